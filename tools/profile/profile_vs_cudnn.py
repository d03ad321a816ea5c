"""One forward launch of ours and one of cuDNN's (PyTorch SDPA) per shape, inside a profiler
range, so Nsight Compute can set the two kernel designs side by side (grid, block, cluster,
registers, shared memory, duration, throughputs):

    ncu --profile-from-start off --section LaunchStats --section SpeedOfLight \
        --section Occupancy -o cmp python3 tools/profile/profile_vs_cudnn.py 1,32760:128,12,128 ...
    ncu --import cmp.ncu-rep --page details --csv > cmp.csv

Shapes as `python -m vidattn.bench dense` takes them: B,S,H,D[,causal] with S a length or Sq:Sk.
Not a test and not a benchmark: each kernel runs once after a warm-up."""
import argparse

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import vidattn
from vidattn.bench.modes.common import parse_shape


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="+", type=parse_shape,
                    help="B,S,H,D[,causal] (S: a length or Sq:Sk)")
    args = ap.parse_args()
    g = torch.Generator(device="cuda").manual_seed(0)
    for B, Sq, H, D, causal, Sk in args.shapes:

        def randn(*shape):
            return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

        q, k, v = randn(B, Sq, H, D), randn(B, Sk, H, D), randn(B, Sk, H, D)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def run():
            vidattn.attention(q, k, v, causal=causal)
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                sdpa(qt, kt, vt, is_causal=causal)

        for _ in range(3):
            run()
        torch.cuda.synchronize()
        torch.cuda.profiler.start()
        torch.cuda.nvtx.range_push(f"{B},{Sq}:{Sk},{H},{D}{',causal' if causal else ''}")
        run()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        torch.cuda.profiler.stop()


if __name__ == "__main__":
    main()
