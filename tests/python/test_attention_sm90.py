"""The sm_90a (Hopper) forward: on an sm_90 GPU the dense forward must take it (checked with
the launch counter torch.ops.vidattn._sm90_forward_launches), match the float64 reference by
the rule of docs/conventions.md, and VIDATTN_DISABLE_SM90=1 must keep the portable path. The shapes
here add what the generic CUDA tests don't reach: many key blocks, more tiles than SMs (the
persistent schedule), strided packed views. Skipped on other GPUs."""
from __future__ import annotations

import os
import random
import subprocess
import sys
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
    return torch.ops.vidattn._sm90_forward_launches()


def takes_sm90(fn) -> None:
    assert_launched(launches, fn, "the sm90 forward")


CASES = [  # B, Sq, Sk, Hq, Hkv, D, dtype, causal
    (2, 1500, 1500, 8, 8, 128, torch.bfloat16, False),
    (2, 1500, 1500, 8, 2, 128, torch.bfloat16, True),
    (1, 700, 2100, 6, 3, 64, torch.float16, False),
    (1, 2100, 700, 6, 6, 64, torch.bfloat16, True),
    (3, 257, 129, 5, 5, 128, torch.float16, True),
    # D = 128 on three warpgroups (77 keys: the one-block instance; 300: 64-key blocks),
    # causal, on a persistent grid with a partial last round (260 tiles of 192 rows on 132
    # CTAs): the causal snake's slots past the tiles are whole tiles.
    (1, 384, 77, 130, 10, 128, torch.bfloat16, True),
    (1, 384, 300, 130, 10, 128, torch.float16, True),
    # The same for D = 64's 192-row tiles at every key length: 11 x 13 = 143 tiles.
    (1, 2000, 2000, 13, 13, 64, torch.bfloat16, True),
    # D = 64 (the 192-row tile of three consumer warpgroups) past 8192 keys, on the persistent
    # grid: partial last query tile and a partial last key block.
    (1, 500, 8200, 4, 2, 64, torch.bfloat16, False),
    (2, 450, 8250, 2, 2, 64, torch.float16, True),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "B{}_Sq{}_Sk{}_H{}x{}_D{}_{}_{}".format(
    *c[:6], str(c[6])[6:], "causal" if c[7] else "full"))
@pytest.mark.parametrize("input_scale", [1.0, 16.0])
def test_sm90_forward_matches_reference(case, input_scale):
    B, Sq, Sk, Hq, Hkv, D, dtype, causal = case
    seed = zlib.crc32(repr((case, input_scale)).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, input_scale)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))



# Head dims other than D = Dv = 64 / 128 run the padded instances of width 96, 128, 192 and
# 256 (FwdConfig::padded_head_dim): TMA fills the columns past D (q, k) and Dv (v) with zeros
# and the output store drops those past Dv. Outputs land on NaN-poisoned memory, so a column
# written past Dv, or one left unwritten, fails. Each width on the paths it takes: at widths
# 96 (64-byte swizzle atoms; dims that are multiples of 16) and 128 the configurations of
# D = 128 (one key block at <= 128 keys, three warpgroups at <= 512, the persistent grid, CTA
# pairs past 24576 keys), above 128
# the one of dense_wide (64-key blocks; TMA-stored output at 192, the threads' stores at 256);
# Dv != D both ways (up to 128 on the instances of widths 128 / 64 and 64 / 128, which take
# D = 128's paths except the CTA pairs), and the instance of D = 192 with v and out 128 wide
# (128 < D <= 192 with Dv <= 128).
PADDED_CASES = [  # B, Sq, Sk, Hq, Hkv, D, Dv, dtype, causal
    (2, 700, 1500, 4, 2, 96, 96, torch.bfloat16, False),
    (1, 1000, 1000, 4, 4, 72, 72, torch.float16, True),
    (1, 600, 77, 8, 8, 80, 80, torch.bfloat16, False),
    (1, 384, 300, 66, 6, 96, 96, torch.float16, False),
    (1, 256, 24700, 2, 2, 80, 80, torch.bfloat16, False),
    (1, 500, 520, 4, 4, 64, 96, torch.float16, True),
    (1, 600, 400, 4, 2, 96, 48, torch.bfloat16, False),
    (1, 600, 400, 4, 2, 88, 88, torch.float16, False),
    (1, 256, 24700, 2, 2, 112, 112, torch.bfloat16, False),
    (1, 500, 1300, 4, 4, 104, 104, torch.float16, False),
    (1, 500, 500, 4, 4, 128, 64, torch.bfloat16, False),
    (1, 500, 520, 4, 4, 64, 128, torch.float16, True),
    (1, 300, 100, 4, 2, 128, 64, torch.bfloat16, False),
    (1, 384, 300, 66, 6, 64, 128, torch.float16, False),
    (1, 384, 300, 66, 6, 120, 56, torch.bfloat16, False),
    (1, 600, 2000, 4, 4, 128, 64, torch.float16, False),
    (1, 256, 24700, 2, 2, 40, 128, torch.bfloat16, False),
    (1, 800, 900, 4, 2, 192, 128, torch.bfloat16, False),
    (1, 400, 650, 4, 2, 160, 96, torch.float16, True),
    (1, 700, 2100, 4, 4, 192, 192, torch.float16, True),
    (1, 300, 301, 2, 2, 136, 200, torch.float16, True),
    (2, 500, 777, 4, 2, 256, 256, torch.bfloat16, False),
    (1, 900, 600, 4, 4, 256, 256, torch.float16, True),
    (1, 300, 300, 2, 2, 256, 8, torch.bfloat16, False),
]


