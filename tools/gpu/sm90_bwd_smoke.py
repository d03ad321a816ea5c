"""Small sm_90a backward runs for compute-sanitizer and as a first check of a new backward
build: dense (D = 64 / 128, bf16 / fp16, causal, GQA, padding masks, varlen with empty
sequences) and block-sparse (tiles of 64 and 128 tokens), each with deterministic=True (a
dK / dV and a dQ kernel) and False (one kernel reducing dQ into an fp32 workspace). Exits
non-zero on non-finite gradients, when the two ways disagree by more than a bf16 rounding
of the gradients' scale, or when the sm90 backward did not run. Needs an op library built
with VIDATTN_TESTING=ON (the launch counter)."""
import sys

import torch

import vidattn


def main() -> int:
    g = torch.Generator(device="cuda")
    g.manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device="cuda").to(dtype)

    def grads(fn, inputs, deterministic):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = fn(*leaves, deterministic)
        return torch.autograd.grad(out, leaves, torch.ones_like(out))

    problems = []
    for dtype in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            q, k, v = rnd(2, 150, 4, D, dtype=dtype), rnd(2, 190, 2, D, dtype=dtype), \
                rnd(2, 190, 2, D, dtype=dtype)
            kmask = torch.rand((2, 190), generator=g, device="cuda") > 0.3
            qmask = torch.rand((2, 150), generator=g, device="cuda") > 0.2
            problems.append((lambda q, k, v, d, km=kmask, qm=qmask: vidattn.attention(
                q, k, v, causal=True, key_padding_mask=km, query_padding_mask=qm,
                deterministic=d), (q, k, v)))
            problems.append((lambda q, k, v, d: vidattn.attention(q, k, v, deterministic=d),
                             (q, k, v)))
            cu_q = torch.tensor([0, 10, 10, 205], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, 5, 137, 300], dtype=torch.int32, device="cuda")
            qv, kv, vv = rnd(205, 4, D, dtype=dtype), rnd(300, 2, D, dtype=dtype), \
                rnd(300, 2, D, dtype=dtype)
            problems.append((lambda q, k, v, d, cq=cu_q, ck=cu_k: vidattn.attention_varlen(
                q, k, v, cq, ck, 195, 163, causal=True, deterministic=d), (qv, kv, vv)))
    for tile in (64, 128):
        tiles = 6
        q, k = rnd(1, tiles * tile, 4, 128), rnd(1, tiles * tile, 2, 128)
        index = torch.tensor([0, 2, 5], dtype=torch.int32, device="cuda").expand(
            1, 4, tiles, 3).contiguous()
        count = torch.randint(0, 4, (1, 4, tiles), generator=g, device="cuda",
                              dtype=torch.int32)
        sizes = torch.tensor([tile, 1, tile, 0, tile, tile // 2], dtype=torch.int32,
                             device="cuda")
        problems.append((lambda q, k, v, d, i=index, c=count, s=sizes, t=tile:
                         vidattn.block_sparse_attention(q, k, v, i, c, tile_volume=t,
                                                        kv_block_sizes=s, deterministic=d),
                         (q, k, k)))
    before = torch.ops.vidattn._sm90_backward_launches()
    bad = []
    for i, (fn, inputs) in enumerate(problems):
        det, nondet = grads(fn, inputs, True), grads(fn, inputs, False)
        for name, a, b in zip(("dq", "dk", "dv"), det, nondet):
            a, b = a.float(), b.float()
            if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
                bad.append((i, name, "non-finite"))
            elif ((a - b).abs() > 2.0 ** -6 * a.abs().amax() + 1e-6).any():
                bad.append((i, name, float((a - b).abs().max())))
    torch.cuda.synchronize()
    launched = torch.ops.vidattn._sm90_backward_launches() - before
    print("sm90_bwd_smoke: problems", len(problems), "sm90 backward launches", launched,
          "bad", bad)
    return 1 if bad or launched < 2 * len(problems) else 0


if __name__ == "__main__":
    sys.exit(main())
