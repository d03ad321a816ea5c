// Kernel parameters of the sm_80 dense attention kernels: raw pointers and 64-bit strides
// (elements) of every tensor, so that any [B, S, H, D] view with a unit-stride D works and
// offsets past 2^31 elements stay exact.
#pragma once

#include <cstdint>

namespace vidattn::cuda_common {

// Where a [B, S, H, D] (batched) or [T, H, D] (varlen) tensor keeps its rows.
struct RowStrides {
  std::int64_t batch = 0;  // unused in varlen mode: sequences are found through cu_seqlens
  std::int64_t row = 0;
  std::int64_t head = 0;
};

struct AttentionParams {
  // Forward inputs and outputs (element type: the kernel's T).
  const void* q = nullptr;
  const void* k = nullptr;
  const void* v = nullptr;
  void* out = nullptr;
  float* lse = nullptr;  // [B, Hq, Sq] or [Hq, Tq]; strides in lse_strides
  RowStrides q_strides, k_strides, v_strides, out_strides, lse_strides;

  // Backward only.
  const void* grad_out = nullptr;
  void* dq = nullptr;
  void* dk = nullptr;
  void* dv = nullptr;
  float* delta = nullptr;  // workspace [Hq][rows_q]: rowsum(dO * O), contiguous
  RowStrides grad_out_strides, dq_strides, dk_strides, dv_strides;

  // Varlen: int32 [N + 1] offsets, read on the device.
  const std::int32_t* cu_seqlens_q = nullptr;
  const std::int32_t* cu_seqlens_k = nullptr;
  std::int64_t cu_seqlens_q_stride = 1, cu_seqlens_k_stride = 1;

  // Padding masks, bool [B, Sk] / [B, Sq] read as bytes; null when absent.
  const std::uint8_t* key_mask = nullptr;
  const std::uint8_t* query_mask = nullptr;
  std::int64_t key_mask_batch = 0, key_mask_row = 0;
  std::int64_t query_mask_batch = 0, query_mask_row = 0;

  int batch = 0;  // B, or the number of sequences
  int heads_q = 0;
  int heads_kv = 0;
  int group = 1;                // heads_q / heads_kv
  std::int64_t seqlen_q = 0;    // Sq, or max_seqlen_q (varlen)
  std::int64_t seqlen_k = 0;    // Sk, or max_seqlen_k (varlen)
  std::int64_t rows_q = 0;      // rows of q: B * Sq, or Tq
  std::int64_t rows_k = 0;      // rows of k: B * Sk, or Tk
  float scale = 0.f;
  bool causal = false;
  bool varlen = false;
  // Every row start of every tile tensor is 16-byte aligned: tiles load with cp.async;
  // otherwise with element-wise loads (correct, slower).
  bool aligned16 = false;
  // Output row starts are 4-byte aligned (column pairs stored as one word).
  bool out_aligned4 = false;
  // SMs the persistent (sm_90a) kernels leave free for concurrent kernels; the sm_80 grids
  // cover every tile and ignore it.
  int sm_margin = 0;

  // Block-sparse attention (VSA's fine branch; batched layout only). The dense kernels never
  // read these; the sparse instantiations walk these lists instead of a range of blocks.
  // Index entries are trusted to be in bounds only after a clamp: ids outside
  // [0, q_tiles) / [0, kv_tiles) are skipped and counts / offsets are clamped.
  const std::int32_t* q2k_index = nullptr;    // [B, Hq, Qtiles, MaxK]
  const std::int32_t* q2k_count = nullptr;    // [B, Hq, Qtiles]
  const std::int32_t* k2q_offsets = nullptr;  // [B, Hq, KVtiles + 1] (backward)
  const std::int32_t* k2q_index = nullptr;    // [B, Hq, Qtiles * MaxK] (backward)
  const std::int32_t* q_block_sizes = nullptr;   // [Qtiles], null: every tile full
  const std::int32_t* kv_block_sizes = nullptr;  // [KVtiles], null: every tile full
  std::int64_t q2k_index_strides[4] = {0, 0, 0, 0};
  std::int64_t q2k_count_strides[3] = {0, 0, 0};
  std::int64_t k2q_offsets_strides[3] = {0, 0, 0};
  std::int64_t k2q_index_strides[3] = {0, 0, 0};
  std::int64_t q_block_sizes_stride = 1, kv_block_sizes_stride = 1;
  int tile_volume = 64;    // 64, 128 or 256: 1, 2 or 4 blocks of 64 keys / queries
  int tile_shift = 0;      // log2(tile_volume / 64)
  int q_tiles = 0, kv_tiles = 0, max_k = 0;

  // Head dims of q / k and of v / out. Only the sm_80 kernels of a padded instance (a tile
  // width above them) read them; every other instance has them equal to its width. Last, so
  // that the fields above keep their offsets in the kernels that never read these.
  int head_dim = 0;
  int head_dim_v = 0;
};

}  // namespace vidattn::cuda_common
