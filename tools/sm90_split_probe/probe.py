"""Times the 64-token block-sparse forward on the bench's uniform random selections, and
optionally dense attention (vidattn and cuDNN) on the same tensors (README.md here).

    python3 tools/sm90_split_probe/probe.py [--shapes 480p,720p] [--sparsity 0.9]
        [--margins 0,66] [--tile 64] [--dense]

CUDA events around each call, median of --reps after 3 warm-up calls (the bench's CudaTimer
with a repeat count: no L2 flush, so not the bench's numbers; compare libraries within one
run). Per row: time, TFLOP/s with the bench's FLOP count, and the K / V bytes the kernel
moves from L2 per second (128-key blocks of two tiles, an odd list's last tile loaded
twice). --margins: sm_margin values (SMs left idle).
--tile: 64, 128 or 256 tokens per tile (the probe patch changes the 64-token kernel only).
"""
import argparse

import torch
import torch.nn.functional as F

import vidattn
from vidattn.bench.blocksparse_case import random_selection
from vidattn.bench.timing import CudaTimer
from vidattn.vsa import topk_from_sparsity

SHAPES = {"480p": (39936, 12), "720p": (92160, 40), "hunyuan": (115200, 24)}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--shapes", default="480p")
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--margins", default="0")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--tile", type=int, default=64, choices=(64, 128, 256))
    p.add_argument("--dense", action="store_true")
    args = p.parse_args()
    sparse_timer, dense_timer = CudaTimer(3, args.reps), CudaTimer(3, 5)
    for name in args.shapes.split(","):
        seq, heads = SHAPES[name]
        tiles = seq // args.tile
        topk = topk_from_sparsity(args.sparsity, tiles)
        g = torch.Generator(device="cuda").manual_seed(1)
        q, k, v = (torch.randn(1, seq, heads, 128, device="cuda", dtype=torch.bfloat16,
                               generator=g) for _ in range(3))
        index, count = random_selection(1, heads, tiles, tiles, topk, g, "cuda")
        flops = 4 * heads * seq * topk * args.tile * 128
        # Bytes of K and V moved per (head, query tile): 64-token tiles in 128-key blocks of
        # two (an odd list's last tile twice), larger tiles whole.
        keys = (topk + 1) // 2 * 128 if args.tile == 64 else topk * args.tile
        kv_bytes = heads * tiles * keys * 2 * (128 * 2)
        for margin in (int(m) for m in args.margins.split(",")):
            ms = sparse_timer.measure(lambda: vidattn.block_sparse_attention(
                q, k, v, index, count, tile_volume=args.tile, validate_index=False,
                sm_margin=margin)).median_ms
            print(f"{name} tile {args.tile} sparsity {args.sparsity} topk {topk} "
                  f"sm_margin {margin}: {ms:.3f} ms"
                  f"  {flops / ms / 1e9:.1f} TFLOP/s  K/V {kv_bytes / ms / 1e9:.2f} TB/s",
                  flush=True)
        if args.dense:
            dense_flops = 4 * heads * seq * seq * 128
            ms = dense_timer.measure(lambda: vidattn.attention(q, k, v)).median_ms
            print(f"{name} dense vidattn: {ms:.3f} ms  {dense_flops / ms / 1e9:.1f} TFLOP/s",
                  flush=True)
            qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
            with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
                ms = dense_timer.measure(
                    lambda: F.scaled_dot_product_attention(qt, kt, vt)).median_ms
            print(f"{name} dense cudnn: {ms:.3f} ms  {dense_flops / ms / 1e9:.1f} TFLOP/s",
                  flush=True)


if __name__ == "__main__":
    main()
