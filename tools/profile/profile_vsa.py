"""Where the time of one whole VSA forward goes: a torch.profiler table of its kernels.

    python3 tools/profile/profile_vsa.py [--grid 21x30x52] [--tile 4x4x4] [--heads 12]
        [--sparsity 0.9] [--out F.txt]

Default: Wan2.1-1.3B 480p (21x30x52 latent grid, 4x4x4 tiles, H12, D128, bf16, with a
gate), the shape where the whole op is furthest from its 7.5x-over-cuDNN target.
Prints CUDA time per kernel summed over --iters forwards (after a warm-up), the share of
each, and cuDNN's dense forward on the same tiled tensors for scale. Not a benchmark (the
profiler adds overhead between kernels); use `python -m vidattn.bench` for the ratios.
"""
import argparse

import torch
import torch.nn.functional as F
from torch.profiler import ProfilerActivity, profile

import vidattn

from vidattn.bench.modes.common import emit


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--grid", default="21x30x52")
    p.add_argument("--tile", default="4x4x4", help="tile shape (volume 64, 128 or 256)")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    grid = tuple(int(x) for x in args.grid.split("x"))
    tile = tuple(int(x) for x in args.tile.split("x"))
    tiling = vidattn.VideoTiling(grid=grid, tile=tile, device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    shape = (1, tiling.num_tokens, args.heads, 128)
    q, k, v, gate = (tiling.tile(randn(*shape)) for _ in range(4))

    def vsa():
        return vidattn.video_sparse_attention(q, k, v, tiling=tiling, sparsity=args.sparsity,
                                              gate=gate)

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)))

    with torch.no_grad():
        for _ in range(3):
            vsa(), cudnn()
        torch.cuda.synchronize()
        lines = []
        for name, fn in (("vsa", vsa), ("cudnn dense", cudnn)):
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(args.iters):
                    fn()
                torch.cuda.synchronize()
            events = [e for e in prof.key_averages() if e.device_time_total > 0]
            total = sum(e.device_time_total for e in events)
            lines.append(f"== {name}: {total / args.iters / 1e3:.3f} ms of kernels per forward "
                         f"({args.grid}, tile {args.tile}, H{args.heads}, "
                         f"sparsity {args.sparsity})")
            for e in sorted(events, key=lambda e: -e.device_time_total):
                lines.append(f"  {e.device_time_total / args.iters / 1e3:8.3f} ms "
                             f"{100 * e.device_time_total / total:5.1f}%  x{e.count // args.iters}"
                             f"  {e.key[:110]}")
    emit(lines, args.out)


if __name__ == "__main__":
    main()
