// The CUDA block-sparse attention entry points (VSA's fine branch; detail::cuda_block_sparse_*,
// core/vsa_backends.h): what the CUDA backend supports, the kernel parameters from the
// validated TensorViews, and the one choice between the sm_90a forward (attention/sm90) and
// the portable kernels (attention/sm80). Nothing here synchronises with the host except the
// index check (vsa/index_check.h), skipped while the stream is being captured.
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>
#include <utility>

#include "core/backends.h"
#include "core/check.h"
#include "core/vsa_backends.h"
#include "cuda/attention/sm80/launch.h"
#include "cuda/attention/sm90/bwd_launch.h"
#include "cuda/attention/sm90/fwd_launch.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/dtype_dispatch.h"
#include "cuda/common/host_params.h"
#include "cuda/common/params.h"
#include "cuda/common/workspace.h"
#include "cuda/vsa/index_check.h"
#include "head_dims.h"
#include "sm90_support.h"
#include "supported.h"

namespace vidattn::detail {
namespace {

using cuda_common::AttentionParams;
using cuda_common::DeviceGuard;
using cuda_common::dispatch_dtype_head_dim;
using cuda_common::layout_params;
using cuda_common::rows_aligned;
using cuda_common::token_strides;

void check_supported(const char* fn, const BlockSparseProblem& p) {
  cuda_dispatch::check_attention_kernels_support(fn, p.dtype, p.head_dim, p.head_dim_v);
  if (p.heads_q > 65535 || p.batch > 65535)
    throw NotImplementedError(concat(fn, ": the CUDA backend supports at most 65535 heads",
                                     " and a batch of 65535, got Hq = ", p.heads_q,
                                     ", B = ", p.batch));
  if (p.q_tiles * std::max<std::int64_t>(p.max_k, 1) > INT_MAX || p.kv_tiles > INT_MAX)
    throw NotImplementedError(concat(fn, ": the CUDA backend needs Qtiles * MaxK (",
                                     p.q_tiles, " * ", p.max_k, ") below 2^31"));
}

int log2_of(std::int64_t x) {
  int s = 0;
  while ((std::int64_t{1} << s) < x) ++s;
  return s;
}

AttentionParams sparse_params(const BlockSparseProblem& p, const TensorView& q,
                              const TensorView& k, const TensorView& v, const TensorView& q2k_index,
                              const TensorView& q2k_count, const TensorView& out,
                              const TensorView& lse, const BlockSparseOptions& o) {
  AttentionParams kp = layout_params(q, k, v, out, lse, p.batch, p.heads_q, p.heads_kv,
                                     p.seqlen_q, p.seqlen_k, p.scale, false);
  kp.q2k_index = static_cast<const std::int32_t*>(q2k_index.data);
  kp.q2k_count = static_cast<const std::int32_t*>(q2k_count.data);
  for (int d = 0; d < 4; ++d) kp.q2k_index_strides[d] = q2k_index.stride[d];
  for (int d = 0; d < 3; ++d) kp.q2k_count_strides[d] = q2k_count.stride[d];
  if (o.q_block_sizes) {
    kp.q_block_sizes = static_cast<const std::int32_t*>(o.q_block_sizes->data);
    kp.q_block_sizes_stride = o.q_block_sizes->stride[0];
  }
  if (o.kv_block_sizes) {
    kp.kv_block_sizes = static_cast<const std::int32_t*>(o.kv_block_sizes->data);
    kp.kv_block_sizes_stride = o.kv_block_sizes->stride[0];
  }
  kp.tile_volume = static_cast<int>(p.tile_volume);
  kp.tile_shift = log2_of(p.tile_volume / 64);
  kp.q_tiles = static_cast<int>(p.q_tiles);
  kp.kv_tiles = static_cast<int>(p.kv_tiles);
  kp.max_k = static_cast<int>(p.max_k);
  return kp;
}

const TensorView* optional_view(const std::optional<TensorView>& t) {
  return t ? &*t : nullptr;
}

#ifdef VIDATTN_WITH_CUTLASS
// Whether the sm_90a kernels (forward or backward) can take this problem and these views (TMA
// reads every tile, the key lists are read with unit strides); they also need sm_90a code in
// this build, which the launchers answer.
bool sm90_sparse_fits(const BlockSparseProblem& p, const TensorView& q2k_index,
                      const BlockSparseOptions& o, std::initializer_list<const TensorView*> tiles) {
  // Other head dims run the portable kernels on every GPU until sm_90a instances exist.
  if (!cuda_dispatch::sm90_exact_head_dims(p.head_dim, p.head_dim_v) ||
      p.batch * p.seqlen_q > INT32_MAX ||
      p.batch * p.seqlen_k > INT32_MAX)
    return false;
  if (p.max_k > 1 && q2k_index.stride[3] != 1) return false;
  if (o.kv_block_sizes && p.kv_tiles > 1 && o.kv_block_sizes->stride[0] != 1) return false;
  if (!cuda_dispatch::sm90_path_enabled(p.device.index) || p.seqlen_k == 0) return false;
  for (const TensorView* t : tiles)
    if (!cuda_dispatch::tma_compatible(*t)) return false;
  return p.scale > 0.0;
}

// The q2k lists as the sm_90a kernels read them.
cuda_sm90::SparseKeyListArgs sm90_key_lists(const BlockSparseProblem& p,
                                            const TensorView& q2k_index,
                                            const TensorView& q2k_count,
                                            const BlockSparseOptions& o) {
  cuda_sm90::SparseKeyListArgs s;
  s.q2k_index = static_cast<const std::int32_t*>(q2k_index.data);
  s.index_batch = q2k_index.stride[0], s.index_head = q2k_index.stride[1];
  s.index_tile = q2k_index.stride[2];
  s.q2k_count = static_cast<const std::int32_t*>(q2k_count.data);
  s.count_batch = q2k_count.stride[0], s.count_head = q2k_count.stride[1];
  s.count_tile = q2k_count.stride[2];
  s.kv_block_sizes =
      o.kv_block_sizes ? static_cast<const std::int32_t*>(o.kv_block_sizes->data) : nullptr;
  s.tile_volume = static_cast<int>(p.tile_volume);
  s.max_k = static_cast<int>(p.max_k);
  s.q_tiles = static_cast<int>(p.q_tiles);
  s.kv_tiles = static_cast<int>(p.kv_tiles);
  return s;
}
#endif

// The sm_90a forward (attention/sm90) when this device, build and layout allow it; with
// `combine`, its fused-combination kernel when that one can run. Returns whether it launched.
// The arguments were validated by the core; this only decides whether the kernels can take
// them.
bool try_sm90_forward(const BlockSparseProblem& p, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& q2k_index,
                      const TensorView& q2k_count, const TensorView& out, const TensorView& lse,
                      const BlockSparseOptions& o, cudaStream_t stream,
                      const detail::CombineViews* combine = nullptr) {
#ifdef VIDATTN_WITH_CUTLASS
  if (!sm90_sparse_fits(p, q2k_index, o, {&q, &k, &v, &out})) return false;
  cuda_sm90::CombineArgs combine_args;
  if (combine) {  // the fused kernel: 64-token tiles, views it addresses in 16-byte chunks
    if (p.tile_volume != 64) return false;
    for (const TensorView* t : {combine->coarse, combine->gate, combine->out})
      if (t && !cuda_dispatch::tma_compatible(*t)) return false;
    combine_args.out = combine->out->data;
    combine_args.out_strides = token_strides(*combine->out, false);
    if (combine->gate) {
      combine_args.gate = combine->gate->data;
      combine_args.gate_strides = token_strides(*combine->gate, false);
    }
    const TensorView& c = *combine->coarse;
    combine_args.coarse = c.data;
    combine_args.coarse_batch = c.stride[0];
    combine_args.coarse_tile = c.stride[1];
    combine_args.coarse_head = c.stride[2];
  }

  // TMA-compatible (checked above): every row starts on 16 bytes.
  AttentionParams kp = layout_params(q, k, v, out, lse, p.batch, p.heads_q, p.heads_kv,
                                     p.seqlen_q, p.seqlen_k, p.scale, false);
  kp.out_aligned4 = true;
  kp.tile_volume = static_cast<int>(p.tile_volume);
  if (o.q_block_sizes) {  // the epilogue zeroes padded query slots (out 0, lse -inf)
    kp.q_block_sizes = static_cast<const std::int32_t*>(o.q_block_sizes->data);
    kp.q_block_sizes_stride = o.q_block_sizes->stride[0];
  }
  kp.sm_margin = o.sm_margin;
  const cuda_sm90::SparseKeyListArgs s = sm90_key_lists(p, q2k_index, q2k_count, o);

  bool launched = false;
  dispatch_dtype_head_dim(p.dtype, p.head_dim, [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    launched = combine ? cuda_sm90::launch_sparse_combine_forward<T, D>(kp, s, combine_args, stream)
                       : cuda_sm90::launch_sparse_forward<T, D>(kp, s, stream);
  });
  return launched;
#else
  (void)p, (void)q, (void)k, (void)v, (void)q2k_index, (void)q2k_count, (void)out, (void)lse,
      (void)o, (void)stream, (void)combine;
  return false;
#endif
}

}  // namespace

bool cuda_block_sparse_forward(const BlockSparseProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v,
                               const TensorView& q2k_index, const TensorView& q2k_count,
                               const TensorView& out, const TensorView& lse,
                               const BlockSparseOptions& o, const CombineViews* combine) {
  constexpr const char* kFn = "vidattn::block_sparse_attention_forward";
  check_supported(kFn, p);
  if (out.numel() == 0 && lse.numel() == 0) return false;
  const DeviceGuard device(p.device.index);
  const auto stream = static_cast<cudaStream_t>(o.stream);
  if (o.validate_index)
    cuda_vsa::check_block_sparse_index(kFn, q2k_index, q2k_count, p.kv_tiles,
                                       optional_view(o.q_block_sizes),
                                       optional_view(o.kv_block_sizes), p.tile_volume, stream);
  if (combine && try_sm90_forward(p, q, k, v, q2k_index, q2k_count, out, lse, o, stream, combine))
    return true;
  if (try_sm90_forward(p, q, k, v, q2k_index, q2k_count, out, lse, o, stream)) return false;
  AttentionParams kp = sparse_params(p, q, k, v, q2k_index, q2k_count, out, lse, o);
  kp.out_aligned4 = rows_aligned(out, 4);
  cuda_dispatch::dispatch_sm80_head_dims(p.dtype, p.head_dim, p.head_dim_v,
                                         [&](auto t, auto d, auto padded) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    constexpr bool kPadded = decltype(padded)::value;
    // A CTA's query block must stay inside one query tile. Widths above 192 run 64-row blocks
    // for every tile volume (sm80/fwd_kernel.h, FwdConfig), in the 64-row instance.
    if constexpr (D > 192) {
      cuda_sm80::launch_block_sparse_forward<T, D, 64, kPadded>(kp, stream);
    } else {
      if (p.tile_volume == 64) cuda_sm80::launch_block_sparse_forward<T, D, 64, kPadded>(kp, stream);
      else cuda_sm80::launch_block_sparse_forward<T, D, 128, kPadded>(kp, stream);
    }
  });
  return false;
}

