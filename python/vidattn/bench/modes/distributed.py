"""Sequence-parallel efficiency of vidattn.DistributedAttention: 2 GPUs against 1.

    torchrun --nproc_per_node 2 -m vidattn.bench distributed          # Wan2.1-14B 720p, bf16
    torchrun --nproc_per_node 2 -m vidattn.bench distributed --check  # NCCL parity + compile first
    torchrun --nproc_per_node 2 -m vidattn.bench distributed --device cpu --grid 2x8x8 \
        --heads 4 --iters 2 --warmup 1                                # smoke test on CPU / gloo

(torchrun is python -m torch.distributed.run.)

Default shape: Wan2.1-14B at 720p, B=1, H=40, D=128, latent grid 21x45x80 -> 75,600 tokens
(37,800 per GPU), bf16, RoPE on q and k with full-sequence tables. Cases: dense
(vidattn.attention) and VSA (vidattn.video_sparse_attention, 4x4x4 tiles, sparsity 0.9, with
a gate), forward and backward.

time(1 GPU): rank 0 runs the layer on the whole sequence and all heads, alone (a one-rank
process group, so no collective; rank 1 waits); rank 1's GPU is timed alone the same way
after it and reported beside (efficiency_mean_1gpu uses the mean of the two). --rounds N
repeats the 1-GPU and 2-GPU timings N times, alternating, and reports medians over the
rounds: on 2x H200 medians of one configuration moved by up to 0.06 in efficiency within one
run. time(2 GPUs): both ranks run the layer on
their shards (all-to-all, attention on H/2 heads, reverse all-to-all); the slower rank's time
counts. efficiency = time(1 GPU) / (2 x time(2 GPUs)): 1.0 is perfect scaling (target >=
0.90). Forward is timed under no_grad; backward is the backward pass alone (the forward
before it is not in the time). Times are medians of CUDA-event timings over --iters after
--warmup.

--comm-priority high puts the world group's NCCL collectives on high-priority CUDA streams
(the GPU then schedules their CTAs ahead of a running kernel's waiting ones); a
--nccl-groups entry 'high_priority=1' (or 0) times a group of either kind beside it. On 2x
H200 it helped the VSA pipeline before its stages were ordered by arrival and is within
noise since (docs/perf-notes.md), so the default is torch's: plain streams.

--check first verifies, at the benchmark shape, that the 2-GPU output shard and the gradients
of q, k, v (and gate) equal the 1-GPU ones (max abs difference reported, must be within
--check-atol), and that torch.compile(fullgraph=True) of the layer has zero graph breaks and
matches eager. Results go to --out (default bench/results/<device>x2/distributed.json) and
stdout.
"""
from __future__ import annotations

import datetime
import json
import math
import os
import statistics
from pathlib import Path

import torch
import torch.distributed as dist

import vidattn

from .. import environment
from .common import parser


