"""CUDA block-sparse attention (VSA's fine branch) against the float64 reference.

Skipped without a GPU. The index, block sizes and inputs are drawn on the CPU with seeded
generators; the reference is vsa_reference.block_sparse on the CPU, in float64 and in the
kernel's dtype (PyTorch's own error), with the 2x rule of test_vsa.assert_2x (3x for dQ).
"""
from __future__ import annotations

import itertools
import os
import subprocess
import sys
import zlib

import pytest
import torch

import vidattn
from cuda_poison import poison_allocator
import vsa_reference as ref
from test_vsa import assert_2x, random_index

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

ops = torch.ops.vidattn
DEV = "cuda"


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, seed, dtype, scale=1.0):
    return (torch.randn(shape, generator=gen(seed), dtype=torch.float64) * scale).to(dtype)


def reference_lse(q, k, idx, cnt, V, q_sizes, kv_sizes, scale):
    """Natural-log LSE [B, Hq, Sq] of the block-sparse logits in q's dtype (accumulated in
    float32 / float64 like the kernels); -inf where a row sees no key or is padding."""
    B, Sq, Hq, D = q.shape
    Hkv, Qt, Kt, K = k.shape[2], Sq // V, k.shape[1] // V, idx.shape[-1]
    g = Hq // Hkv
    qt = q.permute(0, 2, 1, 3).reshape(B, Hq, Qt, V, D)
    kt = k.permute(0, 2, 1, 3).repeat_interleave(g, 1).reshape(B, Hq, Kt, V, D)
    safe = idx.clamp(min=0).long()
    ks = kt[torch.arange(B)[:, None, None, None], torch.arange(Hq)[None, :, None, None], safe]
    ks = ks.reshape(B, Hq, Qt, K * V, D)
    slot = torch.arange(V)
    key_ok = ((torch.arange(K) < cnt[..., None].long())[..., None]
              & (slot < kv_sizes.long()[safe][..., None])).reshape(B, Hq, Qt, 1, K * V)
    q_ok = (slot[None, :] < q_sizes.long()[:, None])[None, None, :, :]
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = ((qt @ ks.transpose(-1, -2)) * scale).to(acc).masked_fill(~key_ok, float("-inf"))
    lse = torch.logsumexp(s, -1)
    lse = lse.masked_fill(~q_ok | ~key_ok.any(-1), float("-inf"))
    return lse.reshape(B, Hq, Sq)


def assert_follows_rule(out, lse, q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale, dtype,
                        dout=None, grads=None):
    """The output and LSE of a block-sparse call, and with dout the gradients `grads` (dq, dk,
    dv of dout; 3x for dQ), against the float64 reference by the rule; LSE: the reference's
    -inf rows (no key) exactly, the rule on the others. Returns those rows, [B, Sq, Hq]."""
    def run_ref(dt):
        x = [t.to(dt).detach().requires_grad_(dout is not None) for t in (q, k, v)]
        o = ref.block_sparse(*x, idx, cnt, V, q_sizes, kv_sizes, scale)
        return (o,) if dout is None else (o, *torch.autograd.grad(o, x, dout.to(dt)))

    got = (out,) if dout is None else (out, *grads)
    for name, g, a, b, f in zip(("out", "dq", "dk", "dv"), got, run_ref(torch.float64),
                                run_ref(dtype), (2, 3, 2, 2)):
        assert g.shape == a.shape, name
        assert_2x(name, g.detach().cpu(), a.detach(), b.detach(), dtype, f)
    l64 = reference_lse(q.double(), k.double(), idx, cnt, V, q_sizes, kv_sizes, scale)
    llp = reference_lse(q, k, idx, cnt, V, q_sizes, kv_sizes, scale)
    dead = torch.isneginf(l64)
    assert torch.equal(torch.isneginf(lse.cpu()), dead), "LSE: -inf rows differ from the reference"
    assert_2x("lse", lse.cpu()[~dead], l64[~dead], llp[~dead], dtype)
    return dead.permute(0, 2, 1)


