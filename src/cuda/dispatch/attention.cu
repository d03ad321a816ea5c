// The CUDA dense attention entry points (detail::cuda_attention_*, core/backends.h): what the
// CUDA backend supports, the kernel parameters from the validated TensorViews, and the one
// choice between the sm_90a kernels (attention/sm90) and the portable ones (attention/sm80).
// Nothing here synchronises with the device but the varlen offsets check (varlen_check.h).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <stdexcept>
#include <string>
#include <utility>

#include "core/backends.h"
#include "core/check.h"
#include "cuda/attention/sm80/launch.h"
#include "cuda/attention/sm90/bwd_launch.h"
#include "cuda/attention/sm90/fwd_launch.h"
#include "cuda/attention/sm90/pack_padding.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/dtype_dispatch.h"
#include "cuda/common/host_params.h"
#include "cuda/common/params.h"
#include "cuda/common/workspace.h"
#include "head_dims.h"
#include "sm90_support.h"
#include "supported.h"
#include "varlen_check.h"

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
// build; the launcher answers that), head dims aside: the callers check those
// (cuda_dispatch/head_dims.h), since the forward has more of them than the backward.
bool sm90_dense_fits(const AttentionProblem& p, const AttentionParams& kp, const TensorView& q,
                     const TensorView& k, const TensorView& v, const TensorView& out) {
#ifdef VIDATTN_WITH_CUTLASS
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

// ---- padded rows, zeroed ---------------------------------------------------------------
// The masked kernels visit the rows a padding mask marks invalid and multiply them by exact
// zeros (V by P = 0 in the forward and in dP; K by dS = 0 in dQ; Q by dS = 0 in dK), and
// 0 * NaN is NaN: a NaN the caller masked would reach other rows. Those kernels run on copies
// with the masked rows zeroed (docs/conventions.md, non-finite values). One pass over the
// tensor, only when a mask is given and the kernel reads the rows; the packed sm_90a forward
// never reads them and takes no copy.

struct MaskedRows {
  const std::uint16_t* src;
  std::uint16_t* dst;
  cuda_common::RowStrides strides;  // of src; dst is contiguous [B, S, H, dim]
  std::int64_t seqlen, total;       // total: chunks of dst
  int heads, chunks_per_row;
  const std::uint8_t* mask;
  std::int64_t mask_batch, mask_row;
};

template <int kChunk>
__global__ void copy_masked_rows(MaskedRows a) {
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       i < a.total; i += static_cast<std::int64_t>(gridDim.x) * blockDim.x) {
    const std::int64_t c = i % a.chunks_per_row, rh = i / a.chunks_per_row;
    const std::int64_t h = rh % a.heads, bs = rh / a.heads;
    const std::int64_t s = bs % a.seqlen, b = bs / a.seqlen;
    const bool keep = a.mask[b * a.mask_batch + s * a.mask_row] != 0;
    const std::uint16_t* from =
        a.src + b * a.strides.batch + s * a.strides.row + h * a.strides.head + c * kChunk;
    std::uint16_t* to = a.dst + i * kChunk;
    if constexpr (kChunk == 8)
      *reinterpret_cast<uint4*>(to) =
          keep ? *reinterpret_cast<const uint4*>(from) : make_uint4(0u, 0u, 0u, 0u);
    else
      *to = keep ? *from : std::uint16_t(0);
  }
}

// Points `data` / `strides` (a batched [B, S, H, dim] tensor of 16-bit elements) at a copy
// whose rows with mask[b, s] false are zero; the returned workspace holds the copy and is
// given back (stream-ordered) after the kernels queued before its end.
cuda_common::DeviceWorkspace zero_masked_rows(const void*& data, cuda_common::RowStrides& strides,
                                              int batch, std::int64_t seqlen, int heads, int dim,
                                              const std::uint8_t* mask, std::int64_t mask_batch,
                                              std::int64_t mask_row, bool aligned16,
                                              cudaStream_t stream) {
  const std::int64_t elems = static_cast<std::int64_t>(batch) * seqlen * heads * dim;
  cuda_common::DeviceWorkspace copy(static_cast<std::size_t>(elems) * 2, stream,
                                    "the masked rows' zeroed copy");
  if (elems == 0) return copy;
  const bool vec = aligned16 && dim % 8 == 0;
  const int chunk = vec ? 8 : 1;
  MaskedRows a{static_cast<const std::uint16_t*>(data), copy.as<std::uint16_t>(), strides,
               seqlen, elems / chunk, heads, dim / chunk, mask, mask_batch, mask_row};
  const int threads = 256;
  const auto blocks = static_cast<unsigned>(std::min<std::int64_t>((a.total + threads - 1) / threads, 65535));
  if (vec)
    copy_masked_rows<8><<<blocks, threads, 0, stream>>>(a);
  else
    copy_masked_rows<1><<<blocks, threads, 0, stream>>>(a);
  cuda_common::check_last_launch("vidattn masked-row copy");
  data = copy.data();
  strides = {seqlen * heads * dim, static_cast<std::int64_t>(heads) * dim, dim};
  return copy;
}

