// Key-visit policies of the sm_90a forward mainloop, and the masks they imply. The mainloop
// asks a policy for the number of key blocks of a query tile and for each block's first key
// row, how many of its rows exist, and whether it needs the per-element mask at all (most
// blocks don't: the mask code runs only on partial, diagonal or padded blocks).
//   DenseKeyRange: blocks 0, 1, ... of the key sequence up to the causal limit; padding masks,
//                  causal (bottom-right), partial last block.
//   SparseKeyList: the query tile's list of selected key tiles (q2k_index row), each tile of
//                  tile_volume slots visited as tile_volume / kBlockN blocks; slots past
//                  kv_block_sizes[tile] are masked.
#pragma once

#include <cstdint>

#include "../sm80/tile_io.h"
#include "sm90_fwd_params.h"

namespace vidattn::cuda_sm90 {

using cuda_sm80::Sequence;
using cuda_sm80::clamp64;

struct KeyBlock {
  std::int64_t start = 0;   // sequence row of the block's first key
  int valid = 0;            // keys [start, start + valid) exist; the rest are masked
  bool needs_mask = false;  // some key of the block is invisible to some row of the tile
};

template <int kBlockN>
struct DenseKeyRange {
  static constexpr bool kElementMask = true;  // causal / key padding possible
  static constexpr bool kProducerRecordsBlocks = false;  // block(i) is arithmetic
  std::int64_t len_q = 0, len_k = 0, k_end = 0;
  std::int64_t q0 = 0;
  const std::uint8_t* key_mask = nullptr;  // this sequence's row, or null
  std::int64_t key_mask_row = 0;
  bool causal = false;

  __device__ __forceinline__ DenseKeyRange(const AttentionParams& p, const SparseKeyListArgs&,
                                           const Sequence& seq, int /*h*/, std::int64_t q0_,
                                           int rows) {
    len_q = seq.len_q;
    len_k = seq.len_k;
    q0 = q0_;
    causal = p.causal;
    key_mask = p.key_mask ? p.key_mask + seq.batch * p.key_mask_batch : nullptr;
    key_mask_row = p.key_mask_row;
    const std::int64_t last_row = q0 + (len_q - q0 < rows ? len_q - q0 : rows);
    k_end = causal ? clamp64(last_row + len_k - len_q, 0, len_k) : len_k;
  }
  __device__ __forceinline__ int num_blocks() const {
    return static_cast<int>((k_end + kBlockN - 1) / kBlockN);
  }
  __device__ __forceinline__ KeyBlock block(int i) const {
    KeyBlock b;
    b.start = static_cast<std::int64_t>(i) * kBlockN;
    b.valid = len_k - b.start < kBlockN ? static_cast<int>(len_k - b.start) : kBlockN;
    b.needs_mask = key_mask != nullptr || b.valid < kBlockN ||
                   (causal && b.start + kBlockN - 1 > q0 + len_k - len_q);
    return b;
  }
  // Whether query row `i` (sequence row) may see key `j` of block b (j - b.start < valid
  // is checked by the caller).
  __device__ __forceinline__ bool visible(std::int64_t i, std::int64_t j) const {
    if (causal && j > i + len_k - len_q) return false;
    if (key_mask && !key_mask[j * key_mask_row]) return false;
    return true;
  }
};

template <int kBlockN>
struct SparseKeyList {
  static constexpr bool kElementMask = false;  // only the per-tile valid length
  // block(i) reads the index (and block sizes) from global memory: the producer, which
  // needs it for the load anyway, records each block's valid length in shared memory.
  static constexpr bool kProducerRecordsBlocks = true;
  const std::int32_t* list = nullptr;
  const std::int32_t* sizes = nullptr;  // null: every key tile is full
  int count = 0, blocks_per_tile = 1, tile_volume = kBlockN, kv_tiles = 0;

  __device__ __forceinline__ SparseKeyList(const AttentionParams&, const SparseKeyListArgs& s,
                                           const Sequence& seq, int h, std::int64_t q0,
                                           int /*rows*/) {
    const std::int64_t t = q0 / s.tile_volume;
    const std::int64_t b = seq.batch;
    list = s.q2k_index + b * s.index_batch + h * s.index_head + t * s.index_tile;
    const int c = s.q2k_count[b * s.count_batch + h * s.count_head + t * s.count_tile];
    count = c < 0 ? 0 : (c > s.max_k ? s.max_k : c);
    sizes = s.kv_block_sizes;
    tile_volume = s.tile_volume;
    blocks_per_tile = s.tile_volume / kBlockN;
    kv_tiles = s.kv_tiles;
  }
  __device__ __forceinline__ int num_blocks() const { return count * blocks_per_tile; }
  __device__ __forceinline__ KeyBlock block(int i) const {
    const int tile = __ldg(list + i / blocks_per_tile);
    const int sub = i % blocks_per_tile;
    KeyBlock b;
    // An out-of-range tile index loads nothing real (TMA zero-fills outside the tensor) and
    // is fully masked.
    const bool ok = tile >= 0 && tile < kv_tiles;
    b.start = static_cast<std::int64_t>(ok ? tile : 0) * tile_volume + sub * kBlockN;
    const int n = ok ? (sizes ? __ldg(sizes + tile) : tile_volume) - sub * kBlockN : 0;
    b.valid = n < 0 ? 0 : (n > kBlockN ? kBlockN : n);
    b.needs_mask = b.valid < kBlockN;
    return b;
  }
  __device__ __forceinline__ bool visible(std::int64_t, std::int64_t) const { return true; }
};

// Sets the logits of invisible (row, key) pairs of one thread's accumulator fragment to
// -inf. `coords(v)` gives the (row, column) of value v inside the stream's tile.
template <class Visit, class Frag, class Coords>
__device__ __forceinline__ void apply_mask(Frag& s, const Coords& coords, const Visit& visit,
                                           const KeyBlock& kb, std::int64_t q0) {
#pragma unroll
  for (int v = 0; v < decltype(cute::size(s))::value; ++v) {
    const int col = cute::get<1>(coords(v));
    bool ok = col < kb.valid;
    if constexpr (Visit::kElementMask)
      ok = ok && visit.visible(q0 + cute::get<0>(coords(v)), kb.start + col);
    if (!ok) s(v) = -INFINITY;
  }
}

}  // namespace vidattn::cuda_sm90
