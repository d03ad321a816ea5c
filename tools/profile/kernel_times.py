"""GPU time per kernel of vidattn's dense attention forward and backward at one shape, from
torch.profiler (the median over a few calls after a warm-up): which kernel of a multi-kernel
op (the backward's preprocess, dK / dV and dQ kernels) holds the time.

    python3 tools/profile/kernel_times.py [--shape B,S,H,D[,causal]] [--calls 5]

Prints one line per kernel: calls, median microseconds per call, the share of the op, and the
TFLOP/s of the op as the bench counts them (backward FLOPs = 2.5 x forward)."""
import argparse
import statistics

import torch

import vidattn


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="1,39936,12,128")
    ap.add_argument("--calls", type=int, default=5)
    args = ap.parse_args()
    parts = args.shape.split(",")
    B, S, H, D = (int(x) for x in parts[:4])
    causal = len(parts) > 4 and parts[4] == "causal"
    g = torch.Generator(device="cuda")
    g.manual_seed(0)
    q, k, v, go = (torch.randn((B, S, H, D), generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = vidattn.attention(q, k, v, causal=causal)
    fwd_flops = 4 * B * H * S * S * D / (2 if causal else 1)
    for name, fn, flops in (
            ("forward", lambda: vidattn.attention(q, k, v, causal=causal), fwd_flops),
            ("backward", lambda: torch.autograd.grad(out, (q, k, v), go, retain_graph=True),
             2.5 * fwd_flops)):
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                fn()
            torch.cuda.synchronize()
        times = {}
        for e in prof.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                times.setdefault(e.name, []).append(e.device_time_total)
        total = sum(statistics.median(t) * len(t) / args.calls for t in times.values())
        print(f"{name} {args.shape}: {total:.0f} us per call, {flops / total / 1e6:.1f} TFLOP/s")
        for kname, t in sorted(times.items(), key=lambda kv: -statistics.median(kv[1])):
            med = statistics.median(t)
            share = med * len(t) / args.calls / total
            print(f"  {len(t) // args.calls:3d} x {med:10.1f} us  {100 * share:5.1f}%  {kname[:110]}")


if __name__ == "__main__":
    main()
