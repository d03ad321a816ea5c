// vidattn's CUDA workspace (include/vidattn/cuda_workspace.h) from PyTorch's caching
// allocator, installed when the op library loads: the packed copies of key-padded attention
// (hundreds of MB at video lengths) then come from torch's cache, count in its memory
// statistics, and an out-of-memory first frees torch's cached blocks; from the default
// cudaMallocAsync pool they would be invisible to torch and mapped afresh after each device
// synchronisation.
#ifdef VIDATTN_TORCH_CUDA
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/util/Exception.h>

#include <cstddef>

#include "vidattn/cuda_workspace.h"

namespace vidattn::torch_ops {
namespace {

void* allocate(std::size_t bytes, void* stream, void* /*context*/) {
  try {
    return c10::cuda::CUDACachingAllocator::raw_alloc_with_stream(
        bytes, static_cast<cudaStream_t>(stream));
  } catch (const c10::OutOfMemoryError&) {
    return nullptr;  // vidattn takes a path without the workspace, or reports it
  }
}

void release(void* ptr, void* /*stream*/, void* /*context*/) {
  c10::cuda::CUDACachingAllocator::raw_delete(ptr);  // stream-ordered: reused on its stream
}

[[maybe_unused]] const bool installed = [] {
  vidattn::set_cuda_workspace_allocator({&allocate, &release, nullptr});
  return true;
}();

}  // namespace
}  // namespace vidattn::torch_ops
#endif
