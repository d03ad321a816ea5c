"""vidattn.attention / attention_varlen against the float64 reference, forward and backward.

float64 inputs must match the reference to 1e-10 (relative past unit magnitude);
bf16 / fp16 / fp32 inputs follow the rule of docs/conventions.md: error <= 2x (3x for dQ) the error
of the same math in the kernel's dtype (attention_reference.py) + a floor: one ulp at the
tensor's magnitude, and for the gradients the float32 rounding bounds of
flash_backward_floors. The full cartesian product of the axes is far too slow for CI, so
the cases below are chosen pairwise-style: every value of every axis appears, with varied
partners (test_cases_cover_every_axis_value keeps that true).
"""
from __future__ import annotations

import pytest
import torch

import vidattn
from attention_reference import (Case, assert_no_nan, assert_within_rule,
                                 flash_backward_floors, flash_backward_floors_varlen, randn,
                                 random_mask, reference_attention,
                                 reference_attention_varlen)

f64, f32, bf16, f16 = torch.float64, torch.float32, torch.bfloat16, torch.float16

# dtype, B, Sq, Sk, Hq, Hkv, D, Dv, causal, key mask, query mask, input scale.
# float64 cases stay small-ish (the reference runs in float64 with autograd); the
# 1000-long sequences go with a single batch and few heads.
CASES = [Case(*c) for c in [
    (f64, 1, 1, 1, 1, 1, 32, 32, False, False, False, 1),
    (f64, 3, 63, 65, 3, 1, 64, 32, True, True, False, 4),
    (f64, 1, 65, 63, 8, 2, 128, 64, True, False, True, 16),
    (f64, 3, 64, 64, 3, 3, 32, 64, False, True, True, 1),
    (f64, 1, 1000, 64, 1, 1, 64, 64, True, True, True, 16),  # causal Sq > Sk: empty rows
    (f64, 1, 1, 1000, 8, 8, 32, 128, True, False, False, 4),
    (f64, 1, 63, 1000, 3, 3, 128, 128, False, True, False, 1),
    (bf16, 1, 1000, 1000, 3, 1, 128, 128, True, True, False, 1),
    (bf16, 3, 65, 1, 8, 2, 64, 32, False, False, True, 16),
    (bf16, 3, 1, 63, 3, 3, 32, 32, True, True, True, 4),
    (bf16, 1, 64, 65, 8, 8, 128, 64, False, True, False, 16),
    (bf16, 3, 63, 64, 1, 1, 64, 128, True, False, True, 1),
    (bf16, 1, 65, 1000, 8, 1, 32, 32, False, False, False, 4),
    (f16, 1, 1000, 65, 8, 2, 32, 64, True, True, True, 4),
    (f16, 3, 64, 1, 3, 1, 128, 128, True, True, False, 1),
    (f16, 1, 63, 63, 8, 8, 64, 64, False, False, True, 16),
    (f16, 3, 1, 64, 1, 1, 32, 64, False, True, False, 1),
    (f16, 1, 65, 65, 3, 3, 128, 32, True, False, False, 16),
    (f16, 1, 1000, 63, 3, 1, 64, 64, False, False, True, 4),
    (f32, 3, 64, 63, 8, 2, 64, 64, True, True, True, 4),
    (f32, 1, 1, 65, 3, 1, 128, 32, False, False, False, 16),
]]


def test_cases_cover_every_axis_value():
    axes = {
        "dtype": {f64, bf16, f16}, "batch": {1, 3}, "seqlen_q": {1, 63, 64, 65, 1000},
        "seqlen_k": {1, 63, 64, 65, 1000}, "heads_q": {1, 3, 8}, "head_dim": {32, 64, 128},
        "causal": {False, True}, "key_mask": {False, True}, "query_mask": {False, True},
        "input_scale": {1, 4, 16},
    }
    for axis, values in axes.items():
        assert values <= {getattr(c, axis) for c in CASES}, axis
    assert any(c.heads_q > c.heads_kv > 1 for c in CASES)      # grouped heads
    assert any(c.head_dim != c.head_dim_v for c in CASES)
    assert any(c.seqlen_q != c.seqlen_k and c.causal for c in CASES)
    for dtype in (f64, bf16, f16):
        assert {True} <= {c.causal for c in CASES if c.dtype == dtype}


