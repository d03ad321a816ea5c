"""CUDA attention at every head-dim width the portable kernels serve: D (q, k) and Dv (v) any
multiples of 8 up to 256, Dv != D included (src/cuda/dispatch/head_dims.h maps them to the
padded instances). Forward and backward against the float64 reference with the rule of
docs/conventions.md, outputs on NaN-poisoned memory (a column the stores skip by mistake, or
one they write past the real head dim, shows up), dense (masks, varlen, GQA, causal, Sq != Sk,
odd sizes, misaligned rows), block-sparse and VSA. On Hopper the dense forward at these dims
runs the padded sm_90a instances (test_attention_sm90.py tests their paths), the rest the
portable kernels. Skipped without a GPU.
"""
from __future__ import annotations

import zlib

import pytest
import torch

import vidattn
import vsa_reference as vref
from cuda_poison import poison_allocator
from test_attention_cuda import check_varlen, cu, gen, randn, run_and_check
from test_block_sparse_cuda import assert_follows_rule, make_case
from test_vsa import assert_2x

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"

# (D, Dv): every padded width (64, 96, 128, 192, 256) at its smallest and largest dims, the
# field's dims (72, 80, 96, 256), and Dv != D both ways, across widths and within one.
HEAD_DIMS = [
    (8, 8), (40, 40), (72, 72), (80, 80), (96, 96), (120, 120), (136, 136), (192, 192),
    (200, 200), (256, 256), (192, 128), (64, 128), (128, 64), (24, 248), (256, 8),
]


def dims_id(p):
    return f"D{p[0]}_Dv{p[1]}"


def dtype_of(d, dv):
    """Both dtypes over the list without doubling it."""
    return torch.bfloat16 if (d // 8 + dv // 8) % 2 == 0 else torch.float16


def qkv(B, Sq, Sk, Hq, Hkv, D, Dv, dtype, seed, input_scale=4.0):
    g = gen(seed)
    return (randn((B, Sq, Hq, D), dtype, g, input_scale), randn((B, Sk, Hkv, D), dtype, g,
                                                                 input_scale),
            randn((B, Sk, Hkv, Dv), dtype, g))


# ---- dense ----------------------------------------------------------------------------------

@pytest.mark.parametrize("dims", HEAD_DIMS, ids=dims_id)
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_dense_head_dims_match_reference(dims, causal):
    """GQA, Sq != Sk, lengths that are no multiple of a block."""
    D, Dv = dims
    seed = zlib.crc32(repr(("dense", dims, causal)).encode())
    q, k, v = qkv(2, 77, 130, 4, 2, D, Dv, dtype_of(D, Dv), seed)
    run_and_check(q, k, v, causal=causal, seed=seed)


@pytest.mark.parametrize("dims", [(40, 40), (96, 96), (192, 128), (256, 256), (64, 128)],
                         ids=dims_id)
def test_padding_masks_at_head_dims(dims):
    D, Dv = dims
    g = gen(100 + D + Dv)
    B, Sq, Sk, H = 3, 70, 100, 2
    q, k, v = qkv(B, Sq, Sk, H, H, D, Dv, dtype_of(D, Dv), 200 + D + Dv)
    kmask = torch.rand((B, Sk), generator=g, device=DEV) > 0.3
    qmask = torch.rand((B, Sq), generator=g, device=DEV) > 0.2
    kmask[1] = False  # every row of this batch entry sees nothing
    run_and_check(q, k, v, causal=True, kmask=kmask, qmask=qmask, seed=D + Dv)


@pytest.mark.parametrize("dims", [(72, 72), (128, 64), (256, 256), (8, 136)], ids=dims_id)
def test_varlen_at_head_dims(dims):
    D, Dv = dims
    dtype = dtype_of(D, Dv)
    g = gen(300 + D + Dv)
    lq, lk = [5, 0, 130, 1, 64], [7, 3, 0, 1, 90]
    Hq, Hkv = 4, 2
    q = randn((sum(lq), Hq, D), dtype, g, 4.0)
    k = randn((sum(lk), Hkv, D), dtype, g, 4.0)
    v = randn((sum(lk), Hkv, Dv), dtype, g)
    gout = randn((sum(lq), Hq, Dv), dtype, g)
    poison_allocator(q.numel() * 8 + (1 << 20))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = vidattn.attention_varlen(*leaves, cu(lq), cu(lk), max(lq), max(lk), causal=True,
                                        return_lse=True)
    assert out.shape == (sum(lq), Hq, Dv) and lse.shape == (Hq, sum(lq))
    dq, dk, dv = torch.autograd.grad(out, leaves, gout)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    check_varlen(q, k, v, lq, lk, out, causal=True, lse=lse, grads=(dq, dk, dv), gout=gout)


def test_misaligned_rows_at_a_padded_head_dim():
    """Rows that do not start on 16 bytes take the element-wise loads, whose column predicate
    must match the cp.async one."""
    g = gen(400)
    B, S, H, D = 1, 70, 2, 40
    n = B * S * H * D
    flat = randn((3 * n + 1,), torch.bfloat16, g).requires_grad_()
    q, k, v = (flat[1 + i * n: 1 + (i + 1) * n].view(B, S, H, D) for i in range(3))
    assert q.data_ptr() % 16 != 0
    run_and_check(q, k, v, causal=True, seed=400, clone_inputs=False)


def test_strided_packed_views_at_a_padded_head_dim():
    """q, k, v slices of one packed [B, S, 3, H, D] tensor: row strides far above D."""
    g = gen(500)
    qkv_packed = randn((2, 90, 3, 3, 80), torch.float16, g, 4.0)
    q, k, v = qkv_packed.unbind(2)
    run_and_check(q, k, v, seed=500)


def test_padded_columns_of_the_inputs_are_never_read():
    """The columns past D / Dv of a wider buffer hold NaN: slices [..., :D] of it must give the
    same result as contiguous copies (the loads stop at the real head dim)."""
    g = gen(600)
    D, Dv = 72, 40
    wide = torch.full((1, 100, 2, 96), float("nan"), device=DEV, dtype=torch.bfloat16)
    q, k, v = (wide.clone() for _ in range(3))
    q[..., :D] = randn((1, 100, 2, D), torch.bfloat16, g)
    k[..., :D] = randn((1, 100, 2, D), torch.bfloat16, g)
    v[..., :Dv] = randn((1, 100, 2, Dv), torch.bfloat16, g)
    views = (q[..., :D], k[..., :D], v[..., :Dv])
    out = vidattn.attention(*views)
    ref = vidattn.attention(*(t.contiguous() for t in views))
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref)