def parse_args(argv):
    p = parser("distributed", __doc__)
    p.add_argument("--grid", default="21x45x80", help="latent grid TxHxW (default Wan 720p)")
    p.add_argument("--heads", type=int, default=40)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    p.add_argument("--cases", default="dense,vsa", help="comma list of dense, vsa")
    p.add_argument("--directions", default="fwd,bwd", help="comma list of fwd, bwd")
    p.add_argument("--sparsity", type=float, default=0.9, help="VSA sparsity")
    p.add_argument("--tile", default="4x4x4", help="VSA tile")
    p.add_argument("--no-rope", action="store_true", help="skip RoPE in the layer")
    p.add_argument("--head-chunks", default="",
                   help="VSA: comma list of DistributedAttention head_chunks to time on 2 GPUs: "
                        "N (equal chunks) or sizes joined by ':' such as 2:8:8:2 (default: the "
                        "layer's default)")
    p.add_argument("--sm-margins", default="",
                   help="VSA: comma list of DistributedAttention sm_margin values to time on "
                        "2 GPUs (default: the layer's default)")
    p.add_argument("--nccl-groups", default="",
                   help="';'-separated NCCL communicator options for the 2-GPU layer's group, "
                        "each 'default' or 'key=value,...' over max_ctas, min_ctas, cta_policy, "
                        "high_priority "
                        "(e.g. 'default;max_ctas=8'); every case and direction is timed with "
                        "each (default: the world group only)")
    p.add_argument("--trace", default=None,
                   help="also write a torch.profiler (kineto) Chrome trace of 3 2-GPU steps of "
                        "each case and direction to TRACE.<case>-<dir>.rank<r>.json")
    p.add_argument("--comm-priority", default="default", choices=["high", "default"],
                   help="CUDA stream priority of the world group's NCCL collectives")
    p.add_argument("--rounds", type=int, default=1,
                   help="repeat the 1-GPU and 2-GPU timings this many times, alternating, and "
                        "report the medians (and every round)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--check", action="store_true",
                   help="verify 2-GPU vs 1-GPU parity and compile (fullgraph) before timing")
    p.add_argument("--check-atol", type=float, default=0.0,
                   help="allowed max abs difference in --check (default: bit-identical)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"],
                   help="cuda (NCCL) or cpu (gloo, for a smoke test)")
    p.add_argument("--out", default=None,
                   help="JSON path (default bench/results/<device>x<world>/distributed.json)")
    return p.parse_args(argv)


def nccl_options(spec: str):
    """ProcessGroupNCCL options from spec ('max_ctas=8,cta_policy=1'; 'high_priority=1' puts
    the group's collectives on a high-priority stream, whose CTAs the GPU schedules ahead of
    a running kernel's)."""
    opts = dist.ProcessGroupNCCL.Options()
    for item in spec.split(","):
        key, value = item.split("=")
        if key.strip() == "high_priority":  # NCCL's stream: high priority (a torch option)
            opts.is_high_priority_stream = bool(int(value))
        else:
            setattr(opts.config, key.strip(), int(value))
    return opts


def nccl_group(spec: str):
    """None (the world group) or a new NCCL group of both ranks with the options in spec
    (nccl_options)."""
    if spec == "default" or not dist.is_nccl_available():
        return None
    return dist.new_group(backend="nccl", pg_options=nccl_options(spec))


def dims(text):
    values = tuple(int(x) for x in text.lower().split("x"))
    if len(values) != 3:
        raise SystemExit(f"expected TxHxW, got {text!r}")
    return values


