"""Digests (SHA-256 of the bytes) of the VSA forward's output and of the block-sparse op's output
and LSE on seeded inputs: run it under two op libraries and compare the lines for bit identity
(a change meant to leave the results alone, where the kernels' SASS did change).

    python3 tools/gpu/vsa_digest.py [--grid 21x30x52] [--heads 12]
    NEW=new.so OLD=old.so STAGES=cmd AB_CMD="python3 tools/gpu/vsa_digest.py" ROUNDS=1 \
        bash tools/gpu/lib_ab.sh
"""
import argparse
import hashlib

import torch

import vidattn


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().cpu().view(torch.uint8).numpy()).hexdigest()[:16]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--grid", default="21x30x52")
    p.add_argument("--heads", type=int, default=12)
    args = p.parse_args()
    grid = tuple(int(x) for x in args.grid.split("x"))
    g = torch.Generator(device="cuda").manual_seed(0)
    for tile in ((4, 4, 4), (4, 4, 8)):
        tiling = vidattn.VideoTiling(grid=grid, tile=tile, device="cuda")
        shape = (1, tiling.num_tokens, args.heads, 128)
        q, k, v, gate = (tiling.tile(torch.randn(*shape, generator=g, device="cuda",
                                                 dtype=torch.bfloat16)) for _ in range(4))
        with torch.no_grad():
            out, (index, count) = vidattn.video_sparse_attention(
                q, k, v, tiling=tiling, sparsity=0.9, gate=gate, return_selection=True)
            fine, lse = vidattn.block_sparse_attention(
                q, k, v, index, count, tile_volume=tiling.tile_volume,
                q_block_sizes=tiling.block_sizes, kv_block_sizes=tiling.block_sizes,
                return_lse=True)
        print(f"{args.grid} H{args.heads} tile {tile}: vsa {digest(out)} fine {digest(fine)} "
              f"lse {digest(lse)}")


if __name__ == "__main__":
    main()
