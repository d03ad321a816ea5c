// The CUDA workspace allocator hook (vidattn/cuda_workspace.h): what is installed is what the
// CUDA backend gets, a half-filled allocator restores the default, and threads may install
// while others read. (Whether the kernels' workspace comes from it is checked on a GPU:
// tests/python/test_attention_sm90.py, through PyTorch's allocator.)
#include <gtest/gtest.h>

#include <cstddef>
#include <thread>
#include <vector>

#include "vidattn/cuda_workspace.h"

namespace {

int g_token = 0;

void* fake_allocate(std::size_t, void*, void*) { return &g_token; }
void fake_release(void*, void*, void*) {}

struct RestoreDefault {
  ~RestoreDefault() { vidattn::set_cuda_workspace_allocator({}); }
};

TEST(CudaWorkspace, DefaultIsEmpty) {
  const RestoreDefault restore;
  vidattn::set_cuda_workspace_allocator({});
  const auto a = vidattn::cuda_workspace_allocator();
  EXPECT_EQ(a.allocate, nullptr);
  EXPECT_EQ(a.release, nullptr);
  EXPECT_EQ(a.context, nullptr);
}

TEST(CudaWorkspace, InstalledAllocatorIsReturned) {
  const RestoreDefault restore;
  int context = 0;
  vidattn::set_cuda_workspace_allocator({&fake_allocate, &fake_release, &context});
  const auto a = vidattn::cuda_workspace_allocator();
  EXPECT_EQ(a.allocate, &fake_allocate);
  EXPECT_EQ(a.release, &fake_release);
  EXPECT_EQ(a.context, &context);
  EXPECT_EQ(a.allocate(16, nullptr, a.context), &g_token);
}

TEST(CudaWorkspace, HalfFilledAllocatorRestoresTheDefault) {
  const RestoreDefault restore;
  vidattn::set_cuda_workspace_allocator({&fake_allocate, &fake_release, nullptr});
  vidattn::set_cuda_workspace_allocator({&fake_allocate, nullptr, nullptr});
  EXPECT_EQ(vidattn::cuda_workspace_allocator().allocate, nullptr);
  vidattn::set_cuda_workspace_allocator({&fake_allocate, &fake_release, nullptr});
  vidattn::set_cuda_workspace_allocator({nullptr, &fake_release, nullptr});
  EXPECT_EQ(vidattn::cuda_workspace_allocator().release, nullptr);
}

TEST(CudaWorkspace, ConcurrentInstallAndRead) {
  const RestoreDefault restore;
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t)
    threads.emplace_back([t] {
      for (int i = 0; i < 2000; ++i) {
        if ((i + t) % 2 == 0) {
          vidattn::set_cuda_workspace_allocator({&fake_allocate, &fake_release, nullptr});
        } else {
          // Never a mix of the two states: both functions, or neither.
          const auto a = vidattn::cuda_workspace_allocator();
          EXPECT_EQ(a.allocate == nullptr, a.release == nullptr);
          vidattn::set_cuda_workspace_allocator({});
        }
      }
    });
  for (auto& th : threads) th.join();
}

}  // namespace
