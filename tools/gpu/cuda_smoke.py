"""One small CUDA forward + backward per feature (masks, causal, GQA, varlen, strides, and
block-sparse attention with partial tiles for each tile volume), for compute-sanitizer runs
(its kernel filter `kns=attention` matches every kernel here): exits non-zero on any
non-finite output."""
import torch

import vidattn


def main() -> None:
    g = torch.Generator(device="cuda")
    g.manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device="cuda").to(dtype).requires_grad_()

    results = []
    for dtype in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            q, k, v = rnd(2, 70, 4, D, dtype=dtype), rnd(2, 90, 2, D, dtype=dtype), rnd(2, 90, 2, D, dtype=dtype)
            kmask = torch.rand((2, 90), generator=g, device="cuda") > 0.3
            qmask = torch.rand((2, 70), generator=g, device="cuda") > 0.2
            out = vidattn.attention(q, k, v, causal=True, key_padding_mask=kmask, query_padding_mask=qmask)
            results += [out] + list(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
            # Not causal: on sm_90 the padding runs packed as varlen (gathers, scatter).
            out = vidattn.attention(q, k, v, key_padding_mask=kmask, query_padding_mask=qmask)
            results += [out] + list(torch.autograd.grad(out, (q, k, v), torch.ones_like(out)))
            cu_q = torch.tensor([0, 10, 10, 75], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, 5, 37, 100], dtype=torch.int32, device="cuda")
            qv, kv, vv = rnd(75, 4, D, dtype=dtype), rnd(100, 2, D, dtype=dtype), rnd(100, 2, D, dtype=dtype)
            out = vidattn.attention_varlen(qv, kv, vv, cu_q, cu_k, 65, 63, causal=True)
            results += [out] + list(torch.autograd.grad(out, (qv, kv, vv), torch.ones_like(out)))
            for V in (64, 128, 256):  # block-sparse: GQA, partial and empty tiles, a count-0 row
                Qt, Kt = 3, 4
                qs, ks, vs = rnd(2, Qt * V, 4, D, dtype=dtype), rnd(2, Kt * V, 2, D, dtype=dtype), rnd(2, Kt * V, 2, D, dtype=dtype)
                idx = torch.tensor([[0, 2, 3], [1, 3, -1], [-1, -1, -1]], dtype=torch.int32, device="cuda")
                idx = idx.expand(2, 4, Qt, 3).contiguous()
                cnt = torch.tensor([3, 2, 0], dtype=torch.int32, device="cuda").expand(2, 4, Qt).contiguous()
                q_sizes = torch.tensor([V, V // 2 + 3, 1], dtype=torch.int32, device="cuda")
                kv_sizes = torch.tensor([V - 5, 0, V, 7], dtype=torch.int32, device="cuda")
                out = vidattn.block_sparse_attention(qs, ks, vs, idx, cnt, tile_volume=V,
                                                     q_block_sizes=q_sizes, kv_block_sizes=kv_sizes)
                results += [out] + list(torch.autograd.grad(out, (qs, ks, vs), torch.ones_like(out)))
    # VSA coarse stage: tile / untile, pooling (+ backward), top-k selection (plain, packed
    # with sparsity, GQA) and the selection from given scores.
    t = vidattn.VideoTiling(grids=[(5, 7, 9), (3, 9, 10)], tile=(4, 4, 4), device="cuda")
    for dtype in (torch.bfloat16, torch.float32):
        x = rnd(1, t.num_tokens, 4, 64, dtype=dtype)
        xt = t.tile(x)
        pooled = vidattn.tile_mean_pool(xt, t.block_sizes, t.tile_volume)
        (gx,) = torch.autograd.grad(pooled, x, torch.ones_like(pooled))
        kc = pooled.detach()[:, :, :2]
        idx, cnt = vidattn.select_topk_tiles(pooled.detach(), kc, 5)
        pidx, pcnt = vidattn.select_topk_tiles(pooled.detach(), kc, 5, sparsity=0.5,
                                               cu_tiles_q=t.cu_tiles, cu_tiles_k=t.cu_tiles)
        sidx, scnt = vidattn.topk_tiles_from_scores(torch.randn(1, 2, 9, 300, generator=g, device="cuda"), 17)
        results += [t.untile(xt), pooled, gx] + [i.float() for i in (idx, cnt, pidx, pcnt, sidx, scnt)]
    # The whole VSA op with a gate (pool, coarse attention, selection, block-sparse, fused
    # combine) forward and backward.
    t = vidattn.VideoTiling((5, 7, 9), (4, 4, 4), device="cuda")
    q, k, v, gate = (t.tile(rnd(1, t.num_tokens, 2, 64)) for _ in range(4))
    xs = [x.detach().requires_grad_() for x in (q, k, v, gate)]
    out = vidattn.video_sparse_attention(*xs[:3], tiling=t, sparsity=0.75, gate=xs[3])
    results += [out] + list(torch.autograd.grad(out, xs, torch.ones_like(out)))
    # The combination on a run of raster rows that ends in padding rows (the
    # sequence-parallel layer's), float32 coarse with bf16 rows, forward and backward.
    fine, row_gate = (rnd(1, 200, 2, 64).detach().requires_grad_() for _ in range(2))
    coarse = torch.randn(1, t.num_tiles, 2, 64, generator=g, device="cuda").requires_grad_()
    rows = torch.ops.vidattn.vsa_combine_rows(fine, coarse, row_gate, t.token_to_slot,
                                              t.slot_to_token, 64, t.num_tokens - 150)
    results += [rows] + list(torch.autograd.grad(rows, (fine, coarse, row_gate),
                                                 torch.ones_like(rows)))
    torch.cuda.synchronize()
    bad = [i for i, t in enumerate(results) if not torch.isfinite(t).all()]
    print("cuda_smoke: tensors", len(results), "non-finite", bad)
    raise SystemExit(1 if bad else 0)


if __name__ == "__main__":
    main()
