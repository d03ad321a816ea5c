"""vidattn's ops inside PyTorch: opcheck, torch.compile, autograd properties, determinism."""
from __future__ import annotations

import pytest
import torch

import vidattn
from attention_reference import randn, random_mask

f64, f32, bf16 = torch.float64, torch.float32, torch.bfloat16
ops = torch.ops.vidattn


def _cu(lengths):
    return torch.tensor([0] + list(lengths), dtype=torch.int32).cumsum(0, dtype=torch.int32)


def _qkv(gen, dtype, batch, seqlen_q, seqlen_k, heads_q, heads_kv, dim, dim_v,
         requires_grad=False):
    shapes = ([batch, seqlen_q, heads_q, dim], [batch, seqlen_k, heads_kv, dim],
              [batch, seqlen_k, heads_kv, dim_v])
    return [randn(s, gen, dtype).requires_grad_(requires_grad) for s in shapes]


# ---- opcheck ----------------------------------------------------------------------------


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("variant", ["plain", "masks_causal_gqa"])
def test_opcheck_attention(variant, requires_grad, gen):
    if variant == "plain":
        args = _qkv(gen, f32, 1, 5, 5, 2, 2, 16, 16, requires_grad)
        kwargs = {}
    else:
        args = _qkv(gen, f32, 2, 9, 6, 4, 2, 16, 8, requires_grad)
        kwargs = dict(scale=0.3, causal=True, key_padding_mask=random_mask(2, 6, gen, 1),
                      query_padding_mask=random_mask(2, 9, gen))
    torch.library.opcheck(ops.attention.default, tuple(args), kwargs)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("causal", [False, True])
def test_opcheck_attention_varlen(causal, requires_grad, gen):
    q_lens, k_lens = [3, 0, 6], [4, 2, 5]
    q = randn([9, 4, 16], gen, f32).requires_grad_(requires_grad)
    k = randn([11, 2, 16], gen, f32).requires_grad_(requires_grad)
    v = randn([11, 2, 8], gen, f32).requires_grad_(requires_grad)
    torch.library.opcheck(ops.attention_varlen.default,
                          (q, k, v, _cu(q_lens), _cu(k_lens), 6, 5), dict(causal=causal))


def test_opcheck_attention_backward(gen):
    q, k, v = _qkv(gen, f32, 2, 7, 5, 2, 1, 16, 8)
    out, lse = ops.attention(q, k, v, causal=True)
    args = (randn(out.shape, gen, f32), q, k, v, out, lse)
    kwargs = dict(scale=None, causal=True, key_padding_mask=None, query_padding_mask=None,
                  cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0)
    torch.library.opcheck(ops.attention_backward.default, args, kwargs)


def test_meta_shapes_follow_v_head_dim():
    q = torch.empty(2, 9, 4, 16, device="meta", dtype=bf16)
    k = torch.empty(2, 6, 2, 16, device="meta", dtype=bf16)
    v = torch.empty(2, 6, 2, 40, device="meta", dtype=bf16)
    out, lse = vidattn.attention(q, k, v, return_lse=True)
    assert out.shape == (2, 9, 4, 40) and out.dtype == bf16 and out.device.type == "meta"
    assert lse.shape == (2, 4, 9) and lse.dtype == f32


# ---- torch.compile ----------------------------------------------------------------------


class TinyAttentionBlock(torch.nn.Module):
    """Projections around vidattn.attention, the way a diffusion transformer block uses it."""

    def __init__(self, width=64, heads=4, kv_heads=2):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, width // heads
        self.to_q = torch.nn.Linear(width, width)
        self.to_kv = torch.nn.Linear(width, 2 * kv_heads * self.head_dim)
        self.to_out = torch.nn.Linear(width, width)

    def forward(self, x, key_padding_mask):
        b, s, _ = x.shape
        q = self.to_q(x).view(b, s, self.heads, self.head_dim)
        k, v = self.to_kv(x).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        out, lse = vidattn.attention(q, k, v, causal=True, key_padding_mask=key_padding_mask,
                                     return_lse=True)
        return self.to_out(out.flatten(2)), lse


def test_compile_fullgraph_matches_eager(gen):
    torch.manual_seed(0)  # only for nn.Linear's initial weights
    model = TinyAttentionBlock()
    x = randn([2, 37, 64], gen, f32)
    mask = random_mask(2, 37, gen)
    explanation = torch._dynamo.explain(model)(x, mask)
    assert explanation.graph_break_count == 0
    assert explanation.graph_count == 1

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    results = []
    for fn in (model, compiled):
        model.zero_grad()
        xx = x.clone().requires_grad_()
        out, lse = fn(xx, mask)
        assert not lse.requires_grad
        out.square().sum().backward()
        results.append([out.detach(), lse, xx.grad] + [p.grad.clone() for p in model.parameters()])
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)


def test_compile_inductor_varlen_matches_eager(gen):
    """Through Inductor too, with the varlen op and a backward."""
    q_lens = [5, 0, 12]
    cu = _cu(q_lens)

    def fn(q, k, v):
        return vidattn.attention_varlen(q, k, v, cu, cu, 12, 12, causal=True)

    qkv = [randn([17, 2, 16], gen, f32) for _ in range(3)]
    results = []
    for f in (fn, torch.compile(fn, fullgraph=True)):
        leaves = [t.clone().requires_grad_() for t in qkv]
        out = f(*leaves)
        out.sum().backward()
        results.append([out.detach()] + [t.grad for t in leaves])
    for eager, comp in zip(*results):
        torch.testing.assert_close(comp, eager, rtol=1e-6, atol=1e-6)


