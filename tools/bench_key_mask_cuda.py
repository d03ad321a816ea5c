"""Dense forward with key padding masks against the same problem unmasked (on sm_90a: the
key-mask kernel instance against the unmasked one), median of triton.testing.do_bench:
  * the Wan 480p tiled tensors with the tiling's slot mask on keys and queries (what the VSA
    bench's vidattn-dense row runs);
  * 2 x 16384 keys with padded suffixes (15000 and 12001 keys kept).
TFLOP/s count every slot, so masked and unmasked rows compare directly.
    python3 tools/bench_key_mask_cuda.py"""
import torch
import triton.testing

import vidattn


def main():
    g = torch.Generator(device="cuda")
    g.manual_seed(0)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)

    tiling = vidattn.VideoTiling(grid=(21, 30, 52), tile=(4, 4, 4), device="cuda")
    S, H, D = tiling.padded_len, 12, 128
    q, k, v = rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, H, D)
    slots = tiling.slot_valid.view(1, -1)
    cases = [("480p slot mask", 4 * H * S * S * D, lambda: vidattn.attention(
                  q, k, v, key_padding_mask=slots, query_padding_mask=slots)),
             ("480p unmasked", 4 * H * S * S * D, lambda: vidattn.attention(q, k, v))]

    B, S2, H2 = 2, 16384, 16
    q2, k2, v2 = rnd(B, S2, H2, D), rnd(B, S2, H2, D), rnd(B, S2, H2, D)
    suffix = torch.zeros(B, S2, dtype=torch.bool, device="cuda")
    suffix[0, :15000] = True
    suffix[1, :12001] = True
    flops = 4 * B * H2 * S2 * S2 * D
    cases += [("2x16384 suffix-padded keys", flops,
               lambda: vidattn.attention(q2, k2, v2, key_padding_mask=suffix)),
              ("2x16384 unmasked", flops, lambda: vidattn.attention(q2, k2, v2))]

    for name, flops, run in cases:
        ms = triton.testing.do_bench(run, return_mode="median")
        print(f"{name:28} {ms:8.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s", flush=True)


if __name__ == "__main__":
    main()
