// The interface between the VSA dispatch (C++20, src/core/vsa.cpp) and the CUDA kernels of the
// coarse stage and the tiling gathers (src/cuda/vsa_coarse.cu). Plain C++17 on purpose, like
// rope_launch.h. Every launcher returns nullptr, or a message (static storage) when CUDA failed;
// none of them synchronises with the host (they run inside CUDA-graph-captured steps).
//
// Index data cannot be checked on the device without a host sync, so the CUDA kernels clamp
// instead of throwing: gather indices outside [-1, S) give zero rows, block sizes are clamped
// to [0, tile volume], cu_tiles offsets to [0, tiles] (a query tile outside every video gets
// count 0). Valid inputs give exactly the CPU backend's results.
#pragma once

#include <cstdint>

namespace vidattn::detail {

// dtype codes: vidattn::DType values, 0 float32, 1 float16, 2 bfloat16, 3 float64.

struct VsaGatherLaunch {
  const void* x = nullptr;
  void* out = nullptr;
  const std::int32_t* index = nullptr;  // contiguous-or-strided int32 [N]
  std::int64_t index_stride = 1;
  int dtype = 0;
  std::int64_t batch = 0, seqlen = 0, rows = 0, heads = 0, head_dim = 0;  // rows = N
  std::int64_t x_stride[3] = {};    // batch, token, head (unit-stride head dim)
  std::int64_t out_stride[3] = {};
  int device = 0;
  void* stream = nullptr;
};
const char* launch_vsa_gather_tokens(const VsaGatherLaunch& p);

// Forward: x [B, Tiles * V, H, D] -> out [B, Tiles, H, D]. Backward: grad_out (x) [B, Tiles, H,
// D] -> grad_x (out) [B, Tiles * V, H, D].
struct VsaPoolLaunch {
  const void* x = nullptr;
  void* out = nullptr;
  const std::int32_t* block_sizes = nullptr;
  std::int64_t block_sizes_stride = 1;
  int dtype = 0;
  bool backward = false;
  std::int64_t batch = 0, tiles = 0, heads = 0, head_dim = 0, tile_volume = 0;
  std::int64_t x_stride[3] = {};
  std::int64_t out_stride[3] = {};
  int device = 0;
  void* stream = nullptr;
};
const char* launch_vsa_tile_mean_pool(const VsaPoolLaunch& p);

// select_topk_tiles (scores from q_pooled, k_pooled) or, with `scores` set, the selection from
// given scores [B, H, Qtiles, Ktiles].
struct VsaTopkLaunch {
  const void* q = nullptr;        // q_pooled [B, Qtiles, Hq, D]
  const void* k = nullptr;        // k_pooled [B, Ktiles, Hkv, D]
  const void* scores = nullptr;   // topk_tiles_from_scores only
  int dtype = 0;
  std::int64_t batch = 0, q_tiles = 0, k_tiles = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  std::int64_t q_stride[3] = {}, k_stride[3] = {};
  std::int64_t scores_stride[3] = {};  // batch, head, query tile (unit-stride key tiles)
  double scale = 1.0;
  std::int64_t topk = 1, max_k = 0;
  bool has_sparsity = false;
  double sparsity = 0.0;
  const std::int32_t* cu_tiles_q = nullptr;  // [num_videos + 1] or null
  const std::int32_t* cu_tiles_k = nullptr;
  std::int64_t cu_q_stride = 1, cu_k_stride = 1, num_videos = 0;
  std::int32_t* index = nullptr;  // q2k_index [B, H, Qtiles, MaxK]
  std::int64_t index_stride[4] = {};
  std::int32_t* count = nullptr;  // q2k_count [B, H, Qtiles]
  std::int64_t count_stride[3] = {};
  int device = 0;
  void* stream = nullptr;
};
// Sets `error_is_limit` when the key tiles do not fit the kernel's shared memory (the message
// then says so); other errors are CUDA failures.
const char* launch_vsa_select_topk(const VsaTopkLaunch& p, bool* error_is_limit);
const char* launch_vsa_topk_from_scores(const VsaTopkLaunch& p);

}  // namespace vidattn::detail
