// The device check of varlen offsets (dispatch/varlen_check.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "vidattn/tensor_view.h"

namespace vidattn::cuda_dispatch {

// Checks cu_seqlens_q and cu_seqlens_k (int32 [N + 1] on the device) against the rule of
// detail::check_cu_seqlens: one small kernel and a 4-byte read-back, which waits for the
// stream. A fault is then described from a host copy of the faulty offsets, so the ValueError
// (naming `fn` and the argument) is the CPU backend's. Returns at once, checking nothing,
// while `stream` is being captured into a CUDA graph.
void check_varlen_offsets(const char* fn, const TensorView& cu_seqlens_q, std::int64_t rows_q,
                          std::int64_t max_seqlen_q, const TensorView& cu_seqlens_k,
                          std::int64_t rows_k, std::int64_t max_seqlen_k, cudaStream_t stream);

}  // namespace vidattn::cuda_dispatch
