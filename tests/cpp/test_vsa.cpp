// The VSA C++ API: outputs written in full (NaN-poisoned before each call), the documented
// values of empty rows and padding, and clear exceptions for bad input.
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

TEST(VsaTiling, MetadataOfTruncatedTiles) {
  const auto layout = vidattn::describe_tiling({{5, 7, 9}}, {4, 4, 4});
  EXPECT_EQ(layout.num_tiles, 12);
  EXPECT_EQ(layout.padded_len(), 768);
  std::vector<std::int32_t> sizes(12, -7), s2t(768, -7), t2s(315, -7), cu_tiles(2), cu_tokens(2);
  vidattn::tiling_metadata(layout, make_view(sizes.data(), DType::kInt32, {12}),
                           make_view(s2t.data(), DType::kInt32, {768}),
                           make_view(t2s.data(), DType::kInt32, {315}),
                           make_view(cu_tiles.data(), DType::kInt32, {2}),
                           make_view(cu_tokens.data(), DType::kInt32, {2}));
  std::int64_t total = 0;
  for (std::int32_t s : sizes) total += s;
  EXPECT_EQ(total, 315);
  EXPECT_EQ(sizes[0], 64);   // full tile
  EXPECT_EQ(sizes[11], 3);   // 1 x 3 x 1 corner tile
  for (int token = 0; token < 315; ++token) EXPECT_EQ(s2t[t2s[token]], token);
  EXPECT_EQ(cu_tiles[1], 12);
  EXPECT_EQ(cu_tokens[1], 315);
}

TEST(VsaTiling, BadTileAndGrid) {
  EXPECT_THROW(vidattn::describe_tiling({{4, 4, 4}}, {3, 3, 3}), vidattn::ValueError);
  EXPECT_THROW(vidattn::describe_tiling({{4, 0, 4}}, {4, 4, 4}), vidattn::ValueError);
  EXPECT_THROW(vidattn::describe_tiling({}, {4, 4, 4}), vidattn::ValueError);
}