void cuda_block_sparse_backward(const BlockSparseProblem& p, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& lse, const TensorView& grad_out,
                                const TensorView& q2k_index, const TensorView& q2k_count,
                                const TensorView& k2q_offsets, const TensorView& k2q_index,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                const BlockSparseOptions& o) {
  constexpr const char* kFn = "vidattn::block_sparse_attention_backward";
  check_supported(kFn, p);
  if (dq.numel() == 0 && dk.numel() == 0) return;
  const DeviceGuard device(p.device.index);
  const auto stream = static_cast<cudaStream_t>(o.stream);
  AttentionParams kp = sparse_params(p, q, k, v, q2k_index, q2k_count, out, lse, o);
  kp.grad_out = grad_out.data;
  kp.grad_out_strides = token_strides(grad_out, false);
  kp.dq = dq.data, kp.dk = dk.data, kp.dv = dv.data;
  kp.dq_strides = token_strides(dq, false);
  kp.dk_strides = token_strides(dk, false);
  kp.dv_strides = token_strides(dv, false);
  kp.aligned16 = kp.aligned16 && rows_aligned(grad_out, 16);
  kp.out_aligned4 = rows_aligned(dq, 4) && rows_aligned(dk, 4) && rows_aligned(dv, 4);
  kp.k2q_offsets = static_cast<const std::int32_t*>(k2q_offsets.data);
  kp.k2q_index = static_cast<const std::int32_t*>(k2q_index.data);
  for (int d = 0; d < 3; ++d) {
    kp.k2q_offsets_strides[d] = k2q_offsets.stride[d];
    kp.k2q_index_strides[d] = k2q_index.stride[d];
  }
#ifdef VIDATTN_WITH_CUTLASS
  if (sm90_sparse_fits(p, q2k_index, o, {&q, &k, &v, &out, &grad_out})) {
    const cuda_sm90::SparseKeyListArgs s = sm90_key_lists(p, q2k_index, q2k_count, o);
    bool launched = false;
    dispatch_dtype_head_dim(p.dtype, p.head_dim, [&](auto t, auto d) {
      launched = cuda_sm90::launch_sparse_backward<decltype(t), decltype(d)::value>(
          kp, s, o.deterministic, stream);
    });
    if (launched) return;
  }
#endif

  // rowsum(dO * O) workspace, stream-ordered (capturable).
  const cuda_common::DeviceWorkspace delta(
      static_cast<std::size_t>(kp.rows_q * kp.heads_q) * sizeof(float), stream,
      "the backward's row sums");
  kp.delta = delta.as<float>();
  cuda_dispatch::dispatch_sm80_head_dims(p.dtype, p.head_dim, p.head_dim_v,
                                         [&](auto t, auto d, auto padded) {
    cuda_sm80::launch_block_sparse_backward<decltype(t), decltype(d)::value,
                                            decltype(padded)::value>(kp, stream);
  });
}

}  // namespace vidattn::detail
