"""Dense attention forward / backward TFLOP/s of vidattn against PyTorch SDPA (cuDNN and flash
backends) at a few shapes, then the sm_90a block-sparse rows; each time the median of
gpu_median_ms (do_bench after the bench's warm-up). One JSON line per row on stdout (what
tools/gpu/lib_ab.sh reads), all rows in --out.

  python -m vidattn.bench dense [--out F.json] [--shapes B,S,H,D[,causal] ...]
                                [--fwd-vs-cudnn | --sweep] [--ours-only] [--sparse-rows ...]
                                [--head-dims [D[:Dv] ...]]

--shapes replaces the dense shapes; S may be Sq:Sk for a key length of its own (cross
attention: 1,32760:512,12,128 is Wan 480p's text cross attention). --fwd-vs-cudnn times only
the forward, ours and cuDNN's, with each row's ratio, and no sparse rows; --sweep does that on
SWEEP's shapes (docs/perf-notes.md, "Across shapes"). --ours-only times only vidattn's forward
(library A/B runs); --requires-grad makes the forward's q, k, v leaves that require grad (the
autograd path, as the case runner has it). --head-dims runs every dense shape (--shapes, else
HEAD_DIM_SHAPES) at each of the given head dims instead of its own D, D:Dv giving v and the
output a head dim of their own; with no values, HEAD_DIMS (the field's dims, each width of the
portable kernels' padded instances, and D != Dv); with --fwd-vs-cudnn only the forward against
cuDNN. FLOPs count 2 (D + Dv) per query-key pair in the forward (4 D when Dv = D)."""
from __future__ import annotations

import argparse
import json

from .common import emit, parse_shape, parser, result_doc, tflops, write_json

SHAPES = ["1,32768,12,128", "2,16384,32,64", "1,16384,12,128,causal", "1,39936,12,128"]
# The forward sweep across shapes against cuDNN: video self attention, cross attention to text
# (77-1024 keys) and image (257) tokens, causal, D = 128 and 64, odd lengths.
SWEEP = ("1,4096,24,128 2,8192,24,128 4,4096,16,128 1,16384,24,128,causal 1,32761,12,128 "
         "2,4680,24,128 1,32760:512,12,128 1,32760:226,12,128 1,32760:128,12,128 "
         "1,32760:77,12,128 2,16384:300,16,128 1,8192:1024,24,128 1,75600:257,40,128 "
         "1,16384,32,64,causal 2,4096,24,64 1,32768,16,64 1,8191,30,64 1,32760:512,12,64 "
         "1,32760:257,12,64 1,24576:128,32,64 4,2048,16,64").split()
# --head-dims: the dims the field uses (72 Open-Sora, 80 / 96 image DiTs, 256, and Dv != D) and
# the padded widths' edges (src/cuda/dispatch/head_dims.h), on a video self-attention shape at
# about the width of a 1.3B model and a cross attention to text.
HEAD_DIMS = ["64", "72", "80", "96", "112", "128", "160", "192", "256", "192:128", "128:64",
             "64:128"]
HEAD_DIM_SHAPES = ["1,32760,16,128", "1,32760:512,16,128"]
# Block-sparse rows (the sm_90a launcher alone): B, S, H, D, tile volume, sparsity. Random
# ascending key-tile lists of topk = ceil((1 - s) * tiles) per query tile, full tiles.
SPARSE = ["1,39936,12,128,64,0.875", "1,39936,12,128,64,0.9", "1,92160,40,128,64,0.9"]


def parse_sparse_row(spec: str) -> tuple:
    """``B,S,H,D,tile,sparsity`` -> (B, S, H, D, tile, sparsity)."""
    parts = spec.split(",")
    try:
        if len(parts) == 6:
            return tuple(int(x) for x in parts[:5]) + (float(parts[5]),)
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"sparse row {spec!r}: expected B,S,H,D,tile,sparsity")


def parse_head_dims(spec: str) -> tuple:
    """``D`` or ``D:Dv`` -> (D, Dv)."""
    parts = spec.split(":")
    try:
        if len(parts) in (1, 2):
            dims = tuple(int(x) for x in parts)
            if min(dims) >= 1:
                return (dims[0], dims[-1])
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"head dims {spec!r}: expected D or D:Dv (integers >= 1)")