@pytest.mark.parametrize("case", PADDED_CASES,
                         ids=lambda c: "B{}_Sq{}_Sk{}_H{}x{}_D{}_Dv{}_{}_{}".format(
                             *c[:7], str(c[7])[6:], "causal" if c[8] else "full"))
@pytest.mark.parametrize("input_scale", [1.0, 16.0])
def test_sm90_padded_head_dims_match_reference(case, input_scale):
    B, Sq, Sk, Hq, Hkv, D, Dv, dtype, causal = case
    seed = zlib.crc32(repr(("padded", case, input_scale)).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, input_scale, dv=Dv)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))


# Key and query padding masks at padded widths: packed as varlen when D = Dv and not causal,
# the masked instance otherwise (Dv != D: the packing copies k and v at one width; causal).
@pytest.mark.parametrize("D,Dv,causal", [(96, 96, False), (192, 128, False), (256, 256, False),
                                         (80, 80, True), (256, 256, True), (128, 64, False),
                                         (48, 128, True)])
def test_sm90_padded_head_dims_with_padding_masks(D, Dv, causal):
    seed = zlib.crc32(repr(("padded masks", D, Dv, causal)).encode())
    g = gen(seed)
    B, Sq, Sk, H = 3, 300, 700, 2
    q, k, v = qkv(g, (B, Sq, Sk, H, H, D), torch.bfloat16, 4.0, dv=Dv)
    kmask = torch.rand((B, Sk), generator=g, device=DEV) > 0.3
    qmask = torch.rand((B, Sq), generator=g, device=DEV) > 0.2
    kmask[1] = False  # every row of this batch entry sees nothing
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, kmask=kmask, qmask=qmask,
                                     seed=seed, check_grads=False))

# Dense D = 128 with at most 512 keys runs on three warpgroups over 64-key blocks
# (DenseShortTraits) when its 192-row tiles put no more rows on the busiest SM than 128-row
# tiles would (dense_short_fits): 66 heads of 384 queries are 132 such tiles, one per SM
# of an H200, against 198 128-row tiles. Last key blocks of 1 (257 keys), 44 (300), 64
# (512) and 1 (65) keys; GQA; causal with fewer keys than queries.
@pytest.mark.parametrize("Sk,causal,dtype", [(257, False, torch.bfloat16),
                                             (300, True, torch.float16),
                                             (512, False, torch.float16),
                                             (65, True, torch.bfloat16)])
def test_sm90_short_key_loops_on_three_warpgroups(Sk, causal, dtype):
    seed = zlib.crc32(repr(("short keys", Sk, causal, str(dtype))).encode())
    g = gen(seed)
    B, Sq, Hq, Hkv, D = 1, 384, 66, 6, 128
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, 16.0)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))


# Short key loops (at most 512 keys) over several tiles per CTA of the persistent grid (132 SMs
# on an H200), so that each CTA's producer loads a tile's Q and K / V while its consumers finish
# the one before: D = 128 with 2 x 44 heads of 1152 queries (528 192-row tiles, and as many
# rows on the busiest SM as 128-row tiles give, so dense_short_fits takes the 192-row
# tile), D = 64 with 2 x 48 heads of 1000 queries (a partial last tile). GQA; causal with fewer
# keys than queries (whole tiles see no key); a one-key problem; 77 text tokens. At most 128
# keys run the one-block instances (D = 128: 77 and 128 keys; D = 64: 1 and 128).
@pytest.mark.parametrize("D,Sk,causal,dtype", [(128, 77, False, torch.bfloat16),
                                               (128, 128, True, torch.float16),
                                               (128, 512, False, torch.bfloat16),
                                               (64, 1, False, torch.bfloat16),
                                               (64, 128, False, torch.float16),
                                               (64, 257, True, torch.bfloat16),
                                               (64, 512, False, torch.float16)])
def test_sm90_short_key_loops_over_several_tiles_per_cta(D, Sk, causal, dtype):
    seed = zlib.crc32(repr(("several tiles per CTA", D, Sk, causal, str(dtype))).encode())
    g = gen(seed)
    B, Sq, Hq, Hkv = (2, 1152, 44, 4) if D == 128 else (2, 1000, 48, 8)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, 4.0)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))


