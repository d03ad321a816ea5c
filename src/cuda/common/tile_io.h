// Sequences (batched or varlen) and tile movement between global and shared memory.
#pragma once

#include <cstdint>

#include "mma_utils.h"
#include "params.h"
#include "sequence.h"

namespace vidattn::cuda_common {

__device__ __forceinline__ std::int64_t clamp64(std::int64_t x, std::int64_t lo,
                                                std::int64_t hi) {
  return x < lo ? lo : (x > hi ? hi : x);
}

// cu_seqlens are trusted on the device (no host sync to check them), but clamped so that a
// bad entry can never index outside q / k.
__device__ __forceinline__ Sequence sequence_of(const AttentionParams& p, int b) {
  Sequence s;
  if (p.varlen) {
    const std::int64_t q0 = clamp64(p.cu_seqlens_q[b * p.cu_seqlens_q_stride], 0, p.rows_q);
    const std::int64_t q1 = clamp64(p.cu_seqlens_q[(b + 1) * p.cu_seqlens_q_stride], q0, p.rows_q);
    const std::int64_t k0 = clamp64(p.cu_seqlens_k[b * p.cu_seqlens_k_stride], 0, p.rows_k);
    const std::int64_t k1 = clamp64(p.cu_seqlens_k[(b + 1) * p.cu_seqlens_k_stride], k0, p.rows_k);
    s.first_q = q0;
    s.first_k = k0;
    s.len_q = q1 - q0 < p.seqlen_q ? q1 - q0 : p.seqlen_q;
    s.len_k = k1 - k0 < p.seqlen_k ? k1 - k0 : p.seqlen_k;
  } else {
    s.batch = b;
    s.first_q = b * p.seqlen_q;
    s.first_k = b * p.seqlen_k;
    s.len_q = p.seqlen_q;
    s.len_k = p.seqlen_k;
  }
  return s;
}

// Element offset of row `row` (within the sequence) of head h.
__device__ __forceinline__ std::int64_t q_side_offset(const AttentionParams& p,
                                                      const RowStrides& st, const Sequence& s,
                                                      std::int64_t row, int h) {
  const std::int64_t base = p.varlen ? s.first_q * st.row : s.batch * st.batch;
  return base + row * st.row + static_cast<std::int64_t>(h) * st.head;
}
__device__ __forceinline__ std::int64_t k_side_offset(const AttentionParams& p,
                                                      const RowStrides& st, const Sequence& s,
                                                      std::int64_t row, int h) {
  const std::int64_t base = p.varlen ? s.first_k * st.row : s.batch * st.batch;
  return base + row * st.row + static_cast<std::int64_t>(h) * st.head;
}

// Loads rows [0, ROWS) of a tile whose row 0 is at `src` (row stride in elements) into the
// swizzled shared tile; rows >= valid_rows are zero-filled, so that no garbage (or NaN)
// from outside the sequence reaches the tensor cores. Only the first valid_cols columns (a
// multiple of 8, at most WIDTH) of a row are real: the 16-byte chunks past them are
// zero-filled too and never read from global memory.
template <int ROWS, int WIDTH, int THREADS>
__device__ __forceinline__ void load_tile_cols(std::uint16_t* tile, const std::uint16_t* src,
                                               std::int64_t row_stride, std::int64_t valid_rows,
                                               int valid_cols, bool aligned16) {
  constexpr int kChunks = WIDTH / 8;
  if (aligned16) {
#pragma unroll
    for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += THREADS) {
      const int r = idx / kChunks, c = idx % kChunks;
      const bool ok = r < valid_rows && c * 8 < valid_cols;
      const std::uint16_t* g = src + (ok ? r * row_stride + c * 8 : 0);
      cp_async_16(tile + swizzle<WIDTH>(r, c), g, ok ? 16 : 0);
    }
  } else {
    for (int idx = threadIdx.x; idx < ROWS * kChunks; idx += THREADS) {
      const int r = idx / kChunks, c = idx % kChunks;
      std::uint16_t* d = tile + swizzle<WIDTH>(r, c);
      const bool ok = r < valid_rows && c * 8 < valid_cols;
#pragma unroll
      for (int e = 0; e < 8; ++e) d[e] = ok ? src[r * row_stride + c * 8 + e] : std::uint16_t(0);
    }
  }
}

// A head-dim tile: valid_cols real columns when the instance is padded (kPadded), else all
// WIDTH (valid_cols unused). The constant WIDTH makes the column test of load_tile_cols
// always true, so the compiler drops it: an exact instance loads as if it had none.
template <int ROWS, int WIDTH, int THREADS, bool kPadded>
__device__ __forceinline__ void load_head_tile(std::uint16_t* tile, const std::uint16_t* src,
                                               std::int64_t row_stride, std::int64_t valid_rows,
                                               bool aligned16, int valid_cols) {
  load_tile_cols<ROWS, WIDTH, THREADS>(tile, src, row_stride, valid_rows,
                                       kPadded ? valid_cols : WIDTH, aligned16);
}

// Stores a pair of adjacent columns (x at col, y at col + 1) of one output row.
template <class T>
__device__ __forceinline__ void store_pair(std::uint16_t* dst, float x, float y, bool aligned4) {
  if (aligned4) {
    *reinterpret_cast<std::uint32_t*>(dst) = Mma<T>::pack(x, y);
  } else {
    dst[0] = Mma<T>::from_float(x);
    dst[1] = Mma<T>::from_float(y);
  }
}

}  // namespace vidattn::cuda_common
