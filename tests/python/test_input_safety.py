"""Input safety of every op (issue 48): all tensor arguments on one device (meta only with
meta), varlen offsets validated (on the host on the CPU, on the device on CUDA, with
block-sparse's opt-out and graph-capture rule), and the smaller checks (integer tile sizes,
gather_tokens' rank, the VSA gate's shape, CPU sizes past what the backend can hold or index).

The CPU tests run in CI; the CUDA ones skip themselves without a GPU."""
from __future__ import annotations

import re

import pytest
import torch

import vidattn

ops = torch.ops.vidattn
HAS_CUDA = torch.cuda.is_available()
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA device")
i32 = torch.int32


def _randn(*shape, seed=0, dtype=torch.float32):
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _idx(*values):
    return torch.tensor(values, dtype=i32)


# ---- the catalogue: one valid CPU call of every op ---------------------------------------

# Ops with no tensor argument (nothing to mix) and the test-only queries of VIDATTN_TESTING
# builds.
NO_TENSOR_ARGUMENTS = {"vsa_tiling_metadata", "_sm90_forward_launches",
                       "_sm90_backward_launches"}


def _dense():
    q, k, v = _randn(1, 4, 2, 8, seed=1), _randn(1, 5, 2, 8, seed=2), _randn(1, 5, 2, 8, seed=3)
    kpm = torch.tensor([[True, True, False, True, True]])
    qpm = torch.tensor([[True, True, True, False]])
    return q, k, v, kpm, qpm


def _sparse():
    """Two 64-slot query and key tiles, the second key tile partial; every query tile selects
    both key tiles."""
    q, k, v = (_randn(1, 128, 2, 8, seed=s) for s in (4, 5, 6))
    index = torch.tensor([[0, 1], [0, 1]], dtype=i32).expand(1, 2, 2, 2).contiguous()
    count = torch.full((1, 2, 2), 2, dtype=i32)
    q_sizes, kv_sizes = _idx(64, 64), _idx(64, 40)
    return q, k, v, index, count, q_sizes, kv_sizes


def _catalogue():
    """op name -> (args, kwargs): a valid CPU call."""
    cases = {}
    q, k, v, kpm, qpm = _dense()
    cases["attention"] = ((q, k, v), dict(key_padding_mask=kpm, query_padding_mask=qpm))
    out, lse = ops.attention(q, k, v, key_padding_mask=kpm, query_padding_mask=qpm)
    cases["attention_backward"] = (
        (torch.ones_like(out), q, k, v, out, lse),
        dict(scale=None, causal=False, key_padding_mask=kpm, query_padding_mask=qpm,
             cu_seqlens_q=None, cu_seqlens_k=None, max_seqlen_q=0, max_seqlen_k=0))
    qv, kv = _randn(7, 2, 8, seed=7), _randn(6, 2, 8, seed=8)
    cases["attention_varlen"] = ((qv, kv, kv, _idx(0, 3, 7), _idx(0, 4, 6), 4, 4), {})

    cases["apply_rope"] = ((_randn(2, 5, 3, 8, seed=9), _randn(5, 4, seed=10),
                            _randn(5, 4, seed=11)), {})

    t = vidattn.VideoTiling((5, 4, 4), (4, 4, 4))  # 80 tokens in 2 tiles (128 slots)
    raster = _randn(1, t.num_tokens, 2, 8, seed=12)
    tiled = t.tile(raster)
    cases["gather_tokens"] = ((raster, t.slot_to_token, t.token_to_slot), {})
    cases["tile_mean_pool"] = ((tiled, t.block_sizes, 64), {})
    pooled = ops.tile_mean_pool(tiled, t.block_sizes, 64)
    cases["tile_mean_pool_backward"] = ((torch.ones_like(pooled), t.block_sizes, 64), {})
    cases["topk_tiles"] = ((pooled, pooled, 1), dict(cu_tiles_q=_idx(0, 2),
                                                      cu_tiles_k=_idx(0, 2)))
    cases["topk_tiles_from_scores"] = ((_randn(1, 2, 2, 3, seed=13), 2), {})

    q, k, v, index, count, q_sizes, kv_sizes = _sparse()
    sizes = dict(q_block_sizes=q_sizes, kv_block_sizes=kv_sizes)
    cases["block_sparse_attention"] = ((q, k, v, index, count), dict(sizes))
    out, lse = ops.block_sparse_attention(q, k, v, index, count, **sizes)
    coarse = _randn(1, 2, 2, 8, seed=14)
    gate = _randn(1, 128, 2, 8, seed=15)
    cases["vsa_fine_combined"] = ((q, k, v, index, count, coarse, gate, q_sizes),
                                  dict(kv_block_sizes=kv_sizes))
    cases["block_sparse_transpose_index"] = ((index, count, 2), {})
    k2q_offsets, k2q_index = ops.block_sparse_transpose_index(index, count, 2)
    cases["block_sparse_attention_backward"] = (
        (torch.ones_like(out), q, k, v, out, lse, index, count, k2q_offsets, k2q_index),
        dict(tile_volume=64, scale=None, deterministic=True, **sizes))

    cases["vsa_combine"] = ((out, coarse, gate, q_sizes, 64), {})
    cases["vsa_combine_backward"] = ((torch.ones_like(out), coarse, gate, q_sizes, 64), {})
    rows = _randn(1, 30, 2, 8, seed=16)
    row_gate = _randn(1, 30, 2, 8, seed=17)
    row_args = (t.token_to_slot, t.slot_to_token, 64, 10)
    cases["vsa_combine_rows"] = ((rows, coarse, row_gate, *row_args), {})
    cases["vsa_combine_rows_backward"] = ((torch.ones_like(rows), coarse, row_gate, *row_args),
                                          {})
    cases["vsa_combine_rows_into"] = ((torch.empty_like(rows), rows, coarse, row_gate,
                                       *row_args), {})
    return cases


