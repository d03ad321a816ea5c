"""The non-finite-value rule of docs/conventions.md on every backend and path: a NaN in q, k or
v that takes part in a row reaches that row (output, LSE where the scores are hit, gradients),
and values a row does not see never affect it.

Each test runs an op twice, on clean inputs and with NaN planted, and checks that the NaN
elements are exactly the expected ones and that every other element is bit-identical to the
clean run (rows are computed independently, in the same blocks and order). Parametrized over
CPU and CUDA (skipped without a GPU); on CUDA the 16-bit dtypes, on the CPU float32 and bf16.
Every backend and kernel must pass each case: the Hopper kernels zero the rows a block loads
past its valid keys before a product reads them, as the portable ones zero-fill them.
"""
from __future__ import annotations

import pytest
import torch

import vidattn

NAN = float("nan")
HAS_CUDA = torch.cuda.is_available()
DEVICES = [pytest.param("cpu", id="cpu"),
           pytest.param("cuda", id="cuda",
                        marks=pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU"))]


def dtype_of(device):
    return torch.float16 if device == "cuda" else torch.float32


def is_hopper():
    return HAS_CUDA and torch.cuda.get_device_capability()[0] == 9


def rand(gen, *shape, device, dtype=None):
    return torch.randn(*shape, generator=gen).to(device, dtype or dtype_of(device))


def assert_nan_exactly(name, got, clean, expected_nan):
    """got is NaN exactly where expected_nan is True, and equals clean elsewhere."""
    got, clean = got.detach().cpu(), clean.detach().cpu()
    expected_nan = expected_nan.expand_as(got).cpu()
    nan = torch.isnan(got)
    assert torch.equal(nan, expected_nan), (
        f"{name}: {int((nan & ~expected_nan).sum())} unexpected NaN, "
        f"{int((~nan & expected_nan).sum())} missing NaN")
    assert torch.equal(got[~expected_nan], clean[~expected_nan]), \
        f"{name}: elements outside the NaN set changed"


def run_dense(q, k, v, backward, dout=None, **kw):
    q, k, v = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
    out, lse = vidattn.attention(q, k, v, return_lse=True, **kw)
    if not backward:
        return out, lse, None
    out.backward(dout)
    return out, lse, (q.grad, k.grad, v.grad)


B, SQ, SK, HQ, HKV, D = 2, 150, 300, 4, 2, 64


def dense_inputs(device, gen):
    return (rand(gen, B, SQ, HQ, D, device=device), rand(gen, B, SK, HKV, D, device=device),
            rand(gen, B, SK, HKV, D, device=device), rand(gen, B, SQ, HQ, D, device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_dense_nan_in_q_reaches_its_row_only(device, causal, backward, gen):
    q, k, v, dout = dense_inputs(device, gen)
    bi, i, h = 1, 120, 3  # with causal, row 120 of 150 sees keys 0..270 of 300
    qn = q.clone()
    qn[bi, i, h, 7] = NAN
    clean = run_dense(q, k, v, backward, dout, causal=causal)
    got = run_dense(qn, k, v, backward, dout, causal=causal)
    row = torch.zeros(B, SQ, HQ, 1, dtype=torch.bool)
    row[bi, i, h] = True
    assert_nan_exactly("out", got[0], clean[0], row)
    lse_nan = torch.zeros(B, HQ, SQ, dtype=torch.bool)
    lse_nan[bi, h, i] = True
    assert_nan_exactly("lse", got[1], clean[1], lse_nan)
    if backward:
        dq, dk, dv = got[2]
        assert torch.isnan(dq[bi, i, h]).all()
        dq_rest = dq.clone()
        dq_rest[bi, i, h] = 0
        clean_rest = clean[2][0].clone()
        clean_rest[bi, i, h] = 0
        assert torch.equal(dq_rest.cpu(), clean_rest.cpu()), "dQ of other rows changed"
        seen = SK if not causal else i + SK - SQ + 1
        hk = h // (HQ // HKV)
        assert torch.isnan(dk[bi, :seen, hk]).all(dim=-1).all(), "dK of seen keys must be NaN"
        assert torch.isnan(dv[bi, :seen, hk]).all(dim=-1).all(), "dV of seen keys must be NaN"
        for t, c in ((dk, clean[2][1]), (dv, clean[2][2])):  # other batch / kv head untouched
            assert torch.equal(t[1 - bi].cpu(), c[1 - bi].cpu())
            assert torch.equal(t[bi, :, 1 - hk].cpu(), c[bi, :, 1 - hk].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("backward", [False, True])
def test_dense_nan_in_seen_key(device, where, backward, gen):
    q, k, v, dout = dense_inputs(device, gen)
    bi, j, hk, col = 0, 77, 1, 5
    kn, vn = k.clone(), v.clone()
    (kn if where == "k" else vn)[bi, j, hk, col] = NAN
    clean = run_dense(q, k, v, backward, dout)
    got = run_dense(q, kn, vn, backward, dout)
    heads = torch.zeros(B, 1, HQ, 1, dtype=torch.bool)
    heads[bi, 0, hk * 2: hk * 2 + 2] = True  # the query heads of kv head hk
    if where == "k":  # every row of those heads sees key j: rows NaN, LSE NaN
        assert_nan_exactly("out", got[0], clean[0], heads)
        assert_nan_exactly("lse", got[1], clean[1], heads[:, 0, :, :].expand(B, HQ, SQ))
    else:  # column col of those rows; probabilities, LSE untouched
        cols = heads & (torch.arange(D) == col)
        assert_nan_exactly("out", got[0], clean[0], cols)
        assert torch.equal(got[1].cpu(), clean[1].cpu())
    if backward:
        dq, dk, dv = got[2]
        assert torch.isnan(dq[bi, :, hk * 2: hk * 2 + 2]).all()
        assert torch.equal(dq[1 - bi].cpu(), clean[2][0][1 - bi].cpu())
        assert torch.isnan(dk[bi, :, hk]).all()
        if where == "k":
            assert torch.isnan(dv[bi, :, hk]).all()
        else:  # P is finite, so dV = P^T dO is too
            assert torch.equal(dv.cpu(), clean[2][2].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_dense_masked_key_is_never_read(device, causal, backward, gen):
    q, k, v, dout = dense_inputs(device, gen)
    mask = torch.rand(B, SK, generator=gen) < 0.7
    mask[:, 40] = False
    mask = mask.to(device)
    kn, vn = k.clone(), v.clone()
    kn[:, 40], vn[:, 40] = NAN, NAN
    kn[~mask] = NAN
    vn[~mask] = float("inf")
    clean = run_dense(q, k, v, backward, dout, causal=causal, key_padding_mask=mask)
    got = run_dense(q, kn, vn, backward, dout, causal=causal, key_padding_mask=mask)
    for name, a, c in zip(("out", "lse"), got[:2], clean[:2]):
        assert torch.equal(a.cpu(), c.cpu()), f"{name} changed by values at masked keys"
    if backward:
        for name, a, c in zip(("dq", "dk", "dv"), got[2], clean[2]):
            assert torch.equal(a.cpu(), c.cpu()), f"{name} changed by values at masked keys"
        assert (got[2][1][~mask.cpu()] == 0).all() and (got[2][2][~mask.cpu()] == 0).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", [False, True])
def test_dense_padded_query_is_never_read(device, backward, gen):
    q, k, v, dout = dense_inputs(device, gen)
    qmask = torch.ones(B, SQ, dtype=torch.bool)
    qmask[0, 10:20] = False
    qn = q.clone()
    qn[0, 10:20] = NAN
    qmask = qmask.to(device)
    clean = run_dense(q, k, v, backward, dout, query_padding_mask=qmask)
    got = run_dense(qn, k, v, backward, dout, query_padding_mask=qmask)
    assert (got[0][0, 10:20] == 0).all() and (got[1][0, :, 10:20] == float("-inf")).all()
    for a, c in zip(got[:2], clean[:2]):
        assert torch.equal(a.cpu(), c.cpu())
    if backward:
        for a, c in zip(got[2], clean[2]):
            assert torch.equal(a.cpu(), c.cpu())


# dim 80: the Hopper forward's 96-wide tile (64-byte swizzle), whose V tail zeroing
# (zero_v_tail_rows) follows that layout's addresses.
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", [False, True])
@pytest.mark.parametrize("dim", [D, 80])
def test_varlen_nan_stays_in_its_sequence(device, backward, dim, gen):
    lens = [70, 0, 130, 45]
    cu = torch.tensor([0, 70, 70, 200, 245], dtype=torch.int32, device=device)
    T = 245
    q, k, v, dout = (rand(gen, T, HQ if n in "qo" else HKV, dim, device=device) for n in "qkvo")
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    qn[5, 0, 3] = NAN    # sequence 0, row 5, head 0
    kn[150, 1, 0] = NAN  # sequence 2, kv head 1
    vn[70] = NAN         # first row of sequence 2: the neighbour of sequence 0's last block

    def run(q, k, v):
        q, k, v = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
        out, lse = vidattn.attention_varlen(q, k, v, cu, cu, max(lens), max(lens),
                                            return_lse=True)
        if backward:
            out.backward(dout)
            return out, lse, q.grad, k.grad, v.grad
        return out, lse

    clean, got = run(q, k, v), run(qn, kn, vn)
    nan_out = torch.zeros(T, HQ, dim, dtype=torch.bool)
    nan_out[5, 0] = True
    nan_out[70:200] = True  # v NaN in every column of a key all of sequence 2 sees
    assert_nan_exactly("out", got[0], clean[0], nan_out)
    nan_lse = torch.zeros(HQ, T, dtype=torch.bool)
    nan_lse[0, 5] = True
    nan_lse[2:4, 70:200] = True  # the k NaN: query heads 2, 3 of kv head 1
    assert_nan_exactly("lse", got[1], clean[1], nan_lse)
    if backward:  # sequences 0 and 2 hold NaN; sequence 3 must be untouched
        for a, c in zip(got[2:], clean[2:]):
            assert torch.equal(a[200:].cpu(), c[200:].cpu())
        assert torch.isnan(got[2][5, 0]).all() and torch.isnan(got[2][70:200]).all()


def sparse_case(device, gen, V=64, Qt=3, Kt=5):
    # Query tile 0 selects key tiles 0, 2; tile 1 selects 1, 3; tile 2 selects 2. Key tile 4
    # is selected by nobody; key tile 2 has 40 valid slots, query tile 1 has 50.
    q = rand(gen, 1, Qt * V, HQ, D, device=device)
    k = rand(gen, 1, Kt * V, HKV, D, device=device)
    v = rand(gen, 1, Kt * V, HKV, D, device=device)
    dout = rand(gen, 1, Qt * V, HQ, D, device=device)
    idx = torch.tensor([[0, 2], [1, 3], [2, -1]], dtype=torch.int32)
    idx = idx.expand(1, HQ, Qt, 2).contiguous().to(device)
    cnt = torch.tensor([2, 2, 1], dtype=torch.int32).expand(1, HQ, Qt).contiguous().to(device)
    qs = torch.tensor([64, 50, 64], dtype=torch.int32, device=device)
    ks = torch.tensor([64, 64, 40, 64, 64], dtype=torch.int32, device=device)
    return q, k, v, dout, idx, cnt, qs, ks


def run_sparse(q, k, v, dout, idx, cnt, qs, ks, backward):
    q, k, v = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
    out, lse = vidattn.block_sparse_attention(q, k, v, idx, cnt, q_block_sizes=qs,
                                              kv_block_sizes=ks, return_lse=True)
    if backward:
        out.backward(dout)
        return out, lse, q.grad, k.grad, v.grad
    return out, lse


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", [False, True])
def test_block_sparse_nan_reaches_selecting_tiles_only(device, backward, gen):
    q, k, v, dout, idx, cnt, qs, ks = sparse_case(device, gen)
    qn, kn = q.clone(), k.clone()
    qn[0, 64 + 10, 1, 0] = NAN   # query tile 1, valid slot 10
    kn[0, 3 * 64 + 5, 0, 0] = NAN  # key tile 3 (selected by query tile 1 only), kv head 0
    clean = run_sparse(q, k, v, dout, idx, cnt, qs, ks, backward)
    got = run_sparse(qn, kn, v, dout, idx, cnt, qs, ks, backward)
    nan = torch.zeros(1, 192, HQ, 1, dtype=torch.bool)
    nan[0, 64 + 10, 1] = True
    nan[0, 64:64 + 50, 0:2] = True  # tile 1's valid slots, heads of kv head 0
    assert_nan_exactly("out", got[0], clean[0], nan)
    if backward:  # tile 0 and tile 2 rows never met either NaN
        for t in (0, 2):
            sl = slice(t * 64, (t + 1) * 64)
            assert torch.equal(got[2][0, sl].cpu(), clean[2][0, sl].cpu())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", [False, True])
def test_block_sparse_padding_and_unselected_tiles_are_never_read(device, backward, gen):
    q, k, v, dout, idx, cnt, qs, ks = sparse_case(device, gen)
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    qn[0, 64 + 50:128] = NAN          # padded query slots of tile 1
    kn[0, 2 * 64 + 40:192] = NAN      # padded key slots of tile 2
    vn[0, 2 * 64 + 40:192] = NAN
    kn[0, 4 * 64:], vn[0, 4 * 64:] = NAN, NAN  # key tile 4: selected by nobody
    clean = run_sparse(q, k, v, dout, idx, cnt, qs, ks, backward)
    got = run_sparse(qn, kn, vn, dout, idx, cnt, qs, ks, backward)
    for a, c in zip(got, clean):
        assert torch.equal(a.cpu(), c.cpu())


def vsa_case(device, gen, gate):
    t = vidattn.VideoTiling((4, 8, 7), (4, 4, 4), device=device)
    x = [rand(gen, 1, t.num_tokens, HQ if n == "q" else HKV, D, device=device) for n in "qkv"]
    q, k, v = (t.tile(a) for a in x)
    g = t.tile(rand(gen, 1, t.num_tokens, HQ, D, device=device)) if gate else None
    return t, q, k, v, g


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("gate", [False, True])
@pytest.mark.parametrize("backward", [False, True])
def test_vsa_nan_token_makes_its_tile_nan_not_zero(device, gate, backward, gen):
    t, q, k, v, g = vsa_case(device, gen, gate)
    valid = (torch.arange(64)[None, :] < t.block_sizes.cpu().long()[:, None]).reshape(-1)

    def run(q, k, v):
        q, k, v = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
        out = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=2, gate=g)
        if backward:
            out.backward(torch.ones_like(out))
            return out, q.grad
        return (out,)

    clean = run(q, k, v)
    qn = q.clone()
    qn[0, 64 + 3, 2, 9] = NAN  # tile 1, a valid slot, head 2
    got = run(qn, k, v)
    nan = torch.zeros(1, t.padded_len, HQ, 1, dtype=torch.bool)
    nan[0, 64:128, 2] = valid[64:128, None]  # the coarse row of tile 1 is NaN: all its slots
    assert_nan_exactly("out", got[0], clean[0], nan)
    if backward:
        assert torch.isnan(got[1][0, 64 + 3, 2]).all()
    # a NaN in k: every query tile's coarse row sees its tile, so every valid slot is NaN
    kn = k.clone()
    kn[0, 5, 1, 0] = NAN
    out = run(q, kn, v)[0].detach().cpu()
    heads = torch.zeros(1, 1, HQ, 1, dtype=torch.bool)
    heads[0, 0, 2:4] = True
    assert torch.equal(torch.isnan(out), (valid[None, :, None, None] & heads).expand_as(out))


@pytest.mark.parametrize("device", DEVICES)
def test_vsa_combine_nan_in_gate_or_fine(device, gen):
    V, Tt = 64, 3
    bs = torch.tensor([64, 30, 0], dtype=torch.int32, device=device)
    fine = rand(gen, 1, Tt * V, 2, 16, device=device)
    coarse = rand(gen, 1, Tt, 2, 16, device=device)
    gate = rand(gen, 1, Tt * V, 2, 16, device=device)
    clean = torch.ops.vidattn.vsa_combine(fine, coarse, gate, bs, V)
    gn, cn = gate.clone(), coarse.clone()
    gn[0, 5, 1, 2] = NAN       # a valid slot's gate: that element
    gn[0, 64 + 40, 0, 0] = NAN  # a padded slot's gate: never read
    cn[0, 2] = NAN             # coarse row of a zero-size tile: never read
    got = torch.ops.vidattn.vsa_combine(fine, cn, gn, bs, V)
    nan = torch.zeros_like(clean, dtype=torch.bool).cpu()
    nan[0, 5, 1, 2] = True
    assert_nan_exactly("out", got, clean, nan)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backward", [False, True])
def test_vsa_padded_slots_are_never_read(device, backward, gen):
    # Pooling, the coarse branch, the selection and the fine branch all skip padded slots.
    t, q, k, v, g = vsa_case(device, gen, gate=True)
    pad = 64 + 60  # tile 1 has 48 valid slots

    def run(q, k, v):
        q, k, v = (x.detach().clone().requires_grad_(backward) for x in (q, k, v))
        out, sel = vidattn.video_sparse_attention(q, k, v, tiling=t, topk=2, gate=g,
                                                  return_selection=True)
        res = [out, *sel]
        if backward:
            out.backward(torch.ones_like(out))
            valid = torch.ones(t.padded_len, dtype=torch.bool)
            valid[pad] = False  # the padded slot's own gradient is not defined by the rule
            res += [x.grad[:, valid.to(x.device)] for x in (q, k, v)]
        return res

    clean = run(q, k, v)
    qn, kn, vn = q.clone(), k.clone(), v.clone()
    for x in (qn, kn, vn):
        x[0, pad] = NAN
    for a, c in zip(run(qn, kn, vn), clean):
        assert torch.equal(a.cpu(), c.cpu())
