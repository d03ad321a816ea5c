"""Times the VSA coarse stage on CUDA (tile, pool, top-k selection) at the spec's shapes.
Prints one line per measurement (median ms of triton.testing.do_bench, or CUDA events when
triton is missing); --json writes them to a file."""
import argparse
import json
import math

import torch

import vidattn
from vidattn.bench.timing import CudaTimer

ops = torch.ops.vidattn


def bench(fn):
    """The bench's GPU timer: do_bench's median after its warm-up (GPU_WARMUP_MS, then
    GPU_REP_MS of runs; vidattn.bench.timing), or CUDA events when triton is missing."""
    return CudaTimer().measure(fn).median_ms


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, grid, heads in (("wan1.3b-480p", (21, 30, 52), 12), ("wan14b-720p", (21, 45, 80), 40)):
        t = vidattn.VideoTiling(grid, (4, 4, 4), device="cuda")
        D = 128
        topk = vidattn.topk_from_sparsity(0.9, t.num_tiles)
        x = torch.randn((1, t.num_tokens, heads, D), generator=g, device="cuda").bfloat16()
        xt = t.tile(x)
        qc = vidattn.tile_mean_pool(xt, t.block_sizes, 64)
        kc = torch.randn(qc.shape, generator=g, device="cuda").bfloat16()
        scores = (qc.float().permute(0, 2, 1, 3) @ kc.float().permute(0, 2, 3, 1)) / math.sqrt(D)
        cases = {
            "tile": lambda: t.tile(x),
            "untile": lambda: t.untile(xt),
            "tile_mean_pool": lambda: vidattn.tile_mean_pool(xt, t.block_sizes, 64),
            "tile_mean_pool_backward": lambda: ops.tile_mean_pool_backward(qc, t.block_sizes, 64),
            "select_topk_tiles": lambda: ops.topk_tiles(qc, kc, topk),
            "topk_tiles_from_scores": lambda: ops.topk_tiles_from_scores(scores, topk),
            "torch.topk(scores) for scale": lambda: torch.topk(scores, topk, dim=-1),
        }
        # Bytes each memory-bound op must move at least (read + write), for a GB/s figure.
        nbytes = {
            "tile": x.numel() * x.element_size() + xt.numel() * xt.element_size(),
            "untile": x.numel() * x.element_size() + xt.numel() * xt.element_size(),
            "tile_mean_pool": xt.numel() * xt.element_size() + qc.numel() * qc.element_size(),
            "tile_mean_pool_backward": xt.numel() * xt.element_size() + qc.numel() * qc.element_size(),
        }
        for case, fn in cases.items():
            ms = bench(fn)
            row = dict(shape=name, heads=heads, tiles=t.num_tiles, topk=topk, op=case, ms=ms)
            rate = ""
            if case in nbytes:
                row["gb_per_s"] = nbytes[case] / (ms * 1e-3) / 1e9
                rate = f" {row['gb_per_s']:7.0f} GB/s"
            rows.append(row)
            print(f"{name:14s} H{heads:<3d} tiles {t.num_tiles:5d} topk {topk:4d} {case:30s} {ms * 1e3:9.1f} us"
                  f"{rate}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
