"""CUDA dense attention against the float64 reference (the rule of docs/conventions.md).

Skipped without a GPU. The reference is the plain math in float64 (computed on the GPU for
speed; it is the same float64 math as on the CPU); the kernel's max abs error must be at most
2x (3x for dQ) the error of the same math done by PyTorch in the kernel's dtype, plus a
rounding floor (floor_of).
"""
from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

import vidattn
from cuda_poison import poison_allocator

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

DEV = "cuda"
DTYPES = [torch.bfloat16, torch.float16]


def gen(seed: int) -> torch.Generator:
    g = torch.Generator(device=DEV)
    g.manual_seed(seed)
    return g


def randn(shape, dtype, g, scale=1.0):
    return (torch.randn(shape, generator=g, device=DEV, dtype=torch.float32) * scale).to(dtype)


def qkv(g, shape, dtype, input_scale, dv=None):
    """q [B, Sq, Hq, D] and k [B, Sk, Hkv, D] at input_scale, v [B, Sk, Hkv, dv or D] at 1,
    drawn from g in that order."""
    B, Sq, Sk, Hq, Hkv, D = shape
    return (randn((B, Sq, Hq, D), dtype, g, input_scale),
            randn((B, Sk, Hkv, D), dtype, g, input_scale), randn((B, Sk, Hkv, dv or D), dtype, g))


def assert_launched(counter, fn, what) -> None:
    """fn() launches at least one kernel that `counter` (a VIDATTN_TESTING hook, e.g.
    torch.ops.vidattn._sm90_forward_launches) counts."""
    before = counter()
    fn()
    torch.cuda.synchronize()
    assert counter() > before, f"{what} did not run"


