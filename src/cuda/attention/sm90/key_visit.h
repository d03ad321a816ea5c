// Key-visit policies of the sm_90a forward mainloop, and the masks they imply. The mainloop
// asks a policy for the number of key blocks of a query tile and for each block's first key
// row, how many of its rows exist, and whether it needs the per-element mask at all (most
// blocks don't: the mask code runs only on partial, diagonal or padded blocks).
//   DenseVisit:  blocks 0, 1, ... of the key sequence up to the causal limit; padding masks,
//                causal (bottom-right), partial last block.
//   SparseVisit: the query tile's list of selected key tiles (q2k_index row), each tile of
//                tile_volume slots visited as tile_volume / kBlockN blocks, or (kHalves) two
//                tiles of kBlockN / 2 slots per block; slots past kv_block_sizes[tile] are
//                masked.
#pragma once

#include <cstdint>

#include "cuda/common/tile_io.h"
#include "fwd_params.h"

namespace vidattn::cuda_sm90 {

using cuda_common::Sequence;
using cuda_common::clamp64;

struct KeyBlock {
  std::int64_t start = 0;   // sequence row of the block's first key
  int valid = 0;            // keys [start, start + valid) exist; the rest are masked
  bool needs_mask = false;  // some key of the block is invisible to some row of the tile
  // Half-loaded blocks (SparseVisit with kHalves): the second half's first row and valid
  // keys; `valid` then counts the first half's only.
  std::int64_t start_hi = 0;
  int valid_hi = 0;
  // Key padding (DenseVisit with a key mask; consumer side only): bit b says whether key
  // start + 4 * lane + b exists, for this thread's lane. apply_mask turns the warp's flags
  // into each thread's columns with four ballots.
  std::uint32_t key_flags = 0xFu;
};

// kKeyMask: the instance for problems with a key padding mask (launch_dense_forward picks
// it when there is one): key flags by ballot and per-row column limits in apply_mask. The
// other instance keeps the per-value mask test.
template <int kBlockN, bool kKeyMask = false>
struct DenseVisit {
  static constexpr bool kElementMask = true;  // causal possible
  static constexpr bool kKeyFlags = kKeyMask;  // key padding (KeyBlock::key_flags)
  static constexpr bool kProducerRecordsBlocks = false;  // block(i) is arithmetic
  // Which blocks need the mask is known before the loop (first_masked_block): the mainloop
  // runs the unmasked ones in a loop without any mask code.
  static constexpr bool kMaskedSuffix = true;
  static constexpr bool kHalves = false;
  static constexpr int kBlockKeys = kBlockN;
  std::int64_t len_q = 0, len_k = 0, k_end = 0;
  std::int64_t q0 = 0;
  const std::uint8_t* key_mask = nullptr;  // this sequence's row, or null
  std::int64_t key_mask_row = 0;
  bool causal = false;

  __device__ __forceinline__ DenseVisit(const AttentionParams& p, const SparseKeyListArgs&,
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
  // Blocks [0, first_masked_block()) need no mask and every later one does (block(i).needs_mask
  // is monotone in i): a key mask masks every block, a partial last block starts at
  // len_k / kBlockN, and the causal diagonal at the first block whose last key passes the
  // tile's first row's limit d = q0 + len_k - len_q.
  __device__ __forceinline__ int first_masked_block() const {
    if (kKeyMask || key_mask != nullptr) return 0;  // kKeyMask: launched with a key mask
    std::int64_t first = len_k / kBlockN;
    if (causal) {
      const std::int64_t d1 = q0 + len_k - len_q + 1;
      const std::int64_t diag = d1 <= 0 ? 0 : d1 / kBlockN;
      first = diag < first ? diag : first;
    }
    return static_cast<int>(first);
  }
  __device__ __forceinline__ KeyBlock block(int i) const {
    KeyBlock b;
    b.start = static_cast<std::int64_t>(i) * kBlockN;
    b.valid = len_k - b.start < kBlockN ? static_cast<int>(len_k - b.start) : kBlockN;
    b.needs_mask = key_mask != nullptr || b.valid < kBlockN ||
                   (causal && b.start + kBlockN - 1 > q0 + len_k - len_q);
    return b;
  }
  // How many of the `valid` keys from `start` on query row `i` (sequence row) may see: a
  // prefix, cut by the causal rule (key j visible iff j <= i + len_k - len_q); the key mask
  // is applied by key_flags.
  __device__ __forceinline__ int visible_keys(std::int64_t i, std::int64_t start,
                                              int valid) const {
    if (!causal) return valid;
    const std::int64_t keys = i + len_k - len_q - start + 1;
    return keys < 0 ? 0 : (keys < valid ? static_cast<int>(keys) : valid);
  }
  // KeyBlock::key_flags of a block starting at key `start`: four byte loads per lane, one
  // coalesced 128-byte row per warp (was a byte load per accumulator value: 64 per thread and
  // block, which made key-masked attention ~3.7x slower than unmasked).
  __device__ __forceinline__ std::uint32_t lane_key_flags(std::int64_t start) const {
    static_assert(kKeyMask, "only the key-mask instance loads key flags");
    static_assert(kBlockN <= 128, "key_flags covers 4 keys per lane");
    if (key_mask == nullptr) return 0xFu;
    const std::int64_t j0 = start + 4 * (threadIdx.x & 31);
    std::uint32_t flags = 0;
#pragma unroll
    for (int b = 0; b < 4; ++b)
      if (j0 + b < len_k && __ldg(key_mask + (j0 + b) * key_mask_row)) flags |= 1u << b;
    return flags;
  }
};

template <int kBlockN, bool kHalves_ = false>
struct SparseVisit {
  static constexpr bool kElementMask = false;  // only the per-tile valid length
  static constexpr bool kKeyFlags = false;
  // block(i) reads the index (and block sizes) from global memory: the producer, which
  // needs it for the load anyway, records each block's valid length in shared memory.
  static constexpr bool kProducerRecordsBlocks = true;
  // Any block of the list may be partial: the mainloop checks each one.
  static constexpr bool kMaskedSuffix = false;
  // Blocks of two key tiles of kBlockN / 2 slots (tile_volume == kBlockN / 2): list entries
  // 2i and 2i + 1; an odd list's last block repeats its tile in the second half, all masked
  // (the rows loaded are real keys, so the masked products stay finite).
  static constexpr bool kHalves = kHalves_;
  static constexpr int kBlockKeys = kBlockN;
  const std::int32_t* list = nullptr;
  const std::int32_t* sizes = nullptr;  // null: every key tile is full
  int count = 0, blocks_per_tile = 1, tile_volume = kBlockN, kv_tiles = 0;

