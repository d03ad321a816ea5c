"""vidattn.apply_rope against a float64 reference: both pairings, both table widths, every
dtype, odd and empty shapes, strided inputs, gradients, opcheck and torch.compile."""
from __future__ import annotations

import pytest
import torch

import vidattn

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _pairs(d: int, interleaved: bool):
    """Indices of the first and second member of each pair."""
    half = d // 2
    idx = torch.arange(half)
    return (2 * idx, 2 * idx + 1) if interleaved else (idx, idx + half)


def rope_reference(x, cos, sin, interleaved, *, dtype=None):
    """The documented formula, written directly: every element j uses cos[s, j] / sin[s, j]
    of a full-width table (a [S, D/2] table gives both members of pair i the entry i).
    Computed in ``dtype`` (default: x's dtype)."""
    dtype = dtype or x.dtype
    x = x.to(dtype)
    d = x.shape[-1]
    a, b = _pairs(d, interleaved)
    if cos.shape[-1] == d // 2:
        full_c = torch.empty(cos.shape[0], d, dtype=cos.dtype)
        full_s = torch.empty_like(full_c)
        full_c[:, a], full_c[:, b] = cos, cos
        full_s[:, a], full_s[:, b] = sin, sin
        cos, sin = full_c, full_s
    c = cos.to(dtype)[None, :, None, :]
    s = sin.to(dtype)[None, :, None, :]
    out = torch.empty_like(x)
    out[..., a] = x[..., a] * c[..., a] - x[..., b] * s[..., a]
    out[..., b] = x[..., b] * c[..., b] + x[..., a] * s[..., b]
    return out