def reference(q, k, v, scale, causal=False, kmask=None, qmask=None):
    """Attention in q's dtype with PyTorch ops: out [B,Sq,Hq,D], lse [B,Hq,Sq] (float64 for
    float64 inputs, else float32)."""
    B, Sq, Hq, D = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    k = k.repeat_interleave(Hq // Hkv, dim=2)
    v = v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    vis = torch.ones(Sq, Sk, dtype=torch.bool, device=q.device)
    if causal:
        vis = torch.tril(vis, diagonal=Sk - Sq)
    vis = vis[None, None].expand(B, 1, Sq, Sk)
    if kmask is not None:
        vis = vis & kmask[:, None, None, :]
    row = vis.any(-1, keepdim=True)
    if qmask is not None:
        row = row & qmask[:, None, :, None]
    s = s.masked_fill(~vis, float("-inf")).masked_fill(~row, 0.0)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(s.to(lse_dtype), dim=-1).masked_fill(~row[..., 0], float("-inf"))
    p = torch.softmax(s, dim=-1) * row
    out = torch.einsum("bhij,bjhd->bihd", p, v)
    return out, lse


def amax(t: torch.Tensor) -> float:
    return t.detach().abs().max().item() if t.numel() else 0.0


def floor_of(ref: torch.Tensor, dtype, terms: float = 0.0) -> float:
    """A quarter ulp of the largest reference value (rounding of the result itself), plus
    1e-5 x the size of the terms a gradient sums before they cancel: float32 accumulation
    noise where the exact result is ~0 (dQ and dK when each query sees one key)."""
    eps = torch.finfo(dtype).eps
    return 0.25 * eps * amax(ref) + 1e-5 * terms + 1e-6


def grad_term_sizes(q, k, v, gout, scale):
    """Sizes of the products dQ, dK and dV are sums of (before any cancellation)."""
    dp = amax(gout) * amax(v)
    return scale * dp * amax(k), scale * dp * amax(q), amax(gout)


def rule_error(got, ref64, lowp, dtype, factor=2.0, terms=0.0):
    """The rule of docs/conventions.md over the reference's finite elements: (max abs error of got,
    that of PyTorch's computation in dtype, the bound factor x the latter + floor)."""
    if got.numel() == 0:
        return 0.0, 0.0, 0.0
    finite = torch.isfinite(ref64)
    g = got.double().masked_fill(~finite, 0)
    r = ref64.masked_fill(~finite, 0)
    l = lowp.double().masked_fill(~finite, 0)
    err = (g - r).abs().max().item()
    base = (l - r).abs().max().item()
    return err, base, factor * base + floor_of(r, dtype, terms)


def check_rule(name, got, ref64, lowp, dtype, factor=2.0, terms=0.0):
    assert torch.equal(torch.isfinite(got), torch.isfinite(ref64)), \
        f"{name}: non-finite pattern differs"
    err, base, bound = rule_error(got, ref64, lowp, dtype, factor, terms)
    assert err <= bound, f"{name}: max abs error {err:.3e} > {factor} x {base:.3e} + floor"


def run_and_check(q, k, v, *, causal=False, kmask=None, qmask=None, scale=None, seed=0,
                  check_grads=True, clone_inputs=True, deterministic=True):
    """clone_inputs=False runs the kernel on the given views themselves (their alignment and
    strides are the point of some tests); they must then require grad when check_grads.
    deterministic: the backward's option."""
    dtype = q.dtype
    D = q.shape[-1]
    sc = scale if scale is not None else 1.0 / math.sqrt(D)
    poison_allocator(q.numel() * 8 + (1 << 20))
    qk = ([t.detach().clone().requires_grad_(check_grads) for t in (q, k, v)] if clone_inputs
          else [q, k, v])
    out, lse = vidattn.attention(*qk, scale=scale, causal=causal, key_padding_mask=kmask,
                                 query_padding_mask=qmask, deterministic=deterministic,
                                 return_lse=True)
    assert out.shape == q.shape[:-1] + (v.shape[-1],) and out.dtype == dtype
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1]) and lse.dtype == torch.float32
    q64, k64, v64 = [t.detach().double().requires_grad_(check_grads) for t in (q, k, v)]
    ql, kl, vl = [t.detach().clone().requires_grad_(check_grads) for t in (q, k, v)]
    ref, ref_lse = reference(q64, k64, v64, sc, causal, kmask, qmask)
    low, low_lse = reference(ql, kl, vl, sc, causal, kmask, qmask)
    assert torch.isfinite(out).all(), "out has non-finite values (unwritten or NaN)"
    check_rule("out", out.detach(), ref.detach(), low.detach(), dtype)
    check_rule("lse", lse, ref_lse.detach(), low_lse.detach(), dtype)
    # Rows that see no key (padded queries, fully masked, Sk == 0): exactly 0 and -inf.
    dead = torch.isinf(ref_lse.detach())  # [B, H, Sq]
    if dead.any():
        dead_rows = dead.permute(0, 2, 1)  # [B, Sq, H]
        assert (out.detach()[dead_rows] == 0).all()
        assert (lse[dead] == float("-inf")).all()
    if not check_grads:
        return out, lse
    gout = randn(out.shape, dtype, gen(seed + 1))
    poison_allocator(q.numel() * 8 + (1 << 20))
    dq, dk, dv = torch.autograd.grad(out, qk, gout)
    d64 = torch.autograd.grad(ref, (q64, k64, v64), gout.double())
    dl = torch.autograd.grad(low, (ql, kl, vl), gout)
    terms = grad_term_sizes(q, k, v, gout, sc)
    for name, got, r, l, f, t in zip(("dq", "dk", "dv"), (dq, dk, dv), d64, dl, (3.0, 2.0, 2.0),
                                     terms):
        assert torch.isfinite(got).all(), f"{name} has non-finite values"
        check_rule(name, got, r, l, dtype, f, t)
    if dead.any():
        assert (dq[dead.permute(0, 2, 1)] == 0).all(), "dead query rows must get zero dQ"
    return out, lse


# ---- dense: sizes, causal, GQA, input scales -------------------------------------------

