"""Bad inputs, each a few lines run in a worker process: a clear Python exception (ValueError,
TypeError, RuntimeError, IndexError, NotImplementedError) passes, a return without one is a
failure (a silent answer to a bad input), and a crash (signal, abort) is counted as one.
Entries of kind "ok" are inputs that must work (NaN, empty tensors): their code asserts what
must hold, and any exception fails them.

`expect_fail` holds the reason an entry fails today, for work that is known and planned
elsewhere: such an entry is reported (xfail, or xpass once fixed) but does not fail the run.
One entry needs it: the Hopper varlen isolation gap that docs/conventions.md lists.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

PRELUDE = """
import torch, vidattn
dev = DEVICE
def r(*s, dtype=torch.float16 if dev == 'cuda' else torch.float32, device=None):
    return torch.randn(*s, dtype=dtype, device=device or dev)
B, S, H, D = 2, 70, 2, 64
q, k, v = r(B, S, H, D), r(B, S, H, D), r(B, S, H, D)
cu = torch.tensor([0, 30, 70], dtype=torch.int32, device=dev)
V = 64
idx = torch.tensor([0, 1], dtype=torch.int32, device=dev).expand(1, 2, 1, 2).contiguous()
cnt = torch.full((1, 2, 1), 2, dtype=torch.int32, device=dev)
bq, bk, bv = r(1, V, 2, D), r(1, 2 * V, 2, D), r(1, 2 * V, 2, D)
nan = float('nan')
"""

RAISE, OK = "raise", "ok"

# A NaN in v of the second sequence stays in the second sequence.
VARLEN_OTHER_SEQUENCE = ("v2 = v[0].clone(); v2[35] = nan\n"
                         "o = vidattn.attention_varlen(q[0], k[0], v2, cu, cu, 40, 40)\n"
                         "assert o[:30].isfinite().all() and o[30:].isnan().any()")


@dataclass(frozen=True)
class Entry:
    name: str
    code: str
    kind: str = RAISE
    devices: tuple = ("cpu", "cuda")
    expect_fail: Optional[str] = None
    expect_fail_on: tuple = ("cpu", "cuda")  # the devices expect_fail applies to

    def expected_failure(self, device: str) -> Optional[str]:
        return self.expect_fail if device in self.expect_fail_on else None


ENTRIES = [
    # dtypes and shapes
    Entry("attention.int_q", "vidattn.attention(q.int(), k, v)"),
    Entry("attention.mixed_dtype", "vidattn.attention(q, k.double(), v)"),
    Entry("attention.rank3", "vidattn.attention(q[0], k[0], v[0])"),
    Entry("attention.head_dim_mismatch", "vidattn.attention(q, k[..., :32], v)"),
    Entry("attention.batch_mismatch", "vidattn.attention(q, k[:1], v[:1])"),
    Entry("attention.sk_mismatch_kv", "vidattn.attention(q, k, v[:, :10])"),
    Entry("attention.heads_not_multiple", "vidattn.attention(r(B, S, 3, D), k, v)"),
    Entry("attention.noncontiguous_d", "vidattn.attention(q.transpose(1, 3).contiguous().transpose(1, 3)[..., ::2], k[..., ::2], v[..., ::2])"),
    Entry("attention.key_mask_shape", "vidattn.attention(q, k, v, key_padding_mask=torch.ones(B, S + 1, dtype=torch.bool, device=dev))"),
    Entry("attention.key_mask_dtype", "vidattn.attention(q, k, v, key_padding_mask=torch.ones(B, S, device=dev))"),
    Entry("attention.query_mask_shape", "vidattn.attention(q, k, v, query_padding_mask=torch.ones(B, 3, dtype=torch.bool, device=dev))"),
    Entry("attention.not_tensor", "vidattn.attention(q, k, [1, 2])"),
    # device and meta mixing
    Entry("attention.meta_k", "vidattn.attention(q, k.to('meta'), v)"),
    Entry("attention.meta_key_mask", "vidattn.attention(q, k, v, key_padding_mask=torch.ones(B, S, dtype=torch.bool, device='meta'))"),
    Entry("attention.cpu_cuda_mix", "vidattn.attention(q, k.cpu(), v)", devices=("cuda",)),
    Entry("rope.meta_tables", "vidattn.apply_rope(r(2, 5, 3, 8), torch.randn(5, 4, device='meta'), torch.randn(5, 4, device='meta'))"),
    Entry("rope.odd_dim", "vidattn.apply_rope(r(2, 5, 3, 7), torch.randn(5, 3, device=dev), torch.randn(5, 3, device=dev))"),
    Entry("rope.table_shape", "vidattn.apply_rope(r(2, 5, 3, 8), torch.randn(6, 4, device=dev), torch.randn(6, 4, device=dev))"),
    Entry("rope.cos_sin_mismatch", "vidattn.apply_rope(r(2, 5, 3, 8), torch.randn(5, 4, device=dev), torch.randn(5, 8, device=dev))"),
    # varlen
    Entry("varlen.cu_dtype", "vidattn.attention_varlen(q[0], k[0], v[0], cu.long(), cu, 40, 40)"),
    Entry("varlen.cu_start", "vidattn.attention_varlen(q[0], k[0], v[0], cu + 1, cu, 40, 40)"),
    Entry("varlen.cu_decreasing", "vidattn.attention_varlen(q[0], k[0], v[0], torch.tensor([0, 50, 40, 70], dtype=torch.int32, device=dev), cu, 70, 70)"),
    Entry("varlen.cu_past_end", "vidattn.attention_varlen(q[0], k[0], v[0], torch.tensor([0, 30, 90], dtype=torch.int32, device=dev), cu, 60, 40)"),
    Entry("varlen.cu_count_mismatch", "vidattn.attention_varlen(q[0], k[0], v[0], cu, cu[:2], 40, 40)"),
    Entry("varlen.max_seqlen_small", "vidattn.attention_varlen(q[0], k[0], v[0], cu, cu, 5, 5)"),
    Entry("varlen.meta_cu", "vidattn.attention_varlen(q[0], k[0], v[0], cu.to('meta'), cu, 40, 40)"),
    Entry("varlen.cu_2d", "vidattn.attention_varlen(q[0], k[0], v[0], cu[None], cu, 40, 40)"),
    # block-sparse
    Entry("block_sparse.index_out_of_range", "vidattn.block_sparse_attention(bq, bk, bv, idx + 5, cnt)"),
    Entry("block_sparse.index_not_ascending", "vidattn.block_sparse_attention(bq, bk, bv, idx.flip(-1).contiguous(), cnt)"),
    Entry("block_sparse.count_too_big", "vidattn.block_sparse_attention(bq, bk, bv, idx, cnt + 1)"),
    Entry("block_sparse.count_negative", "vidattn.block_sparse_attention(bq, bk, bv, idx, cnt - 3)"),
    Entry("block_sparse.index_dtype", "vidattn.block_sparse_attention(bq, bk, bv, idx.long(), cnt)"),
    Entry("block_sparse.seq_not_multiple", "vidattn.block_sparse_attention(bq[:, :60], bk, bv, idx, cnt)"),
    Entry("block_sparse.tile_volume", "vidattn.block_sparse_attention(bq, bk, bv, idx, cnt, tile_volume=48)"),
    Entry("block_sparse.block_sizes_too_big", "vidattn.block_sparse_attention(bq, bk, bv, idx, cnt, kv_block_sizes=torch.tensor([65, 64], dtype=torch.int32, device=dev))"),
    Entry("block_sparse.meta_index", "vidattn.block_sparse_attention(bq, bk, bv, idx.to('meta'), cnt)"),
    # VSA
    Entry("vsa.tiling_float_grid", "vidattn.VideoTiling((4.7, 4, 4))"),
    Entry("vsa.tile_volume", "vidattn.VideoTiling((4, 4, 4), (3, 4, 4))"),
    Entry("vsa.untiled_input", "t = vidattn.VideoTiling((4, 4, 4), device=dev); vidattn.video_sparse_attention(r(1, 63, 2, D), r(1, 63, 2, D), r(1, 63, 2, D), tiling=t, topk=1)"),
    Entry("vsa.gate_shape", "t = vidattn.VideoTiling((4, 8, 4), device=dev); x = r(1, 128, 2, D); vidattn.video_sparse_attention(x, x, x, tiling=t, topk=1, gate=r(1, 128, 2, 8))"),
    Entry("vsa.gate_with_dv_ne_d", "t = vidattn.VideoTiling((4, 8, 4), device=dev); x = r(1, 128, 2, D)\n"
          "o = vidattn.video_sparse_attention(x, x, r(1, 128, 2, 32), tiling=t, topk=1, gate=r(1, 128, 2, 32))\n"
          "assert o.shape == (1, 128, 2, 32)", kind=OK),
    Entry("vsa.topk_zero", "t = vidattn.VideoTiling((4, 8, 4), device=dev); x = r(1, 128, 2, D); vidattn.video_sparse_attention(x, x, x, tiling=t, topk=0)"),
    Entry("gather_tokens.rank3", "torch.ops.vidattn.gather_tokens(r(4, 2, 8), torch.zeros(4, dtype=torch.int32, device=dev))"),
    # must work: NaN and empty tensors
    Entry("nan.q_row", "q2 = q.clone(); q2[0, 3, 1, 5] = nan; o, l = vidattn.attention(q2, k, v, return_lse=True)\n"
          "assert o[0, 3, 1].isnan().all() and l[0, 1, 3].isnan(), 'NaN in q must reach its row'\n"
          "o[0, 3, 1] = 0; assert o.isfinite().all(), 'NaN in q must stay in its row'", kind=OK),
    Entry("nan.k_key", "k2 = k.clone(); k2[1, 9, 0, 2] = nan; o = vidattn.attention(q, k2, v)\n"
          "assert o[1, :, 0].isnan().all() and o[0].isfinite().all() and o[1, :, 1].isfinite().all()", kind=OK),
    Entry("nan.masked_key_ignored", "m = torch.ones(B, S, dtype=torch.bool, device=dev); m[:, 4] = False\n"
          "k2, v2 = k.clone(), v.clone(); k2[:, 4] = nan; v2[:, 4] = nan\n"
          "assert vidattn.attention(q, k2, v2, key_padding_mask=m).isfinite().all()", kind=OK),
    Entry("nan.varlen_other_sequence", VARLEN_OTHER_SEQUENCE, kind=OK),
    Entry("empty.batch0", "o = vidattn.attention(q[:0], k[:0], v[:0]); assert o.shape == (0, S, H, D)", kind=OK),
    Entry("empty.sk0", "o, l = vidattn.attention(q, k[:, :0], v[:, :0], return_lse=True); assert (o == 0).all() and (l == float('-inf')).all()", kind=OK),
    Entry("empty.sq0", "o = vidattn.attention(q[:, :0], k, v); assert o.shape == (B, 0, H, D)", kind=OK),
    Entry("empty.varlen_empty_sequence", "c0 = torch.tensor([0, 0, 70], dtype=torch.int32, device=dev)\n"
          "o = vidattn.attention_varlen(q[0], k[0], v[0], c0, c0, 70, 70); assert o.isfinite().all()", kind=OK),
    Entry("empty.rope_s0", "o = vidattn.apply_rope(r(2, 0, 3, 8), torch.randn(0, 4, device=dev), torch.randn(0, 4, device=dev)); assert o.shape == (2, 0, 3, 8)", kind=OK),
]


def entries_for(device: str):
    return [e for e in ENTRIES if device in e.devices]
