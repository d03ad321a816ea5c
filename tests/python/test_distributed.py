"""vidattn.DistributedAttention on 2 and 4 CPU processes (gloo), spawned by the tests: the
output shard and every gradient equal the single-process result on the same inputs, for dense
attention (with and without replicated tokens, padding, RoPE, grouped heads) and VSA; and the
layer compiles with fullgraph=True, zero graph breaks, matching eager, under gloo."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist

import vidattn
from spawned_group import assert_task, run_tasks

HAVE_VSA = hasattr(vidattn, "video_sparse_attention")


# ---- the single-process reference (no collective, no DistributedAttention code) -----------

def _make_case(seed, *, world, s_local, seq_len, heads=4, kv_heads=None, head_dim=16,
               head_dim_v=None, text_len=0, rope=None, gate=False, dtype=torch.float32, batch=2):
    """Global inputs, identical on every rank (same seed)."""
    gen = torch.Generator().manual_seed(seed)
    kv_heads = kv_heads or heads
    head_dim_v = head_dim_v or head_dim
    padded = world * s_local

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype)

    case = {
        "q": rnd(batch, padded, heads, head_dim),
        "k": rnd(batch, padded, kv_heads, head_dim),
        "v": rnd(batch, padded, kv_heads, head_dim_v),
        "grad_out": rnd(batch, padded, heads, head_dim_v),
        "seq_len": seq_len,
        "rope": rope,
    }
    if rope is not None:
        width = head_dim if rope == "full" else head_dim // 2
        theta = torch.rand(seq_len, width, generator=gen, dtype=torch.float64) * 6.0
        case["cos"], case["sin"] = theta.cos().float(), theta.sin().float()
    if text_len:
        case["text"] = (rnd(batch, text_len, heads, head_dim), rnd(batch, text_len, kv_heads, head_dim),
                        rnd(batch, text_len, kv_heads, head_dim_v))
        case["grad_text"] = rnd(batch, text_len, heads, head_dim_v)
    if gate:
        case["gate"] = rnd(batch, padded, heads, head_dim)
    return case


def _reference(case, backend, tiling=None, topk=None):
    """Full-sequence attention in one process: output and gradients of the loss
    sum(out * grad_out) + sum(text_out * grad_text)."""
    leaves = {name: case[name].clone().requires_grad_(True) for name in ("q", "k", "v")}
    n = case["seq_len"]
    q, k, v = (leaves[name][:, :n] for name in ("q", "k", "v"))
    if case["rope"] is not None:
        q = vidattn.apply_rope(q, case["cos"], case["sin"])
        k = vidattn.apply_rope(k, case["cos"], case["sin"])
    text_leaves = None
    if "text" in case:
        text_leaves = [t.clone().requires_grad_(True) for t in case["text"]]
        q, k, v = (torch.cat([a, b], dim=1) for a, b in zip((q, k, v), text_leaves))
    if backend == "dense":
        out = vidattn.attention(q, k, v)
    else:
        gate = None
        if "gate" in case:
            leaves["gate"] = case["gate"].clone().requires_grad_(True)
            gate = tiling.tile(leaves["gate"][:, :n])
        out = tiling.untile(vidattn.video_sparse_attention(
            tiling.tile(q), tiling.tile(k), tiling.tile(v), tiling=tiling, topk=topk, gate=gate))
    loss = (out[:, :n] * case["grad_out"][:, :n]).sum()
    result = {"out": torch.nn.functional.pad(out[:, :n], (0, 0, 0, 0, 0, case["q"].shape[1] - n))}
    if text_leaves is not None:
        result["text_out"] = out[:, n:]
        loss = loss + (out[:, n:] * case["grad_text"]).sum()
    loss.backward()
    for name, leaf in leaves.items():
        result["d" + name] = leaf.grad
    if text_leaves is not None:
        for name, leaf in zip(("dtext_q", "dtext_k", "dtext_v"), text_leaves):
            result[name] = leaf.grad
    return {k_: v_.detach() for k_, v_ in result.items()}


def _run_sharded(case, module, world, rank, group=None):
    """This rank's part: shards in, the loss counting the replicated output once in total."""
    s_local = case["q"].shape[1] // world
    rows = slice(rank * s_local, (rank + 1) * s_local)
    names = ["q", "k", "v"] + (["gate"] if "gate" in case else [])
    shards = {name: case[name][:, rows].clone().requires_grad_(True) for name in names}
    kwargs = {"seq_len": case["seq_len"]}
    if case["rope"] is not None:
        kwargs.update(cos=case["cos"], sin=case["sin"])
    text = None
    if "text" in case:
        text = [t.clone().requires_grad_(True) for t in case["text"]]
        kwargs.update(replicated_q=text[0], replicated_k=text[1], replicated_v=text[2])
    if "gate" in case:
        kwargs["gate"] = shards["gate"]
    result = module(shards["q"], shards["k"], shards["v"], **kwargs)
    out, text_out = result if text is not None else (result, None)
    # Inference (no autograd) takes other copy paths in the VSA pipeline: the same output.
    with torch.no_grad():
        again = module(shards["q"], shards["k"], shards["v"], **kwargs)
    assert torch.equal(again if text is None else again[0], out.detach())
    loss = (out * case["grad_out"][:, rows]).sum()
    if text_out is not None:
        loss = loss + (text_out * case["grad_text"]).sum() / world
    loss.backward()
    got = {"out": out.detach()}
    for name, leaf in shards.items():
        got["d" + name] = leaf.grad
    if text is not None:
        got["text_out"] = text_out.detach()
        for name, leaf in zip(("dtext_q", "dtext_k", "dtext_v"), text):
            grad = leaf.grad.clone()
            if world > 1:  # partial on each rank (its heads): the sum is the full gradient
                dist.all_reduce(grad, group=group)
            got[name] = grad
    return got, rows