SHAPES = [  # B, Sq, Sk, Hq, Hkv
    (1, 1, 1, 1, 1),
    (2, 63, 65, 3, 3),
    (1, 64, 64, 2, 1),
    (2, 65, 1000, 4, 2),
    (1, 1000, 63, 3, 1),
    (1, 129, 129, 2, 2),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}_Sq{}_Sk{}_H{}x{}".format(*s))
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("input_scale", [1.0, 4.0, 16.0])
def test_dense_matches_reference(dtype, D, shape, causal, input_scale):
    B, Sq, Sk, Hq, Hkv = shape
    seed = zlib.crc32(repr((str(dtype), D, shape, causal, input_scale)).encode())
    g = gen(seed)
    q = randn((B, Sq, Hq, D), dtype, g, input_scale)
    k = randn((B, Sk, Hkv, D), dtype, g, input_scale)
    v = randn((B, Sk, Hkv, D), dtype, g)
    run_and_check(q, k, v, causal=causal, seed=seed)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_padding_masks(dtype, D, causal):
    g = gen(1000 + D + int(causal))
    B, Sq, Sk, H = 3, 100, 150, 3
    q = randn((B, Sq, H, D), dtype, g, 4.0)
    k = randn((B, Sk, H, D), dtype, g, 4.0)
    v = randn((B, Sk, H, D), dtype, g)
    kmask = torch.rand((B, Sk), generator=g, device=DEV) > 0.3
    qmask = torch.rand((B, Sq), generator=g, device=DEV) > 0.2
    kmask[1] = False  # a batch entry whose keys are all padded: every row sees nothing
    kmask[2, :] = True
    run_and_check(q, k, v, causal=causal, kmask=kmask, qmask=qmask, seed=7)


def test_strided_views_and_explicit_scale():
    g = gen(11)
    B, S, H, D = 2, 130, 3, 128
    qkv = randn((B, S, 3, H, D), torch.bfloat16, g, 4.0)  # packed: strides of a slice
    q, k, v = qkv.unbind(2)
    run_and_check(q, k, v, scale=0.05, seed=11)
    # [B, H, S, D] storage seen as [B, S, H, D]
    qt = randn((B, H, S, D), torch.float16, g).transpose(1, 2)
    kt = randn((B, H, S + 5, D), torch.float16, g).transpose(1, 2)
    vt = randn((B, H, S + 5, D), torch.float16, g).transpose(1, 2)
    run_and_check(qt, kt, vt, causal=True, seed=12)


def test_misaligned_rows_take_the_elementwise_path():
    g = gen(13)
    B, S, H, D = 1, 70, 2, 64
    n = B * S * H * D
    flat = randn((3 * n + 1,), torch.bfloat16, g).requires_grad_()
    q, k, v = (flat[1 + i * n: 1 + (i + 1) * n].view(B, S, H, D) for i in range(3))
    assert q.data_ptr() % 16 != 0
    # The views themselves (a clone would be aligned again and take the fast paths).
    run_and_check(q, k, v, causal=True, seed=13, clone_inputs=False)


# ---- varlen -------------------------------------------------------------------------------

def cu(lengths):
    return torch.tensor([0] + list(itertools.accumulate(lengths)), dtype=torch.int32, device=DEV)


def check_varlen(q, k, v, lq, lk, out, *, causal, lse=None, grads=None, gout=None):
    """A packed call (sequence lengths lq of the queries, lk of the keys) sequence by sequence
    against the batched reference, by the rule: out, lse when given, and the gradients `grads`
    (dq, dk, dv of gout) when given. A sequence without keys must output exactly 0 (and LSE
    -inf), one without queries give its keys exactly zero dK and dV."""
    dtype = q.dtype
    sc = 1.0 / math.sqrt(q.shape[-1])
    for t in (out, *(grads or ())):
        assert torch.isfinite(t).all()
    oq = ok = 0
    for a, b in zip(lq, lk):
        sl_q, sl_k = slice(oq, oq + a), slice(ok, ok + b)
        oq, ok = oq + a, ok + b
        name = f"sequence ({a}, {b}), causal={causal}"
        parts = [t[s][None] for t, s in ((q, sl_q), (k, sl_k), (v, sl_k))]
        p64 = [t.double().requires_grad_(grads is not None) for t in parts]
        pl = [t.clone().requires_grad_(grads is not None) for t in parts]
        r, rl = reference(*p64, sc, causal)
        lo, ll = reference(*pl, sc, causal)
        check_rule(f"{name} out", out[sl_q][None].detach(), r.detach(), lo.detach(), dtype)
        if lse is not None:
            check_rule(f"{name} lse", lse[:, sl_q][None], rl.detach(), ll.detach(), dtype)
        if b == 0:
            assert (out[sl_q] == 0).all(), f"{name}: output of a sequence without keys"
            if lse is not None:
                assert (lse[:, sl_q] == float("-inf")).all(), f"{name}: LSE without keys"
        if grads is None:
            continue
        dq, dk, dv = grads
        got = (dq[sl_q][None], dk[sl_k][None], dv[sl_k][None])
        if a == 0:  # keys nobody looks at take no gradient
            assert (got[1] == 0).all() and (got[2] == 0).all(), f"{name}: dK / dV"
            continue
        go = gout[sl_q][None]
        d64 = torch.autograd.grad(r, p64, go.double(), allow_unused=True)
        dl = torch.autograd.grad(lo, pl, go, allow_unused=True)
        terms = grad_term_sizes(*parts, go, sc)
        for gname, gt, rr, l, f, t in zip(("dq", "dk", "dv"), got, d64, dl, (3.0, 2.0, 2.0),
                                          terms):
            if rr is None:  # an empty side
                assert gt.numel() == 0 or (gt == 0).all(), f"{name} {gname}"
                continue
            check_rule(f"{name} {gname}", gt, rr, l, dtype, f, t)


