"""Checks one attention case on the GPU against float64 by the project's rule (targets.md)
and names the kernel that ran: for narrowing down a failure to a case and an instance.

  python3 tools/sm90_varlen_probe.py --lq 384,0,1,200,64 --lk 77,5,0,128,1 --heads 26,2 \
      --causal 1
A single --lq / --lk value with --batch B runs the batched layout instead of varlen. Prints
one line per sequence (max abs error, the bf16 PyTorch error, the rule's bound) and the
kernels' names; exits 1 when a sequence misses the rule, 2 on a CUDA error."""
from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import os
import sys

import torch

import vidattn

# The tests' reference (PyTorch ops in the inputs' dtype, bottom-right causal) and rule, so
# that the probe judges as test_attention_sm90.py does.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
from test_attention_cuda import reference, rule_error  # noqa: E402


def rule(got, ref64, low, dtype):
    """(error, bound) by the tests' rule; an infinite error when the pattern of non-finite
    values differs from the reference's."""
    if not torch.equal(torch.isfinite(got), torch.isfinite(ref64)):
        return math.inf, 0.0
    err, _, bound = rule_error(got, ref64, low, dtype)
    return err, bound


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lq", required=True)
    ap.add_argument("--lk", required=True)
    ap.add_argument("--batch", type=int, default=0, help="batched layout of B sequences")
    ap.add_argument("--heads", default="26,2", help="Hq,Hkv")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--causal", type=int, default=0)
    ap.add_argument("--scale", type=float, default=4.0, help="q and k input scale")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cuda", help="cpu: the script's own check")
    a = ap.parse_args()
    lq = [int(x) for x in a.lq.split(",")]
    lk = [int(x) for x in a.lk.split(",")]
    Hq, Hkv = (int(x) for x in a.heads.split(","))
    D, dt, dev = a.dim, torch.bfloat16, a.device
    g = torch.Generator(device=dev)
    g.manual_seed(a.seed)

    def rnd(n, h, s):
        return (torch.randn((n, h, D), generator=g, device=dev) * s).to(dt)

    def cu(lengths):
        return torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=dev)

    if a.batch:
        lq, lk = lq * a.batch, lk * a.batch
    q, k, v = rnd(sum(lq), Hq, a.scale), rnd(sum(lk), Hkv, a.scale), rnd(sum(lk), Hkv, 1.0)
    prof = (torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA])
            if dev == "cuda" else contextlib.nullcontext())
    try:
        with prof:
            if a.batch:
                B = a.batch
                out, lse = vidattn.attention(q.view(B, lq[0], Hq, D), k.view(B, lk[0], Hkv, D),
                                             v.view(B, lk[0], Hkv, D), causal=bool(a.causal),
                                             return_lse=True)
                out = out.reshape(-1, Hq, D)
                lse = lse.permute(1, 0, 2).reshape(Hq, -1)
            else:
                out, lse = vidattn.attention_varlen(q, k, v, cu(lq), cu(lk), max(lq), max(lk),
                                                    causal=bool(a.causal), return_lse=True)
            if dev == "cuda":
                torch.cuda.synchronize()
    except RuntimeError as e:  # a CUDA error: sticky, nothing after it can run
        print(f"CUDA error: {e}".splitlines()[0])
        return 2
    names = sorted({e.name for e in prof.events() if "sm90_attention_fwd_kernel" in e.name}
                   if dev == "cuda" else ())
    for n in names:
        print("kernel:", n[:300])
    worst, oq, ok = 0, 0, 0
    sc = 1.0 / math.sqrt(D)
    for x, y in zip(lq, lk):
        pq, pk, pv = q[oq:oq + x], k[ok:ok + y], v[ok:ok + y]
        ref, ref_lse = reference(pq[None].double().cpu(), pk[None].double().cpu(),
                                 pv[None].double().cpu(), sc, bool(a.causal))
        low, low_lse = reference(pq[None], pk[None], pv[None], sc, bool(a.causal))
        e_o, b_o = rule(out[oq:oq + x][None].cpu(), ref, low.cpu(), dt)
        e_l, b_l = rule(lse[:, oq:oq + x][None].cpu(), ref_lse, low_lse.cpu(), dt)
        bad = e_o > b_o or e_l > b_l
        worst = max(worst, int(bad))
        print(f"seq ({x},{y}): out err {e_o:.3e} bound {b_o:.3e} | lse err {e_l:.3e} "
              f"bound {b_l:.3e}{'  FAIL' if bad else ''}")
        oq, ok = oq + x, ok + y
    return worst


if __name__ == "__main__":
    sys.exit(main())
