"""The fused VSA combine op (out = fine + gate * coarse on each tile's valid slots): forward
and both gradients against float64 math, padding, strides, opcheck, bad input; CPU always,
CUDA when there is a GPU."""
from __future__ import annotations

import pytest
import torch

import vidattn

ops = torch.ops.vidattn
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def make(seed, B, tiles, V, H, D, dtype, device, partial=True):
    g = torch.Generator().manual_seed(seed)
    fine = torch.randn((B, tiles * V, H, D), generator=g, dtype=torch.float64)
    coarse = torch.randn((B, tiles, H, D), generator=g, dtype=torch.float64)
    gate = torch.randn((B, tiles * V, H, D), generator=g, dtype=torch.float64)
    sizes = torch.full((tiles,), V, dtype=torch.int32)
    if partial and tiles > 1:
        sizes[0] = 0
        sizes[-1] = max(1, V // 3)
    to = lambda x: x.to(dtype).to(device)  # noqa: E731
    return to(fine), to(coarse), to(gate), sizes.to(device)


def reference(fine, coarse, gate, sizes, V):
    slots = torch.arange(fine.shape[1])
    tile = slots // V
    valid = (slots % V) < sizes.cpu().long()[tile]
    c = coarse.cpu().double()[:, tile] * valid[None, :, None, None]
    g = gate.cpu().double() if gate is not None else 1.0
    return fine.cpu().double() + g * c, valid


def rounding(dtype):
    return {torch.float64: 1e-12, torch.float32: 2e-6, torch.bfloat16: 2e-2,
            torch.float16: 3e-3}[dtype]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("V,H,D,use_gate", [(64, 3, 64, True), (128, 1, 40, False),
                                            (256, 2, 128, True), (64, 5, 8, True)])
def test_combine_forward_and_gradients(device, dtype, V, H, D, use_gate):
    fine, coarse, gate, sizes = make(V + H + D, 2, 3, V, H, D, dtype, device)
    gate = gate if use_gate else None
    # Padded slots of gate may hold anything: they must not leak into any result.
    if gate is not None:
        gate[:, 0 : V] = float("nan")
    xs = [x.clone().requires_grad_() for x in (fine, coarse)] + (
        [gate.clone().requires_grad_()] if gate is not None else [])
    out = ops.vsa_combine(xs[0], xs[1], xs[2] if gate is not None else None, sizes, V)
    ref, valid = reference(fine, coarse, gate, sizes, V)
    ref = torch.where(valid[None, :, None, None], ref, fine.cpu().double())
    tol = rounding(dtype) * max(1.0, ref.abs().max().item())
    assert out.shape == fine.shape and out.device.type == device
    assert (out.cpu().double() - ref).abs().max().item() <= tol

    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7),
                       dtype=torch.float64).to(dtype).to(device)
    grads = torch.autograd.grad(out, xs, gout)
    gout64 = gout.cpu().double()
    assert torch.equal(grads[0], gout)  # d out / d fine is the identity
    g64 = gate.cpu().double().nan_to_num(0.0) if gate is not None else torch.ones_like(gout64)
    contrib = gout64 * g64 * valid[None, :, None, None]
    ref_dc = contrib.reshape(2, 3, V, H, D).sum(2)
    tol_c = rounding(dtype) * max(1.0, ref_dc.abs().max().item()) * 4
    assert (grads[1].cpu().double() - ref_dc).abs().max().item() <= tol_c
    if gate is not None:
        tile = torch.arange(3 * V) // V
        ref_dg = gout64 * coarse.cpu().double()[:, tile] * valid[None, :, None, None]
        assert not torch.isnan(grads[2]).any()
        tol_g = rounding(dtype) * max(1.0, ref_dg.abs().max().item())
        assert (grads[2].cpu().double() - ref_dg).abs().max().item() <= tol_g