# ---- block-sparse and VSA ----------------------------------------------------------------

SPARSE_CASES = [  # dtype, V, B, Hq, Hkv, D, Dv, Qt, Kt, MaxK, input scale
    (torch.bfloat16, 64, 2, 3, 1, 80, 80, 4, 5, 3, 4.0),
    (torch.float16, 128, 1, 4, 2, 96, 96, 3, 4, 3, 16.0),
    (torch.bfloat16, 128, 2, 2, 2, 192, 128, 3, 3, 2, 4.0),
    (torch.float16, 256, 1, 2, 1, 256, 256, 2, 3, 2, 4.0),
    (torch.bfloat16, 64, 1, 2, 2, 256, 256, 3, 4, 3, 1.0),
    (torch.float16, 64, 2, 2, 1, 40, 72, 3, 4, 4, 4.0),
    (torch.bfloat16, 256, 1, 2, 2, 128, 64, 2, 3, 2, 16.0),
]


@pytest.mark.parametrize("case", SPARSE_CASES, ids=lambda c: "{}_V{}_B{}_H{}x{}_D{}_Dv{}".format(
    str(c[0])[6:], *c[1:7]))
def test_block_sparse_head_dims_match_reference(case):
    dtype, V, B, Hq, Hkv, D, Dv, Qt, Kt, max_k, input_scale = case
    seed = zlib.crc32(repr(case).encode()) % 100_000
    q, k, _, idx, cnt, q_sizes, kv_sizes = make_case(dtype, V, B, Hq, Hkv, D, Qt, Kt, max_k,
                                                     input_scale, seed)
    v = (torch.randn((B, Kt * V, Hkv, Dv), generator=torch.Generator().manual_seed(seed + 2),
                     dtype=torch.float64)).to(dtype)
    scale = D ** -0.5
    qc, kc, vc = (x.to(DEV).requires_grad_() for x in (q, k, v))
    poison_allocator(q.numel() * 8 + (1 << 20))
    out, lse = vidattn.block_sparse_attention(
        qc, kc, vc, idx.to(DEV), cnt.to(DEV), tile_volume=V, q_block_sizes=q_sizes.to(DEV),
        kv_block_sizes=kv_sizes.to(DEV), return_lse=True)
    assert out.shape == (B, Qt * V, Hq, Dv) and out.dtype == dtype
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 4),
                       dtype=torch.float64).to(dtype)
    poison_allocator(q.numel() * 8 + (1 << 20))
    grads = torch.autograd.grad(out, (qc, kc, vc), dout.to(DEV))
    assert_follows_rule(out, lse, q, k, v, idx, cnt, V, q_sizes, kv_sizes, scale, dtype, dout,
                        grads)


