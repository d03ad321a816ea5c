"""The Python surface of dense attention: strided views, empty inputs and bad inputs."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import vidattn
from attention_reference import randn, random_mask, reference_attention

f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
NEG_INF = float("-inf")


class OpRecorder(TorchDispatchMode):
    """Records every op that reaches the Python dispatch key (copies included)."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _assert_no_copy(ops, op):
    """The op ran once and nothing else but aliasing (autograd detaches what it saves)."""
    assert ops.count(op) == 1
    assert set(ops) <= {op, torch.ops.aten.detach.default}, ops


def _cu(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)


# ---- strided inputs -------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_transposed_bhsd_views_need_no_copy(dtype, gen):
    """q/k/v given as [B, H, S, D] tensors transposed to [B, S, H, D] go to the kernel as
    they are (the only op dispatched is vidattn's own) and give the contiguous result."""
    batch, heads_q, heads_kv, seqlen_q, seqlen_k = 2, 4, 2, 70, 130
    q_bhsd = randn([batch, heads_q, seqlen_q, 64], gen, dtype)
    k_bhsd = randn([batch, heads_kv, seqlen_k, 64], gen, dtype)
    v_bhsd = randn([batch, heads_kv, seqlen_k, 32], gen, dtype)
    mask = random_mask(batch, seqlen_k, gen)
    views = [t.transpose(1, 2) for t in (q_bhsd, k_bhsd, v_bhsd)]
    assert not any(t.is_contiguous() for t in views)
    for t in views:
        t.requires_grad_()

    with OpRecorder() as recorder:
        out, lse = vidattn.attention(*views, causal=True, key_padding_mask=mask,
                                     return_lse=True)
    _assert_no_copy(recorder.ops, torch.ops.vidattn.attention.default)

    dense = [t.detach().contiguous().requires_grad_() for t in views]
    out_ref, lse_ref = vidattn.attention(*dense, causal=True, key_padding_mask=mask,
                                         return_lse=True)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)
    grad = randn(out.shape, gen, dtype)
    out.backward(grad)
    out_ref.backward(grad)
    for strided, contiguous in zip(views, dense):
        assert torch.equal(strided.grad, contiguous.grad)


def test_sliced_and_strided_views(gen):
    """q, k, v sliced out of one packed qkv projection, a strided grad_out and a strided
    mask: any strides work as long as the last dimension is unit-stride."""
    batch, seqlen, heads, dim = 2, 65, 3, 32
    qkv = randn([batch, seqlen, 3, heads, dim + 8], gen, f64)  # padded rows: row stride > D
    q, k, v = (qkv[:, :, i, :, :dim] for i in range(3))
    mask = random_mask(seqlen, batch, gen).t()  # [B, S] view of an [S, B] tensor
    assert mask.stride() == (1, batch)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = vidattn.attention(*leaves, key_padding_mask=mask)
    grad = randn([batch, seqlen, heads, 2 * dim], gen, f64)[..., ::2]  # non-unit last stride
    out.backward(grad)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    ref, _ = reference_attention(*ref_leaves, key_padding_mask=mask.contiguous())
    ref.backward(grad)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, rtol=0, atol=1e-11)


def test_varlen_transposed_views(gen):
    lengths = [3, 0, 100]
    heads, total = 4, sum(lengths)
    q, k, v = (randn([heads, total, 32], gen, f32).transpose(0, 1) for _ in range(3))
    cu = _cu(lengths)
    with OpRecorder() as recorder:
        out, lse = vidattn.attention_varlen(q, k, v, cu, cu, 100, 100, return_lse=True)
    _assert_no_copy(recorder.ops, torch.ops.vidattn.attention_varlen.default)
    out_ref, lse_ref = vidattn.attention_varlen(q.contiguous(), k.contiguous(), v.contiguous(),
                                                cu, cu, 100, 100, return_lse=True)
    assert torch.equal(out, out_ref) and torch.equal(lse, lse_ref)