CATALOGUE = _catalogue()


def _tensor_arguments(name):
    """(schema name, position or keyword) of every tensor argument of the op's call."""
    args, kwargs = CATALOGUE[name]
    schema = getattr(ops, name).default._schema
    found = []
    for i, value in enumerate(args):
        if isinstance(value, torch.Tensor):
            found.append((schema.arguments[i].name, i))
    for key, value in kwargs.items():
        if isinstance(value, torch.Tensor):
            found.append((key, key))
    return found


def _moved(name, to, which=None, rest=None):
    """The catalogue's call of `name` with argument `which` on device `to` and the others on
    `rest` (None: where they are)."""
    args, kwargs = CATALOGUE[name]

    def place(value, key):
        if not isinstance(value, torch.Tensor):
            return value
        if key == which:
            return value.to(to)
        return value.to(rest) if rest is not None else value

    return (tuple(place(a, i) for i, a in enumerate(args)),
            {k: place(v, k) for k, v in kwargs.items()})


def _call(name, args, kwargs):
    return getattr(ops, name)(*args, **kwargs)


def _flat(result):
    if result is None:
        return []
    return list(result) if isinstance(result, (tuple, list)) else [result]


def test_the_catalogue_covers_every_op():
    """A new op without a device test fails here."""
    registered = {n.split("::", 1)[1] for n in torch._C._dispatch_get_all_op_names()
                  if n.startswith("vidattn::")}
    assert registered - NO_TENSOR_ARGUMENTS == set(CATALOGUE)


@pytest.mark.parametrize("name", sorted(CATALOGUE))
def test_all_meta_runs_the_meta_kernel_with_the_cpu_shapes(name):
    cpu = _flat(_call(name, *CATALOGUE[name]))
    meta = _flat(_call(name, *_moved(name, "meta", rest="meta")))
    assert len(cpu) == len(meta)
    for c, m in zip(cpu, meta):
        assert m.device.type == "meta" and m.shape == c.shape and m.dtype == c.dtype


MIXED = [(name, arg, key) for name in sorted(CATALOGUE) for arg, key in _tensor_arguments(name)
         if len(_tensor_arguments(name)) > 1]


MESSAGE = re.compile(r"^vidattn\.(\w+): argument '(\w+)' must be on (\S+) like '(\w+)', got (\S+) "
                     r"\(all tensor arguments of an op must be on one device; meta tensors only "
                     r"together with meta tensors\)")


def _expect_device_error(name, arg, arg_device, other_device, call):
    """The call raises the device error of op `name` naming `arg` on `arg_device` against
    another argument on `other_device` (`arg` is either the one found on the wrong device or,
    when it comes first in the op's check, the one the others are compared with)."""
    with pytest.raises(ValueError) as e:
        call()
    m = MESSAGE.match(str(e.value))
    assert m, str(e.value)
    op, bad, expected, first, got = m.groups()
    assert op == name
    if bad == arg:
        assert (got, expected) == (arg_device, other_device)
    else:
        assert first == arg and (expected, got) == (arg_device, other_device), str(e.value)


