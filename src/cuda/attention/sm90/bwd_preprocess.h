// Preprocess of the sm_90a backward: each query row's statistics (BwdRowStats) for the dK / dV
// and dQ kernels, one warp per (sequence, head, row) of the padded arrays. Every condition
// under which a row takes no gradient folds into lse2 = +inf here, so the main kernels test
// nothing per row.
#pragma once

#include <cmath>
#include <cstdint>

#include "bwd_kernel_params.h"
#include "cuda/common/mma_utils.h"
#include "cuda/common/tile_io.h"

namespace vidattn::cuda_sm90 {

template <class T, int D>
__global__ void __launch_bounds__(256)
    sm90_attention_bwd_preprocess_kernel(const cuda_common::AttentionParams p,
                                         const BwdRowStats stats) {
  using cuda_common::Mma;
  const std::int64_t task =
      static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const std::int64_t total = static_cast<std::int64_t>(p.batch) * p.heads_q * stats.rows;
  if (task >= total) return;
  const int lane = threadIdx.x & 31;
  const std::int64_t row = task % stats.rows;
  const std::int64_t bh = task / stats.rows;
  const int h = static_cast<int>(bh % p.heads_q);
  const int b = static_cast<int>(bh / p.heads_q);
  const cuda_common::Sequence seq = cuda_common::sequence_of(p, b);
  bool live = row < seq.len_q;
  if (live && p.query_mask)
    live = p.query_mask[seq.batch * p.query_mask_batch + row * p.query_mask_row] != 0;
  if (live && p.q_block_sizes) {  // block-sparse: a padded slot of its query tile
    const std::int64_t t = row / p.tile_volume;
    live = row - t * p.tile_volume < __ldg(p.q_block_sizes + t * p.q_block_sizes_stride);
  }
  float lse = -INFINITY;
  if (live) lse = p.lse[cuda_common::q_side_offset(p, p.lse_strides, seq, row, h)];
  live = live && lse != -INFINITY;  // the row saw no key in the forward
  float sum = 0.f;
  if (live) {
    const auto* o = static_cast<const std::uint16_t*>(p.out) +
                    cuda_common::q_side_offset(p, p.out_strides, seq, row, h);
    const auto* g = static_cast<const std::uint16_t*>(p.grad_out) +
                    cuda_common::q_side_offset(p, p.grad_out_strides, seq, row, h);
#pragma unroll
    for (int d = lane; d < D; d += 32) sum += Mma<T>::to_float(o[d]) * Mma<T>::to_float(g[d]);
#pragma unroll
    for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  }
  if (lane == 0) {
    stats.lse2[task] = live ? lse * cuda_common::kLog2e : INFINITY;
    stats.delta[task] = live ? sum : 0.f;
  }
}

}  // namespace vidattn::cuda_sm90
