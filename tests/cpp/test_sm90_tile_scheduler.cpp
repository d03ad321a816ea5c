// The sm_90a tile schedulers' decode (src/cuda/attention/sm90/tile_scheduler.h), run on the host:
// the divisions precomputed by set_shape / set_grid (cutlass::FastDivmod) must give the order
// the kernels document, i.e. what plain division gives, and every tile exactly once. (The
// kernels' results are checked on a GPU: tests/python/test_attention_sm90.py.)
#include <gtest/gtest.h>

#if VIDATTN_TESTS_SM90_SCHEDULER
#include <cuda_runtime.h>  // __host__ / __device__ for a host compiler

#include <tuple>
#include <vector>

#include "cuda/attention/sm90/tile_scheduler.h"

namespace {

using vidattn::cuda_sm90::SplitTail;
using vidattn::cuda_sm90::StreamItems;
using vidattn::cuda_sm90::TileCoord;
using vidattn::cuda_sm90::TileScheduler;

// The documented order with plain division: query blocks fastest, then head, then batch;
// causal: longest first (query blocks descending) with every other round of `grid` slots
// walked backwards.
TileCoord expected(int slot, int grid, int m_blocks, int heads, int batch, bool causal) {
  TileCoord c;
  int tile = slot, m, bh;
  if (causal) {
    const int round = slot / grid, lane = slot % grid;
    tile = round * grid + ((round & 1) ? grid - 1 - lane : lane);
    m = m_blocks - 1 - tile / (heads * batch);
    bh = tile % (heads * batch);
  } else {
    m = tile % m_blocks;
    bh = tile / m_blocks;
  }
  c.valid = tile < m_blocks * heads * batch;
  c.m_block = m;
  c.head = bh % heads;
  c.batch = bh / heads;
  return c;
}

TEST(Sm90TileScheduler, DecodeMatchesPlainDivisionAndCoversEveryTileOnce) {
  // (query blocks, heads, batch, grid): grids of one CTA per tile and persistent ones,
  // powers of two and not, one of everything.
  const std::vector<std::tuple<int, int, int, int>> shapes = {
      {1, 1, 1, 1},     {7, 3, 2, 42},    {171, 12, 1, 132}, {256, 12, 1, 132},
      {11, 16, 4, 132}, {64, 40, 1, 131}, {5, 1, 3, 15},     {33, 24, 2, 100},
      {2, 2, 2, 1},     {720, 40, 1, 132}};
  for (const auto& [m_blocks, heads, batch, grid_hint] : shapes) {
    for (const bool causal : {false, true}) {
      TileScheduler s;
      s.set_shape(m_blocks, heads, batch, causal);
      const int tiles = s.total_tiles();
      const int grid = grid_hint < tiles ? grid_hint : tiles;
      s.set_grid(grid, tiles);
      ASSERT_EQ(s.slots_end % grid, 0);
      ASSERT_GE(s.slots_end, tiles);
      std::vector<int> seen(tiles, 0);
      for (int slot = 0; slot < s.slots_end; ++slot) {
        const TileCoord got = s.decode(slot);
        const TileCoord want = expected(slot, grid, m_blocks, heads, batch, causal);
        ASSERT_EQ(got.valid, want.valid) << "slot " << slot;
        if (!want.valid) continue;
        ASSERT_EQ(got.m_block, want.m_block) << "slot " << slot;
        ASSERT_EQ(got.head, want.head) << "slot " << slot;
        ASSERT_EQ(got.batch, want.batch) << "slot " << slot;
        ASSERT_TRUE(got.m_block >= 0 && got.m_block < m_blocks && got.head >= 0 &&
                    got.head < heads && got.batch >= 0 && got.batch < batch);
        ++seen[(got.batch * heads + got.head) * m_blocks + got.m_block];
      }
      for (int t = 0; t < tiles; ++t)
        ASSERT_EQ(seen[t], 1) << "tile " << t << " of " << m_blocks << "x" << heads << "x"
                              << batch << (causal ? " causal" : "");
    }
  }
}

// A split last round (Traits::kSplitTail, SplitTail): slots before `from` decode as whole
// tiles, the rest as pieces 0, 1, 2 of the tiles from `from` on; every whole tile and every piece of
// a split tile exactly once, the split tiles starting a round.
TEST(Sm90TileScheduler, SplitLastRoundCoversEveryPieceOnce) {
  using vidattn::cuda_sm90::last_round_split_from;
  EXPECT_EQ(last_round_split_from(704, 132), 660);    // 44 tiles left: 132 pieces, one each
  EXPECT_EQ(last_round_split_from(2052, 132), 2052);  // 72 left: 216 pieces, two on some CTAs
  EXPECT_EQ(last_round_split_from(1056, 132), 1056);  // whole rounds
  EXPECT_EQ(last_round_split_from(40, 132), 0);       // one short round: every tile split
  EXPECT_EQ(last_round_split_from(45, 132), 45);
  EXPECT_EQ(last_round_split_from(5, 2), 5);  // too few CTAs to gain
  EXPECT_EQ(last_round_split_from(1, 3), 0);
  const std::vector<std::tuple<int, int, int, int>> shapes = {
      {11, 16, 4, 132}, {171, 12, 1, 132}, {2, 20, 1, 132}, {3, 5, 2, 7}, {1, 1, 1, 132},
      {2, 73, 1, 132}};
  for (const auto& [m_blocks, heads, batch, ctas] : shapes) {
    TileScheduler s;
    s.set_shape(m_blocks, heads, batch, false);
    const int tiles = s.total_tiles();
    const int from = last_round_split_from(tiles, ctas);
    ASSERT_TRUE(from == tiles || from % ctas == 0);  // none split, or whole rounds before
    ASSERT_LE(3 * (tiles - from), ctas);            // at most one piece per CTA
    const SplitTail split{from};
    const int slots = split.slots(s);
    ASSERT_EQ(slots, from + 3 * (tiles - from));
    const int grid = slots < ctas ? slots : ctas;
    s.set_grid(grid, slots);
    ASSERT_GE(s.slots_end, slots);
    std::vector<int> whole(tiles, 0), pieces(3 * tiles, 0);
    for (int slot = 0; slot < s.slots_end; ++slot) {
      const TileCoord got = split.decode(s, slot);
      ASSERT_EQ(got.valid, slot < slots) << "slot " << slot;
      if (!got.valid) continue;
      const int tile = (got.batch * heads + got.head) * m_blocks + got.m_block;
      if (slot < from) {
        const TileCoord want = expected(slot, grid, m_blocks, heads, batch, false);
        ASSERT_EQ(got.piece, -1);
        ASSERT_EQ(tile, (want.batch * heads + want.head) * m_blocks + want.m_block);
        ++whole[tile];
      } else {
        ASSERT_EQ(tile, from + (slot - from) / 3) << "slot " << slot;
        ASSERT_EQ(got.piece, (slot - from) % 3) << "slot " << slot;
        ++pieces[3 * tile + got.piece];
      }
    }
    for (int t = 0; t < tiles; ++t) {
      ASSERT_EQ(whole[t], t < from ? 1 : 0) << "tile " << t;
      for (int piece = 0; piece < 3; ++piece)
        ASSERT_EQ(pieces[3 * t + piece], t < from ? 0 : 1) << "tile " << t << " piece " << piece;
    }
  }
}

// A kSplitTail kernel that splits nothing (from == tiles: causal always, or a last round too
// full to gain) must walk the scheduler's own order, the causal snake included: on a
// persistent grid its last round's slots past the tiles are whole tiles, not pieces (decoding
// them as pieces loaded Q by an unset TMA descriptor: an illegal instruction on the GPU).
TEST(Sm90TileScheduler, UnsplitTailKeepsTheSchedulersOrder) {
  // (query blocks, heads, batch, grid): 260 = 2 x 130 causal tiles on 132 CTAs, the case
  // that failed (varlen: 5 sequences x 26 heads x 2 tiles); others of partial last rounds.
  const std::vector<std::tuple<int, int, int, int>> shapes = {
      {2, 26, 5, 132}, {2, 130, 1, 132}, {3, 7, 2, 10}, {2, 66, 2, 132}, {1, 1, 1, 1}};
  for (const auto& [m_blocks, heads, batch, grid_hint] : shapes) {
    for (const bool causal : {false, true}) {
      TileScheduler s;
      s.set_shape(m_blocks, heads, batch, causal);
      const int tiles = s.total_tiles();
      const SplitTail split{tiles};
      ASSERT_EQ(split.slots(s), tiles);
      const int grid = grid_hint < tiles ? grid_hint : tiles;
      s.set_grid(grid, tiles);
      std::vector<int> seen(tiles, 0);
      for (int slot = 0; slot < s.slots_end; ++slot) {
        const TileCoord got = split.decode(s, slot);
        const TileCoord want = s.decode(slot);
        ASSERT_EQ(got.valid, want.valid) << "slot " << slot;
        if (!want.valid) continue;
        ASSERT_EQ(got.piece, -1) << "slot " << slot;
        ASSERT_EQ(std::make_tuple(got.m_block, got.head, got.batch),
                  std::make_tuple(want.m_block, want.head, want.batch))
            << "slot " << slot;
        ++seen[(got.batch * heads + got.head) * m_blocks + got.m_block];
      }
      for (int t = 0; t < tiles; ++t)
        ASSERT_EQ(seen[t], 1) << "tile " << t << " of " << m_blocks << "x" << heads << "x"
                              << batch << (causal ? " causal" : "");
    }
  }
}

TEST(Sm90StreamItems, DecodeMatchesPlainDivision) {
  for (const auto& [q_blocks, heads, batch] :
       std::vector<std::tuple<int, int, int>>{{624, 12, 1}, {1, 1, 1}, {1440, 40, 2},
                                              {17, 3, 5}, {2048, 24, 1}}) {
    StreamItems items;
    items.set_shape(q_blocks, heads, batch);
    for (int item = 0; item <= items.total(); ++item) {
      const TileCoord c = items.decode(item);
      ASSERT_EQ(c.valid, item < items.total());
      if (!c.valid) continue;
      ASSERT_EQ(c.m_block, item % q_blocks);
      ASSERT_EQ(c.head, item / q_blocks % heads);
      ASSERT_EQ(c.batch, item / q_blocks / heads);
    }
  }
}

// Large counts: the precomputed division holds for every dividend below 2^31.
TEST(Sm90StreamItems, DecodeHoldsForLargeItems) {
  StreamItems items;
  items.set_shape(46341, 46340, 1);  // ~2^31 items
  for (const int item : {0, 1, 46340, 46341, 46342, 1 << 30, 2147395599, 2147395600}) {
    const TileCoord c = items.decode(item);
    if (!c.valid) continue;
    ASSERT_EQ(c.m_block, item % 46341) << item;
    ASSERT_EQ(c.head, item / 46341 % 46340) << item;
    ASSERT_EQ(c.batch, 0) << item;
  }
}

}  // namespace

#else
TEST(Sm90TileScheduler, NeedsTheCudaAndCutlassHeaders) {
  GTEST_SKIP() << "built without CUDA sources or CUTLASS headers";
}
#endif
