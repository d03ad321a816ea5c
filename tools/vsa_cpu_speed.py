"""CPU speed check: VSA (whole op) at a given sparsity vs dense attention on the same tiled
tensors, and the dense vidattn forward vs torch SDPA. Median of a few runs (forward only).

  PYTHONPATH=python .venv/bin/python tools/vsa_cpu_speed.py --threads 2
"""
import argparse
import statistics
import time

import torch

import vidattn


def median_time(fn, runs):
    fn()  # warm-up
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--grid", type=int, nargs=3, default=(16, 32, 32))
    ap.add_argument("--tile", type=int, nargs=3, default=(4, 4, 4))
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--sparsity", type=float, default=0.9)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--dense-only", action="store_true", help="only vidattn dense vs SDPA")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    g = torch.Generator().manual_seed(0)
    tiling = vidattn.VideoTiling(tuple(args.grid), tuple(args.tile))
    shape = (1, tiling.padded_len, args.heads, args.dim)
    q, k, v = (tiling.tile(torch.randn((1, tiling.num_tokens, args.heads, args.dim), generator=g))
               for _ in range(3))
    with torch.no_grad():
        dense = median_time(lambda: vidattn.attention(q, k, v), args.runs)
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
        sdpa = median_time(lambda: torch.nn.functional.scaled_dot_product_attention(qt, kt, vt),
                           args.runs)
        print(f"S={shape[1]} H={args.heads} D={args.dim} fp32 threads={args.threads}")
        print(f"dense vidattn {dense * 1e3:.1f} ms | torch SDPA {sdpa * 1e3:.1f} ms | "
              f"vidattn/SDPA speed {sdpa / dense:.2f}x")
        if args.dense_only:
            return
        vsa = median_time(lambda: vidattn.video_sparse_attention(
            q, k, v, tiling=tiling, sparsity=args.sparsity), args.runs)
        topk = vidattn.topk_from_sparsity(args.sparsity, tiling.num_tiles)
        print(f"VSA sparsity {args.sparsity} (topk {topk}/{tiling.num_tiles}) {vsa * 1e3:.1f} ms | "
              f"speedup vs dense vidattn {dense / vsa:.2f}x, vs SDPA {sdpa / vsa:.2f}x")


if __name__ == "__main__":
    main()
