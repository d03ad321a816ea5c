"""Where the whole VSA forward's time goes besides its kernels: host launch cost, gaps
between kernels, the cold start after an L2 flush.

    python -m vidattn.bench vsa-overhead [--grid 21x30x52] [--heads 12] [--sparsity 0.9] [--out F]

One shape (default Wan2.1-1.3B 480p, bf16, D128, no gate, as the bench's VSA row), rows:
- eager, L2 flushed: what `python -m vidattn.bench` reports (do_bench, median);
- CUDA graph, L2 flushed: the same op captured once and replayed; no host work per call,
  so eager minus graph is what host launches cost the GPU;
- eager / graph, warm: CUDA events around back-to-back calls (L2 keeps the last call's data);
- graph, isolated: CUDA events around single replays, each after 5 ms idle (back to back,
  a long run sits at the board's power limit: the power mode);
- host: wall time of the Python call alone (no synchronisation; the GPU queue absorbs it);
- kernels: the sum of the op's kernel times (torch.profiler), the floor for all of the above;
- cuDNN's dense forward on the same tensors (the bench's peer), for the ratio;
- timelines from a profiler trace: per call the span, the busy time and the gaps between
  kernels, eager and graph, L2 warm and after a flush.
A diagnostic, not a test.
"""
from __future__ import annotations

import json
import os
import statistics
import tempfile
import time

import torch
from torch.profiler import ProfilerActivity, profile

import vidattn

from ..timing import CudaTimer
from .common import emit, parser


def events_median(fn, reps=30):
    """Median of CUDA-event times around fn, calls back to back (warm L2): the bench's timer
    with a repeat count."""
    return CudaTimer(warmup=3, repeats=reps).measure(fn).median_ms


def flushed_median(fn):
    """The bench's own timing: do_bench's median, L2 flushed before each call."""
    return CudaTimer().measure(fn).median_ms


def host_us(fn, calls=40):
    """Mean host wall time per call, without synchronising (the queue holds 40 calls)."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def isolated_events_median(fn, reps=15, idle_s=0.005):
    """Median of CUDA-event times around single calls, each after a synchronisation and an
    idle pause: every call starts on an idle GPU (below its power limit, an empty queue)."""
    times = []
    for _ in range(reps + 2):
        torch.cuda.synchronize()
        time.sleep(idle_s)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times[2:])


def kernel_ms(fn, iters=10):
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages()) / iters / 1e3


def timeline(fn, iters=6):
    """Kernels (and memsets) of each call from a profiler trace, calls separated by a host
    synchronisation: per call the span first start -> last end, the busy time, and the gaps."""
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
            torch.cuda.synchronize()
            time.sleep(0.002)  # a clear break in the trace between calls
    path = os.path.join(tempfile.mkdtemp(), "trace.json")
    prof.export_chrome_trace(path)
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")),
                 key=lambda e: e["ts"])
    calls, current = [], []
    for e in gpu:
        if current and e["ts"] - (current[-1]["ts"] + current[-1]["dur"]) > 1000:
            calls.append(current)
            current = []
        current.append(e)
    calls.append(current)
    lines = []
    for c in calls[1:]:  # the first call pays the profiler's start
        span = c[-1]["ts"] + c[-1]["dur"] - c[0]["ts"]
        busy = sum(e["dur"] for e in c)
        gaps = [round(b["ts"] - (a["ts"] + a["dur"]), 1) for a, b in zip(c, c[1:])]
        lines.append(f"span {span:8.1f} us busy {busy:8.1f} us gaps {gaps} durations "
                     f"{[round(e['dur'], 1) for e in c]}")
    names = [e["name"][:60] for e in calls[-1]]
    return lines, names


def main(argv) -> int:
    p = parser("vsa-overhead", __doc__)
    p.add_argument("--grid", default="21x30x52")
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--sparsity", type=float, default=0.9)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    grid = tuple(int(x) for x in args.grid.split("x"))
    tiling = vidattn.VideoTiling(grid=grid, tile=(4, 4, 4), device="cuda")
    g = torch.Generator(device="cuda").manual_seed(0)
    shape = (1, tiling.num_tokens, args.heads, 128)
    q, k, v = (tiling.tile(torch.randn(*shape, generator=g, device="cuda",
                                       dtype=torch.bfloat16)) for _ in range(3))

    def eager():
        return vidattn.video_sparse_attention(q, k, v, tiling=tiling, sparsity=args.sparsity)

    def cudnn():
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(
                *(t.transpose(1, 2) for t in (q, k, v)))

    lines = [f"== VSA forward {args.grid} H{args.heads} sparsity {args.sparsity} "
             f"({torch.cuda.get_device_name()})"]
    with torch.no_grad():
        ref = eager()
        torch.cuda.synchronize()
        # Capture on a side stream, as torch.cuda.graph does; warm-up first (allocator).
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            static_out = eager()
        graph.replay()
        torch.cuda.synchronize()
        same = torch.equal(static_out, ref)
        lines.append(f"graph replay output equals eager: {same}")
        for r in range(args.rounds):
            rows = {
                "eager, L2 flushed (do_bench)": flushed_median(eager),
                "graph, L2 flushed (do_bench)": flushed_median(graph.replay),
                "eager, warm (events)": events_median(eager),
                "graph, warm (events)": events_median(graph.replay),
                "graph, isolated calls (events)": isolated_events_median(graph.replay),
                "kernels (profiler sum)": kernel_ms(eager),
                "cuDNN dense, warm (events)": events_median(cudnn, reps=10),
                "cuDNN dense, kernels (profiler sum)": kernel_ms(cudnn, iters=5),
                "cuDNN dense, L2 flushed (do_bench)": flushed_median(cudnn),
            }
            for name, ms in rows.items():
                lines.append(f"  round {r + 1}  {name:32s} {ms:8.4f} ms")
            lines.append(f"  round {r + 1}  {'host per eager call':32s} {host_us(eager):8.1f} us")
        flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")

        def after_flush(fn):
            return lambda: (flush.zero_(), fn())

        for label, fn in (("eager", eager), ("graph", graph.replay),
                          ("eager after an L2 flush (first kernel: the flush)", after_flush(eager)),
                          ("graph after an L2 flush", after_flush(graph.replay))):
            rows, names = timeline(fn)
            lines.append(f"timeline, {label} (one call per row):")
            lines += ["  " + r for r in rows]
            lines += ["  kernel: " + n for n in names]
    emit(lines, args.out)
    return 0
