"""Head dims D (q, k) != Dv (v) at the shape level, CPU-only (runs in CI): the Meta kernels of
every attention op give the output v's head dim and the gradients their input's shape,
directly on meta tensors and under FakeTensorMode (what torch.compile traces with); the CPU
op agrees; and the sm80 instance files match their generator and the dispatch's widths. The
CUDA kernels' numbers are in test_head_dims_cuda.py."""
from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import vidattn

ops = torch.ops.vidattn
PAIRS = [(192, 128), (64, 128), (128, 64), (40, 72), (8, 256)]


def ids(p):
    return f"D{p[0]}_Dv{p[1]}"


@pytest.mark.parametrize("dims", PAIRS, ids=ids)
def test_dense_meta_output_has_v_head_dim(dims):
    D, Dv = dims
    q = torch.empty(2, 9, 4, D, device="meta", dtype=torch.bfloat16)
    k = torch.empty(2, 11, 2, D, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 11, 2, Dv, device="meta", dtype=torch.bfloat16)
    out, lse = ops.attention(q, k, v)
    assert out.shape == (2, 9, 4, Dv) and out.device.type == "meta"
    assert lse.shape == (2, 4, 9)
    dq, dk, dv = ops.attention_backward(out, q, k, v, out, lse, scale=None, causal=False,
                                        key_padding_mask=None, query_padding_mask=None,
                                        cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0,
                                        max_seqlen_k=0)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("dims", PAIRS, ids=ids)
def test_varlen_meta_output_has_v_head_dim(dims):
    D, Dv = dims
    q = torch.empty(13, 4, D, device="meta", dtype=torch.float16)
    k = torch.empty(17, 2, D, device="meta", dtype=torch.float16)
    v = torch.empty(17, 2, Dv, device="meta", dtype=torch.float16)
    cu_q = torch.empty(3, device="meta", dtype=torch.int32)
    cu_k = torch.empty(3, device="meta", dtype=torch.int32)
    out, lse = ops.attention_varlen(q, k, v, cu_q, cu_k, 8, 9)
    assert out.shape == (13, 4, Dv) and lse.shape == (4, 13)


@pytest.mark.parametrize("dims", PAIRS, ids=ids)
def test_block_sparse_meta_output_has_v_head_dim(dims):
    D, Dv = dims
    q = torch.empty(1, 128, 2, D, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 192, 2, D, device="meta", dtype=torch.bfloat16)
    v = torch.empty(1, 192, 2, Dv, device="meta", dtype=torch.bfloat16)
    idx = torch.empty(1, 2, 2, 3, device="meta", dtype=torch.int32)
    cnt = torch.empty(1, 2, 2, device="meta", dtype=torch.int32)
    out, lse = ops.block_sparse_attention(q, k, v, idx, cnt, tile_volume=64)
    assert out.shape == (1, 128, 2, Dv) and lse.shape == (1, 2, 128)
    k2q_off = torch.empty(1, 2, 4, device="meta", dtype=torch.int32)
    k2q_idx = torch.empty(1, 2, 6, device="meta", dtype=torch.int32)
    dq, dk, dv = ops.block_sparse_attention_backward(
        out, q, k, v, out, lse, idx, cnt, k2q_off, k2q_idx, tile_volume=64, q_block_sizes=None,
        kv_block_sizes=None, scale=None, deterministic=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


@pytest.mark.parametrize("dims", PAIRS, ids=ids)
def test_fake_tensor_mode_matches_the_cpu_op(dims):
    """The fake kernel's output (shape, dtype, strides) is the CPU op's, gradients included."""
    D, Dv = dims
    g = torch.Generator().manual_seed(D * 1000 + Dv)
    q = torch.randn(1, 5, 2, D, generator=g)
    k = torch.randn(1, 7, 1, D, generator=g)
    v = torch.randn(1, 7, 1, Dv, generator=g)
    real = vidattn.attention(q, k, v, causal=True)
    with FakeTensorMode(allow_non_fake_inputs=False) as mode:
        fq, fk, fv = (mode.from_tensor(t) for t in (q, k, v))
        fake = vidattn.attention(fq, fk, fv, causal=True)
    assert fake.shape == real.shape == (1, 5, 2, Dv)
    assert fake.dtype == real.dtype and fake.stride() == real.stride()
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    grads = torch.autograd.grad(vidattn.attention(*leaves, causal=True).sum(), leaves)
    assert [g.shape for g in grads] == [t.shape for t in (q, k, v)]


def test_sm80_instances_are_the_generators_output_and_cover_the_dispatch_widths():
    """The committed instance files are exactly what tools/codegen/gen_sm80_instances.py
    writes, and the padded widths the dispatch maps to (src/cuda/dispatch/head_dims.h) are the
    generator's."""
    import importlib.util
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[2]
    spec = importlib.util.spec_from_file_location(
        "gen_sm80_instances", root / "tools" / "codegen" / "gen_sm80_instances.py")
    gen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gen)
    written = {name: gen.TEMPLATE.format(**fields) for name, fields in gen.files()}
    committed = {p.name: p.read_text() for p in gen.DIR.glob("attn_*_sm80.cu")}
    assert committed == written
    dispatch = (root / "src" / "cuda" / "dispatch" / "head_dims.h").read_text()
    padded = {int(w) for w in re.findall(r"integral_constant<int, (\d+)>\{\}, std::true_type",
                                         dispatch)}
    exact = {int(w) for w in re.findall(r"integral_constant<int, (\d+)>\{\}, std::false_type",
                                        dispatch)}
    assert padded == set(gen.PADDED_WIDTHS) and exact == set(gen.EXACT_WIDTHS)
