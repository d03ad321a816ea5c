// Query-visit policies of the sm_90a dK / dV kernel: the backward twin of the forward's key
// visit (key_visit.h). A CTA owns a tile of key rows and visits, one 64-row block at a time,
// the query blocks whose rows may see one of its keys, over every query head of its key
// head's group (dK and dV are summed over the group in registers, in a fixed order).
//   DenseQueryVisit: the query blocks of the sequence from the causal limit on.
// The dQ kernel walks key blocks with the forward's own policies (key_visit.h).
#pragma once

#include <cstdint>

#include "cuda/common/params.h"
#include "cuda/common/sequence.h"

namespace vidattn::cuda_sm90 {

struct QueryBlock {
  int head = 0;             // query head
  std::int64_t q0 = 0;      // the block's first query row (sequence row)
  bool needs_mask = false;  // some query of the block cannot see some key of the CTA's tile
};

// kBlockQ: query rows per block; kKeys: key rows of the CTA's tile.
template <int kBlockQ, int kKeys>
struct DenseQueryVisit {
  std::int64_t k0 = 0;     // the tile's first key row
  std::int64_t shift = 0;  // len_k - len_q: query i sees key j iff j <= i + shift (causal)
  int head0 = 0, per_head = 0, first_block = 0;
  bool causal = false;

  __device__ __forceinline__ DenseQueryVisit(const cuda_common::AttentionParams& p,
                                             const cuda_common::Sequence& seq, int hk,
                                             std::int64_t k0_, int group)
      : k0(k0_), shift(seq.len_k - seq.len_q), head0(hk * group), causal(p.causal) {
    // Causal: key k0 is seen from query row k0 - shift on; earlier blocks see none of the
    // tile's keys.
    std::int64_t first_row = causal ? k0 - shift : 0;
    first_row = first_row < 0 ? 0 : first_row;
    first_block = static_cast<int>(first_row / kBlockQ);
    const int end = static_cast<int>((seq.len_q + kBlockQ - 1) / kBlockQ);
    per_head = end > first_block ? end - first_block : 0;
    group_ = group;
  }
  __device__ __forceinline__ int num_blocks() const { return group_ * per_head; }
  __device__ __forceinline__ QueryBlock block(int i) const {
    QueryBlock b;
    const int h = i / per_head;
    b.head = head0 + h;
    b.q0 = static_cast<std::int64_t>(first_block + (i - h * per_head)) * kBlockQ;
    // The block's first row sees keys up to q0 + shift; the tile's last key is k0 + kKeys - 1.
    b.needs_mask = causal && b.q0 + shift < k0 + kKeys - 1;
    return b;
  }

 private:
  int group_ = 1;
};

// Sets S^T (keys as rows, queries as columns) to -inf where the causal rule hides the query's
// view of the key: value v at key k0 + row, query q0 + col, visible iff
// k0 + row <= q0 + col + shift. `coords(v)` gives (row, col) inside the CTA's tile / block.
// Each of the thread's two rows gets one limit (its first visible column); a value then costs
// one compare.
template <class Frag, class Coords>
__device__ __forceinline__ void apply_causal_mask_keys(Frag& s, const Coords& coords,
                                                       std::int64_t k0, std::int64_t q0,
                                                       std::int64_t shift) {
  constexpr int kVals = decltype(cute::size(s))::value;
  int first_col[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    std::int64_t c = k0 + cute::get<0>(coords(2 * r)) - shift - q0;
    c = c < -1 ? -1 : (c > (1 << 20) ? (1 << 20) : c);
    first_col[r] = static_cast<int>(c);
  }
#pragma unroll
  for (int v = 0; v < kVals; ++v)
    if (cute::get<1>(coords(v)) < first_col[(v >> 1) & 1]) s(v) = -INFINITY;
}

}  // namespace vidattn::cuda_sm90
