// Tile mean pooling on CUDA (tile_mean_pool and its backward): x [B, Tiles * V, H, D] ->
// out [B, Tiles, H, D], the mean over each tile's first block_sizes[t] slots, and the gradient
// grad_out [B, Tiles, H, D] -> grad_x [B, Tiles * V, H, D]. The CPU reference is
// cpu_tile_mean_pool / cpu_tile_mean_pool_backward (src/cpu/vsa_cpu.cpp).
//
// Block sizes cannot be checked without a host sync, so the kernels clamp them to
// [0, tile volume]; valid sizes give exactly the CPU results.
#include <cuda_runtime.h>

#include <cstdint>

#include "../../core/vsa_backends.h"
#include "../common/check.h"
#include "../common/device_guard.h"
#include "../common/dtype_dispatch.h"
#include "../common/dtype_io.cuh"
#include "launch_utils.h"

namespace vidattn::cuda_vsa {
namespace {

using cuda_common::Io;

// Forward: x -> out. Backward: grad_out (in x) -> grad_x (in out).
struct PoolParams {
  const void* x = nullptr;
  void* out = nullptr;
  const std::int32_t* block_sizes = nullptr;
  std::int64_t block_sizes_stride = 1;
  std::int64_t batch = 0, tiles = 0, heads = 0, head_dim = 0, tile_volume = 0;
  std::int64_t x_stride[3] = {};  // batch, slot or tile, head (unit-stride head dim)
  std::int64_t out_stride[3] = {};
};

__device__ __forceinline__ std::int64_t clamped_size(const PoolParams& p, std::int64_t t) {
  const std::int64_t n = p.block_sizes[t * p.block_sizes_stride];
  return n < 0 ? 0 : (n > p.tile_volume ? p.tile_volume : n);
}

// One thread per output element; the sum runs over the tile's slots in order, like the CPU
// backend, so float32 / float64 results match it bit for bit.
template <class T>
__global__ void vsa_tile_mean_pool_kernel(PoolParams p) {
  using Acc = cuda_common::AccumulatorOf<T>;
  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  const std::int64_t total = p.batch * p.tiles * p.heads * p.head_dim;
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const std::int64_t d = i % p.head_dim;
    std::int64_t r = i / p.head_dim;
    const std::int64_t h = r % p.heads;
    r /= p.heads;
    const std::int64_t t = r % p.tiles, b = r / p.tiles;
    const std::int64_t n = clamped_size(p, t);
    const T* src = x + b * p.x_stride[0] + t * p.tile_volume * p.x_stride[1] +
                   h * p.x_stride[2] + d;
    Acc sum = Acc(0);
#pragma unroll 4
    for (std::int64_t s = 0; s < n; ++s) sum += Io<T>::template load<Acc>(src[s * p.x_stride[1]]);
    const Acc inv = n > 0 ? Acc(1) / Acc(n) : Acc(0);
    out[b * p.out_stride[0] + t * p.out_stride[1] + h * p.out_stride[2] + d] =
        Io<T>::template store<Acc>(sum * inv);
  }
}

// grad_x[b, t * V + s, h, d] = grad_out[b, t, h, d] / n for s < n, else 0. A block is 8 rows
// (b, slot, h) of 32 lanes that stride over d: the row's index arithmetic (in `Index`, 32-bit
// when it fits) is paid once per row, not per element.
template <class T, class Index>
__global__ void vsa_tile_mean_pool_backward_kernel(PoolParams p) {
  using Acc = cuda_common::AccumulatorOf<T>;
  const auto* g = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  const Index V = Index(p.tile_volume), H = Index(p.heads), slots = Index(p.tiles) * V;
  const Index rows = Index(p.batch) * slots * H;
  const Index step = Index(gridDim.x) * blockDim.y;
  for (Index row = Index(blockIdx.x) * blockDim.y + threadIdx.y; row < rows; row += step) {
    const Index h = row % H, bs = row / H;
    const Index slot = bs % slots, b = bs / slots;
    const Index t = slot / V, s = slot % V;
    const std::int64_t n = clamped_size(p, t);
    const T* src = g + std::int64_t(b) * p.x_stride[0] + std::int64_t(t) * p.x_stride[1] +
                   std::int64_t(h) * p.x_stride[2];
    T* dst = out + std::int64_t(b) * p.out_stride[0] + std::int64_t(slot) * p.out_stride[1] +
             std::int64_t(h) * p.out_stride[2];
    const Acc inv = n > 0 ? Acc(1) / Acc(n) : Acc(0);
    for (std::int64_t d = threadIdx.x; d < p.head_dim; d += 32)
      dst[d] = Io<T>::template store<Acc>(s < n ? Io<T>::template load<Acc>(src[d]) * inv : Acc(0));
  }
}

// 16-byte vector forms of the two pooling kernels, for rows of D % (16 / sizeof(T)) == 0 on
// 16-byte aligned tensors (launch_pool checks). Each element keeps exactly the arithmetic of
// the scalar kernels (forward: a sum over the tile's slots in slot order, like the CPU
// backend), so every dtype stays bit-identical with the CPU op; only the memory access is wider.
template <class T>
union Vec16 {
  uint4 raw;
  T elem[16 / sizeof(T)];
};

// One thread per (b, t, h, 16-byte run of d); runs are the fastest index, so a warp reads whole
// rows of consecutive heads. kAhead slots are loaded before any is added: independent 16-byte
// loads in flight per thread, while the additions stay in slot order.
template <class T>
__global__ void __launch_bounds__(256) vsa_tile_mean_pool_vec_kernel(PoolParams p) {
  using Acc = cuda_common::AccumulatorOf<T>;
  constexpr int kRun = 16 / int(sizeof(T));
  constexpr int kAhead = 8;
  const auto* x = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  const std::int64_t runs = p.head_dim / kRun;
  const std::int64_t total = p.batch * p.tiles * p.heads * runs;
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const std::int64_t c = i % runs;
    std::int64_t r = i / runs;
    const std::int64_t h = r % p.heads;
    r /= p.heads;
    const std::int64_t t = r % p.tiles, b = r / p.tiles;
    const int n = int(clamped_size(p, t));
    const T* src = x + b * p.x_stride[0] + t * p.tile_volume * p.x_stride[1] +
                   h * p.x_stride[2] + c * kRun;
    Acc sum[kRun];
#pragma unroll
    for (int e = 0; e < kRun; ++e) sum[e] = Acc(0);
    for (int s0 = 0; s0 < n; s0 += kAhead) {
      Vec16<T> buf[kAhead];
#pragma unroll
      for (int u = 0; u < kAhead; ++u)
        buf[u].raw = s0 + u < n
                         ? __ldg(reinterpret_cast<const uint4*>(src + (s0 + u) * p.x_stride[1]))
                         : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < kAhead; ++u)
        if (s0 + u < n)
#pragma unroll
          for (int e = 0; e < kRun; ++e) sum[e] += Io<T>::template load<Acc>(buf[u].elem[e]);
    }
    const Acc inv = n > 0 ? Acc(1) / Acc(n) : Acc(0);
    Vec16<T> res;
#pragma unroll
    for (int e = 0; e < kRun; ++e) res.elem[e] = Io<T>::template store<Acc>(sum[e] * inv);
    *reinterpret_cast<uint4*>(out + b * p.out_stride[0] + t * p.out_stride[1] +
                              h * p.out_stride[2] + c * kRun) = res.raw;
  }
}

