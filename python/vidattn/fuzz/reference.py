"""Plain-PyTorch math of every fuzzed op, run in the dtype of its inputs: in float64 it is the
reference, in the kernel's own dtype the baseline of the accuracy rule (docs/conventions.md).
It ships with the package so that the fuzz runs on any machine with vidattn installed; the
test suite's attention reference (tests/python/attention_reference.py) is this math too."""
from __future__ import annotations

import math

import torch


def attention(q, k, v, allowed, scale, return_lse=False):
    """q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv]; allowed bool broadcastable to
    [B, Hq, Sq, Sk]. A row with no allowed key outputs 0 (differentiable, gradient 0).
    return_lse: also the LSE [B, Hq, Sq] of the scaled logits (detached; -inf for such a row)."""
    g = q.shape[2] // k.shape[2]
    kh = k.repeat_interleave(g, 2)
    vh = v.repeat_interleave(g, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kh) * scale
    allowed = allowed.to(s.device).expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    empty = ~allowed.any(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(empty, 0.0), -1).masked_fill(~allowed, 0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, vh)
    return (out, torch.logsumexp(s.detach(), -1)) if return_lse else out


def dense_allowed(B, Sq, Sk, causal, key_mask, query_mask, device="cpu"):
    allowed = torch.ones(B, 1, Sq, Sk, dtype=torch.bool)
    if causal:
        i = torch.arange(Sq)[:, None]
        j = torch.arange(Sk)[None, :]
        allowed = allowed & (j <= i + Sk - Sq)
    if key_mask is not None:
        allowed = allowed & key_mask[:, None, None, :].cpu()
    if query_mask is not None:
        allowed = allowed & query_mask[:, None, :, None].cpu()
    return allowed.to(device)


def varlen(q, k, v, cu_q, cu_k, causal, scale, return_lse=False):
    """Packed [T, H, D] tensors: each sequence on its own (torch.cat keeps autograd).
    return_lse: also the LSE [Hq, Tq] (as vidattn.attention_varlen gives it)."""
    outs, lses = [], []
    for i in range(len(cu_q) - 1):
        qs, ks, vs = (q[cu_q[i]:cu_q[i + 1]], k[cu_k[i]:cu_k[i + 1]], v[cu_k[i]:cu_k[i + 1]])
        allowed = dense_allowed(1, qs.shape[0], ks.shape[0], causal, None, None).to(q.device)
        o, lse = attention(qs[None], ks[None], vs[None], allowed, scale, return_lse=True)
        outs.append(o[0])
        lses.append(lse[0])
    out = torch.cat(outs, 0) if outs else q.new_zeros(0, q.shape[1], v.shape[2])
    if not return_lse:
        return out
    return out, (torch.cat(lses, 1) if lses else q.new_zeros(q.shape[1], 0))


def block_sparse(q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale):
    """Each query tile over its selected key tiles' valid slots; padded query slots output 0."""
    allowed = block_sparse_allowed(q.shape[0], q.shape[2], idx, cnt, V, q_sizes, kv_sizes)
    return attention(q, k, v, allowed.to(q.device), scale)


def slot_mask(block_sizes, V):
    """Bool [T, V] on the CPU: slot s of tile t holds a token (s < block_sizes[t])."""
    return torch.arange(V)[None, :] < block_sizes.long().cpu()[:, None]


def block_sparse_allowed(B, Hq, idx, cnt, V, q_sizes, kv_sizes):
    """Bool [B, Hq, Sq, Sk]: query slot i sees key slot j."""
    Qt, Kt = len(q_sizes), len(kv_sizes)
    Sq, Sk = Qt * V, Kt * V
    slot = torch.arange(V)
    key_ok = torch.zeros(B, Hq, Qt, Kt, V, dtype=torch.bool)
    for b in range(B):
        for h in range(Hq):
            for t in range(Qt):
                for s in range(int(cnt[b, h, t])):
                    kt = int(idx[b, h, t, s])
                    key_ok[b, h, t, kt] = slot < int(kv_sizes[kt])
    q_ok = slot_mask(q_sizes, V)  # [Qt, V]
    allowed = key_ok.reshape(B, Hq, Qt, 1, Sk) & q_ok[None, None, :, :, None]
    return allowed.reshape(B, Hq, Sq, Sk)


def pool(x, block_sizes, V, acc):
    B, S, H, D = x.shape
    T = S // V
    valid = slot_mask(block_sizes, V).to(x.device)
    xs = x.reshape(B, T, V, H, D).to(acc) * valid[None, :, :, None, None].to(acc)
    sizes = block_sizes.to(x.device, acc).clamp(min=1)
    return (xs.sum(2) / sizes[None, :, None, None]).to(x.dtype)


