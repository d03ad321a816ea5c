// Host entry points of the CUDA block-sparse attention (VSA's fine branch, sm_80 and newer):
// the index check, the k2q transpose (both small kernels of this file), and the dispatch to
// the dense attention kernels' sparse instantiations (fwd_kernel.h, bwd_kernels.h).
//
// Nothing here synchronises with the host except the index check of the forward and of the
// transpose, which is skipped while the stream is being captured into a CUDA graph (vsa.h
// documents the contract).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <optional>
#include <utility>

#include "../../core/backends.h"
#include "../../core/check.h"
#include "../../core/vsa_backends.h"
#include "../device_workspace.h"
#include "host_common.h"
#include "launch.h"
#include "params.h"

namespace vidattn::cuda_sm80 {
namespace {

// ---- index check ------------------------------------------------------------------------

enum IndexFault : int {
  kBadCount = 1,
  kOutOfRange = 2,
  kNotAscending = 4,
  kBadQSize = 8,
  kBadKvSize = 16,
};

struct IndexCheckParams {
  const std::int32_t* index = nullptr;  // [B, H, Qt, K]
  std::int64_t is[4] = {};
  const std::int32_t* count = nullptr;  // [B, H, Qt]
  std::int64_t cs[3] = {};
  const std::int32_t* q_sizes = nullptr;
  const std::int32_t* kv_sizes = nullptr;
  std::int64_t q_sizes_stride = 1, kv_sizes_stride = 1;
  std::int64_t heads = 0, q_tiles = 0, max_k = 0, kv_tiles = 0, rows = 0;
  int tile_volume = 64;
};

// One thread per (b, h, query tile) row, then per tile size. flag[0] collects fault bits,
// flag[1] the lowest faulty row (atomicOr / atomicMin: the result does not depend on order).
__global__ void __launch_bounds__(256)
    block_sparse_attention_check_index_kernel(const IndexCheckParams p, int* flag) {
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t r = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
       r < p.rows; r += stride) {
    const std::int64_t t = r % p.q_tiles, bh = r / p.q_tiles;
    const std::int64_t b = bh / p.heads, h = bh % p.heads;
    const std::int32_t n = p.count[b * p.cs[0] + h * p.cs[1] + t * p.cs[2]];
    int fault = 0;
    if (n < 0 || n > p.max_k) {
      fault = kBadCount;
    } else {
      const std::int32_t* row = p.index + b * p.is[0] + h * p.is[1] + t * p.is[2];
      std::int64_t prev = -1;
      for (std::int32_t s = 0; s < n; ++s) {
        const std::int32_t j = row[s * p.is[3]];
        if (j < 0 || j >= p.kv_tiles) fault |= kOutOfRange;
        else if (j <= prev) fault |= kNotAscending;
        prev = j;
      }
    }
    if (fault) {
      atomicOr(flag, fault);
      atomicMin(flag + 1, static_cast<int>(r < INT_MAX ? r : INT_MAX));
    }
  }
  const std::int64_t first = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x;
  for (std::int64_t i = first; p.q_sizes && i < p.q_tiles; i += stride) {
    const std::int32_t s = p.q_sizes[i * p.q_sizes_stride];
    if (s < 0 || s > p.tile_volume) atomicOr(flag, kBadQSize);
  }
  for (std::int64_t i = first; p.kv_sizes && i < p.kv_tiles; i += stride) {
    const std::int32_t s = p.kv_sizes[i * p.kv_sizes_stride];
    if (s < 0 || s > p.tile_volume) atomicOr(flag, kBadKvSize);
  }
}

// Whether work queued on `stream` now would be captured into a graph (then no host
// synchronisation is allowed). An error of the query (the legacy stream while another
// stream captures globally) counts as capturing.
bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

// Checks the index (and the block sizes when given) on the device: one small kernel and an
// 8-byte copy to the host, which waits for the stream. Skipped while capturing.
void check_index_on_device(const char* fn, const TensorView& index, const TensorView& count,
                           std::int64_t kv_tiles, const TensorView* q_sizes,
                           const TensorView* kv_sizes, std::int64_t tile_volume,
                           cudaStream_t stream) {
  if (stream_is_capturing(stream)) return;
  IndexCheckParams p;
  p.index = static_cast<const std::int32_t*>(index.data);
  p.count = static_cast<const std::int32_t*>(count.data);
  for (int d = 0; d < 4; ++d) p.is[d] = index.stride[d];
  for (int d = 0; d < 3; ++d) p.cs[d] = count.stride[d];
  p.heads = index.shape[1];
  p.q_tiles = index.shape[2];
  p.max_k = index.shape[3];
  p.kv_tiles = kv_tiles;
  p.rows = index.shape[0] * index.shape[1] * index.shape[2];
  p.tile_volume = static_cast<int>(tile_volume);
  if (q_sizes && q_sizes->numel() > 0) {
    p.q_sizes = static_cast<const std::int32_t*>(q_sizes->data);
    p.q_sizes_stride = q_sizes->stride[0];
  }
  if (kv_sizes && kv_sizes->numel() > 0) {
    p.kv_sizes = static_cast<const std::int32_t*>(kv_sizes->data);
    p.kv_sizes_stride = kv_sizes->stride[0];
  }
  const std::int64_t work = std::max(p.rows, std::max(p.q_sizes ? p.q_tiles : 0, p.kv_sizes ? kv_tiles : 0));
  if (work == 0) return;
  int host[2] = {0, INT_MAX};
  cudaError_t status = cudaSuccess;
  {
    const cuda_common::DeviceWorkspace flags(2 * sizeof(int), stream, "the block-sparse index check");
    int* flag = flags.as<int>();
    status = cudaMemsetAsync(flag, 0, sizeof(int), stream);
    if (status == cudaSuccess) status = cudaMemsetAsync(flag + 1, 0x7f, sizeof(int), stream);
    if (status == cudaSuccess) {
      const unsigned blocks = static_cast<unsigned>(std::min<std::int64_t>((work + 255) / 256, 1024));
      block_sparse_attention_check_index_kernel<<<blocks, 256, 0, stream>>>(p, flag);
      status = cudaGetLastError();
    }
    if (status == cudaSuccess)
      status = cudaMemcpyAsync(host, flag, sizeof(host), cudaMemcpyDeviceToHost, stream);
    if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  }
  check_cuda(status, "block-sparse index check");
  if (host[0] == 0) return;
  const std::int64_t r = host[1];
  const std::int64_t H = p.heads, Qt = p.q_tiles;
  const auto where = detail::concat(" (first faulty row q2k_index[", r / (H * Qt), ", ",
                                    (r / Qt) % H, ", ", r % Qt, "]; checked on the device)");
  if (host[0] & kBadCount)
    detail::throw_value_error(fn, ": q2k_count holds counts outside [0, ", p.max_k,
                              "]; counts must lie in [0, MaxK]", where);
  if (host[0] & kOutOfRange)
    detail::throw_value_error(fn, ": q2k_index holds a tile id out of range for ", kv_tiles,
                              " key tiles", where);
  if (host[0] & kNotAscending)
    detail::throw_value_error(fn, ": each q2k_index row must be strictly ascending in its first "
                              "q2k_count entries", where);
  if (host[0] & kBadQSize)
    detail::throw_value_error(fn, ": q_block_sizes must lie in [0, ", tile_volume, "]");
  detail::throw_value_error(fn, ": kv_block_sizes must lie in [0, ", tile_volume, "]");
}

// ---- k2q transpose ----------------------------------------------------------------------

struct TransposeParams {
  const std::int32_t* index = nullptr;  // q2k [B, H, Qt, K]
  std::int64_t is[4] = {};
  const std::int32_t* count = nullptr;  // [B, H, Qt]
  std::int64_t cs[3] = {};
  std::int32_t* offsets = nullptr;  // [B, H, Kt + 1]
  std::int64_t os[3] = {};
  std::int32_t* k2q = nullptr;  // [B, H, Qt * K]
  std::int64_t ks[3] = {};
  int heads = 0, q_tiles = 0, max_k = 0, kv_tiles = 0;
  bool shared_cursors = false;  // the Kt cursors fit shared memory; else they live in offsets
};

constexpr int kTransposeThreads = 256;

// One CTA per (b, h): count the entries per key tile (integer atomics: the counts do not
// depend on order), exclusive scan, then a fill row by row in ascending query-tile order.
// The ids of one valid row are distinct, so a row's entries go to distinct cursors; the
// barrier between rows keeps every key tile's list ascending. No sort, deterministic.
// Cursor j is kept at offsets[j + 1] (or in shared memory): it starts at the list's
// beginning and ends at its end, which is the next list's beginning, i.e. offsets[j + 1].
__global__ void __launch_bounds__(kTransposeThreads)
    block_sparse_attention_transpose_kernel(const TransposeParams p) {
  extern __shared__ std::int32_t shared_cursor[];
  __shared__ std::int32_t warp_sums[kTransposeThreads / 32];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const std::int64_t b = blockIdx.x / p.heads, h = blockIdx.x % p.heads;
  const std::int32_t* index = p.index + b * p.is[0] + h * p.is[1];
  const std::int32_t* count = p.count + b * p.cs[0] + h * p.cs[1];
  std::int32_t* offsets = p.offsets + b * p.os[0] + h * p.os[1];
  std::int32_t* k2q = p.k2q + b * p.ks[0] + h * p.ks[1];
  const std::int64_t entries = static_cast<std::int64_t>(p.q_tiles) * p.max_k;
  auto cursor = [&](int j) -> std::int32_t* {
    return p.shared_cursors ? shared_cursor + j : offsets + (j + 1) * p.os[2];
  };
  auto count_of = [&](int t) {
    const std::int32_t n = count[t * p.cs[2]];
    return n < 0 ? 0 : (n > p.max_k ? p.max_k : n);
  };
  auto tile_at = [&](int t, int s) {  // -1 for ids out of range (skipped)
    const std::int32_t j = index[t * p.is[2] + s * p.is[3]];
    return j >= 0 && j < p.kv_tiles ? j : -1;
  };

  for (int j = tid; j < p.kv_tiles; j += kTransposeThreads) *cursor(j) = 0;
  __syncthreads();
  for (std::int64_t e = tid; e < entries; e += kTransposeThreads) {
    const int t = static_cast<int>(e / p.max_k), s = static_cast<int>(e % p.max_k);
    if (s >= count_of(t)) continue;
    const int j = tile_at(t, s);
    if (j >= 0) atomicAdd(cursor(j), 1);
  }
  __syncthreads();

  // Exclusive scan of the counts, 256 at a time, with a running carry.
  std::int32_t carry = 0;
  for (int base = 0; base < p.kv_tiles; base += kTransposeThreads) {
    const int j = base + tid;
    const std::int32_t v = j < p.kv_tiles ? *cursor(j) : 0;
    std::int32_t x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
      const std::int32_t y = __shfl_up_sync(0xffffffffu, x, o);
      if (lane >= o) x += y;
    }
    if (lane == 31) warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
      std::int32_t w = lane < kTransposeThreads / 32 ? warp_sums[lane] : 0;
#pragma unroll
      for (int o = 1; o < kTransposeThreads / 32; o <<= 1) {
        const std::int32_t y = __shfl_up_sync(0xffffffffu, w, o);
        if (lane >= o) w += y;
      }
      if (lane < kTransposeThreads / 32) warp_sums[lane] = w;
    }
    __syncthreads();
    if (j < p.kv_tiles) *cursor(j) = carry + (warp > 0 ? warp_sums[warp - 1] : 0) + x - v;
    carry += warp_sums[kTransposeThreads / 32 - 1];
    __syncthreads();  // warp_sums is rewritten by the next chunk
  }
  const std::int64_t total = carry;

  // Fill, one query tile after the other; the next row's entry is fetched before the barrier.
  int n_next = p.q_tiles > 0 ? count_of(0) : 0;
  int j_next = tid < n_next ? tile_at(0, tid) : -1;
  for (int t = 0; t < p.q_tiles; ++t) {
    const int n = n_next, j0 = j_next;
    if (t + 1 < p.q_tiles) {
      n_next = count_of(t + 1);
      j_next = tid < n_next ? tile_at(t + 1, tid) : -1;
    }
    auto place = [&](int j) {
      if (j < 0) return;
      const std::int32_t pos = (*cursor(j))++;
      if (pos >= 0 && pos < entries) k2q[pos * p.ks[2]] = t;
    };
    if (tid < n) place(j0);
    for (int s = tid + kTransposeThreads; s < n; s += kTransposeThreads) place(tile_at(t, s));
    __syncthreads();
  }

  if (p.shared_cursors)
    for (int j = tid; j < p.kv_tiles; j += kTransposeThreads) offsets[(j + 1) * p.os[2]] = *cursor(j);
  if (tid == 0) offsets[0] = 0;
  for (std::int64_t e = total + tid; e < entries; e += kTransposeThreads) k2q[e * p.ks[2]] = -1;
}

