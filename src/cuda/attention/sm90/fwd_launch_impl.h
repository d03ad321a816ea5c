// Host side of the sm_90a forward: TMA descriptors over the [rows, D, heads, batch] views,
// the persistent grid, the launch. Included only by the generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdlib>
#include <string_view>
#include <type_traits>

#include "../../core/backends.h"
#include "../device_workspace.h"
#include "../sm80/launch.h"
#include "sm90_dispatch.h"
#include "sm90_fwd_kernel.h"
#include "sm90_fwd_launch.h"

namespace vidattn::cuda_sm90 {

namespace launch_detail {

template <class T>
using CutlassElement =
    std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cutlass::bfloat16_t, cutlass::half_t>;

// Dense: one 128-row stream of two warpgroups, 128-key blocks, two stages: D = 128 past 512
// keys (Dense128ShortTraits below) and causal key padding at both head dims.
// Longer blocks (192 at D = 64; 144 to 176 at D = 128 with the extended wgmma shapes) were
// slower once the unmasked blocks ran without mask code (docs/perf-notes.md, Hopper v11).
// Output by TMA from shared memory (32 KB at D = 128): short key loops spend a large share of
// each tile writing it.
template <class T, int D>
using DenseTraits = FwdTraits<CutlassElement<T>, D, 128, 2, 1, 2, 2, false, false, false, 1, true>;
// Dense D = 128 in CTA pairs sharing every K / V load (TMA multicast): L2 sends each block
// once per two query tiles. Under the H200's power cap, moving bytes out of L2 costs clock
// (docs/perf-notes.md, Hopper v21). D = 64 on the 192-row tile, whose softmax rather than
// power limits it, lost 4% at 2 x 16384 x 32 in pairs and stays on single CTAs.
template <class T, int D>
using DenseClusterTraits =
    FwdTraits<CutlassElement<T>, D, 128, 2, 1, 2, 2, false, false, false, 2>;
// D = 64: a 192-row stream of three warpgroups (160 registers each), at every key length
// (at most 128 keys: the same tile compiled for one key block, DenseOneBlockTraits).
// At D = 64 a warpgroup's softmax of a 64 x 128 block takes several times as long as its two
// products (a latency chain, not a full pipe: ncu shows MUFU ~47% and issue ~42% busy), so
// two warpgroups leave the tensor cores idle half the time; a third fills more of it
// (+10-13% at 8K-32K keys, v14). Short key loops kept the 128-row tile until the persistent
// grid (v23) and the TMA output store (v27) came; with both the 192-row tile gains 8-22% from
// 512 to 6144 keys (docs/perf-notes.md, Hopper v28). D = 128's output accumulator and
// 128-key scores do not fit three warpgroups' registers (v14: spills, slower); with 64-key
// blocks they do, which pays only for short key loops (Dense128ShortTraits).
template <class T>
using Dense64WideTraits =
    FwdTraits<CutlassElement<T>, 64, 128, 3, 1, 2, 2, false, false, false, 1, true>;
// Dense D = 128 with at most kDense128ShortMaxKeys keys (cross attention to text or image
// tokens): a 192-row stream of three warpgroups over 64-key blocks. A partial last block
// costs less (257 keys are 320 keys of work instead of 384) and a third warpgroup overlaps
// more of each short tile's start and end: +19-22% at 257 keys, flat at 512, but -3% to -13%
// at 2048-4096 keys (docs/perf-notes.md, Hopper v29). dense128_short_fits decides.
template <class T>
using Dense128ShortTraits =
    FwdTraits<CutlassElement<T>, 128, 64, 3, 1, 2, 2, false, false, false, 1, true>;
inline constexpr std::int64_t kDense128ShortMaxKeys = 512;
// Problems of at most 128 keys (text tokens) that the three-warpgroup tiles take (D = 64
// always, D = 128 where dense128_short_fits): the same tile and warpgroups compiled for one
// 128-key block per tile (FwdTraits::kOneBlock). One K and one V slot: a tile's single block
// frees its K with Q (the next tile's loads start then), and the shared memory stays no larger
// than the loop kernels' (more would shrink L1, where the three-warpgroup kernels' spills
// live: perf-notes, v30). D = 128: one S, softmax and P V per tile instead of Dense128Short's
// two, +6-13%; D = 64: 6 local accesses in the kernel against Dense64Wide's 72, +4-8% at
// 77-128 keys (docs/perf-notes.md, Hopper).
template <class T, int D>
using DenseOneBlockTraits =
    FwdTraits<CutlassElement<T>, D, 128, 3, 1, 1, 1, false, false, false, 1, true>;
// Block-sparse with 128 / 256-token tiles: 128-key blocks (a 256 tile is two), one 128-row
// stream of two warpgroups, on a persistent grid of stream items as the 64-token kernel
// (+2-4% over one CTA per tile at the Wan and HunyuanVideo shapes; perf-notes, Hopper v18).
template <class T, int D>
using Sparse128Traits = FwdTraits<CutlassElement<T>, D, 128, 2, 1, 2, 2, false, true>;
// Block-sparse with 64-token tiles: two 64-row streams (one query tile each); each 128-key
// block is two selected key tiles, loaded separately (one max, exponent base and rescale per
// 128 keys, full-width products, as in the dense kernel). One K slot and two V slots per
// stream: the same shared memory as a 3 + 3 ring of 64-key slots. A persistent grid whose
// streams take query tiles from a counter (stream items): a stream's next Q and first K / V
// load while it finishes a tile, which one CTA per tile cannot overlap (~30 blocks per tile
// here, so that start and end are ~2% of the kernel; docs/perf-notes.md, Hopper v16).
template <class T, int D>
using Sparse64Traits = FwdTraits<CutlassElement<T>, D, 128, 1, 2, 1, 2, true, true>;
// The same with VSA's combination applied by the producer warpgroup's spare warps
// (sm90_fwd_combine.h); an instance of its own, so that the two-pass kernel keeps its code.
template <class T, int D>
using Sparse64CombineTraits = FwdTraits<CutlassElement<T>, D, 128, 1, 2, 1, 2, true, true, true>;

// The (rows, D, heads, batch) view TMA reads. Strides of extent-1 dimensions never matter to
// the addresses; they are replaced by packed values so that the descriptor's 16-byte stride
// rule holds for any view.
template <class Traits>
typename Traits::GmemTensor gmem_view(const void* ptr, std::int64_t rows, int heads, int batch,
                                      const RowStrides& st) {
  using namespace cute;
  constexpr int D = Traits::kHeadDim;
  const std::int64_t head = heads > 1 ? st.head : D;
  const std::int64_t row = rows > 1 ? st.row : head * heads;
  const std::int64_t bat = batch > 1 ? st.batch : row * rows;
  auto layout = make_layout(
      make_shape(static_cast<int32_t>(rows), Int<D>{}, static_cast<int32_t>(heads),
                 static_cast<int32_t>(batch)),
      make_stride(row, _1{}, head, bat));
  return make_tensor(make_gmem_ptr(static_cast<typename Traits::Element const*>(ptr)), layout);
}

// VIDATTN_SM90_PINGPONG=0 turns the warpgroup ping-pong off (for measuring it; read once).
inline bool pingpong_enabled() {
  static const bool on = env_switch_on("VIDATTN_SM90_PINGPONG");
  return on;
}

// VIDATTN_SM90_RESCALE_SLACK=<log2 units> (read once): OnlineSoftmax::slack; default 8,
// negative for the textbook online softmax (for measuring it).
inline float rescale_slack() {
  static const float slack = [] {
    const char* v = std::getenv("VIDATTN_SM90_RESCALE_SLACK");
    return v != nullptr ? std::strtof(v, nullptr) : 8.f;
  }();
  return slack;
}

// VIDATTN_SM90_TMA_STORE_O=0 keeps the dense output on the threads' own stores (for measuring
// the TMA store; read once).
inline bool tma_store_o_enabled() {
  static const bool on = env_switch_on("VIDATTN_SM90_TMA_STORE_O");
  return on;
}

// VIDATTN_SM90_WALK_SPREAD=<n> (read once; for measuring): the stream items' walks start
// spread over 1 / n of their lists (StreamItems::first_block); 0: all at their first block.
// The default, 1, was best at Wan 720p and HunyuanVideo by 2-9% (docs/perf-notes.md,
// "The 64-token kernel's walk, list length and L2 reuse").
inline int walk_spread() {
  static const int spread = [] {
    const char* v = std::getenv("VIDATTN_SM90_WALK_SPREAD");
    return v != nullptr ? std::max(0, std::atoi(v)) : 1;
  }();
  return spread;
}

// The dense grid (the block-sparse kernels take stream items on a persistent grid instead):
// one CTA per tile for long key sequences, a persistent grid of (SMs - sm_margin) CTAs for
// short ones and when the caller leaves SMs free.
// * Past kPersistentMaxKeys keys: alone on the GPU the grids run level (32768 keys) or one CTA
//   per tile ahead through the CTA pairs (92160 x H40); beside other kernels (NCCL in
//   sequence parallelism) a persistent CTA that starts late, behind their blocks, still owns
//   its share of the tiles and the whole kernel waits for it, while one CTA per tile lets the
//   hardware hand the remaining tiles to whichever SM is free (docs/perf-notes.md, v6).
// * Up to kPersistentMaxKeys keys: on one CTA per tile each CTA's start (barriers, Q and the
//   first K / V in flight) and end (the output store) overlap no other tile's products; on
//   the persistent grid the producer loads the next tile while the consumers finish this one
//   (+17% at 32760 x 512 keys, +25% at 257; v23). Since the output went through a TMA store
//   and the tile set-up moved to the producer (v27-v37) this wins at longer keys too, also
//   against the CTA pairs: +5-20% at 1024-4096 keys, +1-4.5% at 6144-24576 (D = 128, D = 64,
//   causal), level at 20480 and 32768 keys and -1.5% at 92160 x H40 where the pairs' halved
//   L2 traffic counts (docs/perf-notes.md, "The persistent grid up to 24576 keys").
// VIDATTN_SM90_GRID=persistent | tiles forces one of them (read once; for A/B, or for a
// caller whose attention runs beside NCCL kernels without leaving SMs free); sm_margin always
// takes the persistent grid.
inline constexpr std::int64_t kPersistentMaxKeys = 24576;

enum class GridChoice { kAuto, kPersistent, kTiles };

inline GridChoice grid_choice() {
  static const GridChoice choice = [] {
    const char* v = std::getenv("VIDATTN_SM90_GRID");
    if (v == nullptr) return GridChoice::kAuto;
    if (std::string_view(v) == "persistent") return GridChoice::kPersistent;
    if (std::string_view(v) == "tiles") return GridChoice::kTiles;
    return GridChoice::kAuto;
  }();
  return choice;
}

// The persistent grid's CTAs: one per SM (of `sms`), less the SMs the caller leaves free.
inline int persistent_grid_ctas(const AttentionParams& a, int sms) {
  return std::max(1, sms - std::max(0, a.sm_margin));
}

inline bool dense_grid_persistent(const AttentionParams& a) {
  if (a.sm_margin > 0) return true;
  switch (grid_choice()) {
    case GridChoice::kPersistent: return true;
    case GridChoice::kTiles: return false;
    default: return a.seqlen_k <= kPersistentMaxKeys;
  }
}

// VIDATTN_SM90_CLUSTER=0 keeps dense attention on single CTAs (for measuring the pairs;
// read once).
inline bool dense_cluster_enabled() {
  static const bool on = env_switch_on("VIDATTN_SM90_CLUSTER");
  return on;
}

// Whether the dense problem runs in CTA pairs: the two tiles of a pair (consecutive slots of
// the one-CTA-per-tile grid, so not a persistent one) must belong to one head and visit the
// same key blocks, so: not causal, not varlen, no key mask, an even number of query blocks
// per head.
inline bool dense_cluster_fits(const AttentionParams& a, int block_m) {
  return dense_cluster_enabled() && !a.causal && !a.varlen && a.key_mask == nullptr &&
         !dense_grid_persistent(a) && ((a.seqlen_q + block_m - 1) / block_m) % 2 == 0;
}

// VIDATTN_SM90_SPLIT_TAIL=0 keeps every tile whole (for measuring the split; read once).
inline bool split_tail_enabled() {
  static const bool on = env_switch_on("VIDATTN_SM90_SPLIT_TAIL");
  return on;
}

// Traits::kSplitTail: the first tile whose three 64-row pieces run apart
// (last_round_split_from), never causal: its longest-first order already evens the CTAs out.
// The choice depends on the launch (tiles and SMs), so a tile's output bits can differ between
// launches of different sizes, as with any split of the key loop.
inline int split_tail_from(const AttentionParams& a, int tiles, int ctas) {
  if (!split_tail_enabled() || a.causal) return tiles;
  return last_round_split_from(tiles, ctas);
}

// Query rows a tiling of block_m-row tiles puts on the busiest of `ctas` CTAs, a piece of a
// split last round counted as its 64 rows (at 2048 x 16 heads, 300 keys that choice, 192-row
// tiles with the split, ran level with the 128-row tiles it replaced; perf-notes, v32).
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

// Whether a dense D = 128 problem takes Dense128ShortTraits: at most kDense128ShortMaxKeys
// keys, and its 192-row tiles put no more query rows on the busiest SM of the persistent grid
// than 128-row tiles would. A grid of few tiles leaves more of the larger tile's last wave
// idle (1 x 2048 x 16 heads, 300 keys: 176 tiles on 132 SMs, -14% on the 192-row tile).
template <class T>
bool dense128_short_fits(const AttentionParams& a) {
  if (a.seqlen_k > kDense128ShortMaxKeys) return false;
  const int ctas = persistent_grid_ctas(a, cuda_sm80::current_sm_count());
  return rows_on_busiest_cta(a, Dense128ShortTraits<T>::kBlockM,
                             Dense128ShortTraits<T>::kSplitTail, ctas) <=
         rows_on_busiest_cta(a, DenseTraits<T, 128>::kBlockM, DenseTraits<T, 128>::kSplitTail,
                             ctas);
}

// Whether the kernel has sm_90a machine code in this build (not just the empty sm_80 body).
template <class Kernel>
bool has_sm90a_code(Kernel kernel) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= 90;
}

// VIDATTN_SM90_PREFIX_LOADS=0 loads whole key tiles in the kernels with prefix loads (for
// measuring them; read once).
inline bool prefix_loads_enabled() {
  static const bool on = env_switch_on("VIDATTN_SM90_PREFIX_LOADS");
  return on;
}

// The prefix-load descriptors (sm90_fwd_prefix_loads.h): 16-row boxes over the views of the
// whole-tile loads (gmem_view). When the driver refuses one, the kernel loads whole tiles.
template <class Traits>
PrefixLoadMaps make_prefix_load_maps(const AttentionParams& a, int kv_rows, int batch) {
  PrefixLoadMaps m{};
  if (!prefix_loads_enabled()) return m;
  using Element = typename Traits::Element;
  auto encode = [&](cute::TmaDescriptor* map, const void* ptr, const RowStrides& st) {
    const auto view = gmem_view<Traits>(ptr, kv_rows, a.heads_kv, batch, st);
    constexpr std::uint64_t e = sizeof(Element);
    // TMA's order: head dim (contiguous), rows, heads, batch; strides in bytes.
    const cuuint64_t dims[4] = {Traits::kHeadDim, static_cast<cuuint64_t>(kv_rows),
                                static_cast<cuuint64_t>(a.heads_kv),
                                static_cast<cuuint64_t>(batch)};
    const cuuint64_t strides[3] = {cute::get<0>(view.stride()) * e,
                                   cute::get<2>(view.stride()) * e,
                                   cute::get<3>(view.stride()) * e};
    const cuuint32_t box[4] = {64, PrefixLoadMaps::kPieceRows, 1, 1};
    const cuuint32_t unit[4] = {1, 1, 1, 1};
    return cutlass::call_cuTensorMapEncodeTiled(
               map, cute::TMA::to_CUtensorMapDataType<Element>(), 4, const_cast<void*>(ptr),
               dims, strides, box, unit, CU_TENSOR_MAP_INTERLEAVE_NONE,
               CU_TENSOR_MAP_SWIZZLE_128B, CU_TENSOR_MAP_L2_PROMOTION_L2_128B,
               CU_TENSOR_MAP_FLOAT_OOB_FILL_NONE) == CUDA_SUCCESS;
  };
  m.enabled = encode(&m.k, a.k, a.k_strides) && encode(&m.v, a.v, a.v_strides);
  return m;
}

// A launch of `grid` CTAs in clusters of Traits::kClusterM (consecutive blockIdx.x).
// `cluster` holds the attribute the config points to.
template <class Traits>
cudaLaunchConfig_t cluster_launch_config(int grid, cudaStream_t stream,
                                         cudaLaunchAttribute& cluster) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(grid);
  config.blockDim = dim3(Traits::kThreads);
  config.dynamicSmemBytes = Traits::kSmemBytes;
  config.stream = stream;
  cluster = cudaLaunchAttribute{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = Traits::kClusterM;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = 1;
  config.attrs = &cluster;
  config.numAttrs = 1;
  return config;
}

// Whether the device can run a cluster of the kernel at all (a MIG slice or an SM
// partition might not); when it cannot, the caller takes single CTAs.
template <class Traits, class Kernel>
bool clusters_fit(Kernel kernel) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                           Traits::kSmemBytes) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config =
      cluster_launch_config<Traits>(Traits::kClusterM, nullptr, cluster);
  int clusters = 0;
  if (cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return clusters > 0;
}

