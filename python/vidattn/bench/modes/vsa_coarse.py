"""The VSA coarse stage on CUDA op by op (tile, untile, mean pool and its backward, the top-k
selection from pooled tensors and from scores, torch.topk for scale) at Wan2.1-1.3B 480p and
14B 720p, 90% sparsity: one line per op (median ms of the bench's GPU timer; GB/s for the
memory-bound ones).

  python -m vidattn.bench vsa-coarse [--out F.json]"""
from __future__ import annotations

import math

from .common import parser, result_doc, write_json


def main(argv) -> int:
    p = parser("vsa-coarse", __doc__)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    import torch
    import vidattn

    from ..timing import CudaTimer

    ops = torch.ops.vidattn
    timer = CudaTimer()
    g = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for name, grid, heads in (("wan1.3b-480p", (21, 30, 52), 12),
                              ("wan14b-720p", (21, 45, 80), 40)):
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
        moved = x.numel() * x.element_size() + xt.numel() * xt.element_size()
        pooled = xt.numel() * xt.element_size() + qc.numel() * qc.element_size()
        nbytes = {"tile": moved, "untile": moved, "tile_mean_pool": pooled,
                  "tile_mean_pool_backward": pooled}
        for case, fn in cases.items():
            ms = timer.measure(fn).median_ms
            row = dict(shape=name, heads=heads, tiles=t.num_tiles, topk=topk, op=case, ms=ms)
            rate = ""
            if case in nbytes:
                row["gb_per_s"] = nbytes[case] / (ms * 1e-3) / 1e9
                rate = f" {row['gb_per_s']:7.0f} GB/s"
            rows.append(row)
            print(f"{name:14s} H{heads:<3d} tiles {t.num_tiles:5d} topk {topk:4d} {case:30s} "
                  f"{ms * 1e3:9.1f} us{rate}", flush=True)
    if args.out:
        write_json(args.out, result_doc("vsa-coarse", argv, rows=rows))
    return 0