class Bench:
    def __init__(self, args):
        self.args = args
        self.rank, self.world = dist.get_rank(), dist.get_world_size()
        if self.world != 2:
            raise SystemExit(f"run with torchrun --nproc_per_node 2 (got world size {self.world})")
        if args.device == "cuda":
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", self.rank)))
            torch.cuda.set_device(self.device)
        else:
            self.device = torch.device("cpu")
        self.dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
        self.grid = dims(args.grid)
        self.tokens = math.prod(self.grid)
        if self.tokens % self.world or args.heads % self.world:
            raise SystemExit("tokens and heads must be divisible by 2 for this benchmark")
        # Every rank creates every group; the one-rank group gives the 1-GPU layer (no collective).
        solo = [dist.new_group([0]), dist.new_group([1])]
        self.solo = solo[self.rank]
        # 2-GPU groups with NCCL communicator options (--nccl-groups), made by every rank.
        self.nccl_groups = {spec: nccl_group(spec) for spec in args.nccl_groups.split(";") if spec}
        gen = torch.Generator().manual_seed(0)
        b, h, d = args.batch, args.heads, args.head_dim
        full = lambda: torch.randn(b, self.tokens, h, d, generator=gen).to(self.device, self.dtype)  # noqa: E731
        self.q, self.k, self.v, self.gate, self.grad_out = (full() for _ in range(5))
        theta = torch.rand(self.tokens, d // 2, generator=gen) * 2 * math.pi
        self.cos, self.sin = theta.cos().to(self.device), theta.sin().to(self.device)
        n = self.tokens // self.world
        self.rows = slice(self.rank * n, (self.rank + 1) * n)

    # -- layers and inputs ----------------------------------------------------------------
    def layer(self, case, group, config=None):
        config = dict(config or {})
        if "nccl" in config:
            group = self.nccl_groups[config.pop("nccl")]
        if case == "dense":
            return vidattn.DistributedAttention("dense", group=group)
        tiling = vidattn.VideoTiling(grid=self.grid, tile=dims(self.args.tile), device=self.device)
        return vidattn.DistributedAttention("vsa", group=group, tiling=tiling,
                                            sparsity=self.args.sparsity, **config)

    def configs(self, case):
        """The 2-GPU layer settings to time: the defaults, or the --head-chunks x
        --sm-margins sweep for VSA; each with every --nccl-groups group."""
        groups = [{"nccl": spec} for spec in self.nccl_groups] or [{}]
        return [dict(layer, **g) for layer in self._layer_configs(case) for g in groups]

    def _layer_configs(self, case):
        if case != "vsa":
            return [{}]
        # "2" -> 2 equal chunks; "2:8:8:2" -> chunks of those head counts.
        chunks = [int(c) if ":" not in c else tuple(int(n) for n in c.split(":"))
                  for c in self.args.head_chunks.split(",") if c] or [None]
        margins = [int(m) for m in self.args.sm_margins.split(",") if m] or [None]
        return [{k: v for k, v in (("head_chunks", c), ("sm_margin", m)) if v is not None}
                for c in chunks for m in margins]

    def inputs(self, case, sharded, requires_grad):
        rows = self.rows if sharded else slice(None)
        names = ["q", "k", "v"] + (["gate"] if case == "vsa" else [])
        xs = {n: getattr(self, n)[:, rows].clone().requires_grad_(requires_grad) for n in names}
        kwargs = {} if self.args.no_rope else {"cos": self.cos, "sin": self.sin}
        if case == "vsa":
            kwargs["gate"] = xs["gate"]
        return xs, kwargs

    # -- timing ------------------------------------------------------------------------------
    def _sync(self):
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _timer(self):
        if self.device.type == "cuda":
            return torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        return None

    def time_ms(self, case, direction, sharded, group, config=None):
        """Median ms of one forward (no_grad) or one backward on this rank."""
        layer = self.layer(case, group, config)
        grad_out = self.grad_out[:, self.rows] if sharded else self.grad_out
        times = []
        for it in range(self.args.warmup + self.args.iters):
            if direction == "fwd":
                xs, kwargs = self.inputs(case, sharded, False)
                self._sync()
                t0 = self._start()
                with torch.no_grad():
                    layer(xs["q"], xs["k"], xs["v"], **kwargs)
            else:
                xs, kwargs = self.inputs(case, sharded, True)
                out = layer(xs["q"], xs["k"], xs["v"], **kwargs)
                self._sync()
                t0 = self._start()
                out.backward(grad_out)
            elapsed = self._stop(t0)
            if it >= self.args.warmup:
                times.append(elapsed)
        return statistics.median(times)

    def _start(self):
        import time
        events = self._timer()
        if events:
            events[0].record()
            return events
        return time.perf_counter()

    def _stop(self, t0):
        import time
        if isinstance(t0, tuple):
            t0[1].record()
            t0[1].synchronize()
            return t0[0].elapsed_time(t0[1])
        return (time.perf_counter() - t0) * 1e3

    def trace(self, case, direction, path_prefix):
        """A Chrome trace (CUDA kernels per stream, NCCL included) of 3 steps on 2 GPUs with
        the layer's default settings, one file per rank."""
        from torch.profiler import ProfilerActivity, profile
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            saved = self.args.iters, self.args.warmup
            self.args.iters, self.args.warmup = 3, 1
            try:
                self.time_ms(case, direction, sharded=True, group=None)
            finally:
                self.args.iters, self.args.warmup = saved
        prof.export_chrome_trace(f"{path_prefix}.{case}-{direction}.rank{self.rank}.json")
        dist.barrier()

    def measure(self, case, direction):
        """One row per 2-GPU configuration. Each of --rounds rounds times rank 0's GPU alone,
        rank 1's GPU alone (two GPUs of one host differ by a few percent, and the slower
        one sets the 2-GPU pace), then every 2-GPU configuration; a row's times are the
        medians over the rounds (each round's are kept), so that drift over a run (the GPUs
        warming up) does not favour whatever was timed first."""
        configs = self.configs(case)
        solo_rounds, pair_rounds = [], [[] for _ in configs]
        for _ in range(self.args.rounds):
            solo = torch.zeros(2, dtype=torch.float64, device=self.device)
            for r in range(2):
                if self.rank == r:
                    solo[r] = self.time_ms(case, direction, sharded=False, group=self.solo)
                dist.barrier()
            dist.all_reduce(solo)
            solo_rounds.append(solo.tolist())
            for times, config in zip(pair_rounds, configs):
                two_gpu = torch.tensor(
                    [self.time_ms(case, direction, sharded=True, group=None, config=config)],
                    dtype=torch.float64, device=self.device)
                dist.all_reduce(two_gpu, op=dist.ReduceOp.MAX)  # the slower rank sets the pace
                dist.barrier()
                times.append(two_gpu.item())
        by_gpu = [statistics.median(r[i] for r in solo_rounds) for i in range(2)]
        one_gpu = by_gpu[0]
        rows = []
        for config, times in zip(configs, pair_rounds):
            t2 = statistics.median(times)
            rows.append({"case": case, "direction": direction, "layer_config": config,
                         "time_1gpu_ms": one_gpu, "time_1gpu_ms_by_gpu": by_gpu,
                         "time_2gpu_ms": t2, "efficiency": one_gpu / (2 * t2),
                         "efficiency_mean_1gpu": sum(by_gpu) / 2 / (2 * t2),
                         "rounds": {"time_1gpu_ms_by_gpu": solo_rounds, "time_2gpu_ms": times,
                                    "efficiency": [s[0] / (2 * t) for s, t in
                                                   zip(solo_rounds, times)]}})
        return rows if self.rank == 0 else []

    def unsupported(self, case):
        """None when this build runs `case` at this dtype / head dim on the device, else the
        reason. Probed on a tiny local problem by every rank (no collective), then agreed on,
        so no rank waits in a collective for one that failed."""
        reason = None
        try:
            gen = torch.Generator().manual_seed(1)
            x = torch.randn(1, 64, 1, self.args.head_dim, generator=gen).to(self.device, self.dtype)
            if case == "dense":
                vidattn.attention(x, x, x)
            else:
                tiling = vidattn.VideoTiling(grid=(4, 4, 4), tile=(4, 4, 4), device=self.device)
                vidattn.video_sparse_attention(x, x, x, tiling=tiling, topk=1, gate=x)
        except (NotImplementedError, AttributeError) as e:
            reason = f"{type(e).__name__}: {e}"
        flag = torch.tensor([0.0 if reason else 1.0], device=self.device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        if flag.item() == 0.0 and reason is None:
            reason = "not supported on the other rank"
        return reason

    # -- parity and compile ----------------------------------------------------------------
    def run_layer(self, layer, case, sharded):
        xs, kwargs = self.inputs(case, sharded, True)
        out = layer(xs["q"], xs["k"], xs["v"], **kwargs)
        out.backward(self.grad_out[:, self.rows] if sharded else self.grad_out)
        return {"out": out.detach(), **{"d" + n: x.grad for n, x in xs.items()}}

    def check(self, case):
        """2-GPU shard vs the 1-GPU result (each rank computes the latter itself), and
        compile(fullgraph=True): zero graph breaks, same output and gradients as eager."""
        # Each rank computes the full 1-GPU reference itself, on its own one-rank group.
        groups = [dist.new_group([0]), dist.new_group([1])]
        ref = self.run_layer(self.layer(case, groups[self.rank]), case, sharded=False)
        got = self.run_layer(self.layer(case, None), case, sharded=True)
        diffs = {name: (got[name].float() - ref[name][:, self.rows].float()).abs().max().item()
                 for name in got}
        layer = self.layer(case, None)
        xs, kwargs = self.inputs(case, True, False)
        explanation = torch._dynamo.explain(layer)(xs["q"], xs["k"], xs["v"], **kwargs)
        torch._dynamo.reset()
        compiled = torch.compile(layer, fullgraph=True)
        got_compiled = self.run_layer(compiled, case, sharded=True)
        compile_diffs = {name: (got_compiled[name].float() - got[name].float()).abs().max().item()
                         for name in got}
        result = torch.tensor([max(diffs.values()), max(compile_diffs.values()),
                               explanation.graph_break_count], dtype=torch.float64,
                              device=self.device)
        dist.all_reduce(result, op=dist.ReduceOp.MAX)
        worst, worst_compiled, breaks = result.tolist()
        ok = worst <= self.args.check_atol and breaks == 0 and worst_compiled <= max(
            self.args.check_atol, 1e-2)
        return {"case": case, "max_abs_diff_2gpu_vs_1gpu": worst,
                "per_tensor_rank_local": diffs, "graph_breaks": int(breaks),
                "max_abs_diff_compiled_vs_eager": worst_compiled, "ok": ok}


def main(argv) -> int:
    args = parse_args(argv)
    backend = "nccl" if args.device == "cuda" else "gloo"
    options = None
    if backend == "nccl":
        options = nccl_options(f"high_priority={int(args.comm_priority == 'high')}")
    dist.init_process_group(backend, timeout=datetime.timedelta(minutes=30),
                            pg_options=options)
    try:
        bench = Bench(args)
        cases = [c for c in args.cases.split(",") if c]
        directions = [d for d in args.directions.split(",") if d]
        report = {"comm_priority": args.comm_priority,
                  "shape": {"batch": args.batch, "grid": bench.grid, "tokens": bench.tokens,
                            "heads": args.heads, "head_dim": args.head_dim, "dtype": args.dtype,
                            "rope": not args.no_rope, "vsa_sparsity": args.sparsity,
                            "vsa_tile": args.tile},
                  "statistic": f"median of {args.iters} timings after {args.warmup} warm-ups",
                  "checks": [], "rows": []}
        skipped = {case: bench.unsupported(case) for case in cases}
        report["skipped"] = {case: why for case, why in skipped.items() if why}
        if bench.rank == 0:
            for case, why in report["skipped"].items():
                print(f"{case}: skipped ({why})", flush=True)
        cases = [case for case in cases if not skipped[case]]
        if args.check:
            for case in cases:
                report["checks"].append(bench.check(case))
                if bench.rank == 0:
                    print(json.dumps(report["checks"][-1]), flush=True)
        for case in cases:
            for direction in directions:
                if args.trace:
                    bench.trace(case, direction, args.trace)
                for row in bench.measure(case, direction):
                    report["rows"].append(row)
                    print(f"{case:6s} {direction} {row['layer_config'] or ''}: 1 GPU "
                          f"{row['time_1gpu_ms']:9.2f} ms (GPU 1 alone "
                          f"{row['time_1gpu_ms_by_gpu'][1]:.2f})   2 GPUs "
                          f"{row['time_2gpu_ms']:9.2f} ms   efficiency {row['efficiency']:.3f} "
                          f"(against the mean 1-GPU time {row['efficiency_mean_1gpu']:.3f})"
                          + (f"; rounds {', '.join(f'{e:.3f}' for e in row['rounds']['efficiency'])}"
                             if args.rounds > 1 else ""), flush=True)
        if bench.rank == 0:
            report["environment"] = environment.metadata(
                bench.device, torch.get_num_threads(), ["distributed", *argv])
            name = f"{report['environment']['device']}x{bench.world}"
            out = Path(args.out) if args.out else (
                environment.repo_root() / "bench" / "results" / name / "distributed.json")
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_text(json.dumps(report, indent=2) + "\n")
            print(f"wrote {out}")
            if args.check and not all(c["ok"] for c in report["checks"]):
                raise SystemExit("parity / compile check failed: see 'checks' in the JSON")
    finally:
        dist.destroy_process_group()
    return 0
