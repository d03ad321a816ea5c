"""Video Sparse Attention on the CPU: tiling, coarse stage, selection, block-sparse attention,
the VSA op, packed videos, ops and torch.compile. References are plain PyTorch in float64
(vsa_reference.py); tolerances follow the 2x rule of docs/conventions.md."""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

import vidattn
import vsa_reference as ref

ops = torch.ops.vidattn


def gen(seed):
    return torch.Generator().manual_seed(seed)


def randn(shape, seed, dtype=torch.float64, scale=1.0):
    return (torch.randn(shape, generator=gen(seed), dtype=torch.float64) * scale).to(dtype)


# Floor of the 2x rule (absolute, relative to the reference's magnitude): rounding noise that
# even an exact kernel shows when PyTorch's own error happens to be tiny.
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-3, torch.float16: 5e-4}


def assert_2x(name, got, ref64, ref_lp, dtype, factor=2.0, magnitude=None):
    """magnitude: the problem's value scale for the rounding floor (default: |ref64| max)."""
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    got, ref64 = got.double(), ref64.double()
    if dtype == torch.float64:
        err = (got - ref64).abs().max().item()
        assert err <= 1e-10, f"{name}: fp64 error {err:.3e} > 1e-10"
        return
    err = (got - ref64).abs().max().item()
    torch_err = (ref_lp.double() - ref64).abs().max().item()
    if magnitude is None:
        magnitude = ref64.abs().max().item()
    bound = factor * torch_err + FLOOR[dtype] * max(1.0, magnitude)
    assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (torch {torch_err:.3e})"


# ---------------------------------------------------------------------------------------
# Tiling

def python_tiling(grid, tile):
    """Brute-force tiled layout: slot -> raster token (-1 pad), block sizes."""
    T, H, W = grid
    tt, th, tw = tile
    nt, nh, nw = -(-T // tt), -(-H // th), -(-W // tw)
    V = tt * th * tw
    slots, sizes = [], []
    for ti, hi, wi in itertools.product(range(nt), range(nh), range(nw)):
        toks = [(t * H + h) * W + w
                for t in range(ti * tt, min(T, ti * tt + tt))
                for h in range(hi * th, min(H, hi * th + th))
                for w in range(wi * tw, min(W, wi * tw + tw))]
        sizes.append(len(toks))
        slots += toks + [-1] * (V - len(toks))
    return slots, sizes


@pytest.mark.parametrize("grid,tile", [((1, 1, 1), (4, 4, 4)), ((5, 7, 9), (4, 4, 4)),
                                       ((9, 10, 7), (2, 8, 8)), ((9, 10, 7), (4, 4, 8)),
                                       ((3, 17, 5), (4, 8, 8))])
def test_tiling_layout_matches_brute_force(grid, tile):
    t = vidattn.VideoTiling(grid, tile)
    slots, sizes = python_tiling(grid, tile)
    assert t.num_tiles == len(sizes) and t.padded_len == len(slots)
    assert t.block_sizes.dtype == torch.int32 and t.block_sizes.tolist() == sizes
    assert int(t.block_sizes.sum()) == math.prod(grid)
    assert t.slot_to_token.tolist() == slots
    x = randn((2, math.prod(grid), 3, 8), 1)
    tiled = t.tile(x)
    expected = torch.zeros(2, len(slots), 3, 8, dtype=x.dtype)
    idx = torch.tensor(slots)
    expected[:, idx >= 0] = x[:, idx[idx >= 0]]
    assert torch.equal(tiled, expected)
    assert torch.equal(t.untile(tiled), x)


def test_tile_untile_gradients():
    # Both are linear gathers: the gradient of one is the other applied to the output grad.
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    x = randn((2, 315, 2, 3), 2).requires_grad_()
    g = randn((2, t.padded_len, 2, 3), 3)
    (gx,) = torch.autograd.grad(t.tile(x), x, g)
    assert torch.equal(gx, g[:, t.token_to_slot.long()])
    y = randn((2, t.padded_len, 2, 3), 4).requires_grad_()
    g2 = randn((2, 315, 2, 3), 5)
    (gy,) = torch.autograd.grad(t.untile(y), y, g2)
    want = torch.zeros_like(y)
    want[:, t.token_to_slot.long()] = g2
    assert torch.equal(gy, want)


def test_tiling_bad_inputs():
    with pytest.raises(ValueError, match="volume"):
        vidattn.VideoTiling((4, 4, 4), (3, 3, 3))
    with pytest.raises(ValueError, match="volume"):
        vidattn.VideoTiling((4, 4, 4), (4, 4, 2))
    with pytest.raises(ValueError, match="grid"):
        vidattn.VideoTiling((0, 4, 4), (4, 4, 4))
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    with pytest.raises(ValueError, match="tokens"):
        t.tile(torch.zeros(1, 300, 1, 8))
    with pytest.raises(ValueError, match="tiled"):
        t.untile(torch.zeros(1, 315, 1, 8))
    with pytest.raises(ValueError, match="inverse_index"):
        ops.gather_tokens(torch.zeros(1, 300, 1, 8), t.slot_to_token, t.token_to_slot)
    with pytest.raises(ValueError, match="index"):
        bad = t.slot_to_token.clone()
        bad[0] = 10_000
        ops.gather_tokens(torch.zeros(1, 315, 1, 8), bad, t.token_to_slot)


# ---------------------------------------------------------------------------------------
# Pooling and selection

@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_tile_mean_pool_and_backward(dtype):
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 8))
    x = randn((2, t.padded_len, 3, 16), 4, dtype).requires_grad_()
    pooled = vidattn.tile_mean_pool(x, t.block_sizes, t.tile_volume)
    expected = ref.pool(x.detach().double(), t, torch.float64)
    tol = 1e-14 if dtype == torch.float64 else 1e-2
    torch.testing.assert_close(pooled.double(), expected, atol=tol * 4, rtol=tol)
    g = randn(pooled.shape, 5, dtype)
    (gx,) = torch.autograd.grad(pooled, x, g)
    sizes = t.block_sizes.double().repeat_interleave(t.tile_volume)
    want = g.double()[:, t.slot_tile.long()] / sizes[None, :, None, None]
    want = want * t.slot_valid[None, :, None, None]
    torch.testing.assert_close(gx.double(), want, atol=tol, rtol=tol)


