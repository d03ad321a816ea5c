"""The bench's block-sparse case and sparse peers on the CPU: presets and shape specs, FLOP
counting, the shared selection, the float64 block-sparse reference, the selection ->
FlexAttention BlockMask conversion, 'unavailable' rows, ratios to every peer.
No timing assertions."""
from __future__ import annotations

import json
import math

import pytest
import torch

import vidattn
from vidattn.bench import peers, report, shapes
from vidattn.bench.blocksparse_case import (BlockSparseCase, FastVideoBlockSparse,
                                            FlexBlockSparse, VidattnBlockSparse,
                                            block_sparse_reference, blocksparse_case,
                                            random_selection, topk_of)
from vidattn.bench.base import Impl, to_layout
from vidattn.bench.cases import cases_for
from vidattn.bench.plot import write_plot
from vidattn.bench.runner import Plan, direction_flops, run_plan
from vidattn.bench.timing import CpuTimer

CPU = torch.device("cpu")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _naive_masked64(q, k, v, token_mask):
    """Plain float64 softmax attention of [B, S, H, D] with a bool [B, H, Sq, Sk] mask; rows
    with no visible key give 0."""
    q, k, v = (t.double().transpose(1, 2) for t in (q, k, v))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
    s = s.masked_fill(~token_mask, float("-inf"))
    p = torch.softmax(s, dim=-1).nan_to_num(0.0)
    return (p @ v).transpose(1, 2)


def _token_mask(index, count, tile, kv_tiles, key_valid=None):
    tiles = peers.selection_to_dense_mask(index, count, kv_tiles)
    mask = tiles.repeat_interleave(tile, dim=2).repeat_interleave(tile, dim=3)
    return mask if key_valid is None else mask & key_valid[None, None, None, :]


# ---- shapes and presets ---------------------------------------------------------------------

def test_block_sparse_specs_and_presets():
    s = shapes.parse_shape("b1h12s39936d128sp0.875")
    assert s.kind == "blocksparse" and s.sparsity == 0.875 and s.q_len == s.kv_len == 39936
    assert s.label == "B1 H12 S39936 D128 s0.875"
    assert s.to_json()["tile_volume"] == 64
    assert shapes.parse_shape("b1h12s39936d128").kind == "dense"
    for bad in ("b1h2s100d64sp0.5",      # not a multiple of 64
                "b1h2s128d64sp1.5",      # sparsity out of range
                "b1h2s128k64d64sp0.5",   # two lengths
                "b1h2s128d64csp0.5"):    # causal
        with pytest.raises(ValueError, match="--shapes"):
            shapes.parse_shape(bad)

    sparse = shapes.resolve(["gpu-sparse"])
    got = {(x.heads, x.q_len, x.sparsity) for x in sparse.shapes}
    assert got == {(12, 39936, 0.875), (12, 39936, 0.9), (40, 92160, 0.875), (40, 92160, 0.9),
                   (12, 32768, 0.875)}
    assert sparse.directions == ("fwd", "bwd") and sparse.dtypes == ("bf16",)
    assert all(x.kind == "blocksparse" and x.head_dim == 128 for x in sparse.shapes)

    suite = shapes.resolve(["gpu-suite"]).shapes
    kinds = [x.kind for x in suite]
    assert kinds.count("dense") == 9 and kinds.count("blocksparse") == 6 and kinds.count("vsa") == 3
    # Issue #5's dense targets: D = 128 at the video shapes and 32K, D = 64 at targets.md's
    # shape and a short one (2048 keys); then Wan's cross attention to 512 text / 257 image
    # tokens.
    assert {(x.batch, x.heads, x.q_len, x.kv_len, x.head_dim) for x in suite
            if x.kind == "dense"} == {
        (1, 12, 39936, 39936, 128), (1, 40, 92160, 92160, 128), (1, 24, 115200, 115200, 128),
        (1, 12, 32768, 32768, 128), (2, 32, 16384, 16384, 64), (4, 16, 2048, 2048, 64),
        (1, 12, 32760, 512, 128),
        (1, 40, 75600, 512, 128), (1, 40, 75600, 257, 128)}
    # vsa.md section 6: the Wan grids tile to 39,936 and 92,160 slots; HunyuanVideo's 30 x 48
    # x 80 (115,200 tokens) has T = 30, not a multiple of 4: 8 x 12 x 20 tiles = 122,880 slots.
    assert {(x.heads, x.q_len) for x in suite if x.kind == "vsa"} == {
        (12, 39936), (40, 92160), (24, 122880)}
    assert {x.sparsity for x in suite if x.kind == "vsa"} == {0.9}


