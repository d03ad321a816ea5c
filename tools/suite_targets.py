"""The Hopper forward issue's targets, read from a GPU runner's suite JSON
(`python -m vidattn.bench --shapes gpu-suite --directions fwd`): one line per row, ours against
the peer in the same run (median), and whether the target holds.

  python3 tools/suite_targets.py bench/results/NVIDIA-H200-gpu-suite-fwd-<date>-<commit>.json
"""
import json
import sys

# The bounds: dense self attention ours / cuDNN (D = 128 at S >= 16K, non-causal);
# block-sparse against our dense rate on the same shape and against the peers; the whole VSA
# forward against cuDNN's dense attention on the same tensors.
DENSE_TARGET = {128: 1.10, 64: 1.00}
SPARSE_OF_DENSE = 0.90
SPARSE_PEERS = {"fastvideo-triton": 1.5, "flex": 1.3}
VSA_SPEEDUP = 7.5


def key(row):
    s = row["shape"]
    return (s["batch"], s["heads"], s["q_len"], s["kv_len"], s["head_dim"], s["causal"])


def target_lines(rows):
    """The report's lines for a suite's rows, and whether every target holds."""
    rows = [r for r in rows if r.get("status") == "ok"]
    lines = []
    by = {(r["case"], r["impl"], key(r), r["shape"].get("sparsity")): r for r in rows}
    ok = True

    def verdict(value, bound):
        nonlocal ok
        ok &= value >= bound
        return "met" if value >= bound else f"missed by {100 * (1 - value / bound):.1f}%"

    dense_rate = {}
    for (case, impl, k, _), r in by.items():
        if case != "dense" or impl != "vidattn":
            continue
        dense_rate[k] = r["tflops"]
        peer = by.get(("dense", "sdpa-cudnn", k, None))
        d = r["shape"]["head_dim"]
        if peer is None or r["shape"]["causal"]:
            continue
        ratio = peer["median_ms"] / r["median_ms"]
        shape = r["shape"]
        if shape["kv_len"] != shape["q_len"] or (d == 128 and shape["q_len"] < 16384):
            # Cross attention and short sequences: measured, outside the targets.
            lines.append(f"dense {r['shape_label']}: {r['tflops']:.1f} vs cuDNN "
                         f"{peer['tflops']:.1f} TFLOP/s, {ratio:.3f}x (no target)")
            continue
        lines.append(f"dense {r['shape_label']}: {r['tflops']:.1f} vs cuDNN {peer['tflops']:.1f} "
                     f"TFLOP/s, {ratio:.3f}x (>= {DENSE_TARGET[d]:.2f}x: "
                     f"{verdict(ratio, DENSE_TARGET[d])})")
    for (case, impl, k, sp), r in by.items():
        if case != "blocksparse" or impl != "vidattn":
            continue
        line = f"block-sparse {r['shape_label']}: {r['tflops']:.1f} TFLOP/s"
        if k in dense_rate:
            frac = r["tflops"] / dense_rate[k]
            line += (f", {100 * frac:.1f}% of our dense {dense_rate[k]:.1f} "
                     f"(>= 90%: {verdict(frac, SPARSE_OF_DENSE)})")
        for peer_impl, bound in SPARSE_PEERS.items():
            peer = by.get(("blocksparse", peer_impl, k, sp))
            if peer is not None:
                ratio = peer["median_ms"] / r["median_ms"]
                line += f"; {ratio:.2f}x {peer_impl} (>= {bound}x: {verdict(ratio, bound)})"
        lines.append(line)
    for (case, impl, k, sp), r in by.items():
        if case != "vsa" or impl != "vidattn-vsa":
            continue
        peer = by.get(("vsa", "sdpa-cudnn", k, sp))
        fv = by.get(("vsa", "fastvideo-vsa", k, sp))
        if peer is None:
            continue
        speedup = peer["median_ms"] / r["median_ms"]
        line = (f"whole VSA {r['shape_label']}: {r['median_ms']:.3f} ms, cuDNN dense "
                f"{peer['median_ms']:.3f} ms, {speedup:.2f}x (>= {VSA_SPEEDUP}x: "
                f"{verdict(speedup, VSA_SPEEDUP)})")
        if fv is not None:
            line += f"; {fv['median_ms'] / r['median_ms']:.2f}x FastVideo's op"
        lines.append(line)
    return lines, ok


def main(path):
    lines, ok = target_lines(json.load(open(path))["rows"])
    print("\n".join(lines))
    print("all targets met" if ok else "some targets missed")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
