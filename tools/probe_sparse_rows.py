"""The gpu-suite's 64-token block-sparse rows, ours only, by the bench's timer: one line per
row, labelled with PROBE_LABEL (the sm_90a measuring switches are read once per process, so
tools/sparse_setting_ab_device_run.sh runs one process per setting).

    PROBE_LABEL=spread4 VIDATTN_SM90_WALK_SPREAD=4 python3 tools/probe_sparse_rows.py

Uniform random ascending lists (the bench's selection, seeded), bf16, D128. Not a test.
"""
import os

import torch

import vidattn
from vidattn.bench.blocksparse_case import random_selection
from vidattn.bench.timing import gpu_median_ms
from vidattn.vsa import topk_from_sparsity

ROWS = [  # (name, tokens, heads, sparsity): the gpu-suite's block-sparse rows
    ("480p", 39936, 12, 0.875), ("480p", 39936, 12, 0.9), ("720p", 92160, 40, 0.875),
    ("720p", 92160, 40, 0.9), ("hunyuan", 115200, 24, 0.9), ("32K", 32768, 12, 0.875)]


def main() -> None:
    label = os.environ.get("PROBE_LABEL", "default")
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, seq, heads, sparsity in ROWS:
        tiles = seq // 64
        topk = topk_from_sparsity(sparsity, tiles)
        q, k, v = (torch.randn(1, seq, heads, 128, generator=g, device="cuda",
                               dtype=torch.bfloat16) for _ in range(3))
        index, count = random_selection(1, heads, tiles, tiles, topk, g, "cuda")
        ms = gpu_median_ms(lambda: vidattn.block_sparse_attention(
            q, k, v, index, count, tile_volume=64, validate_index=False))
        flops = 4 * heads * seq * topk * 64 * 128
        print(f"setting {label}: {name} {sparsity}: {ms:.3f} ms {flops / ms / 1e9:.1f} TFLOP/s",
              flush=True)
        del q, k, v, index, count


if __name__ == "__main__":
    main()
