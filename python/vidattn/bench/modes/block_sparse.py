"""The block-sparse op against our dense forward on the same tensors, at Wan2.1-1.3B 480p (B1
H12, 624 tiles of 64 tokens = 39,936 slots, D128, bf16, 90% sparsity -> topk 63): forward,
backward, the k2q transpose, the forward inside a CUDA graph (no host-side index check), and
the forward with SMs left to concurrent kernels (sm_margin). TFLOP/s count the selected blocks:
4*B*H*Sq*(topk*64)*D forward, 2.5x that backward.

  python -m vidattn.bench block-sparse [--out F.json]"""
from __future__ import annotations

import json

from .common import parser, result_doc, write_json


def main(argv) -> int:
    p = parser("block-sparse", __doc__)
    p.add_argument("--out", default=None, help="JSON file for the results")
    args = p.parse_args(argv)
    import torch
    import vidattn

    from ..timing import gpu_median_ms

    B, H, D, V, tiles, topk = 1, 12, 128, 64, 624, 63
    S = tiles * V
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, S, H, D, generator=g, device="cuda", dtype=torch.bfloat16)
               for _ in range(3))
    # A random selection of topk tiles per (head, query tile), ascending.
    scores = torch.rand(B, H, tiles, tiles, generator=g, device="cuda")
    idx = scores.topk(topk, dim=-1).indices.sort(-1).values.to(torch.int32).contiguous()
    cnt = torch.full((B, H, tiles), topk, dtype=torch.int32, device="cuda")
    ops = torch.ops.vidattn
    out, lse = ops.block_sparse_attention(q, k, v, idx, cnt, tile_volume=V)
    dout = torch.randn_like(out)
    off, k2q = ops.block_sparse_transpose_index(idx, cnt, tiles)

    def backward():
        return ops.block_sparse_attention_backward(
            dout, q, k, v, out, lse, idx, cnt, off, k2q, tile_volume=V, q_block_sizes=None,
            kv_block_sizes=None, scale=None, deterministic=True)

    fwd_flops = 4.0 * B * H * S * (topk * V) * D
    res = {}
    res["sparse_fwd_ms"] = gpu_median_ms(
        lambda: ops.block_sparse_attention(q, k, v, idx, cnt, tile_volume=V))
    res["sparse_bwd_ms"] = gpu_median_ms(backward)
    res["transpose_ms"] = gpu_median_ms(
        lambda: ops.block_sparse_transpose_index(idx, cnt, tiles))
    res["dense_fwd_ms"] = gpu_median_ms(lambda: vidattn.attention(q, k, v))
    # Inside a CUDA graph the host-synchronising index check is skipped: the kernels alone.
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.block_sparse_attention(q, k, v, idx, cnt, tile_volume=V)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        ops.block_sparse_attention(q, k, v, idx, cnt, tile_volume=V)
    res["sparse_fwd_graph_ms"] = gpu_median_ms(graph.replay)
    qg, kg, vg = (x.detach().requires_grad_() for x in (q, k, v))
    dense_out = vidattn.attention(qg, kg, vg)
    res["dense_bwd_ms"] = gpu_median_ms(
        lambda: torch.autograd.grad(dense_out, (qg, kg, vg), dout, retain_graph=True))
    res["sparse_fwd_tflops"] = fwd_flops / res["sparse_fwd_ms"] * 1e-9
    res["sparse_fwd_graph_tflops"] = fwd_flops / res["sparse_fwd_graph_ms"] * 1e-9
    res["sparse_bwd_tflops"] = 2.5 * fwd_flops / res["sparse_bwd_ms"] * 1e-9
    res["dense_fwd_tflops"] = 4.0 * B * H * S * S * D / res["dense_fwd_ms"] * 1e-9
    res["dense_bwd_tflops"] = 2.5 * 4.0 * B * H * S * S * D / res["dense_bwd_ms"] * 1e-9
    res["sparse_fwd_speedup_vs_dense"] = res["dense_fwd_ms"] / res["sparse_fwd_ms"]
    # What leaving SMs to concurrent kernels (sm_margin, for sequence parallelism) costs alone.
    for margin in (0, 8, 16, 32):
        ms = gpu_median_ms(
            lambda: ops.block_sparse_attention(q, k, v, idx, cnt, tile_volume=V,
                                               validate_index=False, sm_margin=margin))
        res[f"sparse_fwd_tflops_sm_margin_{margin}"] = fwd_flops / ms * 1e-9
    print(json.dumps(res, indent=1))
    if args.out:
        write_json(args.out, result_doc("block-sparse", argv, results=res))
    return 0
