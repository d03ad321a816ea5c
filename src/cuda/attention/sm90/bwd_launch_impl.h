// Host side of the sm_90a backward: the row statistics workspace and its preprocess, the TMA
// descriptors of the two main kernels, their grids and launches. Included only by the
// generated instantiation files.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

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

template <class T, int D>
bool launch_dense_backward(const AttentionParams& a, cudaStream_t stream) {
  using namespace cute;
  using Traits = BwdTraits<launch_detail::CutlassElement<T>, D>;
  using KeyMasked = DenseVisit<Traits::kCols, true>;
  using Unmasked = DenseVisit<Traits::kCols, false>;
  using Queries = DenseQueryVisit<Traits::kCols, Traits::kRows>;
  auto dkdv = sm90_attention_bwd_dkdv_kernel<Traits, Queries>;
  static const bool available = launch_detail::has_sm90a_code(dkdv);
  if (!available) return false;
  if (a.batch == 0) return true;

  // Row statistics: [B][Hq][rows] for lse2, then the same for delta.
  BwdRowStats stats;
  stats.rows = (a.seqlen_q + Traits::kRows - 1) / Traits::kRows * Traits::kRows;
  const std::size_t entries = static_cast<std::size_t>(a.batch) * a.heads_q * stats.rows;
  const cuda_common::DeviceWorkspace workspace(2 * entries * sizeof(float), stream,
                                               "the backward's row statistics");
  stats.lse2 = workspace.as<float>();
  stats.delta = stats.lse2 + entries;
  if (entries > 0) {
    sm90_attention_bwd_preprocess_kernel<T, D>
        <<<launch_detail::bwd_blocks(static_cast<std::int64_t>(entries), 8), 256, 0, stream>>>(
            a, stats);
    cuda_common::check_cuda(cudaGetLastError(), "sm90 attention backward (preprocess) launch");
  }

  BwdKernelParams<Traits> p;
  p.attn = a;
  p.stats = stats;
  p.q_rows = static_cast<int>(a.varlen ? a.rows_q : a.seqlen_q);
  p.kv_rows = static_cast<int>(a.varlen ? a.rows_k : a.seqlen_k);
  p.tma_batch = a.varlen ? 1 : a.batch;
  auto view = [&](const void* ptr, int rows, int heads, const RowStrides& st) {
    return launch_detail::gmem_view<Traits>(ptr, rows, heads, p.tma_batch, st);
  };
  using RowsLayout = typename Traits::SmemLayoutRows;
  const auto cols_layout = take<0, 2>(typename Traits::SmemLayoutCols{});

  // dK, dV: K and V stationary, Q and dO streamed.
  p.tma_x = make_tma_copy(SM90_TMA_LOAD{}, view(a.k, p.kv_rows, a.heads_kv, a.k_strides),
                          RowsLayout{});
  p.tma_y = make_tma_copy(SM90_TMA_LOAD{}, view(a.v, p.kv_rows, a.heads_kv, a.v_strides),
                          RowsLayout{});
  p.tma_u = make_tma_copy(SM90_TMA_LOAD{}, view(a.q, p.q_rows, a.heads_q, a.q_strides),
                          cols_layout);
  p.tma_w = make_tma_copy(SM90_TMA_LOAD{},
                          view(a.grad_out, p.q_rows, a.heads_q, a.grad_out_strides), cols_layout);
  if (a.seqlen_k > 0)
    launch_detail::launch_bwd_kernel(
        dkdv, dim3(launch_detail::bwd_blocks(a.seqlen_k, Traits::kRows), a.heads_kv, a.batch), p,
        stream, "sm90 attention backward (dK, dV) launch");

  // dQ: Q and dO stationary, K and V streamed.
  p.tma_x = make_tma_copy(SM90_TMA_LOAD{}, view(a.q, p.q_rows, a.heads_q, a.q_strides),
                          RowsLayout{});
  p.tma_y = make_tma_copy(SM90_TMA_LOAD{},
                          view(a.grad_out, p.q_rows, a.heads_q, a.grad_out_strides), RowsLayout{});
  p.tma_u = make_tma_copy(SM90_TMA_LOAD{}, view(a.k, p.kv_rows, a.heads_kv, a.k_strides),
                          cols_layout);
  p.tma_w = make_tma_copy(SM90_TMA_LOAD{}, view(a.v, p.kv_rows, a.heads_kv, a.v_strides),
                          cols_layout);
  if (a.seqlen_q > 0) {
    const dim3 grid(launch_detail::bwd_blocks(a.seqlen_q, Traits::kRows), a.heads_q, a.batch);
    if (a.key_mask != nullptr)
      launch_detail::launch_bwd_kernel(sm90_attention_bwd_dq_kernel<Traits, KeyMasked>, grid, p,
                                       stream, "sm90 attention backward (dQ) launch");
    else
      launch_detail::launch_bwd_kernel(sm90_attention_bwd_dq_kernel<Traits, Unmasked>, grid, p,
                                       stream, "sm90 attention backward (dQ) launch");
  }
#ifdef VIDATTN_TESTING
  testing::note_sm90_backward_launch();
#endif
  return true;
}

}  // namespace vidattn::cuda_sm90
