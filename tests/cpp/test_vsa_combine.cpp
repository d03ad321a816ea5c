// The fused VSA combine through the C++ API: every output element written (NaN-poisoned
// before the call), padded slots pass the fine branch through, the backward's per-tile sums,
// and clear exceptions for bad input.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <vector>

#include "attention_test_util.h"
#include "vidattn/vidattn.h"

namespace {

using vidattn::DType;
using vidattn::make_view;

using vidattn_test::kNaN;
using vidattn_test::random_vector;

TEST(VsaCombine, ForwardAndBackwardWriteEveryElement) {
  const std::int64_t B = 2, T = 3, V = 64, H = 2, D = 8, S = T * V;
  const auto fine = random_vector(B * S * H * D, 1), coarse = random_vector(B * T * H * D, 2),
             gate = random_vector(B * S * H * D, 3), gout = random_vector(B * S * H * D, 4);
  std::vector<std::int32_t> sizes = {64, 0, 17};
  const auto fv = make_view(const_cast<double*>(fine.data()), DType::kFloat64, {B, S, H, D});
  const auto cv = make_view(const_cast<double*>(coarse.data()), DType::kFloat64, {B, T, H, D});
  const auto gv = make_view(const_cast<double*>(gate.data()), DType::kFloat64, {B, S, H, D});
  const auto sv = make_view(sizes.data(), DType::kInt32, {T});
  std::vector<double> out(fine.size(), kNaN);
  vidattn::vsa_combine(fv, cv, gv, sv, V, make_view(out.data(), DType::kFloat64, {B, S, H, D}));
  auto at = [&](std::int64_t b, std::int64_t s, std::int64_t h, std::int64_t d) {
    return ((b * S + s) * H + h) * D + d;
  };
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t s = 0; s < S; ++s)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t t = s / V, i = at(b, s, h, d);
          const bool valid = s % V < sizes[t];
          const double c = coarse[((b * T + t) * H + h) * D + d];
          const double want = fine[i] + (valid ? gate[i] * c : 0.0);
          ASSERT_NEAR(out[i], want, 1e-14) << b << " " << s << " " << h << " " << d;
        }

  std::vector<double> grad_coarse(coarse.size(), kNaN), grad_gate(gate.size(), kNaN);
  vidattn::vsa_combine_backward(
      make_view(const_cast<double*>(gout.data()), DType::kFloat64, {B, S, H, D}), cv, gv, sv, V,
      make_view(grad_coarse.data(), DType::kFloat64, {B, T, H, D}),
      make_view(grad_gate.data(), DType::kFloat64, {B, S, H, D}));
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t t = 0; t < T; ++t)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) {
          double sum = 0.0;
          for (std::int64_t v = 0; v < sizes[t]; ++v) {
            const std::int64_t i = at(b, t * V + v, h, d);
            sum += gout[i] * gate[i];
          }
          ASSERT_NEAR(grad_coarse[((b * T + t) * H + h) * D + d], sum, 1e-12);
          for (std::int64_t v = 0; v < V; ++v) {
            const std::int64_t i = at(b, t * V + v, h, d);
            const double want =
                v < sizes[t] ? gout[i] * coarse[((b * T + t) * H + h) * D + d] : 0.0;
            ASSERT_NEAR(grad_gate[i], want, 1e-14);
          }
        }
}

TEST(VsaCombine, BadArgumentsAreNamed) {
  std::vector<double> buf(2 * 64 * 2 * 8, 0.0), small(2 * 2 * 8, 0.0);
  std::vector<std::int32_t> sizes = {64, 64};
  const auto fv = make_view(buf.data(), DType::kFloat64, {1, 128, 2, 8});
  const auto cv = make_view(small.data(), DType::kFloat64, {1, 2, 2, 8});
  const auto sv = make_view(sizes.data(), DType::kInt32, {2});
  EXPECT_THROW(vidattn::vsa_combine(fv, cv, std::nullopt, sv, 32, fv), vidattn::ValueError);
  const auto bad_coarse = make_view(small.data(), DType::kFloat64, {1, 1, 2, 16});
  EXPECT_THROW(vidattn::vsa_combine(fv, bad_coarse, std::nullopt, sv, 64, fv),
               vidattn::ValueError);
  const auto f32 = make_view(buf.data(), DType::kFloat32, {1, 128, 2, 8});
  EXPECT_THROW(vidattn::vsa_combine(fv, cv, f32, sv, 64, fv), vidattn::TypeError);
  const auto grad_gate = make_view(buf.data(), DType::kFloat64, {1, 128, 2, 8});
  EXPECT_THROW(vidattn::vsa_combine_backward(fv, cv, std::nullopt, sv, 64, cv, grad_gate),
               vidattn::ValueError);
  try {
    std::vector<std::int32_t> too_big = {65, 64};
    vidattn::vsa_combine(fv, cv, std::nullopt, make_view(too_big.data(), DType::kInt32, {2}), 64,
                         fv);
    FAIL() << "block size 65 > tile volume 64 did not throw";
  } catch (const vidattn::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("block_sizes"), std::string::npos) << e.what();
  }
}