@pytest.mark.parametrize("device", DEVICES)
def test_combine_accepts_strided_views_and_empty_inputs(device):
    fine, coarse, gate, sizes = make(3, 1, 2, 64, 4, 64, torch.bfloat16, device)
    wide = torch.zeros((1, 128, 4, 96), dtype=torch.bfloat16, device=device)
    wide[..., :64] = gate
    strided_gate = wide[..., :64]
    assert not strided_gate.is_contiguous()
    a = ops.vsa_combine(fine, coarse, strided_gate, sizes, 64)
    b = ops.vsa_combine(fine, coarse, gate.contiguous(), sizes, 64)
    assert torch.equal(a, b)
    empty = ops.vsa_combine(fine[:0], coarse[:0], None, sizes, 64)
    assert empty.shape == (0, 128, 4, 64)


@pytest.mark.parametrize("device", DEVICES)
def test_combine_is_deterministic(device):
    fine, coarse, gate, sizes = make(4, 2, 4, 64, 2, 128, torch.bfloat16, device)
    gout = torch.randn(fine.shape, generator=torch.Generator().manual_seed(1)).to(fine)
    first = ops.vsa_combine_backward(gout, coarse, gate, sizes, 64)
    for _ in range(5):
        again = ops.vsa_combine_backward(gout, coarse, gate, sizes, 64)
        assert all(torch.equal(x, y) for x, y in zip(first, again))


def test_combine_opcheck():
    fine, coarse, gate, sizes = make(5, 1, 2, 64, 2, 64, torch.float32, "cpu")
    for g in (gate, None):
        torch.library.opcheck(ops.vsa_combine.default,
                              (fine.requires_grad_(), coarse.requires_grad_(), g, sizes, 64))


@pytest.mark.parametrize("bad,exc,match", [
    (dict(tile_volume=32), ValueError, "tile volume"),
    (dict(coarse_tiles=3), ValueError, "'coarse' must have shape"),
    (dict(gate_dtype=torch.float16), TypeError, "'gate' must have dtype"),
    (dict(sizes_dtype=torch.int64), TypeError, "'block_sizes' must have dtype int32"),
    (dict(sizes_len=3), ValueError, "'block_sizes'"),
    (dict(sizes_value=65), ValueError, r"block sizes must lie in \[0, 64\]"),
    (dict(slots=100), ValueError, "not a multiple of the tile volume"),
])
def test_combine_bad_input(bad, exc, match):
    fine, coarse, gate, sizes = make(6, 1, 2, 64, 2, 64, torch.float32, "cpu")
    V = bad.get("tile_volume", 64)
    if "coarse_tiles" in bad:
        coarse = torch.zeros((1, bad["coarse_tiles"], 2, 64))
    if "gate_dtype" in bad:
        gate = gate.to(bad["gate_dtype"])
    if "sizes_dtype" in bad:
        sizes = sizes.to(bad["sizes_dtype"])
    if "sizes_len" in bad:
        sizes = torch.full((bad["sizes_len"],), 64, dtype=torch.int32)
    if "sizes_value" in bad:
        sizes = torch.full((2,), bad["sizes_value"], dtype=torch.int32)
    if "slots" in bad:
        fine = fine[:, : bad["slots"]]
        gate = gate[:, : bad["slots"]]
    with pytest.raises(exc, match=match):
        ops.vsa_combine(fine, coarse, gate, sizes, V)


def test_vsa_op_output_matches_unfused_composition():
    """video_sparse_attention composes through the fused op; the result equals the
    unfused torch composition of its own branches (float64: exact up to rounding)."""
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    g = torch.Generator().manual_seed(9)
    q, k, v, gate = (t.tile(torch.randn((1, t.num_tokens, 2, 64), generator=g,
                                        dtype=torch.float64)) for _ in range(4))
    out, (idx, cnt) = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=3, gate=gate,
                                                     return_selection=True)
    qc, kc, vc = (vidattn.tile_mean_pool(x, t.block_sizes, 64) for x in (q, k, v))
    o_c = vidattn.attention(qc, kc, vc)
    o_s = vidattn.block_sparse_attention(q, k, v, idx, cnt, q_block_sizes=t.block_sizes,
                                         kv_block_sizes=t.block_sizes)
    expected = t.broadcast_tiles(o_c) * gate + o_s
    assert (out - expected).abs().max().item() <= 1e-12