def test_tile_mean_pool_zero_size_tile_and_bad_sizes():
    x = randn((1, 128, 1, 4), 6)
    out = vidattn.tile_mean_pool(x, torch.tensor([0, 3], dtype=torch.int32), 64)
    assert torch.equal(out[0, 0], torch.zeros(1, 4, dtype=x.dtype))
    torch.testing.assert_close(out[0, 1], x[0, 64:67].mean(0), atol=1e-15, rtol=0)
    with pytest.raises(ValueError, match="block sizes"):
        vidattn.tile_mean_pool(x, torch.tensor([65, 3], dtype=torch.int32), 64)
    with pytest.raises(ValueError, match="tile volume"):
        vidattn.tile_mean_pool(x, torch.tensor([1, 3], dtype=torch.int32), 32)


def test_topk_from_sparsity():
    assert vidattn.topk_from_sparsity(0.9, 624) == 63
    assert vidattn.topk_from_sparsity(0.8, 10) == 2
    assert vidattn.topk_from_sparsity(0.9, 10) == 1
    assert vidattn.topk_from_sparsity(1.0, 10) == 1
    assert vidattn.topk_from_sparsity(0.0, 10) == 10
    assert vidattn.topk_from_sparsity(0.875, 1440) == 180
    with pytest.raises(ValueError):
        vidattn.topk_from_sparsity(1.5, 10)


def test_topk_rules_on_constructed_scores():
    inf = float("inf")
    scores = torch.tensor([[[
        [1.0, 3.0, 3.0, 2.0, 3.0],        # ties: lowest indices win
        [-inf, -inf, -inf, -inf, -inf],   # all -inf: the first k
        [float("nan"), 0.0, -inf, 5.0, float("nan")],  # NaN ranks as -inf
        [0.0, 0.0, 0.0, 0.0, 0.0],
    ]]])
    idx, cnt = vidattn.topk_tiles_from_scores(scores, 2)
    assert idx.dtype == torch.int32 and cnt.dtype == torch.int32
    assert idx[0, 0].tolist() == [[1, 2], [0, 1], [1, 3], [0, 1]]
    assert cnt.tolist() == [[[2, 2, 2, 2]]]
    idx, cnt = vidattn.topk_tiles_from_scores(scores, 9)  # topk >= tiles: all of them
    assert idx.shape[-1] == 5 and cnt.unique().tolist() == [5]
    assert idx[0, 0, 0].tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="topk"):
        vidattn.topk_tiles_from_scores(scores, 0)


@pytest.mark.parametrize("dtype,topk,input_scale", [(torch.float64, 3, 1.0),
                                                    (torch.bfloat16, 5, 4.0),
                                                    (torch.float32, 1, 16.0)])
