// Definitions of the launchers declared in launch.h; included only by the instantiation
// files.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "bwd_kernels.h"
#include "cuda/common/check.h"
#include "fwd_kernel.h"
#include "launch.h"
#include "vidattn/error.h"

namespace vidattn::cuda_sm80 {

using namespace cuda_common;  // params, tile I/O and warp math shared with the sm_90a kernels

namespace launch_detail {

inline unsigned blocks_for(std::int64_t n, int per_block) {
  return static_cast<unsigned>((n + per_block - 1) / per_block);
}

// Kernels with more than 48 KiB of shared memory must opt in, once per kernel and device.
// The wide head dims need more than some GPUs have (sm_86 / sm_89 blocks: 99 KiB): that is a
// valid call this GPU cannot serve, NotImplementedError naming the head dim.
template <class Kernel>
void allow_smem(Kernel kernel, int bytes, const AttentionParams& p, const char* what) {
  const cudaError_t status =
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (status == cudaSuccess) return;
  int device = 0, limit = 0;
  if (cudaGetDevice(&device) == cudaSuccess &&
      cudaDeviceGetAttribute(&limit, cudaDevAttrMaxSharedMemoryPerBlockOptin, device) ==
          cudaSuccess &&
      bytes > limit) {
    (void)cudaGetLastError();  // the refused attribute is not a launch error of a later call
    throw NotImplementedError(
        std::string(what) + ": head dims D = " + std::to_string(p.head_dim) + ", Dv = " +
        std::to_string(p.head_dim_v) + " need " + std::to_string(bytes) +
        " bytes of shared memory per block and this GPU allows " + std::to_string(limit) +
        "; use a GPU with more shared memory (A100, H100) or CPU tensors");
  }
  check_cuda(status, "cudaFuncSetAttribute (dynamic shared memory)");
}

}  // namespace launch_detail

namespace launch_detail {

template <class T, int D, int BQ, bool kSparse, bool kPadded>
void forward(const AttentionParams& p, cudaStream_t stream) {
  using C = FwdConfig<D, BQ>;
  if (p.batch == 0 || p.seqlen_q == 0) return;
  auto kernel = attention_fwd_kernel<T, D, BQ, kSparse, kPadded>;
  allow_smem(kernel, C::kSmemBytes, p, "attention forward (sm_80 kernels)");
  const dim3 grid(blocks_for(p.seqlen_q, C::kBlockQ), p.heads_q, p.batch);
  kernel<<<grid, C::kThreads, C::kSmemBytes, stream>>>(p);
  check_cuda(cudaGetLastError(), "attention forward kernel launch");
}

template <class T, int D, bool kSparse, bool kPadded>
void backward(const AttentionParams& p, cudaStream_t stream) {
  using C = BwdConfig<D>;
  if (p.batch == 0) return;
  if (p.rows_q > 0) {
    const std::int64_t warps = p.rows_q * p.heads_q;
    attention_bwd_delta_kernel<T, D, kPadded><<<blocks_for(warps, 8), 256, 0, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention backward (delta) kernel launch");
  }
  if (p.seqlen_k > 0) {
    auto kernel = attention_bwd_dkdv_kernel<T, D, kSparse, kPadded>;
    allow_smem(kernel, C::kDkdvSmemBytes, p, "attention backward (sm_80 kernels)");
    const dim3 grid(blocks_for(p.seqlen_k, C::kBlockK), p.heads_kv, p.batch);
    kernel<<<grid, C::kDkdvThreads, C::kDkdvSmemBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention backward (dK, dV) kernel launch");
  }
  if (p.seqlen_q > 0) {
    auto kernel = attention_bwd_dq_kernel<T, D, kSparse, kPadded>;
    allow_smem(kernel, C::kDqSmemBytes, p, "attention backward (sm_80 kernels)");
    const dim3 grid(blocks_for(p.seqlen_q, C::kBlockQ), p.heads_q, p.batch);
    kernel<<<grid, C::kDqThreads, C::kDqSmemBytes, stream>>>(p);
    check_cuda(cudaGetLastError(), "attention backward (dQ) kernel launch");
  }
}

}  // namespace launch_detail

template <class T, int D, bool kPadded>
void launch_forward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::forward<T, D, 128, false, kPadded>(p, stream);
}

template <class T, int D, bool kPadded>
void launch_backward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::backward<T, D, false, kPadded>(p, stream);
}

template <class T, int D, int BLOCK_Q, bool kPadded>
void launch_block_sparse_forward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::forward<T, D, BLOCK_Q, true, kPadded>(p, stream);
}

template <class T, int D, bool kPadded>
void launch_block_sparse_backward(const AttentionParams& p, cudaStream_t stream) {
  launch_detail::backward<T, D, true, kPadded>(p, stream);
}

}  // namespace vidattn::cuda_sm80
