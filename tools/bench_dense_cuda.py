"""Dense attention forward / backward TFLOP/s of vidattn against PyTorch SDPA (cuDNN and
flash backends) at a few shapes, then the sm_90a block-sparse rows; median of
triton.testing.do_bench after the bench's warm-up (vidattn.bench.timing.gpu_median_ms), one
JSON line per row on stdout, all rows in the JSON file.

  python3 tools/bench_dense_cuda.py [out.json] [--shapes B,S,H,D[,causal] ...] [--fwd-vs-cudnn]

--shapes replaces the dense shapes; S may be Sq:Sk for a key length of its own (cross
attention: 1,32760:512,12,128 is Wan 480p's text cross attention). --fwd-vs-cudnn times only the forward, ours and cuDNN's,
with each row's ratio, and no sparse rows. Environment: BENCH_OURS_ONLY=1 times only
vidattn's forward (A/B runs of a kernel switch in a second process: tools/sm90_ab.sh);
BENCH_REQUIRES_GRAD=1 makes the forward's q, k, v leaves that require grad (the autograd
path, as in `python -m vidattn.bench`)."""
import argparse
import json
import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import vidattn
from vidattn.bench.timing import gpu_median_ms

SHAPES = [(1, 32768, 12, 128, False), (2, 16384, 32, 64, False), (1, 16384, 12, 128, True),
          (1, 39936, 12, 128, False)]
# The forward sweep across shapes against cuDNN (--sweep; docs/perf-notes.md, "Across shapes"):
# video self attention, cross attention to text (77-1024 keys) and image (257) tokens, causal,
# D = 128 and 64, odd lengths. B,S,H,D[,causal] with S a length or Sq:Sk.
SWEEP = ("1,4096,24,128 2,8192,24,128 4,4096,16,128 1,16384,24,128,causal 1,32761,12,128 "
         "2,4680,24,128 1,32760:512,12,128 1,32760:226,12,128 1,32760:128,12,128 "
         "1,32760:77,12,128 2,16384:300,16,128 1,8192:1024,24,128 1,75600:257,40,128 "
         "1,16384,32,64,causal 2,4096,24,64 1,32768,16,64 1,8191,30,64 1,32760:512,12,64 "
         "1,32760:257,12,64 1,24576:128,32,64 4,2048,16,64").split()
# Block-sparse rows (sm_90a standalone launcher): B, S, H, D, tile volume, sparsity. Random
# ascending key-tile lists of topk = ceil((1 - s) * tiles) per query tile, full tiles.
# BENCH_SPARSE="B,S,H,D,tile,sparsity ..." replaces them (library A/Bs of other rows).
SPARSE = [(1, 39936, 12, 128, 64, 0.875), (1, 39936, 12, 128, 64, 0.9),
          (1, 92160, 40, 128, 64, 0.9)]
if os.environ.get("BENCH_SPARSE"):
    SPARSE = [tuple(int(x) if i < 5 else float(x) for i, x in enumerate(spec.split(",")))
              for spec in os.environ["BENCH_SPARSE"].split()]


def tflops(flops, ms):
    return flops / (ms * 1e-3) / 1e12


def forward_vs_cudnn(row, q, k, v, causal, flops):
    """The forward of ours and of cuDNN, one after the other: TFLOP/s and cuDNN's time over
    ours."""
    ours = gpu_median_ms(lambda: vidattn.attention(q, k, v, causal=causal))
    qt, kt, vt = (t.detach().transpose(1, 2) for t in (q, k, v))
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = gpu_median_ms(lambda: sdpa(qt, kt, vt, is_causal=causal))
    return {**row, "vidattn_fwd": tflops(flops, ours), "cudnn_fwd": tflops(flops, cudnn),
            "ratio": cudnn / ours}


# BENCH_OURS_ONLY=1: only vidattn's forward (A/B runs of a kernel switch such as
# VIDATTN_SM90_PINGPONG=0 in a second process).
OURS_ONLY = os.environ.get("BENCH_OURS_ONLY") == "1"


def parse_shape(spec):
    """B,S,H,D[,causal] with S either one length or Sq:Sk -> (B, Sq, H, D, causal, Sk)."""
    parts = spec.split(",")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "causal"):
        raise argparse.ArgumentTypeError(
            f"shape {spec!r}: expected B,S,H,D or B,S,H,D,causal (S: a length or Sq:Sk)")
    lengths = parts[1].split(":")
    if len(lengths) > 2:
        raise argparse.ArgumentTypeError(f"shape {spec!r}: S is a length or Sq:Sk")
    sq, sk = int(lengths[0]), int(lengths[-1])
    return (int(parts[0]), sq, int(parts[2]), int(parts[3]), len(parts) == 5, sk)


