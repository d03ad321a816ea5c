// Stream-ordered device workspace from the installed allocator (include/vidattn/cuda_workspace.h)
// or, by default, cudaMallocAsync. Given back when the object goes out of scope: the kernels
// that use it are queued on the same stream before that, so they still see it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <stdexcept>
#include <string>

#include "vidattn/cuda_workspace.h"

namespace vidattn::cuda_common {

class DeviceWorkspace {
 public:
  // Null data() when no memory could be had (check before use).
  static DeviceWorkspace try_allocate(std::size_t bytes, cudaStream_t stream) {
    DeviceWorkspace w;
    w.stream_ = stream;
    w.allocator_ = cuda_workspace_allocator();
    if (bytes == 0) return w;
    if (w.allocator_.allocate) {
      w.data_ = w.allocator_.allocate(bytes, stream, w.allocator_.context);
    } else if (cudaMallocAsync(&w.data_, bytes, stream) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it so that later checks do not see it
      w.data_ = nullptr;
    }
    return w;
  }
  // Throws std::runtime_error naming `what` when no memory could be had.
  DeviceWorkspace(std::size_t bytes, cudaStream_t stream, const char* what)
      : DeviceWorkspace(try_allocate(bytes, stream)) {
    if (bytes > 0 && data_ == nullptr)
      throw std::runtime_error(std::string("vidattn (CUDA): out of device memory for ") + what +
                               " (" + std::to_string(bytes) + " bytes)");
  }
  DeviceWorkspace(DeviceWorkspace&& o) noexcept
      : data_(o.data_), stream_(o.stream_), allocator_(o.allocator_) {
    o.data_ = nullptr;
  }
  DeviceWorkspace(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(const DeviceWorkspace&) = delete;
  DeviceWorkspace& operator=(DeviceWorkspace&&) = delete;
  ~DeviceWorkspace() {
    if (data_ == nullptr) return;
    if (allocator_.release) allocator_.release(data_, stream_, allocator_.context);
    else cudaFreeAsync(data_, stream_);
  }

  void* data() const { return data_; }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }

 private:
  DeviceWorkspace() = default;
  void* data_ = nullptr;
  cudaStream_t stream_ = nullptr;
  CudaWorkspaceAllocator allocator_;
};

}  // namespace vidattn::cuda_common
