"""The Hopper forward targets, read from a suite JSON (`python -m vidattn.bench --shapes
gpu-suite --directions fwd`): one line per row, ours against the peer in the same run (median),
and whether the target holds.

  python -m vidattn.bench targets bench/results/NVIDIA-H200/gpu-suite-fwd.json
"""
from __future__ import annotations

import json

from .common import parser

# The bounds: dense self attention ours / cuDNN (D = 128 at S >= 16K, non-causal);
# block-sparse against our dense rate on the same shape and against the peers; the whole VSA
# forward against cuDNN's dense attention on the same tensors.
DENSE_TARGET = {128: 1.10, 64: 1.00}
SPARSE_OF_DENSE = 0.90
SPARSE_PEERS = {"fastvideo-triton": 1.5, "flex": 1.3}
VSA_SPEEDUP = 7.5


def key(row):
    """A dense row's problem, to find the block-sparse rows' own dense rate."""
    s = row["shape"]
    return (row.get("dtype"), s["batch"], s["heads"], s["q_len"], s["kv_len"], s["head_dim"],
            s["causal"])


def target_lines(rows):
    """The report's lines for a suite's rows, and whether every target holds. The ratios are
    the runner's own (``ratios_to_peers``: the peer's median time over ours, same group)."""
    ours = [r for r in rows if r.get("status") == "ok" and r.get("is_ours")]
    dense_rate = {key(r): r["tflops"] for r in ours if r["case"] == "dense"}
    lines = []
    ok = True

    def verdict(value, bound):
        nonlocal ok
        ok &= value >= bound
        return "met" if value >= bound else f"missed by {100 * (1 - value / bound):.1f}%"

    for r in ours:
        shape, peers = r["shape"], r.get("ratios_to_peers") or {}
        if r["case"] == "dense":
            ratio = peers.get("sdpa-cudnn")
            if ratio is None or shape["causal"]:
                continue
            d = shape["head_dim"]
            head = (f"dense {r['shape_label']}: {r['tflops']:.1f} vs cuDNN "
                    f"{r['tflops'] / ratio:.1f} TFLOP/s, {ratio:.3f}x")
            if shape["kv_len"] != shape["q_len"] or (d == 128 and shape["q_len"] < 16384):
                # Cross attention and short sequences: measured, outside the targets.
                lines.append(f"{head} (no target)")
            else:
                lines.append(f"{head} (>= {DENSE_TARGET[d]:.2f}x: "
                             f"{verdict(ratio, DENSE_TARGET[d])})")
        elif r["case"] == "blocksparse":
            line = f"block-sparse {r['shape_label']}: {r['tflops']:.1f} TFLOP/s"
            dense = dense_rate.get(key(r))
            if dense is not None:
                frac = r["tflops"] / dense
                line += (f", {100 * frac:.1f}% of our dense {dense:.1f} "
                         f"(>= {100 * SPARSE_OF_DENSE:.0f}%: {verdict(frac, SPARSE_OF_DENSE)})")
            for peer, bound in SPARSE_PEERS.items():
                if peer in peers:
                    line += (f"; {peers[peer]:.2f}x {peer} (>= {bound}x: "
                             f"{verdict(peers[peer], bound)})")
            lines.append(line)
        elif r["case"] == "vsa" and "sdpa-cudnn" in peers:
            speedup = peers["sdpa-cudnn"]
            line = (f"whole VSA {r['shape_label']}: {r['median_ms']:.3f} ms, cuDNN dense "
                    f"{r['median_ms'] * speedup:.3f} ms, {speedup:.2f}x (>= {VSA_SPEEDUP}x: "
                    f"{verdict(speedup, VSA_SPEEDUP)})")
            if "fastvideo-vsa" in peers:
                line += f"; {peers['fastvideo-vsa']:.2f}x FastVideo's op"
            lines.append(line)
    return lines, ok


def main(argv) -> int:
    p = parser("targets", __doc__)
    p.add_argument("json", help="a suite JSON of python -m vidattn.bench")
    args = p.parse_args(argv)
    with open(args.json) as f:
        lines, ok = target_lines(json.load(f)["rows"])
    print("\n".join(lines))
    print("all targets met" if ok else "some targets missed")
    return 0
