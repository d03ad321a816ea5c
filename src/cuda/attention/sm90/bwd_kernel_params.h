// Device-side parameters of the sm_90a backward kernels: the problem, the TMA descriptors of
// the stationary and streamed tiles (passed by value as a __grid_constant__ kernel
// parameter), and the row statistics the preprocess kernel writes.
#pragma once

#include <cstdint>

#include "bwd_traits.h"
#include "cuda/common/params.h"
#include "fwd_params.h"

namespace vidattn::cuda_sm90 {

// Per query row, in [B][Hq][rows] fp32 arrays with rows = seqlen_q (max_seqlen_q for varlen)
// rounded up to a whole stationary tile, so that every tile's rows are in bounds and 16-byte
// aligned for the bulk copies:
//   lse2:  LSE * log2(e), or +inf where the row takes no gradient (padded, masked, past the
//          sequence, or it saw no key): P = exp2(s * scale * log2(e) - lse2) is then 0;
//   delta: rowsum(dO * O), 0 on those rows.
// Indexed by the sequence's index b (blockIdx.z of the main kernels), not Sequence::batch,
// which is 0 for every varlen sequence.
struct BwdRowStats {
  float* lse2 = nullptr;
  float* delta = nullptr;
  std::int64_t rows = 0;
  __host__ __device__ std::int64_t offset(std::int64_t b, int h, int heads_q,
                                          std::int64_t row) const {
    return (b * heads_q + h) * rows + row;
  }
};

// Fused dQ workspace (BwdTraits::kFusedDq): per (sequence b, query head h) the
// stats.rows / kCols tiles of kCols query rows, each kDqTileFloats fp32 values in the fragment
// order of bwd_fused_dq.h. The tile holding rows q0 .. q0 + kCols (q0 a multiple of kCols):
template <class Traits>
__host__ __device__ std::int64_t dq_tile_offset(const BwdRowStats& stats, int heads_q,
                                                std::int64_t b, int h, std::int64_t q0) {
  return ((b * heads_q + h) * (stats.rows / Traits::kCols) + q0 / Traits::kCols) *
         Traits::kDqTileFloats;
}

template <class Traits>
struct BwdKernelParams {
  cuda_common::AttentionParams attn;
  // Block-sparse: the dQ kernel walks the forward's key lists (the dK / dV kernel reads the
  // k2q lists from attn).
  SparseKeyListArgs sparse;
  BwdRowStats stats;
  // Fused dQ (Traits::kFusedDq): the fp32 workspace of dq_tile_offset, zeroed before the
  // kernel.
  float* dq_accum = nullptr;
  // The stationary pair (K, V for dK / dV; Q, dO for dQ) and the streamed pair (Q, dO; K, V).
  typename Traits::TmaRows tma_x, tma_y;
  typename Traits::TmaCols tma_u, tma_w;
  // Extents of the TMA views (rows, heads, batch): batched (S, H, B); varlen (T, H, 1).
  int q_rows = 0, kv_rows = 0, tma_batch = 0;
};

}  // namespace vidattn::cuda_sm90
