"""tools/suite_targets.py on hand-made suite rows: which rows carry a target, the ratios it
computes from the medians, and the verdicts at and around each bound."""
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[2] / "tools"))
import suite_targets  # noqa: E402


def row(case, impl, ms, tflops, q_len=32768, kv_len=None, head_dim=128, sparsity=None,
        causal=False, status="ok"):
    shape = {"batch": 1, "heads": 12, "q_len": q_len, "kv_len": kv_len or q_len,
             "head_dim": head_dim, "causal": causal}
    if sparsity is not None:
        shape["sparsity"] = sparsity
    return {"case": case, "impl": impl, "median_ms": ms, "tflops": tflops, "shape": shape,
            "shape_label": f"S{q_len}k{kv_len or q_len} D{head_dim} s{sparsity}",
            "status": status}


def test_dense_ratio_is_cudnn_time_over_ours_and_the_bound_is_inclusive():
    lines, ok = suite_targets.target_lines([
        row("dense", "vidattn", 10.0, 660.0),
        row("dense", "sdpa-cudnn", 11.0, 600.0),  # exactly 1.10x
    ])
    assert ok
    assert lines == ["dense S32768k32768 D128 sNone: 660.0 vs cuDNN 600.0 TFLOP/s, 1.100x "
                     "(>= 1.10x: met)"]


def test_a_missed_dense_row_says_by_how_much():
    lines, ok = suite_targets.target_lines([
        row("dense", "vidattn", 10.0, 640.0),
        row("dense", "sdpa-cudnn", 10.45, 612.0),  # 1.045x of 1.10x: 5.0% short
    ])
    assert not ok
    assert lines[0].endswith("1.045x (>= 1.10x: missed by 5.0%)")


def test_cross_short_and_causal_rows_carry_no_target():
    lines, ok = suite_targets.target_lines([
        row("dense", "vidattn", 10.0, 300.0, q_len=32760, kv_len=128),
        row("dense", "sdpa-cudnn", 8.0, 360.0, q_len=32760, kv_len=128),
        row("dense", "vidattn", 10.0, 500.0, q_len=8192),
        row("dense", "sdpa-cudnn", 9.0, 550.0, q_len=8192),
        row("dense", "vidattn", 10.0, 500.0, causal=True),
        row("dense", "sdpa-cudnn", 9.0, 550.0, causal=True),
        row("dense", "vidattn", 10.0, 450.0, q_len=2048, head_dim=64),  # D = 64: any length
        row("dense", "sdpa-cudnn", 9.9, 440.0, q_len=2048, head_dim=64),
    ])
    assert not ok  # the D = 64 row, 0.99x
    assert sum("(no target)" in line for line in lines) == 2
    assert len(lines) == 3  # causal rows are left out
    assert lines[-1].endswith("0.990x (>= 1.00x: missed by 1.0%)")


def test_block_sparse_against_our_dense_and_each_peer():
    lines, ok = suite_targets.target_lines([
        row("dense", "vidattn", 10.0, 600.0),
        row("blocksparse", "vidattn", 1.0, 540.0, sparsity=0.9),  # 90% of dense
        row("blocksparse", "fastvideo-triton", 1.4, 386.0, sparsity=0.9),  # 1.4x
        row("blocksparse", "flex", 1.3, 415.0, sparsity=0.9),  # 1.3x
        row("blocksparse", "flex", 9.9, 50.0, sparsity=0.875),  # another row's peer
    ])
    assert not ok
    assert len(lines) == 1
    assert "90.0% of our dense 600.0 (>= 90%: met)" in lines[0]
    assert "1.40x fastvideo-triton (>= 1.5x: missed by 6.7%)" in lines[0]
    assert "1.30x flex (>= 1.3x: met)" in lines[0]


def test_whole_vsa_against_cudnn_and_failed_rows_are_skipped():
    lines, ok = suite_targets.target_lines([
        row("vsa", "vidattn-vsa", 2.0, 5000.0, sparsity=0.9),
        row("vsa", "sdpa-cudnn", 16.0, 600.0, sparsity=0.9),
        row("vsa", "fastvideo-vsa", 3.0, 3300.0, sparsity=0.9),
        row("dense", "vidattn", 1.0, 999.0, status="error"),
        row("dense", "sdpa-cudnn", 10.0, 99.0),
    ])
    assert ok
    assert lines == ["whole VSA S32768k32768 D128 s0.9: 2.000 ms, cuDNN dense 16.000 ms, 8.00x "
                     "(>= 7.5x: met); 1.50x FastVideo's op"]
