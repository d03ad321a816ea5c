// Device workspace of the CUDA backend: the packed copies of key-padded attention, the
// backward's row sums, small counters. It is stream-ordered: taken before the kernels that use
// it are queued on a stream and given back right after, so work queued on that stream before
// the release may still use it. By default it comes from cudaMallocAsync / cudaFreeAsync (the
// device's default memory pool, which returns its memory to the system whenever the device
// synchronises). A framework with its own caching allocator installs it here so that the
// workspace shares that cache and its out-of-memory handling; vidattn's PyTorch ops install
// PyTorch's. Torch-free and CUDA-free: streams are cudaStream_t passed as void*.
#pragma once

#include <cstddef>

namespace vidattn {

struct CudaWorkspaceAllocator {
  // At least `bytes` of memory on the current device, usable by work queued on `stream`;
  // nullptr when there is none to give (vidattn then takes a path that needs less, or throws).
  void* (*allocate)(std::size_t bytes, void* stream, void* context) = nullptr;
  // Gives `ptr` back; work queued on `stream` before this call may still use it.
  void (*release)(void* ptr, void* stream, void* context) = nullptr;
  void* context = nullptr;
};

// Installs `allocator` for every later workspace (thread-safe); one whose allocate or
// release is null restores the default.
void set_cuda_workspace_allocator(const CudaWorkspaceAllocator& allocator);

// The allocator in use; both functions null for the default.
CudaWorkspaceAllocator cuda_workspace_allocator();

}  // namespace vidattn