def with_head_dims(shapes, dims):
    """Every shape at every (D, Dv) of dims: (B, Sq, H, D, causal, Sk, Dv) tuples."""
    return [(B, S, H, d, causal, Sk, dv) for B, S, H, _, causal, Sk in shapes for d, dv in dims]


def build_parser():
    p = parser("dense", __doc__)
    p.add_argument("--out", default=None, help="JSON file for all rows")
    p.add_argument("--shapes", nargs="+", type=parse_shape, default=None,
                   metavar="B,S,H,D[,causal]",
                   help="the dense shapes (replace the default); S may be Sq:Sk")
    p.add_argument("--fwd-vs-cudnn", action="store_true",
                   help="only the forward, ours and cuDNN's, with their ratio")
    p.add_argument("--sweep", action="store_true",
                   help="the forward sweep against cuDNN: SWEEP's shapes, --fwd-vs-cudnn")
    p.add_argument("--ours-only", action="store_true", help="only vidattn's forward")
    p.add_argument("--requires-grad", action="store_true",
                   help="q, k, v of the forward require grad (the autograd path)")
    p.add_argument("--sparse-rows", nargs="*", type=parse_sparse_row, default=None,
                   metavar="B,S,H,D,tile,sparsity",
                   help="the sm_90a block-sparse rows (replace the default; none: no rows)")
    p.add_argument("--head-dims", nargs="*", type=parse_head_dims, default=None,
                   metavar="D[:Dv]",
                   help="run the dense shapes (--shapes, else HEAD_DIM_SHAPES) at each of these "
                        "head dims (none given: HEAD_DIMS); D:Dv for v's own head dim")
    return p


def forward_vs_cudnn(row, q, k, v, causal, flops):
    """The forward of ours and of cuDNN, one after the other: TFLOP/s and cuDNN's time over
    ours (cuDNN's error instead where it does not take the shape)."""
    import vidattn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from ..timing import gpu_median_ms

    ours = gpu_median_ms(lambda: vidattn.attention(q, k, v, causal=causal))
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    try:
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            cudnn = gpu_median_ms(lambda: sdpa(qt, kt, vt, is_causal=causal))
    except Exception as e:  # a head dim or layout cuDNN does not take
        return {**row, "vidattn_fwd": tflops(flops, ours), "cudnn_error": str(e)[:200]}
    return {**row, "vidattn_fwd": tflops(flops, ours), "cudnn_fwd": tflops(flops, cudnn),
            "ratio": cudnn / ours}


