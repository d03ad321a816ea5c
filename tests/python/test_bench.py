"""The bench CLI (python -m vidattn.bench) end to end on a tiny shape, and its parts that can
be wrong silently: the float64 reference, FLOP counting, shape parsing, device names.
No timing assertions."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import vidattn
from vidattn.bench import clocks, environment, reference, report, shapes
from vidattn.bench.base import Impl
from vidattn.bench.cases import cases_for
from vidattn.bench.dense_case import DenseCase, SdpaDense, VidattnDense
from vidattn.bench.plot import write_plot
from vidattn.bench.runner import Plan, direction_flops, run_plan
from vidattn.bench.timing import CpuTimer


def _run_cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    package_root = str(Path(vidattn.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return subprocess.run([sys.executable, "-m", "vidattn.bench", *args], env=env,
                          capture_output=True, text=True, timeout=600)


def test_cli_tiny_writes_table_json_and_png(tmp_path):
    out = tmp_path / "results" / "tiny.json"
    proc = _run_cli("--device", "cpu", "--shapes", "tiny", "--repeats", "2", "--threads", "1",
                    "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "max abs err" in proc.stdout and "vidattn" in proc.stdout

    doc = json.loads(out.read_text())
    assert doc["schema"] == "vidattn-bench/1"
    assert doc["device"].startswith("cpu-") and doc["device"].endswith("-1t")
    assert doc["threads"] == 1
    assert doc["torch_version"] == torch.__version__
    assert "git_commit" in doc and doc["date"].count("-") == 2

    rows = doc["rows"]
    expected = {(impl, dtype, direction) for impl in ("vidattn", "sdpa")
                for dtype in ("fp32", "bf16") for direction in ("fwd", "bwd")}
    assert {(r["impl"], r["dtype"], r["direction"]) for r in rows} == expected
    assert len(rows) == len(expected)
    shape = shapes.PRESETS["tiny"].shapes[0]
    fwd_flops = 4 * shape.batch * shape.heads * shape.q_len * shape.kv_len * shape.head_dim
    for r in rows:
        assert r["status"] == "ok", r
        assert r["repeats"] == 2
        for key in ("median_ms", "min_ms", "tflops", "max_abs_err"):
            assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] >= 0, (key, r)
        assert r["median_ms"] > 0 and r["tflops"] > 0
        assert r["flops"] == fwd_flops * (2.5 if r["direction"] == "bwd" else 1)
        assert set(r["errors"]) == ({"dq", "dk", "dv"} if r["direction"] == "bwd" else {"out"})
        assert r["max_abs_err"] == max(r["errors"].values())
        # Both implementations agree with the reference to their dtype's precision; a broken
        # reference (or wrong inputs handed to it) would be far off.
        assert r["max_abs_err"] < (1e-5 if r["dtype"] == "fp32" else 3e-2), r
        assert r["ref_scope"]["label"] == "all"
        assert r["peer"] == "sdpa"
        if r["impl"] == "vidattn":
            assert math.isfinite(r["ratio_to_peer"]) and r["ratio_to_peer"] > 0
        else:
            assert r["ratio_to_peer"] is None

    png = out.with_suffix(".png")
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_cli_rejects_bad_arguments(tmp_path):
    proc = _run_cli("--shapes", "b1h4s0d64", "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0 and "--shapes" in proc.stderr
    proc = _run_cli("--directions", "sideways", "--out", str(tmp_path / "x.json"))
    assert proc.returncode != 0 and "--directions" in proc.stderr
    assert not (tmp_path / "x.json").exists()


def _naive_float64(q, k, v, causal):
    """Plain float64 attention with autograd, [B, S, H, D]; every row must see a key."""
    q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        sq, sk = s.shape[-2:]
        visible = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + (sk - sq)
        s = s.masked_fill(~visible, float("-inf"))
    return (torch.softmax(s, dim=-1) @ v).transpose(1, 2)


@pytest.mark.parametrize("q_len,kv_len,causal", [(37, 37, False), (37, 37, True),
                                                  (19, 45, True), (45, 19, False)])
def test_reference_matches_naive_float64(monkeypatch, q_len, kv_len, causal):
    # Blocks of 8 query rows (B2 x H3 x 8 x kv_len scores), so the chunked loops run several
    # blocks with a partial last one.
    monkeypatch.setitem(reference._SCORE_BLOCK_ELEMS, "cpu", 2 * 3 * 8 * kv_len)
    g = torch.Generator().manual_seed(1234 + q_len + kv_len + causal)
    q = torch.randn(2, q_len, 3, 16, generator=g, dtype=torch.float64) * 4
    k = torch.randn(2, kv_len, 3, 16, generator=g, dtype=torch.float64) * 4
    v = torch.randn(2, kv_len, 3, 16, generator=g, dtype=torch.float64)
    grad_out = torch.randn(2, q_len, 3, 16, generator=g, dtype=torch.float64)
    assert reference._row_chunk(q.transpose(1, 2), kv_len) == 8

    out, lse = reference.attention_forward(q, k, v, causal=causal)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    expected = _naive_float64(*leaves, causal)
    torch.testing.assert_close(out, expected.detach(), rtol=1e-12, atol=1e-12)
    assert lse.shape == (2, 3, q_len) and torch.isfinite(lse).all()

    grads = reference.attention_backward(q, k, v, grad_out, causal=causal)
    expected_grads = torch.autograd.grad(expected, leaves, grad_out)
    for got, want in zip(grads, expected_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)


def test_reference_rows_without_keys_are_zero():
    # Causal with q_len > kv_len: the first q_len - kv_len queries see no key.
    g = torch.Generator().manual_seed(7)
    q, k, v, do = (torch.randn(1, n, 2, 8, generator=g) for n in (6, 4, 4, 6))
    out, lse = reference.attention_forward(q, k, v, causal=True)
    assert (out[:, :2] == 0).all() and torch.isinf(lse[..., :2]).all()
    dq, dk, dv = reference.attention_backward(q, k, v, do, causal=True)
    assert (dq[:, :2] == 0).all()
    assert all(torch.isfinite(t).all() for t in (out[:, 2:], dq, dk, dv))


def test_max_abs_error_flags_nan():
    assert reference.max_abs_error(torch.tensor([1.0, float("nan")]),
                                   torch.zeros(2, dtype=torch.float64)) == float("inf")
    assert reference.max_abs_error(torch.tensor([1.0, -3.0]),
                                   torch.zeros(2, dtype=torch.float64)) == 3.0


class _NoKernelHere(Impl):
    """Stands in for vidattn on a device it has no kernel for (CUDA today)."""

    name, backend, is_ours = "vidattn", "test", True

    def forward(self, inputs):
        raise NotImplementedError("Could not run 'vidattn::attention' with arguments from the "
                                  "'CUDA' backend.")


def test_runner_keeps_unimplemented_rows_as_unavailable(tmp_path):
    case = DenseCase([_NoKernelHere(), SdpaDense()], peer_order=("sdpa",))
    plan = Plan(shapes=[shapes.Shape(1, 2, 16, 24, 8)], dtypes=["fp32"],
                directions=["fwd", "bwd"], cases=[case], device=torch.device("cpu"),
                timer=CpuTimer(warmup=0, repeats=1))
    rows = run_plan(plan)
    assert [(r["impl"], r["direction"], r["status"]) for r in rows] == [
        ("vidattn", "fwd", "unavailable"), ("sdpa", "fwd", "ok"),
        ("vidattn", "bwd", "unavailable"), ("sdpa", "bwd", "ok")]
    for r in rows:
        if r["status"] == "unavailable":
            assert "not implemented on cpu" in r["note"] and "median_ms" not in r
            assert r["ratio_to_peer"] is None
        else:
            assert r["max_abs_err"] < 1e-5 and r["peer"] == "sdpa"
    table = report.format_table(rows)
    assert table.count("unavailable") == 2
    meta = {"device": "cpu-test-1t", "device_description": "test", "threads": 1,
            "torch_version": torch.__version__, "git_commit": None, "timer": "test"}
    assert "unavailable: vidattn: not implemented on cpu" in report.format_notes(rows, meta)
    report.write_json(tmp_path / "r.json", meta, rows)
    assert len(json.loads((tmp_path / "r.json").read_text())["rows"]) == 4
    write_plot(tmp_path / "r.png", rows, "test")
    assert (tmp_path / "r.png").stat().st_size > 0


def test_cuda_peers_say_why_they_skip_elsewhere():
    impls = {i.name: i for i in cases_for(torch.device("cuda"))[0].impls}
    assert set(impls) == {"vidattn", "vidattn-nondet", "sdpa", "sdpa-cudnn", "sdpa-flash"}
    shape = shapes.Shape(1, 1, 8, 8, 8)
    assert impls["sdpa-cudnn"].skip_reason(torch.device("cpu"), torch.bfloat16, shape)
    assert "fp16/bf16" in impls["sdpa-flash"].skip_reason(torch.device("cuda"), torch.float32,
                                                           shape)
    assert impls["sdpa-flash"].skip_reason(torch.device("cuda"), torch.bfloat16, shape) is None


def test_flop_counting():
    case = DenseCase([VidattnDense(), SdpaDense()], peer_order=("sdpa",))
    dense = shapes.Shape(2, 3, 100, 200, 64)
    causal = shapes.Shape(2, 3, 100, 200, 64, causal=True)
    assert direction_flops(case, dense, "fwd") == 4 * 2 * 3 * 100 * 200 * 64
    assert direction_flops(case, dense, "bwd") == 2.5 * 4 * 2 * 3 * 100 * 200 * 64
    assert direction_flops(case, causal, "fwd") == 2 * 2 * 3 * 100 * 200 * 64


def test_shape_specs_and_presets():
    assert shapes.parse_shape("b2h12s4096d128") == shapes.Shape(2, 12, 4096, 4096, 128)
    assert shapes.parse_shape("B1H4S100K50D64C") == shapes.Shape(1, 4, 100, 50, 64, True)
    for bad in ("b1h4s1024", "b1h0s16d64", "quick2"):
        with pytest.raises(ValueError, match="--shapes"):
            shapes.parse_shape(bad)
    cpu4k = shapes.resolve(["cpu-4k"])
    assert cpu4k.directions == ("fwd",)
    assert {(s.q_len, s.head_dim) for s in cpu4k.shapes} == {(4096, 64), (4096, 128)}
    mixed = shapes.resolve(["tiny", "b1h1s8d8"])
    assert len(mixed.shapes) == 2 and mixed.directions == ("fwd", "bwd")


def test_reference_scope_shrinks_for_big_shapes():
    small = reference.choose_scope(shapes.Shape(1, 4, 1024, 1024, 64), "bwd", "cpu")
    assert small.is_full and small.label == "all"
    wan = shapes.PRESETS["video"].shapes[1]  # Wan2.1-14B 720p: H40, S92160
    scope = reference.choose_scope(wan, "fwd", "cuda")
    assert scope.batches == 1 and 1 <= scope.heads < wan.heads
    assert scope.label == f"b1/1 h{scope.heads}/40"
    assert reference.choose_scope(wan, "fwd", "cuda", max_heads=1).heads == 1


def test_default_out_is_one_stable_name_per_benchmark_and_device():
    from vidattn.bench.cli import default_out

    meta = {"device": "cpu-X-2t", "date": "2026-11-29"}
    assert default_out(meta, None, "quick").name == "quick.json"
    assert default_out(meta, ["quick"], "quick").name == "quick.json"
    assert default_out(meta, ["cpu-4k"], "quick").name == "cpu-4k.json"
    assert default_out(meta, ["b1h1s8d8"], "quick").name == "custom.json"
    assert default_out(meta, None, "quick").parent.parts[-3:] == ("bench", "results", "cpu-X-2t")
    # A partial run names its cases and directions; all cases is the whole run.
    assert default_out(meta, ["gpu-suite"], "video", None, ["fwd"]).name == "gpu-suite-fwd.json"
    assert default_out(meta, ["gpu-suite"], "video", ["dense", "vsa"]).name == \
        "gpu-suite-dense-vsa.json"
    assert default_out(meta, ["gpu-suite"], "video", ["dense", "blocksparse", "vsa"]).name == \
        "gpu-suite.json"


def test_device_names_are_file_safe():
    assert environment.sanitize("Intel(R) Xeon(R) Gold 6338 CPU @ 2.00GHz") == \
        "Intel-Xeon-Gold-6338"
    assert environment.sanitize("NVIDIA H200") == "NVIDIA-H200"
    assert environment.device_name(torch.device("cpu"), 2).endswith("-2t")


def test_cli_vsa_rows_and_selection_png(tmp_path):
    out = tmp_path / "vsa.json"
    sel = tmp_path / "selection.png"
    proc = _run_cli("--device", "cpu", "--shapes", "tiny-vsa", "--repeats", "2", "--threads",
                    "1", "--out", str(out), "--draw-selection", str(sel))
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(out.read_text())["rows"]
    assert {(r["impl"], r["dtype"]) for r in rows} == {
        (impl, dtype) for impl in ("vidattn-vsa", "vidattn-dense", "sdpa")
        for dtype in ("fp32", "bf16")}
    for r in rows:
        assert r["status"] == "ok" and r["direction"] == "fwd", r
        assert r["shape"]["grid"] == [5, 7, 9] and r["shape"]["sparsity"] == 0.75
        # Each row against its own float64 reference (VSA's, or dense over the video tokens).
        assert r["max_abs_err"] < (1e-5 if r["dtype"] == "fp32" else 3e-2), r
        if r["impl"] == "vidattn-vsa":
            assert r["peer"] == "vidattn-dense" and r["ratio_to_peer"] > 0
    assert sel.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_vsa_reference_is_dense_at_zero_sparsity():
    """With every key tile selected the fine branch is dense attention over the video's tokens,
    so the VSA reference must equal the dense-over-tokens reference plus the coarse branch
    (checked here through the VSA op itself at sparsity 0, which must then agree too)."""
    from vidattn.bench.vsa_case import VsaCase

    shape = shapes.vsa(1, 2, (3, 5, 6), 16, 0.0)
    case = VsaCase([], ())
    gen = torch.Generator().manual_seed(3)
    inputs = case.make_inputs(shape, torch.float64, torch.device("cpu"), gen)
    scope = reference.choose_scope(shape, "fwd", "cpu")
    (vsa_ref,) = case.reference_forward(inputs, scope, "vsa")
    (dense_ref,) = case.reference_forward(inputs, scope, "dense-tokens")
    out = vidattn.video_sparse_attention(inputs.q, inputs.k, inputs.v, tiling=inputs.tiling,
                                         sparsity=0.0)
    coarse = vsa_ref - dense_ref
    assert coarse.abs().max() > 1e-3  # the coarse branch is really there
    assert (out - vsa_ref).abs().max() < 1e-10
    # Pad slots are zero in the reference.
    assert torch.all(vsa_ref[:, ~inputs.tiling.slot_valid] == 0)


def test_clock_summary_takes_the_samples_of_its_window():
    samples = [(0.0, 1980.0, 120.0, 0x1), (1.0, 1755.0, 690.0, 0x4), (1.5, 1650.0, 700.0, 0x4),
               (2.0, 1700.0, 695.0, 0x4 | 0x20), (9.0, 1980.0, 90.0, 0x1)]
    got = clocks.summarise(samples, 1.0, 2.0)
    assert got == {"sm_mhz_median": 1700.0, "sm_mhz_min": 1650.0, "power_w_median": 695.0,
                   "reasons": ["power cap", "sw thermal"], "samples": 3}
    assert clocks.summarise(samples, 3.0, 8.0) is None
    assert clocks.reason_names(0x4 | 0x1000) == ["power cap", "0x1000"]


def test_rows_record_the_clocks_sampled_while_they_were_timed(tmp_path):
    """A sampler with a fake reader: the timed rows get its summary, the table an SM MHz
    column and the notes a line; a CPU run without a sampler records nothing."""
    class SlowTimer(CpuTimer):  # a timed stretch the sampler cannot miss
        def measure_group(self, fns):
            time.sleep(0.05)
            return super().measure_group(fns)

    sampler = clocks.ClockSampler(lambda: (1650.0, 690.0, 0x4), period_s=0.001,
                                  description="fake")
    case = cases_for(torch.device("cpu"))[0]
    plan = Plan(shapes=[shapes.Shape(1, 2, 16, 24, 8)], dtypes=["fp32"], directions=["fwd"],
                cases=[case], device=torch.device("cpu"),
                timer=SlowTimer(warmup=0, repeats=1), clocks=sampler.start())
    try:
        rows = run_plan(plan)
    finally:
        sampler.stop()
    timed = [r for r in rows if r["status"] == "ok"]
    assert timed and all(r["clocks"]["sm_mhz_median"] == 1650.0 and
                         r["clocks"]["reasons"] == ["power cap"] and r["clocks"]["samples"] >= 1
                         for r in timed)
    table = report.format_table(rows)
    assert "SM MHz" in table.splitlines()[0] and "1650" in table
    meta = {"device": "cpu-test-1t", "device_description": "test", "threads": 1,
            "torch_version": torch.__version__, "git_commit": None, "timer": "test",
            "clock_sampling": "fake"}
    assert f"the power cap limited it in {len(timed)} of {len(timed)} rows" in \
        report.format_notes(rows, meta)
    assert "SM" in report.format_rows_brief(timed)
    plain = run_plan(Plan(shapes=[shapes.Shape(1, 2, 16, 24, 8)], dtypes=["fp32"],
                          directions=["fwd"], cases=[case], device=torch.device("cpu"),
                          timer=CpuTimer(warmup=0, repeats=1)))
    assert not any("clocks" in r for r in plain)
    assert "SM MHz" not in report.format_table(plain)
    assert clocks.ClockSampler.for_device(torch.device("cpu")) is None


def test_cuda_timer_warms_up_past_the_clock_swing():
    """GPU rows get GPU_WARMUP_MS of untimed runs and GPU_REP_MS of timed ones from do_bench,
    not its 25 ms default, which timed short rows while the power-capped clock swung."""
    from vidattn.bench import timing

    seen = {}

    def fake_do_bench(fn, **kwargs):
        seen.update(kwargs)
        fn()
        return 1.5

    timer = timing.CudaTimer()
    timer._do_bench = fake_do_bench
    calls = []
    got = timer.measure(lambda: calls.append(1))
    assert got.median_ms == 1.5 and calls == [1]
    assert seen == {"warmup": timing.GPU_WARMUP_MS, "rep": timing.GPU_REP_MS,
                    "return_mode": "median"}
    assert timing.GPU_WARMUP_MS >= 250