def test_each_case_takes_only_its_kind_of_shape():
    dense, sparse, video = (shapes.dense(1, 2, 128, 32), shapes.block_sparse(1, 2, 128, 32, 0.5),
                            shapes.vsa(1, 2, (4, 4, 8), 32, 0.5))
    by_name = {c.name: c for c in cases_for(CPU)}
    assert [n for n, c in by_name.items() if c.accepts(dense)] == ["dense"]
    assert [n for n, c in by_name.items() if c.accepts(sparse)] == ["blocksparse"]
    assert [n for n, c in by_name.items() if c.accepts(video)] == ["vsa"]


# ---- FLOPs ------------------------------------------------------------------------------------

def test_block_sparse_flops_count_the_selected_keys():
    case = blocksparse_case(CPU)
    for sparsity, topk in ((0.875, 78), (0.9, 63)):  # 624 tiles: ceil(0.125 * 624), ceil(62.4)
        shape = shapes.block_sparse(1, 12, 39936, 128, sparsity)
        assert topk_of(shape) == topk == vidattn.topk_from_sparsity(sparsity, 624)
        fwd = 4 * 1 * 12 * 39936 * (topk * 64) * 128
        assert direction_flops(case, shape, "fwd") == fwd
        assert direction_flops(case, shape, "bwd") == 2.5 * fwd
    wan14 = shapes.block_sparse(2, 40, 92160, 128, 0.9)  # 1440 tiles -> 144 kept
    assert direction_flops(case, wan14, "fwd") == 4 * 2 * 40 * 92160 * 144 * 64 * 128


# ---- selection, reference, BlockMask --------------------------------------------------------

def test_random_selection_is_valid_and_seeded():
    a = random_selection(2, 3, 7, 9, 4, _gen(5), CPU)
    b = random_selection(2, 3, 7, 9, 4, _gen(5), CPU)
    c = random_selection(2, 3, 7, 9, 4, _gen(6), CPU)
    index, count = a
    assert index.dtype == count.dtype == torch.int32
    assert index.shape == (2, 3, 7, 4) and (count == 4).all()
    assert (index[..., 1:] > index[..., :-1]).all()  # strictly ascending: distinct
    assert index.min() >= 0 and index.max() < 9
    assert torch.equal(a[0], b[0]) and not torch.equal(a[0], c[0])


def _ragged_selection(b, h, q_tiles, kv_tiles, gen):
    """A selection with different counts per row, zero included, and -1 in unused slots."""
    index, _ = random_selection(b, h, q_tiles, kv_tiles, kv_tiles - 1, gen, CPU)
    count = torch.randint(0, kv_tiles, (b, h, q_tiles), generator=gen, dtype=torch.int32)
    count[0, 0, 0] = 0
    slots = torch.arange(index.shape[-1])
    index = torch.where(slots < count[..., None], index, -1).to(torch.int32)
    return index, count


