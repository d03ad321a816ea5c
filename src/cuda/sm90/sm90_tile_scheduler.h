// Persistent tile scheduler: a grid of at most one CTA per SM walks the (query block, head,
// batch) tiles with a stride of gridDim.x. Query blocks vary fastest, so the CTAs running at
// any moment work on the same few heads and share their K and V in L2 (one head of a 32K
// sequence at D = 128 is 16 MB of K and V). Causal problems walk the query blocks backwards:
// the longest rows start first and the short ones fill the tail.
#pragma once

#include <cstdint>

namespace vidattn::cuda_sm90 {

struct TileCoord {
  int m_block, head, batch;
};

struct TileScheduler {
  int num_m_blocks = 0;
  int heads = 0;
  int batch = 0;
  bool reverse_m = false;

  __host__ __device__ int total_tiles() const { return num_m_blocks * heads * batch; }

  __device__ __forceinline__ TileCoord decode(int tile) const {
    TileCoord c;
    const int m = tile % num_m_blocks;
    const int bh = tile / num_m_blocks;
    c.m_block = reverse_m ? num_m_blocks - 1 - m : m;
    c.head = bh % heads;
    c.batch = bh / heads;
    return c;
  }
};

}  // namespace vidattn::cuda_sm90
