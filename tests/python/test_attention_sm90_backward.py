"""The sm_90a (Hopper) dense backward: on an sm_90 GPU the dense backward must take it (checked
with the launch counter torch.ops.vidattn._sm90_backward_launches, a test hook of
VIDATTN_TESTING builds), its gradients must match the float64 reference by the rule of
docs/conventions.md on NaN-poisoned outputs, with deterministic=True (a dK / dV and a dQ kernel)
and False (one kernel reducing dQ into an fp32 workspace), and deterministic reruns must give
the same bits. The generic
CUDA tests (test_attention_cuda.py) run through it too on such a GPU; the shapes here add many
key and query blocks, groups of query heads per key head, and partial tiles of both kernels
(128 stationary rows; streamed blocks of 64 rows, 128 at D = 64 and 80 in the dK / dV
kernel at D = 128 when deterministic). Skipped on other GPUs."""
from __future__ import annotations

import zlib

import pytest
import torch

import vidattn
from cuda_poison import poison_allocator
from test_attention_cuda import (assert_launched, check_varlen, cu, gen, qkv, randn,
                                 run_and_check)

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
    reason="needs an sm_90 GPU")

DEV = "cuda"


def launches() -> int:
    return torch.ops.vidattn._sm90_backward_launches()


def takes_sm90_backward(fn) -> None:
    assert_launched(launches, fn, "the sm90 backward")


CASES = [  # B, Sq, Sk, Hq, Hkv, D, dtype, causal
    (2, 1500, 1500, 8, 8, 128, torch.bfloat16, False),
    (2, 1500, 1500, 8, 2, 128, torch.bfloat16, True),
    (1, 700, 2100, 6, 3, 64, torch.float16, False),
    (1, 2100, 700, 6, 6, 64, torch.bfloat16, True),
    (3, 257, 129, 5, 5, 128, torch.float16, True),
    (1, 77, 300, 4, 1, 128, torch.bfloat16, False),
    (1, 1, 1000, 2, 1, 64, torch.float16, True),
    (1, 1000, 1, 2, 2, 128, torch.bfloat16, False),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_Sq{}_Sk{}_H{}x{}_D{}_{}_{}".format(
    *c[:6], str(c[6])[6:], "causal" if c[7] else "full"))
@pytest.mark.parametrize("input_scale", [1.0, 16.0])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fused"])
def test_sm90_backward_matches_reference(case, input_scale, deterministic):
    B, Sq, Sk, Hq, Hkv, D, dtype, causal = case
    seed = zlib.crc32(repr((case, input_scale, "bwd")).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, input_scale)
    takes_sm90_backward(lambda: run_and_check(q, k, v, causal=causal, seed=seed,
                                              deterministic=deterministic))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fused"])
def test_sm90_backward_padding_masks(D, causal, deterministic):
    g = gen(6000 + D + int(causal))
    B, Sq, Sk, Hq, Hkv = 3, 300, 450, 4, 2
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), torch.bfloat16, 4.0)
    kmask = torch.rand((B, Sk), generator=g, device=DEV) > 0.3
    qmask = torch.rand((B, Sq), generator=g, device=DEV) > 0.2
    kmask[1] = False  # every query of this entry sees nothing
    kmask[2, :] = True
    takes_sm90_backward(lambda: run_and_check(q, k, v, causal=causal, kmask=kmask, qmask=qmask,
                                              seed=D, deterministic=deterministic))


@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("deterministic", [True, False], ids=["det", "fused"])
def test_sm90_backward_varlen_with_empty_sequences(D, causal, deterministic):
    g = gen(6100 + D + int(causal))
    lq = [5, 0, 300, 1, 129, 64, 3]
    lk = [7, 3, 0, 1, 200, 400, 65]
    Hq, Hkv = 4, 2
    dtype = torch.float16
    q = randn((sum(lq), Hq, D), dtype, g, 4.0)
    k = randn((sum(lk), Hkv, D), dtype, g, 4.0)
    v = randn((sum(lk), Hkv, D), dtype, g)
    gout = randn((sum(lq), Hq, D), dtype, g)
    qk = [t.clone().requires_grad_() for t in (q, k, v)]
    out = vidattn.attention_varlen(*qk, cu(lq), cu(lk), max(lq), max(lk), causal=causal,
                                   deterministic=deterministic)
    poison_allocator(q.numel() * 8 + (1 << 20))
    before = launches()
    dq, dk, dv = torch.autograd.grad(out, qk, gout)
    torch.cuda.synchronize()
    assert launches() > before, "the sm90 backward did not run"
    check_varlen(q, k, v, lq, lk, out, causal=causal, grads=(dq, dk, dv), gout=gout)


