// Backend entry points of the fused VSA combine; calls arrive validated by vsa_combine.cpp.
#pragma once

#include <cstdint>
#include <optional>

#include "vidattn/tensor_view.h"

namespace vidattn::detail {

// vsa_combine's checks of its arguments, under another entry point's name
// (vsa_fine_combine_forward checks the combination it will write before the fine kernel runs).
void check_vsa_combine_arguments(const char* function, const TensorView& fine,
                                 const TensorView& coarse, const std::optional<TensorView>& gate,
                                 const TensorView& block_sizes, std::int64_t tile_volume,
                                 const TensorView& out);

// The block sizes are host data here (CPU tensors), checked to lie in [0, tile_volume].
void cpu_vsa_combine(const TensorView& fine, const TensorView& coarse,
                     const std::optional<TensorView>& gate, const TensorView& block_sizes,
                     std::int64_t tile_volume, const TensorView& out, int num_threads);
void cpu_vsa_combine_backward(const TensorView& grad_out, const TensorView& coarse,
                              const std::optional<TensorView>& gate,
                              const TensorView& block_sizes, std::int64_t tile_volume,
                              const TensorView& grad_coarse,
                              const std::optional<TensorView>& grad_gate, int num_threads);

// Row mode (vidattn::vsa_combine_rows); coarse may be float32 with 16-bit rows. The maps are
// host data here and are checked against each other.
void cpu_vsa_combine_rows(const TensorView& fine, const TensorView& coarse,
                          const std::optional<TensorView>& gate, const TensorView& token_to_slot,
                          const TensorView& slot_to_token, std::int64_t tile_volume,
                          std::int64_t first_token, const TensorView& out, int num_threads);
void cpu_vsa_combine_rows_backward(const TensorView& grad_out, const TensorView& coarse,
                                   const std::optional<TensorView>& gate,
                                   const TensorView& token_to_slot,
                                   const TensorView& slot_to_token, std::int64_t tile_volume,
                                   std::int64_t first_token, const TensorView& grad_coarse,
                                   const std::optional<TensorView>& grad_gate, int num_threads);

#ifdef VIDATTN_WITH_CUDA
// CUDA (src/cuda/vsa/combine.cu): the same calls, asynchronous on `stream`. Block sizes and
// maps are device data here and are not checked: a slot past its tile's block size, or a map
// entry out of range, leaves its row out of every tile. CUDA errors throw std::runtime_error.
void cuda_vsa_combine(const TensorView& fine, const TensorView& coarse,
                      const std::optional<TensorView>& gate, const TensorView& block_sizes,
                      std::int64_t tile_volume, const TensorView& out, void* stream);
void cuda_vsa_combine_backward(const TensorView& grad_out, const TensorView& coarse,
                               const std::optional<TensorView>& gate,
                               const TensorView& block_sizes, std::int64_t tile_volume,
                               const TensorView& grad_coarse,
                               const std::optional<TensorView>& grad_gate, void* stream);
void cuda_vsa_combine_rows(const TensorView& fine, const TensorView& coarse,
                           const std::optional<TensorView>& gate,
                           const TensorView& token_to_slot, const TensorView& slot_to_token,
                           std::int64_t tile_volume, std::int64_t first_token,
                           const TensorView& out, void* stream);
void cuda_vsa_combine_rows_backward(const TensorView& grad_out, const TensorView& coarse,
                                    const std::optional<TensorView>& gate,
                                    const TensorView& token_to_slot,
                                    const TensorView& slot_to_token, std::int64_t tile_volume,
                                    std::int64_t first_token, const TensorView& grad_coarse,
                                    const std::optional<TensorView>& grad_gate, void* stream);
#endif

}  // namespace vidattn::detail