def test_strided_cu_seqlens(gen):
    """cu_seqlens may be a strided int32 view."""
    lengths = [4, 0, 9]
    q, k, v = (randn([13, 2, 16], gen, f64) for _ in range(3))
    cu = _cu(lengths)
    cu_strided = torch.stack([cu, torch.full_like(cu, -7)], dim=1)[:, 0]
    assert cu_strided.stride() == (2,)
    out = vidattn.attention_varlen(q, k, v, cu_strided, cu_strided, 9, 9, causal=True)
    assert torch.equal(out, vidattn.attention_varlen(q, k, v, cu, cu, 9, 9, causal=True))


# ---- empty inputs ---------------------------------------------------------------------


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [f64, bf16])
@pytest.mark.parametrize("batch,seqlen_q,seqlen_k", [(0, 5, 7), (2, 0, 7), (2, 5, 0),
                                                     (0, 0, 0), (2, 0, 0)])
def test_empty_inputs(batch, seqlen_q, seqlen_k, dtype, causal, gen):
    q = randn([batch, seqlen_q, 4, 32], gen, dtype).requires_grad_()
    k = randn([batch, seqlen_k, 2, 32], gen, dtype).requires_grad_()
    v = randn([batch, seqlen_k, 2, 16], gen, dtype).requires_grad_()
    masks = dict(key_padding_mask=torch.ones(batch, seqlen_k, dtype=torch.bool),
                 query_padding_mask=torch.ones(batch, seqlen_q, dtype=torch.bool))
    out, lse = vidattn.attention(q, k, v, causal=causal, return_lse=True, **masks)
    assert out.shape == (batch, seqlen_q, 4, 16) and lse.shape == (batch, 4, seqlen_q)
    # No key at all: every query row outputs 0 with LSE -inf.
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)
    out.backward(torch.ones_like(out))
    for leaf in (q, k, v):
        assert leaf.grad.shape == leaf.shape and torch.all(leaf.grad == 0)
    # The gradient of a sum is expanded (stride 0), which the kernels cannot take as it is.
    grads = torch.autograd.grad(vidattn.attention(q, k, v, causal=causal).sum(), (q, k, v))
    for leaf, grad in zip((q, k, v), grads):
        assert grad.shape == leaf.shape and torch.all(grad == 0)


@pytest.mark.parametrize("q_lens,k_lens", [([], []), ([0, 0], [0, 0]), ([0, 3], [4, 0]),
                                           ([2, 0], [0, 0])])
def test_varlen_empty_members(q_lens, k_lens, gen):
    tq, tk = sum(q_lens), sum(k_lens)
    q = randn([tq, 2, 32], gen, f32).requires_grad_()
    k = randn([tk, 1, 32], gen, f32).requires_grad_()
    v = randn([tk, 1, 64], gen, f32).requires_grad_()
    out, lse = vidattn.attention_varlen(q, k, v, _cu(q_lens), _cu(k_lens), max(q_lens, default=0),
                                        max(k_lens, default=0), causal=True, return_lse=True)
    assert out.shape == (tq, 2, 64) and lse.shape == (2, tq)
    # Rows of sequences without keys: 0 and -inf; ([0, 3], [4, 0]) has only those.
    assert torch.all(out == 0) and torch.all(lse == NEG_INF)
    out.backward(torch.ones_like(out))
    for leaf in (q, k, v):
        assert leaf.grad.shape == leaf.shape and torch.all(leaf.grad == 0)


def test_return_lse_flag(gen):
    q = randn([1, 3, 1, 8], gen, f32)
    out = vidattn.attention(q, q, q)
    assert isinstance(out, torch.Tensor)
    out2, lse = vidattn.attention(q, q, q, return_lse=True)
    assert torch.equal(out, out2) and lse.shape == (1, 1, 3)


# ---- bad inputs -----------------------------------------------------------------------

B, SQ, SK, HQ, HKV, D, DV = 2, 5, 7, 4, 2, 32, 16


def _batched(**changes):
    """Valid batched arguments with some replaced."""
    g = torch.Generator().manual_seed(0)
    args = dict(q=torch.randn(B, SQ, HQ, D, generator=g), k=torch.randn(B, SK, HKV, D, generator=g),
                v=torch.randn(B, SK, HKV, DV, generator=g))
    args.update(changes)
    return args


