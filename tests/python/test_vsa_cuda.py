"""The whole VSA op on CUDA: against the float64 CPU reference with the 2x rule, CUDA-graph
capture and replay of a forward + backward step (proves there is no host synchronisation),
bit-identical reruns, and the CUDA result next to the CPU op's. Skipped without a GPU."""
from __future__ import annotations

import zlib

import pytest
import torch

import vidattn
import vsa_reference as ref
from test_vsa import assert_2x, randn

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"

# (grid, tile, kv_grid, topk, gate, scale, B, H, Hkv, D, dtype)
CASES = [
    ((5, 7, 9), (4, 4, 4), None, 3, True, 1.0, 2, 3, 3, 64, torch.bfloat16),
    ((9, 10, 7), (2, 8, 8), None, 2, False, 4.0, 1, 2, 1, 128, torch.float16),
    ((4, 16, 16), (4, 8, 8), None, 2, True, 16.0, 1, 2, 2, 128, torch.bfloat16),
    ((5, 7, 9), (4, 4, 4), (3, 5, 6), 2, True, 4.0, 1, 4, 2, 128, torch.bfloat16),
    ((1, 1, 1), (4, 4, 4), None, 1, True, 1.0, 1, 1, 1, 64, torch.float16),
]


def _inputs(case, device):
    grid, tile, kv_grid, topk, use_gate, scale, B, H, Hkv, D, dtype = case
    seed = zlib.crc32(repr(case).encode()) % 100_000
    t = vidattn.VideoTiling(grid, tile, device=device)
    kt = vidattn.VideoTiling(kv_grid, tile, device=device) if kv_grid else None
    kvt = kt or t
    q = t.tile(randn((B, t.num_tokens, H, D), seed, dtype, scale).to(device))
    k = kvt.tile(randn((B, kvt.num_tokens, Hkv, D), seed + 1, dtype, scale).to(device))
    v = kvt.tile(randn((B, kvt.num_tokens, Hkv, D), seed + 2, dtype).to(device))
    gate = randn(q.shape, seed + 3, dtype).to(device) if use_gate else None
    dout = randn(q.shape, seed + 4, dtype).to(device)
    return t, kt, q, k, v, gate, dout


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-{c[1]}-kv{c[2]}-k{c[3]}-"
                         f"g{int(c[4])}-s{c[5]}-B{c[6]}H{c[7]}/{c[8]}D{c[9]}-{str(c[10])[6:]}")
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fused"])
def test_vsa_cuda_matches_float64_reference(case, deterministic):
    grid, tile, kv_grid, topk, use_gate, _, _, _, _, _, dtype = case
    t, kt, q, k, v, gate, dout = _inputs(case, DEV)
    inputs = [x.requires_grad_() for x in (q, k, v, gate) if x is not None]
    out, (idx, cnt) = vidattn.video_sparse_attention(
        q, k, v, tiling=t, kv_tiling=kt, topk=topk, gate=gate, return_selection=True,
        deterministic=deterministic)
    assert out.device.type == DEV and idx.device.type == DEV
    grads = torch.autograd.grad(out, inputs, dout)

    # The reference runs on the CPU with the selection the GPU made (the selection itself is
    # checked against float64 coarse scores in the coarse-stage tests).
    t_cpu = vidattn.VideoTiling(grid, tile)
    kt_cpu = vidattn.VideoTiling(kv_grid, tile) if kv_grid else None
    idx_c, cnt_c, dout_c = idx.cpu(), cnt.cpu(), dout.cpu()

    def run_ref(dt):
        xs = [x.detach().cpu().to(dt).requires_grad_() for x in inputs]
        g = xs[3] if use_gate else None
        o = ref.video_sparse(xs[0], xs[1], xs[2], t_cpu, kt_cpu, idx_c, cnt_c, g, None)
        return (o, *torch.autograd.grad(o, xs, dout_c.to(dt)))

    r64, rlp = run_ref(torch.float64), run_ref(dtype)
    names = ("out", "dq", "dk", "dv", "dgate")
    magnitude = max(r.abs().max().item() for r in r64)
    for i, got in enumerate((out, *grads)):
        assert_2x(names[i], got.cpu(), r64[i], rlp[i], dtype, 3.0 if names[i] == "dq" else 2.0,
                  magnitude)


