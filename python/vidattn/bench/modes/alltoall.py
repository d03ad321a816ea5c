"""All-to-all bandwidth of this machine's NCCL, alone and beside a compute kernel.

    torchrun --nproc_per_node 2 -m vidattn.bench alltoall [--sizes-mb 24,97,194] [--out F.json]

Why: DistributedAttention's VSA forward is short enough that its all-to-alls show
(docs/perf-notes.md). This separates what the transport can do (the collective alone) from
what it does next to attention (a bf16 matmul running on the compute stream meanwhile).
Sizes are the bytes each rank sends to the other ranks per call (the [world, ...] send
buffer minus its own slice), as DistributedAttention sends per tensor and head chunk.
NCCL settings come from the environment (NCCL_* variables: one run per setting) or from
--groups, process groups made in this run with communicator options (``max_ctas=8``: NCCL
kernels on at most 8 SMs; ``cta_policy=1``: NCCL's efficiency policy); the JSON records the
NCCL version and the settings seen.
Prints and writes: per size, median time (CUDA events) and GB/s sent per rank.
"""
from __future__ import annotations

import os
import statistics

import torch
import torch.distributed as dist

from .common import parser, result_doc, write_json
# The communicator options of the layer's benchmark: one spelling for both modes.
from .distributed import nccl_group


def timed(fn, iters: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        dist.barrier()
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main(argv) -> int:
    p = parser("alltoall", __doc__)
    p.add_argument("--sizes-mb", default="24,97,194")
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--out", default=None)
    p.add_argument("--label", default="")
    p.add_argument("--groups", default="default",
                   help="';'-separated process-group options to time, each 'default' or "
                        "'key=value,...' over max_ctas, min_ctas, cta_policy")
    args = p.parse_args(argv)
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(rank % torch.cuda.device_count())
    dev = torch.device("cuda")
    rows = []
    # Compute beside the collective: a matmul of ~the sparse kernel's duration per call.
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    comm = torch.cuda.Stream()
    configs = [(spec, nccl_group(spec)) for spec in args.groups.split(";")]
    for (spec, group), mb in ((c, float(x)) for c in configs for x in args.sizes_mb.split(",")):
        per_peer = int(mb * 2**20 / (world - 1)) // 2  # bf16 elements to each other rank
        send = torch.randn(world * per_peer, device=dev, dtype=torch.bfloat16)
        recv = torch.empty_like(send)

        def transfer():
            dist.all_to_all_single(recv, send, group=group)

        def alone():
            transfer()

        def beside():
            comm.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(comm):
                transfer()
            for _ in range(4):
                a @ a
            torch.cuda.current_stream().wait_stream(comm)

        def matmuls():
            for _ in range(4):
                a @ a

        t_alone = timed(alone, args.iters)
        t_mm = timed(matmuls, args.iters)
        t_beside = timed(beside, args.iters)
        sent = (world - 1) * per_peer * 2
        rows.append({"group": spec, "mb_sent_per_rank": sent / 2**20, "alone_ms": t_alone,
                     "alone_GBps": sent / t_alone / 1e6, "matmuls_ms": t_mm,
                     "beside_matmuls_ms": t_beside})
        if rank == 0:
            r = rows[-1]
            print(f"[{args.label} {spec}] {r['mb_sent_per_rank']:.0f} MB/rank: alone {t_alone:.3f} ms "
                  f"({r['alone_GBps']:.0f} GB/s); 4 matmuls {t_mm:.3f} ms; both "
                  f"{t_beside:.3f} ms", flush=True)
    if rank == 0 and args.out:
        nccl = ".".join(str(x) for x in torch.cuda.nccl.version())
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        write_json(args.out, result_doc("alltoall", argv, dev, label=args.label,
                                        gpu=torch.cuda.get_device_name(), world=world,
                                        nccl=nccl, env=env, rows=rows))
    dist.destroy_process_group()
    return 0
