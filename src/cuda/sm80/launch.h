// Launchers of the sm_80 attention kernels, one explicit instantiation per (dtype, head dim)
// in its own .cu file (fwd_*.cu, bwd_*.cu) so that the builds run in parallel.
#pragma once

#include <cuda_runtime.h>

#include "params.h"

namespace vidattn::cuda_sm80 {

// T is __nv_bfloat16 or __half; D is 64 or 128 (Dv == D). Asynchronous on `stream`; throws
// std::runtime_error when a launch fails.
template <class T, int D>
void launch_forward(const AttentionParams& p, cudaStream_t stream);

// Needs p.delta: a [heads_q][rows_q] float workspace.
template <class T, int D>
void launch_backward(const AttentionParams& p, cudaStream_t stream);

// Throws std::runtime_error naming `what` when `status` is an error.
void check_cuda(cudaError_t status, const char* what);

}  // namespace vidattn::cuda_sm80
