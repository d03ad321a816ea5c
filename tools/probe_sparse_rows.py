"""The gpu-suite's 64-token block-sparse rows, ours only, by the bench's timer: one line per
row, labelled with PROBE_LABEL (the sm_90a measuring switches are read once per process, so
tools/sparse_setting_ab_device_run.sh runs one process per setting).

    PROBE_LABEL=spread4 VIDATTN_SM90_WALK_SPREAD=4 python3 tools/probe_sparse_rows.py

Uniform random ascending lists (the bench's selection, seeded), bf16, D128. Not a test.
"""
import os

import torch

import vidattn
from vidattn.bench.blocksparse_case import blocksparse_case, random_selection, topk_of
from vidattn.bench.shapes import PRESETS
from vidattn.bench.timing import gpu_median_ms


def main() -> None:
    label = os.environ.get("PROBE_LABEL", "default")
    g = torch.Generator(device="cuda").manual_seed(0)
    case = blocksparse_case(torch.device("cuda"))
    for shape in PRESETS["gpu-suite"].shapes:
        if shape.kind != "blocksparse":
            continue
        tiles = shape.q_len // 64
        q, k, v = (torch.randn(shape.batch, shape.q_len, shape.heads, shape.head_dim,
                               generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        index, count = random_selection(shape.batch, shape.heads, tiles, tiles, topk_of(shape),
                                        g, "cuda")
        ms = gpu_median_ms(lambda: vidattn.block_sparse_attention(
            q, k, v, index, count, tile_volume=64, validate_index=False))
        print(f"setting {label}: {shape.label}: {ms:.3f} ms "
              f"{case.forward_flops(shape) / ms / 1e9:.1f} TFLOP/s", flush=True)
        del q, k, v, index, count


if __name__ == "__main__":
    main()
