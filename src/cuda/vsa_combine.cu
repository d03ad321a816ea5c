// CUDA kernels of the fused VSA combine (vidattn/vsa_combine.h). Memory bound: the forward
// streams fine and gate once in 16-byte vectors where aligned; the backward gives each
// (batch, tile, head) one block that writes grad_gate and reduces grad_coarse over the tile's
// slots in registers and shared memory (fixed order: deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "dtype_io.cuh"
#include "vsa_combine_launch.h"

namespace vidattn::detail {
namespace {

// VEC consecutive elements moved as one 16-byte access (VEC * sizeof(T) == 16) or one by one.
template <class T, int VEC>
struct alignas(VEC * sizeof(T)) Chunk {
  T v[VEC];
};

template <class T, int VEC>
__device__ Chunk<T, VEC> load_chunk(const T* p) {
  return *reinterpret_cast<const Chunk<T, VEC>*>(p);
}
template <class T, int VEC>
__device__ void store_chunk(T* p, const Chunk<T, VEC>& c) {
  *reinterpret_cast<Chunk<T, VEC>*>(p) = c;
}

template <class T, class Acc, int VEC>
__global__ void vsa_combine_kernel(const CombineLaunchParams p) {
  const std::int64_t chunks = p.head_dim / VEC;
  const std::int64_t slots = p.tiles * p.tile_volume;
  const std::int64_t total = p.batch * slots * p.heads * chunks;
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const std::int64_t c = i % chunks;
    std::int64_t r = i / chunks;
    const std::int64_t h = r % p.heads;
    r /= p.heads;
    const std::int64_t s = r % slots, b = r / slots;
    const std::int64_t tile = s / p.tile_volume;
    const bool valid = s % p.tile_volume < p.block_sizes[tile * p.block_sizes_stride];
    const T* fine = static_cast<const T*>(p.fine) + b * p.fine_stride[0] + s * p.fine_stride[1] +
                    h * p.fine_stride[2] + c * VEC;
    T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + s * p.out_stride[1] +
             h * p.out_stride[2] + c * VEC;
    Chunk<T, VEC> f = load_chunk<T, VEC>(fine);
    if (valid) {
      const T* coarse = static_cast<const T*>(p.coarse) + b * p.coarse_stride[0] +
                        tile * p.coarse_stride[1] + h * p.coarse_stride[2] + c * VEC;
      const Chunk<T, VEC> cv = load_chunk<T, VEC>(coarse);
      Chunk<T, VEC> g;
      if (p.gate) {
        g = load_chunk<T, VEC>(static_cast<const T*>(p.gate) + b * p.gate_stride[0] +
                               s * p.gate_stride[1] + h * p.gate_stride[2] + c * VEC);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const Acc gj = p.gate ? Io<T>::template load<Acc>(g.v[j]) : Acc(1);
        f.v[j] = Io<T>::template store<Acc>(Io<T>::template load<Acc>(f.v[j]) +
                                            gj * Io<T>::template load<Acc>(cv.v[j]));
      }
    }
    store_chunk<T, VEC>(out, f);
  }
}

constexpr int kBackwardThreads = 128;

// One block per (batch, tile, head). Threads split into `lanes` groups of slots times
// `per_pass` column chunks; lane partial sums meet in shared memory in lane order.
template <class T, class Acc, int VEC>
__global__ void __launch_bounds__(kBackwardThreads)
    vsa_combine_backward_kernel(const CombineLaunchParams p) {
  __shared__ Acc partial[kBackwardThreads * VEC];
  const std::int64_t h = blockIdx.x % p.heads;
  const std::int64_t tile = (blockIdx.x / p.heads) % p.tiles;
  const std::int64_t b = blockIdx.x / (p.heads * p.tiles);
  const int chunks = static_cast<int>(p.head_dim / VEC);
  const int lanes = chunks >= kBackwardThreads ? 1 : kBackwardThreads / chunks;
  const int per_pass = kBackwardThreads / lanes;
  const int lane = threadIdx.x / per_pass, col = threadIdx.x % per_pass;
  const int valid = p.block_sizes[tile * p.block_sizes_stride];
  const std::int64_t s0 = tile * p.tile_volume;
  const T* coarse = static_cast<const T*>(p.coarse) + b * p.coarse_stride[0] +
                    tile * p.coarse_stride[1] + h * p.coarse_stride[2];
  for (int pass = 0; pass < chunks; pass += per_pass) {
    const int c = pass + col;
    Acc acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = Acc(0);
    if (lane < lanes && c < chunks) {
      const Chunk<T, VEC> cv = load_chunk<T, VEC>(coarse + c * VEC);
      for (std::int64_t s = lane; s < p.tile_volume; s += lanes) {
        const std::int64_t slot = s0 + s;
        const bool ok = s < valid;
        if (ok) {
          const Chunk<T, VEC> go = load_chunk<T, VEC>(
              static_cast<const T*>(p.fine) + b * p.fine_stride[0] + slot * p.fine_stride[1] +
              h * p.fine_stride[2] + c * VEC);
          Chunk<T, VEC> g;
          if (p.gate)
            g = load_chunk<T, VEC>(static_cast<const T*>(p.gate) + b * p.gate_stride[0] +
                                   slot * p.gate_stride[1] + h * p.gate_stride[2] + c * VEC);
          Chunk<T, VEC> gg;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const Acc goj = Io<T>::template load<Acc>(go.v[j]);
            acc[j] += p.gate ? goj * Io<T>::template load<Acc>(g.v[j]) : goj;
            gg.v[j] = Io<T>::template store<Acc>(goj * Io<T>::template load<Acc>(cv.v[j]));
          }
          if (p.grad_gate)
            store_chunk<T, VEC>(static_cast<T*>(p.grad_gate) + b * p.grad_gate_stride[0] +
                                    slot * p.grad_gate_stride[1] + h * p.grad_gate_stride[2] +
                                    c * VEC,
                                gg);
        } else if (p.grad_gate) {
          Chunk<T, VEC> zero;
#pragma unroll
          for (int j = 0; j < VEC; ++j) zero.v[j] = Io<T>::template store<Acc>(Acc(0));
          store_chunk<T, VEC>(static_cast<T*>(p.grad_gate) + b * p.grad_gate_stride[0] +
                                  slot * p.grad_gate_stride[1] + h * p.grad_gate_stride[2] +
                                  c * VEC,
                              zero);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) partial[threadIdx.x * VEC + j] = acc[j];
    __syncthreads();
    if (lane == 0 && c < chunks) {
      Chunk<T, VEC> sum;
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        Acc total = Acc(0);
        for (int l = 0; l < lanes; ++l) total += partial[(l * per_pass + col) * VEC + j];
        sum.v[j] = Io<T>::template store<Acc>(total);
      }
      store_chunk<T, VEC>(static_cast<T*>(p.grad_coarse) + b * p.grad_coarse_stride[0] +
                              tile * p.grad_coarse_stride[1] + h * p.grad_coarse_stride[2] +
                              c * VEC,
                          sum);
    }
    __syncthreads();
  }
}

template <class Fn>
const char* visit_dtype(int dtype, Fn&& fn) {
  switch (dtype) {
    case 0: return fn(float{}, float{});
    case 1: return fn(__half{}, float{});
    case 2: return fn(__nv_bfloat16{}, float{});
    case 3: return fn(double{}, double{});
    default: return "vsa_combine: unsupported dtype";
  }
}

const char* status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : what;
}

}  // namespace

