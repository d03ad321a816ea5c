// Torch-free, CuTe-free parameters of the sm_90a attention forward that the host code of
// dispatch/ fills: the dense problem reuses the common AttentionParams (pointers, strides,
// masks, varlen offsets); the block-sparse variant adds the key-tile lists.
#pragma once

#include <cstdint>

#include "cuda/common/params.h"

namespace vidattn::cuda_sm90 {

using cuda_common::AttentionParams;
using cuda_common::RowStrides;

// Block-sparse key lists (index-native VSA format, docs/vsa.md section 4). The query and key
// sequences are in the tiled layout: tile t holds slots [t * tile_volume, (t + 1) * tile_volume),
// of which the first block_sizes[t] are tokens and the rest padding (never attended).
struct SparseKeyListArgs {
  const std::int32_t* q2k_index = nullptr;  // [B, Hq, Qtiles, MaxK], ascending, -1 unused
  std::int64_t index_batch = 0, index_head = 0, index_tile = 0;  // element strides (last: 1)
  const std::int32_t* q2k_count = nullptr;  // [B, Hq, Qtiles]
  std::int64_t count_batch = 0, count_head = 0, count_tile = 0;
  const std::int32_t* kv_block_sizes = nullptr;  // [KVtiles] valid tokens per key tile
  int tile_volume = 64;  // 64, 128 or 256
  int max_k = 0;         // MaxK
  int q_tiles = 0;
  int kv_tiles = 0;
};

// VSA's combination written by the 64-token block-sparse kernel itself (inference):
// out = fine + gate * coarse[tile] on each query tile's valid slots, out = fine on padded
// ones, where fine is the kernel's own output (AttentionParams::out), as vsa_combine computes
// it. gate null: a gate of 1. One element type throughout; unit-stride last dimensions and
// 16-byte aligned rows (the launcher checks).
struct CombineArgs {
  void* out = nullptr;
  cuda_common::RowStrides out_strides;    // [B, Sq, Hq, D] like fine
  const void* gate = nullptr;
  cuda_common::RowStrides gate_strides;
  const void* coarse = nullptr;         // [B, Qtiles, Hq, D]
  std::int64_t coarse_batch = 0, coarse_tile = 0, coarse_head = 0;
};

}  // namespace vidattn::cuda_sm90