def _leaves(dtype, *tensors):
    return [t.detach().to(dtype).requires_grad_() for t in tensors]


def _check_against_reference(dtype, kernel, reference, baseline, gradient_floors):
    """Each of kernel / reference / baseline is (out, lse, dq, dk, dv); gradient_floors are
    flash_backward_floors' (dq, dk, dv)."""
    names = ("out", "lse", "dq", "dk", "dv")
    extra = dict(zip(("dq", "dk", "dv"), gradient_floors))
    for name, got, ref, base in zip(names, kernel, reference, baseline or [None] * 5):
        factor = 3.0 if name == "dq" else 2.0
        assert_within_rule(name, got, ref, base, dtype, factor, extra.get(name, 0.0))


@pytest.mark.parametrize("case", CASES, ids=str)
def test_attention_matches_reference(case: Case, gen):
    c = case
    q = randn([c.batch, c.seqlen_q, c.heads_q, c.head_dim], gen, c.dtype, c.input_scale)
    k = randn([c.batch, c.seqlen_k, c.heads_kv, c.head_dim], gen, c.dtype, c.input_scale)
    v = randn([c.batch, c.seqlen_k, c.heads_kv, c.head_dim_v], gen, c.dtype, c.input_scale)
    grad_out = randn([c.batch, c.seqlen_q, c.heads_q, c.head_dim_v], gen, c.dtype)
    masks = dict(
        key_padding_mask=random_mask(c.batch, c.seqlen_k, gen, fully_padded=c.batch - 1)
        if c.key_mask else None,
        query_padding_mask=random_mask(c.batch, c.seqlen_q, gen, fully_padded=0)
        if c.query_mask else None)

    _check_batched(q, k, v, grad_out, causal=c.causal, **masks)


def _check_batched(q, k, v, grad_out, **kwargs):
    """Kernel vs fp64 reference vs low-precision baseline on the same inputs."""
    dtype = q.dtype

    def run(fn, dt):
        qq, kk, vv = _leaves(dt, q, k, v)
        out, lse = fn(qq, kk, vv, **kwargs)
        out.backward(grad_out.to(dt))
        return out.detach(), lse, qq.grad, kk.grad, vv.grad

    kernel = run(lambda *a, **kw: vidattn.attention(*a, return_lse=True, **kw), dtype)
    out, lse = kernel[:2]
    assert out.dtype == dtype and out.shape == grad_out.shape
    assert lse.dtype == (f64 if dtype == f64 else f32)
    assert lse.shape == (q.shape[0], q.shape[2], q.shape[1])
    reference = run(reference_attention, f64)
    baseline = None if dtype == f64 else run(reference_attention, dtype)
    floors = flash_backward_floors(q, k, v, grad_out, **kwargs)
    _check_against_reference(dtype, kernel, reference, baseline, floors)


def _keys(n, valid):
    return valid(torch.arange(n))[None]


# Beyond the axes: head dims that are not SIMD multiples, whole 256-key tiles padded (the
# online softmax sees a tile with no visible key before / after visible ones), a softmax
# scale of 0 (uniform) and a negative one.
EDGE_CASES = {
    "head_dim_1": dict(shape=(2, 5, 7, 3, 1, 1, 1)),
    "head_dims_7_3": dict(shape=(2, 13, 29, 3, 3, 7, 3), causal=True),
    "first_key_tile_padded": dict(shape=(1, 40, 600, 2, 1, 16, 16),
                                  key_padding_mask=_keys(600, lambda j: j >= 256)),
    "middle_key_tile_padded": dict(shape=(1, 40, 600, 2, 1, 16, 16),
                                   key_padding_mask=_keys(600, lambda j: (j < 256) | (j >= 512))),
    "causal_tail_keys_padded": dict(shape=(1, 300, 600, 2, 2, 16, 16), causal=True,
                                    key_padding_mask=_keys(600, lambda j: j < 500)),
    "scale_zero": dict(shape=(2, 9, 9, 2, 2, 8, 8), scale=0.0),
    "scale_negative": dict(shape=(2, 9, 9, 2, 2, 8, 8), scale=-1.5, causal=True),
}


