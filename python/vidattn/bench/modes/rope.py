"""Speed of vidattn.apply_rope on one GPU at the sequence-parallel layer's shapes: Wan2.1-14B
720p (75,600 tokens, H40, D128, bf16, [S, D/2] float32 tables, interleaved and NeoX pairs),
the whole tensor and the pipeline's packing view (one rank's shard, one head chunk of each
destination rank: [2, 37,800, 10, 128] strided). Median of 50 CUDA-event timings; GB/s counts
x read once and out written once (the tables are extra).

  python -m vidattn.bench rope [--out F.json]"""
from __future__ import annotations

from .common import parser, result_doc, write_json


def main(argv) -> int:
    p = parser("rope", __doc__)
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    import torch
    import vidattn

    from ..timing import CudaTimer

    g = torch.Generator(device="cuda").manual_seed(0)
    s, h, d = 75600, 40, 128
    theta = torch.rand(s, d // 2, device="cuda", generator=g)
    cos, sin = theta.cos(), theta.sin()
    x = torch.randn(1, s, h, d, device="cuda", generator=g).to(torch.bfloat16)
    shard = x[:, : s // 2]  # one rank's rows, all heads
    # [destination rank, S_local, head chunk, D]: rank j's heads 0..9 of its 20.
    packing = shard.reshape(s // 2, 2, h // 2, d)[:, :, :10].permute(1, 0, 2, 3)
    timer = CudaTimer(warmup=5, repeats=50)
    rows = []
    for name, view, c, sn in (("whole [1, 75600, 40, 128]", x, cos, sin),
                              ("packing view [2, 37800, 10, 128]", packing,
                               cos[: s // 2], sin[: s // 2])):
        for interleaved in (True, False):
            ms = timer.measure(
                lambda: vidattn.apply_rope(view, c, sn, interleaved=interleaved)).median_ms
            gbs = 2 * view.numel() * view.element_size() / ms / 1e6
            rows.append({"case": name, "interleaved": interleaved, "ms": ms, "GB/s": gbs})
            print(f"{name:34s} interleaved={interleaved!s:5s} {ms:7.3f} ms {gbs:7.0f} GB/s",
                  flush=True)
    if args.out:
        write_json(args.out, result_doc("rope", argv, rows=rows))
    return 0
