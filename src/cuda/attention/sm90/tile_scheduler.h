// Tile scheduler: CTA c takes slots c, c + gridDim.x, ... of the (query block, head, batch)
// tiles (the dense kernels; the block-sparse ones use StreamItems below). By default the grid
// has one CTA per tile (one slot each, handed out by the hardware as SMs free up, in slot
// order); with a persistent grid (at most one CTA per SM, see fwd_launch_impl.h) the
// slots run in rounds of gridDim.x.
//  * Non-causal (all tiles cost the same): query blocks vary fastest, so the CTAs running at
//    any moment work on the same few heads and share their K and V in L2.
//  * Causal (tile cost grows with the query block): tiles go longest first (query blocks
//    descending, then head and batch); on a persistent grid every other round is walked
//    backwards ("snake"), so each CTA's sum of tile lengths comes out within ~0.1% of the
//    mean at 16K tokens. The plain round-robin order left the busiest CTA with 1.67x the
//    mean work (a simulation of the 1 x 16K x 12-head case), which measured as 390 TFLOP/s
//    against 593 non-causal.
//  * Tiles are decoded with divisions precomputed on the host (cutlass::FastDivmod: a
//    multiply-high and a shift): each consumer decodes every tile it takes, between two
//    tiles, and four signed integer divisions there cost ~100 instructions per warp and 8%
//    of the warp stalls of a short key loop (docs/perf-history.md, Hopper v31).
#pragma once

#include <algorithm>
#include <cstdint>

#include <cutlass/fast_math.h>

namespace vidattn::cuda_sm90 {

struct TileCoord {
  int m_block, head, batch;
  bool valid;
  int piece = -1;  // SplitTail::decode: which 64-row third of a split tile, or -1 (whole tile)
};

// The first tile of the last round of `tiles` tiles on `ctas` CTAs when that round should run
// split into three pieces per tile (SplitTail), else `tiles`. A round of r < ctas whole tiles
// keeps ctas - r CTAs idle for a tile's time. Its 3 r pieces take about half a tile's time
// each (a third of the key blocks, without the overlap of one warpgroup's softmax with its
// own products, and the combination): a gain only when every CTA runs at most one piece,
// 3 r <= ctas (two pieces in a row measured no faster than the whole tile; docs/perf-history.md,
// Hopper v32).
__host__ inline int last_round_split_from(int tiles, int ctas) {
  const int tail = tiles % ctas;
  return tail > 0 && 3 * tail <= ctas ? tiles - tail : tiles;
}

struct TileScheduler {
  int num_m_blocks = 0;
  int heads = 0;
  int batch = 0;
  bool longest_first = false;  // causal
  // Slots run over whole rounds, [0, slots_end) with slots_end a multiple of the grid; set by
  // the host (set_grid) so the kernels read it from the parameter bank at each loop test
  // rather than keep it live across the key loop, where ptxas spilled it.
  int slots_end = 0;
  // Division by num_m_blocks, heads, heads * batch and the grid (set_shape, set_grid).
  cutlass::FastDivmod by_m_blocks, by_heads, by_heads_batch, by_grid;

  __host__ __device__ int total_tiles() const { return num_m_blocks * heads * batch; }
  __host__ void set_shape(int m_blocks, int heads_, int batch_, bool causal) {
    num_m_blocks = m_blocks, heads = heads_, batch = batch_, longest_first = causal;
    by_m_blocks = cutlass::FastDivmod(std::max(m_blocks, 1));
    by_heads = cutlass::FastDivmod(std::max(heads_, 1));
    by_heads_batch = cutlass::FastDivmod(std::max(heads_ * batch_, 1));
  }
  // `grid`: the CTAs the kernel is launched with (decode walks rounds of that many slots);
  // `slots`: the slots to hand out (SplitTail::slots when tiles are split).
  __host__ void set_grid(int grid, int slots) {
    slots_end = grid > 0 ? (slots + grid - 1) / grid * grid : 0;
    by_grid = cutlass::FastDivmod(std::max(grid, 1));
  }