def make_case(dtype, V, B, Hq, Hkv, D, Qt, Kt, max_k, input_scale, seed):
    q = randn((B, Qt * V, Hq, D), seed, dtype, input_scale)
    k = randn((B, Kt * V, Hkv, D), seed + 1, dtype, input_scale)
    v = randn((B, Kt * V, Hkv, D), seed + 2, dtype)
    idx, cnt = random_index(B, Hq, Qt, Kt, max_k, seed)
    g = gen(seed + 3)
    q_sizes = torch.randint(0, V + 1, (Qt,), generator=g, dtype=torch.int32)
    kv_sizes = torch.randint(0, V + 1, (Kt,), generator=g, dtype=torch.int32)
    # A full and a 1-token query tile; a zero-size, a full and a (tile - 1)-token key tile.
    q_sizes[0] = V
    if Qt > 1:
        q_sizes[1] = 1
    kv_sizes[0] = 0
    if Kt > 2:
        kv_sizes[1], kv_sizes[2] = V, V - 1
    cnt[0, 0, -1] = 0  # a query tile that selected nothing
    idx[0, 0, -1] = -1
    return q, k, v, idx, cnt, q_sizes, kv_sizes


CASES = [  # dtype, V, B, Hq, Hkv, D, Qt, Kt, MaxK, input scale
    (torch.bfloat16, 64, 2, 3, 1, 64, 5, 7, 3, 1.0),
    (torch.float16, 64, 1, 4, 2, 128, 6, 5, 5, 16.0),
    (torch.float16, 128, 2, 3, 3, 128, 4, 6, 3, 4.0),
    (torch.bfloat16, 128, 2, 3, 3, 64, 3, 3, 3, 16.0),
    (torch.bfloat16, 256, 1, 2, 1, 128, 3, 4, 2, 16.0),
    (torch.float16, 256, 2, 3, 3, 64, 2, 3, 3, 1.0),
    (torch.bfloat16, 64, 2, 3, 3, 128, 3, 4, 4, 4.0),
    (torch.float16, 128, 1, 6, 2, 64, 2, 5, 5, 1.0),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "{}_V{}_B{}_H{}x{}_D{}_Qt{}_Kt{}_K{}_s{}".format(
    str(c[0])[6:], *c[1:]))
def test_block_sparse_cuda_matches_float64_reference(case, deterministic=True):
    """deterministic (not a fixture: it has a default) is the backward's option."""
    dtype, V, B, Hq, Hkv, D, Qt, Kt, max_k, input_scale = case
    seed = zlib.crc32(repr(case).encode()) % 100_000
    q, k, v, idx, cnt, q_sizes, kv_sizes = make_case(dtype, V, B, Hq, Hkv, D, Qt, Kt, max_k,
                                                    input_scale, seed)
    scale = D ** -0.5
    qc, kc, vc = (x.to(DEV).requires_grad_() for x in (q, k, v))
    kw = dict(tile_volume=V, q_block_sizes=q_sizes.to(DEV), kv_block_sizes=kv_sizes.to(DEV),
              deterministic=deterministic)
    poison_allocator(q.numel() * 8 + (1 << 20))
    out, lse = vidattn.block_sparse_attention(qc, kc, vc, idx.to(DEV), cnt.to(DEV), return_lse=True,
                                              **kw)
    assert out.shape == (B, Qt * V, Hq, D) and out.dtype == dtype and lse.dtype == torch.float32
    dout = randn(out.shape, seed + 4, dtype)
    poison_allocator(q.numel() * 8 + (1 << 20))
    grads = torch.autograd.grad(out, (qc, kc, vc), dout.to(DEV))
    dead_rows = assert_follows_rule(out, lse, q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale,
                                    dtype, dout, grads)
    # Dead rows (padding, count 0, only empty key tiles): zero output and zero dQ.
    assert (out.detach().cpu()[dead_rows] == 0).all()
    assert (grads[0].cpu()[dead_rows] == 0).all()
    # Key tiles nobody selected (or of size 0) and padded key slots: exactly zero dK, dV.
    group = Hq // Hkv
    slot_ok = (torch.arange(V)[None, :] < kv_sizes[:, None].long()).reshape(-1)
    for x in grads[1:]:
        assert (x.cpu()[:, ~slot_ok] == 0).all()
    for b, hk, j in itertools.product(range(B), range(Hkv), range(Kt)):
        heads = slice(hk * group, (hk + 1) * group)
        used = ((idx[b, heads] == j) & (torch.arange(max_k) < cnt[b, heads, :, None])).any()
        if not used:
            assert (grads[1][b, j * V:(j + 1) * V, hk] == 0).all()
            assert (grads[2][b, j * V:(j + 1) * V, hk] == 0).all()


