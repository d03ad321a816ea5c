// Which named configuration (fwd_config.h) and which grid a problem runs on: the rules of the
// sm_90a forward's host side, with the measurements behind them. Host code; fwd_launch_impl.h
// applies them.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/common/check.h"
#include "fwd_config.h"
#include "fwd_params.h"
#include "fwd_traits.h"
#include "launch_utils.h"
#include "tile_scheduler.h"

namespace vidattn::cuda_sm90 {
namespace launch_detail {

template <class T, int D>
using DenseTraits = FwdTraits<CutlassElement<T>, dense(D)>;
template <class T, int D>
using DenseClusterTraits = FwdTraits<CutlassElement<T>, dense_cluster(D)>;
template <class T>
using Dense64WideTraits = FwdTraits<CutlassElement<T>, dense64_wide()>;
template <class T, int D>
using DenseShortTraits = FwdTraits<CutlassElement<T>, dense_short(D)>;
template <class T, int D>
using DenseOneBlockTraits = FwdTraits<CutlassElement<T>, dense_one_block(D)>;
template <class T, int D>
using Sparse128Traits = FwdTraits<CutlassElement<T>, sparse128(D)>;
template <class T, int D>
using Sparse64Traits = FwdTraits<CutlassElement<T>, sparse64(D)>;
template <class T, int D>
using Sparse64CombineTraits = FwdTraits<CutlassElement<T>, sparse64_combine(D)>;

// The same configuration with q / k D and v / out Dv wide, padded when kPadded (with_widths).
template <class Traits, int D, int Dv, bool kPadded>
using WithWidths =
    FwdTraits<typename Traits::Element, with_widths(Traits::kConfig, D, Dv, kPadded)>;

// The dense grid (the block-sparse kernels take stream items on a persistent grid instead):
// one CTA per tile for long key sequences, a persistent grid of (SMs - sm_margin) CTAs for
// short ones and when the caller leaves SMs free.
// * Past kPersistentMaxKeys keys: alone on the GPU the grids run level (32768 keys) or one CTA
//   per tile ahead through the CTA pairs (92160 x H40); beside other kernels (NCCL in
//   sequence parallelism) a persistent CTA that starts late, behind their blocks, still owns
//   its share of the tiles and the whole kernel waits for it, while one CTA per tile lets the
//   hardware hand the remaining tiles to whichever SM is free (docs/perf-history.md, Hopper v6).
// * Up to kPersistentMaxKeys keys: on one CTA per tile each CTA's start (barriers, Q and the
//   first K / V in flight) and end (the output store) overlap no other tile's products; on
//   the persistent grid the producer loads the next tile while the consumers finish this one
//   (+17% at 32760 x 512 keys, +25% at 257; perf-history, Hopper v23). With the output stored
//   by TMA and the tile set-up on the producer (Hopper v27-v37) it wins at longer keys too, also
//   against the CTA pairs: +5-20% at 1024-4096 keys, +1-4.5% at 6144-24576 (D = 128, D = 64,
//   causal), level at 20480 and 32768 keys and -1.5% at 92160 x H40 where the pairs' halved
//   L2 traffic counts (docs/perf-history.md, "The persistent grid up to 24576 keys").
// sm_margin always takes the persistent grid.
inline constexpr std::int64_t kPersistentMaxKeys = 24576;

// The persistent grid's CTAs: one per SM (of `sms`), less the SMs the caller leaves free.
inline int persistent_grid_ctas(const AttentionParams& a, int sms) {
  return std::max(1, sms - std::max(0, a.sm_margin));
}

inline bool dense_grid_persistent(const AttentionParams& a) {
  return a.sm_margin > 0 || a.seqlen_k <= kPersistentMaxKeys;
}

// Whether the dense problem runs in CTA pairs: the two tiles of a pair (consecutive slots of
// the one-CTA-per-tile grid, so not a persistent one) must belong to one head and visit the
// same key blocks, so: not causal, not varlen, no key mask, an even number of query blocks
// per head.
inline bool dense_cluster_fits(const AttentionParams& a, int block_m) {
  return !a.causal && !a.varlen && a.key_mask == nullptr &&
         !dense_grid_persistent(a) && ((a.seqlen_q + block_m - 1) / block_m) % 2 == 0;
}

// Traits::kSplitTail: the first tile whose three 64-row pieces run apart
// (last_round_split_from), never causal: its longest-first order already evens the CTAs out.
// The choice depends on the launch (tiles and SMs), so a tile's output bits can differ between
// launches of different sizes, as with any split of the key loop.
inline int split_tail_from(const AttentionParams& a, int tiles, int ctas) {
  if (a.causal) return tiles;
  return last_round_split_from(tiles, ctas);
}

// Query rows a tiling of block_m-row tiles puts on the busiest of `ctas` CTAs, a piece of a
// split last round counted as its 64 rows (at 2048 x 16 heads, 300 keys that choice, 192-row
// tiles with the split, ran level with the 128-row tiles it replaced; perf-history, Hopper v32).
inline std::int64_t rows_on_busiest_cta(const AttentionParams& a, std::int64_t block_m,
                                        bool split_tail, int ctas) {
  const std::int64_t tiles =
      std::int64_t{a.batch} * a.heads_q * ((a.seqlen_q + block_m - 1) / block_m);
  const std::int64_t from =
      split_tail ? split_tail_from(a, static_cast<int>(tiles), ctas) : tiles;
  const std::int64_t whole = (from + ctas - 1) / ctas * block_m;
  const std::int64_t pieces = SplitTail::pieces(static_cast<int>(tiles), static_cast<int>(from));
  return whole + (pieces + ctas - 1) / ctas * 64;
}

// Whether a dense D = 128 (or 96-wide) problem takes DenseShortTraits: at most
// kDenseShortMaxKeys keys, and its 192-row tiles put no more query rows on the busiest SM of
// the persistent grid than 128-row tiles would. A grid of few tiles leaves more of the larger
// tile's last wave idle (1 x 2048 x 16 heads, 300 keys: 176 tiles on 132 SMs, -14% on the
// 192-row tile).
template <class T, int D>
bool dense_short_fits(const AttentionParams& a) {
  if (a.seqlen_k > kDenseShortMaxKeys) return false;
  const int ctas = persistent_grid_ctas(a, cuda_common::current_sm_count());
  return rows_on_busiest_cta(a, DenseShortTraits<T, D>::kBlockM,
                             DenseShortTraits<T, D>::kSplitTail, ctas) <=
         rows_on_busiest_cta(a, DenseTraits<T, D>::kBlockM, DenseTraits<T, D>::kSplitTail,
                             ctas);
}

}  // namespace launch_detail
}  // namespace vidattn::cuda_sm90
