"""The VSA coarse stage and tiling gathers on CUDA (src/cuda/vsa/: gather.cu, pool.cu, topk.cu)
against the CPU ops and float64 references: gather_tokens (tile / untile), tile_mean_pool
(+ backward), topk_tiles and topk_tiles_from_scores. Skipped without a CUDA device."""
from __future__ import annotations

import math

import pytest
import torch

import vidattn
from cuda_poison import poison_allocator
import vsa_reference as ref

ops = torch.ops.vidattn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GRIDS = [((1, 1, 1), (4, 4, 4)), ((5, 7, 9), (4, 4, 4)), ((9, 10, 7), (2, 8, 8)),
         ((21, 30, 52), (4, 8, 8)), ((9, 10, 7), (4, 4, 4)), ((21, 30, 52), (4, 4, 4))]
DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64]
FLOOR = {torch.float32: 2e-6, torch.bfloat16: 2e-3, torch.float16: 5e-4}


def randn(shape, seed, dtype=torch.float32, scale=1.0, device="cuda"):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).to(device)


# ---------------------------------------------------------------------------------------
# gather_tokens

@pytest.mark.parametrize("grid,tile", GRIDS[:4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_tile_untile_match_cpu_exactly(grid, tile, dtype):
    t_cpu = vidattn.VideoTiling(grid, tile)
    t = vidattn.VideoTiling(grid, tile, device="cuda")
    x = randn((2, t.num_tokens, 3, 8), 1, dtype)
    poison_allocator(2 * t.padded_len * 3 * 8 * 8)
    tiled = t.tile(x)
    assert tiled.device.type == "cuda"
    assert torch.equal(tiled.cpu(), t_cpu.tile(x.cpu()))
    poison_allocator(2 * t.padded_len * 3 * 8 * 8)
    assert torch.equal(t.untile(tiled), x)


@pytest.mark.parametrize("D", [1, 5, 8, 64, 128])
def test_gather_strided_views_and_odd_row_bytes(D):
    # Views with unit last stride but padded head / token strides, and row lengths that
    # allow only narrow copies (D = 1, 5 in bf16: 2 and 10 bytes).
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4), device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        base = randn((2, t.num_tokens, 4, D + 3), 2, dtype)
        x = base[:, :, 1:4, 1:D + 1]  # misaligned start, non-contiguous heads
        assert x.stride(-1) == 1 and not x.is_contiguous()
        got = t.tile(x)
        want = torch.zeros(2, t.padded_len, 3, D, dtype=dtype, device="cuda")
        s2t = t.slot_to_token.long()
        want[:, s2t >= 0] = x[:, s2t[s2t >= 0]]
        assert torch.equal(got, want)
        assert torch.equal(t.untile(got), x)


def test_gather_empty_and_autograd():
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4), device="cuda")
    empty = torch.zeros(0, t.num_tokens, 2, 8, device="cuda")
    assert t.tile(empty).shape == (0, t.padded_len, 2, 8)
    x = randn((2, t.num_tokens, 2, 8), 3).requires_grad_()
    g = randn((2, t.padded_len, 2, 8), 4)
    (gx,) = torch.autograd.grad(t.tile(x), x, g)
    assert torch.equal(gx, g[:, t.token_to_slot.long()])


# ---------------------------------------------------------------------------------------
# tile_mean_pool

def torch_pool(x, tiling):
    """PyTorch's own pooling in x's dtype (for the 2x rule)."""
    B, S, H, D = x.shape
    V = tiling.tile_volume
    valid = tiling.slot_valid.view(-1, V).to(x.dtype)
    xs = x.view(B, -1, V, H, D) * valid[None, :, :, None, None]
    return xs.sum(2) / tiling.block_sizes.clamp(min=1).to(x.dtype)[None, :, None, None]


