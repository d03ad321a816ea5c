"""The bench loop: for each shape, dtype, case and direction, one group of rows (one per
implementation), all on the same seeded inputs and checked against one float64 reference."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from . import reference
from .base import DTYPES, Case, Impl, dtype_of, to_layout
from .shapes import Shape

BWD_FLOP_FACTOR = 2.5  # backward FLOPs = 2.5 x forward, by convention


@dataclass
class Plan:
    shapes: Sequence[Shape]
    dtypes: Sequence[str]
    directions: Sequence[str]
    cases: Sequence[Case]
    device: torch.device
    timer: object
    seed: int = 0
    input_scale: float = 1.0
    ref_heads: Optional[int] = None
    clocks: Optional[object] = None  # clocks.ClockSampler, running while rows are timed

    def groups(self):
        for shape_index, shape in enumerate(self.shapes):
            for dtype in self.dtypes:
                for case in self.cases:
                    if case.accepts(shape):
                        yield shape_index, shape, dtype, case

    def directions_of(self, case: Case) -> list[str]:
        return [d for d in self.directions if d in case.directions]

    @property
    def row_count(self) -> int:
        return sum(len(self.directions_of(case)) * len(case.impls)
                   for _, _, _, case in self.groups())


def direction_flops(case: Case, shape: Shape, direction: str) -> float:
    flops = case.forward_flops(shape)
    return flops * BWD_FLOP_FACTOR if direction == "bwd" else flops


def _generator(device: torch.device, seed: int) -> torch.Generator:
    g = torch.Generator(device=device)
    g.manual_seed(seed)
    return g


@dataclass
class _Prepared:
    """An implementation ready to be timed: ``run`` repeats the measured call; ``results``
    are the outputs (fwd) or gradients (bwd) of its first call, for the accuracy check."""

    impl: Impl
    run: Callable[[], object]
    results: tuple[torch.Tensor, ...]


def _prepare(impl: Impl, inputs, direction: str, grad_out) -> _Prepared:
    if direction == "fwd":
        def run():
            with torch.no_grad():
                return impl.forward(inputs)

        return _Prepared(impl, run, (impl.to_common(run(), inputs),))
    leaves = inputs.requiring_grad()
    out = impl.forward(leaves)
    tensors = leaves.differentiable()

    def run():
        return torch.autograd.grad(out, tensors, grad_out, retain_graph=True)

    return _Prepared(impl, run, tuple(run()))


def _in_layout(inputs, grad_out, layout: str, memo: dict):
    """The group's inputs (and grad_out) in ``layout``, converted once per group."""
    if layout == "bshd" or not hasattr(inputs, "in_layout"):
        return inputs, grad_out
    if layout not in memo:
        memo[layout] = (inputs.in_layout(layout),
                        None if grad_out is None else to_layout(grad_out, layout))
    return memo[layout]


def _skipped(base: dict, note: str, status: str = "skipped") -> dict:
    return {**base, "status": status, "note": note}


def run_plan(plan: Plan, progress: Callable[[int], None] = lambda n: None,
             on_rows: Callable[[list[dict]], None] = lambda rows: None) -> list[dict]:
    """All rows; ``on_rows`` sees each group's rows as soon as they are done."""
    rows: list[dict] = []
    for shape_index, shape, dtype_name, case in plan.groups():
        dtype = dtype_of(dtype_name)
        # Seeded by position, so a row's inputs do not depend on which other rows run.
        seed = plan.seed * 1_000_003 + shape_index * 101 + list(DTYPES).index(dtype_name)
        gen = _generator(plan.device, seed)
        inputs = case.make_inputs(shape, dtype, plan.device, gen, plan.input_scale)
        for direction in plan.directions_of(case):
            group = _run_group(plan, case, shape, dtype, dtype_name, direction, inputs, gen)
            rows.extend(group)
            on_rows(group)
            progress(len(case.impls))
        del inputs
    return rows