def dense_rows(shapes, fwd_vs_cudnn, ours_only, requires_grad, g):
    import torch
    import vidattn
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    from ..timing import gpu_median_ms

    rows = []
    for B, S, H, D, causal, Sk, *dv in shapes:
        Dv = dv[0] if dv else D  # v's (and the output's) head dim

        def rnd(length, d=D):
            return torch.randn((B, length, H, d), generator=g, device="cuda", dtype=torch.bfloat16)
        q, k, v, go = rnd(S), rnd(Sk), rnd(Sk, Dv), rnd(S, Dv)
        q, k, v = (t.requires_grad_(requires_grad) for t in (q, k, v))
        # Causal with Sq != Sk is bottom-right aligned; the half is the square case's count.
        fwd_flops = 2 * B * H * S * Sk * (D + Dv) / (2 if causal else 1)
        row = {"shape": [B, S, H, D], "causal": causal}
        if Sk != S:
            row["kv_len"] = Sk
        if Dv != D:
            row["head_dim_v"] = Dv
        if fwd_vs_cudnn:
            rows.append(forward_vs_cudnn(row, q, k, v, causal, fwd_flops))
            print(json.dumps(rows[-1]), flush=True)
            continue
        row["vidattn_fwd"] = tflops(fwd_flops, gpu_median_ms(
            lambda: vidattn.attention(q, k, v, causal=causal)))
        if ours_only:
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        # The backward both ways: deterministic (the default) and not ("nondet").
        for key, deterministic in (("vidattn_bwd", True), ("vidattn_nondet_bwd", False)):
            qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
            out = vidattn.attention(qg, kg, vg, causal=causal, deterministic=deterministic)
            row[key] = tflops(2.5 * fwd_flops, gpu_median_ms(
                lambda: torch.autograd.grad(out, (qg, kg, vg), go, retain_graph=True)))
        qt, kt, vt, got = (t.detach().transpose(1, 2) for t in (q, k, v, go))
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION),
                              ("flash", SDPBackend.FLASH_ATTENTION)):
            try:
                with sdpa_kernel(backend):
                    qs, ks, vs = (t.clone().requires_grad_() for t in (qt, kt, vt))
                    o = sdpa(qs, ks, vs, is_causal=causal)
                    f = gpu_median_ms(lambda: sdpa(qt, kt, vt, is_causal=causal))
                    b = gpu_median_ms(
                        lambda: torch.autograd.grad(o, (qs, ks, vs), got, retain_graph=True))
                row[f"{name}_fwd"] = tflops(fwd_flops, f)
                row[f"{name}_bwd"] = tflops(2.5 * fwd_flops, b)
            except Exception as e:  # a backend that does not take this shape
                row[f"{name}_error"] = str(e)[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def sparse_rows(specs, g):
    """The block-sparse forward (the sm_90a kernels) on random ascending lists, through the
    public op without its index check; none where the GPU is not sm_90."""
    import torch

    import vidattn

    from ..timing import gpu_median_ms

    rows = []
    if torch.cuda.get_device_capability() != (9, 0):
        return rows
    for B, S, H, D, tile, sparsity in specs:
        tiles = S // tile
        topk = max(1, min(tiles, int(-(-(1 - sparsity) * tiles // 1))))
        q, k, v = (torch.randn((B, S, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        scores = torch.rand((B, H, tiles, tiles), generator=g, device="cuda")
        index = scores.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
        count = torch.full((B, H, tiles), topk, dtype=torch.int32, device="cuda")
        sizes = torch.full((tiles,), tile, dtype=torch.int32, device="cuda")

        def op():
            return vidattn.block_sparse_attention(q, k, v, index, count, tile_volume=tile,
                                                  kv_block_sizes=sizes, validate_index=False)

        flops = 4 * B * H * S * topk * tile * D
        row = {"shape": [B, S, H, D], "tile": tile, "sparsity": sparsity, "topk": topk}
        try:
            row["sparse_fwd"] = tflops(flops, gpu_median_ms(op))
        except Exception as e:
            row["sparse_error"] = str(e)[:200]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del q, k, v, scores, index
    return rows


def table(rows, sparse):
    nan = float("nan")
    lines = [f"{'shape':>24} {'Dv':>4} {'causal':>6} | {'ours f':>7} {'cudnn f':>7} "
             f"{'flash f':>7} | {'ours b':>7} {'nondet b':>8} {'cudnn b':>7} {'flash b':>7}"]
    for r in rows:
        dv = r.get("head_dim_v", r["shape"][3])
        lines.append(f"{str(r['shape']):>24} {dv:>4} {str(r['causal']):>6} | " + " ".join(
            f"{r.get(k, nan):7.1f}" for k in ("vidattn_fwd", "cudnn_fwd", "flash_fwd"))
            + " | " + " ".join(
            f"{r.get(k, nan):7.1f}" for k in ("vidattn_bwd", "vidattn_nondet_bwd", "cudnn_bwd",
                                               "flash_bwd")))
    for r in sparse:
        lines.append(f"sparse {str(r['shape']):>24} tile {r['tile']} sparsity {r['sparsity']}: "
                     f"{r.get('sparse_fwd', nan):7.1f} TFLOP/s (effective)")
    return lines


def main(argv) -> int:
    args = build_parser().parse_args(argv)
    import torch

    fwd_vs_cudnn = args.fwd_vs_cudnn or args.sweep
    if args.head_dims is not None:
        base = args.shapes or [parse_shape(s) for s in HEAD_DIM_SHAPES]
        shapes = with_head_dims(base, args.head_dims or [parse_head_dims(d) for d in HEAD_DIMS])
    else:
        shapes = args.shapes or [parse_shape(s) for s in (SWEEP if args.sweep else SHAPES)]
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    rows = dense_rows(shapes, fwd_vs_cudnn, args.ours_only, args.requires_grad, g)
    specs = args.sparse_rows if args.sparse_rows is not None else \
        [parse_sparse_row(s) for s in SPARSE]
    sparse = [] if fwd_vs_cudnn else sparse_rows(specs, g)
    if args.out:
        write_json(args.out, result_doc("dense", argv, gpu=torch.cuda.get_device_name(),
                                        rows=rows, sparse_rows=sparse))
    if not fwd_vs_cudnn and not args.ours_only:
        emit(table(rows, sparse))
    return 0