# ---- vsa_combine_rows: the combination on a run of raster rows (sequence-parallel layer) ----

def make_rows(seed, tiling, first, R, B, H, D, dtype, coarse_dtype, device):
    g = torch.Generator().manual_seed(seed)
    fine, gate = (torch.randn((B, R, H, D), generator=g, dtype=torch.float64) for _ in range(2))
    coarse = torch.randn((B, tiling.num_tiles, H, D), generator=g, dtype=torch.float64)
    return fine.to(dtype).to(device), coarse.to(coarse_dtype).to(device), gate.to(dtype).to(device)


def rows_reference(fine, coarse, gate, tiling, first):
    """float64: out, d coarse / d gate factors by the tiled path's own maps."""
    R = fine.shape[1]
    tokens = torch.arange(first, first + R)
    real = tokens < tiling.num_tokens
    tile = torch.zeros(R, dtype=torch.long)
    tile[real] = tiling.token_to_slot.cpu().long()[tokens[real]] // tiling.tile_volume
    c = coarse.cpu().double()[:, tile] * real[None, :, None, None]
    g = gate.cpu().double() if gate is not None else 1.0
    return fine.cpu().double() + g * c, tile, real


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,coarse_dtype", [
    (torch.float64, torch.float64), (torch.float32, torch.float32),
    (torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32)])
@pytest.mark.parametrize("grid,tile,first,R,H,D,use_gate", [
    ((3, 5, 9), (4, 4, 4), 0, 135, 2, 64, True),      # every token, no padding row
    ((3, 5, 9), (4, 4, 4), 50, 91, 3, 8, True),       # the second half and 6 padding rows
    ((5, 6, 7), (2, 8, 8), 17, 100, 1, 128, False),   # a middle run, no gate
    ((4, 9, 8), (4, 8, 8), 200, 130, 2, 40, True)])   # odd D: the unvectorised path
def test_combine_rows_forward_and_gradients(device, dtype, coarse_dtype, grid, tile, first, R,
                                            H, D, use_gate):
    t = vidattn.VideoTiling(grid, tile, device=device)
    fine, coarse, gate = make_rows(R + H + D, t, first, R, 2, H, D, dtype, coarse_dtype, device)
    gate = gate if use_gate else None
    xs = [x.clone().requires_grad_() for x in (fine, coarse)] + (
        [gate.clone().requires_grad_()] if gate is not None else [])
    out = ops.vsa_combine_rows(xs[0], xs[1], xs[2] if gate is not None else None,
                               t.token_to_slot, t.slot_to_token, t.tile_volume, first)
    ref, tile_of, real = rows_reference(fine, coarse, gate, t, first)
    assert out.shape == fine.shape and out.dtype == dtype and out.device.type == device
    tol = rounding(dtype) * max(1.0, ref.abs().max().item())
    assert (out.cpu().double() - ref).abs().max().item() <= tol
    assert torch.equal(out[:, ~real.to(device)], fine[:, ~real.to(device)])  # padding rows

    gout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3),
                       dtype=torch.float64).to(dtype).to(device)
    grads = torch.autograd.grad(out, xs, gout)
    assert torch.equal(grads[0], gout)
    assert grads[1].dtype == coarse_dtype
    gout64 = gout.cpu().double()
    g64 = gate.cpu().double() if gate is not None else torch.ones_like(gout64)
    contrib = (gout64 * g64)[:, real]
    ref_dc = torch.zeros((2, t.num_tiles, H, D), dtype=torch.float64)
    ref_dc.index_add_(1, tile_of[real], contrib)
    if coarse_dtype == torch.float32 and dtype != torch.float32:
        # float32 sums of exact products of 16-bit values, never rounded to 16 bits: the
        # bound of up to 256 float32 additions.
        abs_sum = torch.zeros_like(ref_dc).index_add_(1, tile_of[real], contrib.abs())
        tol_c = 256 * 2.0 ** -24 * max(1.0, abs_sum.max().item())
    else:
        tol_c = rounding(dtype) * max(1.0, ref_dc.abs().max().item()) * 4
    assert (grads[1].cpu().double() - ref_dc).abs().max().item() <= tol_c
    if gate is not None:
        ref_dg = gout64 * coarse.cpu().double()[:, tile_of] * real[None, :, None, None]
        tol_g = rounding(dtype) * max(1.0, ref_dg.abs().max().item())
        assert (grads[2].cpu().double() - ref_dg).abs().max().item() <= tol_g
        assert torch.equal(grads[2][:, ~real.to(device)],
                           torch.zeros_like(grads[2][:, ~real.to(device)]))


