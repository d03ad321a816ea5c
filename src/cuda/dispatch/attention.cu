// The CUDA dense attention entry points (detail::cuda_attention_*, core/backends.h): what the
// CUDA backend supports, the kernel parameters from the validated TensorViews, and the one
// choice between the sm_90a kernels (attention/sm90) and the portable ones (attention/sm80).
// Nothing here synchronises with the device.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/backends.h"
#include "core/check.h"
#include "cuda/attention/sm80/launch.h"
#include "cuda/attention/sm90/bwd_launch.h"
#include "cuda/attention/sm90/fwd_launch.h"
#include "cuda/attention/sm90/pack_padding.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/dtype_dispatch.h"
#include "cuda/common/host_params.h"
#include "cuda/common/params.h"
#include "cuda/common/workspace.h"
#include "head_dims.h"
#include "sm90_support.h"
#include "supported.h"

namespace vidattn::detail {
namespace {

using cuda_common::AttentionParams;
using cuda_common::DeviceGuard;
using cuda_common::layout_params;
using cuda_common::rows_aligned;
using cuda_common::token_strides;

void check_supported(const char* fn, const AttentionProblem& p) {
  cuda_dispatch::check_attention_kernels_support(fn, p.dtype, p.head_dim, p.head_dim_v);
  if (p.heads_q > 65535 || p.heads_kv > 65535 || p.batch > 65535)
    throw NotImplementedError(concat(fn, ": the CUDA backend supports at most 65535 heads and ",
                                     "65535 sequences, got Hq = ", p.heads_q, ", B = ", p.batch));
}

AttentionParams base_params(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            const AttentionOptions& o) {
  AttentionParams kp = layout_params(q, k, v, out, lse, p.batch, p.heads_q, p.heads_kv,
                                     p.seqlen_q, p.seqlen_k, p.scale, p.varlen);
  if (p.varlen) {
    kp.cu_seqlens_q = static_cast<const std::int32_t*>(o.cu_seqlens_q->data);
    kp.cu_seqlens_k = static_cast<const std::int32_t*>(o.cu_seqlens_k->data);
    kp.cu_seqlens_q_stride = o.cu_seqlens_q->stride[0];
    kp.cu_seqlens_k_stride = o.cu_seqlens_k->stride[0];
  }
  if (o.key_padding_mask) {
    kp.key_mask = static_cast<const std::uint8_t*>(o.key_padding_mask->data);
    kp.key_mask_batch = o.key_padding_mask->stride[0];
    kp.key_mask_row = o.key_padding_mask->stride[1];
  }
  if (o.query_padding_mask) {
    kp.query_mask = static_cast<const std::uint8_t*>(o.query_padding_mask->data);
    kp.query_mask_batch = o.query_padding_mask->stride[0];
    kp.query_mask_row = o.query_padding_mask->stride[1];
  }
  kp.causal = p.causal;
  return kp;
}

// Whether the dense forward and backward may take the sm_90a kernels (they also need sm_90a code in this
// build; the launcher answers that).
bool sm90_dense_fits(const AttentionProblem& p, const AttentionParams& kp, const TensorView& q,
                     const TensorView& k, const TensorView& v, const TensorView& out) {
#ifdef VIDATTN_WITH_CUTLASS
  // Other head dims run the portable kernels on every GPU until sm_90a instances exist.
  if (!cuda_dispatch::sm90_head_dims_supported(p.head_dim, p.head_dim_v)) return false;
  if (!cuda_dispatch::sm90_path_enabled(p.device.index)) return false;
  // Empty sides have nothing to describe to TMA; the portable path handles them.
  if (kp.rows_q <= 0 || kp.rows_k <= 0 || kp.seqlen_q <= 0 || kp.seqlen_k <= 0) return false;
  if (kp.rows_q > INT32_MAX || kp.rows_k > INT32_MAX) return false;
  if (!(kp.scale > 0.f)) return false;  // the softmax folds the scale into a positive max
  return cuda_dispatch::tma_compatible(q) && cuda_dispatch::tma_compatible(k) &&
         cuda_dispatch::tma_compatible(v) && cuda_dispatch::tma_compatible(out);
#else
  (void)p, (void)kp, (void)q, (void)k, (void)v, (void)out;
  return false;
#endif
}

// The sm_90a instances: D = Dv = 64 or 128 (sm90_dense_fits checked).
template <class Launch>
void dispatch(const AttentionProblem& p, Launch&& launch) {
  cuda_common::dispatch_dtype_head_dim(p.dtype, p.head_dim, std::forward<Launch>(launch));
}

// The sm_80 instance of the problem's head dims (cuda_dispatch/head_dims.h).
template <class Launch>
void dispatch_sm80(const AttentionProblem& p, Launch&& launch) {
  cuda_dispatch::dispatch_sm80_head_dims(p.dtype, p.head_dim, p.head_dim_v,
                                         std::forward<Launch>(launch));
}

}  // namespace

void cuda_attention_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            const AttentionOptions& o) {
  constexpr const char* kFn = "vidattn::attention_forward";
  check_supported(kFn, p);
  if (out.numel() == 0 && lse.numel() == 0) return;
  const DeviceGuard device(p.device.index);
  AttentionParams kp = base_params(p, q, k, v, out, lse, o);
  kp.out_aligned4 = rows_aligned(out, 4);
  const auto stream = static_cast<cudaStream_t>(o.stream);
#ifdef VIDATTN_WITH_CUTLASS
  if (sm90_dense_fits(p, kp, q, k, v, out)) {
    bool launched = false;
    dispatch(p, [&](auto t, auto d) {
      using T = decltype(t);
      constexpr int D = decltype(d)::value;
      // Key padding runs packed as varlen (only the valid keys); the masked instance when
      // that cannot run (causal, or no memory for the packed copies).
      if (cuda_sm90::pack_padding_fits(kp))
        launched = cuda_sm90::forward_padding_packed(
            kp, D, sizeof(T), stream, [&](const AttentionParams& varlen) {
              return cuda_sm90::launch_dense_forward<T, D>(varlen, stream);
            });
      if (!launched) launched = cuda_sm90::launch_dense_forward<T, D>(kp, stream);
    });
    if (launched) return;
  }
#endif
  dispatch_sm80(p, [&](auto t, auto d, auto padded) {
    cuda_sm80::launch_forward<decltype(t), decltype(d)::value, decltype(padded)::value>(kp, stream);
  });
}

