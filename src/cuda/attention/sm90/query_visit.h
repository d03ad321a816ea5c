// Query-visit policies of the sm_90a dK / dV kernel: the backward twin of the forward's key
// visit (key_visit.h). A stream owns a tile of key rows and visits, one 64-row block at a time,
// the query blocks whose rows may see one of its keys, over every query head of its key head's
// group (dK and dV are summed over the group in registers, in a fixed order):
//   DenseQueryVisit:  the query blocks of the sequence from the causal limit on;
//   SparseQueryVisit: the query tiles that selected the key tile (its k2q list, ascending),
//                     each tile_volume / 64 blocks.
// A policy is a cursor: the producer and each consumer hold their own copy and call next()
// num_blocks() times, so they agree on the order. It also says which (key, query) pairs of a
// block to hide (mask) and which keys take no gradient at all (key_dropped).
// The dQ kernel walks key blocks with the forward's own policies (key_visit.h).
#pragma once

#include <cmath>
#include <cstdint>

#include <cute/tensor.hpp>

#include "cuda/common/params.h"
#include "cuda/common/sequence.h"
#include "cuda/common/tile_io.h"

namespace vidattn::cuda_sm90 {

struct QueryBlock {
  int head = 0;             // query head
  std::int64_t q0 = 0;      // the block's first query row (sequence row)
  bool needs_mask = false;  // some query of the block cannot see some key of the stream's tile
  // Rows [0, valid_rows) of the block are queries of the sequence (or of the query tile); the
  // consumers zero the rest of the loaded Q and dO rows (the next sequence's, or padded slots,
  // whose content is never to reach a gradient: 0 x NaN is NaN in the products).
  int valid_rows = 0;
};

// kBlockQ: query rows per block; kKeys: key rows of the stream's tile.
template <int kBlockQ, int kKeys>
struct DenseQueryVisit {
  std::int64_t k0 = 0;     // the tile's first key row
  std::int64_t shift = 0;  // len_k - len_q: query i sees key j iff j <= i + shift (causal)
  int head0 = 0, per_head = 0, first_block = 0, n = 0, i = 0;
  bool causal = false;
  const std::uint8_t* key_mask = nullptr;  // this sequence's row, or null
  std::int64_t key_mask_row = 0;

  std::int64_t len_q = 0;

  __device__ __forceinline__ DenseQueryVisit(const cuda_common::AttentionParams& p,
                                             const cuda_common::Sequence& seq, int /*b*/, int hk,
                                             std::int64_t k0_)
      : k0(k0_), shift(seq.len_k - seq.len_q), head0(hk * p.group), causal(p.causal),
        len_q(seq.len_q) {
    if (p.key_mask) {
      key_mask = p.key_mask + seq.batch * p.key_mask_batch;
      key_mask_row = p.key_mask_row;
    }
    // Causal: key k0 is seen from query row k0 - shift on; earlier blocks see none of the
    // tile's keys.
    std::int64_t first_row = causal ? k0 - shift : 0;
    first_row = first_row < 0 ? 0 : first_row;
    first_block = static_cast<int>(first_row / kBlockQ);
    const int end = static_cast<int>((seq.len_q + kBlockQ - 1) / kBlockQ);
    per_head = k0 < seq.len_k && end > first_block ? end - first_block : 0;
    n = p.group * per_head;
  }
  __device__ __forceinline__ int num_blocks() const { return n; }
  __device__ __forceinline__ QueryBlock next() {
    QueryBlock b;
    const int h = i / per_head;
    b.head = head0 + h;
    b.q0 = static_cast<std::int64_t>(first_block + (i - h * per_head)) * kBlockQ;
    // The block's first row sees keys up to q0 + shift; the tile's last key is k0 + kKeys - 1.
    b.needs_mask = causal && b.q0 + shift < k0 + kKeys - 1;
    b.valid_rows = len_q - b.q0 < kBlockQ ? static_cast<int>(len_q - b.q0) : kBlockQ;
    ++i;
    return b;
  }
  // S^T (keys as rows, queries as columns) to -inf where the causal rule hides the query's
  // view of the key: value v at key k0 + row, query q0 + col, visible iff
  // k0 + row <= q0 + col + shift. `coords(v)` gives (row, col) inside the CTA's tile and the
  // block; `row0` is the stream tile's first row in the CTA's. Each of the thread's two rows
  // gets one limit (its first visible column); a value then costs one compare.
  template <class Frag, class Coords>
  __device__ __forceinline__ void mask(Frag& s, const Coords& coords, const QueryBlock& b,
                                       int row0) const {
    constexpr int kVals = decltype(cute::size(s))::value;
    int first_col[2];
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      std::int64_t c = k0 - row0 + cute::get<0>(coords(2 * r)) - shift - b.q0;
      c = c < -1 ? -1 : (c > (1 << 20) ? (1 << 20) : c);
      first_col[r] = static_cast<int>(c);
    }
#pragma unroll
    for (int v = 0; v < kVals; ++v)
      if (cute::get<1>(coords(v)) < first_col[(v >> 1) & 1]) s(v) = -INFINITY;
  }
  // A key hidden by the key padding mask takes no gradient.
  __device__ __forceinline__ bool key_dropped(std::int64_t key) const {
    return key_mask != nullptr && key_mask[key * key_mask_row] == 0;
  }
};