// Block-sparse forward and backward with count-0 tiles, a zero-size key tile, padded query
// slots and an unselected key tile; every output element must be written.
TEST(VsaBlockSparse, WritesEveryOutputAndDocumentedEmptyValues) {
  const std::int64_t V = 64, Qt = 3, Kt = 4, H = 2, D = 16, Sq = Qt * V, Sk = Kt * V;
  auto q = random_vector(Sq * H * D, 1), k = random_vector(Sk * H * D, 2),
       v = random_vector(Sk * H * D, 3), dout = random_vector(Sq * H * D, 4);
  // Head 0: tile 0 -> {0, 2}, tile 1 -> {} (count 0), tile 2 -> {1} (size 0).
  // Head 1: every tile -> {0}. Key tile 3 is never selected.
  std::vector<std::int32_t> index = {0, 2, -1, -1, 1, -1, 0, -1, 0, -1, 0, -1};
  std::vector<std::int32_t> count = {2, 0, 1, 1, 1, 1};
  std::vector<std::int32_t> q_sizes = {64, 10, 40}, kv_sizes = {30, 0, 64, 64};
  vidattn::BlockSparseOptions o;
  o.tile_volume = V;
  o.q_block_sizes = make_view(q_sizes.data(), DType::kInt32, {Qt});
  o.kv_block_sizes = make_view(kv_sizes.data(), DType::kInt32, {Kt});
  const auto qv = make_view(q.data(), DType::kFloat64, {1, Sq, H, D});
  const auto kv = make_view(k.data(), DType::kFloat64, {1, Sk, H, D});
  const auto vv = make_view(v.data(), DType::kFloat64, {1, Sk, H, D});
  const auto iv = make_view(index.data(), DType::kInt32, {1, H, Qt, 2});
  const auto cv = make_view(count.data(), DType::kInt32, {1, H, Qt});
  std::vector<double> out(Sq * H * D, kNaN), lse(H * Sq, kNaN);
  vidattn::block_sparse_attention_forward(qv, kv, vv, iv, cv,
                                          make_view(out.data(), DType::kFloat64, {1, Sq, H, D}),
                                          make_view(lse.data(), DType::kFloat64, {1, H, Sq}), o);
  for (double x : out) ASSERT_FALSE(std::isnan(x));
  for (double x : lse) ASSERT_FALSE(std::isnan(x));
  for (std::int64_t s = 0; s < Sq; ++s) {
    const std::int64_t tile = s / V, slot = s % V;
    const bool dead0 = tile != 0 || slot >= q_sizes[tile];  // head 0 sees keys only in tile 0
    const bool dead1 = slot >= q_sizes[tile];
    EXPECT_EQ(std::isinf(lse[0 * Sq + s]), dead0) << s;
    EXPECT_EQ(std::isinf(lse[1 * Sq + s]), dead1) << s;
    if (dead0)
      for (std::int64_t d = 0; d < D; ++d) EXPECT_EQ(out[(s * H + 0) * D + d], 0.0);
  }

  std::vector<std::int32_t> k2q_offsets(H * (Kt + 1), -7), k2q_index(H * Qt * 2, -7);
  vidattn::block_sparse_transpose_index(iv, cv, Kt,
                                        make_view(k2q_offsets.data(), DType::kInt32, {1, H, Kt + 1}),
                                        make_view(k2q_index.data(), DType::kInt32, {1, H, Qt * 2}));
  EXPECT_EQ(k2q_offsets, (std::vector<std::int32_t>{0, 1, 2, 3, 3, 0, 3, 3, 3, 3}));
  EXPECT_EQ(k2q_index, (std::vector<std::int32_t>{0, 2, 0, -1, -1, -1, 0, 1, 2, -1, -1, -1}));

  std::vector<double> dq(q.size(), kNaN), dk(k.size(), kNaN), dv(v.size(), kNaN);
  vidattn::block_sparse_attention_backward(
      qv, kv, vv, make_view(out.data(), DType::kFloat64, {1, Sq, H, D}),
      make_view(lse.data(), DType::kFloat64, {1, H, Sq}),
      make_view(dout.data(), DType::kFloat64, {1, Sq, H, D}), iv, cv,
      make_view(k2q_offsets.data(), DType::kInt32, {1, H, Kt + 1}),
      make_view(k2q_index.data(), DType::kInt32, {1, H, Qt * 2}),
      make_view(dq.data(), DType::kFloat64, {1, Sq, H, D}),
      make_view(dk.data(), DType::kFloat64, {1, Sk, H, D}),
      make_view(dv.data(), DType::kFloat64, {1, Sk, H, D}), o);
  for (auto* g : {&dq, &dk, &dv})
    for (double x : *g) ASSERT_FALSE(std::isnan(x));
  // Key tile 3 (never selected), tile 1 (size 0) and padded key slots: exactly zero.
  for (std::int64_t s = 0; s < Sk; ++s) {
    const std::int64_t tile = s / V, slot = s % V;
    if (tile == 3 || tile == 1 || slot >= kv_sizes[tile])
      for (std::int64_t i = 0; i < H * D; ++i) {
        EXPECT_EQ(dk[s * H * D + i], 0.0);
        EXPECT_EQ(dv[s * H * D + i], 0.0);
      }
  }
}

TEST(VsaBlockSparse, BadInputsThrow) {
  const std::int64_t V = 64;
  std::vector<float> q(2 * V * 1 * 8, 1.0f), out(q.size()), lse(2 * V);
  std::vector<std::int32_t> index = {0, 5}, count = {1, 1};
  const auto qv = make_view(q.data(), DType::kFloat32, {1, 2 * V, 1, 8});
  const auto ov = make_view(out.data(), DType::kFloat32, {1, 2 * V, 1, 8});
  const auto lv = make_view(lse.data(), DType::kFloat32, {1, 1, 2 * V});
  const auto iv = make_view(index.data(), DType::kInt32, {1, 1, 2, 1});
  const auto cv = make_view(count.data(), DType::kInt32, {1, 1, 2});
  vidattn::BlockSparseOptions o;
  EXPECT_THROW(vidattn::block_sparse_attention_forward(qv, qv, qv, iv, cv, ov, lv, o),
               vidattn::ValueError);  // tile 5 out of range
  index[1] = 1;
  EXPECT_NO_THROW(vidattn::block_sparse_attention_forward(qv, qv, qv, iv, cv, ov, lv, o));
  o.tile_volume = 100;
  EXPECT_THROW(vidattn::block_sparse_attention_forward(qv, qv, qv, iv, cv, ov, lv, o),
               vidattn::ValueError);
  o.tile_volume = 64;
  const auto iv_float = make_view(index.data(), DType::kFloat32, {1, 1, 2, 1});
  EXPECT_THROW(vidattn::block_sparse_attention_forward(qv, qv, qv, iv_float, cv, ov, lv, o),
               vidattn::TypeError);
  const auto q3 = make_view(q.data(), DType::kFloat32, {2 * V, 1, 8});
  EXPECT_THROW(vidattn::block_sparse_attention_forward(q3, qv, qv, iv, cv, ov, lv, o),
               vidattn::ValueError);
}