def _assert_matches(got, ref, rows, label):
    for name, value in got.items():
        expected = ref[name][:, rows] if name in ("out", "dq", "dk", "dv", "dgate") else ref[name]
        assert value.shape == expected.shape, (label, name, value.shape, expected.shape)
        # Each head's attention is computed exactly as in one process; only the order of
        # independent work differs, so the results agree to rounding (in practice exactly).
        # On CUDA, a kernel may split work by the head count: allow one bf16 rounding step.
        rtol, atol = (1e-2, 1e-2) if value.is_cuda else (1e-5, 1e-6)
        torch.testing.assert_close(value, expected, rtol=rtol, atol=atol,
                                   msg=lambda m: f"{label}: {name}: {m}")


# ---- the cases --------------------------------------------------------------------------

def _dense_cases(world):
    # (label, make_case kwargs); S_local * world - seq_len rows of padding.
    cases = [
        ("plain", dict(s_local=12, seq_len=12 * world)),
        ("padding", dict(s_local=12, seq_len=12 * world - 5)),
        ("text", dict(s_local=10, seq_len=10 * world, text_len=7)),
        ("text+padding+rope", dict(s_local=10, seq_len=10 * world - 3, text_len=5, rope="half")),
        ("rope-full", dict(s_local=9, seq_len=9 * world - 1, rope="full")),
        ("float64", dict(s_local=8, seq_len=8 * world - 2, text_len=3, dtype=torch.float64)),
        ("bfloat16", dict(s_local=8, seq_len=8 * world - 1, text_len=3, rope="half",
                          dtype=torch.bfloat16)),
    ]
    if world == 2:  # grouped heads and Dv != D go through one fused all-to-all of mixed widths
        cases.append(("gqa+dv", dict(s_local=11, seq_len=21, kv_heads=2, head_dim_v=8,
                                     text_len=4, rope="half")))
    return cases