// Block-sparse (batched; no causal, no masks): key tile k0 / tile_volume's k2q rows of the
// group's query heads, offsets clamped into the index. An id outside [0, q_tiles) visits a
// block whose every pair is hidden; padded query slots take no gradient through their LSE
// (the preprocess), padded key slots through key_dropped.
template <int kBlockQ>
struct SparseQueryVisit {
  const std::int32_t* offsets = nullptr;  // k2q_offsets of (b, head0), at tile kt
  const std::int32_t* index = nullptr;    // k2q_index of (b, head0)
  std::int64_t off_head = 0, off_tile = 0, index_head = 0, index_entry = 0;
  std::int64_t total = 0, kt = 0, e = 0, end = 0;
  int head0 = 0, group = 1, h = -1, sub = 0, subs = 1, n = 0, q_tiles = 0, tile_volume = 64;
  int valid_keys = 0;  // of key tile kt
  const std::int32_t* q_sizes = nullptr;  // valid slots per query tile, or null: all
  std::int64_t q_sizes_stride = 1;

  __device__ __forceinline__ SparseQueryVisit(const cuda_common::AttentionParams& p,
                                              const cuda_common::Sequence&, int b, int hk,
                                              std::int64_t k0) {
    tile_volume = p.tile_volume;
    q_sizes = p.q_block_sizes;
    q_sizes_stride = p.q_block_sizes_stride;
    subs = tile_volume / kBlockQ;
    q_tiles = p.q_tiles;
    group = p.group;
    head0 = hk * group;
    kt = k0 / tile_volume;
    total = static_cast<std::int64_t>(p.q_tiles) * p.max_k;
    off_head = p.k2q_offsets_strides[1];
    off_tile = p.k2q_offsets_strides[2];
    index_head = p.k2q_index_strides[1];
    index_entry = p.k2q_index_strides[2];
    offsets = p.k2q_offsets + b * p.k2q_offsets_strides[0] + head0 * off_head + kt * off_tile;
    index = p.k2q_index + b * p.k2q_index_strides[0] + head0 * index_head;
    if (kt >= p.kv_tiles) return;  // a CTA's second stream past the last key tile
    valid_keys = p.kv_block_sizes
                     ? __ldg(p.kv_block_sizes + kt * p.kv_block_sizes_stride)
                     : tile_volume;
    for (int g = 0; g < group; ++g) {
      std::int64_t lo, hi;
      range(g, lo, hi);
      n += static_cast<int>(hi - lo) * subs;
    }
  }
  __device__ __forceinline__ void range(int g, std::int64_t& lo, std::int64_t& hi) const {
    const std::int32_t* o = offsets + g * off_head;
    lo = cuda_common::clamp64(__ldg(o), 0, total);
    hi = cuda_common::clamp64(__ldg(o + off_tile), lo, total);
  }
  __device__ __forceinline__ int num_blocks() const { return n; }
  __device__ __forceinline__ QueryBlock next() {
    while (e >= end) {  // the next head with entries (next() runs only num_blocks() times)
      ++h;
      range(h, e, end);
    }
    const int qt = __ldg(index + h * index_head + e * index_entry);
    const bool ok = qt >= 0 && qt < q_tiles;
    QueryBlock b;
    b.head = head0 + h;
    b.q0 = ok ? static_cast<std::int64_t>(qt) * tile_volume + sub * kBlockQ : 0;
    b.needs_mask = !ok;
    int valid = 0;
    if (ok) {
      valid = (q_sizes ? __ldg(q_sizes + qt * q_sizes_stride) : tile_volume) - sub * kBlockQ;
      valid = valid < 0 ? 0 : (valid > kBlockQ ? kBlockQ : valid);
    }
    b.valid_rows = valid;
    if (++sub == subs) sub = 0, ++e;
    return b;
  }
  // Only a block of an out-of-range id is masked, and all of it.
  template <class Frag, class Coords>
  __device__ __forceinline__ void mask(Frag& s, const Coords&, const QueryBlock&, int) const {
    constexpr int kVals = decltype(cute::size(s))::value;
#pragma unroll
    for (int v = 0; v < kVals; ++v) s(v) = -INFINITY;
  }
  __device__ __forceinline__ bool key_dropped(std::int64_t key) const {
    return key - kt * tile_volume >= valid_keys;
  }
};

}  // namespace vidattn::cuda_sm90
