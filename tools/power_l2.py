"""What moving bytes out of L2 costs in board power, beside tensor-core work.

    python3 tools/power_l2.py [--seconds 3] [--out F.txt]

At the H200's 700 W cap a kernel's speed is its energy per unit of work (power_clocks.py).
Attention moves K / V from L2 to the SMs at ~5 TB/s (dense, 128-row tiles) to ~9 TB/s
(64-token block-sparse); whether that traffic is a large share of the power decides whether
sharing loads (TMA multicast in a cluster) could buy clock. For each workload, back to back
for --seconds after 1 s idle: median call time, bytes or FLOP per second, SM clock, board
power and limit reasons (NVML every 50 ms) over the second half. Workloads: idle; a Triton
read loop over an L2-resident buffer (ld.global.cg) and over an HBM-sized one; a bf16 GEMM.
Not a test; a diagnostic.
"""
import argparse
import time

import torch
import triton
import triton.language as tl

from power_clocks import measure, no_rate, tflop_rate
from report_text import emit

BLOCK = 4096  # fp32 per chunk: 16 KB, 16 values (four 16-byte loads) per thread of 8 warps


@triton.jit
def _read_loop(x_ptr, out_ptr, n_chunks, passes, BLOCK: tl.constexpr):
    pid, programs = tl.program_id(0), tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for _ in range(passes):
        for c in range(pid, n_chunks, programs):
            acc += tl.load(x_ptr + c * BLOCK + offs, cache_modifier=".cg")
    tl.store(out_ptr + pid * BLOCK + offs, acc)


def read_workload(megabytes: int, passes: int):
    n_chunks = megabytes * 2**20 // (4 * BLOCK)
    x = torch.randn(n_chunks * BLOCK, device="cuda")
    programs = torch.cuda.get_device_properties(0).multi_processor_count * 8
    out = torch.empty(programs * BLOCK, device="cuda")

    def run():
        _read_loop[(programs,)](x, out, n_chunks, passes, BLOCK=BLOCK, num_warps=8)
    return run, n_chunks * BLOCK * 4 * passes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=3.0)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    work = [("idle (sleep 1 ms)", lambda: time.sleep(1e-3), no_rate)]
    for mb, passes in ((16, 64), (24, 48), (4096, 1)):
        fn, nbytes = read_workload(mb, passes)
        work.append((f"read {mb} MB x {passes}", fn,
                     lambda ms, mhz, nbytes=nbytes: f"{nbytes / ms / 1e9:6.2f} TB/s"))
    work.append(("bf16 GEMM 8192^3", lambda: a @ b, tflop_rate(2 * 8192**3)))
    emit(measure(work, args.seconds, "power_l2"), args.out)


if __name__ == "__main__":
    main()
