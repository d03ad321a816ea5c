"""One launch of each sm_90a forward kernel inside a profiler range, for Nsight Compute:

    ncu --profile-from-start off --set full -o sm90 python3 tools/profile/profile_sm90.py

Dense: B1 H12 S32768 D128 bf16 (the issue's dense shape). Block-sparse: Wan2.1-1.3B 480p
(624 tiles of 64 tokens, H12, D128, 90% sparse -> 63 key tiles per query tile, a seeded
uniform random selection as in the benchmark). Not a test and not a benchmark: it only runs
the kernels once each (after a warm-up) so the profiler sees a steady state.
`--dense B,S,H,D` changes the dense shape (e.g. 2,16384,32,64; S may be Sq:Sk, e.g.
1,32760:512,12,128 for Wan 480p's text cross attention); `--dense-only` skips the block-sparse
launch, `--sparse-only` the dense one, `--sparse-shape tokens,heads` sets the block-sparse
shape (e.g. 92160,40 for Wan 720p); `--sparse-window F` adds a block-sparse launch whose
lists are drawn from the first F of the key tiles (the same work over less K / V: what L2
reuse is worth, docs/perf-notes.md)."""
import argparse

import torch

import vidattn
from vidattn.bench.blocksparse_case import random_selection
from vidattn.vsa import topk_from_sparsity


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dense", default="1,32768,12,128", help="B,S,H,D of the dense launch")
    ap.add_argument("--dense-only", action="store_true")
    ap.add_argument("--sparse-only", action="store_true")
    ap.add_argument("--sparse-window", type=float, default=None)
    ap.add_argument("--sparse-shape", default="39936,12",
                    help="tokens,heads of the block-sparse launches (64-token tiles, 90%%)")
    args = ap.parse_args()
    b, s, h, d = args.dense.split(",")
    B, H, D = int(b), int(h), int(d)
    S, Sk = int(s.split(":")[0]), int(s.split(":")[-1])
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    q, k, v = randn(B, S, H, D), randn(B, Sk, H, D), randn(B, Sk, H, D)
    tokens, heads = (int(x) for x in args.sparse_shape.split(","))
    tiles = tokens // 64
    topk = topk_from_sparsity(0.9, tiles)  # 63 of Wan 480p's 624 tiles
    qs, ks, vs = (randn(1, tiles * 64, heads, 128) for _ in range(3))
    idx, cnt = random_selection(1, heads, tiles, tiles, topk, g, "cuda")
    windowed = None
    if args.sparse_window is not None:
        window = max(topk, int(args.sparse_window * tiles))
        windowed, _ = random_selection(1, heads, tiles, window, topk, g, "cuda")
    ops = torch.ops.vidattn

    def run():
        if not args.sparse_only:
            vidattn.attention(q, k, v)
        if not args.dense_only:
            ops.block_sparse_attention(qs, ks, vs, idx, cnt, tile_volume=64,
                                       validate_index=False)
            if windowed is not None:
                ops.block_sparse_attention(qs, ks, vs, windowed, cnt, tile_volume=64,
                                           validate_index=False)

    for _ in range(3):
        run()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    run()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
