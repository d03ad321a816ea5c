// The workspace allocator hook (include/vidattn/cuda_workspace.h). It lives in the core, not
// the CUDA sources, so that the torch layer can install its allocator in every build.
#include "vidattn/cuda_workspace.h"

#include <mutex>

namespace vidattn {
namespace {

struct Installed {
  std::mutex mutex;
  CudaWorkspaceAllocator allocator;
};

Installed& installed() {
  static Installed state;
  return state;
}

}  // namespace

void set_cuda_workspace_allocator(const CudaWorkspaceAllocator& allocator) {
  Installed& s = installed();
  const std::lock_guard<std::mutex> lock(s.mutex);
  s.allocator = (allocator.allocate && allocator.release) ? allocator : CudaWorkspaceAllocator{};
}

CudaWorkspaceAllocator cuda_workspace_allocator() {
  Installed& s = installed();
  const std::lock_guard<std::mutex> lock(s.mutex);
  return s.allocator;
}

}  // namespace vidattn