def test_selection_is_topk_of_float64_coarse_scores(dtype, topk, input_scale):
    t = vidattn.VideoTiling((9, 10, 7), (4, 4, 4))
    q = randn((2, t.padded_len, 3, 64), 7, dtype, input_scale)
    k = randn((2, t.padded_len, 3, 64), 8, dtype, input_scale)
    v = randn((2, t.padded_len, 3, 64), 9, dtype)
    _, (idx, cnt) = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=topk,
                                                   return_selection=True)
    s = ref.coarse_scores(q, k, t, None)
    assert (cnt == min(topk, t.num_tiles)).all()
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx.long(), True)
    assert (idx[..., 1:] > idx[..., :-1]).all()
    # Rounding of the pooled tensors and scores in the kernel's dtype.
    eps = {torch.float64: 1e-12, torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
    tol = eps * (s.abs().amax(-1, keepdim=True) + 1)
    worst_chosen = s.masked_fill(~chosen, float("inf")).amin(-1, keepdim=True)
    best_other = s.masked_fill(chosen, float("-inf")).amax(-1, keepdim=True)
    assert (worst_chosen >= best_other - tol).all()


def test_selection_packed_stays_within_video():
    t = vidattn.VideoTiling(grids=[(5, 7, 9), (4, 4, 4), (9, 10, 7)])
    q = randn((1, t.padded_len, 2, 64), 10)
    k = randn((1, t.padded_len, 2, 64), 11)
    cu = t.cu_tiles.tolist()
    idx, cnt = vidattn.select_topk_tiles(
        vidattn.tile_mean_pool(q, t.block_sizes, 64), vidattn.tile_mean_pool(k, t.block_sizes, 64),
        4, cu_tiles_q=t.cu_tiles, cu_tiles_k=t.cu_tiles)
    for v in range(3):
        rows = slice(cu[v], cu[v + 1])
        n = min(4, cu[v + 1] - cu[v])
        assert (cnt[:, :, rows] == n).all()
        sel = idx[:, :, rows, :n]
        assert ((sel >= cu[v]) & (sel < cu[v + 1])).all()
        assert (idx[:, :, rows, n:] == -1).all()


# ---------------------------------------------------------------------------------------
# Block-sparse attention

def random_index(B, H, Qt, Kt, max_k, seed, allow_empty=True):
    g = gen(seed)
    idx = torch.full((B, H, Qt, max_k), -1, dtype=torch.int32)
    cnt = torch.zeros((B, H, Qt), dtype=torch.int32)
    for b, h, t in itertools.product(range(B), range(H), range(Qt)):
        n = int(torch.randint(0 if allow_empty else 1, min(max_k, Kt) + 1, (1,), generator=g))
        sel = torch.randperm(Kt, generator=g)[:n].sort().values
        idx[b, h, t, :n] = sel.to(torch.int32)
        cnt[b, h, t] = n
    return idx, cnt


@pytest.mark.parametrize("dtype,V,B,Hq,Hkv,D,Qt,Kt,scale", [
    (torch.float64, 64, 2, 3, 1, 64, 5, 7, 1.0),
    (torch.float64, 256, 1, 2, 2, 32, 3, 2, 4.0),
    (torch.bfloat16, 128, 2, 4, 2, 64, 4, 6, 4.0),
    (torch.float16, 64, 1, 3, 3, 128, 6, 4, 16.0),
    (torch.float32, 64, 1, 2, 1, 64, 4, 9, 1.0),
])
def test_block_sparse_matches_reference(dtype, V, B, Hq, Hkv, D, Qt, Kt, scale):
    seed = zlib.crc32(repr((dtype, V, B, Hq, D)).encode()) % 10_000
    q = randn((B, Qt * V, Hq, D), seed, dtype, scale).requires_grad_()
    k = randn((B, Kt * V, Hkv, D), seed + 1, dtype, scale).requires_grad_()
    v = randn((B, Kt * V, Hkv, D), seed + 2, dtype).requires_grad_()
    idx, cnt = random_index(B, Hq, Qt, Kt, 3, seed)
    g = gen(seed + 3)
    q_sizes = torch.randint(0, V + 1, (Qt,), generator=g, dtype=torch.int32)
    kv_sizes = torch.randint(0, V + 1, (Kt,), generator=g, dtype=torch.int32)
    q_sizes[0], kv_sizes[0] = V, 0  # a full query tile, a zero-size key tile
    out, lse = vidattn.block_sparse_attention(q, k, v, idx, cnt, tile_volume=V,
                                              q_block_sizes=q_sizes, kv_block_sizes=kv_sizes,
                                              return_lse=True)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    dout = randn(out.shape, seed + 4, dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def run_ref(dt):
        qq, kk, vv = (x.detach().to(dt).requires_grad_() for x in (q, k, v))
        o = ref.block_sparse(qq, kk, vv, idx, cnt, V, q_sizes, kv_sizes, D ** -0.5)
        return (o, *torch.autograd.grad(o, (qq, kk, vv), dout.to(dt)))

    r64, rlp = run_ref(torch.float64), run_ref(dtype)
    for name, got, a, b, f in zip(("out", "dq", "dk", "dv"), (out, *grads), r64, rlp,
                                  (2, 3, 2, 2)):
        assert_2x(name, got, a, b, dtype, f)
    # Count-0 query tiles, zero-size tiles and padded query slots: zeros, LSE -inf, no NaN.
    slot = torch.arange(V)
    q_valid = (slot[None, :] < q_sizes[:, None].long()).reshape(-1)
    # A query tile sees nothing when its count is 0 or all its key tiles have size 0.
    sees = ((torch.arange(3) < cnt[..., None].long()) & (kv_sizes.long()[idx.clamp(min=0).long()] > 0))
    empty_tile = (~sees.any(-1))[..., None].expand(B, Hq, Qt, V).reshape(B, Hq, -1)
    dead = ~q_valid[None, None, :] | empty_tile
    assert torch.isneginf(lse[dead]).all() and torch.isfinite(lse[~dead]).all()
    assert (out.permute(0, 2, 1, 3)[dead] == 0).all()
    # Key tiles nobody selected: exactly zero dK, dV.
    group = Hq // Hkv
    for b, hk, j in itertools.product(range(B), range(Hkv), range(Kt)):
        heads = slice(hk * group, (hk + 1) * group)
        used = ((idx[b, heads] == j) & (torch.arange(3) < cnt[b, heads, :, None])).any()
        if not used or kv_sizes[j] == 0:
            assert (grads[1][b, j * V:(j + 1) * V, hk] == 0).all()
            assert (grads[2][b, j * V:(j + 1) * V, hk] == 0).all()


def test_block_sparse_padding_content_is_never_read():
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    q = randn((1, t.padded_len, 2, 64), 20)
    k, v = randn(q.shape, 21), randn(q.shape, 22)
    idx, cnt = random_index(1, 2, t.num_tiles, t.num_tiles, 4, 23, allow_empty=False)
    kw = dict(q_block_sizes=t.block_sizes, kv_block_sizes=t.block_sizes)
    clean = vidattn.block_sparse_attention(q, k, v, idx, cnt, **kw)
    pad = ~t.slot_valid
    poisoned = [x.clone() for x in (q, k, v)]
    for x in poisoned:
        x[:, pad] = float("nan")
    dirty = vidattn.block_sparse_attention(*poisoned, idx, cnt, **kw)
    assert torch.equal(clean, dirty)


def test_transpose_index_is_sorted_csr():
    idx, cnt = random_index(2, 3, 9, 7, 4, 30)
    off, k2q = ops.block_sparse_transpose_index(idx, cnt, 7)
    assert off.shape == (2, 3, 8) and k2q.shape == (2, 3, 36)
    for b, h in itertools.product(range(2), range(3)):
        total = int(cnt[b, h].sum())
        assert off[b, h, -1] == total and (k2q[b, h, total:] == -1).all()
        for j in range(7):
            got = k2q[b, h, off[b, h, j]:off[b, h, j + 1]].tolist()
            want = [t for t in range(9) if j in idx[b, h, t, :cnt[b, h, t]].tolist()]
            assert got == want


def test_block_sparse_bad_inputs():
    q = randn((1, 128, 2, 64), 40, torch.float32)
    idx, cnt = random_index(1, 2, 2, 2, 2, 41, allow_empty=False)
    bsa = vidattn.block_sparse_attention
    bad = idx.clone()
    bad[0, 0, 0, cnt[0, 0, 0] - 1] = 2
    with pytest.raises(ValueError, match="out of range"):
        bsa(q, q, q, bad, cnt)
    asc = idx.clone()
    asc[0, 0, 0, :2] = torch.tensor([1, 0], dtype=torch.int32)
    cnt2 = cnt.clone()
    cnt2[0, 0, 0] = 2
    with pytest.raises(ValueError, match="ascending"):
        bsa(q, q, q, asc, cnt2)
    with pytest.raises(ValueError, match="counts"):
        bsa(q, q, q, idx, cnt + 5)
    with pytest.raises(TypeError, match="int32"):
        bsa(q, q, q, idx.long(), cnt)
    with pytest.raises(TypeError):
        bsa(q, q.double(), q, idx, cnt)
    with pytest.raises(ValueError, match="4-D"):
        bsa(q[0], q[0], q[0], idx, cnt)
    with pytest.raises(ValueError, match="multiples of the tile volume"):
        bsa(q[:, :100], q, q, idx, cnt)
    with pytest.raises(ValueError, match="tile volume"):
        bsa(q, q, q, idx, cnt, tile_volume=32)
    with pytest.raises(ValueError, match="'sm_margin' must be >= 0"):
        bsa(q, q, q, idx, cnt, sm_margin=-1)
    # sm_margin only shapes the Hopper kernel's grid: elsewhere the result is the same.
    assert torch.equal(bsa(q, q, q, idx, cnt), bsa(q, q, q, idx, cnt, sm_margin=1000))


# ---------------------------------------------------------------------------------------
# The VSA op against the float64 reference

VSA_CASES = [
    # grid, tile, kv grid (cross), topk, gate, input scale, B, H, D, dtype
    ((1, 1, 1), (4, 4, 4), None, 1, False, 1.0, 1, 1, 64, torch.float64),
    ((5, 7, 9), (4, 4, 4), None, 3, True, 4.0, 2, 3, 64, torch.bfloat16),
    ((9, 10, 7), (2, 8, 8), None, 64, False, 16.0, 1, 3, 128, torch.float16),
    ((9, 10, 7), (4, 8, 8), (5, 7, 9), 3, True, 1.0, 2, 1, 64, torch.float64),
    ((5, 7, 9), (4, 4, 8), (9, 10, 7), 1, True, 16.0, 1, 12, 64, torch.bfloat16),
    ((21, 30, 52), (4, 4, 4), None, 3, True, 4.0, 1, 1, 64, torch.bfloat16),
    ((21, 30, 52), (4, 8, 8), None, 1, False, 16.0, 1, 1, 128, torch.float64),
    ((5, 7, 9), (4, 4, 4), (1, 1, 1), 3, False, 1.0, 2, 3, 128, torch.float32),
    ((9, 10, 7), (4, 4, 4), None, 1000, True, 16.0, 1, 2, 64, torch.float16),
]


@pytest.mark.parametrize("case", VSA_CASES, ids=lambda c: f"{c[0]}-{c[1]}-kv{c[2]}-k{c[3]}-"
                         f"g{int(c[4])}-s{c[5]}-B{c[6]}H{c[7]}D{c[8]}-{str(c[9])[6:]}")
def test_vsa_matches_float64_reference(case):
    grid, tile, kv_grid, topk, use_gate, scale, B, H, D, dtype = case
    seed = zlib.crc32(repr(case).encode()) % 100_000
    t = vidattn.VideoTiling(grid, tile)
    kt = vidattn.VideoTiling(kv_grid, tile) if kv_grid else None
    S_k = (kt or t).padded_len
    # Real inputs come from tile(): zeros in padding.
    q = t.tile(randn((B, t.num_tokens, H, D), seed, dtype, scale)).requires_grad_()
    k = (kt or t).tile(randn((B, (kt or t).num_tokens, H, D), seed + 1, dtype, scale)).requires_grad_()
    v = (kt or t).tile(randn((B, (kt or t).num_tokens, H, D), seed + 2, dtype)).requires_grad_()
    assert k.shape[1] == S_k
    gate = randn(q.shape, seed + 3, dtype).requires_grad_() if use_gate else None
    out, (idx, cnt) = vidattn.video_sparse_attention(q, k, v, tiling=t, kv_tiling=kt, topk=topk,
                                                     gate=gate, return_selection=True)
    assert (cnt == min(topk, (kt or t).num_tiles)).all()
    inputs = [x for x in (q, k, v, gate) if x is not None]
    dout = randn(out.shape, seed + 4, dtype)
    grads = torch.autograd.grad(out, inputs, dout)

    def run_ref(dt):
        xs = [x.detach().to(dt).requires_grad_() for x in inputs]
        g = xs[3] if use_gate else None
        o = ref.video_sparse(xs[0], xs[1], xs[2], t, kt, idx, cnt, g, None)
        return (o, *torch.autograd.grad(o, xs, dout.to(dt)))

    r64, rlp = run_ref(torch.float64), run_ref(dtype)
    names = ("out", "dq", "dk", "dv", "dgate")
    # A gradient can be exactly 0 in exact math (one key: dS = 0) while each term is not.
    magnitude = max(r.abs().max().item() for r in r64)
    for i, got in enumerate((out, *grads)):
        assert_2x(names[i], got, r64[i], rlp[i], dtype, 3.0 if names[i] == "dq" else 2.0,
                  magnitude)


def test_vsa_grouped_heads_against_reference():
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    q = t.tile(randn((2, t.num_tokens, 6, 64), 130, torch.bfloat16, 4.0)).requires_grad_()
    k = t.tile(randn((2, t.num_tokens, 2, 64), 131, torch.bfloat16, 4.0)).requires_grad_()
    v = t.tile(randn((2, t.num_tokens, 2, 64), 132, torch.bfloat16)).requires_grad_()
    out, (idx, cnt) = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=3,
                                                     return_selection=True)
    s = ref.coarse_scores(q, k, t, None)
    chosen = torch.zeros_like(s, dtype=torch.bool).scatter_(-1, idx.long(), True)
    tol = 2e-2 * (s.abs().amax(-1, keepdim=True) + 1)
    assert (s.masked_fill(~chosen, float("inf")).amin(-1) >=
            s.masked_fill(chosen, float("-inf")).amax(-1) - tol[..., 0]).all()
    dout = randn(out.shape, 133, torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def run_ref(dt):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        o = ref.video_sparse(*xs, t, None, idx, cnt, None, None)
        return (o, *torch.autograd.grad(o, xs, dout.to(dt)))

    r64, rlp = run_ref(torch.float64), run_ref(torch.bfloat16)
    for i, got in enumerate((out, *grads)):
        assert_2x(("out", "dq", "dk", "dv")[i], got, r64[i], rlp[i], torch.bfloat16,
                  3.0 if i == 1 else 2.0)


def test_vsa_sparsity_argument_and_bad_inputs():
    t = vidattn.VideoTiling((9, 10, 7), (4, 4, 4))
    q = randn((1, t.padded_len, 2, 64), 50, torch.float32)
    _, (idx, cnt) = vidattn.video_sparse_attention(q, q, q, tiling=t, sparsity=0.75,
                                                   return_selection=True)
    assert idx.shape[-1] == vidattn.topk_from_sparsity(0.75, t.num_tiles) == 5  # ceil(0.25 * 18)
    assert (cnt == 5).all()
    vsa = vidattn.video_sparse_attention
    with pytest.raises(ValueError, match="topk"):
        vsa(q, q, q, tiling=t, topk=0)
    with pytest.raises(ValueError, match="exactly one"):
        vsa(q, q, q, tiling=t)
    with pytest.raises(ValueError, match="tiled length"):
        vsa(q[:, :-64], q, q, tiling=t, topk=2)
    with pytest.raises(ValueError, match="4-D"):
        vsa(q[0], q, q, tiling=t, topk=2)
    with pytest.raises(TypeError):
        vsa(q.to(torch.int32), q.to(torch.int32), q.to(torch.int32), tiling=t, topk=2)
    with pytest.raises(ValueError, match="gate"):
        vsa(q, q, q, tiling=t, topk=2, gate=q[:, :64])


def test_vsa_deterministic_backward_50_runs():
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    q, k, v = (randn((1, t.padded_len, 2, 64), s, torch.float32).requires_grad_()
               for s in (60, 61, 62))
    dout = randn(q.shape, 63, torch.float32)
    first = None
    for _ in range(50):
        out = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=3)
        grads = torch.autograd.grad(out, (q, k, v), dout)
        if first is None:
            first = [g.clone() for g in grads]
        else:
            for a, b in zip(first, grads):
                assert torch.equal(a, b)


def test_vsa_deterministic_false_is_the_same_op_on_the_cpu():
    """deterministic=False reaches both branches' attention ops (a wrong keyword would raise)
    and changes nothing but the order of the Hopper backward's dQ adds: on the CPU the same
    bits."""
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    q, k, v = (randn((1, t.padded_len, 2, 64), s, torch.float32).requires_grad_()
               for s in (64, 65, 66))
    dout = randn(q.shape, 67, torch.float32)
    runs = []
    for deterministic in (True, False):
        out = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=3,
                                             deterministic=deterministic)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    for a, b in zip(*runs):
        assert torch.equal(a, b)