@pytest.mark.parametrize("device", DEVICES)
def test_combine_rows_partial_sums_add_up_to_the_tiled_op(device):
    """Two runs of rows that split a video (as two ranks hold it): their outputs are the tiled
    op's output untiled, bit for bit, and their float32 coarse gradients add up to the tiled
    op's (the layer's all-gather backward sums them)."""
    t = vidattn.VideoTiling((6, 7, 10), (4, 4, 4), device=device)
    g = torch.Generator().manual_seed(11)
    fine, gate = (torch.randn((1, t.num_tokens, 3, 64), generator=g).to(torch.bfloat16).to(device)
                  for _ in range(2))
    coarse = torch.randn((1, t.num_tiles, 3, 64), generator=g).to(torch.bfloat16).to(device)
    gout = torch.randn(fine.shape, generator=g).to(torch.bfloat16).to(device)
    tiled = ops.vsa_combine(t.tile(fine), coarse, t.tile(gate), t.block_sizes, 64)
    dc_tiled, dg_tiled = ops.vsa_combine_backward(t.tile(gout), coarse, t.tile(gate),
                                                  t.block_sizes, 64)
    half = (t.num_tokens + 1) // 2
    outs, dcs, dgs = [], [], []
    for lo in (0, half):
        rows = slice(lo, min(lo + half, t.num_tokens))
        pad = lo + half - min(lo + half, t.num_tokens)  # the last run's padding row
        f, gt, go = (torch.nn.functional.pad(x[:, rows], (0, 0, 0, 0, 0, pad))
                     for x in (fine, gate, gout))
        outs.append(ops.vsa_combine_rows(f, coarse.float(), gt, t.token_to_slot,
                                         t.slot_to_token, 64, lo)[:, :half - pad])
        dc, dg = ops.vsa_combine_rows_backward(go, coarse.float(), gt, t.token_to_slot,
                                               t.slot_to_token, 64, lo)
        dcs.append(dc)
        dgs.append(dg[:, :half - pad])
    assert torch.equal(torch.cat(outs, dim=1), t.untile(tiled))
    assert torch.equal(torch.cat(dgs, dim=1), t.untile(dg_tiled))
    summed = (dcs[0] + dcs[1]).to(torch.bfloat16)
    # float32 sums in another order, rounded once to bf16: at most one bf16 step apart.
    step = dc_tiled.float().abs() * 2 ** -7 + 1e-6
    assert ((summed.float() - dc_tiled.float()).abs() <= step).all()


def test_combine_rows_opcheck():
    t = vidattn.VideoTiling((3, 5, 6), (4, 4, 4))
    fine, coarse, gate = make_rows(5, t, 20, 50, 1, 2, 64, torch.float32, torch.float32, "cpu")
    for g in (gate, None):
        torch.library.opcheck(ops.vsa_combine_rows.default,
                              (fine.requires_grad_(), coarse.requires_grad_(), g,
                               t.token_to_slot, t.slot_to_token, 64, 20))


