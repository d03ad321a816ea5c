"""Plain-PyTorch attention with explicit masks: the float64 reference and the low-precision
baseline of the accuracy rule (docs/conventions.md): kernel error vs the fp64 reference must be at most
2x (3x for dQ) the error of the same math run in the kernel's dtype, plus a small floor.

The math runs in the dtype of its inputs: pass float64 tensors for the reference, and the
kernel's own bf16/fp16 tensors for the baseline (no upcast: matmuls and softmax in the low
dtype, as PyTorch itself would compute attention in that dtype).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch


def visible_keys(batch: int, seqlen_q: int, seqlen_k: int, *, causal: bool,
                 key_padding_mask: Optional[torch.Tensor],
                 query_padding_mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Bool [B, 1, Sq, Sk]: query i sees key j. Causal is bottom-right aligned."""
    vis = torch.ones(batch, 1, seqlen_q, seqlen_k, dtype=torch.bool)
    if causal:
        i = torch.arange(seqlen_q)[:, None]
        j = torch.arange(seqlen_k)[None, :]
        vis = vis & (j <= i + seqlen_k - seqlen_q)
    if key_padding_mask is not None:
        vis = vis & key_padding_mask[:, None, None, :]
    if query_padding_mask is not None:
        vis = vis & query_padding_mask[:, None, :, None]
    return vis


