// vidattn::apply_rope through the torch-free API: every output element written (NaN-poisoned,
// strided outputs), values against a float64 reference, the transposed map as the adjoint,
// and clear errors for bad arguments.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "vidattn/vidattn.h"

namespace {

using vidattn::DType;
using vidattn::TensorView;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

template <class T>
constexpr DType dtype_of() {
  return std::is_same_v<T, double> ? DType::kFloat64 : DType::kFloat32;
}

// A [B, S, H, D] view over `storage` whose rows are `row_pad` elements longer than D.
template <class T>
TensorView bshd_view(std::vector<T>& storage, std::int64_t b, std::int64_t s, std::int64_t h,
                     std::int64_t d, std::int64_t row_pad = 0) {
  const std::int64_t row = d + row_pad;
  storage.assign(b * s * h * row, T(kNaN));
  TensorView v = vidattn::make_view(storage.data(), dtype_of<T>(), {b, s, h, d});
  v.stride[2] = row, v.stride[1] = h * row, v.stride[0] = s * h * row;
  return v;
}

template <class T>
T& at(const TensorView& v, std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t j) {
  return static_cast<T*>(v.data)[b * v.stride[0] + s * v.stride[1] + h * v.stride[2] + j];
}

struct Tables {
  std::vector<double> cos, sin;  // [S, width]
  std::int64_t width;
};

Tables make_tables(std::int64_t s, std::int64_t width, std::mt19937& rng) {
  std::uniform_real_distribution<double> angle(-3.2, 3.2);
  Tables t{std::vector<double>(s * width), std::vector<double>(s * width), width};
  for (std::int64_t i = 0; i < s * width; ++i) {
    const double a = angle(rng);
    t.cos[i] = std::cos(a), t.sin[i] = std::sin(a);
  }
  return t;
}

// The documented formula in float64.
double reference(const std::vector<double>& x, const Tables& t, std::int64_t s, std::int64_t h,
                 std::int64_t d, std::int64_t j, bool interleaved, bool transpose,
                 std::int64_t heads) {
  const std::int64_t half = d / 2;
  const bool first = interleaved ? j % 2 == 0 : j < half;
  const std::int64_t pair = interleaved ? j / 2 : j % half;
  const std::int64_t a = interleaved ? 2 * pair : pair, b = interleaved ? a + 1 : pair + half;
  auto tab = [&](const std::vector<double>& v, std::int64_t col) {
    return v[s * t.width + (t.width == half ? pair : col)];
  };
  auto xv = [&](std::int64_t col) { return x[(s * heads + h) * d + col]; };
  if (!transpose)
    return first ? xv(a) * tab(t.cos, a) - xv(b) * tab(t.sin, a)
                 : xv(b) * tab(t.cos, b) + xv(a) * tab(t.sin, b);
  return first ? xv(a) * tab(t.cos, a) + xv(b) * tab(t.sin, b)
               : xv(b) * tab(t.cos, b) - xv(a) * tab(t.sin, a);
}

template <class T>
void check_against_reference(bool interleaved, bool half_table, bool transpose) {
  std::mt19937 rng(1234 + interleaved * 4 + half_table * 2 + transpose);
  const std::int64_t B = 1, S = 13, H = 3, D = 10;  // odd S, H; D/2 odd
  std::normal_distribution<double> normal(0.0, 4.0);
  std::vector<double> x64(S * H * D);
  for (double& v : x64) v = normal(rng);
  std::vector<T> x_storage, out_storage;
  TensorView x = bshd_view(x_storage, B, S, H, D, /*row_pad=*/3);
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t h = 0; h < H; ++h)
      for (std::int64_t j = 0; j < D; ++j) at<T>(x, 0, s, h, j) = T(x64[(s * H + h) * D + j]);
  for (double& v : x64) v = double(T(v));  // the reference sees the stored inputs
  const Tables tables = make_tables(S, half_table ? D / 2 : D, rng);
  std::vector<T> cos(tables.cos.begin(), tables.cos.end()), sin(tables.sin.begin(), tables.sin.end());
  TensorView cos_v = vidattn::make_view(cos.data(), dtype_of<T>(), {S, tables.width});
  TensorView sin_v = vidattn::make_view(sin.data(), dtype_of<T>(), {S, tables.width});
  Tables stored{std::vector<double>(cos.begin(), cos.end()),
                std::vector<double>(sin.begin(), sin.end()), tables.width};
  TensorView out = bshd_view(out_storage, B, S, H, D, /*row_pad=*/5);  // NaN everywhere