// The row mode on a run of raster rows that starts mid-video and ends past it (padding rows):
// every output element written, padding rows passed through, and the coarse gradient summed
// over exactly the tokens in the run.
TEST(VsaCombineRows, ForwardAndBackwardOnARunOfRows) {
  const auto layout = vidattn::describe_tiling({{3, 5, 6}}, {4, 4, 4});
  const std::int64_t tokens = layout.num_tokens, tiles = layout.num_tiles, V = 64;
  std::vector<std::int32_t> sizes(tiles), s2t(tiles * V), t2s(tokens), cu_tiles(2), cu_tokens(2);
  vidattn::tiling_metadata(layout, make_view(sizes.data(), DType::kInt32, {tiles}),
                           make_view(s2t.data(), DType::kInt32, {tiles * V}),
                           make_view(t2s.data(), DType::kInt32, {tokens}),
                           make_view(cu_tiles.data(), DType::kInt32, {2}),
                           make_view(cu_tokens.data(), DType::kInt32, {2}));
  const std::int64_t B = 2, H = 2, D = 8, first = 37, R = tokens - first + 3;
  const auto fine = random_vector(B * R * H * D, 5), gate = random_vector(B * R * H * D, 6),
             gout = random_vector(B * R * H * D, 7), coarse = random_vector(B * tiles * H * D, 8);
  const auto rows = [&](const std::vector<double>& x) {
    return make_view(const_cast<double*>(x.data()), DType::kFloat64, {B, R, H, D});
  };
  const auto cv = make_view(const_cast<double*>(coarse.data()), DType::kFloat64, {B, tiles, H, D});
  const auto t2s_view = make_view(t2s.data(), DType::kInt32, {tokens});
  const auto s2t_view = make_view(s2t.data(), DType::kInt32, {tiles * V});
  std::vector<double> out(fine.size(), kNaN), grad_coarse(coarse.size(), kNaN),
      grad_gate(gate.size(), kNaN);
  vidattn::vsa_combine_rows(rows(fine), cv, rows(gate), t2s_view, s2t_view, V, first, rows(out));
  vidattn::vsa_combine_rows_backward(
      rows(gout), cv, rows(gate), t2s_view, s2t_view, V, first,
      make_view(grad_coarse.data(), DType::kFloat64, {B, tiles, H, D}), rows(grad_gate));
  std::vector<double> want_dc(coarse.size(), 0.0);
  for (std::int64_t b = 0; b < B; ++b)
    for (std::int64_t r = 0; r < R; ++r)
      for (std::int64_t h = 0; h < H; ++h)
        for (std::int64_t d = 0; d < D; ++d) {
          const std::int64_t i = ((b * R + r) * H + h) * D + d, token = first + r;
          if (token >= tokens) {  // padding row
            ASSERT_EQ(out[i], fine[i]);
            ASSERT_EQ(grad_gate[i], 0.0);
            continue;
          }
          const std::int64_t c = ((b * tiles + t2s[token] / V) * H + h) * D + d;
          ASSERT_NEAR(out[i], fine[i] + gate[i] * coarse[c], 1e-14);
          ASSERT_NEAR(grad_gate[i], gout[i] * coarse[c], 1e-14);
          want_dc[c] += gout[i] * gate[i];
        }
  for (std::size_t i = 0; i < want_dc.size(); ++i) ASSERT_NEAR(grad_coarse[i], want_dc[i], 1e-12);

  // Inconsistent maps and a float32 coarse with float64 rows are named errors.
  std::vector<std::int32_t> bad = t2s;
  bad[5] = bad[6];
  EXPECT_THROW(vidattn::vsa_combine_rows(rows(fine), cv, rows(gate),
                                         make_view(bad.data(), DType::kInt32, {tokens}), s2t_view,
                                         V, first, rows(out)),
               vidattn::ValueError);
  std::vector<float> coarse32(coarse.size(), 0.f);
  EXPECT_THROW(vidattn::vsa_combine_rows(
                   rows(fine), make_view(coarse32.data(), DType::kFloat32, {B, tiles, H, D}),
                   rows(gate), t2s_view, s2t_view, V, first, rows(out)),
               vidattn::TypeError);
}

}  // namespace