@pytest.mark.parametrize("V,D", [(64, 128), (64, 64), (128, 128)])
def test_some_warps_redo_their_blocks(V, D):
    """Query rows of three magnitudes, 16 rows (one warp's share of a warpgroup) each, against
    key tiles whose norms grow along the sequence, long lists: in each warpgroup the warps of
    large rows climb past their base's slack and redo blocks from their max, while the warps
    beside them keep the exponentials taken against the base they had
    (OnlineSoftmax::speculate). Forward and LSE against the float64 reference, the rule."""
    dtype, B, H, Qt, Kt, max_k = torch.bfloat16, 1, 2, 5, 30, 24
    seed = 4242 + V + D
    rows = torch.arange(Qt * V)
    row_scale = torch.tensor([0.05, 1.0, 6.0], dtype=torch.float64)[rows // 16 % 3]
    q = (randn((B, Qt * V, H, D), seed, torch.float64) * row_scale.view(1, -1, 1, 1)).to(dtype)
    ramp = torch.linspace(0.25, 6.0, Kt * V, dtype=torch.float64).view(1, -1, 1, 1)
    k = (randn((B, Kt * V, H, D), seed + 1, torch.float64) * ramp).to(dtype)
    v = randn((B, Kt * V, H, D), seed + 2, dtype)
    idx, cnt = random_index(B, H, Qt, Kt, max_k, seed, allow_empty=False)
    q_sizes = torch.full((Qt,), V, dtype=torch.int32)
    kv_sizes = torch.full((Kt,), V, dtype=torch.int32)
    scale = D ** -0.5
    poison_allocator(q.numel() * 8 + (1 << 20))
    out, lse = vidattn.block_sparse_attention(q.to(DEV), k.to(DEV), v.to(DEV), idx.to(DEV),
                                              cnt.to(DEV), tile_volume=V, return_lse=True)
    assert_follows_rule(out, lse, q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale, dtype)


def test_padding_content_is_never_read():
    V, Qt, Kt, H = 128, 3, 4, 2
    q, k, v, idx, cnt, qs, ks = make_case(torch.bfloat16, V, 1, H, H, 64, Qt, Kt, 3, 1.0, 77)
    kw = dict(tile_volume=V, q_block_sizes=qs.to(DEV), kv_block_sizes=ks.to(DEV))
    args = [x.to(DEV).requires_grad_() for x in (q, k, v)]
    clean = vidattn.block_sparse_attention(*args, idx.to(DEV), cnt.to(DEV), **kw)
    dout = torch.randn(clean.shape, generator=gen(78)).to(clean.dtype).to(DEV)
    gclean = torch.autograd.grad(clean, args, dout)
    q_pad = (torch.arange(V)[None, :] >= qs[:, None].long()).reshape(-1)
    k_pad = (torch.arange(V)[None, :] >= ks[:, None].long()).reshape(-1)
    poisoned = [x.detach().clone() for x in args]
    poisoned[0][:, q_pad.to(DEV)] = float("nan")
    # Padded key slots are never attended, but on the Hopper forward their V rows meet an
    # exact-zero probability in the P V product, so the contract (vsa.h) asks for finite
    # values there: large finite garbage must change nothing.
    for x in poisoned[1:]:
        x[:, k_pad.to(DEV)] = 3.0e4
    poisoned = [x.requires_grad_() for x in poisoned]
    dirty = vidattn.block_sparse_attention(*poisoned, idx.to(DEV), cnt.to(DEV), **kw)
    dout_dirty = dout.clone()
    dout_dirty[:, q_pad.to(DEV)] = float("nan")  # gradients of padded outputs are never read
    gdirty = torch.autograd.grad(dirty, poisoned, dout_dirty)
    assert torch.equal(clean, dirty)
    for a, b in zip(gclean, gdirty):
        assert torch.equal(a, b)


def _key_tile_lengths(V):
    """Every length 0..V for 64-token tiles; for larger tiles those around the 16-row pieces,
    the 64 / 128-row loads and the tile's end."""
    if V == 64:
        return torch.arange(V + 1, dtype=torch.int32).flip(0)  # 64, 63, ..., 0
    picks = {0, 1, 15, 16, 17, 48, 63, 64, 65, 112, 127, 128, V - 1, V}
    if V == 256:
        picks |= {129, 144, 200, 240, 255}
    return torch.tensor(sorted((x for x in picks if x <= V), reverse=True), dtype=torch.int32)


@pytest.mark.parametrize("dtype,D,V", [(torch.bfloat16, 128, 64), (torch.float16, 64, 64),
                                       (torch.bfloat16, 128, 128), (torch.float16, 64, 256)])
def test_every_key_tile_length_matches_float64_reference(dtype, D, V):
    """Key tiles of every length (64-token tiles; around the 16-row piece boundaries for
    larger tiles), lists of odd and even counts, GQA, K and V as strided views of one packed
    tensor, padded slots holding large finite garbage. The 64-token Hopper kernel loads a key
    tile only up to its valid keys (in 16-row pieces; the slot's other rows keep an earlier
    tile's data) and nothing for an odd list's repeated last tile; the larger tiles' kernel
    loads whole tiles (the prefix loads were measured slower there)."""
    B, Hq, Hkv = 2, 4, 2
    Qt = 5 if V == 64 else 3
    kv_sizes = _key_tile_lengths(V)
    Kt = kv_sizes.numel()
    seed = 4242 + D + V
    q = randn((B, Qt * V, Hq, D), seed, dtype, 2.0)
    kv = randn((B, Kt * V, 2, Hkv, D), seed + 1, dtype, 2.0)
    pad = (torch.arange(V)[None, :] >= kv_sizes[:, None].long()).reshape(-1)
    kv[:, pad] = 3.0e4
    k, v = kv[:, :, 0], kv[:, :, 1]
    q_sizes = torch.full((Qt,), V, dtype=torch.int32)
    q_sizes[-1] = 17
    g = gen(seed + 2)
    idx = torch.full((B, Hq, Qt, Kt), -1, dtype=torch.int32)
    cnt = torch.zeros((B, Hq, Qt), dtype=torch.int32)
    for b, h, t in itertools.product(range(B), range(Hq), range(Qt)):
        # Every tile, or a random subset of odd or even size.
        n = Kt if t == 0 else int(torch.randint(1, Kt + 1, (1,), generator=g))
        idx[b, h, t, :n] = torch.randperm(Kt, generator=g)[:n].sort().values.to(torch.int32)
        cnt[b, h, t] = n
    scale = D ** -0.5
    kvc = kv.to(DEV)
    poison_allocator(q.numel() * 8 + (1 << 20))
    out, lse = vidattn.block_sparse_attention(
        q.to(DEV), kvc[:, :, 0], kvc[:, :, 1], idx.to(DEV), cnt.to(DEV), tile_volume=V,
        q_block_sizes=q_sizes.to(DEV), kv_block_sizes=kv_sizes.to(DEV), return_lse=True)
    assert_follows_rule(out, lse, q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale, dtype)


def test_backward_is_bit_identical_over_50_runs():
    V, B, Hq, Hkv, D, Qt, Kt = 64, 1, 4, 2, 128, 8, 8
    q, k, v, idx, cnt, qs, ks = make_case(torch.bfloat16, V, B, Hq, Hkv, D, Qt, Kt, 5, 4.0, 90)
    args = [x.to(DEV).requires_grad_() for x in (q, k, v)]
    out = vidattn.block_sparse_attention(*args, idx.to(DEV), cnt.to(DEV), tile_volume=V,
                                         q_block_sizes=qs.to(DEV), kv_block_sizes=ks.to(DEV))
    dout = randn(out.shape, 91, torch.bfloat16).to(DEV)
    first = torch.autograd.grad(out, args, dout, retain_graph=True)
    for _ in range(49):
        again = torch.autograd.grad(out, args, dout, retain_graph=True)
        for a, b in zip(first, again):
            assert torch.equal(a, b)


@pytest.mark.parametrize("B,H,Qt,Kt,K", [(2, 3, 9, 7, 4), (1, 2, 40, 13000, 3), (1, 1, 5, 0, 0)])
def test_transpose_index_equals_cpu(B, H, Qt, Kt, K):
    # Kt = 13000 keeps the cursors in global memory (too many for shared memory).
    idx, cnt = random_index(B, H, Qt, Kt, K, 30 + Kt) if Kt else (
        torch.full((B, H, Qt, 0), -1, dtype=torch.int32), torch.zeros((B, H, Qt), dtype=torch.int32))
    off_cpu, k2q_cpu = ops.block_sparse_transpose_index(idx, cnt, Kt)
    poison_allocator(1 << 20)
    off, k2q = ops.block_sparse_transpose_index(idx.to(DEV), cnt.to(DEV), Kt)
    assert torch.equal(off.cpu(), off_cpu) and torch.equal(k2q.cpu(), k2q_cpu)


def test_many_query_tiles_with_rotated_walks_match_float64_reference():
    """The Hopper 64-token kernel starts each query tile's walk part of the way along its list
    (StreamItems::first_block: (item mod the device's streams) / streams), so in a launch with
    more tiles than the device has streams most tiles visit their key blocks in rotated
    order, odd lists and partial key tiles included. Forward and LSE against the reference."""
    dtype, V, B, Hq, Hkv, D, Qt, Kt, max_k = torch.bfloat16, 64, 1, 4, 2, 128, 160, 48, 17
    q, k, v, idx, cnt, q_sizes, kv_sizes = make_case(dtype, V, B, Hq, Hkv, D, Qt, Kt, max_k,
                                                    4.0, 150)
    scale = D ** -0.5
    poison_allocator(q.numel() * 8 + (1 << 20))
    out, lse = vidattn.block_sparse_attention(
        q.to(DEV), k.to(DEV), v.to(DEV), idx.to(DEV), cnt.to(DEV), tile_volume=V,
        q_block_sizes=q_sizes.to(DEV), kv_block_sizes=kv_sizes.to(DEV), return_lse=True)
    assert_follows_rule(out, lse, q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale, dtype)


@pytest.mark.parametrize("V", [64, 128])
def test_cuda_graph_replay_equals_eager(V):
    # The Hopper kernels' tile counter is allocated, zeroed and freed inside the graph.
    B, Hq, Hkv, D, Qt, Kt = 2, 3, 3, 64, 3, 4
    q, k, v, idx, cnt, qs, ks = make_case(torch.float16, V, B, Hq, Hkv, D, Qt, Kt, 3, 4.0, 120)
    static = [x.to(DEV).requires_grad_() for x in (q, k, v)]
    idx_d, cnt_d, qs_d, ks_d = (x.to(DEV) for x in (idx, cnt, qs, ks))
    dout = randn((B, Qt * V, Hq, D), 121, torch.float16).to(DEV)

    def step():
        out = vidattn.block_sparse_attention(*static, idx_d, cnt_d, tile_volume=V,
                                             q_block_sizes=qs_d, kv_block_sizes=ks_d)
        return (out.detach(), *torch.autograd.grad(out, static, dout))

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for seed in (122, 123):  # new input values, replayed, against eager on the same values
        with torch.no_grad():
            for i, x in enumerate(static):
                x.copy_(randn(x.shape, seed + i, torch.float16, 4.0 if i < 2 else 1.0).to(DEV))
        graph.replay()
        torch.cuda.synchronize()
        eager = step()
        for a, b in zip(captured, eager):
            assert torch.equal(a, b)


@pytest.mark.parametrize("V", [64, 128])
def test_concurrent_launches_on_two_streams_keep_their_own_tiles(V):
    """The Hopper block-sparse kernels' streams take query tiles from a counter of their
    launch: two launches running at once on two streams must each compute all of their own
    tiles (a shared counter would split the tiles between them, leaving NaN-poisoned rows)."""
    g = gen(130)
    cases = []
    for heads, qt in ((6, 150), (5, 131)):
        q, k, v = (torch.randn(1, qt * V, heads, 128, generator=g).to(torch.bfloat16).to(DEV)
                   for _ in range(3))
        idx, cnt = random_index(1, heads, qt, qt, 9, 131 + heads, allow_empty=False)
        cases.append((q, k, v, idx.to(DEV), cnt.to(DEV)))
    alone = [vidattn.block_sparse_attention(*c, tile_volume=V, return_lse=True) for c in cases]
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):  # the allocator keeps blocks per stream
            poison_allocator(150 * V * 6 * 128 * 2)
    together = [[], []]
    for _ in range(3):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                together[i].append(vidattn.block_sparse_attention(*cases[i], tile_volume=V,
                                                                  return_lse=True))
    torch.cuda.synchronize()
    for i in range(2):
        for out, lse in together[i]:
            assert torch.equal(out, alone[i][0]) and torch.equal(lse, alone[i][1]), i