@pytest.mark.parametrize("seed", [0, 1])
def test_block_sparse_reference_matches_masked_dense(seed):
    gen = _gen(100 + seed)
    b, h, tile, q_tiles, kv_tiles, d = 2, 3, 4, 5, 6, 8
    q = torch.randn(b, q_tiles * tile, h, d, generator=gen, dtype=torch.float64) * 4
    k = torch.randn(b, kv_tiles * tile, h, d, generator=gen, dtype=torch.float64) * 4
    v = torch.randn(b, kv_tiles * tile, h, d, generator=gen, dtype=torch.float64)
    index, count = _ragged_selection(b, h, q_tiles, kv_tiles, gen)
    key_valid = torch.rand(kv_tiles * tile, generator=gen) > 0.3
    mask = _token_mask(index, count, tile, kv_tiles, key_valid)

    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = block_sparse_reference(*leaves, index, count, tile, key_valid=key_valid)
    want = _naive_masked64(*[t.clone().requires_grad_() for t in (q, k, v)], mask)
    torch.testing.assert_close(out, want, rtol=1e-12, atol=1e-12)
    assert (out[0, :tile, 0] == 0).all()  # the count-0 query tile (batch 0, head 0)

    # The backward reference is autograd through the same (checkpointed) chunks.
    grad_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    leaves_naive = [t.clone().requires_grad_() for t in (q, k, v)]
    got = torch.autograd.grad(out, leaves, grad_out)
    expected = torch.autograd.grad(_naive_masked64(*leaves_naive, mask), leaves_naive, grad_out)
    for g, e in zip(got, expected):
        assert torch.isfinite(g).all()
        torch.testing.assert_close(g, e, rtol=1e-10, atol=1e-10)


def test_block_sparse_reference_chunks_agree(monkeypatch):
    from vidattn.bench import blocksparse_case as bc

    gen = _gen(9)
    q, k, v = (torch.randn(1, 7 * 4, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    index, count = random_selection(1, 2, 7, 7, 3, gen, CPU)
    whole = block_sparse_reference(q, k, v, index, count, 4)
    monkeypatch.setitem(bc._REF_CHUNK_ELEMS, "cpu", 2 * 4 * 3 * 4 * 2)  # 2 query tiles a chunk
    torch.testing.assert_close(block_sparse_reference(q, k, v, index, count, 4), whole,
                               rtol=0, atol=0)


def test_selection_to_block_mask_equals_dense_expansion():
    gen = _gen(21)
    tile, q_tiles, kv_tiles = 16, 5, 7
    index, count = _ragged_selection(2, 3, q_tiles, kv_tiles, gen)
    mask = peers.selection_to_block_mask(index, count, q_tiles * tile, kv_tiles * tile, tile)
    assert mask.BLOCK_SIZE == (tile, tile)
    expected = peers.selection_to_dense_mask(index, count, kv_tiles)
    assert torch.equal(mask.to_dense().bool(), expected)
    # Every selected block is full: no partial block (no mask function inside the kernel).
    assert (mask.kv_num_blocks == 0).all()
    assert torch.equal(mask.full_kv_num_blocks, count)
    # Token level: the mask function is the same selection.
    b, h, qi, ki = (torch.arange(n) for n in (2, 3, q_tiles * tile, kv_tiles * tile))
    tokens = mask.mask_mod(b[:, None, None, None], h[None, :, None, None],
                           qi[None, None, :, None], ki[None, None, None, :])
    assert torch.equal(tokens, _token_mask(index, count, tile, kv_tiles))


def test_flex_peer_computes_the_selection_on_cpu():
    """Eager FlexAttention (CPU) with the converted mask equals the float64 reference: the
    check that would catch a peer attending to other keys (eager flex ignores block
    structure, so the mask function must carry the selection)."""
    shape = shapes.block_sparse(1, 2, 4 * 64, 16, 0.5)
    case = BlockSparseCase([FlexBlockSparse("cpu")], ())
    inputs = case.make_inputs(shape, torch.float32, CPU, _gen(4))
    flex_inputs = inputs.in_layout("bhsd")
    with torch.no_grad():
        out = FlexBlockSparse("cpu").forward(flex_inputs)
    scope = __import__("vidattn.bench.reference", fromlist=["RefScope"]).RefScope(1, 2, 1, 2)
    (ref,) = case.reference_forward(inputs, scope)
    assert (out.double() - ref).abs().max() < 1e-5
    dense = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))).transpose(1, 2)
    assert (dense.double() - ref).abs().max() > 1e-2  # the selection really matters here