namespace {

// vsa_fine_combine_forward on the CPU: the same bits as block_sparse_attention_forward followed
// by vsa_combine, every output written (NaN-poisoned before), and q_block_sizes required.
TEST(VsaFineCombine, EqualsTheTwoCallsAndNeedsBlockSizes) {
  const std::int64_t V = 64, H = 2, D = 8, Qt = 3, Kt = 2, S = Qt * V, Sk = Kt * V;
  const auto q = random_vector(S * H * D, 11), k = random_vector(Sk * H * D, 12),
             v = random_vector(Sk * H * D, 13), coarse = random_vector(Qt * H * D, 14),
             gate = random_vector(S * H * D, 15);
  std::vector<std::int32_t> index = {0, 1, 1, -1, 0, -1, 1, 0, 0, 1, 1, -1};
  std::vector<std::int32_t> count = {2, 1, 1, 1, 2, 1};
  // index rows must be ascending: row (h1, t0) = {1, 0} is rewritten to {0, 1}
  index[6] = 0, index[7] = 1;
  std::vector<std::int32_t> q_sizes = {64, 0, 30}, kv_sizes = {64, 5};
  auto view = [](const std::vector<double>& x, std::initializer_list<std::int64_t> shape) {
    return make_view(const_cast<double*>(x.data()), DType::kFloat64, shape);
  };
  const auto qv = view(q, {1, S, H, D}), kv = view(k, {1, Sk, H, D}), vv = view(v, {1, Sk, H, D});
  const auto cv = view(coarse, {1, Qt, H, D}), gv = view(gate, {1, S, H, D});
  const auto iv = make_view(index.data(), DType::kInt32, {1, H, Qt, 2});
  const auto nv = make_view(count.data(), DType::kInt32, {1, H, Qt});
  vidattn::BlockSparseOptions o;
  o.q_block_sizes = make_view(q_sizes.data(), DType::kInt32, {Qt});
  o.kv_block_sizes = make_view(kv_sizes.data(), DType::kInt32, {Kt});
  std::vector<double> fine(S * H * D, kNaN), lse(H * S, kNaN), out(S * H * D, kNaN);
  vidattn::vsa_fine_combine_forward(qv, kv, vv, iv, nv, cv, gv, view(fine, {1, S, H, D}),
                                    view(lse, {1, H, S}), view(out, {1, S, H, D}), o);
  std::vector<double> fine2(S * H * D, kNaN), lse2(H * S, kNaN), out2(S * H * D, kNaN);
  vidattn::block_sparse_attention_forward(qv, kv, vv, iv, nv, view(fine2, {1, S, H, D}),
                                          view(lse2, {1, H, S}), o);
  vidattn::vsa_combine(view(fine2, {1, S, H, D}), cv, gv, *o.q_block_sizes, V,
                       view(out2, {1, S, H, D}));
  for (std::size_t i = 0; i < out.size(); ++i) {
    ASSERT_FALSE(std::isnan(out[i])) << i;
    ASSERT_EQ(out[i], out2[i]) << i;
    ASSERT_EQ(fine[i], fine2[i]) << i;
  }
  for (std::size_t i = 0; i < lse.size(); ++i)
    ASSERT_TRUE(lse[i] == lse2[i] || (std::isinf(lse[i]) && std::isinf(lse2[i]))) << i;

  o.q_block_sizes.reset();
  try {
    vidattn::vsa_fine_combine_forward(qv, kv, vv, iv, nv, cv, gv, view(fine, {1, S, H, D}),
                                      view(lse, {1, H, S}), view(out, {1, S, H, D}), o);
    FAIL() << "no q_block_sizes did not throw";
  } catch (const vidattn::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("q_block_sizes"), std::string::npos) << e.what();
  }
}

}  // namespace