def _batched_cases():
    q, k, v = _batched()["q"], _batched()["k"], _batched()["v"]
    mask_k = torch.ones(B, SK, dtype=torch.bool)
    return [
        ("q int64", _batched(q=q.long()), TypeError, "'q'"),
        ("q int32", _batched(q=q.int()), TypeError, "'q' must be float32"),
        ("k dtype", _batched(k=k.double()), TypeError, "'k' must have dtype float32"),
        ("v dtype", _batched(v=v.to(bf16)), TypeError, "'v' must have dtype float32"),
        ("q rank", _batched(q=q[0]), ValueError, "'q'"),
        ("k rank", _batched(k=k[..., None]), ValueError, "'k'"),
        ("v rank", _batched(v=v[0]), ValueError, "'v'"),
        ("k batch", _batched(k=torch.randn(3, SK, HKV, D), v=torch.randn(3, SK, HKV, DV)),
         ValueError, "'k'.*batch of q"),
        ("v batch", _batched(v=torch.randn(3, SK, HKV, DV)), ValueError, "'v'"),
        ("v heads", _batched(v=torch.randn(B, SK, 1, DV)), ValueError, "'v'"),
        ("v seqlen", _batched(v=torch.randn(B, SK + 1, HKV, DV)), ValueError, "'v'"),
        ("k head dim", _batched(k=torch.randn(B, SK, HKV, D + 1)), ValueError, "'k'"),
        ("Hq % Hkv", _batched(k=torch.randn(B, SK, 3, D), v=torch.randn(B, SK, 3, DV)),
         ValueError, "multiple of the number of k/v heads"),
        ("zero heads", _batched(k=torch.randn(B, SK, 0, D), v=torch.randn(B, SK, 0, DV)),
         ValueError, "at least one head"),
        ("q last stride", _batched(q=torch.randn(B, SQ, HQ, 2 * D)[..., ::2]), ValueError,
         "'q' must have a unit stride"),
        ("v last stride", _batched(v=torch.randn(B, SK, HKV, 2 * DV)[..., ::2]), ValueError,
         "'v' must have a unit stride"),
        ("key mask shape", _batched(key_padding_mask=mask_k[:, :-1]), ValueError,
         "'key_padding_mask'"),
        ("key mask batch", _batched(key_padding_mask=torch.ones(1, SK, dtype=torch.bool)),
         ValueError, "'key_padding_mask'"),
        ("key mask rank", _batched(key_padding_mask=mask_k[0]), ValueError,
         "'key_padding_mask'"),
        ("key mask dtype", _batched(key_padding_mask=mask_k.float()), TypeError,
         "'key_padding_mask'"),
        ("query mask shape", _batched(query_padding_mask=torch.ones(B, SK, dtype=torch.bool)),
         ValueError, "'query_padding_mask'"),
        ("query mask dtype", _batched(query_padding_mask=torch.ones(B, SQ, dtype=torch.uint8)),
         TypeError, "'query_padding_mask'"),
        ("query mask int32", _batched(query_padding_mask=torch.ones(B, SQ, dtype=torch.int32)),
         TypeError, "'query_padding_mask'"),
        ("scale inf", _batched(scale=float("inf")), ValueError, "'scale'"),
        ("scale nan", _batched(scale=float("nan")), ValueError, "'scale'"),
    ]


@pytest.mark.parametrize("kwargs,error,message",
                         [c[1:] for c in _batched_cases()], ids=[c[0] for c in _batched_cases()])
def test_bad_batched_inputs(kwargs, error, message):
    with pytest.raises(error, match=message.replace("(", r"\(")) as info:
        vidattn.attention(**kwargs)
    assert "vidattn" in str(info.value)  # the message names the entry point too


def _varlen(q_lens=(3, 4), k_lens=(5, 2), **changes):
    args = dict(q=torch.randn(sum(q_lens), HQ, D), k=torch.randn(sum(k_lens), HKV, D),
                v=torch.randn(sum(k_lens), HKV, DV), cu_seqlens_q=_cu(q_lens),
                cu_seqlens_k=_cu(k_lens), max_seqlen_q=max(q_lens), max_seqlen_k=max(k_lens))
    args.update(changes)
    return args


