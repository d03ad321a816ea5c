// Host side of the sm_90a backward: the row statistics workspace and its preprocess, the TMA
// descriptors of the two main kernels, their grids and launches. Included only by the
// generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "bwd_dq_convert.h"
#include "bwd_kernels.h"
#include "bwd_launch.h"
#include "bwd_preprocess.h"
#include "cuda/common/check.h"
#include "cuda/common/workspace.h"
#ifdef VIDATTN_TESTING
#include "core/testing.h"
#endif
#include "launch_utils.h"

namespace vidattn::cuda_sm90 {

namespace launch_detail {

inline unsigned bwd_blocks(std::int64_t n, std::int64_t per) {
  return static_cast<unsigned>((n + per - 1) / per);
}

template <class Traits, class Kernel>
void launch_bwd_kernel(Kernel kernel, dim3 grid, const BwdKernelParams<Traits>& p,
                       cudaStream_t stream, const char* what) {
  cuda_common::check_cuda(cudaFuncSetAttribute(kernel,
                                               cudaFuncAttributeMaxDynamicSharedMemorySize,
                                               Traits::kSmemBytes),
                          "cudaFuncSetAttribute (dynamic shared memory)");
  kernel<<<grid, Traits::kThreads, Traits::kSmemBytes, stream>>>(p);
  cuda_common::check_cuda(cudaGetLastError(), what);
}

}  // namespace launch_detail

namespace launch_detail {

// The dK / dV kernel's view of the problem: K and V stationary, Q and dO streamed.
template <class Traits>
BwdKernelParams<Traits> dkdv_params(const AttentionParams& a, const SparseKeyListArgs& sparse,
                                    const BwdRowStats& stats) {
  using namespace cute;
  BwdKernelParams<Traits> p;
  p.attn = a;
  p.sparse = sparse;
  p.stats = stats;
  p.q_rows = static_cast<int>(a.varlen ? a.rows_q : a.seqlen_q);
  p.kv_rows = static_cast<int>(a.varlen ? a.rows_k : a.seqlen_k);
  p.tma_batch = a.varlen ? 1 : a.batch;
  auto view = [&](const void* ptr, int rows, int heads, const RowStrides& st) {
    return gmem_view<Traits>(ptr, rows, heads, p.tma_batch, st);
  };
  const auto cols_layout = take<0, 2>(typename Traits::SmemLayoutCols{});
  p.tma_x = make_tma_copy(SM90_TMA_LOAD{}, view(a.k, p.kv_rows, a.heads_kv, a.k_strides),
                          typename Traits::SmemLayoutRows{});
  p.tma_y = make_tma_copy(SM90_TMA_LOAD{}, view(a.v, p.kv_rows, a.heads_kv, a.v_strides),
                          typename Traits::SmemLayoutRows{});
  p.tma_u = make_tma_copy(SM90_TMA_LOAD{}, view(a.q, p.q_rows, a.heads_q, a.q_strides),
                          cols_layout);
  p.tma_w = make_tma_copy(SM90_TMA_LOAD{},
                          view(a.grad_out, p.q_rows, a.heads_q, a.grad_out_strides), cols_layout);
  return p;
}

// The dQ kernel's: Q and dO stationary, K and V streamed.
template <class Traits>
BwdKernelParams<Traits> dq_params(const AttentionParams& a, const SparseKeyListArgs& sparse,
                                  const BwdRowStats& stats) {
  using namespace cute;
  BwdKernelParams<Traits> p = dkdv_params<Traits>(a, sparse, stats);
  auto view = [&](const void* ptr, int rows, int heads, const RowStrides& st) {
    return gmem_view<Traits>(ptr, rows, heads, p.tma_batch, st);
  };
  const auto cols_layout = take<0, 2>(typename Traits::SmemLayoutCols{});
  p.tma_x = make_tma_copy(SM90_TMA_LOAD{}, view(a.q, p.q_rows, a.heads_q, a.q_strides),
                          typename Traits::SmemLayoutRows{});
  p.tma_y = make_tma_copy(SM90_TMA_LOAD{},
                          view(a.grad_out, p.q_rows, a.heads_q, a.grad_out_strides),
                          typename Traits::SmemLayoutRows{});
  p.tma_u = make_tma_copy(SM90_TMA_LOAD{}, view(a.k, p.kv_rows, a.heads_kv, a.k_strides),
                          cols_layout);
  p.tma_w = make_tma_copy(SM90_TMA_LOAD{}, view(a.v, p.kv_rows, a.heads_kv, a.v_strides),
                          cols_layout);
  return p;
}

// The preprocess, then either the dK / dV kernel (QueryVisitT: its query visit) and the dQ
// kernel (KeyVisitT: the forward's key visit), deterministic; or, with `fused` (one stream
// only), the dK / dV kernel that also reduces dQ into an fp32 workspace, and the convert of
// that workspace (FusedQueryVisitT: the query visit of its 64-row blocks). DqTraits: the dQ
// kernel's shape, where it streams blocks of another size than the dK / dV kernel.
// kMayFuse: whether `fused` is ever taken (else the fused kernel is not compiled). False when
// this build holds no sm_90a code.
template <class T, class Traits, class QueryVisitT, class KeyVisitT,
          class FusedQueryVisitT = QueryVisitT, class DqTraits = Traits,
          bool kMayFuse = Traits::kStreams == 1>
bool backward(const AttentionParams& a, const SparseKeyListArgs& sparse, bool fused,
              cudaStream_t stream) {
  using FusedTraits = BwdTraits<typename Traits::Element, Traits::kHeadDim, 1, true>;
  auto dkdv = sm90_attention_bwd_dkdv_kernel<Traits, QueryVisitT>;
  auto dq = sm90_attention_bwd_dq_kernel<DqTraits, KeyVisitT>;
  static_assert(DqTraits::kRows == Traits::kRows &&
                Traits::kStatsRowsMultiple % DqTraits::kStatsRowsMultiple == 0);
  static const bool available = has_sm90a_code(dkdv);
  if (!available) return false;
  if (a.batch == 0) return true;

  // Row statistics: [B][Hq][rows] for lse2, then the same for delta.
  BwdRowStats stats;
  constexpr int kStatsMultiple = Traits::kStatsRowsMultiple;  // a multiple of 64 and kRows
  stats.rows = (a.seqlen_q + kStatsMultiple - 1) / kStatsMultiple * kStatsMultiple;
  const std::size_t entries = static_cast<std::size_t>(a.batch) * a.heads_q * stats.rows;
  const cuda_common::DeviceWorkspace workspace(2 * entries * sizeof(float), stream,
                                               "the backward's row statistics");
  stats.lse2 = workspace.as<float>();
  stats.delta = stats.lse2 + entries;
  if (entries > 0) {
    sm90_attention_bwd_preprocess_kernel<T, Traits::kHeadDim>
        <<<bwd_blocks(static_cast<std::int64_t>(entries), 8), 256, 0, stream>>>(a, stats);
    cuda_common::check_cuda(cudaGetLastError(), "sm90 attention backward (preprocess) launch");
  }
  const dim3 dkdv_grid(bwd_blocks(a.seqlen_k, Traits::kRows), a.heads_kv, a.batch);

  if constexpr (kMayFuse) {
    static_assert(Traits::kStreams == 1);
    if (fused) {
      const std::size_t floats = entries * Traits::kHeadDim;
      const cuda_common::DeviceWorkspace dq_accum(floats * sizeof(float), stream,
                                                  "the backward's fp32 dQ");
      BwdKernelParams<FusedTraits> p = dkdv_params<FusedTraits>(a, sparse, stats);
      p.dq_accum = dq_accum.as<float>();
      cuda_common::check_cuda(cudaMemsetAsync(p.dq_accum, 0, floats * sizeof(float), stream),
                              "sm90 attention backward (dQ workspace) clear");
      if (a.seqlen_k > 0)
        launch_bwd_kernel(sm90_attention_bwd_dkdv_kernel<FusedTraits, FusedQueryVisitT>,
                          dkdv_grid, p, stream, "sm90 attention backward (dK, dV, dQ) launch");
      if (entries > 0) {
        sm90_attention_bwd_dq_convert_kernel<FusedTraits>
            <<<dim3(static_cast<unsigned>(stats.rows / FusedTraits::kCols), a.heads_q,
                    a.batch),
               FusedTraits::kDqThreads, 0, stream>>>(a, p.dq_accum, stats);
        cuda_common::check_cuda(cudaGetLastError(),
                                "sm90 attention backward (dQ convert) launch");
      }
#ifdef VIDATTN_TESTING
      testing::note_sm90_backward_launch();
#endif
      return true;
    }
  }

  if (a.seqlen_k > 0)
    launch_bwd_kernel(dkdv, dkdv_grid, dkdv_params<Traits>(a, sparse, stats), stream,
                      "sm90 attention backward (dK, dV) launch");
  if (a.seqlen_q > 0)
    launch_bwd_kernel(dq, dim3(bwd_blocks(a.seqlen_q, DqTraits::kRows), a.heads_q, a.batch),
                      dq_params<DqTraits>(a, sparse, stats), stream,
                      "sm90 attention backward (dQ) launch");
#ifdef VIDATTN_TESTING
  testing::note_sm90_backward_launch();
#endif
  return true;
}

}  // namespace launch_detail

template <class T, int D>
bool launch_dense_backward(const AttentionParams& a, bool deterministic, cudaStream_t stream) {
  // Streamed rows per block (BwdTraits): D = 64 128 in both kernels; D = 128 80 query rows in
  // the dK / dV kernel and 64-key blocks in the dQ kernel (the forward's key visits come in 64
  // and 128). The fused dQ keeps its own 64-row traits.
  // deterministic=False fuses dQ into the dK / dV kernel at D = 128 only: at D = 64 the fused
  // kernel streams 64-row blocks (its fp32 dQ buffers leave no room for 128), and the two
  // deterministic kernels with their 128-row blocks measured faster on every shape
  // (docs/perf-history.md, "Hopper backward v7").
  constexpr bool kFuse = D == 128;
  using E = launch_detail::CutlassElement<T>;
  using Traits = BwdTraits<E, D, 1, false, D == 64 ? 128 : 80>;
  using DqTraits = BwdTraits<E, D, 1, false, D == 64 ? 128 : 64>;
  using Queries = DenseQueryVisit<Traits::kCols, Traits::kRows>;
  using FusedQueries = DenseQueryVisit<64, Traits::kRows>;
  const bool fused = kFuse && !deterministic;
  // Key padding has an instance of its own (the key flags of the forward's masked kernel).
  if (a.key_mask != nullptr)
    return launch_detail::backward<T, Traits, Queries, DenseVisit<DqTraits::kCols, true>,
                                   FusedQueries, DqTraits, kFuse>(a, SparseKeyListArgs{},
                                                                  fused, stream);
  return launch_detail::backward<T, Traits, Queries, DenseVisit<DqTraits::kCols, false>,
                                 FusedQueries, DqTraits, kFuse>(a, SparseKeyListArgs{}, fused,
                                                                stream);
}

template <class T, int D>
bool launch_sparse_backward(const AttentionParams& a, const SparseKeyListArgs& s,
                            bool deterministic, cudaStream_t stream) {
  // 64-token tiles: each consumer warpgroup's 64 rows are a tile of their own, with their own
  // list (two streams); larger tiles hold the CTA's 128 rows and share one list.
  if (s.tile_volume == 64) {
    using Traits = BwdTraits<launch_detail::CutlassElement<T>, D, 2>;
    return launch_detail::backward<T, Traits, SparseQueryVisit<Traits::kCols>,
                                   SparseVisit<Traits::kCols>>(a, s, false, stream);
  }
  using Traits = BwdTraits<launch_detail::CutlassElement<T>, D, 1>;
  return launch_detail::backward<T, Traits, SparseQueryVisit<Traits::kCols>,
                                 SparseVisit<Traits::kCols>>(a, s, !deterministic, stream);
}

}  // namespace vidattn::cuda_sm90