template <class Traits, class Visit>
bool launch(const AttentionParams& a, const SparseKeyListArgs& sparse, cudaStream_t stream,
            const CombineArgs* combine = nullptr) {
  using namespace cute;
  auto kernel = sm90_attention_fwd_kernel<Traits, Visit>;
  static const bool available = has_sm90a_code(kernel);
  if (!available) return false;
  if constexpr (Traits::kClusterM > 1) {
    static const bool fit = clusters_fit<Traits>(kernel);
    if (!fit) return false;
  }
  if (a.batch == 0 || a.seqlen_q == 0) return true;

  FwdKernelParams<Traits> p;
  p.attn = a;
  p.sparse = sparse;
  p.q_rows = static_cast<int>(a.varlen ? a.rows_q : a.seqlen_q);
  p.kv_rows = static_cast<int>(a.varlen ? a.rows_k : a.seqlen_k);
  p.tma_batch = a.varlen ? 1 : a.batch;
  p.tma_q = make_tma_copy(SM90_TMA_LOAD{},
                          gmem_view<Traits>(a.q, p.q_rows, a.heads_q, p.tma_batch, a.q_strides),
                          typename Traits::SmemLayoutQ{});
  using KVOp = typename Traits::TmaKVOp;
  constexpr auto kCluster = Int<Traits::kClusterM>{};
  p.tma_k = make_tma_copy(KVOp{},
                          gmem_view<Traits>(a.k, p.kv_rows, a.heads_kv, p.tma_batch, a.k_strides),
                          typename Traits::SmemLayoutKVLoad{}, kCluster);
  p.tma_v = make_tma_copy(KVOp{},
                          gmem_view<Traits>(a.v, p.kv_rows, a.heads_kv, p.tma_batch, a.v_strides),
                          typename Traits::SmemLayoutKVLoad{}, kCluster);
  if constexpr (Traits::kTmaStoreO) {
    // The out view meets TMA's rules (the caller checks them: sm90_fwd_launch.h).
    p.store_o_by_tma = tma_store_o_enabled();
    if (p.store_o_by_tma)
      p.tma_o = make_tma_copy(
          SM90_TMA_STORE{},
          gmem_view<Traits>(a.out, p.q_rows, a.heads_q, p.tma_batch, a.out_strides),
          typename Traits::SmemLayoutOStore{});
  }
  p.sched.set_shape(static_cast<int>((a.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM),
                    a.heads_q, a.batch, a.causal);
  if (combine != nullptr) p.combine = *combine;
  if constexpr (Traits::kPrefixLoads)
    p.prefix = make_prefix_load_maps<Traits>(a, p.kv_rows, p.tma_batch);
  p.pingpong = pingpong_enabled();
  p.rescale_slack = rescale_slack();
  const bool persistent = Traits::kStreamItems || dense_grid_persistent(a);
  const int sms = cuda_sm80::current_sm_count();
  int slots = p.sched.total_tiles();  // one per tile, three per split tile
  if constexpr (Traits::kSplitTail) {
    // The same split for either grid (one CTA per tile fills its last wave the same way), so
    // VIDATTN_SM90_GRID keeps the bits.
    p.split.from = split_tail_from(a, slots, persistent_grid_ctas(a, sms));
    if (p.split.from < slots)
      p.tma_q_piece = make_tma_copy(
          SM90_TMA_LOAD{}, gmem_view<Traits>(a.q, p.q_rows, a.heads_q, p.tma_batch, a.q_strides),
          typename Traits::SmemLayoutQPiece{});
    slots = p.split.slots(p.sched);
  }
  const int grid = persistent ? std::min(slots, persistent_grid_ctas(a, sms)) : slots;
  p.sched.set_grid(grid, slots);
  cuda_sm80::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                             Traits::kSmemBytes),
                        "cudaFuncSetAttribute (dynamic shared memory)");
  // The item counter: one int per launch, stream-ordered (allocated, zeroed, the kernel,
  // given back when this function returns), so launches on other streams never share it and
  // graph capture records it.
  const cuda_common::DeviceWorkspace counter(Traits::kStreamItems ? sizeof(int) : 0, stream,
                                             "the sm90 tile counter");
  if constexpr (Traits::kStreamItems) {
    p.items.set_shape(
        static_cast<int>((a.seqlen_q + Traits::kBlockMStream - 1) / Traits::kBlockMStream),
        a.heads_q, a.batch);
    p.items.device_streams = Traits::kStreams * sms;
    p.items.walk_spread = walk_spread();
    p.items.counter = counter.as<int>();
    cuda_sm80::check_cuda(cudaMemsetAsync(p.items.counter, 0, sizeof(int), stream),
                          "cudaMemsetAsync (sm90 tile counter)");
  }
  cudaError_t launched = cudaSuccess;
  if constexpr (Traits::kClusterM > 1) {
    // The tiles of consecutive slots (the caller checks that they share a head and a key
    // range; see dense_cluster_fits).
    cudaLaunchAttribute cluster;
    const cudaLaunchConfig_t config = cluster_launch_config<Traits>(grid, stream, cluster);
    launched = cudaLaunchKernelEx(&config, kernel, p);
  } else {
    kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  }
  const cudaError_t last = cudaGetLastError();  // also clears a failed launch's error
  if (launched == cudaSuccess) launched = last;
  cuda_sm80::check_cuda(launched, "sm90 attention forward kernel launch");
  detail::note_sm90_forward_launch();
  return true;
}

}  // namespace launch_detail