def test_vsa_inference_forward_equals_training_forward():
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    q, k, v = (randn((1, t.padded_len, 2, 64), s, torch.bfloat16) for s in (64, 65, 66))
    with torch.no_grad():
        a = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=2)
    b = vidattn.video_sparse_attention(q.requires_grad_(), k, v, tiling=t, topk=2)
    assert torch.equal(a, b)


def test_double_backward_raises():
    """VSA's backward ops have no derivative of their own: a gradient of its gradients raises
    (instead of PyTorch's fallback, which warns and returns zeros); first-order gradients with
    create_graph=True are the plain ones."""
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    q, k, v, g = (randn((1, t.padded_len, 2, 16), s).requires_grad_() for s in (70, 71, 72, 73))
    out = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=2, gate=g)
    first = torch.autograd.grad(out.sum(), (q, k, v, g), create_graph=True)
    plain = torch.autograd.grad(
        vidattn.video_sparse_attention(q, k, v, tiling=t, topk=2, gate=g).sum(), (q, k, v, g))
    for a, b in zip(first, plain):
        assert torch.equal(a.detach(), b)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad(sum((x * x).sum() for x in first), (q, k, v, g))


# ---------------------------------------------------------------------------------------
# Packed videos

def test_packed_videos_match_separate_calls():
    grids, kv_grids = [(5, 7, 9), (1, 1, 1), (9, 10, 7)], [(4, 4, 4), (5, 7, 9), (2, 3, 5)]
    tile, H, D = (4, 4, 4), 2, 64
    pt, pk = vidattn.VideoTiling(grids=grids, tile=tile), vidattn.VideoTiling(grids=kv_grids, tile=tile)
    qs = [randn((1, math.prod(g), H, D), 70 + i) for i, g in enumerate(grids)]
    ks = [randn((1, math.prod(g), H, D), 80 + i) for i, g in enumerate(kv_grids)]
    vs = [randn((1, math.prod(g), H, D), 90 + i) for i, g in enumerate(kv_grids)]
    q = pt.tile(vidattn.pack_videos(qs)).requires_grad_()
    k = pk.tile(vidattn.pack_videos(ks)).requires_grad_()
    v = pk.tile(vidattn.pack_videos(vs)).requires_grad_()
    out, (idx, cnt) = vidattn.video_sparse_attention(q, k, v, tiling=pt, kv_tiling=pk, topk=2,
                                                     return_selection=True)
    dout = randn(out.shape, 99)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    raster = vidattn.unpack_videos(pt.untile(out), pt)
    cu_q, cu_k = pt.cu_tiles.tolist(), pk.cu_tiles.tolist()
    for i, (g, kg) in enumerate(zip(grids, kv_grids)):
        st, sk = vidattn.VideoTiling(g, tile), vidattn.VideoTiling(kg, tile)
        qi, ki, vi = (st.tile(qs[i]).requires_grad_(), sk.tile(ks[i]).requires_grad_(),
                      sk.tile(vs[i]).requires_grad_())
        oi, (ii, ci) = vidattn.video_sparse_attention(qi, ki, vi, tiling=st, kv_tiling=sk, topk=2,
                                                      return_selection=True)
        torch.testing.assert_close(raster[i], st.untile(oi), atol=1e-12, rtol=0)
        qr = slice(cu_q[i], cu_q[i + 1])
        assert torch.equal(ci, cnt[:, :, qr])
        sel = idx[:, :, qr, :ci.max()] - cu_k[i]
        assert torch.equal(torch.where(ii >= 0, sel, -1), ii)
        gi = torch.autograd.grad(oi, (qi, ki, vi), dout[:, cu_q[i] * 64:cu_q[i + 1] * 64])
        torch.testing.assert_close(gi[0], grads[0][:, cu_q[i] * 64:cu_q[i + 1] * 64], atol=1e-12, rtol=0)
        for a, b in zip(gi[1:], grads[1:]):
            torch.testing.assert_close(a, b[:, cu_k[i] * 64:cu_k[i + 1] * 64], atol=1e-12, rtol=0)