  vidattn::RopeOptions options;
  options.interleaved = interleaved;
  options.transpose = transpose;
  options.num_threads = 2;
  vidattn::apply_rope(x, cos_v, sin_v, out, options);

  // float32: a few ulps (2^-23) of the largest |x| (about 16 at sigma 4).
  const double tolerance = std::is_same_v<T, double> ? 1e-13 : 16 * std::ldexp(1.0, -23) * 16;
  std::int64_t written = 0;
  for (std::int64_t s = 0; s < S; ++s)
    for (std::int64_t h = 0; h < H; ++h) {
      for (std::int64_t j = 0; j < D; ++j) {
        const double got = at<T>(out, 0, s, h, j);
        ASSERT_FALSE(std::isnan(got)) << "element not written: s " << s << " h " << h << " j " << j;
        const double want = reference(x64, stored, s, h, D, j, interleaved, transpose, H);
        EXPECT_NEAR(got, want, tolerance) << "s " << s << " h " << h << " j " << j;
        ++written;
      }
      // The padding after each row is not the kernel's to write.
      for (std::int64_t j = D; j < D + 5; ++j) EXPECT_TRUE(std::isnan(at<T>(out, 0, s, h, j)));
    }
  EXPECT_EQ(written, S * H * D);
}

TEST(Rope, MatchesReferenceFloat64) {
  for (bool interleaved : {true, false})
    for (bool half_table : {true, false})
      for (bool transpose : {false, true}) check_against_reference<double>(interleaved, half_table, transpose);
}

TEST(Rope, MatchesReferenceFloat32) {
  for (bool interleaved : {true, false})
    for (bool half_table : {true, false})
      for (bool transpose : {false, true}) check_against_reference<float>(interleaved, half_table, transpose);
}

// <R x, y> == <x, R^T y> for full-width tables whose pair members differ (not a rotation).
TEST(Rope, TransposeIsTheAdjoint) {
  std::mt19937 rng(99);
  const std::int64_t S = 7, H = 2, D = 8;
  std::normal_distribution<double> normal;
  std::vector<double> x(S * H * D), y(S * H * D), rx(S * H * D), rty(S * H * D);
  for (double& v : x) v = normal(rng);
  for (double& v : y) v = normal(rng);
  Tables t = make_tables(S, D, rng);
  for (bool interleaved : {true, false}) {
    vidattn::RopeOptions o;
    o.interleaved = interleaved;
    auto cos = vidattn::make_view(t.cos.data(), DType::kFloat64, {S, D});
    auto sin = vidattn::make_view(t.sin.data(), DType::kFloat64, {S, D});
    vidattn::apply_rope(vidattn::make_view(x.data(), DType::kFloat64, {1, S, H, D}), cos, sin,
                        vidattn::make_view(rx.data(), DType::kFloat64, {1, S, H, D}), o);
    o.transpose = true;
    vidattn::apply_rope(vidattn::make_view(y.data(), DType::kFloat64, {1, S, H, D}), cos, sin,
                        vidattn::make_view(rty.data(), DType::kFloat64, {1, S, H, D}), o);
    double lhs = 0, rhs = 0;
    for (std::size_t i = 0; i < x.size(); ++i) lhs += rx[i] * y[i], rhs += x[i] * rty[i];
    EXPECT_NEAR(lhs, rhs, 1e-12 * (std::fabs(lhs) + 1));
  }
}