@pytest.mark.parametrize("dtype", [f64, f32, bf16])
@pytest.mark.parametrize("name", list(EDGE_CASES))
def test_edge_cases(name, dtype, gen):
    kwargs = dict(EDGE_CASES[name])
    batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dim_v = kwargs.pop("shape")
    q = randn([batch, seqlen_q, heads_q, dim], gen, dtype, 4)
    k = randn([batch, seqlen_k, heads_kv, dim], gen, dtype, 4)
    v = randn([batch, seqlen_k, heads_kv, dim_v], gen, dtype, 4)
    grad_out = randn([batch, seqlen_q, heads_q, dim_v], gen, dtype)
    _check_batched(q, k, v, grad_out, **kwargs)


# dtype, q lengths, k lengths, Hq, Hkv, D, Dv, causal, input scale, softmax scale.
# Zero-length members on either side; a q sequence with no keys gives empty rows.
VARLEN_CASES = [
    (f64, [0, 65, 1, 0, 63], [3, 64, 0, 0, 100], 3, 1, 32, 64, True, 1, None),
    (f64, [5, 0, 17], [0, 9, 17], 8, 8, 64, 32, False, 16, 0.3),
    (bf16, [1, 64, 0, 130], [65, 0, 7, 129], 8, 2, 64, 64, True, 4, None),
    (bf16, [1000], [1000], 1, 1, 128, 128, False, 1, None),
    (f16, [63, 0, 65], [1, 5, 65], 3, 3, 128, 32, False, 16, None),
    (f16, [200, 1, 0], [100, 1, 50], 1, 1, 32, 32, True, 1, 0.05),
    (f32, [64, 3], [1, 64], 3, 1, 64, 128, True, 4, None),
]


def _cu(lengths):
    return torch.tensor([0] + lengths, dtype=torch.int32).cumsum(0, dtype=torch.int32)


@pytest.mark.parametrize(
    "dtype,q_lens,k_lens,heads_q,heads_kv,head_dim,head_dim_v,causal,input_scale,scale",
    VARLEN_CASES)
def test_attention_varlen_matches_reference(dtype, q_lens, k_lens, heads_q, heads_kv,
                                            head_dim, head_dim_v, causal, input_scale,
                                            scale, gen):
    tq, tk = sum(q_lens), sum(k_lens)
    q = randn([tq, heads_q, head_dim], gen, dtype, input_scale)
    k = randn([tk, heads_kv, head_dim], gen, dtype, input_scale)
    v = randn([tk, heads_kv, head_dim_v], gen, dtype, input_scale)
    grad_out = randn([tq, heads_q, head_dim_v], gen, dtype)
    cu_q, cu_k = _cu(q_lens), _cu(k_lens)

    def run(fn, dt):
        qq, kk, vv = _leaves(dt, q, k, v)
        out, lse = fn(qq, kk, vv)
        out.backward(grad_out.to(dt))
        return out.detach(), lse, qq.grad, kk.grad, vv.grad

    kernel = run(lambda qq, kk, vv: vidattn.attention_varlen(
        qq, kk, vv, cu_q, cu_k, max(q_lens), max(k_lens) + 3,  # a loose max is allowed
        scale=scale, causal=causal, return_lse=True), dtype)
    assert kernel[1].shape == (heads_q, tq)
    assert kernel[1].dtype == (f64 if dtype == f64 else f32)

    def ref(qq, kk, vv):
        return reference_attention_varlen(qq, kk, vv, cu_q, cu_k, scale=scale, causal=causal)

    reference = run(ref, f64)
    baseline = None if dtype == f64 else run(ref, dtype)
    floors = flash_backward_floors_varlen(q, k, v, grad_out, cu_q, cu_k, scale=scale,
                                          causal=causal)
    _check_against_reference(dtype, kernel, reference, baseline, floors)


