"""The gpu-suite's 64-token block-sparse rows, ours only, by the bench's timer: one line per
row, labelled with PROBE_LABEL (the sm_90a measuring switches are read once per process, so
tools/sparse_setting_ab_device_run.sh runs one process per setting).

    PROBE_LABEL=spread4 VIDATTN_SM90_WALK_SPREAD=4 python3 tools/probe_sparse_rows.py

By default uniform random ascending lists (the bench's selection, seeded), bf16, D128.
PROBE_LISTS (comma separated) adds other ways of drawing the same number of key tiles per
query tile, each selecting every key tile about equally often, to tell apart where the
streams' K / V working set comes from:
  uniform     the bench's lists;
  stratified  one tile drawn at random from each of k equal strata of the key tiles, so the
              i-th entry of every list lies in the i-th stratum: lists at the same fraction of
              their walk read keys at most one stratum apart;
  strided     k tiles evenly spaced from a random offset (no randomness beyond the offset);
  window4     uniform lists over the first quarter of the key tiles (a 4x smaller working
              set, the reference of the L2 windows entry in docs/perf-notes.md).
PROBE_SHAPES ("seq,heads,sparsity;..."), if set, replaces the gpu-suite's rows (B = 1, D = 128).
Not a test.
"""
import os

import torch

import vidattn
from vidattn.bench.blocksparse_case import blocksparse_case, random_selection, topk_of
from vidattn.bench.shapes import PRESETS, block_sparse
from vidattn.bench.timing import gpu_median_ms


def selection(kind, batch, heads, tiles, topk, g):
    """Ascending int32 index [B, H, Qt, topk] and count [B, H, Qt] drawn the way `kind` says."""
    if kind == "uniform":
        return random_selection(batch, heads, tiles, tiles, topk, g, "cuda")
    if kind == "window4":
        return random_selection(batch, heads, tiles, max(tiles // 4, topk), topk, g, "cuda")
    # Stratum i covers key tiles [floor(i N / k), floor((i + 1) N / k)), never empty for k <= N.
    edges = (torch.arange(topk + 1, device="cuda", dtype=torch.float64) * tiles / topk).floor()
    lo, width = edges[:-1], edges[1:] - edges[:-1]
    if kind == "stratified":
        u = torch.rand(batch, heads, tiles, topk, generator=g, device="cuda", dtype=torch.float64)
    elif kind == "strided":
        u = torch.rand(batch, heads, tiles, 1, generator=g, device="cuda", dtype=torch.float64)
        u = u.expand(batch, heads, tiles, topk)
    else:
        raise ValueError(f"PROBE_LISTS: unknown list kind {kind!r}")
    index = (lo + (u * width).floor()).to(torch.int32).contiguous()
    count = torch.full((batch, heads, tiles), topk, dtype=torch.int32, device="cuda")
    return index, count


def main() -> None:
    label = os.environ.get("PROBE_LABEL", "default")
    kinds = os.environ.get("PROBE_LISTS", "uniform").split(",")
    g = torch.Generator(device="cuda").manual_seed(0)
    case = blocksparse_case(torch.device("cuda"))
    shapes = [s for s in PRESETS["gpu-suite"].shapes if s.kind == "blocksparse"]
    if os.environ.get("PROBE_SHAPES"):
        shapes = [block_sparse(1, int(h), int(n), 128, float(s))
                  for n, h, s in (row.split(",") for row in os.environ["PROBE_SHAPES"].split(";"))]
    for shape in shapes:
        tiles = shape.q_len // 64
        q, k, v = (torch.randn(shape.batch, shape.q_len, shape.heads, shape.head_dim,
                               generator=g, device="cuda", dtype=torch.bfloat16)
                   for _ in range(3))
        for kind in kinds:
            index, count = selection(kind, shape.batch, shape.heads, tiles, topk_of(shape), g)
            assert bool((index[..., 1:] > index[..., :-1]).all()), kind  # distinct, ascending
            ms = gpu_median_ms(lambda: vidattn.block_sparse_attention(
                q, k, v, index, count, tile_volume=64, validate_index=False))
            name = shape.label if kind == "uniform" else f"{shape.label} [{kind}]"
            print(f"setting {label}: {name}: {ms:.3f} ms "
                  f"{case.forward_flops(shape) / ms / 1e9:.1f} TFLOP/s", flush=True)
            del index, count
        del q, k, v


if __name__ == "__main__":
    main()
