"""A short run of the fuzz harness (python -m vidattn.fuzz) on the CPU: random configurations
of every op against the float64 reference, and the catalogue of bad inputs in a worker
process. Zero failures and zero crashes; catalogue entries that wait for other work are
listed as expected failures by the catalogue itself."""
from __future__ import annotations

import json
import subprocess
import sys

import vidattn.fuzz.__main__ as fuzz
from vidattn.fuzz import catalogue, configs


def test_fuzz_short_cpu_run(tmp_path):
    summary = tmp_path / "fuzz.json"
    proc = subprocess.run(
        [sys.executable, "-m", "vidattn.fuzz", "--device", "cpu", "--count", "36", "--seed",
         "20261206", "--time-budget", "30", "--json", str(summary)],
        capture_output=True, text=True, timeout=300,
        env=fuzz_env())
    assert summary.exists(), proc.stdout + proc.stderr
    s = json.loads(summary.read_text())
    assert s["failures"] == 0 and s["crashes"] == 0 and s["catalogue_failures"] == 0, \
        json.dumps(s["failed"], indent=1)
    assert s["configurations"] >= 12, "the time budget left too few configurations"
    assert s["passed"] + s["unsupported"] == s["configurations"]
    assert s["catalogue"] == len(catalogue.entries_for("cpu"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def fuzz_env():
    import os
    import vidattn
    env = dict(os.environ)
    root = os.path.dirname(os.path.dirname(os.path.abspath(vidattn.__file__)))
    env["PYTHONPATH"] = os.pathsep.join(x for x in (root, env.get("PYTHONPATH")) if x)
    return env


def test_configurations_are_reproducible():
    # The same (op, seed) gives the same configuration: the printed repro rebuilds it.
    for op in configs.OPS:
        assert configs.draw(op, 7, "cpu") == configs.draw(op, 7, "cpu")
    assert "run_config('vsa', 7, 'cpu')" in configs.repro("vsa", 7, "cpu")


def test_a_wrong_kernel_is_caught():
    # The rule fails a result that is off: the harness can fail.
    import torch
    ref = torch.randn(4, 8, dtype=torch.float64)
    base = ref.to(torch.bfloat16)
    bad = base.double() + 0.5
    try:
        configs.check("x", bad, ref, base, torch.bfloat16)
    except configs.Mismatch:
        pass
    else:
        raise AssertionError("a 0.5 error passed the rule")
    nan = base.clone()
    nan[0, 0] = float("nan")
    try:
        configs.check("x", nan, ref, base, torch.bfloat16)
    except configs.Mismatch:
        return
    raise AssertionError("a NaN where the reference is finite passed")


def test_a_crash_counts_as_a_crash():
    pool = fuzz.Pool("cpu", prefix=[sys.executable, "-c",
                                    "import os, sys; sys.stdin.readline(); os.abort()", "--"])
    res = pool.run({"type": "config", "op": "dense", "seed": 0})
    assert res["status"] == "crash"
    pool.close()


def test_stored_output_floor_is_the_exact_shift():
    # backward_floors' term for the output stored in the kernel's dtype: zero where O is exact
    # in it (one key: O = V), and at least the shift rowsum(dO (round(O) - O)) itself where it
    # is not, so the floor grows only by what every flash-style backward must make.
    import math

    import torch
    from vidattn.fuzz import reference as ref
    g = torch.Generator().manual_seed(3)
    q, k, v, do = (torch.randn(1, n, 1, 16, generator=g, dtype=torch.float64).to(
        torch.float16).double() for n in (5, 1, 1, 5))
    allowed = torch.ones(1, 1, 5, 1, dtype=torch.bool)
    assert ref.backward_floors(q, k, v, do, allowed, 0.25, torch.float16) == \
        ref.backward_floors(q, k, v, do, allowed, 0.25)
    k, v = (torch.randn(1, 7, 1, 16, generator=g, dtype=torch.float64).to(torch.float16)
            .double() for _ in range(2))
    allowed = torch.ones(1, 1, 5, 7, dtype=torch.bool)
    plain = ref.backward_floors(q, k, v, do, allowed, 0.25)
    stored = ref.backward_floors(q, k, v, do, allowed, 0.25, torch.float16)
    assert stored[2] == plain[2]  # dV does not use delta
    out = ref.attention(q, k, v, allowed, 0.25)
    shift = (do * (out.to(torch.float16).double() - out)).sum(-1).abs().max().item()
    assert shift > 0 and stored[0] > plain[0] and stored[1] > plain[1]
    assert not math.isclose(stored[0], plain[0])


def test_a_nearly_one_hot_row_in_fp16_passes(monkeypatch):
    # The GPU fuzz's varlen seed 91 (fp16, scale-16 inputs: a row whose two largest logits are
    # 7.8 apart) failed dQ by the stored output's shift of delta, on the CPU backend too; the
    # rule's floor now holds that term. The CPU runs the CUDA draw of that seed.
    draw = configs.draw
    monkeypatch.setattr(configs, "draw", lambda op, seed, device: draw(op, seed, "cuda"))
    configs.run_config("varlen", 91, "cpu")


def test_memcheck_log_without_a_summary_is_not_clean():
    """The sanitizer subset counts memcheck's ERROR SUMMARY lines; a log without one (the
    tool died, or never ran) must not read as zero errors."""
    from vidattn.fuzz.__main__ import memcheck_errors
    assert memcheck_errors("") is None
    assert memcheck_errors("========= COMPUTE-SANITIZER\n========= Program hit ...\n") is None
    assert memcheck_errors("========= ERROR SUMMARY: 0 errors\n") == 0
    assert memcheck_errors("========= ERROR SUMMARY: 2 errors\n"
                           "========= ERROR SUMMARY: 1 error\n") == 3
