"""SM clock and board power while a kernel runs back to back, as a benchmark's timed loop does.

    python -m vidattn.bench power [--seconds 2] [--cases dense,vsa,sparse,gemm,idle]
                                   [--windows 0.25,0.5] [--bench-timer] [--out F.txt]

For each workload (--cases: `dense`, vidattn's dense forward and cuDNN's at Wan 480p and 32K
tokens, D128; `vsa`, the whole VSA forward at Wan 480p; `sparse`, the 64-token block-sparse
forward at Wan 480p and 720p, 90%, on the bench's uniform random lists, with the K / V bytes it
moves from L2 per second, and with --windows the 720p and HunyuanVideo rows again on lists drawn
from a part of the keys (what L2 misses cost: sparse_work); `gemm`, torch's bf16 matmul (cuBLAS)
at 8192^3 and 16384^3, the ceiling of tensor-core work at the power cap; `idle`, the board
with the host asleep, the power that the others' energy per FLOP is counted above), after 1 s
idle: run it back to back for --seconds, sampling NVML every 50 ms (the bench's sampler), and
print the median SM clock, power and clock-limit reasons over the second half of the window (the
first half is the ramp to the power limit), with the median call time. --bench-timer then times
each workload as the bench times its rows (do_bench after a 500 ms warm-up), to set the ceiling
beside them. A long run of a kernel on an H200 sits at the board's power limit, so what it costs
in energy per FLOP sets its clock and so its speed. A diagnostic, not a test.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

import vidattn
from vidattn.vsa import topk_from_sparsity

from ..blocksparse_case import random_selection
from ..clocks import ClockSampler
from ..timing import gpu_median_ms
from .common import emit, parser


def sampled(fn, seconds, sampler):
    """Runs fn back to back for `seconds` (after 1 s idle) while `sampler` runs; returns the
    median call time and the clock summary (vidattn.bench.clocks.summarise) of the second
    half."""
    time.sleep(1.0)
    events, t0 = [], time.monotonic()
    while time.monotonic() - t0 < seconds:
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        events.append((time.monotonic() - t0, a, b))
        if len(events) % 8 == 0:
            events[-8][2].synchronize()  # keep the queue a few calls deep
    torch.cuda.synchronize()
    late = [a.elapsed_time(b) for t, a, b in events if t >= seconds / 2]
    return statistics.median(late), sampler.window(t0 + seconds / 2, time.monotonic())


def tflop_rate(flops):
    """A workload's rate text for `measure`: TFLOP/s of `flops` per call, and per GHz of the
    SM clock when it was sampled."""
    def rate(ms, mhz):
        tflops = flops / ms / 1e9
        return f"{tflops:7.1f} TFLOP/s" + (f", {tflops / mhz * 1e3:6.1f} TFLOP/s per GHz"
                                           if mhz else "")
    return rate


def no_rate(ms, mhz):
    return ""


def measure(work, seconds, tool, medians=None):
    """Runs each (name, fn, rate) of `work` back to back for `seconds` (`sampled`) and returns
    the report's lines: median call time, SM clock, board power, `rate(ms, mhz)` and the
    clock-limit reasons of each. `medians`, a list, also gets each workload's (ms, MHz or None)
    in order. Exits when NVML is not there (`tool` names the script)."""
    sampler = ClockSampler.for_device(torch.device("cuda", torch.cuda.current_device()))
    if sampler is None:
        sys.exit(f"{tool}: NVML (libnvidia-ml) is not available")
    width = max(len(name) for name, _, _ in work)
    l2 = getattr(torch.cuda.get_device_properties(torch.cuda.current_device()), "L2_cache_size", 0)
    lines = [f"== {torch.cuda.get_device_name()} (L2 {l2 / 2**20:.0f} MiB): back to back for "
             f"{seconds} s each, medians over the second half"]
    sampler.start()
    try:
        with torch.no_grad():
            for name, fn, rate in work:
                fn()
                torch.cuda.synchronize()
                ms, seen = sampled(fn, seconds, sampler)
                if medians is not None:
                    medians.append((ms, None if seen is None else seen["sm_mhz_median"]))
                if seen is None:
                    lines.append(f"  {name:{width}s} {ms:8.3f} ms  {rate(ms, None)}  "
                                 "(no clock samples)")
                    continue
                clock = seen["sm_mhz_median"]
                lines.append(f"  {name:{width}s} {ms:8.3f} ms  SM {clock:6.0f} MHz  "
                             f"{seen['power_w_median']:5.0f} W  {rate(ms, clock)}  "
                             f"limits {seen['reasons']}")
    finally:
        sampler.stop()
    return lines


def windowed_selection(heads, tiles, topk, window, g, local):
    """random_selection over a window of ``window`` consecutive key tiles: the first
    ``window`` for every query tile (local False), or the window centred on the query tile's
    own position (local True, the locality of real video selections). Ascending int32 index
    [1, H, Qt, topk] and count [1, H, Qt]."""
    index, count = random_selection(1, heads, tiles, window, topk, g, "cuda")
    if local:
        start = (torch.arange(tiles, device="cuda") - window // 2).clamp(0, tiles - window)
        index += start.to(torch.int32).view(1, 1, tiles, 1)  # a per-row shift keeps the order
    return index, count


def sparse_work(randn, g, windows=()):
    """The 64-token block-sparse forward at Wan 480p and 720p, 90%, on uniform random
    ascending lists (the bench's selection), as (name, fn, rate) workloads. The rate adds the
    K / V bytes moved from L2 per second: 128-key blocks of two tiles, an odd list's last
    tile loaded twice.
    ``windows``: fractions of the key tiles; for each, the 720p and HunyuanVideo (115200 x
    24 heads) rows again with the same top-k drawn from that fraction of the keys, first the
    same window for every query tile, then one centred on each: the same FLOPs and L2 -> SM
    bytes over a smaller set of K / V (per head 47 MB at 720p, 59 MB at HunyuanVideo,
    against an L2 of ~50 MB), so the difference is what L2 misses cost."""
    work = []
    rows = [("480p", 39936, 12, None, False), ("720p", 92160, 40, None, False)]
    if windows:
        rows.append(("hunyuan", 115200, 24, None, False))
    for fraction in windows:
        for local in (False, True):
            rows += [("720p", 92160, 40, fraction, local), ("hunyuan", 115200, 24, fraction, local)]
    for name, seq, heads, fraction, local in rows:
        tiles = seq // 64
        topk = topk_from_sparsity(0.9, tiles)
        q, k, v = (randn(1, seq, heads, 128) for _ in range(3))
        if fraction is None:
            index, count = random_selection(1, heads, tiles, tiles, topk, g, "cuda")
            label = name
        else:
            window = max(topk, int(fraction * tiles))
            index, count = windowed_selection(heads, tiles, topk, window, g, local)
            label = (f"{name}, keys from windows of {window} around each query tile" if local
                     else f"{name}, keys from one window of {window}")
        flops = 4 * heads * seq * topk * 64 * 128
        keys = (topk + 1) // 2 * 128  # per query tile
        kv_bytes = heads * tiles * keys * 2 * (128 * 2)
        flop_rate = tflop_rate(flops)

        def rate(ms, mhz, flop_rate=flop_rate, kv_bytes=kv_bytes):
            return flop_rate(ms, mhz) + f", K/V {kv_bytes / ms / 1e9:5.2f} TB/s"

        work.append((f"vidattn block-sparse {label} (64-token tiles, 0.9)",
                     lambda q=q, k=k, v=v, index=index, count=count:
                     vidattn.block_sparse_attention(q, k, v, index, count, tile_volume=64,
                                                    validate_index=False), rate))
    return work


def fractions(text):
    """--windows: comma-separated numbers in (0, 1]."""
    try:
        values = [float(f) for f in text.split(",") if f]
    except ValueError:
        values = None
    if values is None or any(not 0 < f <= 1 for f in values):
        raise argparse.ArgumentTypeError(f"expected fractions in (0, 1], got {text!r}")
    return values


def main(argv) -> int:
    p = parser("power", __doc__)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--cases", default="dense,vsa",
                   help="comma-separated: dense, vsa, sparse, gemm, idle")
    p.add_argument("--windows", default=[], type=fractions,
                   help="with sparse: comma-separated fractions of the key tiles that the "
                        "windowed rows draw their lists from (sparse_work)")
    p.add_argument("--bench-timer", action="store_true",
                   help="then time each workload as the bench's rows are (gpu_median_ms)")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    cases = set(args.cases.split(","))
    unknown = cases - {"dense", "vsa", "sparse", "gemm", "idle"}
    if unknown:
        p.error(f"--cases: unknown {sorted(unknown)}; expected dense, vsa, sparse, gemm or idle")
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device="cuda", dtype=torch.bfloat16)

    work = []
    if "idle" in cases:
        work.append(("idle (host asleep)", lambda: time.sleep(0.01), no_rate))
    for n in (8192, 16384) if "gemm" in cases else ():
        a, b = randn(n, n), randn(n, n)
        work.append((f"cuBLAS bf16 GEMM {n}^3", lambda a=a, b=b: a @ b,
                     tflop_rate(2.0 * n ** 3)))
    for seq, heads in ((39936, 12), (32768, 16)) if "dense" in cases else ():
        q, k, v = (randn(1, seq, heads, 128) for _ in range(3))
        flops = 4 * seq * seq * heads * 128
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))

        def cudnn(qt=qt, kt=kt, vt=vt):
            with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                return F.scaled_dot_product_attention(qt, kt, vt)

        work.append((f"vidattn dense {seq}x{heads}", lambda q=q, k=k, v=v:
                     vidattn.attention(q, k, v), tflop_rate(flops)))
        work.append((f"cuDNN dense {seq}x{heads}", cudnn, tflop_rate(flops)))
    if "vsa" in cases:
        tiling = vidattn.VideoTiling(grid=(21, 30, 52), tile=(4, 4, 4), device="cuda")
        tq, tk, tv = (tiling.tile(randn(1, tiling.num_tokens, 12, 128)) for _ in range(3))
        work.append(("vidattn VSA 480p (sparsity 0.9)", lambda: vidattn.video_sparse_attention(
            tq, tk, tv, tiling=tiling, sparsity=0.9), no_rate))
    if "sparse" in cases:
        work += sparse_work(randn, g, args.windows)

    lines = measure(work, args.seconds, "vidattn.bench power")
    if args.bench_timer:
        lines.append("== the bench's timer (gpu_median_ms: do_bench after its warm-up, L2 flushed)")
        width = max(len(name) for name, _, _ in work)
        with torch.no_grad():
            for name, fn, rate in work:
                if rate is no_rate:
                    continue
                ms = gpu_median_ms(fn)
                lines.append(f"  {name:{width}s} {ms:8.3f} ms  {rate(ms, None)}")
    emit(lines, args.out)
    return 0