def test_to_layout_keeps_values_and_makes_bhsd_contiguous():
    x = torch.randn(2, 5, 3, 4, generator=_gen(2))
    y = to_layout(x, "bhsd")
    assert torch.equal(x, y) and y.shape == x.shape
    assert y.transpose(1, 2).is_contiguous() and not y.is_contiguous()
    assert to_layout(x, "bshd") is x
    with pytest.raises(ValueError, match="layout"):
        to_layout(x, "sbhd")


# ---- the runner: unavailable rows, every ratio ------------------------------------------------

class _NotOnThisDevice(Impl):
    name, backend, is_ours = "vidattn", "test", True

    def forward(self, inputs):
        raise NotImplementedError("Could not run 'vidattn::block_sparse_attention' with "
                                  "arguments from the 'CUDA' backend.")


class _NotInstalled(Impl):
    name, backend = "absent-peer", "test"

    def unavailable_reason(self, device):
        return "package not importable"


class _Broken(Impl):
    name, backend = "broken-peer", "test"

    def forward(self, inputs):
        raise AssertionError("q length must be a multiple of 64")  # a peer's own assert


class _WrongAnswer(Impl):
    """A peer that silently attends densely: its error must show it."""

    name, backend, layout = "dense-in-disguise", "test", "bhsd"

    def forward(self, inputs):
        assert inputs.q.transpose(1, 2).is_contiguous()  # got the layout it asked for
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        return torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def test_runner_marks_unavailable_and_broken_rows_and_catches_a_wrong_peer(tmp_path):
    case = BlockSparseCase([_NotOnThisDevice(), VidattnBlockSparse(), _NotInstalled(), _Broken(),
                            _WrongAnswer(), FastVideoBlockSparse()],
                           peer_order=("dense-in-disguise",))
    case.impls[1].name = "vidattn-cpu"
    plan = Plan(shapes=[shapes.block_sparse(1, 2, 5 * 64, 16, 0.6)], dtypes=["fp32"],
                directions=["fwd", "bwd"], cases=[case], device=CPU,
                timer=CpuTimer(warmup=0, repeats=1))
    seen = []
    rows = run_plan(plan, on_rows=seen.extend)
    assert seen == rows
    status = {(r["impl"], r["direction"]): r["status"] for r in rows}
    for d in ("fwd", "bwd"):
        assert status[("vidattn", d)] == "unavailable"
        assert status[("absent-peer", d)] == "unavailable"
        assert status[("fastvideo-triton", d)] == "unavailable"  # CUDA only
        assert status[("broken-peer", d)] == "skipped"
        assert status[("vidattn-cpu", d)] == status[("dense-in-disguise", d)] == "ok"
    by = {(r["impl"], r["direction"]): r for r in rows}
    assert "not implemented on cpu" in by[("vidattn", "fwd")]["note"]
    assert "package not importable" in by[("absent-peer", "bwd")]["note"]
    assert "AssertionError" in by[("broken-peer", "fwd")]["note"]
    assert "median_ms" not in by[("vidattn", "fwd")]
    ours, wrong = by[("vidattn-cpu", "fwd")], by[("dense-in-disguise", "fwd")]
    assert ours["max_abs_err"] < 1e-5
    assert wrong["max_abs_err"] > 1e-2  # caught
    for d in ("fwd", "bwd"):
        r = by[("vidattn-cpu", d)]
        assert r["peer"] == "dense-in-disguise"
        assert set(r["ratios_to_peers"]) == {"dense-in-disguise"}
        assert r["ratios_to_peers"]["dense-in-disguise"] == pytest.approx(r["ratio_to_peer"])
        assert set(r["err_ratios_to_peers"]) == {"dense-in-disguise"}
        assert by[("vidattn", d)]["ratios_to_peers"] == {}
    assert by[("dense-in-disguise", "fwd")]["ratios_to_peers"] == {}  # no other peer ran

    table = report.format_table(rows)
    assert table.count("unavailable") == 6 and table.count("skipped") == 2
    meta = {"device": "cpu-test-1t", "device_description": "test", "threads": 1,
            "torch_version": torch.__version__, "git_commit": None, "timer": "test",
            "peers": {"fastvideo_kernel": {"available": False, "reason": "not installed"}}}
    notes = report.format_notes(rows, meta)
    assert "unavailable: absent-peer: package not importable" in notes
    assert "fastvideo-kernel: not installed" in notes
    assert "vs every peer: dense-in-disguise" in notes
    report.write_json(tmp_path / "r.json", meta, rows)
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == len(rows)
    write_plot(tmp_path / "r.png", rows, "test")
    assert (tmp_path / "r.png").read_bytes()[:4] == b"\x89PNG"