# The three-warpgroup kernels (D = 64; D = 128 with at most 512 keys) split the tiles of a
# partly filled last round into three 64-row pieces, each run by all three warpgroups over
# every third key block and combined in shared memory (SplitTail). Heads chosen
# from the device's SM count so that the launch has whole rounds and 14 tiles left over (42
# pieces): whole tiles and pieces in one launch. 347 queries: the last tile's third piece ends
# inside its 64 rows; key lengths give a partial last key block, one or two blocks (a
# warpgroup with no block of its own), and a key count below one block (D = 64 with 100 keys
# and D = 128 with 64: the one-block instances' pieces). GQA (one KV head).
@pytest.mark.parametrize("D,Sk,dtype", [(64, 1000, torch.bfloat16), (64, 100, torch.float16),
                                        (64, 200, torch.bfloat16), (128, 300, torch.bfloat16),
                                        (128, 64, torch.float16), (128, 512, torch.float16)])
@pytest.mark.parametrize("input_scale", [1.0, 16.0])
def test_sm90_split_last_round_matches_reference(D, Sk, dtype, input_scale):
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    B, Sq, Hq, Hkv = 1, 347, sms // 2 + 7, 1  # 2 tiles of 192 rows per head
    seed = zlib.crc32(repr(("split last round", D, Sk, str(dtype), input_scale)).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, input_scale)
    takes_sm90(lambda: run_and_check(q, k, v, seed=seed, check_grads=False))


# Key lengths around the 128-key block boundary: the last block holds 1, 63, 64, 65 or 127
# keys (or none), and the masked step cuts each accumulator row at one column limit (v26 of
# docs/perf-notes.md), which must land between a lane's two columns and between lanes alike;
# with causal, the diagonal crosses the same blocks. 203 queries: a partial last query tile.
@pytest.mark.parametrize("Sk", [129, 191, 192, 193, 255, 256])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_key_lengths_across_a_block_boundary(causal, D, Sk):
    seed = zlib.crc32(repr(("block boundary", causal, D, Sk)).encode())
    g = gen(seed)
    B, Sq, Hq, Hkv = 1, 203, 3, 1
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), torch.float16, 16.0)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))


# D = 128 past the short-key kernel's 512 keys: the two-warpgroup tiles, whose key loops run
# blocks in pairs over two P operands and move P back after a loop with an odd number of
# steps (v41). Blocks after the first: 640 keys 4 unmasked; 700, 4 + 1 masked; 768, 5; 896, 6;
# 1000, 6 + 1; 1024, 7; so each loop ends on either parity.
@pytest.mark.parametrize("Sk", [640, 700, 768, 896, 1000, 1024])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_sm90_key_loops_of_either_parity(Sk, dtype):
    seed = zlib.crc32(repr(("loop parity", Sk, str(dtype))).encode())
    g = gen(seed)
    B, Sq, Hq, Hkv, D = 1, 300, 4, 2, 128
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, 4.0)
    takes_sm90(lambda: run_and_check(q, k, v, seed=seed, check_grads=False))


@pytest.mark.parametrize("Sq,Sk,D", [(3000, 3000, 128), (600, 8300, 64)])
@pytest.mark.parametrize("causal", [False, True])
def test_sm90_logits_growing_along_the_keys(causal, Sq, Sk, D):
    """Key norms that grow along the sequence make each row's maximum climb block after
    block, far past the softmax base's slack (OnlineSoftmax::slack): the rescale path runs on
    many blocks, and the result still follows the rule. D = 64 with 8300 keys: the 192-row
    tile on one CTA per tile."""
    g = gen(93 + causal + D)
    B, H = 1, 4
    q = randn((B, Sq, H, D), torch.bfloat16, g)
    ramp = torch.linspace(0.25, 8.0, Sk, device=DEV).view(1, Sk, 1, 1)
    k = (randn((B, Sk, H, D), torch.float32, g) * ramp).to(torch.bfloat16)
    v = randn((B, Sk, H, D), torch.bfloat16, g)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=93, check_grads=False))


@pytest.mark.parametrize("Sq,Sk,H,D", [(1000, 3000, 2, 128), (512, 24833, 2, 128),
                                       (700, 2900, 2, 64), (384, 400, 66, 128)])