def test_packed_against_float64_reference_with_sparsity():
    pt = vidattn.VideoTiling(grids=[(9, 10, 7), (5, 7, 9)], tile=(4, 4, 4))
    q, k, v = (pt.tile(randn((1, pt.num_tokens, 3, 64), s, torch.bfloat16)).requires_grad_()
               for s in (100, 101, 102))
    out, (idx, cnt) = vidattn.video_sparse_attention(q, k, v, tiling=pt, sparsity=0.7,
                                                     return_selection=True)
    per_video = [vidattn.topk_from_sparsity(0.7, n) for n in pt.tiles_per_video]
    assert idx.shape[-1] == max(per_video)
    assert cnt[0, 0].tolist() == sum(([c] * n for c, n in zip(per_video, pt.tiles_per_video)), [])
    dout = randn(out.shape, 103, torch.bfloat16)
    grads = torch.autograd.grad(out, (q, k, v), dout)

    def run_ref(dt):
        xs = [x.detach().to(dt).requires_grad_() for x in (q, k, v)]
        o = ref.video_sparse(*xs, pt, None, idx, cnt, None, None)
        return (o, *torch.autograd.grad(o, xs, dout.to(dt)))

    r64, rlp = run_ref(torch.float64), run_ref(torch.bfloat16)
    for i, got in enumerate((out, *grads)):
        assert_2x(("out", "dq", "dk", "dv")[i], got, r64[i], rlp[i], torch.bfloat16,
                  3.0 if i == 1 else 2.0)