const char* launch_vsa_combine_cuda(const CombineLaunchParams& p) {
  const std::int64_t elems = p.batch * p.tiles * p.tile_volume * p.heads * p.head_dim;
  if (elems == 0) return nullptr;
  auto stream = static_cast<cudaStream_t>(p.stream);
  return visit_dtype(p.dtype, [&](auto t, auto acc) -> const char* {
    using T = decltype(t);
    using Acc = decltype(acc);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = p.vectorize && p.head_dim % kVec == 0;
    const std::int64_t work = vec ? elems / kVec : elems;
    const int threads = 256;
    const unsigned blocks = static_cast<unsigned>(
        work / threads + 1 < 65536LL * 16 ? work / threads + 1 : 65536LL * 16);
    if (vec)
      vsa_combine_kernel<T, Acc, kVec><<<blocks, threads, 0, stream>>>(p);
    else
      vsa_combine_kernel<T, Acc, 1><<<blocks, threads, 0, stream>>>(p);
    return status("vsa_combine kernel launch failed");
  });
}

const char* launch_vsa_combine_backward_cuda(const CombineLaunchParams& p) {
  const std::int64_t blocks = p.batch * p.tiles * p.heads;
  if (blocks == 0 || p.head_dim == 0) return nullptr;
  if (blocks > 0x7fffffff) return "vsa_combine_backward: too many (batch, tile, head) blocks";
  auto stream = static_cast<cudaStream_t>(p.stream);
  return visit_dtype(p.dtype, [&](auto t, auto acc) -> const char* {
    using T = decltype(t);
    using Acc = decltype(acc);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = p.vectorize && p.head_dim % kVec == 0;
    if (vec)
      vsa_combine_backward_kernel<T, Acc, kVec>
          <<<static_cast<unsigned>(blocks), kBackwardThreads, 0, stream>>>(p);
    else
      vsa_combine_backward_kernel<T, Acc, 1>
          <<<static_cast<unsigned>(blocks), kBackwardThreads, 0, stream>>>(p);
    return status("vsa_combine_backward kernel launch failed");
  });
}

}  // namespace vidattn::detail