// Zeroed copies of k and v (key mask) and, with `queries`, of q (query mask): see above.
struct MaskedCopies {
  std::optional<cuda_common::DeviceWorkspace> q, k, v;
};
MaskedCopies zero_masked_inputs(AttentionParams& kp, const AttentionProblem& p, bool queries,
                                cudaStream_t stream) {
  MaskedCopies c;
  if (kp.key_mask) {
    c.k.emplace(zero_masked_rows(kp.k, kp.k_strides, kp.batch, kp.seqlen_k, kp.heads_kv,
                                 static_cast<int>(p.head_dim), kp.key_mask, kp.key_mask_batch,
                                 kp.key_mask_row, kp.aligned16, stream));
    c.v.emplace(zero_masked_rows(kp.v, kp.v_strides, kp.batch, kp.seqlen_k, kp.heads_kv,
                                 static_cast<int>(p.head_dim_v), kp.key_mask, kp.key_mask_batch,
                                 kp.key_mask_row, kp.aligned16, stream));
  }
  if (queries && kp.query_mask)
    c.q.emplace(zero_masked_rows(kp.q, kp.q_strides, kp.batch, kp.seqlen_q, kp.heads_q,
                                 static_cast<int>(p.head_dim), kp.query_mask,
                                 kp.query_mask_batch, kp.query_mask_row, kp.aligned16, stream));
  return c;
}

// The sm_90a backward instances: D = Dv = 64 or 128 (the caller checked).
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
  const DeviceGuard device(p.device.index);
  const auto stream = static_cast<cudaStream_t>(o.stream);
  // Before the early return: offsets that describe no rows must still be valid ones.
  if (p.varlen && o.validate_index)
    cuda_dispatch::check_varlen_offsets(kFn, *o.cu_seqlens_q, q.shape[0], p.seqlen_q,
                                        *o.cu_seqlens_k, k.shape[0], p.seqlen_k, stream);
  if (out.numel() == 0 && lse.numel() == 0) return;
  AttentionParams kp = base_params(p, q, k, v, out, lse, o);
  kp.out_aligned4 = rows_aligned(out, 4);
#ifdef VIDATTN_WITH_CUTLASS
  if (cuda_dispatch::sm90_dense_forward_head_dims(p.head_dim, p.head_dim_v) &&
      sm90_dense_fits(p, kp, q, k, v, out)) {
    bool launched = false;
    cuda_dispatch::dispatch_sm90_dense_forward_head_dims(
        p.dtype, p.head_dim, p.head_dim_v, [&](auto t, auto d, auto padded, auto dv) {
          using T = decltype(t);
          constexpr int D = decltype(d)::value, Dv = decltype(dv)::value;
          constexpr bool kPadded = decltype(padded)::value;
          // Key padding runs packed as varlen (only the valid keys); the masked instance when
          // that cannot run (causal, Dv != D: the packing copies k and v at one width, or no
          // memory for the packed copies).
          if (cuda_sm90::pack_padding_fits(kp) && p.head_dim == p.head_dim_v)
            launched = cuda_sm90::forward_padding_packed(
                kp, static_cast<int>(p.head_dim), sizeof(T), stream,
                [&](const AttentionParams& varlen) {
                  return cuda_sm90::launch_dense_forward<T, D, kPadded, Dv>(varlen, stream);
                });
          if (!launched) {
            AttentionParams masked = kp;
            const MaskedCopies copies = zero_masked_inputs(masked, p, false, stream);
            launched = cuda_sm90::launch_dense_forward<T, D, kPadded, Dv>(masked, stream);
          }
        });
    if (launched) return;
  }
#endif
  const MaskedCopies copies = zero_masked_inputs(kp, p, false, stream);
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
  const bool sm90 = cuda_dispatch::sm90_exact_head_dims(p.head_dim, p.head_dim_v) &&
                    sm90_dense_fits(p, kp, q, k, v, out) && cuda_dispatch::tma_compatible(grad_out);
  const MaskedCopies copies = zero_masked_inputs(kp, p, true, stream);
  (void)sm90;
#ifdef VIDATTN_WITH_CUTLASS
  if (sm90) {
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
