from __future__ import annotations

from typing import Optional

import torch

_ops = torch.ops.vidattn


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    key_padding_mask: Optional[torch.Tensor] = None,
    query_padding_mask: Optional[torch.Tensor] = None,
    deterministic: bool = True,
    return_lse: bool = False,
):
    """Softmax attention over ``[B, S, H, D]`` tensors (any strides, unit stride on D).

    q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` with Hq a multiple of
    Hkv. Returns out ``[B, Sq, Hq, Dv]`` and, with ``return_lse``, the log-sum-exp of the
    scaled scores ``[B, Hq, Sq]`` (float32, natural log; float64 for float64 inputs).

    ``scale`` defaults to 1/sqrt(D). ``causal`` aligns to the bottom-right corner: query i
    sees key j iff j <= i + Sk - Sq. Masks are bool, True marks a valid token: keys
    ``[B, Sk]``, queries ``[B, Sq]`` (padded query rows output 0). A row that sees no key
    outputs 0 with LSE -inf and gets zero gradient. A NaN in an input the row sees reaches
    the row (output NaN, LSE NaN for q or k), as in SDPA; masked values never affect a
    result (docs/conventions.md). All tensor arguments must be on one device (``ValueError``
    otherwise; meta tensors only together with meta tensors).

    ``deterministic`` is the backward's: True gives the same bits on every run; False lets
    the Hopper (sm_90a) backward at D = 128 add dQ in an order that varies (one fused kernel
    instead of two, faster). Elsewhere (D = 64 included, where the two kernels are the faster)
    the backward is deterministic either way.
    """
    out, lse = _ops.attention(
        q, k, v, scale=scale, causal=causal,
        key_padding_mask=key_padding_mask, query_padding_mask=query_padding_mask,
        deterministic=bool(deterministic))
    return (out, lse) if return_lse else out


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    scale: Optional[float] = None,
    causal: bool = False,
    deterministic: bool = True,
    return_lse: bool = False,
    validate_index: bool = True,
):
    """Attention over packed variable-length sequences.

    q ``[Tq, Hq, D]``, k ``[Tk, Hkv, D]``, v ``[Tk, Hkv, Dv]``; sequence i owns rows
    ``cu_seqlens[i]:cu_seqlens[i+1]`` (int32, on the tensors' device). Returns out
    ``[Tq, Hq, Dv]`` and, with ``return_lse``, LSE ``[Hq, Tq]``. Causal alignment is per
    sequence; ``deterministic`` as in :func:`attention`.

    Each ``cu_seqlens`` must start at 0, never decrease, end at its tensor's row count (Tq,
    Tk), and hold no sequence longer than its ``max_seqlen``; otherwise ``ValueError`` naming
    the argument. The CPU checks this on the host. On CUDA the check runs on the device and
    waits for its verdict (one host synchronisation; skipped inside CUDA-graph capture);
    ``validate_index=False`` skips it for offsets known to be valid, as for
    :func:`block_sparse_attention`'s index. Unchecked, bad offsets are clamped to the tensors
    (never an out-of-bounds access) but give wrong results for their sequences.

    All tensor arguments must be on one device (``ValueError`` otherwise).
    """
    out, lse = _ops.attention_varlen(
        q, k, v, cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k),
        scale=scale, causal=causal, deterministic=bool(deterministic),
        validate_index=bool(validate_index))
    return (out, lse) if return_lse else out