def test_bad_index_and_unsupported_inputs_raise_clear_errors():
    q = torch.randn(1, 128, 2, 64, generator=gen(40)).to(torch.bfloat16).to(DEV)
    idx, cnt = random_index(1, 2, 2, 2, 2, 41, allow_empty=False)
    bsa = vidattn.block_sparse_attention
    bad = idx.clone()
    bad[0, 0, 0, cnt[0, 0, 0] - 1] = 2
    with pytest.raises(ValueError, match="out of range"):
        bsa(q, q, q, bad.to(DEV), cnt.to(DEV))
    with pytest.raises(ValueError, match="out of range"):
        ops.block_sparse_transpose_index(bad.to(DEV), cnt.to(DEV), 2)
    asc = idx.clone()
    asc[0, 1, 1, :2] = torch.tensor([1, 0], dtype=torch.int32)
    cnt2 = cnt.clone()
    cnt2[0, 1, 1] = 2
    with pytest.raises(ValueError, match="ascending"):
        bsa(q, q, q, asc.to(DEV), cnt2.to(DEV))
    with pytest.raises(ValueError, match="counts"):
        bsa(q, q, q, idx.to(DEV), (cnt + 5).to(DEV))
    sizes = torch.tensor([64, 65], dtype=torch.int32, device=DEV)
    with pytest.raises(ValueError, match="kv_block_sizes"):
        bsa(q, q, q, idx.to(DEV), cnt.to(DEV), kv_block_sizes=sizes)
    with pytest.raises(ValueError, match="must be on"):
        bsa(q, q, q, idx, cnt)  # index on the CPU, tensors on the GPU
    with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
        bsa(q.float(), q.float(), q.float(), idx.to(DEV), cnt.to(DEV))
    q100 = torch.zeros(1, 128, 2, 100, dtype=torch.bfloat16, device=DEV)  # not a multiple of 8
    with pytest.raises(NotImplementedError, match="head dims"):
        bsa(q100, q100, q100, idx.to(DEV), cnt.to(DEV))
    # The good index still works after the errors (nothing left broken on the stream).
    out = bsa(q, q, q, idx.to(DEV), cnt.to(DEV))
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("B,Qt,Kt", [(0, 2, 2), (1, 0, 2), (1, 2, 0)])
def test_empty_inputs(B, Qt, Kt):
    mk = lambda n, s: randn((B, n * 64, 2, 64), s, torch.bfloat16).to(DEV).requires_grad_()
    q, k, v = mk(Qt, 140), mk(Kt, 141), mk(Kt, 142)
    idx = torch.full((B, 2, Qt, min(2, Kt)), -1, dtype=torch.int32, device=DEV)
    cnt = torch.zeros((B, 2, Qt), dtype=torch.int32, device=DEV)
    out, lse = vidattn.block_sparse_attention(q, k, v, idx, cnt, return_lse=True)
    assert out.shape == q.shape and (out == 0).all() and torch.isneginf(lse).all()
    for g, x in zip(torch.autograd.grad(out.sum(), (q, k, v)), (q, k, v)):
        assert g.shape == x.shape and (g == 0).all()


