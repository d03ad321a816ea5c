// The head-dim rules of the CUDA dispatch (src/cuda/dispatch/head_dims.h), run on the host for
// every (D, Dv) the CUDA kernels take: the instance chosen must be at least as wide as each of
// the problem's dims (a narrower one would drop columns: a silent wrong answer), exact only
// where D = Dv is its width, one that the generators write, and the smallest such. (The
// kernels themselves are checked on a GPU: tests/python/test_head_dims_cuda.py.)
#include <gtest/gtest.h>

#if VIDATTN_TESTS_SM90_SCHEDULER  // the CUDA runtime's headers (cuda_bf16.h) are found
#include <cstdint>
#include <set>
#include <tuple>
#include <type_traits>

#include "cuda/dispatch/head_dims.h"

namespace {

using vidattn::DType;
namespace dispatch = vidattn::cuda_dispatch;

constexpr int kWidths80[] = {64, 96, 128, 192, 256};

struct Choice {
  int width = 0, width_v = 0;
  bool padded = false;
  int calls = 0;
};

Choice sm80_choice(std::int64_t d, std::int64_t dv) {
  Choice c;
  dispatch::dispatch_sm80_head_dims(DType::kBFloat16, d, dv, [&](auto, auto w, auto padded) {
    c.width = c.width_v = decltype(w)::value;
    c.padded = decltype(padded)::value;
    ++c.calls;
  });
  return c;
}

Choice sm90_choice(std::int64_t d, std::int64_t dv, DType dtype = DType::kBFloat16) {
  Choice c;
  dispatch::dispatch_sm90_dense_forward_head_dims(dtype, d, dv,
                                                  [&](auto, auto w, auto padded, auto wv) {
                                                    c.width = decltype(w)::value;
                                                    c.width_v = decltype(wv)::value;
                                                    c.padded = decltype(padded)::value;
                                                    ++c.calls;
                                                  });
  return c;
}

TEST(HeadDimsDispatch, TakesMultiplesOfEightUpTo256Only) {
  for (std::int64_t d : {0, 4, 12, 63, 257, 264, -8})
    EXPECT_FALSE(dispatch::sm80_head_dims_supported(d, 64)) << d;
  for (std::int64_t d = 8; d <= 256; d += 8)
    EXPECT_TRUE(dispatch::sm80_head_dims_supported(d, 256 - d + 8)) << d;
}

TEST(HeadDimsDispatch, PortableInstanceIsTheSmallestWidthThatHoldsBoth) {
  for (std::int64_t d = 8; d <= 256; d += 8) {
    for (std::int64_t dv = 8; dv <= 256; dv += 8) {
      const Choice c = sm80_choice(d, dv);
      const std::int64_t m = d > dv ? d : dv;
      ASSERT_EQ(c.calls, 1) << d << ", " << dv;
      EXPECT_GE(c.width, m) << d << ", " << dv;
      int smallest = 0;
      for (int w : kWidths80)
        if (w >= m) { smallest = w; break; }
      EXPECT_EQ(c.width, smallest) << d << ", " << dv;
      EXPECT_EQ(c.padded, !(d == dv && (d == 64 || d == 128))) << d << ", " << dv;
    }
  }
}

TEST(HeadDimsDispatch, HopperForwardTakesEveryPairPast64WithAGeneratedInstance) {
  // (width, width of v, padded): what tools/codegen/gen_sm90_instances.py writes for the
  // dense forward.
  const std::set<std::tuple<int, int, bool>> generated = {
      {64, 64, false}, {128, 128, false}, {96, 96, true}, {128, 128, true},
      {128, 64, true}, {64, 128, true},
      {192, 192, true}, {192, 128, true}, {256, 256, true}};
  for (std::int64_t d = 8; d <= 256; d += 8) {
    for (std::int64_t dv = 8; dv <= 256; dv += 8) {
      const std::int64_t m = d > dv ? d : dv;
      const bool exact = d == dv && (d == 64 || d == 128);
      EXPECT_EQ(dispatch::sm90_exact_head_dims(d, dv), exact) << d << ", " << dv;
      const bool admitted = dispatch::sm90_dense_forward_head_dims(d, dv);
      EXPECT_EQ(admitted, exact || m > 64) << d << ", " << dv;
      if (!admitted) continue;
      for (DType dtype : {DType::kBFloat16, DType::kFloat16}) {
        const Choice c = sm90_choice(d, dv, dtype);
        ASSERT_EQ(c.calls, 1) << d << ", " << dv;
        EXPECT_GE(c.width, d) << d << ", " << dv;
        EXPECT_GE(c.width_v, dv) << d << ", " << dv;
        EXPECT_EQ(c.padded, !exact) << d << ", " << dv;
        EXPECT_TRUE(generated.count({c.width, c.width_v, c.padded}))
            << d << ", " << dv << " -> " << c.width << " / " << c.width_v;
        // The smallest generated instance that holds both dims (the 96-wide one only for
        // multiples of 16).
        const bool width96 = d % 16 == 0 && dv % 16 == 0;
        if (c.width == 96 || c.width_v == 96) EXPECT_TRUE(width96) << d << ", " << dv;
        for (const auto& [w, wv, padded] : generated)
          if (padded == c.padded && w >= d && wv >= dv && (width96 || (w != 96 && wv != 96)))
            EXPECT_GE(w + wv, c.width + c.width_v) << d << ", " << dv;
      }
    }
  }
}

}  // namespace
#endif