@pytest.mark.parametrize("dtype", DTYPES, ids=["bf16", "fp16"])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_varlen_matches_per_sequence_reference(dtype, D, causal):
    g = gen(2000 + D + int(causal))
    lq = [5, 0, 130, 1, 64, 3]
    lk = [7, 3, 0, 1, 200, 65]
    Hq, Hkv = 4, 2
    q = randn((sum(lq), Hq, D), dtype, g, 4.0)
    k = randn((sum(lk), Hkv, D), dtype, g, 4.0)
    v = randn((sum(lk), Hkv, D), dtype, g)
    gout = randn((sum(lq), Hq, D), dtype, g)
    poison_allocator(q.numel() * 8 + (1 << 20))
    qk = [t.clone().requires_grad_() for t in (q, k, v)]
    out, lse = vidattn.attention_varlen(*qk, cu(lq), cu(lk), max(lq), max(lk), causal=causal,
                                        return_lse=True)
    assert lse.shape == (Hq, sum(lq))
    grads = torch.autograd.grad(out, qk, gout)
    check_varlen(q, k, v, lq, lk, out, causal=causal, lse=lse, grads=grads, gout=gout)


# ---- empty inputs, errors -----------------------------------------------------------------

@pytest.mark.parametrize("B,Sq,Sk", [(0, 5, 5), (2, 0, 5), (2, 5, 0), (1, 0, 0)])
def test_empty_inputs(B, Sq, Sk):
    g = gen(3000 + B + Sq + Sk)
    q = randn((B, Sq, 2, 64), torch.bfloat16, g).requires_grad_()
    k = randn((B, Sk, 1, 64), torch.bfloat16, g).requires_grad_()
    v = randn((B, Sk, 1, 64), torch.bfloat16, g).requires_grad_()
    poison_allocator(1 << 20)
    out, lse = vidattn.attention(q, k, v, return_lse=True)
    assert out.shape == (B, Sq, 2, 64)
    assert (out == 0).all() and (lse == float("-inf")).all()
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    assert (dq == 0).all() and (dk == 0).all() and (dv == 0).all()


def test_varlen_all_empty_sequences():
    q = torch.zeros((0, 2, 64), dtype=torch.float16, device=DEV)
    k = torch.zeros((0, 2, 64), dtype=torch.float16, device=DEV)
    z = cu([0, 0, 0])
    out, lse = vidattn.attention_varlen(q, k, k, z, z, 0, 0, return_lse=True)
    assert out.shape == (0, 2, 64) and lse.shape == (2, 0)


def test_unsupported_dtype_and_head_dim_raise_not_implemented():
    g = gen(4000)
    q = randn((1, 8, 2, 64), torch.float32, g)
    with pytest.raises(NotImplementedError, match="bfloat16 and float16"):
        vidattn.attention(q, q, q)
    q = randn((1, 8, 2, 100), torch.bfloat16, g)  # not a multiple of 8
    with pytest.raises(NotImplementedError, match="head dims"):
        vidattn.attention(q, q, q)


# ---- determinism, inference == training, streams and graphs ------------------------------