# ---------------------------------------------------------------------------------------
# Ops and torch.compile

def test_opcheck_every_vsa_op():
    from torch.library import opcheck
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    for rg in (False, True):
        x = randn((2, t.num_tokens, 2, 16), 110).requires_grad_(rg)
        opcheck(ops.gather_tokens, (x, t.slot_to_token, t.token_to_slot))
        q = randn((2, t.padded_len, 2, 64), 111, torch.float32).requires_grad_(rg)
        k = randn((2, t.padded_len, 1, 64), 112, torch.float32).requires_grad_(rg)
        v = randn((2, t.padded_len, 1, 32), 113, torch.float32).requires_grad_(rg)
        opcheck(ops.tile_mean_pool, (q, t.block_sizes, 64))
        opcheck(ops.tile_mean_pool_backward, (randn((2, t.num_tiles, 2, 8), 114), t.block_sizes, 64))
        qc = ops.tile_mean_pool(q, t.block_sizes, 64).detach().requires_grad_(rg)
        kc = ops.tile_mean_pool(k, t.block_sizes, 64).detach().requires_grad_(rg)
        opcheck(ops.topk_tiles, (qc, kc, 3))
        opcheck(ops.topk_tiles, (qc[:1], kc[:1], 2),
                dict(sparsity=0.5, cu_tiles_q=t.cu_tiles, cu_tiles_k=t.cu_tiles))
        opcheck(ops.topk_tiles_from_scores, (randn((1, 2, 4, 6), 115).requires_grad_(rg), 2))
        idx, cnt = ops.topk_tiles(qc.detach(), kc.detach(), 3)
        kw = dict(tile_volume=64, q_block_sizes=t.block_sizes, kv_block_sizes=t.block_sizes)
        opcheck(ops.block_sparse_attention, (q, k, v, idx, cnt), kw)
        off, k2q = ops.block_sparse_transpose_index(idx, cnt, t.num_tiles)
        opcheck(ops.block_sparse_transpose_index, (idx, cnt, t.num_tiles))
        out, lse = ops.block_sparse_attention(q.detach(), k.detach(), v.detach(), idx, cnt, **kw)
        # The backward op has no derivative of its own (double backward raises: see
        # test_double_backward_raises): checked on inputs that do not require grad.
        opcheck(ops.block_sparse_attention_backward,
                (randn(out.shape, 116, torch.float32), q.detach(), k.detach(), v.detach(), out,
                 lse, idx, cnt, off, k2q),
                dict(kw, scale=None, deterministic=True))
    opcheck(ops.vsa_tiling_metadata, ([5, 7, 9, 2, 3, 4], [4, 4, 4]))
    opcheck(ops.vsa_tiling_metadata, ([5, 7, 9], [4, 8, 8]), dict(device="cpu"))


