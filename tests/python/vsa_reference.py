"""Plain-PyTorch reference of VSA (tests only): the same math written with torch ops, run in
float64 for the reference and in the kernel's dtype for "PyTorch's own error"."""
from __future__ import annotations

import torch


def pool(x, tiling, acc_dtype):
    """Per-tile mean of valid slots, summed in acc_dtype, returned in x's dtype."""
    B, S, H, D = x.shape
    V = tiling.tile_volume
    valid = tiling.slot_valid.view(-1, V)  # [Tiles, V]
    xs = x.view(B, -1, V, H, D).to(acc_dtype) * valid[None, :, :, None, None].to(acc_dtype)
    sizes = tiling.block_sizes.to(acc_dtype).clamp(min=1)
    return (xs.sum(2) / sizes[None, :, None, None]).to(x.dtype)


def dense_attention(q, k, v, scale, allowed=None):
    """q [B, Sq, Hq, D] ... allowed: bool [Sq, Sk] (or None); rows with no key output 0."""
    g = q.shape[2] // k.shape[2]
    qh = q.permute(0, 2, 1, 3)
    kh = k.permute(0, 2, 1, 3).repeat_interleave(g, 1)
    vh = v.permute(0, 2, 1, 3).repeat_interleave(g, 1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
        row_ok = allowed.any(-1, keepdim=True)
        s = torch.where(row_ok, s, torch.zeros_like(s))
    p = torch.softmax(s, -1)
    if allowed is not None:
        p = p * row_ok.to(p.dtype)
    return (p @ vh).permute(0, 2, 1, 3)


def block_sparse(q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale):
    """Attention of each query tile over its selected key tiles, valid slots only."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv, Dv = k.shape[1], k.shape[2], v.shape[3]
    Qt, Kt, K = Sq // V, Sk // V, idx.shape[-1]
    g = Hq // Hkv
    qt = q.permute(0, 2, 1, 3).reshape(B, Hq, Qt, V, D)
    kt = k.permute(0, 2, 1, 3).repeat_interleave(g, 1).reshape(B, Hq, Kt, V, D)
    vt = v.permute(0, 2, 1, 3).repeat_interleave(g, 1).reshape(B, Hq, Kt, V, Dv)
    safe = idx.clamp(min=0).long()
    bi = torch.arange(B)[:, None, None, None]
    hi = torch.arange(Hq)[None, :, None, None]
    ks = kt[bi, hi, safe].reshape(B, Hq, Qt, K * V, D)
    vs = vt[bi, hi, safe].reshape(B, Hq, Qt, K * V, Dv)
    slot = torch.arange(V)
    key_ok = (torch.arange(K) < cnt[..., None].long())[..., None] & (
        slot < kv_sizes.long()[safe][..., None])  # [B, Hq, Qt, K, V]
    key_ok = key_ok.reshape(B, Hq, Qt, 1, K * V)
    q_ok = (slot[None, :] < q_sizes.long()[:, None])  # [Qt, V]
    s = (qt @ ks.transpose(-1, -2)) * scale
    s = s.masked_fill(~key_ok, float("-inf"))
    row_ok = key_ok.any(-1, keepdim=True) & q_ok[None, None, :, :, None]
    s = torch.where(row_ok, s, torch.zeros_like(s))
    p = torch.softmax(s, -1) * row_ok.to(s.dtype)
    o = p @ vs  # [B, Hq, Qt, V, Dv]
    return o.reshape(B, Hq, Sq, Dv).permute(0, 2, 1, 3)


def video_sparse(q, k, v, tiling, kv_tiling, idx, cnt, gate, scale):
    """VSA with a given selection, computed in q's dtype (pool sums in float32 or float64)."""
    kv_tiling = kv_tiling or tiling
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    if scale is None:
        scale = q.shape[-1] ** -0.5
    q_c, k_c, v_c = pool(q, tiling, acc), pool(k, kv_tiling, acc), pool(v, kv_tiling, acc)
    allowed = None
    if tiling.packed:  # block-diagonal over videos
        vq = torch.repeat_interleave(torch.arange(len(tiling.grids)),
                                     torch.tensor(tiling.tiles_per_video))
        vk = torch.repeat_interleave(torch.arange(len(kv_tiling.grids)),
                                     torch.tensor(kv_tiling.tiles_per_video))
        allowed = vq[:, None] == vk[None, :]
    o_c = dense_attention(q_c, k_c, v_c, scale, allowed)
    o_c = o_c[:, tiling.slot_tile.long()] * tiling.slot_valid.to(q.dtype)[None, :, None, None]
    o_s = block_sparse(q, k, v, idx, cnt, tiling.tile_volume, tiling.block_sizes,
                       kv_tiling.block_sizes, scale)
    return (o_c * gate if gate is not None else o_c) + o_s


def coarse_scores(q, k, tiling, kv_tiling, scale=None):
    """Float64 coarse scores [B, Hq, Qt, Kt] of the pooled tensors."""
    kv_tiling = kv_tiling or tiling
    q_c = pool(q.double(), tiling, torch.float64)
    k_c = pool(k.double(), kv_tiling, torch.float64)
    g = q.shape[2] // k.shape[2]
    if scale is None:
        scale = q.shape[-1] ** -0.5
    return (q_c.permute(0, 2, 1, 3) @ k_c.permute(0, 2, 3, 1).repeat_interleave(g, 1)) * scale