def test_sm90_some_warps_redo_their_blocks(Sq, Sk, H, D):
    """Query rows of three magnitudes, 16 rows (one warp's share of a warpgroup) each, against
    keys whose norms grow along the sequence: the warps of large rows climb past their base's
    slack block after block and redo those blocks from their max, while the warps beside them
    keep the exponentials taken against the base they had (OnlineSoftmax::speculate). 512 x
    24833: the CTA pairs; 1000 x 3000: the 128-row persistent tile; D = 64, and 400 keys at
    D = 128 over 66 heads (132 tiles of 192 rows, as in the short-key test above): the
    three-warpgroup tiles, which speculate after the previous P V."""
    g = gen(311 + Sk + D)
    B = 1
    rows = torch.arange(Sq, device=DEV)
    row_scale = torch.tensor([0.05, 1.0, 6.0], device=DEV)[rows // 16 % 3]
    q = (randn((B, Sq, H, D), torch.float32, g) * row_scale.view(1, Sq, 1, 1)).to(torch.bfloat16)
    ramp = torch.linspace(0.25, 6.0, Sk, device=DEV).view(1, Sk, 1, 1)
    k = (randn((B, Sk, H, D), torch.float32, g) * ramp).to(torch.bfloat16)
    v = randn((B, Sk, H, D), torch.bfloat16, g)
    takes_sm90(lambda: run_and_check(q, k, v, seed=311, check_grads=False))


# Seeded random problems drawn around the host dispatch's limits, so that every route meets
# odd sizes beside the hand-picked cases above: key lengths at 1, 64, 128, 512 (the
# three-warpgroup D = 128 kernel's limit), 1024, 4096 and 24576 (the persistent grid's) +- 1
# or anywhere up to 30000 (one CTA per tile past 24576 keys; CTA pairs when the query blocks
# are even); query lengths at the 64 / 128 / 192-row tile edges or anywhere; GQA; causal, key
# and query padding (packed as varlen or the key-mask instance). The draw is a function of the
# index only.
def _dispatch_problem(i: int):
    rng = random.Random(zlib.crc32(repr(("dispatch", i)).encode()))
    D = rng.choice([64, 128])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    if rng.random() < 0.7:
        Sk = max(1, rng.choice([1, 64, 128, 512, 1024, 4096, 24576]) + rng.choice([-1, 0, 1]))
    else:
        Sk = rng.randint(1, 30000)
    if rng.random() < 0.6:
        Sq = max(1, rng.choice([64, 128, 192, 256, 384]) + rng.choice([-1, 0, 1]))
    else:
        Sq = rng.randint(1, 3000)
    B, Hkv = rng.randint(1, 2), rng.randint(1, 3)
    Hq = Hkv * rng.randint(1, 3)
    # Keep the float64 reference's score matrix under ~3e7 entries.
    while B * Hq * Sq * Sk > 3e7 and Sq > 1:
        Sq = max(1, Sq // 2)
    causal = rng.random() < 0.3
    key_mask, query_mask = rng.random() < 0.25, rng.random() < 0.15
    return B, Sq, Sk, Hq, Hkv, D, dtype, causal, key_mask, query_mask


DISPATCH_PROBLEMS = [_dispatch_problem(i) for i in range(40)]


def _dispatch_problem_id(c) -> str:
    return "B{}_Sq{}_Sk{}_H{}x{}_D{}_{}_{}{}{}".format(
        *c[:6], str(c[6])[6:], "causal" if c[7] else "full", "_kmask" if c[8] else "",
        "_qmask" if c[9] else "")


@pytest.mark.parametrize("problem", DISPATCH_PROBLEMS, ids=_dispatch_problem_id)
def test_sm90_random_problems_around_the_dispatch_limits(problem):
    B, Sq, Sk, Hq, Hkv, D, dtype, causal, key_mask, query_mask = problem
    seed = zlib.crc32(repr(problem).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, 4.0)
    kmask = torch.rand((B, Sk), generator=g, device=DEV) > 0.3 if key_mask else None
    qmask = torch.rand((B, Sq), generator=g, device=DEV) > 0.2 if query_mask else None
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, kmask=kmask, qmask=qmask,
                                     seed=seed, check_grads=False))


# Seeded random problems over the persistent grid's schedule: enough heads and batches for one
# to several rounds of tiles on 132 SMs, mostly with a partial last round (under causal every
# other round walks backwards), at the key lengths of the three-warpgroup kernels (the one-block
# instance, 64-key blocks, the split last round) and past them. The cases above have fewer tiles
# than SMs or whole rounds; a causal partial odd round ran tiles as split pieces until 0a9abcb.
def _schedule_problem(i: int):
    rng = random.Random(zlib.crc32(repr(("schedule", i)).encode()))
    D = rng.choice([64, 128])
    dtype = rng.choice([torch.bfloat16, torch.float16])
    Sk = rng.choice([rng.randint(1, 128), rng.randint(129, 512), rng.randint(513, 3000)])
    Sq = rng.randint(1, 600)
    B, Hkv = rng.randint(1, 3), rng.randint(1, 8)
    Hq = Hkv * rng.randint(1, 24)
    # Keep the float64 reference's score matrix under ~3e7 entries.
    while B * Hq * Sq * Sk > 3e7:
        if Sk > 512:
            Sk //= 2
        else:
            Sq = max(1, Sq // 2)
    return B, Sq, Sk, Hq, Hkv, D, dtype, rng.random() < 0.5


SCHEDULE_PROBLEMS = [_schedule_problem(i) for i in range(32)]


@pytest.mark.parametrize("problem", SCHEDULE_PROBLEMS, ids=lambda c: _dispatch_problem_id(
    c + (False, False)))
def test_sm90_random_problems_over_the_schedule(problem):
    B, Sq, Sk, Hq, Hkv, D, dtype, causal = problem
    seed = zlib.crc32(repr(problem).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, 4.0)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))


