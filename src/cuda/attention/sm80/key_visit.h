// Which blocks of 64 keys (or queries) a mainloop visits. Dense and block-sparse attention
// share one mainloop per kernel; only the key-visit policy differs:
//   dense:  the blocks of a row range, in order (every step is a block);
//   sparse: the query tile's q2k list (forward, dQ) or the key tile's k2q list (dK/dV), each
//           tile expanded into its tile_volume / 64 blocks; blocks without a valid row (tiles
//           of size 0, the empty tail of a partial tile, ids out of range) are skipped.
// A visit is read with: i = visit.next(0); while (i < visit.steps()) { b = visit.block(i); ...;
// i = visit.next(i + 1); }.
#pragma once

#include <cstdint>

#include "cuda/common/params.h"
#include "cuda/common/tile_io.h"
#include "softmax_mask.h"

namespace vidattn::cuda_sm80 {

using namespace cuda_common;  // params, tile I/O and warp math shared with the sm_90a kernels

constexpr int kSparseBlock = 64;  // rows of a key / query block of the sparse visits

// Rows [start, start + valid) of a block are real; the rest of its 64 rows are masked out.
struct RowBlock {
  std::int64_t start = 0;
  std::int64_t valid = 0;
};

// Valid tokens of a tile: its block size clamped to [0, volume], or volume when none given.
__device__ __forceinline__ int tile_size(const std::int32_t* sizes, std::int64_t stride,
                                         std::int64_t tile, int volume) {
  if (!sizes) return volume;
  const int s = sizes[tile * stride];
  return s < 0 ? 0 : (s > volume ? volume : s);
}

// ---- dense ------------------------------------------------------------------------------

// Blocks of BLOCK rows covering [begin, end); rows past `limit` (the sequence's end) are not
// loaded (load_tile_cols zero-fills them), rows in [end, limit) are loaded and masked.
template <int BLOCK>
struct DenseVisit {
  std::int64_t begin = 0, end = 0, limit = 0;
  __device__ __forceinline__ int steps() const {
    return end > begin ? static_cast<int>((end - begin + BLOCK - 1) / BLOCK) : 0;
  }
  __device__ __forceinline__ int next(int i) const { return i; }
  __device__ __forceinline__ RowBlock block(int i) const {
    const std::int64_t start = begin + static_cast<std::int64_t>(i) * BLOCK;
    return {start, limit - start};
  }
};

// ---- sparse -----------------------------------------------------------------------------

// A list of tile ids (strided int32), each expanded into 1 << shift blocks of 64 rows.
struct SparseVisit {
  const std::int32_t* list = nullptr;
  std::int64_t stride = 0;
  const std::int32_t* sizes = nullptr;  // block sizes of the listed tiles
  std::int64_t sizes_stride = 1;
  int num_tiles = 0;  // ids outside [0, num_tiles) are skipped
  int volume = 64, shift = 0;
  int n_steps = 0;

