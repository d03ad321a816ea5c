"""Probe (not a test): would cross attention to a short key sequence run faster on the 64-token
block-sparse kernel's two independent 64-row streams than on the dense kernel's one 128-row
stream? Times, on the same tensors, vidattn.attention (dense kernel), block_sparse_attention
with every key tile selected (the 64-token kernel walking all of them) and cuDNN; prints
TFLOP/s of each and the largest difference between the two outputs.

  python3 tools/probe_cross_streams.py [B,Sq,H,D,Sk ...]   (Sq a multiple of 64)"""
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import vidattn
from vidattn.bench.timing import gpu_median_ms

SHAPES = ["1,32768,12,128,512", "1,32768,12,128,257", "1,75648,40,128,512",
          "1,75648,40,128,257", "1,32768,12,128,2048", "1,32768,12,128,4096"]


def main(specs):
    ops = torch.ops.vidattn
    for spec in specs:
        B, Sq, H, D, Sk = (int(x) for x in spec.split(","))
        tiles_k = (Sk + 63) // 64
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(B, Sq, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
        kp, vp = (torch.randn(B, tiles_k * 64, H, D, generator=g, device="cuda",
                              dtype=torch.bfloat16) for _ in range(2))
        k, v = kp[:, :Sk], vp[:, :Sk]
        idx = torch.arange(tiles_k, device="cuda", dtype=torch.int32).expand(
            B, H, Sq // 64, tiles_k).contiguous()
        cnt = torch.full((B, H, Sq // 64), tiles_k, device="cuda", dtype=torch.int32)
        sizes = torch.full((tiles_k,), 64, device="cuda", dtype=torch.int32)
        sizes[-1] = Sk - 64 * (tiles_k - 1)

        def sparse():
            return ops.block_sparse_attention(q, kp, vp, idx, cnt, tile_volume=64,
                                              kv_block_sizes=sizes, validate_index=False)[0]

        dense_out = vidattn.attention(q, k, v)
        diff = (sparse().float() - dense_out.float()).abs().max().item()
        flops = 4 * B * H * Sq * Sk * D
        t_dense = gpu_median_ms(lambda: vidattn.attention(q, k, v))
        t_sparse = gpu_median_ms(sparse)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            t_cudnn = gpu_median_ms(lambda: sdpa(qt, kt, vt))
        rate = lambda ms: flops / (ms * 1e-3) / 1e12
        print(f"{spec}: dense kernel {rate(t_dense):6.1f}  64-token streams {rate(t_sparse):6.1f}"
              f"  cuDNN {rate(t_cudnn):6.1f} TFLOP/s  (max |diff| {diff:.2e})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or SHAPES)