def _vsa_cases(world):
    # grid (3, 6, 10) = 180 tokens, 6 tiles of 4x4x4; (3, 5, 9) = 135 tokens needs padding.
    return [
        ("vsa", (3, 6, 10), dict(gate=False, rope="half")),
        ("vsa+gate+padding", (3, 5, 9), dict(gate=True)),
        # B = 1 with heads to pipeline: RoPE before the all-to-all into the send buffers.
        ("vsa b1+rope+gate+padding", (3, 5, 9), dict(gate=True, rope="half", batch=1,
                                                      heads=4 * world)),
        ("vsa b1+full table", (3, 6, 10), dict(rope="full", batch=1, heads=8 * world)),
    ]


def _cuda_dense_cases(world):
    # The CUDA kernels take bf16 / fp16 with head dims 64 and 128.
    return [
        ("cuda plain", dict(s_local=64, seq_len=64 * world, head_dim=64, dtype=torch.bfloat16)),
        ("cuda text+padding+rope", dict(s_local=64, seq_len=64 * world - 5, head_dim=64,
                                        text_len=7, rope="half", dtype=torch.bfloat16)),
    ]


def _to_device(case, device):
    moved = {}
    for name, value in case.items():
        if isinstance(value, torch.Tensor):
            value = value.to(device)
        elif isinstance(value, tuple):
            value = tuple(t.to(device) for t in value)
        moved[name] = value
    return moved


def _check_all(rank, world, group=None, device=None):
    seed = 100 * world
    cases = _dense_cases(world) if device is None else _cuda_dense_cases(world)
    for label, kwargs in cases:
        seed += 1
        case = _make_case(seed, world=world, **kwargs)
        if device is not None:
            case = _to_device(case, device)
        got, rows = _run_sharded(case, vidattn.DistributedAttention(group=group), world, rank, group)
        _assert_matches(got, _reference(case, "dense"), rows, f"world {world} dense {label}")