def _tables(s: int, d: int, full: bool, interleaved: bool, gen, *, distinct=False,
            dtype=torch.float32):
    """Angle tables. ``distinct`` gives the two members of a pair different entries (legal
    for [S, D] tables: the formula is then per element, not a rotation)."""
    theta = torch.rand(s, d // 2, generator=gen, dtype=torch.float64) * 6.3 - 3.15
    if not full:
        return theta.cos().to(dtype), theta.sin().to(dtype)
    a, b = _pairs(d, interleaved)
    full_theta = torch.empty(s, d, dtype=torch.float64)
    full_theta[:, a] = theta
    full_theta[:, b] = theta + (torch.rand(s, d // 2, generator=gen, dtype=torch.float64)
                                if distinct else 0.0)
    return full_theta.cos().to(dtype), full_theta.sin().to(dtype)


def _tolerance(x, cos, sin, interleaved, ref64):
    """2 x the error of PyTorch's own computation in x's dtype, plus a floor."""
    torch_err = (rope_reference(x, cos, sin, interleaved).double() - ref64).abs().max().item()
    floor = 1e-12 if x.dtype == torch.float64 else 1e-6 * max(1.0, ref64.abs().max().item())
    return 2 * torch_err + floor


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("scale", [1.0, 4.0, 16.0])
def test_forward_matches_float64_reference(dtype, interleaved, full, scale):
    seed = 1000 + DTYPES.index(dtype) * 100 + interleaved * 10 + full * 5 + int(scale)
    gen = _gen(seed)
    b, s, h, d = 2, 37, 3, 64  # odd S, B > 1, H not a power of two
    x = (torch.randn(b, s, h, d, generator=gen) * scale).to(dtype)
    cos, sin = _tables(s, d, full, interleaved, gen, distinct=full)
    out = vidattn.apply_rope(x, cos, sin, interleaved=interleaved)
    assert out.dtype == dtype and out.shape == x.shape and out.is_contiguous()
    ref64 = rope_reference(x.double(), cos.double(), sin.double(), interleaved)
    err = (out.double() - ref64).abs().max().item()
    assert err <= _tolerance(x, cos, sin, interleaved, ref64), err


@pytest.mark.parametrize("table_dtype", [torch.float64, torch.bfloat16, torch.float16])
def test_table_dtypes(table_dtype):
    gen = _gen(7)
    x = torch.randn(1, 9, 2, 16, generator=gen)
    cos, sin = _tables(9, 16, False, True, gen, dtype=table_dtype)
    out = vidattn.apply_rope(x, cos, sin)
    ref = rope_reference(x.double(), cos.double(), sin.double(), True)
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_rotation_preserves_pair_norms_and_half_equals_full_table():
    gen = _gen(11)
    x = torch.randn(2, 13, 5, 32, generator=gen, dtype=torch.float64)
    for interleaved in (True, False):
        half_c, half_s = _tables(13, 32, False, interleaved, _gen(12))
        full_c, full_s = _tables(13, 32, True, interleaved, _gen(12))
        out_half = vidattn.apply_rope(x, half_c, half_s, interleaved=interleaved)
        out_full = vidattn.apply_rope(x, full_c, full_s, interleaved=interleaved)
        torch.testing.assert_close(out_half, out_full, rtol=0, atol=1e-6)
        a, b = _pairs(32, interleaved)
        norms_in = x[..., a] ** 2 + x[..., b] ** 2
        norms_out = out_half[..., a] ** 2 + out_half[..., b] ** 2
        torch.testing.assert_close(norms_in, norms_out, rtol=1e-6, atol=1e-6)


def test_pairings_differ():
    """interleaved and NeoX pairings are different maps (guards against a flag ignored)."""
    gen = _gen(13)
    x = torch.randn(1, 4, 1, 8, generator=gen)
    cos, sin = _tables(4, 8, False, True, gen)
    assert not torch.allclose(vidattn.apply_rope(x, cos, sin, interleaved=True),
                              vidattn.apply_rope(x, cos, sin, interleaved=False))


def test_strided_inputs():
    gen = _gen(17)
    base = torch.randn(3, 2, 11, 40, 24, generator=gen)
    # [B, H, S, D] storage seen as [B, S, H, D], a batch slice and a sequence stride of 2.
    x = base[::2, 1].transpose(1, 2)[:, ::2]
    assert not x.is_contiguous() and x.stride(-1) == 1
    cos_storage = torch.empty(20, 40)
    sin_storage = torch.empty(20, 40)
    cos, sin = _tables(20, 24, True, False, gen)
    cos_storage[:, :24], sin_storage[:, :24] = cos, sin
    cos_view, sin_view = cos_storage[:, :24], sin_storage[:, :24]  # row stride 40
    cos_t = cos.t().contiguous().t()  # column-major table
    out = vidattn.apply_rope(x, cos_view, sin_view, interleaved=False)
    ref = rope_reference(x.double(), cos.double(), sin.double(), False)
    assert (out.double() - ref).abs().max().item() < 1e-5
    out_t = vidattn.apply_rope(x, cos_t, sin, interleaved=False)
    torch.testing.assert_close(out_t, out, rtol=0, atol=0)


def test_input_not_modified_and_contiguous_output():
    gen = _gen(19)
    x = torch.randn(2, 6, 2, 8, generator=gen)
    x_copy = x.clone()
    cos, sin = _tables(6, 8, False, True, gen)
    out = vidattn.apply_rope(x, cos, sin)
    assert out.data_ptr() != x.data_ptr()
    torch.testing.assert_close(x, x_copy, rtol=0, atol=0)


@pytest.mark.parametrize("shape", [(0, 5, 2, 8), (2, 0, 2, 8), (2, 5, 0, 8)])
def test_empty_inputs(shape):
    x = torch.randn(*shape)
    cos, sin = _tables(shape[1], 8, False, True, _gen(23))
    out = vidattn.apply_rope(x, cos, sin)
    assert out.shape == x.shape
    out.sum().backward() if x.requires_grad else None
    x.requires_grad_(True)
    vidattn.apply_rope(x, cos, sin).sum().backward()
    assert x.grad.shape == x.shape


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("full", [False, True])
def test_gradient_matches_float64_reference(dtype, interleaved, full):
    gen = _gen(2000 + DTYPES.index(dtype) * 10 + interleaved * 2 + full)
    b, s, h, d = 2, 21, 3, 32
    x = torch.randn(b, s, h, d, generator=gen).to(dtype).requires_grad_(True)
    grad_out = torch.randn(b, s, h, d, generator=gen).to(dtype)
    cos, sin = _tables(s, d, full, interleaved, gen, distinct=full)
    vidattn.apply_rope(x, cos, sin, interleaved=interleaved).backward(grad_out)
    x64 = x.detach().double().requires_grad_(True)
    rope_reference(x64, cos.double(), sin.double(), interleaved).backward(grad_out.double())
    xl = x.detach().clone().requires_grad_(True)
    rope_reference(xl, cos, sin, interleaved).backward(grad_out)  # torch in x's dtype
    torch_err = (xl.grad.double() - x64.grad).abs().max().item()
    floor = 1e-12 if dtype == torch.float64 else 1e-6
    err = (x.grad.double() - x64.grad).abs().max().item()
    assert x.grad.dtype == dtype
    assert err <= 2 * torch_err + floor, (err, torch_err)


def test_gradcheck_and_double_backward():
    gen = _gen(29)
    x = torch.randn(2, 5, 2, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    for interleaved in (True, False):
        for full in (False, True):
            cos, sin = _tables(5, 8, full, interleaved, gen, distinct=full, dtype=torch.float64)
            fn = lambda t: vidattn.apply_rope(t, cos, sin, interleaved=interleaved)  # noqa: E731
            assert torch.autograd.gradcheck(fn, (x,))
            assert torch.autograd.gradgradcheck(lambda t: fn(t) ** 2, (x,))


def test_no_gradient_to_tables():
    gen = _gen(31)
    x = torch.randn(1, 4, 2, 8, generator=gen, requires_grad=True)
    cos, sin = _tables(4, 8, False, True, gen)
    cos.requires_grad_(True)
    sin.requires_grad_(True)
    vidattn.apply_rope(x, cos, sin).sum().backward()
    assert x.grad is not None and cos.grad is None and sin.grad is None


def test_grad_from_non_contiguous_upstream():
    gen = _gen(37)
    x = torch.randn(2, 6, 3, 8, generator=gen, dtype=torch.float64, requires_grad=True)
    cos, sin = _tables(6, 8, False, False, gen, dtype=torch.float64)
    grad_out = torch.randn(2, 6, 8, 3, generator=gen, dtype=torch.float64).transpose(-1, -2)
    assert grad_out.stride(-1) != 1
    vidattn.apply_rope(x, cos, sin, interleaved=False).backward(grad_out)
    x64 = x.detach().clone().requires_grad_(True)
    rope_reference(x64, cos, sin, False).backward(grad_out)
    torch.testing.assert_close(x.grad, x64.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("interleaved", [True, False])
def test_opcheck(requires_grad, interleaved):
    gen = _gen(41 + interleaved)
    x = torch.randn(2, 7, 3, 16, generator=gen, requires_grad=requires_grad)
    for full in (False, True):
        cos, sin = _tables(7, 16, full, interleaved, gen)
        torch.library.opcheck(torch.ops.vidattn.apply_rope.default, (x, cos, sin),
                              {"interleaved": interleaved})
        torch.library.opcheck(torch.ops.vidattn.apply_rope.default, (x, cos, sin),
                              {"interleaved": interleaved, "transpose": True})


def test_meta_shapes():
    x = torch.empty(2, 7, 3, 16, device="meta", dtype=torch.bfloat16)
    cos = torch.empty(7, 8, device="meta")
    out = torch.ops.vidattn.apply_rope(x, cos, cos)
    assert out.shape == x.shape and out.dtype == x.dtype and out.is_contiguous()
    with pytest.raises(ValueError, match="cos"):
        torch.ops.vidattn.apply_rope(x, torch.empty(6, 8, device="meta"), cos)


def test_compile_fullgraph_no_graph_breaks():
    gen = _gen(43)
    x = torch.randn(2, 9, 3, 16, generator=gen, requires_grad=True)
    cos, sin = _tables(9, 16, False, False, gen)
    w = torch.randn(16, 16, generator=gen)

    def model(t):
        q = t @ w
        return vidattn.apply_rope(q, cos, sin, interleaved=False).relu().sum()

    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0
    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    torch._dynamo.reset()
    eager = model(x)
    (g_eager,) = torch.autograd.grad(eager, x)
    got = compiled(x)
    (g_comp,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, eager)
    torch.testing.assert_close(g_comp, g_eager)


def test_compile_dynamic_shapes():
    """Symbolic S through the Meta kernel (two lengths, one compiled graph)."""
    compiled = torch.compile(lambda t, c, s: vidattn.apply_rope(t, c, s), fullgraph=True,
                             dynamic=True, backend="aot_eager")
    for s in (5, 11):
        gen = _gen(47 + s)
        x = torch.randn(1, s, 2, 8, generator=gen)
        cos, sin = _tables(s, 8, False, True, gen)
        torch.testing.assert_close(compiled(x, cos, sin), vidattn.apply_rope(x, cos, sin))


def test_bad_inputs():
    x = torch.randn(2, 5, 3, 8)
    cos = torch.randn(5, 4)
    with pytest.raises(ValueError, match="'x' must be 4-D"):
        vidattn.apply_rope(x[0], cos, cos)
    with pytest.raises(ValueError, match="must be even"):
        vidattn.apply_rope(torch.randn(2, 5, 3, 7), torch.randn(5, 7), torch.randn(5, 7))
    with pytest.raises(ValueError, match=r"'cos' must be \[S, D\] = \[5, 8\] or \[S, D/2\]"):
        vidattn.apply_rope(x, torch.randn(6, 4), torch.randn(6, 4))
    with pytest.raises(ValueError, match="'cos' must be"):
        vidattn.apply_rope(x, torch.randn(5, 3), torch.randn(5, 3))
    with pytest.raises(ValueError, match="'sin' must have the shape of cos"):
        vidattn.apply_rope(x, cos, torch.randn(5, 8))
    with pytest.raises(ValueError, match="'cos' .*2-D"):
        vidattn.apply_rope(x, cos[None], cos[None])
    with pytest.raises(TypeError, match="'x' must be float32"):
        vidattn.apply_rope(x.int(), cos, cos)
    with pytest.raises(TypeError, match="'sin' must have dtype float32"):
        vidattn.apply_rope(x, cos, cos.double())
    with pytest.raises(TypeError, match="'cos' must be float32"):
        vidattn.apply_rope(x, cos.int(), cos.int())
    with pytest.raises(ValueError, match="unit stride"):
        vidattn.apply_rope(torch.randn(2, 5, 8, 3).transpose(-1, -2), cos, cos)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("full", [False, True])
def test_cuda_matches_float64_reference(dtype, interleaved, full):
    gen = _gen(3000 + DTYPES.index(dtype) * 10 + interleaved * 2 + full)
    b, s, h, d = 2, 37, 3, 64
    x = (torch.randn(b, s, h, d, generator=gen) * 4).to(dtype)
    cos, sin = _tables(s, d, full, interleaved, gen, distinct=full)
    out = vidattn.apply_rope(x.cuda(), cos.cuda(), sin.cuda(), interleaved=interleaved)
    assert out.is_cuda and out.dtype == dtype and out.is_contiguous()
    ref64 = rope_reference(x.double(), cos.double(), sin.double(), interleaved)
    err = (out.cpu().double() - ref64).abs().max().item()
    assert err <= _tolerance(x, cos, sin, interleaved, ref64), err


@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize("layout", ["head_slice", "misaligned", "d16"])
def test_cuda_vector_and_scalar_paths(dtype, interleaved, full, layout):
    """16-bit x takes 16-byte loads when rows and heads are 16-byte aligned (a head slice of
    a wider tensor: the sequence-parallel layout), element loads otherwise (a view one element
    into its storage); both against the float64 reference, output poisoned first."""
    gen = _gen(3200 + interleaved * 2 + full + 10 * ["head_slice", "misaligned", "d16"].index(layout))
    b, s, h, d = 2, 29, 3, 16 if layout == "d16" else 128
    wide = (torch.randn(b, s, 2 * h, d, generator=gen) * 4).to(dtype).cuda()
    if layout == "misaligned":
        flat = torch.randn(b * s * h * d + 1, generator=gen).to(dtype).cuda()
        x = flat[1:].view(b, s, h, d)
    else:
        x = wide[:, :, h:]  # head stride d, row stride 2 h d
    cos, sin = _tables(s, d, full, interleaved, gen, distinct=full)
    cos, sin = cos.to(dtype).cuda(), sin.to(dtype).cuda()
    torch.cuda.empty_cache()
    poison = torch.full((4 * b * s * h * d,), float("nan"), device="cuda")
    del poison
    out = vidattn.apply_rope(x, cos, sin, interleaved=interleaved)
    ref64 = rope_reference(x.cpu().double(), cos.cpu().double(), sin.cpu().double(), interleaved)
    assert not out.isnan().any()
    err = (out.cpu().double() - ref64).abs().max().item()
    assert err <= _tolerance(x.cpu(), cos.cpu(), sin.cpu(), interleaved, ref64), err


@needs_cuda
def test_cuda_strided_gradients_and_tables():
    gen = _gen(3100)
    base = torch.randn(2, 3, 20, 16, generator=gen, dtype=torch.float64)
    x = base.transpose(1, 2).cuda().requires_grad_(True)  # [B, S, H, D] view of [B, H, S, D]
    cos, sin = _tables(20, 16, True, False, gen, distinct=True, dtype=torch.float64)
    cos_t = cos.t().contiguous().t().cuda()  # column-major table
    grad_out = torch.randn(2, 20, 3, 16, generator=gen, dtype=torch.float64)
    vidattn.apply_rope(x, cos_t, sin.cuda(), interleaved=False).backward(grad_out.cuda())
    x64 = x.detach().cpu().requires_grad_(True)
    ref = rope_reference(x64, cos, sin, False)
    ref.backward(grad_out)
    torch.testing.assert_close(x.grad.cpu(), x64.grad, rtol=0, atol=1e-12)
    fn = lambda t: vidattn.apply_rope(t, cos_t, sin.cuda(), interleaved=False)  # noqa: E731
    small = torch.randn(1, 20, 1, 16, generator=gen, dtype=torch.float64).cuda()
    assert torch.autograd.gradcheck(fn, (small.requires_grad_(True),))


@needs_cuda
def test_cuda_opcheck_and_empty():
    gen = _gen(3200)
    x = torch.randn(2, 7, 3, 16, generator=gen).cuda().requires_grad_(True)
    cos, sin = (t.cuda() for t in _tables(7, 16, False, True, gen))
    torch.library.opcheck(torch.ops.vidattn.apply_rope.default, (x, cos, sin))
    empty = torch.randn(0, 7, 3, 16).cuda()
    assert vidattn.apply_rope(empty, cos, sin).shape == empty.shape
    with pytest.raises(ValueError, match="argument 'cos' must be on cuda:0 like 'x', got cpu"):
        vidattn.apply_rope(x, cos.cpu(), sin.cpu())


@needs_cuda
@pytest.mark.parametrize("interleaved", [True, False])
@pytest.mark.parametrize("full", [False, True])
def test_cuda_vector_path_gradient(interleaved, full):
    """The 16-byte path's transposed rotation (the backward of 16-bit x, a head slice as in
    the sequence-parallel layer) against the float64 gradient."""
    gen = _gen(3300 + interleaved * 2 + full)
    b, s, h, d = 2, 29, 3, 128
    wide = torch.randn(b, s, 2 * h, d, generator=gen).to(torch.bfloat16)
    x = wide.cuda()[:, :, h:].requires_grad_(True)
    grad_out = (torch.randn(b, s, h, d, generator=gen) * 4).to(torch.bfloat16)
    cos, sin = _tables(s, d, full, interleaved, gen, distinct=full)
    vidattn.apply_rope(x, cos.cuda(), sin.cuda(), interleaved=interleaved).backward(
        grad_out.cuda())
    x64 = x.detach().cpu().double().requires_grad_(True)
    rope_reference(x64, cos.double(), sin.double(), interleaved).backward(grad_out.double())
    xl = x.detach().cpu().clone().requires_grad_(True)
    rope_reference(xl, cos, sin, interleaved).backward(grad_out)  # torch in bf16
    torch_err = (xl.grad.double() - x64.grad).abs().max().item()
    err = (x.grad.cpu().double() - x64.grad).abs().max().item()
    assert not x.grad.isnan().any()
    assert err <= 2 * torch_err + 1e-6 * max(1.0, x64.grad.abs().max().item()), (err, torch_err)