void cuda_attention_backward(const AttentionProblem& p, const TensorView& q,
                             const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& lse, const TensorView& grad_out,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                             const AttentionOptions& o) {
  constexpr const char* kFn = "vidattn::attention_backward";
  check_supported(kFn, p);
  if (dq.numel() == 0 && dk.numel() == 0) return;
  const DeviceGuard device(p.device.index);
  AttentionParams kp = base_params(p, q, k, v, out, lse, o);
  kp.grad_out = grad_out.data;
  kp.grad_out_strides = token_strides(grad_out, p.varlen);
  kp.dq = dq.data, kp.dk = dk.data, kp.dv = dv.data;
  kp.dq_strides = token_strides(dq, p.varlen);
  kp.dk_strides = token_strides(dk, p.varlen);
  kp.dv_strides = token_strides(dv, p.varlen);
  kp.aligned16 = kp.aligned16 && rows_aligned(grad_out, 16);
  kp.out_aligned4 = rows_aligned(dq, 4) && rows_aligned(dk, 4) && rows_aligned(dv, 4);
  const auto stream = static_cast<cudaStream_t>(o.stream);
#ifdef VIDATTN_WITH_CUTLASS
  if (sm90_dense_fits(p, kp, q, k, v, out) && cuda_dispatch::tma_compatible(grad_out)) {
    bool launched = false;
    dispatch(p, [&](auto t, auto d) {
      launched = cuda_sm90::launch_dense_backward<decltype(t), decltype(d)::value>(
          kp, o.deterministic, stream);
    });
    if (launched) return;
  }
#endif

  // rowsum(dO * O) workspace, stream-ordered (no device-wide synchronisation; capturable).
  const cuda_common::DeviceWorkspace delta(
      static_cast<std::size_t>(kp.rows_q * kp.heads_q) * sizeof(float), stream,
      "the backward's row sums");
  kp.delta = delta.as<float>();
  dispatch_sm80(p, [&](auto t, auto d, auto padded) {
    cuda_sm80::launch_backward<decltype(t), decltype(d)::value, decltype(padded)::value>(kp,
                                                                                        stream);
  });
}

}  // namespace vidattn::detail
