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