TEST(VsaPool, MeanOfValidSlotsAndBackward) {
  const std::int64_t V = 64;
  auto x = random_vector(2 * V * 3, 7);
  std::vector<std::int32_t> sizes = {5, 0};
  std::vector<double> pooled(2 * 3, kNaN), grad_x(x.size(), kNaN);
  vidattn::tile_mean_pool(make_view(x.data(), DType::kFloat64, {1, 2 * V, 1, 3}),
                          make_view(sizes.data(), DType::kInt32, {2}), V,
                          make_view(pooled.data(), DType::kFloat64, {1, 2, 1, 3}));
  for (int d = 0; d < 3; ++d) {
    double sum = 0;
    for (int s = 0; s < 5; ++s) sum += x[s * 3 + d];
    EXPECT_NEAR(pooled[d], sum / 5, 1e-15);
    EXPECT_EQ(pooled[3 + d], 0.0);  // size-0 tile
  }
  std::vector<double> g = {1, 2, 3, 4, 5, 6};
  vidattn::tile_mean_pool_backward(make_view(g.data(), DType::kFloat64, {1, 2, 1, 3}),
                                   make_view(sizes.data(), DType::kInt32, {2}), V,
                                   make_view(grad_x.data(), DType::kFloat64, {1, 2 * V, 1, 3}));
  for (std::int64_t s = 0; s < 2 * V; ++s)
    for (int d = 0; d < 3; ++d)
      EXPECT_DOUBLE_EQ(grad_x[s * 3 + d], s < 5 ? g[d] / 5 : 0.0);
  sizes[0] = 65;
  EXPECT_THROW(vidattn::tile_mean_pool(make_view(x.data(), DType::kFloat64, {1, 2 * V, 1, 3}),
                                       make_view(sizes.data(), DType::kInt32, {2}), V,
                                       make_view(pooled.data(), DType::kFloat64, {1, 2, 1, 3})),
               vidattn::ValueError);
}

TEST(VsaTopk, RulesAndSparsity) {
  const double inf = std::numeric_limits<double>::infinity();
  std::vector<double> scores = {1, 3, 3, 2, -inf, -inf, -inf, -inf};
  std::vector<std::int32_t> index(4, -7), count(2, -7);
  vidattn::topk_tiles_from_scores(make_view(scores.data(), DType::kFloat64, {1, 1, 2, 4}), 2,
                                  make_view(index.data(), DType::kInt32, {1, 1, 2, 2}),
                                  make_view(count.data(), DType::kInt32, {1, 1, 2}));
  EXPECT_EQ(index, (std::vector<std::int32_t>{1, 2, 0, 1}));
  EXPECT_EQ(count, (std::vector<std::int32_t>{2, 2}));
  EXPECT_EQ(vidattn::topk_from_sparsity(0.9, 624), 63);
  EXPECT_EQ(vidattn::topk_from_sparsity(0.8, 10), 2);
  EXPECT_THROW(vidattn::topk_from_sparsity(-0.1, 10), vidattn::ValueError);
  EXPECT_THROW(vidattn::topk_tiles_from_scores(make_view(scores.data(), DType::kFloat64, {1, 1, 2, 4}),
                                               0, make_view(index.data(), DType::kInt32, {1, 1, 2, 0}),
                                               make_view(count.data(), DType::kInt32, {1, 1, 2})),
               vidattn::ValueError);
}

}  // namespace
