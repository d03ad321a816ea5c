// Definitions of the launchers declared in launch.h; included only by the instantiation
// files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "bwd_kernels.h"
#include "cuda/common/check.h"
#include "fwd_kernel.h"
#include "launch.h"

namespace vidattn::cuda_sm80 {

using namespace cuda_common;  // params, tile I/O and warp math shared with the sm_90a kernels

namespace launch_detail {

inline unsigned blocks_for(std::int64_t n, int per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

// Kernels with more than 48 KiB of shared memory must opt in, once per kernel and device.
template <class Kernel>
void allow_smem(Kernel kernel, int bytes) {
  check_cuda(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes),
             "cudaFuncSetAttribute (dynamic shared memory)");
}

}  // namespace launch_detail

namespace launch_detail {

template <class T, int D, int BQ, bool kSparse>
void forward(const AttentionParams& p, cudaStream_t stream) {
  using C = FwdConfig<D, BQ>;
  if (p.batch == 0 || p.seqlen_q == 0) return;
  auto kernel = attention_fwd_kernel<T, D, BQ, kSparse>;
  allow_smem(kernel, C::kSmemBytes);
  const dim3 grid(blocks_for(p.seqlen_q, C::kBlockQ), p.heads_q, p.batch);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "attention forward kernel launch");
}

template <class T, int D, bool kSparse>
void backward(const AttentionParams& p, cudaStream_t stream) {
  using C = BwdConfig<D>;
  if (p.batch == 0) return;
  if (p.rows_q > 0) {
    const std::int64_t warps = p.rows_q * p.heads_q;
    attention_bwd_delta_kernel<T, D><<<blocks_for(warps, 8), 256, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention backward (delta) kernel launch");
  }
  if (p.seqlen_k > 0) {
    auto kernel = attention_bwd_dkdv_kernel<T, D, kSparse>;
    allow_smem(kernel, C::kDkdvSmemBytes);
    const dim3 grid(blocks_for(p.seqlen_k, C::kBlockK), p.heads_kv, p.batch);
    kernel<<<grid, C::kDkdvThreads, C::kDkdvSmemBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention backward (dK, dV) kernel launch");
  }
  if (p.seqlen_q > 0) {
    auto kernel = attention_bwd_dq_kernel<T, D, kSparse>;
    allow_smem(kernel, C::kDqSmemBytes);
    const dim3 grid(blocks_for(p.seqlen_q, C::kBlockQ), p.heads_q, p.batch);
    kernel<<<grid, C::kDqThreads, C::kDqSmemBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention backward (dQ) kernel launch");
  }
}

}  // namespace launch_detail

template <class T, int D>
void launch_forward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::forward<T, D, FwdConfig<D>::kBlockQ, false>(p, stream);
}

template <class T, int D>
void launch_backward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::backward<T, D, false>(p, stream);
}

template <class T, int D, int BLOCK_Q>
void launch_block_sparse_forward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::forward<T, D, BLOCK_Q, true>(p, stream);
}

template <class T, int D>
void launch_block_sparse_backward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::backward<T, D, true>(p, stream);
}

}  // namespace vidattn::cuda_sm80