def test_sm90_padding_masks_and_packed_views():
    g = gen(91)
    B, S, H, D = 3, 300, 4, 128
    qkv = randn((B, S, 3, H, D), torch.bfloat16, g, 4.0)
    q, k, v = qkv.unbind(2)
    kmask = torch.rand((B, S), generator=g, device=DEV) > 0.3
    qmask = torch.rand((B, S), generator=g, device=DEV) > 0.2
    kmask[1] = False
    takes_sm90(lambda: run_and_check(q, k, v, kmask=kmask, qmask=qmask, causal=True, seed=92,
                                     check_grads=False))


# Key padding masks (their own kernel instance): lengths that end inside a 128-key block and
# inside a lane's 4 keys, masks as views with a storage offset (not 4-byte aligned) and with a
# key stride of 3, D = 64 past 8192 keys (packed when not causal: the 192-row tile), and
# masks that hide whole blocks or keep one key of a block. Every key position of a block maps
# to a different (lane, flag bit) of the ballots in apply_mask, so a wrong column would show
# in the output. "suffix": padded key suffixes, so most blocks have every key (the early exit
# of apply_mask), also beside the causal cut.
@pytest.mark.parametrize("Sq,Sk,D,causal,layout", [
    (700, 1001, 128, False, "contiguous"),
    (513, 1283, 128, True, "offset"),
    (300, 999, 64, False, "strided"),
    (400, 8303, 64, True, "contiguous"),
    (1100, 1300, 128, False, "suffix"),
    (1100, 1300, 64, True, "suffix"),
])
def test_sm90_key_padding_mask(Sq, Sk, D, causal, layout):
    g = gen(zlib.crc32(repr((Sq, Sk, D, causal, layout)).encode()))
    B, Hq, Hkv = 3, 4, 2
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), torch.bfloat16, 4.0)
    width = {"contiguous": Sk, "offset": Sk + 1, "strided": 3 * Sk, "suffix": Sk}[layout]
    wide = torch.rand((B, width), generator=g, device=DEV) > 0.4
    kmask = {"contiguous": wide, "offset": wide[:, 1:], "strided": wide[:, ::3],
             "suffix": torch.ones_like(wide)}[layout]
    assert kmask.shape == (B, Sk)
    if layout == "suffix":
        kmask[1, Sk - 301:] = False
        kmask[2, 77:] = False
    else:
        kmask[1] = False
        kmask[1, 5] = True  # one visible key in a whole sequence
        kmask[2, 128:512] = False  # whole blocks hidden
        kmask[2, 700] = True
    qmask = torch.rand((B, Sq), generator=g, device=DEV) > 0.1
    takes_sm90(lambda: run_and_check(q, k, v, kmask=kmask, qmask=qmask, causal=causal,
                                     seed=95, check_grads=False))


# Non-causal key padding runs packed as varlen: the valid keys (and, with a query mask, the
# valid queries) are gathered into packed buffers, the unmasked kernel runs on them and the
# output is scattered back. B, Sq, Sk, Hq, Hkv, D, dtype, query mask, layout. "bhsd": q, k, v
# are [B, H, S, D] tensors seen as [B, S, H, D] (q and out are packed too, since their
# sequences' rows do not follow each other); "contiguous" without a query mask writes out in
# place. Sequence 1 has no valid key, sequence 2 a single one, and with a query mask sequence
# 0 has no valid query; D = 64 runs packed on the 192-row tile.
PACKED_CASES = [
    (3, 700, 1001, 4, 2, 128, torch.bfloat16, True, "contiguous"),
    (2, 1100, 1300, 8, 8, 128, torch.float16, False, "contiguous"),
    (1, 513, 1283, 6, 3, 64, torch.bfloat16, False, "contiguous"),
    (2, 400, 8303, 4, 2, 64, torch.bfloat16, False, "bhsd"),
    (3, 300, 999, 4, 4, 64, torch.float16, True, "bhsd"),
    (3, 129, 65, 2, 1, 128, torch.bfloat16, True, "bhsd"),
]


