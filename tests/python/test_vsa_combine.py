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
