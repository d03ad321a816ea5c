"""`python -m vidattn.bench MODE`: the dispatch to the modes, their command lines (parsed on
any machine; measuring needs a GPU) and what they write; the sequence-parallel mode runs for
real on the CPU with gloo."""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vidattn
from vidattn.bench import modes
from vidattn.bench.cli import main
from vidattn.bench.modes import common, dense


@pytest.mark.parametrize("mode", list(modes.MODES))
def test_every_mode_has_its_own_help(mode, capsys):
    with pytest.raises(SystemExit) as exit:
        main([mode, "--help"])
    assert exit.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: python -m vidattn.bench {mode} ")


def test_the_main_help_lists_the_modes(capsys):
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    assert all(f"\n  {mode} " in out for mode in modes.MODES)


def test_a_word_that_is_no_mode_goes_to_the_case_runner(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["rop"])  # a typo of "rope"
    assert exit.value.code == 2
    assert "unrecognized arguments: rop" in capsys.readouterr().err


def test_shapes_of_the_kernel_modes():
    assert common.parse_shape("1,32760:512,12,128") == (1, 32760, 12, 128, False, 512)
    assert common.parse_shape("2,4096,24,64,causal") == (2, 4096, 24, 64, True, 4096)
    for bad in ("1,2", "1,4096,24,64,full", "1,1:2:3,4,64", "1,x,4,64"):
        with pytest.raises(argparse.ArgumentTypeError):
            common.parse_shape(bad)
    assert dense.parse_sparse_row("1,39936,12,128,64,0.9") == (1, 39936, 12, 128, 64, 0.9)
    with pytest.raises(argparse.ArgumentTypeError):
        dense.parse_sparse_row("1,39936,12,128,64")
    # Every default shape parses; the sweep has its 21 shapes.
    assert len([common.parse_shape(s) for s in dense.SWEEP]) == 21
    assert all(common.parse_shape(s) for s in dense.SHAPES)


def test_head_dims_of_the_dense_mode():
    assert dense.parse_head_dims("96") == (96, 96)
    assert dense.parse_head_dims("192:128") == (192, 128)
    for bad in ("", "0", "96:", "a", "1:2:3", "-8"):
        with pytest.raises(argparse.ArgumentTypeError):
            dense.parse_head_dims(bad)
    base = [common.parse_shape("1,4096,8,128"), common.parse_shape("1,4096:77,8,64,causal")]
    got = dense.with_head_dims(base, [(80, 80), (192, 128)])
    assert got == [(1, 4096, 8, 80, False, 4096, 80), (1, 4096, 8, 192, False, 4096, 128),
                   (1, 4096, 8, 80, True, 77, 80), (1, 4096, 8, 192, True, 77, 128)]
    assert all(dense.parse_head_dims(d) for d in dense.HEAD_DIMS)
    assert all(common.parse_shape(s) for s in dense.HEAD_DIM_SHAPES)
    args = dense.build_parser().parse_args(["--head-dims", "--fwd-vs-cudnn"])
    assert args.head_dims == [] and args.fwd_vs_cudnn
    args = dense.build_parser().parse_args(["--head-dims", "72", "256:128"])
    assert args.head_dims == [(72, 72), (256, 128)]


def test_a_mode_result_carries_the_run_metadata(tmp_path):
    doc = common.result_doc("rope", ["--out", "x.json"], torch.device("cpu"), rows=[{"ms": 1.0}])
    assert doc["mode"] == "rope" and doc["schema"] == "vidattn-bench-rope/1"
    assert doc["argv"] == ["--out", "x.json"] and doc["rows"] == [{"ms": 1.0}]
    assert {"date", "git_commit", "torch_version", "device"} <= set(doc)
    common.write_json(tmp_path / "sub" / "r.json", {**doc, "bad": float("nan")})
    assert json.loads((tmp_path / "sub" / "r.json").read_text())["bad"] == "nan"


def test_distributed_mode_on_cpu(tmp_path):
    """Two gloo processes: the layer on 2 ranks against 1, with the parity check."""
    out = tmp_path / "distributed.json"
    env = dict(os.environ, OMP_NUM_THREADS="1",
               # The workers import the vidattn this test imported (an installed one, or a
               # checkout's python/ with its built op library), not whatever python/ holds.
               PYTHONPATH=os.pathsep.join([str(Path(vidattn.__file__).resolve().parents[1]),
                                           os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--standalone", "-m", "vidattn.bench", "distributed", "--device", "cpu",
         "--grid", "2x8x8", "--heads", "4", "--iters", "2", "--warmup", "1", "--check",
         "--out", str(out)],
        env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["checks"] and all(c["ok"] for c in report["checks"])
    cases = {(r["case"], r["direction"]) for r in report["rows"]}
    assert cases == {("dense", "fwd"), ("dense", "bwd"), ("vsa", "fwd"), ("vsa", "bwd")}
    assert report["environment"]["argv"][0] == "distributed"
