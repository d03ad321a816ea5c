// The device check of a block-sparse index (vsa/index_check.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "vidattn/tensor_view.h"

namespace vidattn::cuda_vsa {

// Whether work queued on `stream` now would be captured into a graph (then no host
// synchronisation is allowed). An error of the query (the legacy stream while another stream
// captures globally) counts as capturing.
bool stream_is_capturing(cudaStream_t stream);

// Checks q2k_index / q2k_count [B, H, Qtiles(, MaxK)] (counts in [0, MaxK], ids in
// [0, kv_tiles), each row strictly ascending) and the tile sizes when given (in
// [0, tile_volume]) on the device, waits for the verdict and throws ValueError naming `fn`
// and the first faulty row. Returns at once, checking nothing, while `stream` is captured.
void check_block_sparse_index(const char* fn, const TensorView& index, const TensorView& count,
                              std::int64_t kv_tiles, const TensorView* q_sizes,
                              const TensorView* kv_sizes, std::int64_t tile_volume,
                              cudaStream_t stream);

}  // namespace vidattn::cuda_vsa
