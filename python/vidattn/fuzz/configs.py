"""Random configurations of every op, each checked against the float64 reference with the
accuracy rule of docs/conventions.md: the kernel's largest error against float64 is at most
2x (3x for dQ) the error of the same math run in the kernel's dtype, plus a rounding floor.

A configuration is a dict of plain values drawn from one integer seed, so `run_config(op,
seed, device)` rebuilds it anywhere: that call is the one-line repro a failure prints.
"""
from __future__ import annotations

import math
import random

import torch

from . import reference as ref

OPS = ("dense", "varlen", "block_sparse", "vsa", "rope", "combine")
EPS32 = torch.finfo(torch.float32).eps


class Unsupported(Exception):
    """The backend turned the configuration down with a clear NotImplementedError."""


class Mismatch(AssertionError):
    pass


def dtypes_for(device: str):
    # The CPU backend takes every float dtype; the CUDA kernels take 16-bit ones (others give
    # a clear NotImplementedError, which the fuzz counts as unsupported, not as a failure).
    if device == "cpu":
        return (torch.float32, torch.float64, torch.bfloat16, torch.float16)
    return (torch.bfloat16, torch.float16)


def head_dims_for(device: str):
    # CUDA: the exact widths twice as often, then dims of the padded instances (72, 96 on
    # width 128; 160 with v at most 128 on 192 / 128; 256).
    return (8, 16, 24, 32, 40, 64) if device == "cpu" else (64, 128, 64, 128, 72, 96, 160, 256)


def draw(op: str, seed: int, device: str) -> dict:
    r = random.Random(f"{op}:{seed}")
    dtype = r.choice(dtypes_for(device))
    hkv = r.choice((1, 1, 2, 3))
    cfg = dict(op=op, seed=seed, dtype=str(dtype).replace("torch.", ""),
               hkv=hkv, hq=hkv * r.choice((1, 1, 2, 3)),
               d=r.choice(head_dims_for(device)), scale_in=r.choice((1.0, 4.0, 16.0)),
               backward=r.random() < 0.6)
    cfg["dv"] = cfg["d"] if r.random() < 0.7 else r.choice(head_dims_for(device))
    if op == "dense":
        cfg.update(b=r.choice((1, 1, 2, 3)), sq=r.choice((1, 2, 17, 64, 65, 130, 257)),
                   sk=r.choice((1, 3, 17, 64, 129, 200, 300)), causal=r.random() < 0.4,
                   kmask=r.random() < 0.3, qmask=r.random() < 0.2)
    elif op == "varlen":
        n = r.choice((1, 2, 3, 5))
        cfg.update(lens_q=[r.choice((0, 1, 7, 33, 64, 100, 150)) for _ in range(n)],
                   causal=r.random() < 0.4, same_lengths=r.random() < 0.3)
        cfg["lens_k"] = (list(cfg["lens_q"]) if cfg["same_lengths"] else
                         [r.choice((0, 1, 9, 64, 120)) for _ in range(n)])
    elif op in ("block_sparse", "vsa", "combine"):
        cfg.update(volume=r.choice((64, 64, 128)) if op != "vsa" else 64,
                   q_tiles=r.choice((1, 2, 3, 5)), kv_tiles=r.choice((1, 2, 4, 6)),
                   b=r.choice((1, 2)), gate=r.random() < 0.5)
        if op == "vsa":
            cfg.update(b=1, grid=(r.choice((2, 4, 5)), r.choice((4, 6, 8)), r.choice((4, 7, 8))))
    elif op == "rope":
        cfg.update(b=r.choice((1, 2)), s=r.choice((1, 5, 33, 100)), d=r.choice((2, 8, 64, 128)),
                   half=r.random() < 0.5, interleaved=r.random() < 0.5)
    return cfg


# ---- the accuracy rule ------------------------------------------------------------------

def ulp_floor(dtype, reference):
    """The rule's floor: one unit in the last place of `dtype` at the tensor's largest
    magnitude. The kernel rounds each stored value to `dtype` once (at most half an ulp),
    and at tiny sizes (one key, a single visible key) the low-precision baseline can be
    exact, so 2x its error alone would demand a bit-exact kernel. One ulp covers that final
    rounding without hiding a real error (a wrong row or mask is off by O(1))."""
    finite = reference[torch.isfinite(reference)]
    top = finite.abs().max().item() if finite.numel() else 0.0
    if top == 0.0:
        return 0.0
    return torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(top))


