// Tile scheduler: CTA c takes slots c, c + gridDim.x, ... of the (query block, head, batch)
// tiles (the dense kernels; the block-sparse ones use StreamItems below). By default the grid
// has one CTA per tile (one slot each, handed out by the hardware as SMs free up, in slot
// order); with a persistent grid (at most one CTA per SM, see sm90_fwd_launch_impl.h) the
// slots run in rounds of gridDim.x.
//  * Non-causal (all tiles cost the same): query blocks vary fastest, so the CTAs running at
//    any moment work on the same few heads and share their K and V in L2.
//  * Causal (tile cost grows with the query block): tiles go longest first (query blocks
//    descending, then head and batch); on a persistent grid every other round is walked
//    backwards ("snake"), so each CTA's sum of tile lengths comes out within ~0.1% of the
//    mean at 16K tokens. The plain round-robin order left the busiest CTA with 1.67x the
//    mean work (a simulation of the 1 x 16K x 12-head case), which measured as 390 TFLOP/s
//    against 593 non-causal.
#pragma once

#include <cstdint>

namespace vidattn::cuda_sm90 {

struct TileCoord {
  int m_block, head, batch;
  bool valid;
};

struct TileScheduler {
  int num_m_blocks = 0;
  int heads = 0;
  int batch = 0;
  bool longest_first = false;  // causal
  // Slots run over whole rounds, [0, slots_end) with slots_end a multiple of the grid; set by
  // the host (set_grid) so the kernels read it from the parameter bank at each loop test
  // rather than keep it live across the key loop, where ptxas spilled it.
  int slots_end = 0;

  __host__ __device__ int total_tiles() const { return num_m_blocks * heads * batch; }
  __host__ void set_grid(int grid) {
    slots_end = grid > 0 ? (total_tiles() + grid - 1) / grid * grid : 0;
  }

  __device__ __forceinline__ TileCoord decode(int slot, int grid) const {
    TileCoord c;
    int tile = slot;
    int m, bh;
    if (longest_first) {
      const int round = slot / grid, lane = slot % grid;
      tile = round * grid + ((round & 1) ? grid - 1 - lane : lane);
      const int bhs = heads * batch;
      m = num_m_blocks - 1 - tile / bhs;
      bh = tile % bhs;
    } else {
      m = tile % num_m_blocks;
      bh = tile / num_m_blocks;
    }
    c.valid = tile < total_tiles();
    c.m_block = m;
    c.head = bh % heads;
    c.batch = bh / heads;
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
  int* counter = nullptr;  // zeroed before the launch
  // Streams per CTA x the device's SMs, counting those sm_margin leaves idle.
  int device_streams = 1;

  __host__ __device__ int total() const { return num_q_blocks * heads * batch; }
  // Where item `item` starts its walk over its n key blocks. Items start in order, one per
  // stream as streams free up, so item j starts ~j / device_streams of an item's time after
  // item 0. Starting it (j mod device_streams) / device_streams of the way along its list
  // puts every stream in flight at about the same place of its own list at any moment:
  // the lists are ascending, so the streams read the same few key tiles of a head at once
  // and share them in L2, instead of spreading over the whole head's K and V (47 MB at Wan
  // 720p, about L2's size). A function of the item and the device only, so results do not
  // depend on the schedule or on sm_margin (test_sm_margin_leaves_the_result_bit_identical).
  __device__ __forceinline__ int first_block(int item, int n) const {
    return static_cast<int>(static_cast<long long>(item % device_streams) * n / device_streams);
  }
  __device__ __forceinline__ TileCoord decode(int item) const {
    TileCoord c;
    c.m_block = item % num_q_blocks;
    const int bh = item / num_q_blocks;
    c.head = bh % heads;
    c.batch = bh / heads;
    c.valid = item < total();
    return c;
  }
  // The next item, or -1 when none is left (called by one thread per stream).
  __device__ __forceinline__ int take() const {
    const int item = atomicAdd(counter, 1);
    return item < total() ? item : -1;
  }
};

}  // namespace vidattn::cuda_sm90