def test_backward_is_deterministic_over_50_runs():
    g = gen(5000)
    B, Sq, Sk, Hq, Hkv, D = 2, 300, 333, 4, 2, 128
    q = randn((B, Sq, Hq, D), torch.bfloat16, g, 4.0).requires_grad_()
    k = randn((B, Sk, Hkv, D), torch.bfloat16, g, 4.0).requires_grad_()
    v = randn((B, Sk, Hkv, D), torch.bfloat16, g).requires_grad_()
    kmask = torch.rand((B, Sk), generator=g, device=DEV) > 0.1
    gout = randn((B, Sq, Hq, D), torch.bfloat16, g)
    first = None
    for _ in range(50):
        out = vidattn.attention(q, k, v, causal=True, key_padding_mask=kmask)
        grads = torch.autograd.grad(out, (q, k, v), gout)
        if first is None:
            first = [out.detach().clone()] + [t.clone() for t in grads]
        else:
            for a, b in zip(first, [out] + list(grads)):
                assert torch.equal(a, b.detach())


def test_inference_forward_equals_training_forward():
    g = gen(5100)
    q = randn((2, 77, 3, 64), torch.float16, g)
    k = randn((2, 90, 3, 64), torch.float16, g)
    with torch.no_grad():
        a = vidattn.attention(q, k, k, causal=True)
    b = vidattn.attention(q.requires_grad_(), k, k, causal=True)
    assert torch.equal(a, b.detach())


def test_side_stream_and_cuda_graph_replay():
    g = gen(5200)
    q = randn((1, 200, 2, 128), torch.bfloat16, g)
    k = randn((1, 180, 2, 128), torch.bfloat16, g)
    v = randn((1, 180, 2, 128), torch.bfloat16, g)
    gout = randn((1, 200, 2, 128), torch.bfloat16, g)
    ops = torch.ops.vidattn

    def step():
        out, lse = ops.attention(q, k, v, causal=True)
        grads = ops.attention_backward(gout, q, k, v, out, lse, scale=None, causal=True,
                                       key_padding_mask=None, query_padding_mask=None,
                                       cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                                       max_seqlen_k=0)
        return (out, lse) + tuple(grads)

    expected = step()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        on_side = step()
    torch.cuda.current_stream().wait_stream(side)
    for a, b in zip(expected, on_side):
        assert torch.equal(a, b)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(expected, captured):
        assert torch.equal(a, b)


# ---- 64-bit offsets -------------------------------------------------------------------------

def test_forward_with_more_than_2_31_elements_per_tensor():
    free, _ = torch.cuda.mem_get_info()
    B, S, H, D = 8193, 512, 4, 128  # q, k, v, out: 2^31 + 2^18 elements each
    if free < 6 * B * S * H * D * 2:
        pytest.skip("needs ~26 GB of free GPU memory")
    g = gen(6000)
    q = torch.empty((B, S, H, D), dtype=torch.bfloat16, device=DEV)
    k = torch.empty_like(q)
    v = torch.empty_like(q)
    assert q.numel() > 2**31
    for t in (q, k, v):
        t.normal_(generator=g)
    out, lse = vidattn.attention(q, k, v, causal=True, return_lse=True)
    sc = 1.0 / math.sqrt(D)
    for b in (0, 4096, B - 1):  # the last batch entry lives past element 2^31
        sl = slice(b, b + 1)
        r, rl = reference(q[sl].double(), k[sl].double(), v[sl].double(), sc, True)
        lo, ll = reference(q[sl], k[sl], v[sl], sc, True)
        check_rule(f"out[{b}]", out[sl], r, lo, torch.bfloat16)
        check_rule(f"lse[{b}]", lse[sl], rl, ll, torch.bfloat16)


# ---- torch.library.opcheck ------------------------------------------------------------------

def test_opcheck_on_cuda_tensors():
    g = gen(7000)
    q = randn((2, 40, 4, 64), torch.bfloat16, g).requires_grad_()
    k = randn((2, 33, 2, 64), torch.bfloat16, g).requires_grad_()
    v = randn((2, 33, 2, 64), torch.bfloat16, g).requires_grad_()
    kmask = torch.rand((2, 33), generator=g, device=DEV) > 0.2
    torch.library.opcheck(torch.ops.vidattn.attention.default, (q, k, v),
                          {"causal": True, "key_padding_mask": kmask})
    qv = randn((45, 4, 64), torch.float16, g).requires_grad_()
    kv = randn((50, 2, 64), torch.float16, g).requires_grad_()
    torch.library.opcheck(torch.ops.vidattn.attention_varlen.default,
                          (qv, kv, kv, cu([20, 25]), cu([30, 20]), 25, 30), {"causal": True})