def test_unvalidated_index_gives_the_same_result_and_never_reads_out_of_bounds():
    """validate_index=False (what video_sparse_attention passes for its own index) skips the
    device check and its host wait: a valid index gives bit-identical results; an out-of-range
    id is skipped by the kernels (no fault, finite output) instead of raising."""
    g = gen(60)
    q = torch.randn(2, 4 * 64, 3, 64, generator=g).to(torch.bfloat16).to(DEV)
    k = torch.randn(2, 5 * 64, 3, 64, generator=g).to(torch.bfloat16).to(DEV)
    idx, cnt = random_index(2, 3, 4, 5, 3, 61, allow_empty=False)
    idx, cnt = idx.to(DEV), cnt.to(DEV)
    checked = vidattn.block_sparse_attention(q, k, k, idx, cnt, return_lse=True)
    trusted = vidattn.block_sparse_attention(q, k, k, idx, cnt, return_lse=True,
                                             validate_index=False)
    assert all(torch.equal(a, b) for a, b in zip(checked, trusted))
    bad = idx.clone()
    bad[..., 0] = 1000
    out = vidattn.block_sparse_attention(q, k, k, bad, cnt, validate_index=False)
    torch.cuda.synchronize()
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("tile", [64, 128])
def test_sm_margin_leaves_the_result_bit_identical(tile):
    """sm_margin shrinks the persistent grid of the Hopper forward (fewer CTAs, more tiles
    each): any margin, down to a single CTA, gives the same bits as the full grid."""
    g = gen(70)
    q = torch.randn(1, 37 * tile, 5, 128, generator=g).to(torch.bfloat16).to(DEV)
    k = torch.randn(1, 29 * tile, 5, 128, generator=g).to(torch.bfloat16).to(DEV)
    v = torch.randn(1, 29 * tile, 5, 128, generator=g).to(torch.bfloat16).to(DEV)
    idx, cnt = random_index(1, 5, 37, 29, 6, 71, allow_empty=True)
    idx, cnt = idx.to(DEV), cnt.to(DEV)
    full = vidattn.block_sparse_attention(q, k, v, idx, cnt, tile_volume=tile, return_lse=True)
    for margin in (16, 100000):
        poison_allocator(q.numel() * 2)
        got = vidattn.block_sparse_attention(q, k, v, idx, cnt, tile_volume=tile,
                                             return_lse=True, sm_margin=margin)
        assert all(torch.equal(a, b) for a, b in zip(full, got)), margin