TEST(Rope, EmptyInputsWriteNothing) {
  std::vector<float> table(5 * 4);
  auto cos = vidattn::make_view(table.data(), DType::kFloat32, {5, 4});
  auto x = vidattn::make_view(nullptr, DType::kFloat32, {0, 5, 2, 8});
  EXPECT_NO_THROW(vidattn::apply_rope(x, cos, cos, x, {}));
}

TEST(Rope, BadArgumentsAreNamed) {
  std::vector<float> xs(2 * 5 * 3 * 8), outs(xs.size()), table(5 * 8);
  auto x = vidattn::make_view(xs.data(), DType::kFloat32, {2, 5, 3, 8});
  auto out = vidattn::make_view(outs.data(), DType::kFloat32, {2, 5, 3, 8});
  auto cos = vidattn::make_view(table.data(), DType::kFloat32, {5, 4});
  auto expect_message = [](auto&& call, const char* fragment, bool type_error = false) {
    try {
      call();
      ADD_FAILURE() << "no exception; expected one mentioning " << fragment;
    } catch (const vidattn::TypeError& e) {
      EXPECT_TRUE(type_error) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    } catch (const vidattn::ValueError& e) {
      EXPECT_FALSE(type_error) << e.what();
      EXPECT_NE(std::string(e.what()).find(fragment), std::string::npos) << e.what();
    }
  };
  expect_message([&] {
    auto odd = vidattn::make_view(xs.data(), DType::kFloat32, {2, 5, 4, 5});
    vidattn::apply_rope(odd, cos, cos, odd, {});
  }, "must be even");
  expect_message([&] {
    auto bad = vidattn::make_view(table.data(), DType::kFloat32, {4, 4});
    vidattn::apply_rope(x, bad, bad, out, {});
  }, "argument 'cos' must be [S, D] = [5, 8] or [S, D/2] = [5, 4]");
  expect_message([&] {
    auto wide = vidattn::make_view(table.data(), DType::kFloat32, {5, 8});
    vidattn::apply_rope(x, cos, wide, out, {});
  }, "argument 'sin' must have the shape of cos");
  expect_message([&] {
    auto d = vidattn::make_view(table.data(), DType::kFloat64, {5, 2});
    vidattn::apply_rope(x, cos, d, out, {});
  }, "argument 'sin' must have dtype float32", true);
  expect_message([&] {
    auto i = vidattn::make_view(xs.data(), DType::kInt32, {2, 5, 3, 8});
    vidattn::apply_rope(i, cos, cos, out, {});
  }, "argument 'x' must be float32", true);
  expect_message([&] {
    auto small = vidattn::make_view(outs.data(), DType::kFloat32, {2, 5, 2, 8});
    vidattn::apply_rope(x, cos, cos, small, {});
  }, "argument 'out' must have the shape of x");
  expect_message([&] {
    auto d = vidattn::make_view(outs.data(), DType::kFloat64, {2, 5, 3, 4});
    vidattn::apply_rope(x, cos, cos, d, {});
  }, "argument 'out' must have dtype float32", true);
  expect_message([&] {
    auto strided = x;
    strided.stride[3] = 2;
    vidattn::apply_rope(strided, cos, cos, out, {});
  }, "unit stride");
  expect_message([&] {
    auto null = vidattn::make_view(nullptr, DType::kFloat32, {2, 5, 3, 8});
    vidattn::apply_rope(null, cos, cos, out, {});
  }, "argument 'x' has no data pointer");
  auto on_gpu = [](TensorView v) {
    v.device = {vidattn::DeviceKind::kCUDA, 0};
    return v;
  };
  expect_message([&] { vidattn::apply_rope(x, on_gpu(cos), on_gpu(cos), out, {}); },
                 "argument 'cos' must be on cpu like x, got cuda:0");
#if !VIDATTN_TESTS_WITH_CUDA
  // Only a build without CUDA can say so: with CUDA these host pointers would reach a kernel.
  EXPECT_THROW(vidattn::apply_rope(on_gpu(x), on_gpu(cos), on_gpu(cos), on_gpu(out), {}),
               vidattn::NotImplementedError);
#endif
}

}  // namespace
