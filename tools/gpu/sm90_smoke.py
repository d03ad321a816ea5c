"""Small sm_90a forward runs (dense with masks / causal / GQA / varlen, multi-tile persistent
cases, D = 64's 192-row tile, D = 128 cross attention, D = 128's CTA pairs, block-sparse 64 and
128, the 64-token kernel with VSA's combination) for compute-sanitizer: exits non-zero on
non-finite output or when the sm90 kernels did not run. Counts the launches with the test-only
ops, so it needs an op library built with VIDATTN_TESTING=ON (tools/gpu/gpu_runner.sh and
tools/gpu/sm90_loop.sh build one)."""
import sys

import torch

import vidattn


def main() -> int:
    g = torch.Generator(device="cuda")
    g.manual_seed(0)

    def rnd(*shape, dtype=torch.bfloat16):
        return torch.randn(shape, generator=g, device="cuda").to(dtype)

    before = torch.ops.vidattn._sm90_forward_launches()
    results = []
    for dtype in (torch.bfloat16, torch.float16):
        for D in (64, 128):
            q, k, v = rnd(2, 70, 4, D, dtype=dtype), rnd(2, 90, 2, D, dtype=dtype), rnd(2, 90, 2, D, dtype=dtype)
            kmask = torch.rand((2, 90), generator=g, device="cuda") > 0.3
            qmask = torch.rand((2, 70), generator=g, device="cuda") > 0.2
            results.append(vidattn.attention(q, k, v, causal=True, key_padding_mask=kmask,
                                             query_padding_mask=qmask))
            cu_q = torch.tensor([0, 10, 10, 75], dtype=torch.int32, device="cuda")
            cu_k = torch.tensor([0, 5, 37, 100], dtype=torch.int32, device="cuda")
            qv, kv, vv = rnd(75, 4, D, dtype=dtype), rnd(100, 2, D, dtype=dtype), rnd(100, 2, D, dtype=dtype)
            results.append(vidattn.attention_varlen(qv, kv, vv, cu_q, cu_k, 65, 63, causal=True))
    q = rnd(2, 1024, 16, 128)  # 256 tiles: several per CTA of the persistent grid
    results.append(vidattn.attention(q, q, q))
    q = rnd(2, 1000, 16, 64)  # D = 64's 192-row tiles, several per CTA, a partial last one
    results.append(vidattn.attention(q, q, q))
    # D = 128 with 257 keys on three warpgroups of 64-key blocks (264 tiles of 192 rows, two
    # per CTA; small problems stay on the 128-row tile): a one-key last block, GQA.
    q, k = rnd(1, 384, 132, 128), rnd(1, 257, 12, 128)
    results.append(vidattn.attention(q, k, k))
    # D = 64 with 128 keys: the D = 64 one-block kernel, 288 tiles, a partial last one.
    q, k = rnd(2, 1000, 48, 64), rnd(2, 128, 4, 64)
    results.append(vidattn.attention(q, k, k))
    # A last round split into 64-row pieces (SplitTail): 146 192-row tiles on an H200's 132
    # SMs, the last 14 as 42 pieces on CTAs that ran a whole tile first; D = 64 self attention
    # and D = 128 with 300 keys (three warpgroups over 64-key blocks).
    q = rnd(1, 347, 73, 64)
    results.append(vidattn.attention(q, q, q))
    q, k = rnd(1, 347, 73, 128), rnd(1, 300, 1, 128)
    results.append(vidattn.attention(q, k, k))
    # Causal on the same kernel, 260 tiles on 132 CTAs: the snake order's last round, whose
    # slots past the tiles land on whole tiles (not pieces: nothing is split under causal).
    q, k = rnd(1, 384, 130, 128), rnd(1, 77, 10, 128)
    results.append(vidattn.attention(q, k, k, causal=True))
    q = rnd(1, 2000, 13, 64)  # D = 64's three-warpgroup tiles likewise: 143 tiles
    results.append(vidattn.attention(q, q, q, causal=True))
    # D = 128 with 77 keys: the one-block kernel (three warpgroups, one 128-key block), whole
    # tiles (384 x 132 heads: two per CTA) and a split last round (347 x 73 heads).
    q, k = rnd(1, 384, 132, 128), rnd(1, 77, 12, 128)
    results.append(vidattn.attention(q, k, k))
    q, k = rnd(1, 347, 73, 128), rnd(1, 77, 1, 128)
    results.append(vidattn.attention(q, k, k))
    # D = 64 with 8200 keys on the persistent grid, and past its 24576 keys on one CTA per
    # tile (partial query tile, partial key block).
    for keys in (8200, 24600):
        q, k = rnd(1, 500, 2, 64), rnd(1, keys, 2, 64)
        results.append(vidattn.attention(q, k, k))
        results.append(vidattn.attention(q, k, k, causal=True))
    # D = 128 past the persistent grid's 24576 keys: two query blocks of a head run as a CTA
    # pair sharing K / V loads by multicast, three as single CTAs; a partial last key block.
    q, k = rnd(1, 256, 2, 128), rnd(1, 24700, 2, 128)
    results.append(vidattn.attention(q, k, k))
    q = rnd(1, 300, 2, 128)
    results.append(vidattn.attention(q, k, k))
    # Key padding over several key blocks, the mask a view at an odd offset: the key-mask
    # instance's flag loads end inside a lane's four keys.
    q, k = rnd(2, 300, 4, 128), rnd(2, 1283, 2, 128)
    kmask = (torch.rand((2, 1284), generator=g, device="cuda") > 0.4)[:, 1:]
    results.append(vidattn.attention(q, k, k, key_padding_mask=kmask, causal=True))
    # Not causal, the padding runs packed as varlen: q and out in place, then with a query
    # mask on [B, H, S, D] views (q gathered too, the output scattered back).
    results.append(vidattn.attention(q, k, k, key_padding_mask=kmask))
    qt, kt = rnd(2, 4, 300, 128).transpose(1, 2), rnd(2, 2, 1283, 128).transpose(1, 2)
    qmask = torch.rand((2, 300), generator=g, device="cuda") > 0.2
    results.append(vidattn.attention(qt, kt, kt, key_padding_mask=kmask, query_padding_mask=qmask))
    for tile in (64, 128):
        tiles = 6
        q = rnd(1, tiles * tile, 4, 128)
        k = rnd(1, tiles * tile, 2, 128)
        index = torch.tensor([0, 2, 5], dtype=torch.int32, device="cuda").expand(1, 4, tiles, 3).contiguous()
        count = torch.randint(0, 4, (1, 4, tiles), generator=g, device="cuda", dtype=torch.int32)
        sizes = torch.tensor([tile, 1, tile, 0, tile, tile // 2], dtype=torch.int32, device="cuda")
        results.append(vidattn.block_sparse_attention(q, k, k, index, count, tile_volume=tile,
                                                      kv_block_sizes=sizes))
    # VSA's combination inside the 64-token kernel (vsa_fine_combined), with a persistent grid
    # of one CTA, so that the combining warps take many tiles from the consumers.
    tiles = 40
    q, k = rnd(1, tiles * 64, 4, 128), rnd(1, tiles * 64, 2, 128)
    index = torch.tensor([1, 7, 30], dtype=torch.int32, device="cuda").expand(1, 4, tiles, 3).contiguous()
    count = torch.randint(0, 4, (1, 4, tiles), generator=g, device="cuda", dtype=torch.int32)
    sizes = torch.randint(0, 65, (tiles,), generator=g, device="cuda", dtype=torch.int32)
    coarse, gate = rnd(1, tiles, 4, 128), rnd(1, tiles * 64, 4, 128)
    for margin in (0, 100000):
        out, fine, lse = torch.ops.vidattn.vsa_fine_combined(q, k, k, index, count, coarse, gate,
                                                             sizes, kv_block_sizes=sizes,
                                                             sm_margin=margin)
        results += [out, fine]
    torch.cuda.synchronize()
    launched = torch.ops.vidattn._sm90_forward_launches() - before
    bad = [i for i, t in enumerate(results) if not torch.isfinite(t).all()]
    print("sm90_smoke: outputs", len(results), "sm90 launches", launched, "non-finite", bad)
    return 1 if bad or launched < len(results) - 2 else 0  # two outputs per fused launch


if __name__ == "__main__":
    sys.exit(main())