def _run_group(plan, case, shape, dtype, dtype_name, direction, inputs, gen) -> list[dict]:
    flops = direction_flops(case, shape, direction)
    scope = reference.choose_scope(shape, direction, plan.device.type, plan.ref_heads)
    grad_out = case.make_grad_out(inputs, gen) if direction == "bwd" else None
    names = case.grad_names if direction == "bwd" else case.output_names
    references = {}  # one per kind the implementations that run ask for (most cases: one)

    rows, prepared, layouts = [], [], {}
    for impl in case.impls:
        base = {"case": case.name, "shape": shape.to_json(), "shape_label": shape.label,
                "impl": impl.name, "backend": impl.backend, "is_ours": impl.is_ours,
                "dtype": dtype_name, "direction": direction, "flops": flops,
                "ref_scope": scope.to_json()}
        reason = impl.unavailable_reason(plan.device)
        if reason:
            rows.append(_skipped(base, f"{impl.name}: {reason}", "unavailable"))
            continue
        reason = impl.skip_reason(plan.device, dtype, shape)
        if reason:
            rows.append(_skipped(base, reason))
            continue
        try:
            impl_inputs, impl_grad_out = _in_layout(inputs, grad_out, impl.layout, layouts)
            p = _prepare(impl, impl_inputs, direction, impl_grad_out)
        except NotImplementedError as e:
            rows.append(_skipped(base, f"{impl.name}: not implemented on "
                                       f"{plan.device.type} ({_first_line(e)})", "unavailable"))
            continue
        except Exception as e:  # no kernel for this configuration, out of memory, a peer's
            # compile error, ...: the row says why, the run goes on
            rows.append(_skipped(base, f"{impl.name}: {type(e).__name__}: {_first_line(e)}"))
            _free(plan.device)
            continue
        kind = impl.reference_kind
        if kind not in references:
            references[kind] = (case.reference_backward(inputs, grad_out, scope, kind)
                                if direction == "bwd" else case.reference_forward(inputs, scope,
                                                                                  kind))
        expected = references[kind]
        if direction == "bwd":
            p.results = case.common_grads(p.results, inputs)
        errors = {n: reference.max_abs_error(scope.take(r), e)
                  for n, r, e in zip(names, p.results, expected)}
        p.results = ()
        rows.append({**base, "status": "ok", "note": "", "errors": errors,
                     "max_abs_err": max(errors.values())})
        prepared.append((rows[-1], p))
        if not plan.timer.interleaves:  # GPU: time now, one graph alive at a time
            _time_or_skip(plan, prepared, flops)
            prepared.clear()
            _free(plan.device)
    if prepared:
        _time_or_skip(plan, prepared, flops)
    del layouts
    _compare_to_peer(rows, case.peer_order)
    _ratios_to_every_peer(rows)
    return rows


def _time_or_skip(plan: Plan, prepared, flops: float) -> None:
    try:
        _time(plan.timer, prepared, flops, plan.clocks)
    except Exception as e:  # e.g. out of memory while timing: keep the row, say why
        for row, p in prepared:
            for key in ("errors", "max_abs_err"):
                row.pop(key, None)
            row.update(status="skipped",
                       note=f"{p.impl.name}: timing failed: {type(e).__name__}: {_first_line(e)}")
        _free(plan.device)


def _time(timer, prepared, flops: float, clocks=None) -> None:
    started = time.monotonic()
    timings = timer.measure_group([p.run for _, p in prepared])
    # The GPU times one implementation per call; on the CPU nothing is sampled.
    seen = clocks.window(started, time.monotonic()) if clocks is not None else None
    for (row, _), t in zip(prepared, timings):
        row.update(median_ms=t.median_ms, min_ms=t.min_ms, repeats=t.repeats,
                   tflops=flops / (t.median_ms * 1e-3) / 1e12)
        if seen is not None:
            row["clocks"] = seen


def _compare_to_peer(rows: list[dict], peer_order: Sequence[str]) -> None:
    """ratio_to_peer = peer time / this time (> 1: faster than the peer); err_ratio_to_peer =
    this error / the peer's error (the accuracy rule compares the two)."""
    done = {r["impl"]: r for r in rows if r["status"] == "ok"}
    peer = next((done[name] for name in peer_order if name in done), None)
    for row in rows:
        row["peer"] = peer["impl"] if peer else None
        if row["status"] != "ok" or peer is None or row is peer:
            row["ratio_to_peer"] = row["err_ratio_to_peer"] = None
            continue
        row["ratio_to_peer"] = peer["median_ms"] / row["median_ms"]
        row["err_ratio_to_peer"] = (row["max_abs_err"] / peer["max_abs_err"]
                                    if peer["max_abs_err"] > 0 else None)
        row["peer_max_abs_err"] = peer["max_abs_err"]


def _ratios_to_every_peer(rows: list[dict]) -> None:
    """For every row: ``ratios_to_peers`` = {peer: peer time / this time} and
    ``err_ratios_to_peers`` = {peer: this error / the peer's error}, over every other peer
    (not vidattn) of the group that ran; empty for rows that did not run."""
    peers = [r for r in rows if r["status"] == "ok" and not r["is_ours"]]
    for row in rows:
        others = [p for p in peers if p is not row] if row["status"] == "ok" else []
        row["ratios_to_peers"] = {p["impl"]: p["median_ms"] / row["median_ms"] for p in others}
        row["err_ratios_to_peers"] = {p["impl"]: (row["max_abs_err"] / p["max_abs_err"]
                                                  if p["max_abs_err"] > 0 else None)
                                      for p in others}


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0][:160] if text else type(e).__name__


def _free(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()