  __device__ __forceinline__ int steps() const { return n_steps; }
  __device__ __forceinline__ RowBlock block(int i) const {
    const int tile = list[static_cast<std::int64_t>(i >> shift) * stride];
    if (tile < 0 || tile >= num_tiles) return {0, 0};
    const int sub = (i & ((1 << shift) - 1)) * kSparseBlock;
    const int valid = tile_size(sizes, sizes_stride, tile, volume) - sub;
    return {static_cast<std::int64_t>(tile) * volume + sub,
            valid < 0 ? 0 : (valid > kSparseBlock ? kSparseBlock : valid)};
  }
  __device__ __forceinline__ int next(int i) const {
    while (i < n_steps && block(i).valid <= 0) ++i;
    return i;
  }
};

// Valid query rows of the block [q0, q0 + rows) (inside one query tile): a prefix, since a
// tile keeps its valid tokens first.
__device__ __forceinline__ std::int64_t sparse_query_rows(const AttentionParams& p,
                                                          std::int64_t q0, int rows) {
  const std::int64_t t = q0 / p.tile_volume;
  const std::int64_t valid =
      tile_size(p.q_block_sizes, p.q_block_sizes_stride, t, p.tile_volume) - (q0 - t * p.tile_volume);
  return valid < 0 ? 0 : (valid > rows ? rows : valid);
}

// The key blocks of query tile q0 / tile_volume of (batch b, query head h); no steps when the
// query block has no valid row.
__device__ __forceinline__ SparseVisit sparse_key_visit(const AttentionParams& p, int b, int h,
                                                      std::int64_t q0, std::int64_t rows) {
  const std::int64_t t = q0 / p.tile_volume;
  SparseVisit w;
  w.list = p.q2k_index + b * p.q2k_index_strides[0] + h * p.q2k_index_strides[1] +
           t * p.q2k_index_strides[2];
  w.stride = p.q2k_index_strides[3];
  w.sizes = p.kv_block_sizes;
  w.sizes_stride = p.kv_block_sizes_stride;
  w.num_tiles = p.kv_tiles;
  w.volume = p.tile_volume;
  w.shift = p.tile_shift;
  int count = p.q2k_count[b * p.q2k_count_strides[0] + h * p.q2k_count_strides[1] +
                          t * p.q2k_count_strides[2]];
  count = count < 0 ? 0 : (count > p.max_k ? p.max_k : count);
  w.n_steps = rows > 0 ? count << p.tile_shift : 0;
  return w;
}

// The query blocks that selected key tile `kt` for (batch b, query head h): the k2q CSR row,
// offsets clamped into the index.
__device__ __forceinline__ SparseVisit sparse_query_visit(const AttentionParams& p, int b, int h,
                                                        std::int64_t kt) {
  const std::int32_t* off = p.k2q_offsets + b * p.k2q_offsets_strides[0] +
                            h * p.k2q_offsets_strides[1];
  const std::int64_t total = static_cast<std::int64_t>(p.q_tiles) * p.max_k;
  std::int64_t begin = off[kt * p.k2q_offsets_strides[2]];
  std::int64_t end = off[(kt + 1) * p.k2q_offsets_strides[2]];
  begin = clamp64(begin, 0, total);
  end = clamp64(end, begin, total);
  SparseVisit w;
  w.list = p.k2q_index + b * p.k2q_index_strides[0] + h * p.k2q_index_strides[1] +
           begin * p.k2q_index_strides[2];
  w.stride = p.k2q_index_strides[2];
  w.sizes = p.q_block_sizes;
  w.sizes_stride = p.q_block_sizes_stride;
  w.num_tiles = p.q_tiles;
  w.volume = p.tile_volume;
  w.shift = p.tile_shift;
  w.n_steps = static_cast<int>(end - begin) << p.tile_shift;
  return w;
}

// The key blocks that a block of `block_rows` queries starting at q0 visits (the forward and
// the dQ pass walk alike), and through `rows` its valid query rows (sparse: padded query
// slots are dead rows).
template <bool kSparse, int BK>
__device__ __forceinline__ auto query_block_visit(const AttentionParams& p, const Sequence& seq,
                                                 const MaskInfo& mask, int b, int h,
                                                 std::int64_t q0, int block_rows,
                                                 std::int64_t& rows) {
  if constexpr (kSparse) {
    rows = sparse_query_rows(p, q0, block_rows);
    return sparse_key_visit(p, b, h, q0, rows);
  } else {
    rows = seq.len_q - q0 < block_rows ? seq.len_q - q0 : block_rows;
    return DenseVisit<BK>{0, key_end(mask, q0, rows), seq.len_k};
  }
}

// Keys [0, key_end) visible to every query (the sparse kernels' only key mask).
__device__ __forceinline__ MaskInfo key_limit_mask(std::int64_t len_q, std::int64_t key_end) {
  MaskInfo m;
  m.len_q = len_q;
  m.len_k = key_end;
  m.key_mask = nullptr;
  m.key_mask_row = 0;
  m.causal = false;
  return m;
}

}  // namespace vidattn::cuda_sm80
