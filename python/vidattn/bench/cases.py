"""What the bench runs: a *case* is one problem (dense attention here; block-sparse in
blocksparse_case.py, the whole VSA op in vsa_case.py) with its implementations: vidattn's and
the peers it is compared against.

A new case subclasses ``Case`` (inputs, FLOPs, float64 reference) and lists its ``Impl``s;
``cases_for`` picks the cases and implementations that exist on a device. An implementation
that is not there (a peer package that does not import, an op without a kernel for the device:
``unavailable_reason``, or ``NotImplementedError`` when called) gives a row marked
``unavailable``; one that cannot run a configuration (``skip_reason``, or a RuntimeError such as
out of memory) gives a row marked ``skipped``. Either way the row is kept with the reason.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional, Sequence

import torch
import torch.nn.functional as F

from . import reference
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


@dataclass(frozen=True)
class DenseInputs(QkvInputs):
    q: torch.Tensor  # [B, Sq, H, D]
    k: torch.Tensor  # [B, Sk, H, D]
    v: torch.Tensor  # [B, Sk, H, D]
    causal: bool
    scale: Optional[float] = None


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


# ---- dense attention -------------------------------------------------------------------

class VidattnDense(Impl):
    name, backend, is_ours = "vidattn", "vidattn.attention", True

    def unavailable_reason(self, device):
        return missing_vidattn_op("attention")

    def forward(self, inputs: DenseInputs) -> torch.Tensor:
        import vidattn  # the bench is part of the package; imported late to keep the cli light

        return vidattn.attention(inputs.q, inputs.k, inputs.v, scale=inputs.scale,
                                 causal=inputs.causal)


class SdpaDense(Impl):
    """PyTorch SDPA on ``[B, H, S, D]`` transposed views (no copies), optionally pinned to one
    backend with ``sdpa_kernel``."""

    _LOW_PRECISION_ONLY = ("FLASH_ATTENTION", "CUDNN_ATTENTION")

    def __init__(self, backend: Optional[str] = None):
        self.sdpa_backend = backend
        self.name = "sdpa" if backend is None else "sdpa-" + {
            "FLASH_ATTENTION": "flash", "CUDNN_ATTENTION": "cudnn",
            "EFFICIENT_ATTENTION": "efficient", "MATH": "math"}[backend]
        self.backend = "torch SDPA " + ("(default dispatch)" if backend is None else backend)

    def skip_reason(self, device, dtype, shape):
        if self.sdpa_backend is not None and device.type != "cuda":
            return f"{self.name}: CUDA only"
        if self.sdpa_backend in self._LOW_PRECISION_ONLY and dtype not in (torch.float16,
                                                                           torch.bfloat16):
            return f"{self.name}: needs fp16/bf16"
        return None

    def forward(self, inputs: DenseInputs) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        kwargs = {"scale": inputs.scale}
        if inputs.causal and q.shape[-2] == k.shape[-2]:
            kwargs["is_causal"] = True
        elif inputs.causal:  # SDPA's is_causal is top-left aligned; vidattn's is bottom-right
            from torch.nn.attention.bias import causal_lower_right

            kwargs["attn_mask"] = causal_lower_right(q.shape[-2], k.shape[-2])
        if self.sdpa_backend is None:
            out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        else:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(getattr(SDPBackend, self.sdpa_backend)):
                out = F.scaled_dot_product_attention(q, k, v, **kwargs)
        return out.transpose(1, 2)


class DenseCase(Case):
    name = "dense"

    def forward_flops(self, shape: Shape) -> float:
        flops = 4.0 * shape.batch * shape.heads * shape.q_len * shape.kv_len * shape.head_dim
        return flops / 2 if shape.causal else flops

    def make_inputs(self, shape, dtype, device, generator, input_scale=1.0) -> DenseInputs:
        def randn(seq):
            t = torch.randn(shape.batch, seq, shape.heads, shape.head_dim, device=device,
                            generator=generator, dtype=torch.float32)
            return (t * input_scale).to(dtype)

        return DenseInputs(randn(shape.q_len), randn(shape.kv_len), randn(shape.kv_len),
                           shape.causal)

    def make_grad_out(self, inputs: DenseInputs, generator) -> torch.Tensor:
        q = inputs.q  # the output has q's shape here (Dv == D)
        return torch.randn(q.shape, device=q.device, generator=generator,
                           dtype=torch.float32).to(q.dtype)

    def reference_forward(self, inputs: DenseInputs, scope: RefScope, kind: str = ""):
        out, _ = reference.attention_forward(
            scope.take(inputs.q), scope.take(inputs.k), scope.take(inputs.v),
            scale=inputs.scale, causal=inputs.causal)
        return (out,)

    def reference_backward(self, inputs: DenseInputs, grad_out, scope: RefScope, kind: str = ""):
        return reference.attention_backward(
            scope.take(inputs.q), scope.take(inputs.k), scope.take(inputs.v),
            scope.take(grad_out), scale=inputs.scale, causal=inputs.causal)


CASE_NAMES = ("dense", "blocksparse", "vsa")


def cases_for(device: torch.device, names: Sequence[str] = CASE_NAMES) -> list[Case]:
    """The cases named, with the implementations that exist on ``device``."""
    from .blocksparse_case import blocksparse_case
    from .vsa_case import vsa_case

    available = {"vsa": vsa_case(device), "blocksparse": blocksparse_case(device)}
    if device.type == "cuda":
        # targets.md measures against cuDNN first; FA2 and the default dispatch for context.
        available["dense"] = DenseCase(
            [VidattnDense(), SdpaDense("CUDNN_ATTENTION"), SdpaDense("FLASH_ATTENTION"),
             SdpaDense()],
            peer_order=("sdpa-cudnn", "sdpa-flash", "sdpa"))
    else:
        available["dense"] = DenseCase([VidattnDense(), SdpaDense()], peer_order=("sdpa",))
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"--cases: unknown case(s) {unknown}; expected some of "
                         f"{sorted(available)}")
    return [available[n] for n in names]


def dtype_of(name: str) -> torch.dtype:
    try:
        return DTYPES[name]
    except KeyError:
        raise ValueError(f"--dtype: {name!r} is not one of {sorted(DTYPES)}") from None