def test_cuda_sparse_peers_are_listed_and_say_why_elsewhere():
    cases = {c.name: c for c in cases_for(torch.device("cuda"))}
    sparse = {i.name: i for i in cases["blocksparse"].impls}
    assert set(sparse) == {"vidattn", "vidattn-nondet", "flex", "fastvideo-triton",
                           "fastvideo-tk"}
    assert not sparse["vidattn-nondet"].deterministic and sparse["vidattn"].deterministic
    assert "sm_90" in sparse["fastvideo-tk"].unavailable_reason(CPU)
    assert "bf16" in sparse["fastvideo-tk"].skip_reason(CPU, torch.float16,
                                                        shapes.block_sparse(1, 1, 64, 64, 0.5))
    assert sparse["flex"].layout == sparse["fastvideo-triton"].layout == "bhsd"
    assert "compile" in sparse["flex"].backend
    assert "CUDA only" in sparse["fastvideo-triton"].unavailable_reason(CPU)
    shape = shapes.block_sparse(1, 1, 64, 8, 0.5)
    assert "bf16" in sparse["fastvideo-triton"].skip_reason(CPU, torch.float32, shape)
    vsa = {i.name for i in cases["vsa"].impls}
    assert {"vidattn-vsa", "vidattn-vsa-nondet", "sdpa-cudnn", "fastvideo-vsa"} <= vsa
    info = peers.fastvideo_info()
    assert set(info) >= {"available"} and (info["available"] or "reason" in info)


def test_vsa_reference_selection_fallback_matches_vidattn():
    """Where vidattn's op cannot run, the VSA reference selects tiles itself (float64 top-k of
    the coarse scores): on the CPU both must agree."""
    from vidattn.bench.vsa_case import VsaCase, _selection, _selection64

    shape = shapes.vsa(1, 3, (5, 7, 9), 16, 0.7)
    inputs = VsaCase([], ()).make_inputs(shape, torch.float64, CPU, _gen(12))
    ours, fallback = _selection(inputs), _selection64(inputs)
    assert torch.equal(ours[1], fallback[1])
    assert torch.equal(ours[0], fallback[0])