@pytest.mark.parametrize("bad,exc,match", [
    (dict(first=-1), ValueError, "first_token must be >= 0"),
    (dict(coarse_dtype=torch.float16), TypeError, "'coarse' must have dtype bfloat16 .* or float32"),
    (dict(coarse_tiles=2), ValueError, "'coarse' must have shape"),
    (dict(maps="swapped"), ValueError, "slot_to_token|tile volume|inverse maps"),
    (dict(maps="corrupt"), ValueError, "not the inverse maps of one tiling"),
    (dict(maps="int64"), TypeError, "'token_to_slot' must have dtype int32"),
    (dict(gate_shape=True), ValueError, "'gate' must have shape"),
])
def test_combine_rows_bad_input(bad, exc, match):
    t = vidattn.VideoTiling((3, 5, 6), (4, 4, 4))
    fine, coarse, gate = make_rows(6, t, 0, 40, 1, 2, 64, torch.bfloat16, torch.bfloat16, "cpu")
    t2s, s2t = t.token_to_slot, t.slot_to_token
    if "coarse_dtype" in bad:
        coarse = coarse.to(bad["coarse_dtype"])
    if "coarse_tiles" in bad:
        coarse = coarse[:, :bad["coarse_tiles"]]
    if bad.get("maps") == "swapped":
        t2s, s2t = s2t, t2s
    if bad.get("maps") == "corrupt":
        t2s = t2s.clone()
        t2s[3] = t2s[4]
    if bad.get("maps") == "int64":
        t2s = t2s.long()
    if "gate_shape" in bad:
        gate = gate[:, :39]
    with pytest.raises(exc, match=match):
        ops.vsa_combine_rows(fine, coarse, gate, t2s, s2t, 64, bad.get("first", 0))


# ---- vsa_combine_rows_into: the same combination written into a given (strided) tensor ----

@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,coarse_dtype", [
    (torch.float32, torch.float32), (torch.bfloat16, torch.float32),
    (torch.float16, torch.float16)])
@pytest.mark.parametrize("use_gate", [True, False])
def test_combine_rows_into_writes_the_functional_result_into_a_view(device, dtype, coarse_dtype,
                                                                  use_gate):
    """What the sequence-parallel layer does with a returned chunk: the output is some heads
    of a larger tensor (head group as the batch dimension), the gate a strided view too.
    The written elements equal vsa_combine_rows bit for bit; every other element of the
    larger tensor keeps its NaN poison."""
    t = vidattn.VideoTiling((3, 5, 9), (4, 4, 4), device=device)
    world, R, h_local, D, h0, h1, first = 2, 70, 5, 64, 1, 4, 65  # rows 65..134 + 1 padding
    fine, coarse, _ = make_rows(21, t, first, R, world, h1 - h0, D, dtype, coarse_dtype, device)
    gate_full = torch.randn((1, R, world * h_local, D), generator=torch.Generator().manual_seed(4),
                            dtype=torch.float64).to(dtype).to(device)
    gate = gate_full[0].unflatten(1, (world, h_local))[:, :, h0:h1].permute(1, 0, 2, 3)
    gate = gate if use_gate else None
    expected = ops.vsa_combine_rows(fine, coarse, gate, t.token_to_slot, t.slot_to_token,
                                    t.tile_volume, first)
    result = torch.full((R, world, h_local, D), float("nan"), dtype=dtype, device=device)
    out = result[:, :, h0:h1].permute(1, 0, 2, 3)
    assert not out.is_contiguous()
    version = result._version
    ops.vsa_combine_rows_into(out, fine, coarse, gate, t.token_to_slot, t.slot_to_token,
                              t.tile_volume, first)
    assert torch.equal(out, expected)
    assert result[:, :, :h0].isnan().all() and result[:, :, h1:].isnan().all()
    assert result._version > version  # autograd's in-place bookkeeping sees the write


def test_combine_rows_into_refuses_autograd_and_checks_out():
    t = vidattn.VideoTiling((3, 5, 6), (4, 4, 4))
    fine, coarse, gate = make_rows(7, t, 0, 40, 1, 2, 64, torch.float32, torch.float32, "cpu")
    out = torch.empty_like(fine)
    args = (t.token_to_slot, t.slot_to_token, 64, 0)
    with pytest.raises(RuntimeError, match="has no gradient; .* use vidattn.vsa_combine_rows"):
        ops.vsa_combine_rows_into(out, fine.clone().requires_grad_(), coarse, gate, *args)
    with torch.no_grad():  # the same call without autograd recording is fine
        ops.vsa_combine_rows_into(out, fine.clone().requires_grad_(), coarse, gate, *args)
    assert torch.equal(out, ops.vsa_combine_rows(fine, coarse, gate, *args))
    with pytest.raises(ValueError, match="'out' must have shape"):
        ops.vsa_combine_rows_into(out[:, :39], fine, coarse, gate, *args)
    with pytest.raises(TypeError, match="'out' must have dtype"):
        ops.vsa_combine_rows_into(out.double(), fine, coarse, gate, *args)
    torch.library.opcheck(ops.vsa_combine_rows_into.default,
                          (out, fine, coarse, gate, *args))


