// Logits and masks shared by the forward and both backward kernels. The backward kernels
// recompute the logits with exactly the forward's instruction sequence (same operands, same
// k-order of the mma chain from a zero accumulator, same fp32 multiply by the scale), so
// they are bit-identical to the forward's and exp(s - lse) matches the saved LSE.
#pragma once

#include <cstdint>

#include "cuda/common/mma_utils.h"
#include "cuda/common/params.h"
#include "cuda/common/tile_io.h"

namespace vidattn::cuda_sm80 {

using namespace cuda_common;  // params, tile I/O and warp math shared with the sm_90a kernels

// S[16 x KEYS] of one warp: rows [a_row0, a_row0 + 16) of the shared A tile times rows
// [b_row0, b_row0 + KEYS) of the shared B tile, both row-major [row][d] and swizzled with
// width D, fp32, unscaled. Q K^T (logits) and dO V^T (dP) are both this product.
// kPadded: only the first `cols` columns are real (the rest zero-filled), and the 16-column
// steps past them, which would add exact zeros, are skipped, as the forward skips them.
template <class T, int D, int KEYS, bool kPadded = false>
__device__ __forceinline__ void qk_logits(float (&s)[KEYS / 8][4], const std::uint16_t* a_tile,
                                          int a_row0, const std::uint16_t* b_tile, int b_row0,
                                          int cols = D) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < KEYS / 8; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk) {
    if (kPadded && kk * 16 >= cols) break;
    std::uint32_t a[4];
    ldmatrix_x4(a, smem_addr(a_tile + swizzle<D>(a_row0 + (lane & 15), kk * 2 + (lane >> 4))));
#pragma unroll
    for (int np = 0; np < KEYS / 16; ++np) {
      std::uint32_t b[4];
      ldmatrix_x4(b, smem_addr(b_tile + swizzle<D>(b_row0 + np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                   kk * 2 + ((lane >> 3) & 1))));
      Mma<T>::run(s[2 * np], a, b[0], b[1]);
      Mma<T>::run(s[2 * np + 1], a, b[2], b[3]);
    }
  }
}

// What the masks let a block see.
struct MaskInfo {
  std::int64_t len_q, len_k;
  const std::uint8_t* key_mask;  // this sequence's row of the key mask, or null
  std::int64_t key_mask_row;
  bool causal;

  // Key j (in the sequence) is visible to query i.
  __device__ __forceinline__ bool visible(std::int64_t i, std::int64_t j) const {
    if (j >= len_k) return false;
    if (causal && j > i + len_k - len_q) return false;
    if (key_mask && !key_mask[j * key_mask_row]) return false;
    return true;
  }
  // Whether a [q0, q0 + rows) x [k0, k0 + KEYS) block needs per-element masking.
  __device__ __forceinline__ bool block_needs_mask(std::int64_t q0, std::int64_t k0,
                                                   int keys) const {
    if (key_mask || k0 + keys > len_k) return true;
    return causal && k0 + keys - 1 > q0 + len_k - len_q;
  }
};

__device__ __forceinline__ MaskInfo mask_info(const AttentionParams& p, const Sequence& s) {
  MaskInfo m;
  m.len_q = s.len_q;
  m.len_k = s.len_k;
  m.causal = p.causal;
  m.key_mask = p.key_mask ? p.key_mask + s.batch * p.key_mask_batch : nullptr;
  m.key_mask_row = p.key_mask_row;
  return m;
}

// Scales the logits of one warp's 16 x KEYS block and sets invisible ones to -inf.
// q_row is the sequence row of this thread's first row (the second is q_row + 8).
template <int KEYS>
__device__ __forceinline__ void scale_and_mask(float (&s)[KEYS / 8][4], float scale,
                                               const MaskInfo& m, bool needs_mask,
                                               std::int64_t q_row, std::int64_t k0) {
  const int lane = threadIdx.x & 31;
#pragma unroll
  for (int n = 0; n < KEYS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) s[n][e] *= scale;
  if (!needs_mask) return;
#pragma unroll
  for (int n = 0; n < KEYS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const std::int64_t i = q_row + (e >> 1) * 8;
      const std::int64_t j = k0 + n * 8 + (lane & 3) * 2 + (e & 1);
      if (!m.visible(i, j)) s[n][e] = -INFINITY;
    }
}

// Keys a query block [q0, q0 + rows) can see: [0, end).
__device__ __forceinline__ std::int64_t key_end(const MaskInfo& m, std::int64_t q0,
                                                std::int64_t rows) {
  if (!m.causal) return m.len_k;
  return clamp64(q0 + rows + m.len_k - m.len_q, 0, m.len_k);
}

// First query that can see key k0 (causal), else 0.
__device__ __forceinline__ std::int64_t query_begin(const MaskInfo& m, std::int64_t k0) {
  if (!m.causal) return 0;
  return clamp64(k0 + m.len_q - m.len_k, 0, m.len_q);
}

}  // namespace vidattn::cuda_sm80
