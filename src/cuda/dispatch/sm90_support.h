// When a device and a tensor view may take the sm_90a kernels (CuTe-free host code of the
// dispatch).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>

#include "cuda/common/check.h"
#include "vidattn/tensor_view.h"

namespace vidattn::cuda_dispatch {

// TMA reads tiles: the base 16-byte aligned, every stride of a dimension with more than one
// entry a multiple of 16 bytes below 2^40 bytes, the last dimension contiguous.
inline bool tma_compatible(const TensorView& t) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0) return false;
  const std::int64_t elem = static_cast<std::int64_t>(dtype_size(t.dtype));
  for (int d = 0; d + 1 < t.ndim; ++d) {
    if (t.shape[d] <= 1) continue;
    const std::int64_t bytes = t.stride[d] * elem;
    if (bytes <= 0 || bytes % 16 != 0 || bytes >= (std::int64_t{1} << 40)) return false;
  }
  return t.ndim == 0 || t.stride[t.ndim - 1] == 1 || t.shape[t.ndim - 1] <= 1;
}

// The one environment switch of the kernels' host code, a documented kill switch:
// VIDATTN_DISABLE_SM90=1 keeps sm_90 devices on the portable kernels (read once per process),
// for a user who meets a problem on the Hopper path and needs to work on meanwhile.
inline bool sm90_disabled_by_env() {
  static const bool disabled = [] {
    const char* v = std::getenv("VIDATTN_DISABLE_SM90");
    return v != nullptr && std::strcmp(v, "1") == 0;
  }();
  return disabled;
}

// Compute capability exactly 9.0 (sm_90a code runs on nothing else) and not disabled.
inline bool sm90_path_enabled(int device) {
  if (sm90_disabled_by_env()) return false;
  int major = 0, minor = 0;
  cuda_common::check_cuda(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device),
                        "cudaDeviceGetAttribute (compute capability)");
  cuda_common::check_cuda(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device),
                        "cudaDeviceGetAttribute (compute capability)");
  return major == 9 && minor == 0;
}

}  // namespace vidattn::cuda_dispatch
