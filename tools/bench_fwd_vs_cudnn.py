"""Dense forward of vidattn against cuDNN SDPA in the same process, median of
triton.testing.do_bench, TFLOP/s and ratio per shape; one JSON line per shape on stdout.
Kernel switches (environment variables read once per process) are compared by running this
script once per setting, alternating: tools/sm90_ab.sh does that for bench_dense_cuda.py.
  python3 tools/bench_fwd_vs_cudnn.py [B,S,H,D[,causal] ...]
BENCH_REQUIRES_GRAD=1: q, k, v are leaves that require grad (the autograd path, as in
`python -m vidattn.bench`)."""
import os
import json
import sys

import torch
import triton.testing
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import vidattn

DEFAULT = ["2,16384,32,64", "1,32768,16,64", "4,8192,16,64", "1,32768,12,128",
           "1,39936,12,128", "1,16384,12,128,causal"]


def main(specs):
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    for spec in specs or DEFAULT:
        parts = spec.split(",")
        B, S, H, D = (int(x) for x in parts[:4])
        causal = len(parts) > 4 and parts[4] == "causal"
        q, k, v = (torch.randn((B, S, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
                   .requires_grad_(os.environ.get("BENCH_REQUIRES_GRAD") == "1")
                   for _ in range(3))
        flops = 4 * B * H * S * S * D / (2 if causal else 1)
        ours = triton.testing.do_bench(lambda: vidattn.attention(q, k, v, causal=causal),
                                       return_mode="median")
        qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = triton.testing.do_bench(lambda: sdpa(qt, kt, vt, is_causal=causal),
                                            return_mode="median")
        row = {"shape": [B, S, H, D], "causal": causal,
               "vidattn_tflops": round(flops / ours / 1e9, 1),
               "cudnn_tflops": round(flops / cudnn / 1e9, 1),
               "ratio": round(cudnn / ours, 4)}
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