def _check_vsa(rank, world, group=None, device=None):
    """device: run on it in bfloat16 with D = 64 (what the CUDA kernels take)."""
    seed = 200 * world
    for label, grid, kwargs in _vsa_cases(world):
        seed += 1
        tokens = grid[0] * grid[1] * grid[2]
        s_local = -(-tokens // world)
        if device is not None:
            kwargs = dict(kwargs, head_dim=64, dtype=torch.bfloat16)
        case = _make_case(seed, world=world, s_local=s_local, seq_len=tokens, **kwargs)
        if device is not None:
            case = _to_device(case, device)
        tiling = vidattn.VideoTiling(grid=grid, tile=(4, 4, 4), device=device)
        module = vidattn.DistributedAttention("vsa", group=group, tiling=tiling, topk=2)
        got, rows = _run_sharded(case, module, world, rank, group)
        _assert_matches(got, _reference(case, "vsa", tiling, 2), rows, f"world {world} {label}")


def _vsa_head_chunks(rank, world):
    """The pipelined VSA path (head chunks) gives exactly the unpipelined result, and a chunk
    count that does not divide the heads is refused."""
    grid = (3, 6, 10)
    tokens = grid[0] * grid[1] * grid[2]
    case = _make_case(401, world=world, s_local=-(-tokens // world), seq_len=tokens,
                      heads=4 * world, gate=True, rope="half", batch=1)
    tiling = vidattn.VideoTiling(grid=grid, tile=(4, 4, 4))
    results = []
    for chunks, margin in ((1, None), (2, None), (4, None), (2, 0), (2, 8), ((1, 3), None),
                           ((1, 2, 1), None), ([3, 1], None)):
        module = vidattn.DistributedAttention("vsa", tiling=tiling, topk=2, head_chunks=chunks,
                                              sm_margin=margin)
        results.append(_run_sharded(case, module, world, rank)[0])
    for other in results[1:]:
        for name, value in results[0].items():
            assert torch.equal(value, other[name]), name
    for spec, text in ((3, "head_chunks=3 must divide"), ((1, 2), "must sum to the 4 heads")):
        bad = vidattn.DistributedAttention("vsa", tiling=tiling, topk=2, head_chunks=spec)
        try:
            _run_sharded(case, bad, world, rank)
        except ValueError as e:
            assert text in str(e), str(e)
        else:
            raise AssertionError(f"head_chunks={spec} with 4 heads per rank did not raise")


def _compile_check(rank, world):
    """fullgraph compile of a small model around the layer: zero graph breaks, same output
    and gradients as eager."""
    gen = torch.Generator().manual_seed(7)
    b, s_local, h, d = 1, 8, 4, 16
    seq_len = world * s_local - 3
    proj = torch.randn(d, 3 * d, generator=gen) / 4
    theta = torch.rand(seq_len, d // 2, generator=gen)
    cos, sin = theta.cos(), theta.sin()
    text = [torch.randn(b, 5, h, d, generator=gen) for _ in range(3)]
    x_full = torch.randn(b, world * s_local, h, d, generator=gen)
    layer = vidattn.DistributedAttention()

    def model(x):
        q, k, v = (x @ proj).chunk(3, dim=-1)
        out, text_out = layer(q, k, v, seq_len=seq_len, cos=cos, sin=sin, replicated_q=text[0],
                              replicated_k=text[1], replicated_v=text[2])
        return out.square().sum() + text_out.sum() / world

    x = x_full[:, rank * s_local:(rank + 1) * s_local].clone().requires_grad_(True)
    explanation = torch._dynamo.explain(model)(x)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    assert explanation.graph_count == 1, explanation.graph_count
    torch._dynamo.reset()
    eager = model(x)
    (g_eager,) = torch.autograd.grad(eager, x)
    compiled = torch.compile(model, fullgraph=True, backend=os.environ.get(
        "VIDATTN_TEST_COMPILE_BACKEND", "aot_eager"))
    got = compiled(x)
    (g_comp,) = torch.autograd.grad(got, x)
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(g_comp, g_eager, rtol=1e-5, atol=1e-5)


def _heads_not_divisible(rank, world):
    x = torch.randn(1, 4, world + 1, 8)
    with pytest.raises(ValueError, match=rf"heads of q \({world + 1}\) must be divisible by "
                                         rf"the world size \({world}\)"):
        vidattn.DistributedAttention()(x, x, x)
    y = torch.randn(1, 4, 2 * world, 8)
    with pytest.raises(ValueError, match=r"heads of k \(1\) must be divisible"):
        vidattn.DistributedAttention()(y, y[:, :, :1], y[:, :, :1])


def _subgroup_parity(rank, world):
    """A 2-rank group inside the 4-rank world: the layer runs on the group it was given."""
    groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]  # every rank creates both
    group = groups[rank // 2]
    sub_rank = dist.get_rank(group)
    for seed, (label, kwargs) in enumerate(_dense_cases(2)[-2:]):
        case = _make_case(300 + seed, world=2, **kwargs)
        got, rows = _run_sharded(case, vidattn.DistributedAttention(group=group), 2, sub_rank,
                                 group)
        _assert_matches(got, _reference(case, "dense"), rows, f"subgroup {label}")


def _compile_vsa_check(rank, world):
    """The VSA layer (tiling, gate, RoPE, padding) under fullgraph compile, on both pipeline
    paths (B = 1 and B = 2)."""
    for batch in (1, 2):
        _compile_vsa_case(rank, world, batch)
        torch._dynamo.reset()


def _compile_vsa_case(rank, world, batch):
    gen = torch.Generator().manual_seed(8)
    grid = (3, 5, 9)  # 135 tokens: padded to a multiple of the world size
    tokens = grid[0] * grid[1] * grid[2]
    s_local = -(-tokens // world)
    h, d = 4, 16
    theta = torch.rand(tokens, d // 2, generator=gen)
    cos, sin = theta.cos(), theta.sin()
    full = [torch.randn(batch, world * s_local, h, d, generator=gen) for _ in range(4)]
    rows = slice(rank * s_local, (rank + 1) * s_local)
    q, k, v, gate = (t[:, rows].clone().requires_grad_(True) for t in full)
    layer = vidattn.DistributedAttention(
        "vsa", tiling=vidattn.VideoTiling(grid=grid, tile=(4, 4, 4)), topk=2)

    def model(q, k, v, gate):
        return layer(q, k, v, seq_len=tokens, cos=cos, sin=sin, gate=gate).square().sum()

    explanation = torch._dynamo.explain(model)(q, k, v, gate)
    assert explanation.graph_break_count == 0, explanation.break_reasons
    torch._dynamo.reset()
    eager = model(q, k, v, gate)
    g_eager = torch.autograd.grad(eager, (q, k, v, gate))
    compiled = torch.compile(model, fullgraph=True, backend=os.environ.get(
        "VIDATTN_TEST_COMPILE_BACKEND", "aot_eager"))
    got = compiled(q, k, v, gate)
    g_comp = torch.autograd.grad(got, (q, k, v, gate))
    torch.testing.assert_close(got, eager, rtol=1e-5, atol=1e-5)
    for a, b in zip(g_comp, g_eager):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


TASKS = {
    "parity": lambda rank, world: _check_all(rank, world),
    "heads_not_divisible": _heads_not_divisible,
    "vsa": _check_vsa,
    "parity_cuda": lambda rank, world: _check_all(rank, world, device=torch.device("cuda", rank)),
    "vsa_cuda": lambda rank, world: _check_vsa(rank, world, device=torch.device("cuda", rank)),
    # The NCCL task's bf16 / D = 64 cases, here on the CPU over gloo.
    "vsa_bf16": lambda rank, world: _check_vsa(rank, world, device=torch.device("cpu")),
    "compile": _compile_check,
    "compile_vsa": _compile_vsa_check,
    "subgroup": _subgroup_parity,
    "vsa_chunks": _vsa_head_chunks,
}


@pytest.fixture(scope="module")
def two_processes():
    return run_tasks(__name__, 2, ["parity", "heads_not_divisible", "compile"]
                     + (["vsa", "vsa_bf16", "vsa_chunks", "compile_vsa"] if HAVE_VSA else []))


@pytest.fixture(scope="module")
def four_processes():
    return run_tasks(__name__, 4,
                     ["parity", "heads_not_divisible", "subgroup"] + (["vsa"] if HAVE_VSA else []))


@pytest.fixture(scope="module")
def two_gpus():
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA devices")
    return run_tasks(__name__, 2, ["parity_cuda"] + (["vsa_cuda"] if HAVE_VSA else []),
                     backend="nccl")


# ---- tests ------------------------------------------------------------------------------

def test_parity_two_processes(two_processes):
    assert_task(two_processes, "parity")


def test_parity_four_processes(four_processes):
    assert_task(four_processes, "parity")


@pytest.mark.skipif(not HAVE_VSA, reason="this build has no vidattn.video_sparse_attention")
def test_vsa_parity_two_processes(two_processes):
    assert_task(two_processes, "vsa")


@pytest.mark.skipif(not HAVE_VSA, reason="this build has no vidattn.video_sparse_attention")
def test_vsa_parity_bfloat16_two_processes(two_processes):
    assert_task(two_processes, "vsa_bf16")


@pytest.mark.skipif(not HAVE_VSA, reason="this build has no vidattn.video_sparse_attention")
def test_vsa_head_chunk_pipeline_changes_nothing(two_processes):
    assert_task(two_processes, "vsa_chunks")


@pytest.mark.skipif(not HAVE_VSA, reason="this build has no vidattn.video_sparse_attention")
def test_vsa_parity_four_processes(four_processes):
    assert_task(four_processes, "vsa")


def test_parity_two_gpus_nccl(two_gpus):
    """The same parity with NCCL on two GPUs (bf16, the CUDA kernels' dtypes)."""
    assert_task(two_gpus, "parity_cuda")


@pytest.mark.skipif(not HAVE_VSA, reason="this build has no vidattn.video_sparse_attention")
def test_vsa_parity_two_gpus_nccl(two_gpus):
    """VSA (CUDA tiling, coarse stage, block-sparse, combine) sharded over two GPUs equals the
    single-GPU result."""
    assert_task(two_gpus, "vsa_cuda")


def test_parity_on_a_subgroup(four_processes):
    assert_task(four_processes, "subgroup")


def test_heads_not_divisible_raise(two_processes, four_processes):
    assert_task(two_processes, "heads_not_divisible")
    assert_task(four_processes, "heads_not_divisible")


def test_compile_fullgraph_under_gloo(two_processes):
    """Zero graph breaks (explain) and compiled output and gradient equal eager. The compile
    backend is aot_eager by default (Dynamo + AOTAutograd: the collectives and vidattn ops
    traced into one forward and one backward graph); VIDATTN_TEST_COMPILE_BACKEND=inductor
    also runs Inductor's CPU codegen (minutes on a 2-core machine)."""
    assert_task(two_processes, "compile")


@pytest.mark.skipif(not HAVE_VSA, reason="this build has no vidattn.video_sparse_attention")
def test_compile_fullgraph_vsa_under_gloo(two_processes):
    assert_task(two_processes, "compile_vsa")


def test_world_size_one_is_plain_attention():
    """Without torch.distributed the layer is the single-process computation itself."""
    for label, kwargs in _dense_cases(1):
        case = _make_case(5, world=1, **kwargs)
        got, rows = _run_sharded(case, vidattn.DistributedAttention(), 1, 0)
        _assert_matches(got, _reference(case, "dense"), rows, f"world 1 {label}")


def test_bad_arguments():
    layer = vidattn.DistributedAttention()
    x = torch.randn(1, 6, 2, 8)
    with pytest.raises(ValueError, match="backend must be 'dense' or 'vsa'"):
        vidattn.DistributedAttention("flash")
    with pytest.raises(ValueError, match="needs tiling"):
        vidattn.DistributedAttention("vsa", topk=2)
    with pytest.raises(ValueError, match="are for backend='vsa'"):
        vidattn.DistributedAttention(topk=2)
    with pytest.raises(ValueError, match="sm_margin must be >= 0"):
        vidattn.DistributedAttention(sm_margin=-1)
    with pytest.raises(ValueError, match="topk must be >= 1"):
        vidattn.DistributedAttention("vsa", tiling=vidattn.VideoTiling((4, 4, 4)), topk=0)
    for chunks in (0, (), (2, 0), (1.5,)):
        with pytest.raises(ValueError, match="head_chunks must be an int >= 1"):
            vidattn.DistributedAttention(head_chunks=chunks)
    with pytest.raises(ValueError, match="seq_len must be in"):
        layer(x, x, x, seq_len=7)
    with pytest.raises(ValueError, match="q must be a 4-D"):
        layer(x[0], x, x)
    with pytest.raises(ValueError, match="share B and S_local"):
        layer(x, x[:, :5], x[:, :5])
    with pytest.raises(ValueError, match="pass both cos and sin"):
        layer(x, x, x, cos=torch.randn(6, 4))
    with pytest.raises(ValueError, match="replicated_q, replicated_k and replicated_v"):
        layer(x, x, x, replicated_q=x)
    with pytest.raises(ValueError, match="replicated_k must be"):
        layer(x, x, x, replicated_q=x, replicated_k=torch.randn(1, 6, 3, 8), replicated_v=x)
    with pytest.raises(ValueError, match="gate is for backend='vsa'"):
        layer(x, x, x, gate=x)
    with pytest.raises(ValueError, match="process group was given"):
        vidattn.DistributedAttention(group=object())(x, x, x)
