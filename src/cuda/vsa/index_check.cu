// The device check of a block-sparse index (q2k lists and tile sizes) against the rules of
// docs/vsa.md section 4: one small kernel and an 8-byte read-back, the one host
// synchronisation of the block-sparse ops, skipped while the stream is being captured.
#include "index_check.h"

#include <algorithm>
#include <climits>
#include <cstdint>

#include "core/check.h"
#include "cuda/common/check.h"
#include "cuda/common/workspace.h"

namespace vidattn::cuda_vsa {
namespace {

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
}  // namespace

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
void check_block_sparse_index(const char* fn, const TensorView& index, const TensorView& count,
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
  cuda_common::check_cuda(status, "block-sparse index check");
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


}  // namespace vidattn::cuda_vsa
