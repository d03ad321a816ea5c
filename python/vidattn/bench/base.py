"""The parts every benchmark case is made of: a *case* is one problem with its
implementations, vidattn's and the peers it is compared against. The cases themselves live in
dense_case.py, blocksparse_case.py and vsa_case.py, which import this module and nothing of
each other's registry; cases.py puts them together (``cases_for``).

A new case subclasses ``Case`` (inputs, FLOPs, float64 reference) and lists its ``Impl``s. An
implementation that is not there (a peer package that does not import, an op without a kernel
for the device: ``unavailable_reason``, or ``NotImplementedError`` when called) gives a row
marked ``unavailable``; one that cannot run a configuration (``skip_reason``, or a RuntimeError
such as out of memory) gives a row marked ``skipped``. Either way the row is kept with the
reason.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Optional, Sequence

import torch

from .reference import RefScope
from .shapes import Shape

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "fp64": torch.float64}


class QkvInputs:
    """What every case's inputs (a frozen dataclass with fields q, k, v) share: q, k, v are
    the differentiable tensors."""

    def differentiable(self) -> tuple[torch.Tensor, ...]:
        return self.q, self.k, self.v

    def requiring_grad(self):
        """Fresh leaves with ``requires_grad``, so every implementation gets its own graph."""
        return replace(self, q=self.q.detach().requires_grad_(),
                       k=self.k.detach().requires_grad_(), v=self.v.detach().requires_grad_())


class QkvLayoutInputs(QkvInputs):
    """Inputs that peers may take in another memory layout (see ``to_layout``)."""

    def in_layout(self, layout: str):
        return replace(self, q=to_layout(self.q, layout), k=to_layout(self.k, layout),
                       v=to_layout(self.v, layout))



def to_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """A ``[B, S, H, D]`` tensor with the same values whose memory is laid out as ``layout``:
    ``bshd`` (as given) or ``bhsd`` (a ``[B, H, S, D]``-contiguous copy, seen through a
    transposed view), so that a peer taking ``[B, H, S, D]`` gets contiguous tensors by a
    transpose, without a copy inside the timed call."""
    if layout == "bshd":
        return t
    if layout == "bhsd":
        return t.transpose(1, 2).contiguous().transpose(1, 2)
    raise ValueError(f"unknown layout {layout!r}; expected bshd or bhsd")


class Impl:
    """One implementation of a case. ``forward`` returns the output ``[B, Sq, H, Dv]``."""

    name = ""
    backend = ""  # what actually runs, for the JSON
    is_ours = False
    reference_kind = ""  # which of its case's float64 references this computes ("": the one)
    layout = "bshd"  # memory layout of the q, k, v (and grad_out) it is handed; see to_layout

    def unavailable_reason(self, device: torch.device) -> Optional[str]:
        """Why this implementation is not there at all (package missing, op not built)."""
        return None

    def skip_reason(self, device: torch.device, dtype: torch.dtype, shape: Shape) -> Optional[str]:
        return None

    def forward(self, inputs) -> torch.Tensor:
        raise NotImplementedError

    def to_common(self, result: torch.Tensor, inputs) -> torch.Tensor:
        """A forward output as the reference has it (outside the timed call); most are already."""
        return result


def missing_vidattn_op(name: str) -> Optional[str]:
    """A reason when ``torch.ops.vidattn.<name>`` is not registered (op library not loaded)."""
    try:
        getattr(torch.ops.vidattn, name)
    except (AttributeError, RuntimeError):
        return f"torch.ops.vidattn.{name} is not registered (op library not built or loaded)"
    return None


class Case:
    """A problem and its implementations; ``peer_order`` names the peers vidattn's ratio is
    taken against, the first one that ran wins."""

    name = ""
    impls: Sequence[Impl] = ()
    peer_order: Sequence[str] = ()
    directions: Sequence[str] = ("fwd", "bwd")  # the directions this case can check

    def __init__(self, impls: Sequence[Impl], peer_order: Sequence[str]):
        self.impls = tuple(impls)
        self.peer_order = tuple(peer_order)

    def accepts(self, shape: Shape) -> bool:
        """Whether ``shape`` is a problem of this case (dense, block-sparse or video grid)."""
        return shape.kind == self.name

    def forward_flops(self, shape: Shape) -> float:
        raise NotImplementedError

    def make_inputs(self, shape: Shape, dtype: torch.dtype, device: torch.device,
                    generator: torch.Generator, input_scale: float):
        raise NotImplementedError

    def make_grad_out(self, inputs, generator: torch.Generator) -> torch.Tensor:
        """A random gradient for the output (never zeros)."""
        raise NotImplementedError

    def reference_forward(self, inputs, scope: RefScope,
                          kind: str = "") -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def reference_backward(self, inputs, grad_out: torch.Tensor, scope: RefScope,
                           kind: str = "") -> tuple[torch.Tensor, ...]:
        raise NotImplementedError

    def common_grads(self, grads, inputs) -> tuple[torch.Tensor, ...]:
        """Gradients as they are compared with the reference (outside the timed call)."""
        return tuple(grads)

    output_names = ("out",)
    grad_names: tuple[str, ...] = ("dq", "dk", "dv")  # every case differentiates q, k, v


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype: {name!r} is not one of {sorted(DTYPES)}") from None