constexpr int kSharedCursorBytes = 48 * 1024;

void launch_transpose(const TensorView& index, const TensorView& count, std::int64_t kv_tiles,
                      const TensorView& offsets, const TensorView& k2q, cudaStream_t stream) {
  const std::int64_t B = index.shape[0], H = index.shape[1];
  if (B * H == 0) return;
  TransposeParams p;
  p.index = static_cast<const std::int32_t*>(index.data);
  p.count = static_cast<const std::int32_t*>(count.data);
  p.offsets = static_cast<std::int32_t*>(offsets.data);
  p.k2q = static_cast<std::int32_t*>(k2q.data);
  for (int d = 0; d < 4; ++d) p.is[d] = index.stride[d];
  for (int d = 0; d < 3; ++d) p.cs[d] = count.stride[d], p.os[d] = offsets.stride[d], p.ks[d] = k2q.stride[d];
  p.heads = static_cast<int>(H);
  p.q_tiles = static_cast<int>(index.shape[2]);
  p.max_k = static_cast<int>(index.shape[3]);
  p.kv_tiles = static_cast<int>(kv_tiles);
  const std::int64_t cursor_bytes = kv_tiles * static_cast<std::int64_t>(sizeof(std::int32_t));
  p.shared_cursors = cursor_bytes <= kSharedCursorBytes;
  const int smem = p.shared_cursors ? static_cast<int>(cursor_bytes) : 0;
  block_sparse_attention_transpose_kernel<<<static_cast<unsigned>(B * H), kTransposeThreads, smem,
                                            stream>>>(p);
  check_cuda(cudaGetLastError(), "block-sparse transpose kernel launch");
}