@pytest.mark.parametrize("grid,tile", GRIDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("input_scale", [1.0, 16.0])
def test_tile_mean_pool_matches_cpu_and_float64(grid, tile, dtype, input_scale):
    t = vidattn.VideoTiling(grid, tile, device="cuda")
    t_cpu = vidattn.VideoTiling(grid, tile)
    H = 3 if math.prod(grid) < 10_000 else 2
    x = randn((2, t.padded_len, H, 16), 5, dtype, input_scale)
    poison_allocator(2 * t.num_tiles * H * 16 * 8)
    got = vidattn.tile_mean_pool(x, t.block_sizes, t.tile_volume)
    # Same summation order as the CPU backend: bit-identical.
    assert torch.equal(got.cpu(), vidattn.tile_mean_pool(x.cpu(), t_cpu.block_sizes, t.tile_volume))
    want = ref.pool(x.double(), t, torch.float64)
    if dtype == torch.float64:
        assert (got - want).abs().max().item() <= 1e-12 * input_scale
    else:
        err = (got.double() - want).abs().max().item()
        torch_err = (torch_pool(x, t).double() - want).abs().max().item()
        bound = 2 * torch_err + FLOOR[dtype] * max(1.0, want.abs().max().item())
        assert err <= bound, f"error {err:.3e} > {bound:.3e}"
    # The backward, against the CPU op and the rule in float64.
    g = randn(got.shape, 6, dtype, input_scale)
    poison_allocator(2 * t.padded_len * H * 16 * 8)
    gx = ops.tile_mean_pool_backward(g, t.block_sizes, t.tile_volume)
    assert torch.equal(gx.cpu(), ops.tile_mean_pool_backward(g.cpu(), t_cpu.block_sizes, t.tile_volume))
    sizes = t.block_sizes.double().repeat_interleave(t.tile_volume)
    want_gx = g.double()[:, t.slot_tile.long()] / sizes[None, :, None, None]
    want_gx = want_gx * t.slot_valid[None, :, None, None]
    tol = 1e-15 if dtype == torch.float64 else {torch.float32: 1e-6, torch.float16: 1e-3,
                                              torch.bfloat16: 8e-3}[dtype]
    tiny = 6e-8 if dtype == torch.float16 else 1e-300  # float16 subnormal spacing
    assert ((gx.double() - want_gx).abs() <= tol * want_gx.abs() + tiny).all()


def test_tile_mean_pool_zero_tile_autograd_and_gradcheck():
    x = randn((1, 128, 1, 4), 7, torch.float64).requires_grad_()
    sizes = torch.tensor([0, 3], dtype=torch.int32, device="cuda")
    out = vidattn.tile_mean_pool(x, sizes, 64)
    assert torch.equal(out[0, 0], torch.zeros(1, 4, dtype=x.dtype, device="cuda"))
    torch.testing.assert_close(out[0, 1], x[0, 64:67].mean(0), atol=1e-15, rtol=0)
    (gx,) = torch.autograd.grad(out, x, torch.ones_like(out))
    assert torch.equal(gx[0, :64], torch.zeros_like(gx[0, :64]))
    assert torch.equal(gx[0, 64:67], torch.full_like(gx[0, 64:67], 1 / 3))
    assert torch.equal(gx[0, 67:], torch.zeros_like(gx[0, 67:]))
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4), device="cuda")
    xs = randn((1, t.padded_len, 2, 3), 8, torch.float64).requires_grad_()
    assert torch.autograd.gradcheck(lambda a: vidattn.tile_mean_pool(a, t.block_sizes, 64), (xs,))


# ---------------------------------------------------------------------------------------
# selection

def scores64(qc, kc, scale, cu_q=None, cu_k=None):
    """float64 coarse scores [B, Hq, Qt, Kt]; -inf outside each query tile's video."""
    g = qc.shape[2] // kc.shape[2]
    s = torch.einsum("bqhd,bkhd->bhqk", qc.double(), kc.double().repeat_interleave(g, 2)) * scale
    if cu_q is not None:
        allowed = torch.zeros(s.shape[-2:], dtype=torch.bool, device=s.device)
        cq, ck = cu_q.tolist(), cu_k.tolist()
        for i in range(len(cq) - 1):
            allowed[cq[i]:cq[i + 1], ck[i]:ck[i + 1]] = True
        s = s.masked_fill(~allowed, float("-inf"))
    return s