def packed_case_inputs(case, g):
    B, Sq, Sk, Hq, Hkv, D, dtype, with_qmask, layout = case
    if layout == "bhsd":
        q, k, v = (randn((B, h, s, D), dtype, g, sc).transpose(1, 2)
                   for h, s, sc in ((Hq, Sq, 4.0), (Hkv, Sk, 4.0), (Hkv, Sk, 1.0)))
    else:
        q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, 4.0)
    kmask = torch.rand((B, Sk), generator=g, device=DEV) > 0.3
    if B > 1:
        kmask[1] = False
    if B > 2:
        kmask[2] = False
        kmask[2, Sk // 2] = True
    qmask = None
    if with_qmask:
        qmask = torch.rand((B, Sq), generator=g, device=DEV) > 0.2
        qmask[0] = False
    return q, k, v, kmask, qmask


def packed_case_id(c):
    return "B{}_Sq{}_Sk{}_H{}x{}_D{}_{}_{}_{}".format(
        *c[:6], str(c[6])[6:], "qmask" if c[7] else "noqmask", c[8])


@pytest.mark.parametrize("case", PACKED_CASES, ids=packed_case_id)
def test_sm90_key_padding_packed_matches_reference(case):
    g = gen(zlib.crc32(repr(case).encode()))
    q, k, v, kmask, qmask = packed_case_inputs(case, g)
    takes_sm90(lambda: run_and_check(q, k, v, kmask=kmask, qmask=qmask, seed=96,
                                     check_grads=False, clone_inputs=False))


@pytest.mark.parametrize("case", [PACKED_CASES[0], PACKED_CASES[3]],
                         ids=["qmask_contiguous", "noqmask_bhsd"])
def test_sm90_key_padding_packed_never_reads_padded_rows(case):
    """NaN in every padded key, value and query row changes no bit of the output or LSE: the
    packed path reads valid rows only (the masked kernel would multiply the padded values by
    their zero probabilities, and 0 * NaN is NaN)."""
    g = gen(zlib.crc32(repr(("nan", case)).encode()))
    q, k, v, kmask, qmask = packed_case_inputs(case, g)
    clean = vidattn.attention(q, k, v, key_padding_mask=kmask, query_padding_mask=qmask,
                              return_lse=True)
    qn, kn, vn = (t.clone() for t in (q, k, v))
    kn[~kmask] = float("nan")
    vn[~kmask] = float("nan")
    if qmask is not None:
        qn[~qmask] = float("nan")
    poisoned = vidattn.attention(qn, kn, vn, key_padding_mask=kmask, query_padding_mask=qmask,
                                 return_lse=True)
    for c, p in zip(clean, poisoned):
        assert c.isfinite().any()
        assert torch.equal(c, p)


def test_sm90_packed_padding_workspace_comes_from_torch():
    """The op library installs PyTorch's caching allocator as vidattn's CUDA workspace
    allocator: the packed copies of K and V count in torch's memory statistics while the call
    runs, and are given back when it returns."""
    g = gen(98)
    B, S, H, D = 2, 4096, 4, 128
    q, k, v = (randn((B, S, H, D), torch.bfloat16, g) for _ in range(3))
    kmask = torch.rand((B, S), generator=g, device=DEV) > 0.5
    packed_kv = 2 * k.numel() * k.element_size()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = vidattn.attention(q, k, v, key_padding_mask=kmask)
    torch.cuda.synchronize()
    outputs = torch.cuda.memory_allocated() - base
    assert out.isfinite().all()
    assert outputs < packed_kv, "the workspace was not given back"
    assert torch.cuda.max_memory_allocated() - base >= outputs + packed_kv


# The second case (D = 64: the 192-row tile) has sequences past 8192 keys. The third runs on
# D = 128's three warpgroups (at most 128 keys: the one-block instance): 5 sequences x 26
# heads make 260 tiles of 192 rows on 132 CTAs, a partial last round (under causal, the snake
# order's slots past the tiles: they once decoded as split pieces, an illegal instruction).
@pytest.mark.parametrize("input_scale", [1.0, 4.0])
@pytest.mark.parametrize("lq,lk,D,Hq", [([300, 0, 1, 129, 64], [260, 5, 0, 400, 1], 128, 4),
                                        ([300, 0, 200, 1], [8300, 5, 9000, 700], 64, 4),
                                        ([384, 0, 1, 200, 64], [77, 5, 0, 128, 1], 128, 26)])
def test_sm90_varlen(lq, lk, D, Hq, input_scale):
    g = gen(zlib.crc32(repr((lq, lk, D, Hq, input_scale)).encode()))
    Hkv = 2
    q = randn((sum(lq), Hq, D), torch.bfloat16, g, input_scale)
    k = randn((sum(lk), Hkv, D), torch.bfloat16, g, input_scale)
    v = randn((sum(lk), Hkv, D), torch.bfloat16, g)
    for causal in (False, True):
        before = launches()
        poison_allocator(q.numel() * 8 + (1 << 20))
        out, lse = vidattn.attention_varlen(q, k, v, cu(lq), cu(lk), max(lq), max(lk),
                                            causal=causal, return_lse=True)
        torch.cuda.synchronize()
        assert launches() > before
        # Each sequence by the rule of docs/conventions.md (as every other test here), with
        # the reference's pattern of non-finite values (LSE -inf for rows that see no key).
        check_varlen(q, k, v, lq, lk, out, causal=causal, lse=lse)


def test_disable_env_keeps_the_portable_path():
    code = (
        "import torch, vidattn\n"
        "q = torch.randn(1, 200, 2, 128, device='cuda', dtype=torch.bfloat16)\n"
        "vidattn.attention(q, q, q); torch.cuda.synchronize()\n"
        "print(torch.ops.vidattn._sm90_forward_launches())\n")
    env = dict(os.environ, VIDATTN_DISABLE_SM90="1")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip().splitlines()[-1] == "0"
    env.pop("VIDATTN_DISABLE_SM90")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert res.returncode == 0, res.stderr
    assert int(res.stdout.strip().splitlines()[-1]) >= 1


# Dense D = 128 problems with more than 24576 keys (shorter ones take the persistent grid) and
# an even number of 128-row query blocks run in CTA pairs that share each K / V load (TMA
# multicast); odd counts, causal, varlen, key masks and D = 64 (the last two rows: the
# 192-row tile) on single CTAs, one per tile. B, Sq, Sk, Hq, Hkv, D, dtype: partial last query
# and key blocks, GQA, q != kv length.
PAIR_SHAPES = [(2, 200, 24833, 4, 2, 128, torch.bfloat16),
               (1, 1000, 24900, 3, 3, 128, torch.float16),
               (3, 256, 24580, 2, 1, 128, torch.bfloat16),
               (1, 2048, 24677, 2, 2, 128, torch.float16),
               (1, 700, 24700, 4, 2, 64, torch.bfloat16),
               (2, 384, 24832, 2, 2, 64, torch.float16)]


@pytest.mark.parametrize("shape", PAIR_SHAPES, ids=lambda c: "B{}_Sq{}_Sk{}_H{}x{}_D{}_{}".format(
    *c[:6], str(c[6])[6:]))
def test_sm90_cta_pairs_match_reference(shape):
    B, Sq, Sk, Hq, Hkv, D, dtype = shape
    seed = zlib.crc32(repr(shape).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dtype, 4.0)
    takes_sm90(lambda: run_and_check(q, k, v, seed=seed, check_grads=False))



# Non-causal problems of the three-warpgroup kernels whose last round runs as split pieces,
# and causal ones (whose tiles stay whole), at odd sizes: partial last key blocks (129, 255,
# 1000 keys at D = 64), partial query tiles, GQA, one CTA per tile (24600 keys); D = 128 with
# 300 keys.
ODD_TILE_SHAPES = [(1, 203, 129, 3, 1, 64, "float16"), (1, 203, 255, 3, 1, 64, "bfloat16"),
                   (2, 300, 1000, 4, 2, 64, "bfloat16"), (1, 347, 300, 5, 1, 128, "float16"),
                   (1, 500, 24600, 2, 2, 64, "bfloat16")]


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
@pytest.mark.parametrize("shape", ODD_TILE_SHAPES,
                         ids=lambda c: "B{}_Sq{}_Sk{}_H{}x{}_D{}_{}".format(*c))
def test_sm90_odd_tiles_match_reference(shape, causal):
    B, Sq, Sk, Hq, Hkv, D, dtype = shape
    seed = zlib.crc32(repr((shape, causal)).encode())
    g = gen(seed)
    dt = getattr(torch, dtype)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), dt, 4.0)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))


