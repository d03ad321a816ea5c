// Device-side parameters of the sm_90a forward kernel: the problem, the TMA descriptors
// (passed by value as a __grid_constant__ kernel parameter) and the tile schedule.
#pragma once

#include <cstdint>
#include <type_traits>

#include "fwd_params.h"
#include "fwd_prefix_loads.h"
#include "fwd_traits.h"
#include "tile_scheduler.h"

namespace vidattn::cuda_sm90 {

template <class Traits>
struct FwdKernelParams {
  AttentionParams attn;
  SparseKeyListArgs sparse;
  typename Traits::TmaQ tma_q;
  typename Traits::TmaKV tma_k;
  typename Traits::TmaV tma_v;
  // Extents of the TMA views (rows, heads, batch): batched (S, H, B); varlen (T, H, 1).
  int q_rows = 0, kv_rows = 0, tma_batch = 0;
  TileScheduler sched;
  StreamItems items;          // Traits::kStreamItems only
  CombineArgs combine;        // Traits::kFusedCombine only
  std::conditional_t<Traits::kPrefixLoads, PrefixLoadMaps, NoPrefixLoadMaps> prefix;
  // Traits::kTmaStoreO: the output's store descriptor (a varlen sequence's last rows are
  // stored by the threads themselves).
  struct NoTmaO {};
  std::conditional_t<Traits::kTmaStoreO, typename Traits::TmaO, NoTmaO> tma_o;
  // Traits::kSplitTail: which tiles run as 64-row pieces, and the pieces' Q load (last, so that
  // the other kernels keep their parameter layout).
  struct NoSplitTail {};
  std::conditional_t<Traits::kSplitTail, SplitTail, NoSplitTail> split;
  struct NoQPiece {};
  std::conditional_t<Traits::kSplitTail, typename Traits::TmaQPiece, NoQPiece> tma_q_piece;
  // Always 0; ptxas cannot know it. A Traits::kSpeculativeSoftmax key loop of an odd number
  // of steps moves its P back into the first P V operand with `| zero`: with a plain copy
  // ptxas forwards the source registers into the product, registers written while the previous
  // product runs, and serialises every wgmma of the kernel (C7513).
  std::uint32_t zero = 0;
};

}  // namespace vidattn::cuda_sm90
