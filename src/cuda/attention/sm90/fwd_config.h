// The named configurations of the sm_90a forward, in one place: what each kernel instance is
// (tile, warpgroups, pipeline, schedule, features), and why. A configuration is a value of
// FwdConfig, passed to FwdTraits as a class-type template parameter, so an instance reads as
// `FwdTraits<Element, kDense128>` instead of a row of positional numbers. Which configuration
// runs a problem is decided in fwd_launch_impl.h (launch_dense_forward, launch_sparse_forward).
// The measurements behind each choice are in docs/perf-history.md under the version named.
#pragma once

#include <cstdint>

namespace vidattn::cuda_sm90 {

// How a kernel's CTAs find their work.
enum class Schedule : std::uint8_t {
  // A CTA per query tile (or, for short dense key loops, a persistent grid over the same
  // slots: see kPersistentMaxKeys).
  kTiles,
  // A persistent grid whose streams take their query tiles one at a time from a global counter
  // (StreamItems, tile_scheduler.h): a stream's next Q and first K / V load while it finishes
  // a tile.
  kStreamItems,
};

// A CTA holds one producer warpgroup and streams * wg_per_stream consumer warpgroups. A
// "stream" is a Q tile of 64 * wg_per_stream rows with its own K / V pipeline.
struct FwdConfig {
  int head_dim = 128;
  int block_n = 128;        // keys per K / V block
  int wg_per_stream = 2;    // consumer warpgroups (64 query rows each) sharing a stream's K / V
  int streams = 1;          // streams per CTA
  int stages_k = 2;         // ring slots of K blocks
  int stages_v = 2;         // ring slots of V blocks
  // Each block_n-key block is filled by two TMA loads of block_n / 2 rows from independent
  // places (two 64-token key tiles), so the consumers run full-width products on them.
  bool half_loads = false;
  Schedule schedule = Schedule::kTiles;
  // With stream items and one warpgroup per stream: a spare producer warp per stream applies
  // VSA's combination to each finished tile while the stream computes the next one.
  bool fused_combine = false;
  // CTAs of a cluster of this many run query tiles of one head side by side, each TMA-loading
  // 1 / cluster_m of every K / V block into all of them (multicast): L2 sends a block once per
  // cluster.
  int cluster_m = 1;
  // Each warpgroup writes its 64 output rows to shared memory (stmatrix) and one thread stores
  // them by TMA, instead of 16-byte stores from every thread.
  bool tma_store_o = false;

  constexpr int block_m() const { return 64 * wg_per_stream * streams; }
};

// Dense: one 128-row stream of two warpgroups over 128-key blocks, two stages, output by TMA
// (short key loops spend a large share of each tile writing it). Runs D = 128 past
// kDense128ShortMaxKeys keys when the CTA pairs do not fit, and causal key padding at both
// head dims. Longer key blocks were slower (perf-history, Hopper v11).
constexpr FwdConfig dense(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 2, .streams = 1, .stages_k = 2,
          .stages_v = 2, .tma_store_o = true};
}

// Dense D = 128 in CTA pairs sharing every K / V load: under the H200's power cap, bytes out
// of L2 cost clock (perf-history, Hopper v21). D = 64, bound by its softmax rather than power, lost 4% in pairs.
// Clusters of four fit only 120 of the H200's 132 SMs and ran 2-6% slower than pairs.
constexpr FwdConfig dense_cluster(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 2, .streams = 1, .stages_k = 2,
          .stages_v = 2, .cluster_m = 2};
}

// Dense D = 64: a 192-row stream of three warpgroups (160 registers each) at every key
// length. A warpgroup's softmax of a 64 x 128 block takes several times as long as its two
// products (a latency chain), so a third warpgroup fills the tensor cores' idle time (+10-13%
// at 8K-32K keys, v14; +8-22% at 512-6144 keys with the persistent grid and TMA store; perf-history, Hopper v28).
constexpr FwdConfig dense64_wide() {
  return {.head_dim = 64, .block_n = 128, .wg_per_stream = 3, .streams = 1, .stages_k = 2,
          .stages_v = 2, .tma_store_o = true};
}

// Dense D = 128 with at most kDense128ShortMaxKeys keys (cross attention to text or image
// tokens): three warpgroups over 64-key blocks. A partial last block costs less and a third
// warpgroup overlaps more of each short tile's start and end: +19-22% at 257 keys, flat at
// 512, -3% to -13% at 2048-4096 keys (perf-history, Hopper v29).
constexpr FwdConfig dense128_short() {
  return {.head_dim = 128, .block_n = 64, .wg_per_stream = 3, .streams = 1, .stages_k = 2,
          .stages_v = 2, .tma_store_o = true};
}
inline constexpr std::int64_t kDense128ShortMaxKeys = 512;

// At most 128 keys (text tokens) on the three-warpgroup tile, compiled for one 128-key block
// per tile (FwdTraits::kOneBlock): one S, softmax and P V per tile. One K and one V slot, so
// shared memory stays no larger than the loop kernels' (more would shrink L1, where the
// three-warpgroup kernels' spills live; perf-history, Hopper v30). D = 128: +6-13% over dense128_short; D = 64:
// +4-8% at 77-128 keys over dense64_wide.
constexpr FwdConfig dense_one_block(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 3, .streams = 1, .stages_k = 1,
          .stages_v = 1, .tma_store_o = true};
}

// Block-sparse with 128 / 256-token tiles: 128-key blocks (a 256-token tile is two), one
// 128-row stream of two warpgroups, stream items (+2-4% over a CTA per tile; perf-history, Hopper v18).
constexpr FwdConfig sparse128(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 2, .streams = 1, .stages_k = 2,
          .stages_v = 2, .schedule = Schedule::kStreamItems};
}

// Block-sparse with 64-token tiles: two 64-row streams (one query tile each); each 128-key
// block is two selected key tiles loaded separately (one max, base and rescale per 128 keys,
// full-width products). One K and two V slots per stream: the shared memory of a 3 + 3 ring
// of 64-key slots. Stream items, since a tile's ~30 blocks make its start and end ~2% of the
// kernel, which one CTA per tile cannot overlap (perf-history, Hopper v16).
constexpr FwdConfig sparse64(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 1, .streams = 2, .stages_k = 1,
          .stages_v = 2, .half_loads = true, .schedule = Schedule::kStreamItems};
}

// The same with VSA's combination fused in; an instance of its own, so that the two-pass
// kernel keeps its code.
constexpr FwdConfig sparse64_combine(int d) {
  FwdConfig c = sparse64(d);
  c.fused_combine = true;
  return c;
}

}  // namespace vidattn::cuda_sm90