@pytest.mark.parametrize("dtype", [f64, bf16])
def test_varlen_equals_batched_per_sequence(dtype, gen):
    """Packing must not change the math: each varlen sequence equals a B=1 batched call."""
    q_lens, k_lens = [7, 0, 65], [64, 3, 65]
    q = randn([sum(q_lens), 3, 32], gen, dtype)
    k = randn([sum(k_lens), 1, 32], gen, dtype)
    v = randn([sum(k_lens), 1, 64], gen, dtype)
    out, lse = vidattn.attention_varlen(q, k, v, _cu(q_lens), _cu(k_lens), 65, 65,
                                        causal=True, return_lse=True)
    cq, ck = _cu(q_lens).tolist(), _cu(k_lens).tolist()
    for i in range(len(q_lens)):
        o, l = vidattn.attention(q[None, cq[i]:cq[i + 1]], k[None, ck[i]:ck[i + 1]],
                                 v[None, ck[i]:ck[i + 1]], causal=True, return_lse=True)
        torch.testing.assert_close(out[cq[i]:cq[i + 1]], o[0], rtol=0, atol=0)
        torch.testing.assert_close(lse[:, cq[i]:cq[i + 1]], l[0], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [f64, bf16, f16])
def test_rows_without_visible_keys(dtype, gen):
    """Rows that see no key (all keys padded, causal with Sq > Sk, padded queries) output 0
    with LSE -inf, get zero dQ, give zero dK / dV to padded keys, and nothing is NaN."""
    batch, seqlen_q, seqlen_k = 3, 70, 5
    q = randn([batch, seqlen_q, 2, 32], gen, dtype, 4).requires_grad_()
    k = randn([batch, seqlen_k, 1, 32], gen, dtype, 4).requires_grad_()
    v = randn([batch, seqlen_k, 1, 32], gen, dtype, 4).requires_grad_()
    key_mask = torch.ones(batch, seqlen_k, dtype=torch.bool)
    key_mask[0] = False          # sequence 0: no key at all
    key_mask[1, :2] = False      # sequence 1: the first two keys padded
    query_mask = torch.ones(batch, seqlen_q, dtype=torch.bool)
    query_mask[2, ::3] = False   # sequence 2: every third query padded
    out, lse = vidattn.attention(q, k, v, causal=True, key_padding_mask=key_mask,
                                 query_padding_mask=query_mask, return_lse=True)
    out.backward(randn(out.shape, gen, dtype))
    for name, t in [("out", out), ("lse", lse), ("dq", q.grad), ("dk", k.grad),
                    ("dv", v.grad)]:
        assert_no_nan(name, t)

    # Causal, bottom-right: query i sees keys j <= i + Sk - Sq, so rows i < Sq - Sk see none.
    causal_empty = torch.arange(seqlen_q) < seqlen_q - seqlen_k
    empty = torch.zeros(batch, seqlen_q, dtype=torch.bool)
    empty[0] = True
    empty[1] = torch.arange(seqlen_q) < seqlen_q - seqlen_k + 2  # sees only padded keys
    empty[2] = causal_empty | ~query_mask[2]
    assert torch.all(out.detach()[empty] == 0)
    assert torch.all(lse.transpose(1, 2)[empty] == float("-inf"))
    assert torch.isfinite(lse.transpose(1, 2)[~empty]).all()
    assert torch.all(q.grad[empty] == 0)
    assert torch.all(k.grad[~key_mask] == 0) and torch.all(v.grad[~key_mask] == 0)
    assert torch.all(out.detach()[~empty].abs().sum(-1) > 0)