# Problems with at most 24576 keys run on the persistent grid (the producer loads the next tile
# while the consumers finish one): cross attention to 512 / 257 text or image tokens, self
# attention of 2048 and 12000 tokens, causal (longest tiles first, snake rounds), D = 64, GQA,
# and 20000 keys at D = 128 with two query blocks (CTA pairs when one CTA per tile is forced).
SHORT_KEY_SHAPES = [(1, 3000, 512, 4, 4, 128, False), (2, 1000, 257, 4, 2, 128, False),
                    (1, 2048, 2048, 2, 2, 64, False), (2, 777, 4096, 2, 1, 128, True),
                    (1, 640, 9000, 3, 1, 128, True), (1, 500, 12000, 2, 2, 64, False),
                    (1, 256, 20000, 2, 2, 128, False)]


@pytest.mark.parametrize("shape", SHORT_KEY_SHAPES,
                         ids=lambda c: "B{}_Sq{}_Sk{}_H{}x{}_D{}_{}".format(
                             *c[:6], "causal" if c[6] else "full"))
def test_sm90_short_keys_match_reference(shape):
    B, Sq, Sk, Hq, Hkv, D, causal = shape
    seed = zlib.crc32(repr(shape).encode())
    g = gen(seed)
    q, k, v = qkv(g, (B, Sq, Sk, Hq, Hkv, D), torch.bfloat16, 4.0)
    takes_sm90(lambda: run_and_check(q, k, v, causal=causal, seed=seed, check_grads=False))