def test_vsa_cuda_selection_equals_cpu_where_scores_are_clear():
    """Same inputs on both devices: the GPU's selection is the CPU's wherever no two coarse
    scores of a row are within fp32 rounding of the k-th one."""
    case = ((9, 10, 7), (4, 4, 4), None, 4, False, 4.0, 1, 3, 3, 64, torch.bfloat16)
    t, _, q, k, v, _, _ = _inputs(case, DEV)
    t_cpu = vidattn.VideoTiling((9, 10, 7), (4, 4, 4))
    _, (idx_g, _) = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=4,
                                                   return_selection=True)
    _, (idx_c, _) = vidattn.video_sparse_attention(q.cpu(), k.cpu(), v.cpu(), tiling=t_cpu,
                                                   topk=4, return_selection=True)
    s = ref.coarse_scores(q.cpu(), k.cpu(), t_cpu, None)
    kth = s.sort(-1, descending=True).values[..., 3:5]
    clear = (kth[..., 0] - kth[..., 1]) > 1e-4 * (s.abs().amax(-1) + 1)
    assert clear.float().mean() > 0.5  # the check below must cover most rows
    assert torch.equal(idx_g.cpu()[clear], idx_c[clear])


def _step(q, k, v, gate, dout, t):
    out = vidattn.video_sparse_attention(q, k, v, tiling=t, sparsity=0.75, gate=gate)
    out.backward(dout)
    return out


def test_vsa_forward_backward_captured_in_a_cuda_graph_and_replayed():
    """A whole VSA training step (pool, coarse attention, top-k, block-sparse forward, the
    transposed index, every backward) captured once and replayed on new inputs equals eager
    on those inputs bit for bit: nothing in it synchronises with the host."""
    case = ((4, 12, 16), (4, 4, 4), None, 0, True, 4.0, 1, 4, 4, 128, torch.bfloat16)
    t, _, q0, k0, v0, gate0, dout0 = _inputs(case, DEV)
    static = [x.clone().requires_grad_() for x in (q0, k0, v0, gate0)]
    static_dout = dout0.clone()

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up (allocator, autograd) off the capture stream
        for _ in range(2):
            _step(*static, static_dout, t)
            for x in static:
                x.grad = None
    torch.cuda.current_stream().wait_stream(side)

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = _step(*static, static_dout, t)

    for seed in (11, 12):
        g = torch.Generator().manual_seed(seed)
        fresh = [t.tile(torch.randn((1, t.num_tokens) + tuple(x.shape[2:]), generator=g)
                        .to(x.dtype).to(DEV)) for x in static[:3]]
        fresh.append(torch.randn(static[3].shape, generator=g).to(static[3].dtype).to(DEV))
        fresh_dout = torch.randn(static_dout.shape, generator=g).to(static_dout.dtype).to(DEV)
        with torch.no_grad():
            for s, f in zip(static, fresh):
                s.copy_(f)
            static_dout.copy_(fresh_dout)
        graph.replay()
        torch.cuda.synchronize()

        eager = [f.clone().requires_grad_() for f in fresh]
        out = _step(*eager, fresh_dout, t)
        assert torch.equal(static_out, out.detach())
        for s, e in zip(static, eager):
            assert torch.equal(s.grad, e.grad)


def test_vsa_cuda_backward_is_deterministic_over_50_runs():
    case = ((5, 7, 9), (4, 4, 4), None, 3, True, 4.0, 2, 3, 3, 64, torch.bfloat16)
    t, _, q, k, v, gate, dout = _inputs(case, DEV)
    xs = [x.requires_grad_() for x in (q, k, v, gate)]
    first = None
    for _ in range(50):
        out = vidattn.video_sparse_attention(xs[0], xs[1], xs[2], tiling=t, topk=3, gate=xs[3])
        got = [out.detach()] + list(torch.autograd.grad(out, xs, dout))
        if first is None:
            first = [x.clone() for x in got]
        else:
            for a, b in zip(first, got):
                assert torch.equal(a, b)
