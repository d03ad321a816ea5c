"""The float64 reference and the low-precision baseline of the accuracy rule
(docs/conventions.md): kernel error vs the fp64 reference must be at most 2x (3x for dQ) the
error of the same math run in the kernel's dtype, plus a small floor.

The math is the package's own (vidattn.fuzz.reference, which the fuzz runs too); here it takes
vidattn.attention's keywords. It runs in the dtype of its inputs: pass float64 tensors for the
reference, and the kernel's own bf16/fp16 tensors for the baseline (no upcast: matmuls and
softmax in the low dtype, as PyTorch itself would compute attention in that dtype). Below it:
the rule's checks and the tests' inputs.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from vidattn.fuzz import reference as shipped
from vidattn.fuzz.configs import ulp_floor


def _scale(q, scale):
    return shipped.default_scale(q) if scale is None else scale


def reference_attention(q, k, v, *, scale=None, causal=False, key_padding_mask=None,
                        query_padding_mask=None):
    """out [B, Sq, Hq, Dv] (differentiable) and lse [B, Hq, Sq] (detached), with the masks of
    vidattn.attention (causal bottom-right aligned)."""
    allowed = shipped.dense_allowed(q.shape[0], q.shape[1], k.shape[1], causal,
                                    key_padding_mask, query_padding_mask)
    return shipped.attention(q, k, v, allowed, _scale(q, scale), return_lse=True)


def reference_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None,
                               causal=False):
    """Packed sequences, each on its own: out [Tq, Hq, Dv], lse [Hq, Tq]."""
    return shipped.varlen(q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), causal,
                          _scale(q, scale), return_lse=True)


def flash_backward_floors(q, k, v, grad_out, *, scale=None, causal=False,
                          key_padding_mask=None, query_padding_mask=None):
    """Extra floors (dq, dk, dv) for the roundings every flash-style backward makes and eager
    PyTorch does not (vidattn.fuzz.reference.backward_floors says which; the output is
    stored in q's dtype); the rule's "small floor for rounding", made explicit."""
    allowed = shipped.dense_allowed(q.shape[0], q.shape[1], k.shape[1], causal,
                                    key_padding_mask, query_padding_mask)
    return shipped.backward_floors(q, k, v, grad_out, allowed, _scale(q, scale), q.dtype)


def flash_backward_floors_varlen(q, k, v, grad_out, cu_seqlens_q, cu_seqlens_k, *,
                                 scale=None, causal=False):
    """flash_backward_floors over packed sequences: the largest per-sequence floors."""
    return shipped.varlen_floors(q, k, v, grad_out, cu_seqlens_q.tolist(),
                                 cu_seqlens_k.tolist(), causal, _scale(q, scale), q.dtype)


# ---- the accuracy rule ------------------------------------------------------------------

FP64_TOLERANCE = 1e-10


def max_abs_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    if x.numel() == 0:
        return 0.0
    return (x.double() - ref.double()).abs().max().item()


def assert_no_nan(name: str, x: torch.Tensor):
    assert not torch.isnan(x).any(), f"{name}: NaN in output"


def assert_within_rule(name: str, kernel: torch.Tensor, ref: torch.Tensor,
                       baseline: Optional[torch.Tensor], dtype: torch.dtype,
                       factor: float = 2.0, extra_floor: float = 0.0):
    """kernel vs the fp64 reference: 1e-10 for float64, else factor x baseline error + floor.
    -inf entries (LSE of rows with no visible key) must match exactly."""
    assert kernel.shape == ref.shape, f"{name}: shape {tuple(kernel.shape)} != {tuple(ref.shape)}"
    assert_no_nan(name, kernel)
    ref_inf = torch.isinf(ref)
    assert torch.equal(torch.isinf(kernel), ref_inf), f"{name}: -inf entries differ"
    if ref_inf.any():
        assert torch.equal(kernel[ref_inf].double(), ref[ref_inf]), f"{name}: inf sign differs"
        keep = ~ref_inf
        kernel, ref = kernel[keep], ref[keep]
        baseline = None if baseline is None else baseline[keep]
    err = max_abs_error(kernel, ref)
    if dtype == torch.float64:
        # 1e-10 at unit magnitude. Gradients at input scale 16 reach the hundreds, where
        # float64's own rounding of the ~600-sized logits is already ~1e-13 relative, so the
        # bound scales with the tensor's largest magnitude once that passes 1.
        bound = FP64_TOLERANCE * max(1.0, ref.abs().max().item() if ref.numel() else 0.0)
        assert err <= bound, f"{name}: float64 error {err:.3e} > {bound:.3e}"
        return
    base = max_abs_error(baseline, ref)
    # An overflowing baseline (inf) would make the bound vacuous.
    assert math.isfinite(base), f"{name}: the low-precision baseline is not finite"
    floor = ulp_floor(dtype, ref) + extra_floor
    bound = factor * base + floor
    assert err <= bound, (f"{name}: error {err:.3e} > {factor:g} x baseline {base:.3e} "
                          f"+ floor {floor:.3e}")


# ---- inputs ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    """One batched accuracy case."""
    dtype: torch.dtype
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads_q: int
    heads_kv: int
    head_dim: int
    head_dim_v: int
    causal: bool
    key_mask: bool
    query_mask: bool
    input_scale: float

    def __str__(self):
        name = str(self.dtype).replace("torch.", "")
        return (f"{name}-B{self.batch}-Sq{self.seqlen_q}-Sk{self.seqlen_k}-H{self.heads_q}"
                f"x{self.heads_kv}-D{self.head_dim}-Dv{self.head_dim_v}"
                f"{'-causal' if self.causal else ''}{'-kmask' if self.key_mask else ''}"
                f"{'-qmask' if self.query_mask else ''}-x{self.input_scale:g}")


def randn(shape: Sequence[int], gen: torch.Generator, dtype: torch.dtype,
          scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)


def random_mask(batch: int, length: int, gen: torch.Generator,
                fully_padded: Optional[int] = None) -> torch.Tensor:
    """Bool [batch, length], about 70% valid; with B > 1, sequence `fully_padded` has no
    valid token at all (its rows must come out as zeros with LSE -inf)."""
    mask = torch.rand(batch, length, generator=gen) < 0.7
    if batch > 1 and fully_padded is not None:
        mask[fully_padded] = False
    return mask