def main(path, shapes, fwd_vs_cudnn):
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    grad_inputs = os.environ.get("BENCH_REQUIRES_GRAD") == "1"
    rows = []
    for B, S, H, D, causal, *kv_len in shapes:
        Sk = kv_len[0] if kv_len else S

        def rnd(length):
            return torch.randn((B, length, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
        q, k, v, go = rnd(S), rnd(Sk), rnd(Sk), rnd(S)
        q, k, v = (t.requires_grad_(grad_inputs) for t in (q, k, v))
        # Causal with Sq != Sk is bottom-right aligned; the half is the square case's count.
        fwd_flops = 4 * B * H * S * Sk * D / (2 if causal else 1)
        row = {"shape": [B, S, H, D], "causal": causal}
        if Sk != S:
            row["kv_len"] = Sk
        if fwd_vs_cudnn:
            rows.append(forward_vs_cudnn(row, q, k, v, causal, fwd_flops))
            print(json.dumps(rows[-1]), flush=True)
            continue
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

        def ours_fwd():
            return vidattn.attention(q, k, v, causal=causal)
        out = vidattn.attention(qg, kg, vg, causal=causal)

        def ours_bwd():
            return torch.autograd.grad(out, (qg, kg, vg), go, retain_graph=True)
        row["vidattn_fwd"] = tflops(fwd_flops, gpu_median_ms(ours_fwd))
        if OURS_ONLY:
            rows.append(row)
            print(json.dumps(row), flush=True)
            continue
        row["vidattn_bwd"] = tflops(2.5 * fwd_flops, gpu_median_ms(ours_bwd))
        qt, kt, vt, got = (t.detach().transpose(1, 2) for t in (q, k, v, go))
        for name, backend in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION)):
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
    sparse_rows = []
    if not fwd_vs_cudnn and hasattr(torch.ops.vidattn, "_block_sparse_forward_sm90") and \
            torch.cuda.get_device_capability() == (9, 0):
        for B, S, H, D, tile, sparsity in SPARSE:
            tiles = S // tile
            topk = max(1, min(tiles, int(-(-(1 - sparsity) * tiles // 1))))
            q, k, v = (torch.randn((B, S, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
                       for _ in range(3))
            scores = torch.rand((B, H, tiles, tiles), generator=g, device="cuda")
            index = scores.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
            count = torch.full((B, H, tiles), topk, dtype=torch.int32, device="cuda")
            sizes = torch.full((tiles,), tile, dtype=torch.int32, device="cuda")
            op = torch.ops.vidattn._block_sparse_forward_sm90
            flops = 4 * B * H * S * topk * tile * D
            row = {"shape": [B, S, H, D], "tile": tile, "sparsity": sparsity, "topk": topk}
            try:
                row["sparse_fwd"] = tflops(flops, gpu_median_ms(
                    lambda: op(q, k, v, index, count, sizes, tile)))
            except Exception as e:
                row["sparse_error"] = str(e)[:200]
            sparse_rows.append(row)
            print(json.dumps(row), flush=True)
            del q, k, v, scores, index
    with open(path, "w") as f:
        json.dump({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows,
                   "sparse_rows": sparse_rows}, f, indent=1)
    if fwd_vs_cudnn:
        return
    print(f"{'shape':>24} {'causal':>6} | {'ours f':>7} {'cudnn f':>7} {'flash f':>7} | {'ours b':>7} {'cudnn b':>7} {'flash b':>7}")
    for r in rows:
        print(f"{str(r['shape']):>24} {str(r['causal']):>6} | " + " ".join(
            f"{r.get(k, float('nan')):7.1f}" for k in ("vidattn_fwd", "cudnn_fwd", "flash_fwd")) + " | " + " ".join(
            f"{r.get(k, float('nan')):7.1f}" for k in ("vidattn_bwd", "cudnn_bwd", "flash_bwd")))
    for r in sparse_rows:
        print(f"sparse {str(r['shape']):>24} tile {r['tile']} sparsity {r['sparsity']}: "
              f"{r.get('sparse_fwd', float('nan')):7.1f} TFLOP/s (effective)")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", nargs="?", default="bench_dense_cuda.json",
                        help="JSON file for all rows")
    parser.add_argument("--shapes", nargs="+", type=parse_shape, default=SHAPES,
                        metavar="B,S,H,D[,causal]",
                        help="the dense shapes (replace the default); S may be Sq:Sk")
    parser.add_argument("--fwd-vs-cudnn", action="store_true",
                        help="only the forward, ours and cuDNN's, with their ratio")
    parser.add_argument("--sweep", action="store_true",
                        help="the forward sweep against cuDNN: SWEEP's shapes, --fwd-vs-cudnn")
    args = parser.parse_args()
    if args.sweep:
        main(args.out, [parse_shape(s) for s in SWEEP], True)
    else:
        main(args.out, args.shapes, args.fwd_vs_cudnn)
