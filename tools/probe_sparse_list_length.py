"""How the 64-token block-sparse forward's speed depends on the length of its key-tile lists.

    python3 tools/probe_sparse_list_length.py [--seconds 1.5] [--topk 16,32,...] [--out F.txt]

Runs the 64-token kernel at Wan 480p (1 x 39936 x H12, D128, bf16) on uniform random
ascending lists of k key tiles for a range of k, back to back as power_clocks.py does (SM clock
and board power sampled), then fits the call time, and the SM cycles (time x clock), as
a + b * k and prints a / b in key tiles: what a query tile would cost beside its key tiles if
the cost were linear in k. Then k = 62 (about 90%) on lists drawn from a quarter of the key tiles
(one window for all query tiles, and one around each), the same work over less K / V.
The twenty-sixth session read a (~5 key tiles) as the tiles' start and end and found it was
not (docs/perf-notes.md, "The 64-token kernel's walk, list length and L2 reuse"). Not a test;
a diagnostic.
"""
import argparse
import sys

import torch

import vidattn
from vidattn.bench.blocksparse_case import random_selection

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from power_clocks import measure, tflop_rate, windowed_selection  # noqa: E402
from report_text import emit  # noqa: E402


def fit_line(xs, ys):
    """Least squares y = a + b x; returns (a, b)."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=1.5)
    p.add_argument("--topk", default="16,32,48,62,78,124,248")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    seq, heads, tiles = 39936, 12, 624
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(1, seq, heads, 128, generator=g, device="cuda",
                           dtype=torch.bfloat16) for _ in range(3))
    topks = [int(t) for t in args.topk.split(",")]

    def run(index, count):
        return lambda: vidattn.block_sparse_attention(q, k, v, index, count, tile_volume=64,
                                                      validate_index=False)

    def rate(topk):
        return tflop_rate(4 * heads * seq * topk * 64 * 128)

    work = [(f"480p k={topk}", run(*random_selection(1, heads, tiles, tiles, topk, g, "cuda")),
             rate(topk)) for topk in topks]
    for local in (False, True):
        name = ("480p k=62, windows of 156 around each" if local
                else "480p k=62, one window of 156")
        work.append((name, run(*windowed_selection(heads, tiles, 62, tiles // 4, g, local)),
                     rate(62)))
    medians = []
    lines = measure(work, args.seconds, "probe_sparse_list_length", medians)
    ms_list = [ms for ms, _ in medians[:len(topks)]]
    cyc = [ms * mhz if mhz else None for ms, mhz in medians[:len(topks)]]
    device = torch.cuda.get_device_properties(torch.cuda.current_device())
    streams = 2 * device.multi_processor_count  # the kernel's streams: two per SM
    items_per_stream = heads * tiles / streams
    a, b = fit_line(topks, ms_list)
    lines.append(f"== fit of call time over k: {a:.4f} ms + {b * 1e3:.3f} us x k; per query tile "
                 f"{a / items_per_stream * 1e3:.2f} us + {b / items_per_stream * 1e6:.1f} ns "
                 f"x k; a / b = {a / b:.1f} key tiles")
    if all(c is not None for c in cyc):
        a2, b2 = fit_line(topks, cyc)
        lines.append(f"== fit of SM cycles (ms x MHz) over k: a / b = {a2 / b2:.1f} key tiles")
    for x, y in zip(topks, ms_list):
        lines.append(f"   k={x:4d}: {y:.4f} ms measured, {a + b * x:.4f} fitted")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
