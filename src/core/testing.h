// Hooks for the test suites, compiled only with the CMake option VIDATTN_TESTING=ON: production
// builds hold no counters and no test-only ops.
#pragma once

#include <cstdint>

namespace vidattn::testing {

// Launches of the sm_90a (Hopper) forward kernels so far in this process: lets the tests check
// which path a call took (torch.ops.vidattn._sm90_forward_launches). Thread-safe.
void note_sm90_forward_launch() noexcept;
std::int64_t sm90_forward_launch_count() noexcept;

// The same for the sm_90a backward (torch.ops.vidattn._sm90_backward_launches): one per call.
void note_sm90_backward_launch() noexcept;
std::int64_t sm90_backward_launch_count() noexcept;

}  // namespace vidattn::testing