class TinyVideoBlock(torch.nn.Module):
    def __init__(self, tiling, dim=64, heads=2):
        super().__init__()
        self.tiling, self.heads = tiling, heads
        self.qkv = torch.nn.Linear(dim * heads, 3 * dim * heads, dtype=torch.float64)
        self.gate = torch.nn.Linear(dim * heads, dim * heads, dtype=torch.float64)

    def forward(self, x):  # x [B, tokens, C] raster
        B, S, C = x.shape
        q, k, v = self.qkv(x).view(B, S, 3, self.heads, -1).unbind(2)
        q, k, v = self.tiling.tile(q), self.tiling.tile(k), self.tiling.tile(v)
        gate = self.tiling.tile(self.gate(x).view(B, S, self.heads, -1))
        out = vidattn.video_sparse_attention(q, k, v, tiling=self.tiling, sparsity=0.5, gate=gate)
        return self.tiling.untile(out).reshape(B, S, C)


def test_compiled_model_has_no_graph_breaks_and_matches_eager():
    torch.manual_seed(0)  # the Linear layers' init; inputs use explicit generators
    model = TinyVideoBlock(vidattn.VideoTiling((5, 7, 9), (4, 4, 4)))
    x = randn((1, 315, 128), 120).requires_grad_()
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    compiled = torch.compile(model, fullgraph=True)
    eager_out = model(x)
    compiled_out = compiled(x)
    torch.testing.assert_close(compiled_out, eager_out, atol=1e-12, rtol=0)
    ge = torch.autograd.grad(eager_out.square().sum(), x)[0]
    gc = torch.autograd.grad(compiled_out.square().sum(), x)[0]
    torch.testing.assert_close(gc, ge, atol=1e-10, rtol=0)


