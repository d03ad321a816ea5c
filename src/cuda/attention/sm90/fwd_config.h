// The named configurations of the sm_90a forward, in one place: what each kernel instance is
// (tile, warpgroups, pipeline, schedule, features), and why. A configuration is a value of
// FwdConfig, passed to FwdTraits as a class-type template parameter, so an instance reads as
// `FwdTraits<Element, kDense128>` instead of a row of positional numbers. Which configuration
// runs a problem is decided in fwd_launch_impl.h (launch_dense_forward, launch_sparse_forward).
// The measurements behind each choice are in docs/perf-history.md under the version named
// (vNN: its "Hopper vNN" entry).
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

// How a key block's softmax meets the running row maxima (OnlineSoftmax, fwd_softmax.h).
enum class Speculation : std::uint8_t {
  // Reduce the block's max first, then exponentiate (one-block tiles: there is no earlier max).
  kNone,
  // Exponentiate against the rows' current bases while the previous block's P V runs, check
  // afterwards; a warp whose check fails redoes the block exactly. Needs a second P operand
  // (32 registers): two consumer warpgroups of 240 registers only.
  kOverlapped,
  // The same speculation, but after the previous block's P V is done, writing P straight into
  // its operand: the other warpgroups' products fill the tensor cores meanwhile.
  kAfterPV,
};

// A CTA holds one producer warpgroup and streams * wg_per_stream consumer warpgroups. A
// "stream" is a Q tile of 64 * wg_per_stream rows with its own K / V pipeline.
struct FwdConfig {
  int head_dim = 128;       // the tile width of q and k, and of v and out unless head_dim_v
  int head_dim_v = 0;       // the tile width of v and out; 0: head_dim
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
  // Three warpgroups over one block_n-key block per tile, for problems of at most block_n keys:
  // only that path is compiled (one S, softmax and P V; O not live through S and the softmax).
  bool one_block = false;
  // The tiles of a grid's last, partly filled round run as three 64-row pieces, each over
  // every third key block by all three warpgroups, combined in shared memory (SplitTail).
  bool split_tail = false;
  // Partial key tiles are loaded only up to their valid keys (fwd_prefix_loads.h).
  bool prefix_loads = false;
  // Stream items start their walks spread over their lists (StreamItems::first_block), so the
  // streams in flight read the same part of a head's K / V at once.
  bool rotated_walk = false;
  // The tile record's loop-steering values made warp-uniform (a shared-memory read is not
  // uniform to the compiler, which then guards the key loops' warp-collective instructions).
  bool uniform_control = true;
  // The consumers set a tile up from its record before its Q arrives (overlapping Q's load).
  bool early_tile_setup = false;
  Speculation speculation = Speculation::kOverlapped;
  // q / k (D) and v / out (Dv) have at most head_dim columns, given at run time
  // (AttentionParams::head_dim, head_dim_v): the TMA descriptors take the real widths, so
  // the loads fill the columns past them with zeros (which add nothing to Q K^T and give
  // zero columns of O) and the TMA store drops them; the threads' own stores skip them.
  // One instance per width serves every (D, Dv) up to it, at the cost of the zero columns'
  // products.
  bool padded_head_dim = false;

  constexpr int block_m() const { return 64 * wg_per_stream * streams; }
  constexpr int width_v() const { return head_dim_v > 0 ? head_dim_v : head_dim; }
};

// Dense: one 128-row stream of two warpgroups over 128-key blocks, two stages, output by TMA
// (short key loops spend a large share of each tile writing it). Runs D = 128 past
// kDenseShortMaxKeys keys when the CTA pairs do not fit, and causal key padding at both
// head dims. Longer key blocks were slower (v11).
constexpr FwdConfig dense(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 2, .streams = 1, .stages_k = 2,
          .stages_v = 2, .tma_store_o = true};
}

// Dense D = 128 in CTA pairs sharing every K / V load: under the H200's power cap, bytes out
// of L2 cost clock (v21). D = 64, bound by its softmax rather than power, lost 4% in pairs.
// Clusters of four fit only 120 of the H200's 132 SMs and ran 2-6% slower than pairs.
constexpr FwdConfig dense_cluster(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 2, .streams = 1, .stages_k = 2,
          .stages_v = 2, .cluster_m = 2};
}

// Dense D = 64: a 192-row stream of three warpgroups (160 registers each) at every key
// length. A warpgroup's softmax of a 64 x 128 block takes several times as long as its two
// products (a latency chain), so a third warpgroup fills the tensor cores' idle time (+10-13%
// at 8K-32K keys, v14; +8-22% at 512-6144 keys with the persistent grid and TMA store; v28).
constexpr FwdConfig dense64_wide() {
  return {.head_dim = 64, .block_n = 128, .wg_per_stream = 3, .streams = 1, .stages_k = 2,
          .stages_v = 2, .tma_store_o = true, .split_tail = true,
          .speculation = Speculation::kAfterPV};
}

