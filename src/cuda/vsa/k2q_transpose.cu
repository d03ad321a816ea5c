// The transposed block-sparse index (k2q lists: for each key tile, the query tiles that
// selected it, ascending), built on the device for the backward's dK / dV loop
// (detail::cuda_block_sparse_transpose_index, core/vsa_backends.h).
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/check.h"
#include "core/vsa_backends.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "index_check.h"

namespace vidattn::cuda_vsa {
namespace {

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
  cuda_common::check_last_launch("block-sparse transpose kernel launch");
}


}  // namespace
}  // namespace vidattn::cuda_vsa

namespace vidattn::detail {

void cuda_block_sparse_transpose_index(const TensorView& q2k_index, const TensorView& q2k_count,
                                       std::int64_t num_kv_tiles, const TensorView& k2q_offsets,
                                       const TensorView& k2q_index, void* stream_ptr,
                                       bool validate_index) {
  constexpr const char* kFn = "vidattn::block_sparse_transpose_index";
  if (q2k_index.shape[2] * std::max<std::int64_t>(q2k_index.shape[3], 1) > INT_MAX ||
      num_kv_tiles > INT_MAX || q2k_index.shape[0] * q2k_index.shape[1] > INT_MAX)
    throw NotImplementedError(
        concat(kFn, ": the CUDA backend needs Qtiles * MaxK, KVtiles and B * H below 2^31"));
  if (k2q_offsets.numel() == 0) return;
  const cuda_common::DeviceGuard device(q2k_index.device.index);
  const auto stream = static_cast<cudaStream_t>(stream_ptr);
  if (validate_index)
    cuda_vsa::check_block_sparse_index(kFn, q2k_index, q2k_count, num_kv_tiles, nullptr, nullptr,
                                       64, stream);
  cuda_vsa::launch_transpose(q2k_index, q2k_count, num_kv_tiles, k2q_offsets, k2q_index, stream);
}

}  // namespace vidattn::detail
