// Pieces of the CPU VSA backend shared by vsa_cpu.cpp and the block-sparse attention.
#pragma once

#include <omp.h>

#include <cstdint>
#include <vector>

#include "../core/check.h"
#include "vidattn/tensor_view.h"

namespace vidattn::detail::cpu_vsa {

// OpenMP threads for a `num_threads` argument (0: the OpenMP default).
inline int threads_of(int n) { return n > 0 ? n : omp_get_max_threads(); }

// Element (i) of an int32 vector view, any stride.
inline std::int32_t int_at(const TensorView& t, std::int64_t i) {
  return static_cast<const std::int32_t*>(t.data)[i * t.stride[0]];
}

// Block sizes of `tiles` tiles: the given int32 vector (checked to lie in [0, tile_volume]) or,
// when absent, tile_volume for every tile.
std::vector<std::int32_t> read_block_sizes(const ArgChecker& check, const TensorView* sizes,
                                           const char* name, std::int64_t tiles,
                                           std::int64_t tile_volume);

// Checks a q2k index against num_kv_tiles: counts in [0, MaxK], ids in range and strictly
// ascending. Throws ValueError naming the first bad entry.
void check_q2k_index(const ArgChecker& check, const TensorView& q2k_index,
                     const TensorView& q2k_count, std::int64_t num_kv_tiles);

}  // namespace vidattn::detail::cpu_vsa