def rerun_inputs(seed):
    """q, k, v (leaves requiring grad) and grad_out of the rerun tests: GQA, several blocks."""
    g = gen(seed)
    B, Sq, Sk, Hq, Hkv, D = 1, 1100, 1300, 8, 2, 128
    q = randn((B, Sq, Hq, D), torch.bfloat16, g, 4.0).requires_grad_()
    k = randn((B, Sk, Hkv, D), torch.bfloat16, g, 4.0).requires_grad_()
    v = randn((B, Sk, Hkv, D), torch.bfloat16, g).requires_grad_()
    return q, k, v, randn((B, Sq, Hq, D), torch.bfloat16, g)


def test_sm90_backward_is_deterministic_over_50_runs():
    """deterministic=True (the default) on the Hopper kernels: 50 reruns, the same bits."""
    q, k, v, gout = rerun_inputs(6200)
    out = vidattn.attention(q, k, v, causal=True)
    first = None
    before = launches()
    for _ in range(50):
        grads = torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)
        if first is None:
            first = [t.clone() for t in grads]
        else:
            for a, b in zip(first, grads):
                assert torch.equal(a, b)
    torch.cuda.synchronize()
    assert launches() >= before + 50


# ---- block-sparse ---------------------------------------------------------------------------
# test_block_sparse_cuda.py's reference check (partial query and key tiles, a 0-token key tile,
# a query tile that selected nothing, grouped heads, tiles of 64 / 128 / 256 tokens, input
# scales to 16, dead rows with zero dQ, unselected key tiles with zero dK / dV), here with
# the launch counter: each case must take the sm90 backward. The larger cases give long k2q
# lists and an odd number of 64-token key tiles (the last CTA's second stream has none).
from test_block_sparse_cuda import CASES as SPARSE_CASES  # noqa: E402
from test_block_sparse_cuda import \
    test_block_sparse_cuda_matches_float64_reference as sparse_reference_check  # noqa: E402

LARGE_SPARSE_CASES = [  # dtype, V, B, Hq, Hkv, D, Qt, Kt, MaxK, input scale
    (torch.bfloat16, 64, 1, 4, 2, 128, 33, 33, 12, 4.0),
    (torch.float16, 64, 2, 2, 2, 64, 20, 31, 9, 16.0),
    (torch.bfloat16, 128, 1, 3, 1, 128, 17, 15, 6, 1.0),
]


@pytest.mark.parametrize("case", SPARSE_CASES + LARGE_SPARSE_CASES,
                         ids=lambda c: "{}_V{}_B{}_H{}x{}_D{}_Qt{}_Kt{}_K{}_s{}".format(
                             str(c[0])[6:], *c[1:]))
def test_sm90_block_sparse_backward_matches_reference(case):
    takes_sm90_backward(lambda: sparse_reference_check(case))


# Fused dQ on block-sparse: tiles of 128 and 256 tokens (64-token tiles stay deterministic).
@pytest.mark.parametrize("case", [c for c in SPARSE_CASES + LARGE_SPARSE_CASES if c[1] > 64],
                         ids=lambda c: "{}_V{}_B{}_H{}x{}_D{}_Qt{}_Kt{}_K{}_s{}".format(
                             str(c[0])[6:], *c[1:]))
def test_sm90_block_sparse_fused_backward_matches_reference(case):
    takes_sm90_backward(lambda: sparse_reference_check(case, deterministic=False))


def test_sm90_fused_backward_reruns_agree_within_the_rule():
    """deterministic=False: reruns may differ only in the order of dQ's fp32 adds; dK and dV
    have one owner each and stay bit-identical."""
    q, k, v, gout = rerun_inputs(6300)
    out = vidattn.attention(q, k, v, deterministic=False)
    first = torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)
    for _ in range(10):
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), gout, retain_graph=True)
        assert torch.equal(dk, first[1]) and torch.equal(dv, first[2])
        # The same fp32 terms summed in another order (their sums differ by a few fp32
        # roundings of the row's scale), then rounded to bf16: one unit in the last place of
        # the larger result, plus the fp32 part where a sum cancels to near zero.
        a, b = dq.float(), first[0].float()
        bound = torch.maximum(a.abs(), b.abs()) * 2.0 ** -7 + 1e-5 * b.abs().amax()
        assert ((a - b).abs() <= bound).all()