# ---- VSA's fine branch and combination in one op (vidattn.vsa_fine_combined) -----------------

@pytest.mark.parametrize("dtype,V,D,use_gate,margin", [
    (torch.bfloat16, 64, 128, True, 0),
    (torch.float16, 64, 64, True, 0),
    (torch.bfloat16, 64, 64, False, 0),
    (torch.bfloat16, 64, 128, True, 100000),  # one CTA: two combining warps take every tile
    (torch.float16, 128, 128, True, 0),        # no fused kernel: the two passes
])
def test_fine_combined_gives_the_bits_of_the_two_ops(dtype, V, D, use_gate, margin):
    """The fused op (on Hopper, 64-token tiles: the combination inside the fine kernel) writes
    exactly block_sparse_attention's out and lse and vsa_combine's result, on NaN-poisoned
    memory, with partial and empty query tiles, a query tile that selected nothing, GQA."""
    B, Hq, Hkv, Qt, Kt = 2, 4, 2, 37, 29
    q, k, v, idx, cnt, qs, ks = make_case(dtype, V, B, Hq, Hkv, D, Qt, Kt, 7, 4.0, 140)
    coarse = randn((B, Qt, Hq, D), 141, dtype)
    gate = randn((B, Qt * V, Hq, D), 142, dtype) if use_gate else None
    args = [x.to(DEV) for x in (q, k, v, idx, cnt)]
    coarse_d, qs_d, ks_d = coarse.to(DEV), qs.to(DEV), ks.to(DEV)
    gate_d = gate.to(DEV) if use_gate else None
    fine, lse = ops.block_sparse_attention(*args, tile_volume=V, q_block_sizes=qs_d,
                                           kv_block_sizes=ks_d, sm_margin=margin)
    want = ops.vsa_combine(fine, coarse_d, gate_d, qs_d, V)
    for _ in range(2):
        poison_allocator(B * Qt * V * Hq * D * 2)
        got = ops.vsa_fine_combined(*args, coarse_d, gate_d, qs_d, tile_volume=V,
                                    kv_block_sizes=ks_d, sm_margin=margin)
        torch.cuda.synchronize()
        for name, a, b in zip(("out", "fine", "lse"), got, (want, fine, lse)):
            assert torch.equal(a, b), name


