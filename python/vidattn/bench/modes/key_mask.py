"""Dense forward with padding masks against the same problem unmasked and against cuDNN
(PyTorch SDPA, unmasked, on contiguous [B, H, S, D] copies made once), each the median of
gpu_median_ms:
  * the Wan 480p and 720p tiled tensors with the tiling's slot mask on keys and queries (what
    the VSA case's vidattn-dense row runs), and on keys only;
  * 2 x 16384 keys with padded suffixes (15000 and 12001 keys kept).
On sm_90a the non-causal masked rows run packed as varlen. TFLOP/s count every slot, so all
rows of a shape compare directly. "after sync": the median of single calls each started after
torch.cuda.synchronize() (what a stream-ordered workspace costs when the pool has handed its
memory back).

  python -m vidattn.bench key-mask [--grids 480p,720p] [--no-suffix] [--out F.txt]"""
from __future__ import annotations

from .common import emit, parser

GRIDS = {"480p": ((21, 30, 52), 12), "720p": ((21, 45, 80), 40)}


def after_sync(run, calls=7):
    """Median time of one call that starts on an idle, synchronised device."""
    import torch

    times = []
    for _ in range(calls):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        run()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def main(argv) -> int:
    p = parser("key-mask", __doc__)
    p.add_argument("--grids", default="480p", help="comma list of " + ", ".join(GRIDS))
    p.add_argument("--no-suffix", action="store_true", help="skip the 2 x 16384 rows")
    p.add_argument("--out", default=None, help="also write the report here")
    args = p.parse_args(argv)
    unknown = [n for n in args.grids.split(",") if n and n not in GRIDS]
    if unknown:
        p.error(f"--grids: unknown {unknown}; expected some of {sorted(GRIDS)}")
    import torch
    import vidattn

    from ..timing import gpu_median_ms

    g = torch.Generator(device="cuda")
    g.manual_seed(0)

    def rnd(*shape):
        return torch.randn(shape, generator=g, device="cuda", dtype=torch.bfloat16)

    def cudnn(q, k, v):
        qh, kh, vh = (t.transpose(1, 2).contiguous() for t in (q, k, v))
        backend = torch.nn.attention.SDPBackend.CUDNN_ATTENTION

        def run():
            with torch.nn.attention.sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(qh, kh, vh)
        return run

    D = 128
    cases = []
    for name in [n for n in args.grids.split(",") if n]:
        grid, H = GRIDS[name]
        tiling = vidattn.VideoTiling(grid=grid, tile=(4, 4, 4), device="cuda")
        S = tiling.padded_len
        q, k, v = rnd(1, S, H, D), rnd(1, S, H, D), rnd(1, S, H, D)
        slots = tiling.slot_valid.view(1, -1)
        flops = 4 * H * S * S * D
        cases += [
            (f"{name} slot mask", flops, lambda q=q, k=k, v=v, m=slots: vidattn.attention(
                q, k, v, key_padding_mask=m, query_padding_mask=m)),
            (f"{name} slot mask, keys only", flops, lambda q=q, k=k, v=v, m=slots:
                vidattn.attention(q, k, v, key_padding_mask=m)),
            (f"{name} unmasked", flops, lambda q=q, k=k, v=v: vidattn.attention(q, k, v)),
            (f"{name} cuDNN unmasked", flops, cudnn(q, k, v)),
        ]
    if not args.no_suffix:
        B, S2, H2 = 2, 16384, 16
        q2, k2, v2 = rnd(B, S2, H2, D), rnd(B, S2, H2, D), rnd(B, S2, H2, D)
        suffix = torch.zeros(B, S2, dtype=torch.bool, device="cuda")
        suffix[0, :15000] = True
        suffix[1, :12001] = True
        flops = 4 * B * H2 * S2 * S2 * D
        cases += [("2x16384 suffix-padded keys", flops,
                   lambda: vidattn.attention(q2, k2, v2, key_padding_mask=suffix)),
                  ("2x16384 unmasked", flops, lambda: vidattn.attention(q2, k2, v2)),
                  ("2x16384 cuDNN unmasked", flops, cudnn(q2, k2, v2))]

    lines = [f"{'':30} {'do_bench':>12} {'':15} {'after sync':>12}"]
    for name, flops, run in cases:
        ms = gpu_median_ms(run)
        lines.append(f"{name:30} {ms:9.3f} ms {flops / ms / 1e9:7.1f} TFLOP/s "
                     f"{after_sync(run):9.3f} ms")
        print(lines[-1], flush=True)
    if args.out:
        emit(lines, args.out)
    return 0