template <class T, int D>
bool launch_dense_forward(const AttentionParams& p, cudaStream_t stream) {
  if (p.key_mask != nullptr) {
    // Key padding runs an instance of its own, so that the mask code does not shape the
    // unmasked kernel (with it, ptxas scheduled the unmasked loop differently: up to -6% at
    // D = 128; docs/perf-notes.md v15). It keeps to the 128-row tile at D = 64 (causal key
    // padding only: the rest is packed as varlen first, sm90_fwd_pack_padding.h).
    using Traits = launch_detail::DenseTraits<T, D>;
    return launch_detail::launch<Traits, DenseKeyRange<Traits::kBlockN, true>>(
        p, SparseKeyListArgs{}, stream);
  }
  using OneBlock = launch_detail::DenseOneBlockTraits<T, D>;
  if (p.seqlen_k <= OneBlock::kBlockN &&  // kOneBlock runs one key block per tile
      (D == 64 || launch_detail::dense128_short_fits<T>(p)))
    return launch_detail::launch<OneBlock, DenseKeyRange<OneBlock::kBlockN>>(
        p, SparseKeyListArgs{}, stream);
  if constexpr (D == 64) {
    using Wide = launch_detail::Dense64WideTraits<T>;
    return launch_detail::launch<Wide, DenseKeyRange<Wide::kBlockN>>(p, SparseKeyListArgs{},
                                                                     stream);
  } else {
    if (launch_detail::dense128_short_fits<T>(p)) {
      using Short = launch_detail::Dense128ShortTraits<T>;
      return launch_detail::launch<Short, DenseKeyRange<Short::kBlockN>>(
          p, SparseKeyListArgs{}, stream);
    }
    // Single CTAs when the pairs do not fit the problem or the device.
    using Pair = launch_detail::DenseClusterTraits<T, D>;
    if (launch_detail::dense_cluster_fits(p, Pair::kBlockM) &&
        launch_detail::launch<Pair, DenseKeyRange<Pair::kBlockN>>(p, SparseKeyListArgs{},
                                                                  stream))
      return true;
    using Traits = launch_detail::DenseTraits<T, D>;
    return launch_detail::launch<Traits, DenseKeyRange<Traits::kBlockN>>(
        p, SparseKeyListArgs{}, stream);
  }
}

template <class T, int D>
bool launch_sparse_forward(const AttentionParams& p, const SparseKeyListArgs& s,
                           cudaStream_t stream) {
  if (s.tile_volume == 64) {
    using Traits = launch_detail::Sparse64Traits<T, D>;
    return launch_detail::launch<Traits, SparseKeyList<Traits::kBlockN, Traits::kHalfLoads>>(
        p, s, stream);
  }
  using Traits = launch_detail::Sparse128Traits<T, D>;
  return launch_detail::launch<Traits, SparseKeyList<Traits::kBlockN>>(p, s, stream);
}

template <class T, int D>
bool launch_sparse_combine_forward(const AttentionParams& p, const SparseKeyListArgs& s,
                                   const CombineArgs& c, cudaStream_t stream) {
  if (s.tile_volume != 64) return false;
  using Traits = launch_detail::Sparse64CombineTraits<T, D>;
  return launch_detail::launch<Traits, SparseKeyList<Traits::kBlockN, Traits::kHalfLoads>>(
      p, s, stream, &c);
}

}  // namespace vidattn::cuda_sm90
