"""Probe (not a test): what a partial last key block costs the dense sm_90a forward. Times, on
1 x Sq x H x 128 queries over Sk keys:
  * dense: vidattn.attention, the last block's TMA box reaching past the tensor's end;
  * varlen, box in bounds: the same problem as sequence 0 of attention_varlen, followed by a
    short sequence whose keys fill the rest of that box (its cost is a 64-row tile);
  * full: Sk rounded up to whole 128-key blocks (the work the partial problem issues).
  python3 tools/probe_partial_block.py [Sq,H,Sk ...]"""
import sys

import torch

import vidattn
from vidattn.bench.timing import gpu_median_ms


def main(specs):
    for spec in specs:
        Sq, H, Sk = (int(x) for x in spec.split(","))
        full = (Sk + 127) // 128 * 128
        g = torch.Generator(device="cuda").manual_seed(0)
        mk = lambda rows: torch.randn(rows, H, 128, generator=g, device="cuda",
                                      dtype=torch.bfloat16)
        q, k, v = mk(Sq + 64), mk(full), mk(full)
        cu_q = torch.tensor([0, Sq, Sq + 64], device="cuda", dtype=torch.int32)
        cu_k = torch.tensor([0, Sk, full], device="cuda", dtype=torch.int32)
        qd, kd, vd = q[None, :Sq], k[None, :Sk].contiguous(), v[None, :Sk].contiguous()
        kf, vf = k[None], v[None]
        t_dense = gpu_median_ms(lambda: vidattn.attention(qd, kd, vd))
        max_k = max(Sk, full - Sk)
        t_varlen = gpu_median_ms(lambda: vidattn.attention_varlen(q, k, v, cu_q, cu_k, Sq, max_k))
        t_full = gpu_median_ms(lambda: vidattn.attention(qd, kf, vf))
        ref = vidattn.attention(qd, kd, vd)[0]
        got = vidattn.attention_varlen(q, k, v, cu_q, cu_k, Sq, max_k)[:Sq]
        diff = (ref.float() - got.float()).abs().max().item()
        print(f"Sq {Sq} H {H} Sk {Sk}: dense {t_dense * 1e3:7.1f} us, varlen in bounds "
              f"{t_varlen * 1e3:7.1f} us, {full} keys {t_full * 1e3:7.1f} us "
              f"(max |diff| dense vs varlen {diff:.2e})", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["32768,12,257", "32768,12,320", "32768,12,385", "32768,12,2049",
                          "32768,12,4033"])