  __device__ __forceinline__ SparseVisit(const AttentionParams&, const SparseKeyListArgs& s,
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
  __device__ __forceinline__ int num_blocks() const {
    return kHalves ? (count + 1) / 2 : count * blocks_per_tile;
  }
  // Valid keys of key tile `tile` (0 for an out-of-range id: TMA zero-fills outside the
  // tensor and every key is masked).
  __device__ __forceinline__ int tile_keys(int tile) const {
    const bool ok = tile >= 0 && tile < kv_tiles;
    return ok ? (sizes ? __ldg(sizes + tile) : tile_volume) : 0;
  }
  // Valid keys clamped to [0, n].
  static __device__ __forceinline__ int clamp_keys(int keys, int n) {
    return keys < 0 ? 0 : (keys > n ? n : keys);
  }
  // Whether a block with these valid keys (per half with kHalves) needs the key mask; the
  // consumers apply the same rule to the lengths the producer records.
  static __device__ __forceinline__ bool needs_mask(int valid, int valid_hi) {
    return kHalves ? valid < kBlockN / 2 || valid_hi < kBlockN / 2 : valid < kBlockN;
  }
  __device__ __forceinline__ KeyBlock block(int i) const {
    if constexpr (kHalves) {
      constexpr int kHalf = kBlockN / 2;
      const int lo = __ldg(list + 2 * i);
      const bool has_hi = 2 * i + 1 < count;
      const int hi = has_hi ? __ldg(list + 2 * i + 1) : lo;
      KeyBlock b;
      b.start = static_cast<std::int64_t>(lo >= 0 && lo < kv_tiles ? lo : 0) * kHalf;
      b.start_hi = static_cast<std::int64_t>(hi >= 0 && hi < kv_tiles ? hi : 0) * kHalf;
      const int n_lo = tile_keys(lo), n_hi = has_hi ? tile_keys(hi) : 0;
      b.valid = clamp_keys(n_lo, kHalf);
      b.valid_hi = clamp_keys(n_hi, kHalf);
      b.needs_mask = needs_mask(b.valid, b.valid_hi);
      return b;
    }
    const int tile = __ldg(list + i / blocks_per_tile);
    const int sub = i % blocks_per_tile;
    KeyBlock b;
    // An out-of-range tile index loads nothing real (TMA zero-fills outside the tensor) and
    // is fully masked.
    const bool ok = tile >= 0 && tile < kv_tiles;
    b.start = static_cast<std::int64_t>(ok ? tile : 0) * tile_volume + sub * kBlockN;
    b.valid = clamp_keys(ok ? tile_keys(tile) - sub * kBlockN : 0, kBlockN);
    b.needs_mask = needs_mask(b.valid, 0);
    return b;
  }
};

// Sets the logits of invisible (row, key) pairs of one thread's accumulator fragment to
// -inf. `coords(v)` gives the (row, column) of value v inside the stream's tile.
//
// The wgmma accumulator (one 64 x kBlockN atom per warpgroup) gives thread `lane` value v at
// row coords(2 * ((v / 2) % 2)) and column 8 (v / 4) + 2 (lane % 4) + v % 2. So each of the
// thread's two rows gets one limit (its first invisible column, from the valid keys and the
// causal rule, less the thread's column offset), and each value costs one compare against
// a constant: the per-value 64-bit causal test and key-mask load this replaced made a masked
// key block ~4x the instructions of an unmasked one.
// Key padding: value v's column was loaded by lane 2 (v / 4) + (lane % 4) / 2 as bit
// 2 (lane % 2) + v % 2 of its key_flags; one ballot per flag bit gathers the warp's block,
// after which the thread's columns sit at the even bits of two words.
template <class Visit, class Frag, class Coords>
__device__ __forceinline__ void apply_mask(Frag& s, const Coords& coords, const Visit& visit,
                                           const KeyBlock& kb, std::int64_t q0) {
  constexpr int kVals = decltype(cute::size(s))::value;
  if constexpr (!Visit::kElementMask) {
    // Block-sparse lists: only each tile's valid keys, a test per value. Limits as below cut
    // the 64-token loop by 26 instructions, but ptxas then scheduled its unmasked blocks
    // differently and the Wan VSA shapes measured 1.5-4% slower (docs/perf-history.md, Hopper v15).
#pragma unroll
    for (int v = 0; v < kVals; ++v) {
      const int col = cute::get<1>(coords(v));
      bool ok;
      if constexpr (Visit::kHalves) {
        constexpr int kHalf = Visit::kBlockKeys / 2;
        ok = col < kHalf ? col < kb.valid : col - kHalf < kb.valid_hi;
      } else {
        ok = col < kb.valid;
      }
      if (!ok) s(v) = -INFINITY;
    }
  } else {
    // Dense (partial last block, causal diagonal, key padding): the row limits described
    // above, instead of a test of each value, which at 257 keys (one masked block in three)
    // cost the kernel 24% (docs/perf-history.md, Hopper v26).
    static_assert(kVals == Visit::kBlockKeys / 2, "one 64-row wgmma atom per warpgroup");
    const int quad = threadIdx.x & 3;
    static_assert(!Visit::kHalves, "half-loaded blocks are block-sparse");
    int limit[2];  // value v is visible iff 8 (v / 4) + v % 2 < limit[(v / 2) % 2]
#pragma unroll
    for (int r = 0; r < 2; ++r)
      limit[r] = visit.visible_keys(q0 + cute::get<0>(coords(2 * r)), kb.start, kb.valid) -
                 2 * quad;
    std::uint32_t key_bits[2] = {~0u, ~0u};
    if constexpr (Visit::kKeyFlags) {
      if (visit.key_mask != nullptr) {
        std::uint32_t words[4];
#pragma unroll
        for (int b = 0; b < 4; ++b) words[b] = __ballot_sync(~0u, (kb.key_flags >> b) & 1u);
        // Every key of the block present (the flags cover 128 keys from its start) and both
        // rows seeing the whole block: nothing to mask, as in most blocks of a padded suffix.
        if ((words[0] & words[1] & words[2] & words[3]) == ~0u &&
            min(limit[0], limit[1]) >= Visit::kBlockKeys - 2 * quad)
          return;
        key_bits[0] = ((quad & 1) ? words[2] : words[0]) >> (quad >> 1);
        key_bits[1] = ((quad & 1) ? words[3] : words[1]) >> (quad >> 1);
      }
    }
#pragma unroll
    for (int v = 0; v < kVals; ++v) {
      const int group = v / 4, col = 8 * group + (v & 1);  // less the thread's 2 (lane % 4)
      bool ok = col < limit[(v >> 1) & 1];
      if constexpr (Visit::kKeyFlags) ok = ok && ((key_bits[v & 1] >> (2 * group)) & 1u);
      if (!ok) s(v) = -INFINITY;
    }
  }
}

// Whether the rows of a loaded block past its valid keys (per half with kHalves) must be
// zeroed before a product reads them (docs/conventions.md, non-finite values): masking makes
// their probabilities exactly 0, but 0 times a non-finite value is NaN. They hold the next
// sequence's keys (varlen), a key tile's padded slots, or rows an earlier block left in the slot
// (block-sparse prefix loads). Rows past a batched sequence lie outside the TMA view and
// arrive as zeros already.
template <class Visit>
__device__ __forceinline__ bool tail_rows_need_zeros(const AttentionParams& a, int valid,
                                                     int valid_hi) {
  constexpr int kRows = Visit::kBlockKeys;
  if constexpr (Visit::kHalves) return valid < kRows / 2 || valid_hi < kRows / 2;
  else if constexpr (Visit::kElementMask) return a.varlen && valid < kRows;  // DenseVisit
  else return valid < kRows;
}

}  // namespace vidattn::cuda_sm90
