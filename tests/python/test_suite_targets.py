"""`python -m vidattn.bench targets` on hand-made suite rows: which rows carry a target, the
ratios it reads from the runner's ``ratios_to_peers``, and the verdicts at and around each
bound."""
import json

from vidattn.bench.cli import main as bench_main
from vidattn.bench.modes import targets as suite_targets


def row(case, ms, tflops, peers=None, q_len=32768, kv_len=None, head_dim=128, sparsity=None,
        causal=False, status="ok", ours=True, dtype="bf16"):
    """One of ours (or, ours=False, a peer's) row as the runner writes it; peers: its
    ratios_to_peers, {peer: peer time / this time}."""
    shape = {"batch": 1, "heads": 12, "q_len": q_len, "kv_len": kv_len or q_len,
             "head_dim": head_dim, "causal": causal}
    if sparsity is not None:
        shape["sparsity"] = sparsity
    return {"case": case, "is_ours": ours, "dtype": dtype, "median_ms": ms, "tflops": tflops,
            "shape": shape, "shape_label": f"S{q_len}k{kv_len or q_len} D{head_dim} s{sparsity}",
            "status": status, "ratios_to_peers": peers or {}}


def test_dense_ratio_against_cudnn_and_the_bound_is_inclusive():
    lines, ok = suite_targets.target_lines([
        row("dense", 10.0, 660.0, {"sdpa-cudnn": 1.1, "sdpa-flash": 2.0}),  # exactly 1.10x
        row("dense", 11.0, 600.0, ours=False),  # a peer's row: reported through ours
    ])
    assert ok
    assert lines == ["dense S32768k32768 D128 sNone: 660.0 vs cuDNN 600.0 TFLOP/s, 1.100x "
                     "(>= 1.10x: met)"]


def test_a_missed_dense_row_says_by_how_much():
    lines, ok = suite_targets.target_lines([
        row("dense", 10.0, 640.0, {"sdpa-cudnn": 1.045}),  # 1.045x of 1.10x: 5.0% short
    ])
    assert not ok
    assert lines[0].endswith("1.045x (>= 1.10x: missed by 5.0%)")


def test_cross_short_and_causal_rows_carry_no_target():
    lines, ok = suite_targets.target_lines([
        row("dense", 10.0, 300.0, {"sdpa-cudnn": 0.8}, q_len=32760, kv_len=128),
        row("dense", 10.0, 500.0, {"sdpa-cudnn": 0.9}, q_len=8192),
        row("dense", 10.0, 500.0, {"sdpa-cudnn": 0.9}, causal=True),
        row("dense", 10.0, 450.0, {"sdpa-cudnn": 0.99}, q_len=2048, head_dim=64),  # any length
    ])
    assert not ok  # the D = 64 row, 0.99x
    assert sum("(no target)" in line for line in lines) == 2
    assert len(lines) == 3  # causal rows are left out
    assert lines[-1].endswith("0.990x (>= 1.00x: missed by 1.0%)")


def test_block_sparse_against_our_dense_and_each_peer():
    lines, ok = suite_targets.target_lines([
        row("dense", 10.0, 600.0),
        row("dense", 10.0, 700.0, dtype="fp16"),  # another dtype's dense rate: not this one's
        row("blocksparse", 1.0, 540.0, {"fastvideo-triton": 1.4, "flex": 1.3},
            sparsity=0.9),  # 90% of dense
    ])
    assert not ok
    assert len(lines) == 1
    assert "90.0% of our dense 600.0 (>= 90%: met)" in lines[0]
    assert "1.40x fastvideo-triton (>= 1.5x: missed by 6.7%)" in lines[0]
    assert "1.30x flex (>= 1.3x: met)" in lines[0]


def test_whole_vsa_against_cudnn_and_failed_rows_are_skipped():
    lines, ok = suite_targets.target_lines([
        row("vsa", 2.0, 5000.0, {"vidattn-dense": 6.0, "sdpa-cudnn": 8.0, "fastvideo-vsa": 1.5},
            sparsity=0.9),
        row("dense", 1.0, 999.0, {"sdpa-cudnn": 0.5}, status="error"),
    ])
    assert ok
    assert lines == ["whole VSA S32768k32768 D128 s0.9: 2.000 ms, cuDNN dense 16.000 ms, 8.00x "
                     "(>= 7.5x: met); 1.50x FastVideo's op"]


def test_targets_mode_reads_a_suite_json(tmp_path, capsys):
    path = tmp_path / "suite.json"
    path.write_text(json.dumps({"rows": [
        row("dense", 10.0, 660.0, {"sdpa-cudnn": 1.05}),  # below 1.10x
        row("vsa", 1.0, 0.0, {"sdpa-cudnn": 8.0}, q_len=39936)]}))
    assert bench_main(["targets", str(path)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0].endswith("1.050x (>= 1.10x: missed by 4.5%)")
    assert out[1].startswith("whole VSA") and out[1].endswith("8.00x (>= 7.5x: met)")
    assert out[-1] == "some targets missed"
