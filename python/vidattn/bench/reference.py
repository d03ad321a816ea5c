"""Float64 reference attention (forward and backward), computed in query chunks.

The reference is the same math as vidattn in float64: ``softmax(q k^T * scale) v`` with
causal aligned to the bottom-right corner (query i sees key j iff j <= i + Sk - Sq); a row
that sees no key outputs 0. It runs on the tensors' device, a block of query rows at a time
so that the score matrix never has to fit whole. Heads and batches are independent, so for
big problems the reference covers a slice of them (``RefScope``) and errors are measured
on that slice only.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from .shapes import Shape

# float64 FLOP budgets for the reference of one row (forward or backward). The CPU one keeps
# the default run short on a 2-core machine; a GPU does float64 at tens of TFLOP/s.
REF_FLOP_BUDGET = {"cpu": 6e10, "cuda": 3e13}
# Elements of one block of scores (float64): 16M = 128 MiB on CPU, 256M = 2 GiB on GPU.
_SCORE_BLOCK_ELEMS = {"cpu": 1 << 24, "cuda": 1 << 28}


@dataclass(frozen=True)
class RefScope:
    """The batches ``[0, batches)`` and heads ``[0, heads)`` the reference covers."""

    batches: int
    heads: int
    total_batches: int
    total_heads: int

    @property
    def is_full(self) -> bool:
        return self.batches == self.total_batches and self.heads == self.total_heads

    @property
    def label(self) -> str:
        if self.is_full:
            return "all"
        return f"b{self.batches}/{self.total_batches} h{self.heads}/{self.total_heads}"

    def to_json(self) -> dict:
        return {"batches": self.batches, "heads": self.heads, "label": self.label}

    def take(self, t: torch.Tensor) -> torch.Tensor:
        """The covered part of a ``[B, S, H, ...]`` tensor."""
        return t[: self.batches, :, : self.heads]

    def take_bh(self, t: torch.Tensor) -> torch.Tensor:
        """The covered part of a ``[B, H, ...]`` tensor."""
        return t[: self.batches, : self.heads]


def choose_scope(shape: Shape, direction: str, device_type: str,
                 max_heads: Optional[int] = None) -> RefScope:
    """All of the problem if its float64 cost fits the budget, else batch 0 and as many heads
    as fit (at least one). ``max_heads`` caps the heads (``--ref-heads``)."""
    per_head = 4.0 * shape.q_len * shape.kv_len * shape.head_dim
    per_head *= 3.5 if direction == "bwd" else 1.0  # forward recompute + backward
    budget = REF_FLOP_BUDGET.get(device_type, REF_FLOP_BUDGET["cpu"])
    heads_cap = shape.heads if max_heads is None else max(1, min(max_heads, shape.heads))
    if heads_cap == shape.heads and per_head * shape.batch * shape.heads <= budget:
        return RefScope(shape.batch, shape.heads, shape.batch, shape.heads)
    heads = int(max(1, min(heads_cap, budget // per_head)))
    return RefScope(1, heads, shape.batch, shape.heads)


def _key_mask(rows: torch.Tensor, q_len: int, kv_len: int, device) -> torch.Tensor:
    """Bottom-right causal mask for the query rows ``rows``: True where the key is visible."""
    keys = torch.arange(kv_len, device=device)
    return keys[None, :] <= (rows[:, None] + (kv_len - q_len))


def _row_chunk(q: torch.Tensor, kv_len: int) -> int:
    """Query rows per block so that the block's scores over all (batch, head) pairs of the
    ``[B, H, Sq, D]`` tensor ``q`` stay within the element budget."""
    batch_heads = q.shape[0] * q.shape[1]
    budget = _SCORE_BLOCK_ELEMS.get(q.device.type, 1 << 24)
    return max(1, min(q.shape[-2], budget // max(kv_len * batch_heads, 1)))


def _probabilities(q_blk, k, scale, causal, rows, q_len, lse=None):
    """Scores of one query block and their softmax; with ``lse`` given, reuse it."""
    s = torch.matmul(q_blk, k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(~_key_mask(rows, q_len, k.shape[-2], s.device), float("-inf"))
    if lse is None:
        lse = torch.logsumexp(s, dim=-1)
    # Rows that see no key have lse = -inf; give them probability 0, not exp(nan).
    p = torch.exp(s - lse.unsqueeze(-1).clamp_min(torch.finfo(s.dtype).min))
    return p, lse


def _to_bhsd64(t: torch.Tensor) -> torch.Tensor:
    return t.transpose(1, 2).to(torch.float64)


def attention_forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
                      scale: Optional[float] = None, causal: bool = False):
    """float64 ``(out [B, Sq, H, Dv], lse [B, H, Sq])`` for ``[B, S, H, D]`` inputs."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    q64, k64, v64 = _to_bhsd64(q), _to_bhsd64(k), _to_bhsd64(v)
    q_len = q64.shape[-2]
    out = torch.empty(*q64.shape[:-1], v64.shape[-1], dtype=torch.float64, device=q.device)
    lse = torch.empty(q64.shape[:-1], dtype=torch.float64, device=q.device)
    chunk = _row_chunk(q64, k64.shape[-2])
    for start in range(0, q_len, chunk):
        stop = min(start + chunk, q_len)
        rows = torch.arange(start, stop, device=q.device)
        p, lse_blk = _probabilities(q64[..., start:stop, :], k64, scale, causal, rows, q_len)
        out[..., start:stop, :] = torch.matmul(p, v64)
        lse[..., start:stop] = lse_blk
    return out.transpose(1, 2), lse


def attention_backward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       grad_out: torch.Tensor, *, scale: Optional[float] = None,
                       causal: bool = False):
    """float64 ``(dq, dk, dv)`` in ``[B, S, H, D]`` layout for ``[B, S, H, D]`` inputs."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    out, lse = attention_forward(q, k, v, scale=scale, causal=causal)
    q64, k64, v64 = _to_bhsd64(q), _to_bhsd64(k), _to_bhsd64(v)
    do64, o64 = _to_bhsd64(grad_out), out.transpose(1, 2)
    q_len = q64.shape[-2]
    dq, dk, dv = torch.empty_like(q64), torch.zeros_like(k64), torch.zeros_like(v64)
    chunk = _row_chunk(q64, k64.shape[-2])
    for start in range(0, q_len, chunk):
        stop = min(start + chunk, q_len)
        rows = torch.arange(start, stop, device=q.device)
        q_blk, do_blk = q64[..., start:stop, :], do64[..., start:stop, :]
        p, _ = _probabilities(q_blk, k64, scale, causal, rows, q_len, lse[..., start:stop])
        dv += torch.matmul(p.transpose(-1, -2), do_blk)
        dp = torch.matmul(do_blk, v64.transpose(-1, -2))
        delta = (do_blk * o64[..., start:stop, :]).sum(-1, keepdim=True)
        ds = p * (dp - delta)
        dq[..., start:stop, :] = torch.matmul(ds, k64) * scale
        dk += torch.matmul(ds.transpose(-1, -2), q_blk) * scale
    return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def max_abs_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """max |actual - expected| in float64; inf if the result holds NaN or inf."""
    diff = (actual.to(torch.float64) - expected).abs()
    if diff.numel() == 0:
        return 0.0
    if not torch.isfinite(diff).all():
        return float("inf")
    return float(diff.max())
