// Definitions of testing.h (VIDATTN_TESTING builds only).
#include "testing.h"

#include <atomic>

namespace vidattn::testing {
namespace {
std::atomic<std::int64_t> g_sm90_forward_launches{0};
std::atomic<std::int64_t> g_sm90_backward_launches{0};
}  // namespace

void note_sm90_forward_launch() noexcept {
  g_sm90_forward_launches.fetch_add(1, std::memory_order_relaxed);
}

std::int64_t sm90_forward_launch_count() noexcept {
  return g_sm90_forward_launches.load(std::memory_order_relaxed);
}

void note_sm90_backward_launch() noexcept {
  g_sm90_backward_launches.fetch_add(1, std::memory_order_relaxed);
}

std::int64_t sm90_backward_launch_count() noexcept {
  return g_sm90_backward_launches.load(std::memory_order_relaxed);
}

}  // namespace vidattn::testing