  __host__ __device__ __forceinline__ TileCoord decode(int slot) const {
    TileCoord c;
    int tile = slot;
    int m, bh;
    if (longest_first) {
      int round, lane;
      by_grid(round, lane, slot);
      const int grid = by_grid.divisor;
      tile = round * grid + ((round & 1) ? grid - 1 - lane : lane);
      int from_last;
      by_heads_batch(from_last, bh, tile);
      m = num_m_blocks - 1 - from_last;
    } else {
      by_m_blocks(bh, m, tile);
    }
    c.valid = tile < total_tiles();
    c.m_block = m;
    by_heads(c.batch, c.head, bh);
    return c;
  }
};

// A split last round (Traits::kSplitTail): tiles [from, total) of a TileScheduler run as three
// 64-row pieces each, slots from + 3 j .. from + 3 j + 2 for tile from + j, so that a CTA's
// pieces come after all its whole tiles. Not with longest_first (decode walks tiles in plain
// order). Kept apart from TileScheduler, whose layout the other kernels' parameters share.
struct SplitTail {
  int from = 0;  // the first split tile; the scheduler's total_tiles() when none is

  // Three 64-row pieces for each tile from `from` on.
  __host__ __device__ static constexpr int pieces(int tiles, int from) { return 3 * (tiles - from); }
  __host__ __device__ int slots(const TileScheduler& s) const {
    return from + pieces(s.total_tiles(), from);
  }
  __host__ __device__ __forceinline__ TileCoord decode(const TileScheduler& s, int slot) const {
    // No tile split (from == total, always so for causal): the scheduler's own order. Its
    // snake walks the last round's slots past the tiles too, where they land on whole tiles
    // (1 x 260 causal tiles on 132 CTAs: slots 260-263 are tiles 135-132), not on pieces.
    if (slot < from || from >= s.total_tiles()) return s.decode(slot);
    const int j = slot - from;
    const int tile = from + j / 3;  // a constant divisor: a multiply-high
    TileCoord c = s.decode(tile);
    c.piece = j - 3 * (j / 3);
    return c;
  }
};

// Stream items (FwdTraits::kStreamItems): every stream of every CTA of a persistent grid
// takes its next query tile of kBlockMStream rows from one global counter, in item order:
// query tiles fastest, then head and batch, so the tiles in flight share their heads' K and
// V in L2 as with one CTA per tile. Taking tiles as streams free up keeps that window
// narrow, which a persistent grid's fixed slots do not: at Wan 720p (47 MB of K and V per
// head) CTAs that drift apart over 218 rounds cost 4%; and a CTA that starts late (NCCL
// holding its SM) simply takes fewer tiles.
struct StreamItems {
  int num_q_blocks = 0;  // query tiles of kBlockMStream rows per (head, batch)
  int heads = 0;
  int batch = 0;
  cutlass::FastDivmod by_q_blocks, by_heads;  // set_shape
  int* counter = nullptr;  // zeroed before the launch
  // Streams per CTA x the device's SMs, counting those sm_margin leaves idle.
  int device_streams = 1;

  __host__ __device__ int total() const { return num_q_blocks * heads * batch; }
  __host__ void set_shape(int q_blocks, int heads_, int batch_) {
    num_q_blocks = q_blocks, heads = heads_, batch = batch_;
    by_q_blocks = cutlass::FastDivmod(std::max(q_blocks, 1));
    by_heads = cutlass::FastDivmod(std::max(heads_, 1));
  }
  // Where item `item` starts its walk over its n key blocks. Items start in order, one per
  // stream as streams free up; once the streams no longer run in lock step, item j starts
  // ~j / device_streams of an item's time after item 0. Starting it (j mod device_streams) /
  // device_streams of the way along its list then puts every stream in flight at about the
  // same place of its own ascending list at any moment, so the streams read the same key
  // tiles of a head at once and share them in L2 (Wan 720p, ncu: L2 hit rate 89% against 70%
  // with every walk from block 0; 7-9% faster than that and 2-3% faster than starts spread
  // over half of each list: docs/perf-history.md, "The 64-token kernel's walk, list length and
  // L2 reuse"). A function of the item and the device only, so results do not depend on the
  // schedule or on sm_margin (test_sm_margin_leaves_the_result_bit_identical).
  __device__ __forceinline__ int first_block(int item, int n) const {
    return static_cast<int>(static_cast<long long>(item % device_streams) * n / device_streams);
  }
  __host__ __device__ __forceinline__ TileCoord decode(int item) const {
    TileCoord c;
    int bh;
    by_q_blocks(bh, c.m_block, item);
    by_heads(c.batch, c.head, bh);
    c.valid = item < total();
    return c;
  }
#ifdef __CUDACC__  // device only (tests/cpp/test_sm90_tile_scheduler.cpp reads the rest on the host)
  // The next item, or -1 when none is left (called by one thread per stream).
  __device__ __forceinline__ int take() const {
    const int item = atomicAdd(counter, 1);
    return item < total() ? item : -1;
  }
#endif
};

}  // namespace vidattn::cuda_sm90