def test_compiled_inference_takes_the_fused_op_and_matches_eager():
    """Without gradients the op runs vsa_fine_combined (one op for the fine branch and the
    combination): compiled whole, the same values as eager, which equal the training path's."""
    torch.manual_seed(0)
    model = TinyVideoBlock(vidattn.VideoTiling((5, 7, 9), (4, 4, 4)))
    x = randn((1, 315, 128), 121)
    with torch.no_grad():
        compiled = torch.compile(model, fullgraph=True)
        eager_out = model(x)
        compiled_out = compiled(x)
    torch.testing.assert_close(compiled_out, eager_out, atol=1e-12, rtol=0)
    assert torch.equal(eager_out, model(x.clone().requires_grad_()).detach())


@pytest.mark.parametrize("B,Qt,Kt", [(0, 2, 2), (1, 0, 2), (1, 2, 0), (0, 0, 0)])
def test_block_sparse_empty_inputs(B, Qt, Kt):
    q = randn((B, Qt * 64, 2, 16), 140).requires_grad_()
    k = randn((B, Kt * 64, 2, 16), 141).requires_grad_()
    v = randn((B, Kt * 64, 2, 16), 142).requires_grad_()
    idx = torch.full((B, 2, Qt, min(2, Kt)), -1, dtype=torch.int32)
    cnt = torch.zeros((B, 2, Qt), dtype=torch.int32)
    out, lse = vidattn.block_sparse_attention(q, k, v, idx, cnt, return_lse=True)
    assert out.shape == q.shape and lse.shape == (B, 2, Qt * 64)
    assert (out == 0).all() and torch.isneginf(lse).all()
    for g, x in zip(torch.autograd.grad(out.sum(), (q, k, v)), (q, k, v)):
        assert g.shape == x.shape and (g == 0).all()


def test_vsa_empty_batch():
    t = vidattn.VideoTiling((1, 1, 1), (4, 4, 4))
    x = torch.zeros(0, 64, 1, 8, requires_grad=True)
    out = vidattn.video_sparse_attention(x, x, x, tiling=t, topk=1)
    assert out.shape == x.shape
    assert torch.autograd.grad(out.sum(), x)[0].shape == x.shape


def test_block_sparse_results_do_not_depend_on_thread_count():
    t = vidattn.VideoTiling((9, 10, 7), (4, 4, 4))
    q, k, v = (randn((2, t.padded_len, 3, 64), s, torch.float32).requires_grad_()
               for s in (150, 151, 152))
    dout = randn(q.shape, 153, torch.float32)
    results = []
    threads = torch.get_num_threads()
    try:
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            out = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=4)
            results.append((out, *torch.autograd.grad(out, (q, k, v), dout)))
    finally:
        torch.set_num_threads(threads)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            assert torch.equal(a, b)