def vsa(q, k, v, block_sizes, V, idx, cnt, gate, scale):
    """VSA of one video with a given selection."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    q_c, k_c, v_c = (pool(x, block_sizes, V, acc) for x in (q, k, v))
    T = q_c.shape[1]
    o_c = attention(q_c, k_c, v_c, torch.ones(1, 1, T, T, dtype=torch.bool, device=q.device), scale)
    valid = slot_mask(block_sizes, V).reshape(-1)
    o_c = o_c.repeat_interleave(V, 1) * valid.to(q.device, q.dtype)[None, :, None, None]
    o_s = block_sparse(q, k, v, idx, cnt, V, block_sizes, block_sizes, scale)
    return (o_c * gate if gate is not None else o_c) + o_s


def combine(fine, coarse, gate, block_sizes, V):
    valid = slot_mask(block_sizes, V).reshape(-1)
    c = coarse.repeat_interleave(V, 1) * valid.to(fine.device, fine.dtype)[None, :, None, None]
    return fine + (c * gate if gate is not None else c)


def rope(x, cos, sin, interleaved):
    D = x.shape[-1]
    if cos.shape[-1] == D // 2:
        rep = (lambda t: t.repeat_interleave(2, -1)) if interleaved else (
            lambda t: torch.cat([t, t], -1))
        cos, sin = rep(cos), rep(sin)
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        rot = torch.stack([-b, a], -1).flatten(-2)
    else:
        a, b = x[..., : D // 2], x[..., D // 2:]
        rot = torch.cat([-b, a], -1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


def default_scale(q):
    return 1.0 / math.sqrt(q.shape[-1])


@torch.no_grad()
def backward_floors(q, k, v, dout, allowed, scale, out_dtype=None):
    """Floors (dq, dk, dv), scalars, for the float32 roundings a flash-style backward makes and
    the plain autograd baseline does not (docs/conventions.md, accuracy rule):
    1. dS = P * (dP - delta) with delta = rowsum(dO * O) from the stored output: where the
       two nearly cancel (a one-hot row, a single key) float32 leaves about eps32 * |dO| .
       (|V_j| + |O|) of noise, which the baseline, differentiating softmax directly, does not.
    2. P recomputed as exp(S - LSE) from a float32 LSE: a relative error eps32 * |LSE| in
       every probability of the row.
    3. With out_dtype (the kernel's dtype), delta from the output as stored, rounded to that
       dtype: delta moves by rowsum(dO * (round(O) - O)), computed here exactly. Where a row
       is nearly one-hot (large logits) dP - delta is that small too, and the shift is all
       of dS; every flash-style backward (FlashAttention, cuDNN) makes it, the baseline,
       differentiating softmax from P, does not.
    Each is carried through dQ = scale dS K, dK = scale dS^T Q, dV = P^T dO in magnitudes.
    Inputs in float64; allowed broadcastable to [B, Hq, Sq, Sk]."""
    q, k, v, dout = (t.double() for t in (q, k, v, dout))
    if q.numel() == 0 or k.numel() == 0:
        return 0.0, 0.0, 0.0
    g = q.shape[2] // k.shape[2]
    kh, vh = k.repeat_interleave(g, 2), v.repeat_interleave(g, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, kh) * scale
    allowed = allowed.to(s.device).expand_as(s)
    s = s.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(s, -1, keepdim=True)
    p = torch.where(allowed, torch.exp(s - lse.nan_to_num(neginf=0.0)), 0.0)
    out = torch.einsum("bhij,bjhd->bihd", p, vh)
    eps = torch.finfo(torch.float32).eps
    adout = dout.abs()
    a = (torch.einsum("bihd,bjhd->bhij", adout, vh.abs())
         + (adout * out.abs()).sum(-1).transpose(1, 2)[..., None])
    dp = torch.einsum("bihd,bjhd->bhij", dout, vh)
    delta = (dout * out).sum(-1).transpose(1, 2)[..., None]
    w = p * eps * torch.where(torch.isfinite(lse), lse.abs(), 0.0)
    ds = 2 * eps * p * a + w * (dp - delta).abs()
    if out_dtype is not None and out_dtype != torch.float64:
        stored = out.to(out_dtype).double()
        shift = (dout * (stored - out)).sum(-1).abs().transpose(1, 2)[..., None]
        ds = ds + p * shift
    dq = abs(scale) * torch.einsum("bhij,bjhd->bihd", ds, kh.abs())
    dk = (abs(scale) * torch.einsum("bhij,bihd->bjhd", ds, q.abs())).unflatten(2, (-1, g)).sum(3)
    dv = torch.einsum("bhij,bihd->bjhd", w, adout).unflatten(2, (-1, g)).sum(3)
    return tuple(t.max().item() if t.numel() else 0.0 for t in (dq, dk, dv))


def varlen_floors(q, k, v, dout, cu_q, cu_k, causal, scale, out_dtype=None):
    """backward_floors per packed sequence: the largest of each."""
    fl = [backward_floors(q[None, cu_q[i]:cu_q[i + 1]], k[None, cu_k[i]:cu_k[i + 1]],
                          v[None, cu_k[i]:cu_k[i + 1]], dout[None, cu_q[i]:cu_q[i + 1]],
                          dense_allowed(1, cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i], causal,
                                        None, None), scale, out_dtype)
          for i in range(len(cu_q) - 1)]
    return tuple(max((f[j] for f in fl), default=0.0) for j in range(3))


def vsa_floors(q, k, v, dout, block_sizes, V, idx, cnt, gate, scale, out_dtype=None):
    """VSA's gradient floors: the fine branch's (block-sparse) plus the coarse branch's, on
    the pooled tensors with the gradient the coarse output receives (a token's share of a
    pooled gradient is at most the whole of it)."""
    B, Hq = q.shape[0], q.shape[2]
    fine = backward_floors(q, k, v, dout, block_sparse_allowed(
        B, Hq, idx, cnt, V, block_sizes, block_sizes), scale, out_dtype)
    T = len(block_sizes)
    valid = slot_mask(block_sizes, V).reshape(-1)
    d_c = dout * (gate if gate is not None else 1.0) * valid.to(dout.device, dout.dtype)[
        None, :, None, None]
    d_c = d_c.reshape(B, T, V, Hq, -1).sum(2)
    pooled = [pool(x, block_sizes, V, torch.float64) for x in (q, k, v)]
    coarse = backward_floors(*pooled, d_c,
                             torch.ones(1, 1, T, T, dtype=torch.bool, device=q.device), scale,
                             out_dtype)
    return tuple(f + c for f, c in zip(fine, coarse))