def _i32(*values):
    return torch.tensor(values, dtype=torch.int32)


VARLEN_BAD = [
    ("cu_q start", _varlen(cu_seqlens_q=_i32(1, 3, 7)), ValueError, "'cu_seqlens_q' must start at 0"),
    ("cu_k start", _varlen(cu_seqlens_k=_i32(2, 5, 7)), ValueError, "'cu_seqlens_k' must start at 0"),
    ("cu_q decreasing", _varlen(cu_seqlens_q=_i32(0, 5, 4, 7), cu_seqlens_k=_i32(0, 3, 5, 7),
                                max_seqlen_q=10),
     ValueError, "'cu_seqlens_q' must be non-decreasing"),
    ("cu_k decreasing", _varlen(cu_seqlens_k=_i32(0, 6, 5), max_seqlen_k=10), ValueError,
     "'cu_seqlens_k' must be non-decreasing"),
    ("cu_q end", _varlen(cu_seqlens_q=_i32(0, 3, 6)), ValueError, "'cu_seqlens_q' must end"),
    ("cu_k end", _varlen(cu_seqlens_k=_i32(0, 5, 8)), ValueError, "'cu_seqlens_k' must end"),
    ("max_seqlen_q", _varlen(max_seqlen_q=3), ValueError, "'cu_seqlens_q'.*max_seqlen"),
    ("max_seqlen_k", _varlen(max_seqlen_k=4), ValueError, "'cu_seqlens_k'.*max_seqlen"),
    ("max_seqlen negative", _varlen(max_seqlen_q=-1), ValueError, "max_seqlen_q"),
    ("cu dtype", _varlen(cu_seqlens_q=_cu((3, 4)).long()), TypeError, "'cu_seqlens_q'"),
    ("cu rank", _varlen(cu_seqlens_k=_cu((5, 2))[None]), ValueError, "'cu_seqlens_k'"),
    ("cu lengths differ", _varlen(cu_seqlens_k=_i32(0, 7)), ValueError, "'cu_seqlens_k'"),
    ("cu empty", _varlen(cu_seqlens_q=_i32(), cu_seqlens_k=_i32()), ValueError,
     "'cu_seqlens_q'"),
    ("q rank", _varlen(q=torch.randn(1, 7, HQ, D)), ValueError, "'q'"),
    ("v tokens", _varlen(v=torch.randn(8, HKV, DV)), ValueError, "'v'"),
    ("k dtype", _varlen(k=torch.randn(7, HKV, D, dtype=f64)), TypeError, "'k'"),
    ("Hq % Hkv", _varlen(k=torch.randn(7, 3, D), v=torch.randn(7, 3, DV)), ValueError,
     "multiple"),
    ("q last stride", _varlen(q=torch.randn(7, HQ, 2 * D)[..., ::2]), ValueError, "'q'"),
]


@pytest.mark.parametrize("kwargs,error,message", [c[1:] for c in VARLEN_BAD],
                         ids=[c[0] for c in VARLEN_BAD])
def test_bad_varlen_inputs(kwargs, error, message):
    with pytest.raises(error, match=message):
        vidattn.attention_varlen(**kwargs)


def test_bad_backward_grad_out():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    out, lse = torch.ops.vidattn.attention(q, k, v)
    common = dict(scale=None, causal=False, key_padding_mask=None, query_padding_mask=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0)
    with pytest.raises(ValueError, match="'grad_out'"):
        torch.ops.vidattn.attention_backward(torch.randn(1, 4, 2, 9), q, k, v, out, lse, **common)
    with pytest.raises(TypeError, match="'grad_out'"):
        torch.ops.vidattn.attention_backward(torch.randn(1, 4, 2, 8, dtype=f64), q, k, v, out,
                                             lse, **common)
    with pytest.raises(TypeError, match="'lse'"):
        torch.ops.vidattn.attention_backward(torch.randn(1, 4, 2, 8), q, k, v, out, lse.double(),
                                             **common)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_mixed_devices():
    q, k, v = (torch.randn(1, 4, 2, 8) for _ in range(3))
    with pytest.raises((ValueError, RuntimeError), match="'k'"):
        vidattn.attention(q, k.cuda(), v)