// ---- attention --------------------------------------------------------------------------

void check_supported(const char* fn, const BlockSparseProblem& p) {
  if (p.dtype != DType::kBFloat16 && p.dtype != DType::kFloat16)
    throw NotImplementedError(detail::concat(
        fn, ": the CUDA backend supports bfloat16 and float16 inputs, got ", dtype_name(p.dtype),
        "; cast to bfloat16 / float16 or use CPU tensors"));
  if ((p.head_dim != 64 && p.head_dim != 128) || p.head_dim_v != p.head_dim)
    throw NotImplementedError(detail::concat(
        fn, ": the CUDA backend supports head dims D = Dv = 64 or 128, got D = ", p.head_dim,
        ", Dv = ", p.head_dim_v, "; pad the head dim or use CPU tensors"));
  if (p.heads_q > 65535 || p.batch > 65535)
    throw NotImplementedError(detail::concat(fn, ": the CUDA backend supports at most 65535 heads",
                                             " and a batch of 65535, got Hq = ", p.heads_q,
                                             ", B = ", p.batch));
  if (p.q_tiles * std::max<std::int64_t>(p.max_k, 1) > INT_MAX || p.kv_tiles > INT_MAX)
    throw NotImplementedError(detail::concat(fn, ": the CUDA backend needs Qtiles * MaxK (",
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

// The sm_90a forward (src/cuda/sm90) when this device, build and layout allow it (with
// `combine`: its fused-combination kernel, when that one can run).
bool try_sm90_forward(const BlockSparseProblem& p, const TensorView& q, const TensorView& k,
                      const TensorView& v, const TensorView& q2k_index,
                      const TensorView& q2k_count, const TensorView& out, const TensorView& lse,
                      const BlockSparseOptions& o, cudaStream_t stream,
                      const detail::CombineViews* combine = nullptr) {
#ifdef VIDATTN_WITH_CUTLASS
  if (p.head_dim != p.head_dim_v || p.batch * p.seqlen_q > INT32_MAX ||
      p.batch * p.seqlen_k > INT32_MAX)
    return false;
  if (p.max_k > 1 && q2k_index.stride[3] != 1) return false;
  if (o.kv_block_sizes && p.kv_tiles > 1 && o.kv_block_sizes->stride[0] != 1) return false;
  const double scale = p.scale;
  // Its epilogue writes the padded query slots (out 0, lse -inf).
  return detail::cuda_sm90_block_sparse_forward(q, k, v, out, lse, q2k_index, q2k_count,
                                                optional_view(o.kv_block_sizes),
                                                static_cast<int>(p.tile_volume), scale,
                                                o.sm_margin, stream, optional_view(o.q_block_sizes),
                                                combine);
#else
  (void)p, (void)q, (void)k, (void)v, (void)q2k_index, (void)q2k_count, (void)out, (void)lse,
      (void)o, (void)stream, (void)combine;
  return false;
#endif
}

}  // namespace
}  // namespace vidattn::cuda_sm80

namespace vidattn::detail {

bool cuda_block_sparse_forward(const BlockSparseProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v,
                               const TensorView& q2k_index, const TensorView& q2k_count,
                               const TensorView& out, const TensorView& lse,
                               const BlockSparseOptions& o, const CombineViews* combine) {
  using namespace cuda_sm80;
  constexpr const char* kFn = "vidattn::block_sparse_attention_forward";
  check_supported(kFn, p);
  if (out.numel() == 0 && lse.numel() == 0) return false;
  const DeviceScope device(p.device.index);
  const auto stream = static_cast<cudaStream_t>(o.stream);
  if (o.validate_index)
    check_index_on_device(kFn, q2k_index, q2k_count, p.kv_tiles, optional_view(o.q_block_sizes),
                          optional_view(o.kv_block_sizes), p.tile_volume, stream);
  if (combine && try_sm90_forward(p, q, k, v, q2k_index, q2k_count, out, lse, o, stream, combine))
    return true;
  if (try_sm90_forward(p, q, k, v, q2k_index, q2k_count, out, lse, o, stream)) return false;
  AttentionParams kp = sparse_params(p, q, k, v, q2k_index, q2k_count, out, lse, o);
  kp.out_aligned4 = rows_aligned(out, 4);
  dispatch_dtype_head_dim(p.dtype == DType::kBFloat16, p.head_dim, [&](auto t, auto d) {
    using T = decltype(t);
    constexpr int D = decltype(d)::value;
    // A CTA's query block must stay inside one query tile.
    if (p.tile_volume == 64) launch_block_sparse_forward<T, D, 64>(kp, stream);
    else launch_block_sparse_forward<T, D, 128>(kp, stream);
  });
  return false;
}

void cuda_block_sparse_transpose_index(const TensorView& q2k_index, const TensorView& q2k_count,
                                       std::int64_t num_kv_tiles, const TensorView& k2q_offsets,
                                       const TensorView& k2q_index, void* stream_ptr,
                                       bool validate_index) {
  using namespace cuda_sm80;
  constexpr const char* kFn = "vidattn::block_sparse_transpose_index";
  if (q2k_index.shape[2] * std::max<std::int64_t>(q2k_index.shape[3], 1) > INT_MAX ||
      num_kv_tiles > INT_MAX || q2k_index.shape[0] * q2k_index.shape[1] > INT_MAX)
    throw NotImplementedError(
        detail::concat(kFn, ": the CUDA backend needs Qtiles * MaxK, KVtiles and B * H below 2^31"));
  if (k2q_offsets.numel() == 0) return;
  const DeviceScope device(q2k_index.device.index);
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (validate_index)
    check_index_on_device(kFn, q2k_index, q2k_count, num_kv_tiles, nullptr, nullptr, 64, stream);
  launch_transpose(q2k_index, q2k_count, num_kv_tiles, k2q_offsets, k2q_index, stream);
}

void cuda_block_sparse_backward(const BlockSparseProblem& p, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& lse, const TensorView& grad_out,
                                const TensorView& q2k_index, const TensorView& q2k_count,
                                const TensorView& k2q_offsets, const TensorView& k2q_index,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                const BlockSparseOptions& o) {
  using namespace cuda_sm80;
  constexpr const char* kFn = "vidattn::block_sparse_attention_backward";
  check_supported(kFn, p);
  if (dq.numel() == 0 && dk.numel() == 0) return;
  const DeviceScope device(p.device.index);
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

  // rowsum(dO * O) workspace, stream-ordered (capturable).
  const cuda_common::DeviceWorkspace delta(
      static_cast<std::size_t>(kp.rows_q * kp.heads_q) * sizeof(float), stream,
      "the backward's row sums");
  kp.delta = delta.as<float>();
  dispatch_dtype_head_dim(p.dtype == DType::kBFloat16, p.head_dim, [&](auto t, auto d) {
    launch_block_sparse_backward<decltype(t), decltype(d)::value>(kp, stream);
  });
}

}  // namespace vidattn::detail