def check_selection(idx, cnt, s, want_count, rel_tol, cpu_idx, cpu_cnt):
    """idx must be the top `cnt` of the float64 scores s up to the kernel's rounding, ascending,
    -1 padded; equal to the CPU's choice on rows without near-ties."""
    assert torch.equal(cnt.cpu(), want_count.cpu().to(torch.int32))
    assert torch.equal(cnt.cpu(), cpu_cnt)
    K = idx.shape[-1]
    slot = torch.arange(K, device=idx.device)
    used = slot < cnt[..., None]
    assert (idx[~used] == -1).all()
    assert ((idx >= 0) | ~used).all() and (idx < s.shape[-1]).all()
    ascending = (idx[..., 1:] > idx[..., :-1]) | ~used[..., 1:]
    assert ascending.all()
    # Unused slots scatter into a spare last column (never onto a chosen tile).
    chosen = torch.zeros((*s.shape[:-1], s.shape[-1] + 1), dtype=torch.bool, device=s.device)
    chosen.scatter_(-1, torch.where(used, idx.long(), s.shape[-1]), True)
    chosen = chosen[..., :-1]
    finite = s.masked_fill(~torch.isfinite(s), 0)
    tol = rel_tol * (finite.abs().amax(-1, keepdim=True) + 1)
    allowed = s > float("-inf")
    worst_chosen = s.masked_fill(~chosen, float("inf")).amin(-1, keepdim=True)
    best_other = s.masked_fill(chosen | ~allowed, float("-inf")).amax(-1, keepdim=True)
    assert (worst_chosen >= best_other - tol).all(), "a chosen tile ranks below an unchosen one"
    # Rows whose k-th and (k+1)-th scores are well apart must match the CPU exactly.
    srt = s.sort(-1, descending=True).values
    kth = srt.gather(-1, (cnt.long() - 1).clamp(min=0)[..., None])
    nxt = srt.gather(-1, cnt.long().clamp(max=s.shape[-1] - 1)[..., None])
    clear = ((kth - nxt) > 4 * tol).squeeze(-1) | (cnt.long() == (allowed.sum(-1)))
    same = (idx.cpu() == cpu_idx).all(-1)
    assert same[clear.cpu()].all(), "differs from the CPU op on a row without near-ties"
    return clear.float().mean().item()


TOL = {torch.float64: 1e-12, torch.float32: 1e-5, torch.float16: 1e-5, torch.bfloat16: 1e-5}