@pytest.mark.parametrize("name,arg,key", MIXED, ids=[f"{n}-{a}" for n, a, _ in MIXED])
def test_one_meta_argument_among_cpu_ones_raises(name, arg, key):
    """What returned uninitialised CPU memory: the dispatcher sends a call with any meta
    argument to the Meta kernel."""
    _expect_device_error(name, arg, "meta", "cpu",
                         lambda: _call(name, *_moved(name, "meta", which=key)))


@pytest.mark.parametrize("name,arg,key", MIXED, ids=[f"{n}-{a}" for n, a, _ in MIXED])
def test_one_cpu_argument_among_meta_ones_raises(name, arg, key):
    _expect_device_error(name, arg, "cpu", "meta",
                         lambda: _call(name, *_moved(name, "cpu", which=key, rest="meta")))


def test_the_error_names_the_argument_and_both_devices():
    x = torch.randn(2, 5, 3, 8)
    cos = torch.randn(5, 4, device="meta")
    with pytest.raises(ValueError) as e:
        vidattn.apply_rope(x, cos, cos)
    assert re.search(r"argument 'cos' must be on cpu like 'x', got meta", str(e.value))


def test_the_issue_examples_raise():
    q, k, v, kpm, _ = _dense()
    meta = lambda t: t.to("meta")  # noqa: E731
    with pytest.raises(ValueError, match="'cos'"):
        vidattn.apply_rope(torch.randn(2, 5, 3, 8), torch.randn(5, 4, device="meta"),
                           torch.randn(5, 4, device="meta"))
    with pytest.raises(ValueError, match="'k'"):
        vidattn.attention(q, meta(k), v)
    with pytest.raises(ValueError, match="'v'"):
        vidattn.attention(q, k, meta(v))
    with pytest.raises(ValueError, match="'key_padding_mask'"):
        vidattn.attention(q, k, v, key_padding_mask=meta(kpm))
    qv = torch.randn(7, 2, 8)
    with pytest.raises(ValueError, match="'cu_seqlens_q'"):
        vidattn.attention_varlen(qv, qv, qv, meta(_idx(0, 3, 7)), _idx(0, 3, 7), 4, 4)
    q, k, v, index, count, *_ = _sparse()
    with pytest.raises(ValueError, match="'q2k_index'"):
        vidattn.block_sparse_attention(q, k, v, meta(index), count)


def test_meta_inputs_through_autograd_and_the_python_layer():
    """The functions users call (autograd kernels in front of the ops) keep both rules."""
    q, k, v, *_ = _dense()
    qm, km, vm = (t.to("meta").requires_grad_() for t in (q, k, v))
    out = vidattn.attention(qm, km, vm)
    assert out.device.type == "meta" and out.shape == q.shape
    with pytest.raises(ValueError, match="'v'"):
        vidattn.attention(q.requires_grad_(), k, vm)
    t = vidattn.VideoTiling((5, 4, 4), (4, 4, 4))
    with pytest.raises(ValueError, match="'index'"):
        t.tile(torch.randn(1, t.num_tokens, 2, 8, device="meta"))


def test_torch_compile_still_traces_through_the_meta_kernels():
    """Fake tensors reach the Meta kernels as meta tensors: one device, so the check passes."""
    q, k, v, kpm, _ = _dense()
    f = torch.compile(lambda a, b, c, m: vidattn.attention(a, b, c, key_padding_mask=m),
                      backend="eager", fullgraph=True)
    torch.testing.assert_close(f(q, k, v, kpm), vidattn.attention(q, k, v, key_padding_mask=kpm))


@needs_cuda
@pytest.mark.parametrize("name,arg,key", MIXED, ids=[f"{n}-{a}" for n, a, _ in MIXED])
def test_cuda_one_cpu_argument_among_cuda_ones_raises(name, arg, key):
    """The dispatcher sends a call with any CUDA argument to the CUDA kernel; the check comes
    before any dtype or head-dim check, so the catalogue's float32 CPU call serves."""
    _expect_device_error(name, arg, "cpu", "cuda:0",
                         lambda: _call(name, *_moved(name, "cpu", which=key, rest="cuda:0")))


@needs_cuda
@pytest.mark.parametrize("name,arg,key", MIXED, ids=[f"{n}-{a}" for n, a, _ in MIXED])
def test_cuda_one_meta_argument_among_cuda_ones_raises(name, arg, key):
    _expect_device_error(name, arg, "meta", "cuda:0",
                         lambda: _call(name, *_moved(name, "meta", which=key, rest="cuda:0")))


