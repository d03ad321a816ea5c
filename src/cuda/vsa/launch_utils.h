// Host helpers shared by the VSA kernels' entry points (gather.cu, pool.cu, topk.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace vidattn::cuda_vsa {

// Blocks for `total` work items of `threads` each: enough to fill any current GPU, at most
// 65536; the kernels' grid-stride loops cover the rest.
inline unsigned grid_for(std::int64_t total, int threads) {
  const std::int64_t blocks = (total + threads - 1) / threads;
  return unsigned(blocks < 65536 ? blocks : 65536);
}

inline bool aligned(const void* ptr, std::int64_t bytes) {
  return reinterpret_cast<std::uintptr_t>(ptr) % std::uintptr_t(bytes) == 0;
}

}  // namespace vidattn::cuda_vsa