def check(name, kernel, reference, baseline, dtype, factor=2.0, extra_floor=0.0):
    kernel = kernel.detach().cpu().double()
    reference = reference.detach().cpu().double()
    if kernel.shape != reference.shape:
        raise Mismatch(f"{name}: shape {tuple(kernel.shape)} != {tuple(reference.shape)}")
    bad = torch.isfinite(kernel) != torch.isfinite(reference)
    if bad.any():
        raise Mismatch(f"{name}: non-finite elements differ from the reference "
                       f"({int(bad.sum())} of {kernel.numel()})")
    keep = torch.isfinite(reference)
    if kernel.numel() == 0 or not keep.any():
        return
    err = (kernel[keep] - reference[keep]).abs().max().item()
    if dtype == torch.float64:
        bound = 1e-10 * max(1.0, reference[keep].abs().max().item())
    else:
        base = (baseline.detach().cpu().double()[keep] - reference[keep]).abs().max().item()
        if not math.isfinite(base):
            raise Mismatch(f"{name}: the low-precision baseline is not finite")
        bound = factor * base + ulp_floor(dtype, reference) + extra_floor
    if not err <= bound:
        raise Mismatch(f"{name}: error {err:.3e} > bound {bound:.3e}")


def _top(x):
    finite = x[torch.isfinite(x)]
    return finite.abs().max().item() if finite.numel() else 0.0


def logit_floor(logit_max, value_max):
    """The float32 rounding of the logits, which every kernel makes (the CPU one also rounds
    q * scale once) and a baseline in a 16-bit dtype hides but a float32 one does not: logits
    off by eps32 * |s|max move each probability by at most 2 eps32 |s|max relative, so the
    output by 4 eps32 |s|max max|v|."""
    return 4.0 * EPS32 * logit_max * value_max


def grad_floor(reference, logit_max):
    """The logits' float32 rounding (logit_floor) carried into a gradient: the same relative
    error of the probabilities, at the gradient's magnitude."""
    return 4.0 * EPS32 * _top(reference) * logit_max


# ---- one configuration --------------------------------------------------------------------