@pytest.mark.skipif(not HAS_CUDA or torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cuda_two_gpus_are_two_devices():
    q, k, v, *_ = _dense()
    with pytest.raises(ValueError, match="'k' must be on cuda:0 like 'q', got cuda:1"):
        ops.attention(q.cuda(0), k.cuda(1), v.cuda(0))


# ---- varlen offsets ------------------------------------------------------------------------

def _varlen_inputs(device="cpu", dtype=torch.float32, D=8):
    g = torch.Generator().manual_seed(20)
    q = torch.randn(7, 2, D, generator=g).to(dtype).to(device)
    k = torch.randn(6, 2, D, generator=g).to(dtype).to(device)
    v = torch.randn(6, 2, D, generator=g).to(dtype).to(device)
    return q, k, v


# (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, the faulty argument, message);
# q has 7 rows, k 6. The good offsets are (0, 3, 7) and (0, 4, 6) with maxima 4 and 4.
BAD_OFFSETS = [
    ((1, 3, 7), (0, 4, 6), 4, 4, "cu_seqlens_q", "must start at 0"),
    ((0, 3, 7), (2, 4, 6), 4, 4, "cu_seqlens_k", "must start at 0"),
    ((0, 5, 3, 7), (0, 4, 5, 6), 5, 4, "cu_seqlens_q", "must be non-decreasing"),
    ((0, 3, 7), (0, 5, 4), 4, 10, "cu_seqlens_k", "must be non-decreasing"),
    ((0, 3, 9), (0, 4, 6), 6, 4, "cu_seqlens_q", "must end at the number of rows \\(7\\)"),
    ((0, 3, 7), (0, 4, 8), 4, 4, "cu_seqlens_k", "must end at the number of rows \\(6\\)"),
    ((0, 3, 6), (0, 4, 6), 4, 4, "cu_seqlens_q", "must end at the number of rows \\(7\\)"),
    ((0, 3, 7), (0, 4, 6), 3, 4, "cu_seqlens_q", "has length 4, more than the max_seqlen"),
    ((0, 3, 7), (0, 4, 6), 4, 3, "cu_seqlens_k", "has length 4, more than the max_seqlen"),
    ((0, -2, 7), (0, 4, 6), 9, 4, "cu_seqlens_q", "must be non-decreasing"),
]
BAD_IDS = [f"{arg}-{msg.split()[1]}-{i}" for i, (*_, arg, msg) in enumerate(BAD_OFFSETS)]


@pytest.mark.parametrize("cq,ck,mq,mk,arg,message", BAD_OFFSETS, ids=BAD_IDS)
def test_cpu_bad_offsets_raise_naming_the_argument(cq, ck, mq, mk, arg, message):
    q, k, v = _varlen_inputs()
    for validate in (True, False):  # the CPU checks on the host whatever it is told
        with pytest.raises(ValueError, match=f"'{arg}' .*{message}|{message}.*'{arg}'|"
                                             f"of '{arg}' {message}"):
            vidattn.attention_varlen(q, k, v, _idx(*cq), _idx(*ck), mq, mk,
                                     validate_index=validate)


def test_cpu_good_offsets_pass_and_the_argument_is_in_the_schema():
    q, k, v = _varlen_inputs()
    a = vidattn.attention_varlen(q, k, v, _idx(0, 3, 7), _idx(0, 4, 6), 4, 4)
    b = ops.attention_varlen(q, k, v, _idx(0, 3, 7), _idx(0, 4, 6), 4, 4,
                             validate_index=False)[0]
    assert torch.equal(a, b)
    assert "bool validate_index=True" in str(ops.attention_varlen.default._schema)


@needs_cuda
@pytest.mark.parametrize("cq,ck,mq,mk,arg,message", BAD_OFFSETS, ids=BAD_IDS)
def test_cuda_bad_offsets_raise_the_cpu_error(cq, ck, mq, mk, arg, message):
    """Checked on the device by default: the same ValueError as the CPU (the faulty offsets
    are described from a host copy), and the stream stays usable afterwards."""
    q, k, v = _varlen_inputs("cuda", torch.bfloat16, 64)
    with pytest.raises(ValueError) as cpu_error:
        vidattn.attention_varlen(q.float().cpu(), k.float().cpu(), v.float().cpu(), _idx(*cq),
                                 _idx(*ck), mq, mk)
    with pytest.raises(ValueError) as cuda_error:
        vidattn.attention_varlen(q, k, v, _idx(*cq).cuda(), _idx(*ck).cuda(), mq, mk)
    assert str(cuda_error.value).splitlines()[0] == str(cpu_error.value).splitlines()[0]
    assert re.search(f"'{arg}'", str(cuda_error.value)) and re.search(message,
                                                                      str(cuda_error.value))
    good = vidattn.attention_varlen(q, k, v, _idx(0, 3, 7).cuda(), _idx(0, 4, 6).cuda(), 4, 4)
    torch.cuda.synchronize()
    assert torch.isfinite(good).all()


@needs_cuda
def test_cuda_strided_offsets_are_checked_too():
    q, k, v = _varlen_inputs("cuda", torch.bfloat16, 64)
    bad_q = torch.tensor([0, 99, 3, 99, 8], dtype=i32, device="cuda")[::2]  # (0, 3, 8)
    good_k = torch.tensor([0, 99, 4, 99, 6], dtype=i32, device="cuda")[::2]
    with pytest.raises(ValueError, match="'cu_seqlens_q' must end at the number of rows \\(7\\), "
                                         "got 8"):
        vidattn.attention_varlen(q, k, v, bad_q, good_k, 5, 4)


@needs_cuda
def test_cuda_validate_index_false_skips_the_check_and_stays_in_bounds():
    """validate_index=False: no check and no host wait; a valid call gives the same bits; bad
    offsets are clamped by the kernels (no fault, finite output) instead of raising."""
    q, k, v = _varlen_inputs("cuda", torch.bfloat16, 64)
    cq, ck = _idx(0, 3, 7).cuda(), _idx(0, 4, 6).cuda()
    checked = vidattn.attention_varlen(q, k, v, cq, ck, 4, 4, return_lse=True)
    trusted = vidattn.attention_varlen(q, k, v, cq, ck, 4, 4, return_lse=True,
                                       validate_index=False)
    assert all(torch.equal(a, b) for a, b in zip(checked, trusted))
    out = vidattn.attention_varlen(q, k, v, _idx(0, 3, 7000).cuda(), ck, 4, 4,
                                   validate_index=False)
    torch.cuda.synchronize()
    assert out.shape == q.shape


@needs_cuda
def test_cuda_graph_capture_skips_the_check():
    """Inside CUDA-graph capture the check (a host synchronisation, illegal there) is skipped:
    capture succeeds, even with bad offsets, and replay gives the eager result."""
    q, k, v = _varlen_inputs("cuda", torch.bfloat16, 64)
    cq, ck = _idx(0, 3, 7).cuda(), _idx(0, 4, 6).cuda()
    eager = vidattn.attention_varlen(q, k, v, cq, ck, 4, 4)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up off the default stream, as capture wants
        vidattn.attention_varlen(q, k, v, cq, ck, 4, 4)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = vidattn.attention_varlen(q, k, v, cq, ck, 4, 4)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured, eager)
    bad = _idx(0, 3, 9).cuda()  # before the capture: a pageable copy cannot be captured
    bad_graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(bad_graph):  # not checked, so no error (and no fault: clamped)
        vidattn.attention_varlen(q, k, v, bad, ck, 6, 4)
    bad_graph.replay()
    torch.cuda.synchronize()


