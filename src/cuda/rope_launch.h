// The interface between the RoPE dispatch (C++20, src/core/rope.cpp) and its CUDA kernel.
// Plain C++17 on purpose: nvcc compiles the kernel whatever C++ standard the build gives it.
#pragma once

#include <cstdint>

namespace vidattn::detail {

struct RopeLaunchParams {
  const void* x = nullptr;
  void* out = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  int x_dtype = 0;      // vidattn::DType value: 0 float32, 1 float16, 2 bfloat16, 3 float64
  int table_dtype = 0;  // the same, for cos and sin
  std::int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  std::int64_t x_stride[3] = {};    // batch, position, head (the head dim is unit-stride)
  std::int64_t out_stride[3] = {};
  std::int64_t cos_stride[2] = {};  // position, column
  std::int64_t sin_stride[2] = {};
  bool half_table = false, interleaved = true, transpose = false;
  int device = 0;
  void* stream = nullptr;  // cudaStream_t
};

// Launches the kernel; returns nullptr, or a message (static storage) when CUDA failed.
const char* launch_rope_cuda(const RopeLaunchParams& params);

}  // namespace vidattn::detail