def _randn(gen, shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(device, dtype)


def _call(fn):
    try:
        return fn()
    except NotImplementedError as e:
        raise Unsupported(str(e).splitlines()[0] if str(e) else "NotImplementedError") from None


def _compare(name, cfg, device, inputs, run_kernel, run_ref, floors=None, attention=True):
    """Forward (and, with cfg['backward'], backward) of one op against float64 and the
    dtype baseline. inputs: list of tensors (float64, CPU) that take gradients; floors(xs,
    dout) gives the flash-style backward's float32 floors of their gradients
    (reference.backward_floors), in input order."""
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator().manual_seed(cfg["seed"] + 1)
    # The reference and the baseline run where the kernel does (float64 on a GPU is the same
    # math, and fast enough for the long run's 10,000 configurations).
    # The inputs are rounded to the kernel's dtype first: the reference sees the very values
    # the kernel does, so that the error measured is the kernel's alone.
    inputs = [x.to(dtype).to(torch.float64) for x in inputs]

    def leaves(dt):  # fresh leaf tensors: .to() may return its input itself
        return [x.detach().to(device, dt).clone().requires_grad_(cfg["backward"])
                for x in inputs]

    xk, xr, xb = leaves(dtype), leaves(torch.float64), leaves(dtype)
    logit_max = value_max = 0.0
    if attention and inputs[0].numel() and inputs[1].numel():
        # inputs are q, k, v: the largest scaled logit |q . k| / sqrt(D), over every pair
        q, k = (x if x.dim() == 4 else x[None] for x in inputs[:2])
        k = k.repeat_interleave(q.shape[2] // k.shape[2], 2)
        logit_max = torch.einsum("bihd,bjhd->bhij", q, k).abs().max().item() / q.shape[-1] ** 0.5
        value_max = _top(inputs[2])
    out = _call(lambda: run_kernel(*xk))
    with torch.enable_grad():
        out_r = run_ref(*xr)
        out_b = run_ref(*xb)
    check(f"{name}.out", out, out_r, out_b, dtype, extra_floor=logit_floor(logit_max, value_max))
    if not cfg["backward"] or out.numel() == 0:
        return
    dout = _randn(gen, out.shape, torch.float64, device)
    _call(lambda: out.backward(dout.to(dtype)))
    out_r.backward(dout)
    out_b.backward(dout.to(dtype))
    extra = list(floors([x.detach() for x in xr], dout)) if floors else []
    extra += [0.0] * (len(xr) - len(extra))
    for i, (a, r_, b_) in enumerate(zip(xk, xr, xb)):
        if r_.grad is None:
            continue
        factor = 3.0 if i == 0 else 2.0
        check(f"{name}.grad{i}", a.grad if a.grad is not None else torch.zeros_like(r_),
              r_.grad, b_.grad, dtype, factor, extra[i] + grad_floor(r_.grad, logit_max))


def run_config(op: str, seed: int, device: str = "cpu") -> dict:
    """Builds and checks one configuration; raises Mismatch / Unsupported / any error."""
    import vidattn

    cfg = draw(op, seed, device)
    dtype = getattr(torch, cfg["dtype"])
    gen = torch.Generator().manual_seed(seed)
    s_in = cfg["scale_in"]
    hq, hkv, d, dv = cfg["hq"], cfg["hkv"], cfg["d"], cfg["dv"]

    def rn(*shape, scale=s_in):
        return _randn(gen, shape, torch.float64, "cpu", scale)

    if op == "dense":
        b, sq, sk = cfg["b"], cfg["sq"], cfg["sk"]
        kmask = (torch.rand(b, sk, generator=gen) < 0.7) if cfg["kmask"] else None
        qmask = (torch.rand(b, sq, generator=gen) < 0.8) if cfg["qmask"] else None
        allowed = ref.dense_allowed(b, sq, sk, cfg["causal"], kmask, qmask)
        sc = 1.0 / math.sqrt(d)
        _compare(f"dense{cfg}", cfg, device, [rn(b, sq, hq, d), rn(b, sk, hkv, d), rn(b, sk, hkv, dv, scale=1.0)],
                 lambda q, k, v: vidattn.attention(
                     q, k, v, causal=cfg["causal"],
                     key_padding_mask=None if kmask is None else kmask.to(device),
                     query_padding_mask=None if qmask is None else qmask.to(device)),
                 lambda q, k, v: ref.attention(q, k, v, allowed, sc),
                 lambda xs, do: ref.backward_floors(*xs, do, allowed, sc, dtype))
    elif op == "varlen":
        lq, lk = cfg["lens_q"], cfg["lens_k"]
        cu_q = [0]
        cu_k = [0]
        for a, c in zip(lq, lk):
            cu_q.append(cu_q[-1] + a)
            cu_k.append(cu_k[-1] + c)
        tq, tk = cu_q[-1], cu_k[-1]
        sc = 1.0 / math.sqrt(d)
        cq = torch.tensor(cu_q, dtype=torch.int32, device=device)
        ck = torch.tensor(cu_k, dtype=torch.int32, device=device)
        _compare(f"varlen{cfg}", cfg, device, [rn(tq, hq, d), rn(tk, hkv, d), rn(tk, hkv, dv, scale=1.0)],
                 lambda q, k, v: vidattn.attention_varlen(
                     q, k, v, cq, ck, max(lq), max(lk), causal=cfg["causal"]),
                 lambda q, k, v: ref.varlen(q, k, v, cu_q, cu_k, cfg["causal"], sc),
                 lambda xs, do: ref.varlen_floors(*xs, do, cu_q, cu_k, cfg["causal"], sc, dtype))
    elif op == "block_sparse":
        b, V, qt, kt = cfg["b"], cfg["volume"], cfg["q_tiles"], cfg["kv_tiles"]
        q_sizes = torch.randint(0, V + 1, (qt,), generator=gen, dtype=torch.int32)
        kv_sizes = torch.randint(0, V + 1, (kt,), generator=gen, dtype=torch.int32)
        q_sizes[0], kv_sizes[-1] = V, V  # at least one full tile of each
        maxk = min(kt, 3)
        idx = torch.full((b, hq, qt, maxk), -1, dtype=torch.int32)
        cnt = torch.randint(0, maxk + 1, (b, hq, qt), generator=gen, dtype=torch.int32)
        for bi in range(b):
            for h in range(hq):
                for t in range(qt):
                    sel = torch.randperm(kt, generator=gen)[: int(cnt[bi, h, t])].sort().values
                    idx[bi, h, t, : len(sel)] = sel.int()
        sc = 1.0 / math.sqrt(d)
        _compare(f"block_sparse{cfg}", cfg, device,
                 [rn(b, qt * V, hq, d), rn(b, kt * V, hkv, d), rn(b, kt * V, hkv, dv, scale=1.0)],
                 lambda q, k, v: vidattn.block_sparse_attention(
                     q, k, v, idx.to(device), cnt.to(device), tile_volume=V,
                     q_block_sizes=q_sizes.to(device), kv_block_sizes=kv_sizes.to(device)),
                 lambda q, k, v: ref.block_sparse(q, k, v, idx, cnt, V, q_sizes, kv_sizes, sc),
                 lambda xs, do: ref.backward_floors(
                     *xs, do, ref.block_sparse_allowed(b, hq, idx, cnt, V, q_sizes, kv_sizes), sc,
                     dtype))
    elif op == "vsa":
        tiling = vidattn.VideoTiling(cfg["grid"], (4, 4, 4), device=device)
        S, V, T = tiling.padded_len, tiling.tile_volume, tiling.num_tiles
        topk = max(1, T // 3)
        bs = tiling.block_sizes.cpu()
        valid = ref.slot_mask(bs, V).reshape(-1)
        vmask = valid[None, :, None, None].double()
        inputs = [rn(1, S, hq, d) * vmask, rn(1, S, hkv, d) * vmask, rn(1, S, hkv, dv, scale=1.0) * vmask]
        gate = rn(1, S, hq, dv, scale=1.0) if cfg["gate"] else None
        sc = 1.0 / math.sqrt(d)
        if gate is not None:
            inputs.append(gate)
        sel = {}

        def kernel(q, k, v, g=None):
            out, (idx, cnt) = vidattn.video_sparse_attention(
                q, k, v, tiling=tiling, topk=topk, gate=g, return_selection=True)
            sel["idx"], sel["cnt"] = idx.cpu(), cnt.cpu()
            return out

        def reference(q, k, v, g=None):
            return ref.vsa(q, k, v, bs, V, sel["idx"], sel["cnt"], g, sc)

        def floors(xs, do):
            return ref.vsa_floors(xs[0], xs[1], xs[2], do, bs, V, sel["idx"], sel["cnt"],
                                  xs[3] if len(xs) > 3 else None, sc, dtype)

        _compare(f"vsa{cfg}", cfg, device, inputs, kernel, reference, floors)
    elif op == "combine":
        b, V, qt = cfg["b"], cfg["volume"], cfg["q_tiles"]
        bs = torch.randint(0, V + 1, (qt,), generator=gen, dtype=torch.int32)
        inputs = [rn(b, qt * V, hq, dv), rn(b, qt, hq, dv)]
        if cfg["gate"]:
            inputs.append(rn(b, qt * V, hq, dv))
        bsd = bs.to(device)
        _compare(f"combine{cfg}", cfg, device, inputs,
                 lambda f, c, g=None: torch.ops.vidattn.vsa_combine(f, c, g, bsd, V),
                 lambda f, c, g=None: ref.combine(f, c, g, bs, V), attention=False)
    elif op == "rope":
        b, s, d = cfg["b"], cfg["s"], cfg["d"]
        width = d // 2 if cfg["half"] else d
        ang = torch.rand(s, width, generator=gen, dtype=torch.float64) * 6.3
        if not cfg["half"]:  # full-width tables repeat each pair's angle
            ang = ang[:, : d // 2]
            ang = ang.repeat_interleave(2, -1) if cfg["interleaved"] else torch.cat([ang, ang], -1)
        tab_dtype = torch.float64 if dtype == torch.float64 else torch.float32
        cos, sin = ang.cos(), ang.sin()
        cosk, sink = cos.to(device, tab_dtype), sin.to(device, tab_dtype)
        _compare(f"rope{cfg}", cfg, device, [rn(b, s, hq, d)],
                 lambda x: vidattn.apply_rope(x, cosk, sink, interleaved=cfg["interleaved"]),
                 lambda x: ref.rope(x, cos.to(x.device, x.dtype), sin.to(x.device, x.dtype),
                                          cfg["interleaved"]), attention=False)
    else:
        raise ValueError(f"unknown op {op!r}; one of {OPS}")
    return cfg


def repro(op: str, seed: int, device: str) -> str:
    return (f"python -c \"from vidattn.fuzz.configs import run_config; "
            f"run_config('{op}', {seed}, '{device}')\"")