// One thread per (b, t, group of kSlots slots, h, 16-byte run of d): one load of grad_out, one
// conversion, then kSlots independent 16-byte stores (the value, or zeros past the tile's size).
constexpr int kPoolBwdSlots = 16;
template <class T>
__global__ void __launch_bounds__(256) vsa_tile_mean_pool_backward_vec_kernel(PoolParams p) {
  using Acc = cuda_common::AccumulatorOf<T>;
  constexpr int kRun = 16 / int(sizeof(T));
  const auto* g = static_cast<const T*>(p.x);
  auto* out = static_cast<T*>(p.out);
  const std::int64_t runs = p.head_dim / kRun;
  const std::int64_t groups = (p.tile_volume + kPoolBwdSlots - 1) / kPoolBwdSlots;
  const std::int64_t total = p.batch * p.tiles * groups * p.heads * runs;
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const std::int64_t c = i % runs;
    std::int64_t r = i / runs;
    const std::int64_t h = r % p.heads;
    r /= p.heads;
    const std::int64_t grp = r % groups;
    r /= groups;
    const std::int64_t t = r % p.tiles, b = r / p.tiles;
    const std::int64_t n = clamped_size(p, t);
    const Acc inv = n > 0 ? Acc(1) / Acc(n) : Acc(0);
    Vec16<T> in, val;
    in.raw = __ldg(reinterpret_cast<const uint4*>(g + b * p.x_stride[0] + t * p.x_stride[1] +
                                                  h * p.x_stride[2] + c * kRun));
#pragma unroll
    for (int e = 0; e < kRun; ++e)
      val.elem[e] = Io<T>::template store<Acc>(Io<T>::template load<Acc>(in.elem[e]) * inv);
    const std::int64_t s0 = grp * kPoolBwdSlots;
    T* dst = out + b * p.out_stride[0] + (t * p.tile_volume + s0) * p.out_stride[1] +
             h * p.out_stride[2] + c * kRun;
#pragma unroll 4
    for (int u = 0; u < kPoolBwdSlots; ++u) {
      const std::int64_t s = s0 + u;
      if (s >= p.tile_volume) break;
      // Zero bits are +0, what the scalar path stores (Io<T>::store(Acc(0))).
      *reinterpret_cast<uint4*>(dst + u * p.out_stride[1]) =
          s < n ? val.raw : make_uint4(0, 0, 0, 0);
    }
  }
}

