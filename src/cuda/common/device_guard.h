// The one device guard of the CUDA host code: makes a device current for the calls in scope
// and restores the caller's device on the way out (also when an exception leaves the scope).
#pragma once

#include <cuda_runtime.h>

#include "check.h"

namespace vidattn::cuda_common {

class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    check_cuda(cudaGetDevice(&previous_), "cudaGetDevice");
    if (previous_ != device) check_cuda(cudaSetDevice(device), "cudaSetDevice");
    else previous_ = -1;
  }
  ~DeviceGuard() {
    if (previous_ >= 0) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = -1;
};

}  // namespace vidattn::cuda_common
