// Host side of the sm_90a forward: TMA descriptors over the [rows, D, heads, batch] views,
// the grid, the launch, and the launchers of fwd_launch.h, which pick a named configuration
// (fwd_config.h) by the rules of fwd_heuristics.h. Included only by the generated
// instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "cuda/common/check.h"
#include "cuda/common/workspace.h"
#ifdef VIDATTN_TESTING
#include "core/testing.h"
#endif
#include "fwd_heuristics.h"
#include "fwd_kernel.h"
#include "fwd_launch.h"
#include "launch_utils.h"

namespace vidattn::cuda_sm90 {

namespace launch_detail {

// The prefix-load descriptors (fwd_prefix_loads.h): 16-row boxes over the views of the
// whole-tile loads (gmem_view). When the driver refuses one, the kernel loads whole tiles.
template <class Traits>
PrefixLoadMaps make_prefix_load_maps(const AttentionParams& a, int kv_rows, int batch) {
  PrefixLoadMaps m{};
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
                          gmem_view<Traits>(a.q, p.q_rows, a.heads_q, p.tma_batch, a.q_strides,
                                            a.head_dim),
                          typename Traits::SmemLayoutQ{});
  using KVOp = typename Traits::TmaKVOp;
  constexpr auto kCluster = Int<Traits::kClusterM>{};
  p.tma_k = make_tma_copy(KVOp{},
                          gmem_view<Traits>(a.k, p.kv_rows, a.heads_kv, p.tma_batch, a.k_strides,
                                            a.head_dim),
                          typename Traits::SmemLayoutKVLoad{}, kCluster);
  p.tma_v = make_tma_copy(KVOp{},
                          gmem_view<Traits>(a.v, p.kv_rows, a.heads_kv, p.tma_batch, a.v_strides,
                                            a.head_dim_v),
                          typename Traits::SmemLayoutVLoad{}, kCluster);
  if constexpr (Traits::kTmaStoreO) {
    // The out view meets TMA's rules (the caller checks them: fwd_launch.h).
    p.tma_o = make_tma_copy(
          SM90_TMA_STORE{},
          gmem_view<Traits>(a.out, p.q_rows, a.heads_q, p.tma_batch, a.out_strides,
                            a.head_dim_v),
          typename Traits::SmemLayoutOStore{});
  }
  p.sched.set_shape(static_cast<int>((a.seqlen_q + Traits::kBlockM - 1) / Traits::kBlockM),
                    a.heads_q, a.batch, a.causal);
  if (combine != nullptr) p.combine = *combine;
  if constexpr (Traits::kPrefixLoads)
    p.prefix = make_prefix_load_maps<Traits>(a, p.kv_rows, p.tma_batch);
  const bool persistent = Traits::kStreamItems || dense_grid_persistent(a);
  const int sms = cuda_common::current_sm_count();
  int slots = p.sched.total_tiles();  // one per tile, three per split tile
  if constexpr (Traits::kSplitTail) {
    // The same split for either grid (one CTA per tile fills its last wave the same way), so
    // the grid choice keeps the bits.
    p.split.from = split_tail_from(a, slots, persistent_grid_ctas(a, sms));
    if (p.split.from < slots)
      p.tma_q_piece = make_tma_copy(
          SM90_TMA_LOAD{}, gmem_view<Traits>(a.q, p.q_rows, a.heads_q, p.tma_batch, a.q_strides,
                                             a.head_dim),
          typename Traits::SmemLayoutQPiece{});
    slots = p.split.slots(p.sched);
  }
  const int grid = persistent ? std::min(slots, persistent_grid_ctas(a, sms)) : slots;
  p.sched.set_grid(grid, slots);
  cuda_common::check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
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
    p.items.counter = counter.as<int>();
    cuda_common::check_cuda(cudaMemsetAsync(p.items.counter, 0, sizeof(int), stream),
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
  cuda_common::check_cuda(launched, "sm90 attention forward kernel launch");
#ifdef VIDATTN_TESTING
  testing::note_sm90_forward_launch();
#endif
  return true;
}

}  // namespace launch_detail

template <class T, int D, bool kPadded, int Dv>
bool launch_dense_forward(const AttentionParams& p, cudaStream_t stream) {
  using launch_detail::WithWidths;
  static_assert(Dv == D || kPadded, "a width of v's own: the padded instances");
  if constexpr (D > 128) {
    // Above 128 one configuration serves every problem (fwd_config.h, dense_wide); key
    // padding takes its masked visit.
    using Traits =
        FwdTraits<launch_detail::CutlassElement<T>, dense_wide(D, Dv == D ? 0 : Dv)>;
    if (p.key_mask != nullptr)
      return launch_detail::launch<Traits, DenseVisit<Traits::kBlockN, true>>(
          p, SparseKeyListArgs{}, stream);
    return launch_detail::launch<Traits, DenseVisit<Traits::kBlockN>>(p, SparseKeyListArgs{},
                                                                         stream);
  } else {
    // The configurations of the wider width W (with_widths): D = 64 / Dv = 128 and the reverse
    // run D = 128's.
    constexpr int W = D > Dv ? D : Dv;
    if (p.key_mask != nullptr) {
      // Key padding runs an instance of its own, so that the mask code does not shape the
      // unmasked kernel (with it, ptxas scheduled the unmasked loop differently: up to -6% at
      // D = 128; docs/perf-history.md, Hopper v15). It keeps to the 128-row tile at D = 64
      // (causal key padding only: the rest is packed as varlen first, pack_padding.h).
      using Traits = WithWidths<launch_detail::DenseTraits<T, W>, D, Dv, kPadded>;
      return launch_detail::launch<Traits, DenseVisit<Traits::kBlockN, true>>(
          p, SparseKeyListArgs{}, stream);
    }
    using OneBlock = WithWidths<launch_detail::DenseOneBlockTraits<T, W>, D, Dv, kPadded>;
    if (p.seqlen_k <= OneBlock::kBlockN &&  // kOneBlock runs one key block per tile
        (W == 64 || launch_detail::dense_short_fits<T, W>(p)))
      return launch_detail::launch<OneBlock, DenseVisit<OneBlock::kBlockN>>(
          p, SparseKeyListArgs{}, stream);
    if constexpr (W == 64) {
      using Wide = WithWidths<launch_detail::Dense64WideTraits<T>, D, Dv, kPadded>;
      return launch_detail::launch<Wide, DenseVisit<Wide::kBlockN>>(p, SparseKeyListArgs{},
                                                                       stream);
    } else {
      if (launch_detail::dense_short_fits<T, W>(p)) {
        using Short = WithWidths<launch_detail::DenseShortTraits<T, W>, D, Dv, kPadded>;
        return launch_detail::launch<Short, DenseVisit<Short::kBlockN>>(
            p, SparseKeyListArgs{}, stream);
      }
      // Single CTAs when the pairs do not fit the problem or the device. The pairs' multicast
      // K / V loads share one width (FwdTraits).
      if constexpr (Dv == D) {
        using Pair = WithWidths<launch_detail::DenseClusterTraits<T, W>, D, Dv, kPadded>;
        if (launch_detail::dense_cluster_fits(p, Pair::kBlockM) &&
            launch_detail::launch<Pair, DenseVisit<Pair::kBlockN>>(p, SparseKeyListArgs{},
                                                                      stream))
          return true;
      }
      using Traits = WithWidths<launch_detail::DenseTraits<T, W>, D, Dv, kPadded>;
      return launch_detail::launch<Traits, DenseVisit<Traits::kBlockN>>(
          p, SparseKeyListArgs{}, stream);
    }
  }
}

template <class T, int D>
bool launch_sparse_forward(const AttentionParams& p, const SparseKeyListArgs& s,
                           cudaStream_t stream) {
  if (s.tile_volume == 64) {
    using Traits = launch_detail::Sparse64Traits<T, D>;
    return launch_detail::launch<Traits, SparseVisit<Traits::kBlockN, Traits::kHalfLoads>>(
        p, s, stream);
  }
  using Traits = launch_detail::Sparse128Traits<T, D>;
  return launch_detail::launch<Traits, SparseVisit<Traits::kBlockN>>(p, s, stream);
}

template <class T, int D>
bool launch_sparse_combine_forward(const AttentionParams& p, const SparseKeyListArgs& s,
                                   const CombineArgs& c, cudaStream_t stream) {
  if (s.tile_volume != 64) return false;
  using Traits = launch_detail::Sparse64CombineTraits<T, D>;
  return launch_detail::launch<Traits, SparseVisit<Traits::kBlockN, Traits::kHalfLoads>>(
      p, s, stream, &c);
}

}  // namespace vidattn::cuda_sm90