def test_cli_tiny_sparse_rows_json_and_png(tmp_path):
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = dict(os.environ)
    package_root = str(Path(vidattn.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    out = tmp_path / "sparse.json"
    proc = subprocess.run([sys.executable, "-W", "ignore", "-m", "vidattn.bench", "--device",
                           "cpu", "--shapes", "tiny-sparse", "--dtype", "bf16", "--repeats", "1",
                           "--threads", "1", "--no-progress", "--out", str(out)],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "blocksparse B1 H3 S320 D32 s0.6 bf16 fwd flex:" in proc.stderr  # rows as they finish
    doc = json.loads(out.read_text())
    assert doc["peers"]["fastvideo_kernel"]["available"] in (True, False)
    status = {(r["impl"], r["direction"]): r["status"] for r in doc["rows"]}
    assert status == {("vidattn", "fwd"): "ok", ("flex", "fwd"): "ok",
                      ("fastvideo-triton", "fwd"): "unavailable", ("vidattn", "bwd"): "ok",
                      ("flex", "bwd"): "unavailable",  # FlexAttention has no CPU backward
                      ("fastvideo-triton", "bwd"): "unavailable",
                      ("fastvideo-tk", "fwd"): "unavailable", ("fastvideo-tk", "bwd"): "unavailable"}
    shape = shapes.PRESETS["tiny-sparse"].shapes[0]
    fwd = 4 * 1 * 3 * 320 * (topk_of(shape) * 64) * 32
    for r in doc["rows"]:
        assert r["flops"] == fwd * (2.5 if r["direction"] == "bwd" else 1)
        if r["status"] == "ok":
            assert r["max_abs_err"] < 3e-2, r
    ours = next(r for r in doc["rows"] if r["impl"] == "vidattn" and r["direction"] == "fwd")
    assert ours["peer"] == "flex" and set(ours["ratios_to_peers"]) == {"flex"}
    assert out.with_suffix(".png").read_bytes()[:4] == b"\x89PNG"


def test_vsa_case_backward_against_its_references():
    """The VSA case's backward rows: each implementation's dq, dk, dv on token slots against
    its own float64 reference (VSA with vidattn's selection, dense over tokens, dense over
    every slot), with a gradient that is 0 on pad slots."""
    from vidattn.bench.dense_case import SdpaDense
    from vidattn.bench.vsa_case import vsa_case

    case = vsa_case(CPU)
    assert "bwd" in case.directions
    shape = shapes.vsa(1, 2, (5, 6, 7), 16, 0.6)
    inputs = case.make_inputs(shape, torch.float32, CPU, _gen(31))
    grad_out = case.make_grad_out(inputs, _gen(32))
    pads = ~inputs.tiling.slot_valid
    assert pads.any() and (grad_out[:, pads] == 0).all() and grad_out.abs().sum() > 0
    plan = Plan(shapes=[shape], dtypes=["fp32"], directions=["bwd"], cases=[case], device=CPU,
                timer=CpuTimer(warmup=0, repeats=1))
    rows = run_plan(plan)
    assert {r["impl"] for r in rows} == {"vidattn-vsa", "vidattn-dense", "sdpa"}
    for r in rows:
        assert r["status"] == "ok" and set(r["errors"]) == {"dq", "dk", "dv"}, r
        assert r["max_abs_err"] < 1e-5, r
        assert r["flops"] == 2.5 * 4 * 2 * shape.q_len ** 2 * 16
    # The references differ from each other, so each row really met its own.
    scope = __import__("vidattn.bench.reference", fromlist=["RefScope"]).RefScope(1, 2, 1, 2)
    vsa_grads = case.reference_backward(inputs, grad_out, scope, "vsa")
    dense_grads = case.reference_backward(inputs, grad_out, scope, "dense-tokens")
    assert max(float((a - b).abs().max()) for a, b in zip(vsa_grads, dense_grads)) > 1e-3
    assert all((g[:, pads] == 0).all() for g in vsa_grads)
    assert isinstance(case.impls[2], SdpaDense)


def test_vsa_inputs_are_the_tiled_tokens():
    """The VSA case tiles its inputs with plain torch indexing (no vidattn kernel needed on
    the device): it must equal VideoTiling.tile of the same raster tensor."""
    from vidattn.bench.vsa_case import VsaCase

    shape = shapes.vsa(2, 3, (5, 6, 7), 8, 0.5)
    inputs = VsaCase([], ()).make_inputs(shape, torch.float32, CPU, _gen(40))
    # The same draws as make_inputs (q first), tiled by vidattn's op.
    raster_q = torch.randn(2, inputs.tiling.num_tokens, 3, 8, generator=_gen(40))
    assert torch.equal(inputs.tiling.tile(raster_q), inputs.q)
    assert (inputs.q[:, ~inputs.tiling.slot_valid] == 0).all() and inputs.q.is_contiguous()