# ---- smaller items ---------------------------------------------------------------------------

@pytest.mark.parametrize("grid,tile", [((4.7, 4, 4), (4, 4, 4)), ((4, 4, 4), (4.0, 4, 4)),
                                       ((4, 4, "4"), (4, 4, 4)), ((4, 4), (4, 4, 4)),
                                       ((True, 4, 4), (4, 4, 4)),
                                       ((torch.tensor(4.5), 4, 4), (4, 4, 4))])
def test_tiling_refuses_non_integer_sizes(grid, tile):
    with pytest.raises(ValueError, match="must be three integers"):
        vidattn.VideoTiling(grid, tile)


def test_tiling_takes_integers_of_any_kind():
    numpy = pytest.importorskip("numpy")
    a = vidattn.VideoTiling((5, 7, 9), (4, 4, 4))
    b = vidattn.VideoTiling((numpy.int64(5), torch.tensor(7), 9), [4, 4, 4])
    assert (a.grids, a.tile_shape, a.num_tiles) == (b.grids, b.tile_shape, b.num_tiles)
    assert all(type(x) is int for x in b.grids[0] + b.tile_shape)


def test_gather_tokens_on_a_3d_tensor_names_its_rank():
    t = vidattn.VideoTiling((5, 4, 4), (4, 4, 4))
    x = torch.randn(t.num_tokens, 2, 8)
    for call in (lambda a: ops.gather_tokens(a, t.slot_to_token, t.token_to_slot),
                 lambda a: ops.gather_tokens(a.to("meta"), t.slot_to_token.to("meta"),
                                             t.token_to_slot.to("meta"))):
        with pytest.raises(ValueError, match=r"argument 'x' must be 4-D \[B, S, H, D\], got a "
                                             r"3-D tensor"):
            call(x)
    with pytest.raises(ValueError, match=r"one entry per token of x \(79, x's dimension 1"):
        ops.gather_tokens(torch.randn(1, 79, 2, 8), t.slot_to_token, t.token_to_slot)