def test_compile_dynamic_shapes(gen):
    """Symbolic sequence lengths go through the Meta kernel: one graph serves all lengths."""
    def fn(q, k, v, mask):
        return vidattn.attention(q, k, v, causal=True, key_padding_mask=mask)

    compiled = torch.compile(fn, dynamic=True, fullgraph=True, backend="aot_eager")
    for seqlen in (17, 33, 70):
        q, k, v = _qkv(gen, f32, 2, seqlen, seqlen + 3, 4, 2, 16, 8, requires_grad=True)
        mask = random_mask(2, seqlen + 3, gen)
        got, want = compiled(q, k, v, mask), fn(q, k, v, mask)
        assert torch.equal(got, want)
        grad = randn(got.shape, gen, f32)
        got_grads = torch.autograd.grad(got, (q, k, v), grad)
        want_grads = torch.autograd.grad(want, (q, k, v), grad)
        assert all(torch.equal(a, b) for a, b in zip(got_grads, want_grads))


# ---- autograd properties, determinism -----------------------------------------------------


@pytest.mark.parametrize("dtype", [f32, bf16, f64])
def test_no_grad_forward_is_bit_identical(dtype, gen):
    q, k, v = _qkv(gen, dtype, 2, 150, 300, 4, 2, 32, 48)
    mask = random_mask(2, 300, gen)
    with torch.no_grad():
        out0, lse0 = vidattn.attention(q, k, v, causal=True, key_padding_mask=mask,
                                       return_lse=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out1, lse1 = vidattn.attention(*leaves, causal=True, key_padding_mask=mask,
                                   return_lse=True)
    assert out1.requires_grad
    assert torch.equal(out0, out1) and torch.equal(lse0, lse1)


def test_no_grad_varlen_forward_is_bit_identical(gen):
    lens = [130, 0, 7]
    q, k, v = (randn([137, 2, 32], gen, bf16) for _ in range(3))
    with torch.no_grad():
        out0 = vidattn.attention_varlen(q, k, v, _cu(lens), _cu(lens), 130, 130)
    out1 = vidattn.attention_varlen(*(t.requires_grad_() for t in (q, k, v)), _cu(lens),
                                    _cu(lens), 130, 130)
    assert torch.equal(out0, out1)


def test_lse_is_not_differentiable(gen):
    q, k, v = _qkv(gen, f32, 1, 4, 4, 2, 1, 8, 8, requires_grad=True)
    out, lse = vidattn.attention(q, k, v, return_lse=True)
    assert out.requires_grad and out.grad_fn is not None
    assert not lse.requires_grad and lse.grad_fn is None
    out, lse = vidattn.attention_varlen(q[0], k[0], v[0], _cu([4]), _cu([4]), 4, 4,
                                        return_lse=True)
    assert out.requires_grad and not lse.requires_grad
    # Only out carries a gradient; backward through the pair uses out's alone.
    grads = torch.autograd.grad(out.sum(), (q, k, v))
    assert all(torch.isfinite(g).all() for g in grads)


def _gradients(q, k, v, grad_out, **kwargs):
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = vidattn.attention(*leaves, **kwargs)
    out.backward(grad_out)
    return [t.grad for t in leaves]


@pytest.mark.parametrize("dtype", [f32, bf16])
def test_backward_is_deterministic(dtype, gen):
    """Bit-identical gradients over repeated runs and across thread counts; the shapes span
    several query and key blocks and GQA groups, where an atomic or racy reduction would
    show up."""
    batch, seqlen_q, seqlen_k = 2, 300, 600
    q, k, v = _qkv(gen, dtype, batch, seqlen_q, seqlen_k, 6, 2, 32, 32)
    grad_out = randn([batch, seqlen_q, 6, 32], gen, dtype)
    kwargs = dict(causal=True, key_padding_mask=random_mask(batch, seqlen_k, gen))
    first = _gradients(q, k, v, grad_out, **kwargs)
    for _ in range(10):
        assert all(torch.equal(a, b) for a, b in zip(first, _gradients(q, k, v, grad_out,
                                                                        **kwargs)))
    threads = torch.get_num_threads()
    try:
        for n in (1, 3):
            torch.set_num_threads(n)
            again = _gradients(q, k, v, grad_out, **kwargs)
            assert all(torch.equal(a, b) for a, b in zip(first, again)), f"{n} threads"
    finally:
        torch.set_num_threads(threads)


def test_forward_is_thread_count_independent(gen):
    q, k, v = _qkv(gen, f32, 1, 257, 513, 4, 4, 64, 64)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out1 = vidattn.attention(q, k, v)
        torch.set_num_threads(3)
        out3 = vidattn.attention(q, k, v)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(out1, out3)


def test_double_backward_raises():
    """attention_backward has no derivative of its own: differentiating vidattn's gradients
    raises instead of silently giving zeros; a second-order graph elsewhere still works."""
    q = torch.randn(1, 16, 2, 8, dtype=torch.float64, requires_grad=True)
    (g,) = torch.autograd.grad(vidattn.attention(q, q, q).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="double backward"):
        torch.autograd.grad((g * g).sum(), q)
    w = torch.randn(3, dtype=torch.float64, requires_grad=True)
    (gw,) = torch.autograd.grad((w ** 3).sum() + vidattn.attention(q, q, q).sum(), w,
                                create_graph=True)
    (gww,) = torch.autograd.grad(gw.sum(), w)
    torch.testing.assert_close(gww, 6 * w.detach())