def _probs(q, k, *, scale, causal, key_padding_mask, query_padding_mask):
    """Softmax probabilities [B, Hq, Sq, Sk] (0 where masked) and the LSE [B, Hq, Sq]."""
    batch, seqlen_q, heads_q, head_dim = q.shape
    seqlen_k, heads_kv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(heads_q // heads_kv, dim=2)
    scores = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    vis = visible_keys(batch, seqlen_q, seqlen_k, causal=causal,
                       key_padding_mask=key_padding_mask,
                       query_padding_mask=query_padding_mask)
    scores = scores.masked_fill(~vis, float("-inf"))
    lse = torch.logsumexp(scores.detach(), dim=-1).double()
    # A row with no visible key would be softmax(-inf, ..., -inf) = NaN, also in autograd:
    # give it finite scores, then zero its probabilities (gradient 0 through masked_fill).
    row_empty = ~vis.any(dim=-1, keepdim=True)
    probs = torch.softmax(scores.masked_fill(row_empty, 0.0), dim=-1).masked_fill(~vis, 0.0)
    return probs, lse


def reference_attention(q, k, v, *, scale=None, causal=False, key_padding_mask=None,
                        query_padding_mask=None):
    """out [B, Sq, Hq, Dv] (differentiable) and lse [B, Hq, Sq] (detached, float64)."""
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    probs, lse = _probs(q, k, scale=scale, causal=causal, key_padding_mask=key_padding_mask,
                        query_padding_mask=query_padding_mask)
    v = v.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    return torch.einsum("bhij,bjhd->bihd", probs, v), lse


@torch.no_grad()
def flash_backward_floors(q, k, v, out, grad_out, *, scale=None, causal=False,
                          key_padding_mask=None, query_padding_mask=None):
    """Extra floors (dq, dk, dv) for two float32 roundings every flash-style backward makes
    and eager PyTorch does not; the rule's "small floor for rounding", made explicit.

    1. Cancellation in dS = P * (dP - delta). delta = rowsum(dO * O) comes from the stored
       output, not from dP, so for a (nearly) one-hot softmax row dP - delta is ~0 in exact
       math (dQ, dK ~ 0) while float32 sums leave eps32 * sum_d |dO_d| (|V_jd| + |O_d|) of
       noise. The baseline differentiates softmax directly and cancels exactly there, so 2x
       its error alone would demand a zero. Bound: 2 eps32 x the magnitudes
       scale * (P * A) @ |K| and scale * (P * A)^T @ |Q|, A_ij = |dO_i|.|V_j| + |dO_i|.|O_i|.
    2. Recomputing P = exp(S - LSE) from the float32 LSE: one ulp of LSE is a relative error
       of eps32 * |LSE_i| in every P_ij of row i, which eager softmax (exp(S - max) / sum)
       does not have; with logits around 60 it is comparable to the whole fp32 baseline
       error. Bound: with W = P * eps32 * |LSE_i|, W^T @ |dO| for dV, and
       scale * (W * |dP - delta|) @ |K|, resp. ^T @ |Q|, for dQ, dK.
    Both are float32 effects: negligible next to a bf16 / fp16 baseline's error.
    """
    q, k, v, out, grad_out = (t.double() for t in (q, k, v, out, grad_out))
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    group = q.shape[2] // k.shape[2]
    probs, lse = _probs(q, k, scale=scale, causal=causal, key_padding_mask=key_padding_mask,
                        query_padding_mask=query_padding_mask)
    k = k.repeat_interleave(group, dim=2)
    v = v.repeat_interleave(group, dim=2)
    eps32 = torch.finfo(torch.float32).eps
    abs_dout = grad_out.abs()
    a = (torch.einsum("bihd,bjhd->bhij", abs_dout, v.abs())
         + (abs_dout * out.abs()).sum(-1).transpose(1, 2)[..., None])
    dp = torch.einsum("bihd,bjhd->bhij", grad_out, v)
    delta = (grad_out * out).sum(-1).transpose(1, 2)[..., None]
    w = probs * eps32 * torch.where(torch.isfinite(lse), lse.abs(), 0.0)[..., None]
    ds_mag = 2 * eps32 * probs * a + w * (dp - delta).abs()
    dq_mag = abs(scale) * torch.einsum("bhij,bjhd->bihd", ds_mag, k.abs())
    dk_mag = abs(scale) * torch.einsum("bhij,bihd->bjhd", ds_mag, q.abs())
    dk_mag = dk_mag.unflatten(2, (-1, group)).sum(3)  # dK sums over the heads of its group
    dv_mag = torch.einsum("bhij,bihd->bjhd", w, abs_dout).unflatten(2, (-1, group)).sum(3)
    return tuple(t.max().item() if t.numel() else 0.0 for t in (dq_mag, dk_mag, dv_mag))


def flash_backward_floors_varlen(q, k, v, out, grad_out, cu_seqlens_q, cu_seqlens_k, *,
                                 scale=None, causal=False):
    """flash_backward_floors over packed sequences: the largest per-sequence floors."""
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    floors = [flash_backward_floors(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                                    v[None, ck[i]:ck[i + 1]], out[None, cq[i]:cq[i + 1]],
                                    grad_out[None, cq[i]:cq[i + 1]], scale=scale,
                                    causal=causal)
              for i in range(len(cq) - 1)]
    return tuple(max([f[j] for f in floors], default=0.0) for j in range(3))


def reference_attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, scale=None,
                               causal=False):
    """Packed sequences, one batched reference call each: out [Tq, Hq, Dv], lse [Hq, Tq]."""
    outs, lses = [], []
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for i in range(len(cq) - 1):
        o, l = reference_attention(
            q[cq[i]:cq[i + 1]][None], k[ck[i]:ck[i + 1]][None], v[ck[i]:ck[i + 1]][None],
            scale=q.shape[-1] ** -0.5 if scale is None else scale, causal=causal)
        outs.append(o[0])
        lses.append(l[0])
    out = torch.cat(outs) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(q.shape[1], 0, dtype=torch.float64)
    return out, lse


# ---- the accuracy rule ------------------------------------------------------------------

FP64_TOLERANCE = 1e-10


def ulp_floor(dtype: torch.dtype, ref: torch.Tensor) -> float:
    """The rule's floor: one unit in the last place of `dtype` at the tensor's largest
    magnitude. The kernel rounds each stored value to `dtype` once (at most half an ulp),
    and at tiny sizes (one key, a single visible key) the low-precision baseline can be
    exact, so 2x its error alone would demand a bit-exact kernel. One ulp covers that final
    rounding without hiding a real error (a wrong row or mask is off by O(1))."""
    finite = ref[torch.isfinite(ref)]
    top = finite.abs().max().item() if finite.numel() else 0.0
    if top == 0.0:
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top))


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