@pytest.mark.parametrize("D,dtype", [(80, torch.bfloat16), (192, torch.float16)])
def test_vsa_at_head_dims(D, dtype):
    """The whole VSA op (coarse attention, top-k, fine block-sparse, combine) at a padded head
    dim, against the reference run with the selection the GPU made."""
    grid, tile, topk = (5, 7, 9), (4, 4, 4), 3
    seed = 700 + D
    t = vidattn.VideoTiling(grid, tile, device=DEV)

    def rnd(shape, s, scale=1.0):
        return (torch.randn(shape, generator=torch.Generator().manual_seed(s),
                            dtype=torch.float64) * scale).to(dtype).to(DEV)

    B, H = 1, 2
    q = t.tile(rnd((B, t.num_tokens, H, D), seed, 4.0))
    k = t.tile(rnd((B, t.num_tokens, H, D), seed + 1, 4.0))
    v = t.tile(rnd((B, t.num_tokens, H, D), seed + 2))
    gate = rnd(q.shape, seed + 3)
    dout = rnd(q.shape, seed + 4)
    inputs = [x.requires_grad_() for x in (q, k, v, gate)]
    out, (idx, cnt) = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=topk, gate=gate,
                                                     return_selection=True)
    grads = torch.autograd.grad(out, inputs, dout)
    t_cpu = vidattn.VideoTiling(grid, tile)

    def run_ref(dt):
        xs = [x.detach().cpu().to(dt).requires_grad_() for x in inputs]
        o = vref.video_sparse(xs[0], xs[1], xs[2], t_cpu, None, idx.cpu(), cnt.cpu(), xs[3],
                              None)
        return (o, *torch.autograd.grad(o, xs, dout.cpu().to(dt)))

    r64, rlp = run_ref(torch.float64), run_ref(dtype)
    magnitude = max(r.abs().max().item() for r in r64)
    for name, got, a, b in zip(("out", "dq", "dk", "dv", "dgate"), (out, *grads), r64, rlp):
        assert_2x(name, got.cpu(), a, b, dtype, 3.0 if name == "dq" else 2.0, magnitude)


# ---- errors and dispatch --------------------------------------------------------------------

@pytest.mark.parametrize("dims", [(100, 100), (264, 264), (64, 12), (4, 4), (128, 512)],
                         ids=dims_id)
def test_unsupported_head_dims_raise_not_implemented(dims):
    D, Dv = dims
    q = torch.zeros((1, 64, 2, D), dtype=torch.bfloat16, device=DEV)
    v = torch.zeros((1, 64, 2, Dv), dtype=torch.bfloat16, device=DEV)
    msg = rf"multiples of 8 from 8 to 256, got D = {D}, Dv = {Dv}"
    with pytest.raises(NotImplementedError, match=msg):
        vidattn.attention(q, q, v)
    idx = torch.zeros((1, 2, 1, 1), dtype=torch.int32, device=DEV)
    cnt = torch.ones((1, 2, 1), dtype=torch.int32, device=DEV)
    with pytest.raises(NotImplementedError, match=msg):
        vidattn.block_sparse_attention(q, q, v, idx, cnt, tile_volume=64)


@pytest.mark.skipif(not torch.cuda.is_available() or
                    torch.cuda.get_device_capability() != (9, 0)
                    or not hasattr(torch.ops.vidattn, "_sm90_forward_launches"),
                    reason="needs an sm_90 GPU and a VIDATTN_TESTING build")
def test_hopper_forward_takes_every_dim_past_64_and_leaves_the_rest_portable():
    """The dense forward's sm_90a instances: exact D = Dv = 64 / 128, padded widths for every
    (D, Dv) with 64 < max(D, Dv) <= 256 (cuda/dispatch/head_dims.h); below, the portable path."""
    import os
    if os.environ.get("VIDATTN_DISABLE_SM90") == "1":
        pytest.skip("the sm90 path is disabled in this process")
    launches = torch.ops.vidattn._sm90_forward_launches
    for dims in [(96, 96), (192, 128), (256, 256), (64, 128), (128, 64), (72, 72), (8, 136),
                 (64, 64), (128, 128)]:
        q, k, v = qkv(1, 200, 200, 2, 2, *dims, torch.bfloat16, 800)
        before = launches()
        vidattn.attention(q, k, v)
        torch.cuda.synchronize()
        assert launches() > before, f"{dims} left the sm90 kernels"
    for dims in [(40, 40), (8, 8), (64, 48), (56, 56)]:
        q, k, v = qkv(1, 200, 200, 2, 2, *dims, torch.bfloat16, 801)
        before = launches()
        vidattn.attention(q, k, v)
        torch.cuda.synchronize()
        assert launches() == before, f"{dims} ran on the sm90 kernels"