def test_vsa_gate_has_the_output_shape_when_dv_differs():
    """A gate of the output's shape [B, Sq, Hq, Dv] passes (and is applied); one of q's shape
    is refused with a message giving the output's shape."""
    t = vidattn.VideoTiling((4, 4, 8), (4, 4, 4))  # two full tiles
    g = torch.Generator().manual_seed(30)
    q = t.tile(torch.randn(1, t.num_tokens, 2, 16, generator=g))
    k = t.tile(torch.randn(1, t.num_tokens, 2, 16, generator=g))
    v = t.tile(torch.randn(1, t.num_tokens, 2, 8, generator=g))
    gate = torch.rand(1, t.padded_len, 2, 8, generator=g)
    plain, sel = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=1, return_selection=True)
    gated = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=1, gate=gate)
    assert gated.shape == plain.shape == (1, t.padded_len, 2, 8)
    o_s = vidattn.block_sparse_attention(q, k, v, *sel)
    torch.testing.assert_close(gated, o_s + gate * (plain - o_s), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match=r"gate must have the output's shape \(1, 128, 2, 8\)"):
        vidattn.video_sparse_attention(q, k, v, tiling=t, topk=1, gate=torch.rand(q.shape))
    assert "output's shape" in vidattn.video_sparse_attention.__doc__


def test_cpu_working_copy_too_large_raises_a_named_out_of_memory_error():
    """k of 2^30 keys x 16 heads x 65536 dims (stride 0 but for D, so nothing large exists):
    the CPU backend's float32 copy of k would take 4 PiB, more than any address space; the
    error names the entry point and the tensor instead of a bare std::bad_alloc."""
    q = torch.randn(1, 1, 16, 1 << 16)
    k = torch.randn(1, 1, 16, 1 << 16).expand(1, 1 << 30, 16, 1 << 16)
    v = torch.randn(1, 1, 16, 1).expand(1, 1 << 30, 16, 1)
    with pytest.raises(torch.OutOfMemoryError,
                       match=r"vidattn::attention_forward: the CPU backend cannot allocate its "
                             r"working copy of 'k' \(1125899906842624 elements"):
        vidattn.attention(q, k, v)


def test_cpu_sequences_past_int32_raise_instead_of_wrapping():
    k = torch.zeros(1, 1, 1, 8).expand(1, 1 << 31, 1, 8)
    v = torch.zeros(1, 1, 1, 1).expand(1, 1 << 31, 1, 1)
    with pytest.raises(ValueError, match=r"at most 2\^31 - 1 keys per sequence, got 2147483648"):
        vidattn.attention(torch.randn(1, 1, 1, 8), k, v)


def test_cpu_topk_over_too_many_key_tiles_raises_a_named_out_of_memory_error():
    """k_pooled of 2^31 - 1 tiles x 65536 dims (stride 0 but for D): its float32 copy would
    take 512 TiB. The selection's buffers are all allocated before its parallel region (an
    exception inside one would end the process)."""
    qp = torch.randn(1, 1, 1, 1 << 16)
    kp = torch.randn(1, 1, 1, 1 << 16).expand(1, (1 << 31) - 1, 1, 1 << 16)
    with pytest.raises(torch.OutOfMemoryError,
                       match="vidattn::select_topk_tiles: .* working copy of 'k_pooled'"):
        vidattn.select_topk_tiles(qp, kp, 1)
    with pytest.raises(ValueError, match=r"at most 2\^31 - 1 key tiles, got 2147483648"):
        vidattn.select_topk_tiles(qp, torch.randn(1, 1, 1, 1 << 16).expand(1, 1 << 31, 1, 1 << 16), 1)
