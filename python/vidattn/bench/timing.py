"""Timers. CPU: ``time.perf_counter`` around synchronous calls; after warm-up (the runner's
first call, which feeds the accuracy check, plus ``warmup`` more), the median of N rounds,
the implementations of one row group interleaved round by round so that load from other
processes falls on all of them alike. CUDA: ``triton.testing.do_bench`` (median) when
triton imports, after GPU_WARMUP_MS of untimed runs (the clock at the power cap settles), else
CUDA events, each after warm-up.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

# CPU rounds when --repeats is not given: until ~TARGET seconds a row group, within bounds.
CPU_TARGET_S = 0.5
CPU_MAX_REPEATS = 50
# do_bench's warm-up and timed span per GPU row (its defaults: 25 and 100 ms). At the power
# cap (the H200's 700 W) the clock swings for a while after a pause (each row group pauses
# for its float64 reference): with 25 ms of warm-up, a 10 ms row was timed inside the swing
# (four clock samples from 1560 to 1980 MHz at a median 706 W; docs/perf-notes.md, "The
# bench's warm-up"). The same warm-up for every implementation.
GPU_WARMUP_MS = 500
GPU_REP_MS = 200


def gpu_median_ms(fn: Callable[[], object], do_bench=None) -> float:
    """The median time of ``fn`` from ``triton.testing.do_bench`` after GPU_WARMUP_MS of
    untimed runs, over GPU_REP_MS of runs (do_bench picks the counts; L2 flushed before each
    run). The bench's rows and the benchmarks and probes in tools/ time through it."""
    if do_bench is None:
        import triton.testing

        do_bench = triton.testing.do_bench
    return float(do_bench(fn, warmup=GPU_WARMUP_MS, rep=GPU_REP_MS, return_mode="median"))


@dataclass(frozen=True)
class Timing:
    median_ms: float
    min_ms: Optional[float]  # None where do_bench keeps it to itself
    repeats: Optional[int]  # timed runs; None where do_bench chose


class CpuTimer:
    name = "time.perf_counter (interleaved rounds)"
    interleaves = True

    def __init__(self, warmup: int = 0, repeats: Optional[int] = None, min_repeats: int = 3):
        self.warmup, self.repeats, self.min_repeats = warmup, repeats, min_repeats

    def measure_group(self, fns: Sequence[Callable[[], object]]) -> list[Timing]:
        """Rounds of one call each: ``repeats`` of them, or by default until ~CPU_TARGET_S has
        passed (at least ``min_repeats``, at most CPU_MAX_REPEATS)."""
        for fn in fns:
            for _ in range(self.warmup):
                fn()
        samples: list[list[float]] = [[] for _ in fns]
        started = time.perf_counter()
        while True:
            for fn, times in zip(fns, samples):
                start = time.perf_counter()
                fn()
                times.append((time.perf_counter() - start) * 1e3)
            rounds = len(samples[0])
            if self.repeats is not None:
                if rounds >= self.repeats:
                    break
            elif rounds >= CPU_MAX_REPEATS or (
                    rounds >= self.min_repeats
                    and time.perf_counter() - started >= CPU_TARGET_S):
                break
        return [Timing(statistics.median(t), min(t), len(t)) for t in samples]


class CudaTimer:
    interleaves = False

    def __init__(self, warmup: int = 3, repeats: Optional[int] = None):
        self.warmup, self.repeats = warmup, repeats
        try:
            import triton.testing  # noqa: F401

            self._do_bench = triton.testing.do_bench
            self.name = "triton.testing.do_bench (median)"
        except ImportError:
            self._do_bench = None
            self.name = "CUDA events (median)"

    def measure(self, fn: Callable[[], object]) -> Timing:
        if self._do_bench is not None and self.repeats is None:
            return Timing(gpu_median_ms(fn, self._do_bench), None, None)
        for _ in range(self.warmup):
            fn()
        torch.cuda.synchronize()
        repeats = self.repeats or 20
        events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
                  for _ in range(repeats)]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize()
        times = [start.elapsed_time(end) for start, end in events]
        return Timing(statistics.median(times), min(times), repeats)

    def measure_group(self, fns: Sequence[Callable[[], object]]) -> list[Timing]:
        return [self.measure(fn) for fn in fns]


def timer_for(device: torch.device, warmup: Optional[int], repeats: Optional[int],
              cpu_min_repeats: int = 3):
    if device.type == "cuda":
        return CudaTimer(3 if warmup is None else warmup, repeats)
    return CpuTimer(0 if warmup is None else warmup, repeats, cpu_min_repeats)
