// Test-only ops (VIDATTN_TESTING builds): queries the test suites make of the library's
// internals. Not part of the API; production builds do not define them.
#include <torch/library.h>

#include "../src/core/testing.h"

namespace vidattn::torch_ops {
namespace {

// How many times the sm_90a forward kernels ran in this process.
int64_t sm90_forward_launches() { return vidattn::testing::sm90_forward_launch_count(); }
// How many times the sm_90a backward ran in this process.
int64_t sm90_backward_launches() { return vidattn::testing::sm90_backward_launch_count(); }

}  // namespace

TORCH_LIBRARY_FRAGMENT(vidattn, m) {
  m.def("_sm90_forward_launches() -> int", &sm90_forward_launches);
  m.def("_sm90_backward_launches() -> int", &sm90_backward_launches);
}

}  // namespace vidattn::torch_ops
