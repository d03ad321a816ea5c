// CUDA status checks and device queries shared by every CUDA host file. Errors become
// exceptions here, once, so no launcher returns an error code across the core / CUDA seam.
#pragma once

#include <cuda_runtime.h>

namespace vidattn::cuda_common {

// Throws std::runtime_error naming `what` when `status` is an error.
void check_cuda(cudaError_t status, const char* what);

// Throws like check_cuda when the last launch (or any earlier asynchronous call on this
// thread) failed; clears a launch error so that it does not surface again elsewhere.
void check_last_launch(const char* what);

// Multiprocessors of the current device.
int current_sm_count();

}  // namespace vidattn::cuda_common
