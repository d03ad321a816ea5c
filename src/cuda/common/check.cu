// Definitions of common/check.h.
#include "check.h"

#include <stdexcept>
#include <string>

namespace vidattn::cuda_common {

void check_cuda(cudaError_t status, const char* what) {
  if (status != cudaSuccess)
    throw std::runtime_error(std::string("vidattn (CUDA): ") + what + " failed: " +
                             cudaGetErrorName(status) + ": " + cudaGetErrorString(status));
}

void check_last_launch(const char* what) { check_cuda(cudaGetLastError(), what); }

int current_sm_count() {
  int device = 0, count = 0;
  check_cuda(cudaGetDevice(&device), "cudaGetDevice");
  check_cuda(cudaDeviceGetAttribute(&count, cudaDevAttrMultiProcessorCount, device),
             "cudaDeviceGetAttribute (multiprocessors)");
  return count;
}

}  // namespace vidattn::cuda_common