@pytest.mark.parametrize("Qt,Kt,Hq,Hkv,D", [(1, 1, 1, 1, 4), (37, 53, 3, 3, 64), (62, 300, 6, 2, 128),
                                            (20, 1440, 2, 1, 128), (33, 517, 3, 1, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("topk", [1, 7, 10_000])
def test_topk_tiles_matches_float64_and_cpu(Qt, Kt, Hq, Hkv, D, dtype, topk):
    seed = Qt * 1000 + Kt + topk
    for input_scale in (1.0, 4.0, 16.0):
        qc = randn((2, Qt, Hq, D), seed, dtype, input_scale)
        kc = randn((2, Kt, Hkv, D), seed + 1, dtype, input_scale)
        poison_allocator(2 * Hq * Qt * min(topk, Kt) * 4)
        idx, cnt = ops.topk_tiles(qc, kc, topk)
        cpu_idx, cpu_cnt = ops.topk_tiles(qc.cpu(), kc.cpu(), topk)
        assert idx.shape == cpu_idx.shape
        s = scores64(qc, kc, 1 / math.sqrt(D))
        want = torch.full(cnt.shape, min(topk, Kt))
        frac = check_selection(idx, cnt, s, want, TOL[dtype], cpu_idx, cpu_cnt)
        assert frac > 0.5 or Kt <= topk or dtype != torch.float64
        idx2, cnt2 = ops.topk_tiles(qc, kc, topk)
        assert torch.equal(idx, idx2) and torch.equal(cnt, cnt2)  # bit-identical reruns


def test_topk_tiles_nan_inf_ties_and_scale():
    D = 16
    qc = randn((1, 9, 2, D), 20)
    kc = randn((1, 40, 2, D), 21)
    qc[0, 2] = float("nan")            # NaN scores everywhere: the first tiles
    qc[0, 3] = 0.0                     # +0 / -0 scores (NaN on the inf / NaN keys)
    kc[0, 5] = float("inf")            # +-inf / NaN in some key tiles
    kc[0, 7, :, 0] = float("nan")
    kc[0, 11] = kc[0, 12]              # exact ties: the lower index first
    for scale in (None, 0.5, -2.0):
        idx, cnt = ops.topk_tiles(qc, kc, 6, scale=scale)
        cidx, ccnt = ops.topk_tiles(qc.cpu(), kc.cpu(), 6, scale=scale)
        assert torch.equal(idx.cpu(), cidx) and torch.equal(cnt.cpu(), ccnt)
    assert idx[0, :, 2].tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    assert idx[0, :, 3].tolist() == [[0, 1, 2, 3, 4, 6]] * 2  # key 5: 0 * inf = NaN


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_tiles_nan_and_inf_on_the_tensor_core_path(dtype):
    """Half-precision inputs with a tensor-core head dim take the mma score path: a NaN query
    still ranks every key as -inf (the first tiles), a zero query still turns inf keys into
    NaN scores (0 * inf), and everything else stays valid."""
    D = 64
    qc = randn((1, 9, 2, D), 22, dtype)
    kc = randn((1, 40, 2, D), 23, dtype)
    qc[0, 2] = float("nan")
    qc[0, 3] = 0.0
    kc[0, 5] = float("inf")
    idx, cnt = ops.topk_tiles(qc, kc, 6)
    assert (cnt == 6).all()
    assert idx[0, :, 2].tolist() == [[0, 1, 2, 3, 4, 5]] * 2
    assert idx[0, :, 3].tolist() == [[0, 1, 2, 3, 4, 6]] * 2
    assert ((idx[..., 1:] > idx[..., :-1]).all())


# The tensor-core selection (bf16 / fp16, D in {32, 64, 128, 256}) bins each row's scores by
# value while it computes them and ranks only the threshold bin's candidates, falling back to
# the radix select when a bin holds more than 64. Integer-valued inputs with D = 64 (scale 1/8)
# make every score exact in fp32 whatever the summation order, so these rows must equal the CPU
# op bit for bit: ties around the threshold, all-equal rows, NaN / +-inf / signed-zero rows, a
# huge outlier that squeezes a row into one bin (candidate overflow), k = 1, k = n - 1, k = n.

def integer_tensor(shape, seed, low, high, dtype):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, high + 1, shape, generator=g).to(dtype).cuda()


def assert_topk_equals_cpu(qc, kc, topk, **kw):
    poison_allocator(qc.shape[0] * qc.shape[2] * qc.shape[1] * min(topk, kc.shape[1]) * 4 + 4096)
    idx, cnt = ops.topk_tiles(qc, kc, topk, **kw)
    cpu_kw = {key: (v.cpu() if isinstance(v, torch.Tensor) else v) for key, v in kw.items()}
    cidx, ccnt = ops.topk_tiles(qc.cpu(), kc.cpu(), topk, **cpu_kw)
    assert torch.equal(cnt.cpu(), ccnt)
    bad = (idx.cpu() != cidx).any(-1)
    assert not bad.any(), f"{int(bad.sum())} rows differ from the CPU op, first at {bad.nonzero()[0].tolist()}"
    return idx, cnt


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("Kt", [624, 1440, 97])
@pytest.mark.parametrize("spread", [1, 3, 40])
def test_topk_tiles_tensor_core_exact_ties(dtype, Kt, spread):
    D, Qt = 64, 40
    qc = integer_tensor((1, Qt, 2, D), Kt + spread, -spread, spread, dtype)
    kc = integer_tensor((1, Kt, 1, D), Kt + spread + 1, -spread, spread, dtype)
    qc[0, 1] = 0.0                      # all-equal row (zeros)
    qc[0, 2] = float("nan")             # NaN row: the first tiles
    qc[0, 3] = -0.0                     # signed zeros
    qc[0, 4] = 1.0                      # all keys one large bin below an outlier:
    kc[0, 7] = 60000.0 if dtype == torch.float16 else 1e30  # candidate overflow
    kc[0, 11] = kc[0, 12]               # exact ties between tiles: the lower index first
    kc[0, Kt - 1] = float("inf")        # inf scores (NaN where q is 0)
    kc[0, Kt // 2, :, 3] = float("-inf")
    for topk in (1, 2, 7, max(1, Kt // 10), Kt // 2, Kt - 1, Kt, Kt + 5):
        assert_topk_equals_cpu(qc, kc, topk)
    # The same with the scale's sign flipped (the bins' range reversed) and scale 1.
    assert_topk_equals_cpu(qc, kc, max(1, Kt // 10), scale=-0.125)
    assert_topk_equals_cpu(qc, kc, max(1, Kt // 10), scale=1.0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_topk_tiles_tensor_core_exact_few_values(dtype):
    # Rows taking only a few distinct values (thousands of ties in the threshold bin) and rows
    # where one value repeats just around the k-th position.
    D, Qt, Kt = 32, 33, 1440
    qc = integer_tensor((2, Qt, 3, D), 70, 0, 1, dtype)
    kc = integer_tensor((2, Kt, 3, D), 71, 0, 1, dtype)
    kc[:, ::5] = kc[:, :1]              # every 5th tile equal to tile 0
    for topk in (1, 144, 288, 1439):
        assert_topk_equals_cpu(qc, kc, topk, scale=1.0)


@pytest.mark.parametrize("sparsity", [None, 0.5, 0.9])
def test_topk_tiles_tensor_core_exact_packed_videos(sparsity):
    # Packed videos, tiny ones among them, so that CTAs of 16 query tiles straddle videos whose
    # key ranges get few or no sampled keys; per-row topk from the sparsity and -1 padding.
    grids_q = [(1, 1, 1), (5, 7, 9), (1, 1, 2), (2, 4, 4), (9, 10, 7), (1, 2, 1)]
    grids_k = [(2, 4, 4), (9, 10, 7), (1, 1, 1), (1, 1, 1), (21, 30, 52), (3, 17, 5)]
    tq = vidattn.VideoTiling(grids=grids_q, tile=(4, 4, 4), device="cuda")
    tk = vidattn.VideoTiling(grids=grids_k, tile=(4, 4, 4), device="cuda")
    D = 64
    for dtype in (torch.bfloat16, torch.float16):
        qc = integer_tensor((1, tq.num_tiles, 4, D), 80, -4, 4, dtype)
        kc = integer_tensor((1, tk.num_tiles, 2, D), 81, -4, 4, dtype)
        for topk in (1, 40, 700):
            assert_topk_equals_cpu(qc, kc, topk, sparsity=sparsity, cu_tiles_q=tq.cu_tiles,
                                   cu_tiles_k=tk.cu_tiles)


@pytest.mark.parametrize("sparsity", [None, 0.5, 0.9])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_topk_tiles_packed_videos(sparsity, dtype):
    grids_q = [(5, 7, 9), (1, 1, 1), (9, 10, 7), (3, 17, 5)]
    grids_k = [(9, 10, 7), (2, 4, 4), (5, 7, 9), (21, 30, 52)]
    tq = vidattn.VideoTiling(grids=grids_q, tile=(4, 4, 4), device="cuda")
    tk = vidattn.VideoTiling(grids=grids_k, tile=(4, 4, 4), device="cuda")
    D, topk = 32, 40
    qc = randn((1, tq.num_tiles, 6, D), 30, dtype, 4.0)
    kc = randn((1, tk.num_tiles, 3, D), 31, dtype, 4.0)
    kw = dict(sparsity=sparsity, cu_tiles_q=tq.cu_tiles, cu_tiles_k=tk.cu_tiles)
    idx, cnt = ops.topk_tiles(qc, kc, topk, **kw)
    cidx, ccnt = ops.topk_tiles(qc.cpu(), kc.cpu(), topk,
                                **dict(kw, cu_tiles_q=tq.cu_tiles.cpu(), cu_tiles_k=tk.cu_tiles.cpu()))
    s = scores64(qc, kc, 1 / math.sqrt(D), tq.cu_tiles, tk.cu_tiles)
    want = torch.empty(cnt.shape, dtype=torch.long)
    cq = tq.cu_tiles.tolist()
    for v, n in enumerate(tk.tiles_per_video):
        k_row = min(topk, n) if sparsity is None else min(vidattn.topk_from_sparsity(sparsity, n), topk)
        want[..., cq[v]:cq[v + 1]] = k_row
    check_selection(idx, cnt, s, want, TOL[dtype], cidx, ccnt)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_from_scores_equals_cpu(dtype):
    # Identical scores: the selection rule is exact, so the CUDA result must equal the CPU's,
    # ties (coarse rounding makes many), NaN, +-inf and signed zeros included.
    for Kt, topk in ((1, 1), (5, 2), (300, 30), (1500, 150), (64, 100)):
        s = randn((2, 3, 7, Kt), Kt + topk, torch.float64).mul(4).round().to(dtype)
        s[0, 0, 0] = float("nan")
        s[0, 0, 1] = float("-inf")
        s[0, 1, 2, ::3] = float("inf")
        s[1, 2, 3] = -0.0
        s[1, 2, 3, ::2] = 0.0
        poison_allocator(2 * 3 * 7 * min(topk, Kt) * 4)
        idx, cnt = ops.topk_tiles_from_scores(s, topk)
        cidx, ccnt = ops.topk_tiles_from_scores(s.cpu(), topk)
        assert torch.equal(idx.cpu(), cidx) and torch.equal(cnt.cpu(), ccnt)
        # Strided scores (unit last stride).
        wide = torch.zeros(2, 3, 7, Kt + 3, dtype=dtype, device="cuda")
        wide[..., 1:Kt + 1] = s
        idx2, _ = ops.topk_tiles_from_scores(wide[..., 1:Kt + 1], topk)
        assert torch.equal(idx2, idx)


def test_ops_capture_in_a_cuda_graph():
    # No host synchronisation: the whole coarse stage records into a CUDA graph.
    t = vidattn.VideoTiling((9, 10, 7), (4, 4, 4), device="cuda")
    x = randn((1, t.num_tokens, 2, 64), 40, torch.bfloat16)
    k = randn((1, t.num_tokens, 2, 64), 41, torch.bfloat16)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):  # warm-up outside capture
        ops.topk_tiles(vidattn.tile_mean_pool(t.tile(x), t.block_sizes, 64),
                       vidattn.tile_mean_pool(t.tile(k), t.block_sizes, 64), 5)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        qc = vidattn.tile_mean_pool(t.tile(x), t.block_sizes, 64)
        kc = vidattn.tile_mean_pool(t.tile(k), t.block_sizes, 64)
        idx, cnt = ops.topk_tiles(qc, kc, 5, sparsity=0.9)
        sidx, _ = ops.topk_tiles_from_scores(qc.float().permute(0, 2, 1, 3) @ kc.float().permute(0, 2, 3, 1), 5)
    graph.replay()
    torch.cuda.synchronize()
    want, _ = ops.topk_tiles(qc.cpu(), kc.cpu(), 5, sparsity=0.9)
    assert cnt.unique().tolist() == [vidattn.topk_from_sparsity(0.9, t.num_tiles)]
    assert (idx.cpu() == want).float().mean() > 0.9  # bf16 near-ties aside
    assert sidx.shape == (1, 2, t.num_tiles, 5)


def test_opcheck_coarse_ops_on_cuda():
    from torch.library import opcheck
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4), device="cuda")
    for rg in (False, True):
        x = randn((2, t.num_tokens, 2, 16), 50).requires_grad_(rg)
        opcheck(ops.gather_tokens, (x, t.slot_to_token, t.token_to_slot))
        q = randn((2, t.padded_len, 2, 64), 51).requires_grad_(rg)
        k = randn((2, t.padded_len, 1, 64), 52).requires_grad_(rg)
        opcheck(ops.tile_mean_pool, (q, t.block_sizes, 64))
        opcheck(ops.tile_mean_pool_backward, (randn((2, t.num_tiles, 2, 8), 53), t.block_sizes, 64))
        qc = ops.tile_mean_pool(q, t.block_sizes, 64).detach()
        kc = ops.tile_mean_pool(k, t.block_sizes, 64).detach()
        opcheck(ops.topk_tiles, (qc, kc, 3))
        opcheck(ops.topk_tiles, (qc[:1], kc[:1], 2),
                dict(sparsity=0.5, cu_tiles_q=t.cu_tiles, cu_tiles_k=t.cu_tiles))
        opcheck(ops.topk_tiles_from_scores, (randn((1, 2, 4, 6), 54), 2))


def test_bad_inputs_on_cuda():
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4), device="cuda")
    x = randn((1, t.padded_len, 1, 8), 60)
    with pytest.raises(ValueError, match="block_sizes"):
        vidattn.tile_mean_pool(x, t.block_sizes.cpu(), 64)
    with pytest.raises(ValueError, match="tile volume"):
        vidattn.tile_mean_pool(x, t.block_sizes, 32)
    qc = randn((1, 4, 3, 8), 61)
    with pytest.raises(ValueError, match="multiple"):
        ops.topk_tiles(qc, randn((1, 5, 2, 8), 62), 2)
    with pytest.raises(ValueError, match="topk"):
        ops.topk_tiles_from_scores(randn((1, 1, 2, 3), 63), 0)
