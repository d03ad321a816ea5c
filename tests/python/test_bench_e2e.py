"""``python -m vidattn.bench --e2e`` on the CPU: the whole-model step benchmark runs its code
path on the tiny Wan config (1 repeat) and writes a complete JSON; the Wan2.1 models refuse
the CPU clearly. (The GPU numbers come from the GPU runner.)"""
from __future__ import annotations

import json
import math

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("matplotlib")

from vidattn.bench import cli, e2e_case  # noqa: E402


def _finite(x):
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def test_e2e_tiny_cpu_smoke(tmp_path):
    out = tmp_path / "e2e.json"
    rc = cli.main(["--e2e", "--e2e-models", "tiny", "--device", "cpu", "--repeats", "1",
                   "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["schema"] == "vidattn-bench-e2e/1" and doc["sparsity"] == 0.9
    assert out.with_suffix(".png").stat().st_size > 0
    (model,) = doc["models"]
    assert model["name"] == "tiny" and model["grid"] == [5, 5, 7] and model["tokens"] == 175
    assert model["timed_layers"] == model["full_layers"] == 2
    assert all(_finite(v) and v > 0 for v in model["non_block_ms"].values())
    rows = {(r["impl"], r["direction"]): r for r in model["rows"]}
    assert set(rows) == {(i, d) for i in e2e_case.IMPLS for d in e2e_case.DIRECTIONS}
    for direction in e2e_case.DIRECTIONS:
        assert rows[("sdpa-cudnn", direction)]["status"] == "unavailable"  # CUDA only
        for impl in ("diffusers-default", "vidattn-dense", "vidattn-vsa"):
            row = rows[(impl, direction)]
            assert row["status"] == "ok", row
            for key in ("step_ms", "per_layer_ms", "full_depth_step_ms", "attention_share",
                        "profiled_total_ms"):
                assert _finite(row[key]), (impl, direction, key, row[key])
            assert row["step_ms"] > 0 and 0 < row["attention_share"] < 1
            assert row["full_depth_extrapolated"] is False
            assert row["full_depth_step_ms"] == row["step_ms"]
            assert set(row["breakdown_ms"]) == {"attention", "tiling", "rope", "linear",
                                                "norm", "other"}
            assert all(_finite(v) and v >= 0 for v in row["breakdown_ms"].values())
            # vidattn's ops are where the profile says: its RoPE op ran in vidattn's rows.
            assert (row["breakdown_ms"]["rope"] > 0) == impl.startswith("vidattn")
        assert rows[("vidattn-vsa", direction)]["breakdown_ms"]["tiling"] > 0
    diff = model["dense_vs_default"]
    assert all(_finite(diff[k]) for k in ("max_abs", "mean_abs", "max_rel", "ref_max_abs"))
    # bf16 outputs of two correct attentions: close, not necessarily equal.
    assert diff["max_rel"] < 0.05


def test_e2e_layers_extrapolates(tmp_path):
    out = tmp_path / "e2e1.json"
    rc = cli.main(["--e2e", "--e2e-models", "tiny", "--device", "cpu", "--repeats", "1",
                   "--e2e-layers", "1", "--impls", "vidattn-dense", "--directions",
                   "inference", "--no-profile", "--no-plot", "--out", str(out)])
    assert rc == 0
    (model,) = json.loads(out.read_text())["models"]
    assert model["timed_layers"] == 1 and model["full_layers"] == 2
    (row,) = model["rows"]
    assert row["full_depth_extrapolated"] is True
    expected = model["non_block_ms"]["inference"] + 2 * row["per_layer_ms"]
    assert row["full_depth_step_ms"] == pytest.approx(expected)
    assert "attention_share" not in row


def test_e2e_refuses_the_wan_models_on_the_cpu(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--e2e", "--device", "cpu"])
    assert exc.value.code == 2
    assert "need a CUDA GPU" in capsys.readouterr().err
    for bad in (["--e2e-models", "wan3"], ["--impls", "flash"], ["--e2e-layers", "0"],
                ["--sparsity", "1"]):
        with pytest.raises(SystemExit):
            cli.main(["--e2e", "--device", "cpu", *bad])


def test_gpu_script_dry_run(tmp_path):
    """tools/gpu/e2e.sh, the GPU machine's call, with DRY_RUN=1: the same entry point and
    arguments on the tiny model on the CPU, JSON and PNG in <OUT>/<device>/ (bench/results'
    layout), every implementation it names, the training rows at the depth it asks for."""
    import os
    import subprocess
    import sys

    import vidattn

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    package_dir = os.path.dirname(os.path.dirname(os.path.abspath(vidattn.__file__)))
    env = dict(os.environ, OUT=str(tmp_path), DRY_RUN="1", PYTHON=sys.executable,
               PACKAGE_DIR=package_dir)
    done = subprocess.run(["bash", os.path.join(root, "tools", "gpu", "e2e.sh")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (folder,) = [p for p in tmp_path.iterdir() if p.is_dir()]
    doc = json.loads((folder / "e2e.json").read_text())
    assert (folder / "e2e.png").stat().st_size > 0
    by_depth = {(m["name"], m["timed_layers"]): m for m in doc["models"]}
    assert set(by_depth) == {("tiny", 2), ("tiny", 1)}
    for (name, depth), model in by_depth.items():
        directions = {r["direction"] for r in model["rows"]}
        assert directions == ({"inference"} if depth == 2 else {"training"})
        rows = {r["impl"]: r for r in model["rows"]}
        assert set(rows) == set(e2e_case.IMPLS + e2e_case.EXTRA_IMPLS)
        for impl, row in rows.items():
            if impl != "sdpa-cudnn":
                assert row["status"] == "ok" and _finite(row["attention_share"]), row
                assert row["full_depth_extrapolated"] == (depth == 1)


def test_e2e_layers_per_model_and_direction():
    models, directions = ["tiny", "wan2.1-14b-720p"], list(e2e_case.DIRECTIONS)
    parser = e2e_case.build_parser()
    layers = e2e_case.parse_layers("tiny:training=1,wan2.1-14b-720p=4", models, directions,
                                   parser)
    assert layers == {("tiny", "inference"): None, ("tiny", "training"): 1,
                      ("wan2.1-14b-720p", "inference"): 4, ("wan2.1-14b-720p", "training"): 4}
    assert e2e_case.parse_layers("3", models, directions, parser) == {k: 3 for k in layers}
    assert e2e_case.parse_layers("tiny:training=0", models, directions,
                                 parser)[("tiny", "training")] == 0
    for bad in ("tiny=x", "wan3=2", "tiny:backward=2", "tiny=-1", "0"):
        with pytest.raises(SystemExit):
            e2e_case.parse_layers(bad, models, directions, parser)