// Dense D = 128 (and the 96-wide padded tile) with at most kDenseShortMaxKeys keys (cross
// attention to text or image tokens): three warpgroups over 64-key blocks. A partial last block
// costs less and a third warpgroup overlaps more of each short tile's start and end: +19-22% at
// 257 keys, flat at 512, -3% to -13% at 2048-4096 keys (v29). Its key loops spilled with
// uniform control (2-7% slower) and gain 2.5% from the early tile set-up at 77-128 keys, which
// cost 2-2.6% in the other kernels (v36, v37).
constexpr FwdConfig dense_short(int d) {
  return {.head_dim = d, .block_n = 64, .wg_per_stream = 3, .streams = 1, .stages_k = 2,
          .stages_v = 2, .tma_store_o = true, .split_tail = true, .uniform_control = false,
          .early_tile_setup = true, .speculation = Speculation::kAfterPV};
}
inline constexpr std::int64_t kDenseShortMaxKeys = 512;

// At most 128 keys (text tokens) on the three-warpgroup tile, compiled for one 128-key block
// per tile (FwdTraits::kOneBlock): one S, softmax and P V per tile. One K and one V slot, so
// shared memory stays no larger than the loop kernels' (more would shrink L1, where the
// three-warpgroup kernels' spills live; v30). D = 128: +6-13% over dense_short; D = 64:
// +4-8% at 77-128 keys over dense64_wide.
constexpr FwdConfig dense_one_block(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 3, .streams = 1, .stages_k = 1,
          .stages_v = 1, .tma_store_o = true, .one_block = true, .split_tail = true,
          .uniform_control = d == 64, .early_tile_setup = d > 64,
          .speculation = Speculation::kNone};
}

// Block-sparse with 128 / 256-token tiles: 128-key blocks (a 256-token tile is two), one
// 128-row stream of two warpgroups, stream items (+2-4% over a CTA per tile; v18).
constexpr FwdConfig sparse128(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 2, .streams = 1, .stages_k = 2,
          .stages_v = 2, .schedule = Schedule::kStreamItems};
}

// Block-sparse with 64-token tiles: two 64-row streams (one query tile each); each 128-key
// block is two selected key tiles loaded separately (one max, base and rescale per 128 keys,
// full-width products). One K and two V slots per stream: the shared memory of a 3 + 3 ring
// of 64-key slots. Stream items, since a tile's ~30 blocks make its start and end ~2% of the
// kernel, which one CTA per tile cannot overlap (v16).
// Prefix loads: -5% at Wan 480p; the 128 / 256-token kernel, moving half the bytes per FLOP,
// ran 0.3-0.7% slower with them (v20). Rotated walks: +3% at Wan 720p and HunyuanVideo for
// these 64-row streams (each loads its own K / V), -2-3% for the 128-row ones (v19).
constexpr FwdConfig sparse64(int d) {
  return {.head_dim = d, .block_n = 128, .wg_per_stream = 1, .streams = 2, .stages_k = 1,
          .stages_v = 2, .half_loads = true, .schedule = Schedule::kStreamItems,
          .prefix_loads = true, .rotated_walk = true};
}

// The same with VSA's combination fused in; an instance of its own, so that the two-pass
// kernel keeps its code.
constexpr FwdConfig sparse64_combine(int d) {
  FwdConfig c = sparse64(d);
  c.fused_combine = true;
  return c;
}

// Dense at head dims above 128 (D = 192 / Dv = 128, D = 256; padded instances): two
// warpgroups of 240 registers hold a 64 x 256 fp32 O (128 each) beside a 64 x 64 S, so 64-key
// blocks. Shared memory (227 KiB): at 256, Q (64 KiB) and two K and two V slots of 64 keys
// (4 x 32 KiB) leave no room for O's TMA staging (64 KiB), so the threads store O; at 192,
// Q, the slots and O's staging take 192 KiB. 128-key blocks need 240 KiB at 192 without O.
// The three-warpgroup tiles (160 registers) cannot hold O above 128.
// dv: v's and out's width when it is below d (D = 192 / Dv = 128: a third less P V work than
// the 192 tile; V slots and O's staging shrink with it).
constexpr FwdConfig dense_wide(int d, int dv = 0) {
  return {.head_dim = d, .head_dim_v = dv, .block_n = 64, .wg_per_stream = 2, .streams = 1,
          .stages_k = 2, .stages_v = 2, .tma_store_o = d <= 192, .padded_head_dim = true};
}

// `c`, a configuration of the wider of the two widths, with q / k `d` and v / out `dv` wide,
// as a padded instance (FwdConfig::padded_head_dim) or not: D = 128 / Dv = 64 and
// D = 64 / Dv = 128 run the tiles, blocks and warpgroups of D = 128, since their O
// accumulator (Dv) or S product (D) is that of D = 128, with the products of the narrower
// width a half shorter.
constexpr FwdConfig with_widths(FwdConfig c, int d, int dv, bool padded) {
  c.head_dim = d;
  c.head_dim_v = dv == d ? 0 : dv;
  c.padded_head_dim = padded;
  return c;
}

}  // namespace vidattn::cuda_sm90