def test_misaligned_views_fall_back():
    """Rows that TMA cannot read (2-byte offset) take the portable path, still correct.
    (run_and_check clones its inputs, which would realign them: call the op directly.)"""
    from test_attention_cuda import check_rule, reference
    g = gen(95)
    n = 70 * 2 * 64
    flat = randn((3 * n + 1,), torch.bfloat16, g)
    q, k, v = (flat[1 + i * n: 1 + (i + 1) * n].view(1, 70, 2, 64) for i in range(3))
    assert q.data_ptr() % 16 != 0
    before = launches()
    out, lse = vidattn.attention(q, k, v, causal=True, return_lse=True)
    torch.cuda.synchronize()
    assert launches() == before
    ref, ref_lse = reference(q.double(), k.double(), v.double(), 64 ** -0.5, True)
    low, low_lse = reference(q, k, v, 64 ** -0.5, True)
    check_rule("out", out, ref, low, torch.bfloat16)
    check_rule("lse", lse, ref_lse, low_lse, torch.bfloat16)


# ---- block-sparse key lists (standalone sm_90a launcher) -----------------------------------

def sparse_inputs(g, B, Hq, Hkv, q_tiles, kv_tiles, tile, D, dtype, max_k):
    q = randn((B, q_tiles * tile, Hq, D), dtype, g, 4.0)
    k = randn((B, kv_tiles * tile, Hkv, D), dtype, g, 4.0)
    v = randn((B, kv_tiles * tile, Hkv, D), dtype, g)
    sizes = torch.randint(0, tile + 1, (kv_tiles,), generator=g, device=DEV, dtype=torch.int32)
    sizes[0], sizes[-1] = tile, 0  # a full tile and an empty one
    scores = torch.rand((B, Hq, q_tiles, kv_tiles), generator=g, device=DEV)
    index = scores.topk(max_k, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    count = torch.randint(0, max_k + 1, (B, Hq, q_tiles), generator=g, device=DEV,
                          dtype=torch.int32)
    count[0, 0, 0] = 0  # a query tile that selects nothing
    count[..., -1] = max_k
    slot = torch.arange(max_k, device=DEV)
    index = torch.where(slot < count[..., None], index, torch.full_like(index, -1))
    return q, k, v, index, count, sizes


def sparse_reference(q, k, v, index, count, sizes, tile, scale):
    """Dense attention with the token mask the key lists imply, in q's dtype (float64 for the
    reference). Rows of a tile that selects nothing: out 0, lse -inf."""
    B, Sq, Hq, _ = q.shape
    Sk, Hkv = k.shape[1], k.shape[2]
    kv_tiles = Sk // tile
    # Unused slots (-1) scatter into an extra column that is dropped.
    sel = torch.zeros((B, Hq, Sq // tile, kv_tiles + 1), dtype=torch.bool, device=q.device)
    idx = torch.where(index >= 0, index, kv_tiles).long()
    sel.scatter_(-1, idx, True)
    sel = sel[..., :kv_tiles]
    slot_ok = (torch.arange(tile, device=q.device)[None, :] < sizes[:, None]).reshape(Sk)
    vis = sel.repeat_interleave(tile, dim=2).repeat_interleave(tile, dim=3) & slot_ok
    kk = k.repeat_interleave(Hq // Hkv, dim=2)
    vv = v.repeat_interleave(Hq // Hkv, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    row = vis.any(-1, keepdim=True)
    s = s.masked_fill(~vis, float("-inf")).masked_fill(~row, 0.0)
    lse_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    lse = torch.logsumexp(s.to(lse_dtype), -1).masked_fill(~row[..., 0], float("-inf"))
    p = torch.softmax(s, -1) * row
    return torch.einsum("bhij,bjhd->bihd", p, vv), lse


@pytest.mark.parametrize("tile", [64, 128, 256])
@pytest.mark.parametrize("D,dtype", [(128, torch.bfloat16), (64, torch.float16)],
                         ids=["D128_bf16", "D64_fp16"])
def test_sm90_block_sparse_matches_reference(tile, D, dtype):
    from test_attention_cuda import check_rule
    g = gen(zlib.crc32(repr((tile, D, str(dtype))).encode()))
    B, Hq, Hkv, q_tiles, kv_tiles, max_k = 2, 4, 2, 5, 7, 3
    q, k, v, index, count, sizes = sparse_inputs(g, B, Hq, Hkv, q_tiles, kv_tiles, tile, D,
                                                 dtype, max_k)
    scale = D ** -0.5
    before = launches()
    out, lse = vidattn.block_sparse_attention(q, k, v, index, count, tile_volume=tile,
                                              kv_block_sizes=sizes, return_lse=True)
    torch.cuda.synchronize()
    assert launches() > before
    ref, ref_lse = sparse_reference(q.double(), k.double(), v.double(), index, count, sizes,
                                    tile, scale)
    low, low_lse = sparse_reference(q, k, v, index, count, sizes, tile, scale)
    assert torch.isfinite(out).all()
    check_rule("out", out, ref, low, dtype)
    check_rule("lse", lse, ref_lse, low_lse, dtype)