void launch_pool(const char* what, const PoolParams& p, DType dtype, int device, bool backward,
                 void* stream_ptr) {
  const std::int64_t total =
      p.batch * p.tiles * p.heads * p.head_dim * (backward ? p.tile_volume : 1);
  if (total == 0) return;
  const cuda_common::DeviceGuard guard(device);
  constexpr int kThreads = 256;
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  const unsigned grid = grid_for(total, kThreads);
  cuda_common::dispatch_float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    // 16-byte runs of d when the row length, the pointers and every stride allow them.
    const std::int64_t run = 16 / std::int64_t(sizeof(T));
    bool vec = p.head_dim % run == 0 && aligned(p.x, 16) && aligned(p.out, 16);
    for (int d = 0; d < 3 && vec; ++d) vec = p.x_stride[d] % run == 0 && p.out_stride[d] % run == 0;
    if (vec) {
      const std::int64_t runs = p.batch * p.tiles * p.heads * (p.head_dim / run);
      if (backward) {
        const std::int64_t groups = (p.tile_volume + kPoolBwdSlots - 1) / kPoolBwdSlots;
        vsa_tile_mean_pool_backward_vec_kernel<T>
            <<<grid_for(runs * groups, kThreads), kThreads, 0, stream>>>(p);
      } else {
        vsa_tile_mean_pool_vec_kernel<T><<<grid_for(runs, kThreads), kThreads, 0, stream>>>(p);
      }
      return;
    }
    if (backward) {
      const std::int64_t rows = p.batch * p.tiles * p.tile_volume * p.heads;
      const dim3 block(32, 8);
      if (rows < (std::int64_t(1) << 31) - 65536 * 8)
        vsa_tile_mean_pool_backward_kernel<T, std::uint32_t>
            <<<grid_for(rows, 8), block, 0, stream>>>(p);
      else
        vsa_tile_mean_pool_backward_kernel<T, std::int64_t>
            <<<grid_for(rows, 8), block, 0, stream>>>(p);
    } else
      vsa_tile_mean_pool_kernel<T><<<grid, kThreads, 0, stream>>>(p);
  });
  cuda_common::check_last_launch(what);
}

PoolParams pool_params(const TensorView& x, const TensorView& block_sizes,
                       std::int64_t tile_volume, const TensorView& out) {
  PoolParams p;
  p.x = x.data, p.out = out.data;
  p.block_sizes = static_cast<const std::int32_t*>(block_sizes.data);
  p.block_sizes_stride = block_sizes.stride[0];
  p.batch = x.shape[0], p.tiles = block_sizes.shape[0], p.heads = x.shape[2];
  p.head_dim = x.shape[3], p.tile_volume = tile_volume;
  for (int d = 0; d < 3; ++d) p.x_stride[d] = x.stride[d], p.out_stride[d] = out.stride[d];
  return p;
}

}  // namespace
}  // namespace vidattn::cuda_vsa

namespace vidattn::detail {

void cuda_tile_mean_pool(const TensorView& x, const TensorView& block_sizes,
                         std::int64_t tile_volume, const TensorView& out, void* stream) {
  cuda_vsa::launch_pool("vidattn::tile_mean_pool kernel launch",
                        cuda_vsa::pool_params(x, block_sizes, tile_volume, out), x.dtype,
                        x.device.index, false, stream);
}

void cuda_tile_mean_pool_backward(const TensorView& grad_out, const TensorView& block_sizes,
                                  std::int64_t tile_volume, const TensorView& grad_x,
                                  void* stream) {
  cuda_vsa::launch_pool("vidattn::tile_mean_pool_backward kernel launch",
                        cuda_vsa::pool_params(grad_out, block_sizes, tile_volume, grad_x),
                        grad_out.dtype, grad_out.device.index, true, stream);
}

}  // namespace vidattn::detail
