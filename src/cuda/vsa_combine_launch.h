// The interface between the VSA combine dispatch (C++20, src/core/vsa_combine.cpp) and its
// CUDA kernels. Plain C++17 on purpose, like rope_launch.h.
#pragma once

#include <cstdint>

namespace vidattn::detail {

struct CombineLaunchParams {
  // Tiled mode (block_sizes set) or row mode (token_to_slot and slot_to_token set).
  // Forward: fine, coarse, gate (may be null) -> out.
  // Backward: grad_out (in `fine`), coarse, gate -> grad_coarse, grad_gate (may be null).
  const void* fine = nullptr;
  const void* coarse = nullptr;
  const void* gate = nullptr;
  const std::int32_t* block_sizes = nullptr;
  void* out = nullptr;
  void* grad_coarse = nullptr;
  void* grad_gate = nullptr;
  int dtype = 0;  // vidattn::DType value: 0 float32, 1 float16, 2 bfloat16, 3 float64
  int coarse_dtype = 0;  // dtype, or float32 (row mode only)
  std::int64_t batch = 0, tiles = 0, tile_volume = 0, heads = 0, head_dim = 0;
  std::int64_t block_sizes_stride = 1;
  // Rows of fine / gate / out per batch: tiles * tile_volume slots in the tiled mode; in the
  // row mode (token_to_slot set) tokens first_token ... of a raster sequence of num_tokens.
  std::int64_t rows = 0;
  const std::int32_t* token_to_slot = nullptr;
  const std::int32_t* slot_to_token = nullptr;
  std::int64_t num_tokens = 0, first_token = 0;
  // Strides (elements) of batch, slot (or tile for coarse tensors) and head; D is unit-stride.
  std::int64_t fine_stride[3] = {}, coarse_stride[3] = {}, gate_stride[3] = {};
  std::int64_t out_stride[3] = {}, grad_coarse_stride[3] = {}, grad_gate_stride[3] = {};
  bool vectorize = false;  // every row start 16-byte aligned and D a multiple of 16 bytes
  void* stream = nullptr;  // cudaStream_t
};

// Launch the kernels (either mode); return nullptr, or a message (static storage) when CUDA
// failed.
const char* launch_vsa_combine_cuda(const CombineLaunchParams& params);
const char* launch_vsa_combine_backward_cuda(const CombineLaunchParams& params);

}  // namespace vidattn::detail