def test_fine_combined_strided_views_and_the_vsa_op():
    """Views with padded rows (strides not the packed ones) for gate and coarse; and
    video_sparse_attention without gradients (the fused op) against the same call recording
    them (the two ops): the same bits."""
    t = vidattn.VideoTiling((9, 10, 13), (4, 4, 4), device=DEV)
    S, H, D = t.padded_len, 3, 128
    g = torch.Generator(device=DEV).manual_seed(150)
    q, k, v = (t.tile(torch.randn(1, t.num_tokens, H, D, generator=g, device=DEV)
                      .to(torch.bfloat16)) for _ in range(3))
    wide = torch.randn(1, S, H, D + 8, generator=g, device=DEV).to(torch.bfloat16)
    gate = wide[..., :D]  # row stride H * (D + 8)
    with torch.no_grad():
        fast = vidattn.video_sparse_attention(q, k, v, tiling=t, sparsity=0.7, gate=gate)
    slow = vidattn.video_sparse_attention(q.clone().requires_grad_(), k, v, tiling=t,
                                          sparsity=0.7, gate=gate)
    assert torch.equal(fast, slow.detach())
    pooled = [ops.tile_mean_pool(x, t.block_sizes, 64) for x in (q, k)]
    idx, cnt = vidattn.select_topk_tiles(*pooled, 8)
    coarse = torch.randn(1, t.num_tiles, H, D + 8, generator=g, device=DEV).to(torch.bfloat16)
    coarse = coarse[..., :D]  # tile stride H * (D + 8)
    fine, lse = ops.block_sparse_attention(q, k, v, idx, cnt, q_block_sizes=t.block_sizes,
                                           kv_block_sizes=t.block_sizes)
    got = ops.vsa_fine_combined(q, k, v, idx, cnt, coarse, gate, t.block_sizes,
                                kv_block_sizes=t.block_sizes)
    want = (ops.vsa_combine(fine, coarse, gate, t.block_sizes, 64), fine, lse)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