# ---- vsa_fine_combined: the fine branch and the combination in one op (inference) ------------

def fine_combined_case(device, dtype=torch.float32, V=64, D=32, seed=60):
    from test_vsa import random_index
    g = torch.Generator().manual_seed(seed)
    B, H, Qt, Kt = 1, 2, 5, 4
    q, k, v = (torch.randn((B, n * V, H, D), generator=g).to(dtype).to(device)
               for n in (Qt, Kt, Kt))
    idx, cnt = random_index(B, H, Qt, Kt, 3, seed + 1)
    coarse = torch.randn((B, Qt, H, D), generator=g).to(dtype).to(device)
    gate = torch.randn((B, Qt * V, H, D), generator=g).to(dtype).to(device)
    qs = torch.tensor([V, 1, 0, V // 2, V - 1], dtype=torch.int32).to(device)
    ks = torch.tensor([V, 3, V, 0], dtype=torch.int32).to(device)
    return (q, k, v, idx.to(device), cnt.to(device)), coarse, gate, qs, ks


@pytest.mark.parametrize("use_gate", [True, False])
def test_fine_combined_equals_block_sparse_then_combine(use_gate):
    # float32 at D = 32 runs on the CPU only; CUDA's cases (16-bit, D 64 / 128, the fused
    # Hopper kernel) are in test_block_sparse_cuda.py.
    args, coarse, gate, qs, ks = fine_combined_case("cpu")
    gate = gate if use_gate else None
    fine, lse = ops.block_sparse_attention(*args, q_block_sizes=qs, kv_block_sizes=ks)
    want = (ops.vsa_combine(fine, coarse, gate, qs, 64), fine, lse)
    got = ops.vsa_fine_combined(*args, coarse, gate, qs, kv_block_sizes=ks)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


def test_fine_combined_refuses_gradients_and_passes_opcheck():
    args, coarse, gate, qs, ks = fine_combined_case("cpu")
    q = args[0].clone().requires_grad_()
    with pytest.raises(RuntimeError, match="inference only .* vidattn.block_sparse_attention"):
        ops.vsa_fine_combined(q, *args[1:], coarse, gate, qs, kv_block_sizes=ks)
    with torch.no_grad():
        out, _, _ = ops.vsa_fine_combined(q, *args[1:], coarse, gate, qs, kv_block_sizes=ks)
    assert not out.requires_grad
    torch.library.opcheck(ops.vsa_fine_combined.default, (*args, coarse, gate, qs),
                          {"kv_block_sizes": ks})


@pytest.mark.parametrize("bad,exc,match", [
    ("coarse_tiles", ValueError, "'coarse' must have shape"),
    ("gate_dtype", TypeError, "'gate' must have dtype"),
    ("gate_shape", ValueError, "'gate' must have shape"),
    ("sizes_dtype", TypeError, "q_block_sizes"),
    ("coarse_dtype", TypeError, "'coarse' must have dtype"),
])
def test_fine_combined_bad_input_names_the_argument(bad, exc, match):
    args, coarse, gate, qs, ks = fine_combined_case("cpu")
    if bad == "coarse_tiles":
        coarse = coarse[:, :4]
    elif bad == "gate_dtype":
        gate = gate.double()
    elif bad == "gate_shape":
        gate = gate[:, :64]
    elif bad == "sizes_dtype":
        qs = qs.long()
    elif bad == "coarse_dtype":
        coarse = coarse.double()
    with pytest.raises(exc, match=match):
        ops.vsa_fine_combined(*args, coarse, gate, qs, kv_block_sizes=ks)
