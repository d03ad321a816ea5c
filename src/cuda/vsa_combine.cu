// CUDA kernels of the fused VSA combine (vidattn/vsa_combine.h). Memory bound: the forward
// streams fine and gate once in 16-byte vectors where aligned; the backward gives each
// (batch, tile, head) one block that writes grad_gate and reduces grad_coarse over the tile's
// slots in registers and shared memory (fixed order: deterministic).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "common/dtype_io.cuh"
#include "vsa_combine_launch.h"

namespace vidattn::detail {
namespace {

using cuda_common::Io;

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

// VEC values of a coarse row as Acc. The coarse type C may be wider than T (float32 coarse
// with 16-bit rows): VEC * sizeof(C) is then a whole number of 16-byte pieces.
template <class C, class Acc, int VEC>
__device__ void load_acc(const C* p, Acc (&out)[VEC]) {
  constexpr int kPiece = VEC * sizeof(C) >= 16 ? 16 / int(sizeof(C)) : VEC;
#pragma unroll
  for (int k = 0; k < VEC; k += kPiece) {
    const Chunk<C, kPiece> piece = load_chunk<C, kPiece>(p + k);
#pragma unroll
    for (int j = 0; j < kPiece; ++j) out[k + j] = Io<C>::template load<Acc>(piece.v[j]);
  }
}
template <class C, class Acc, int VEC>
__device__ void store_acc(C* p, const Acc (&in)[VEC]) {
  constexpr int kPiece = VEC * sizeof(C) >= 16 ? 16 / int(sizeof(C)) : VEC;
#pragma unroll
  for (int k = 0; k < VEC; k += kPiece) {
    Chunk<C, kPiece> piece;
#pragma unroll
    for (int j = 0; j < kPiece; ++j) piece.v[j] = Io<C>::template store<Acc>(in[k + j]);
    store_chunk<C, kPiece>(p + k, piece);
  }
}

// The two ways rows meet tiles. Tiled mode: row = slot, in tile slot / V, valid below the
// tile's block size. Row mode: row r holds token first_token + r, in tile token_to_slot / V;
// a row past the sequence (or a slot out of range) is in no tile.
__device__ std::int64_t tile_of_row(const CombineLaunchParams& p, std::int64_t row) {
  if (p.token_to_slot == nullptr) {
    const std::int64_t tile = row / p.tile_volume;
    return row % p.tile_volume < p.block_sizes[tile * p.block_sizes_stride] ? tile : -1;
  }
  const std::int64_t token = p.first_token + row;
  if (token >= p.num_tokens) return -1;
  const std::int64_t slot = p.token_to_slot[token];
  return slot >= 0 && slot < p.tiles * p.tile_volume ? slot / p.tile_volume : -1;
}

// Slot v of a tile: the row holding it (-1: none in this tensor) and whether it is a token
// (tiled mode: padded slots are rows too, whose gate gradient is written as 0).
struct SlotRow {
  std::int64_t row;
  bool token;
};
__device__ SlotRow row_of_slot(const CombineLaunchParams& p, std::int64_t tile, std::int64_t v,
                               int tile_size) {
  const std::int64_t slot = tile * p.tile_volume + v;
  if (p.slot_to_token == nullptr) return {slot, v < tile_size};
  const std::int64_t row = std::int64_t(p.slot_to_token[slot]) - p.first_token;
  const bool ok = p.slot_to_token[slot] >= 0 && row >= 0 && row < p.rows;
  return {ok ? row : -1, ok};
}

template <class T, class C, class Acc, int VEC>
__global__ void vsa_combine_kernel(const CombineLaunchParams p) {
  const std::int64_t chunks = p.head_dim / VEC;
  const std::int64_t total = p.batch * p.rows * p.heads * chunks;
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const std::int64_t c = i % chunks;
    std::int64_t r = i / chunks;
    const std::int64_t h = r % p.heads;
    r /= p.heads;
    const std::int64_t s = r % p.rows, b = r / p.rows;
    const std::int64_t tile = tile_of_row(p, s);
    const T* fine = static_cast<const T*>(p.fine) + b * p.fine_stride[0] + s * p.fine_stride[1] +
                    h * p.fine_stride[2] + c * VEC;
    T* out = static_cast<T*>(p.out) + b * p.out_stride[0] + s * p.out_stride[1] +
             h * p.out_stride[2] + c * VEC;
    Chunk<T, VEC> f = load_chunk<T, VEC>(fine);
    if (tile >= 0) {
      Acc cv[VEC];
      load_acc<C, Acc, VEC>(static_cast<const C*>(p.coarse) + b * p.coarse_stride[0] +
                                tile * p.coarse_stride[1] + h * p.coarse_stride[2] + c * VEC,
                            cv);
      Chunk<T, VEC> g;
      if (p.gate) {
        g = load_chunk<T, VEC>(static_cast<const T*>(p.gate) + b * p.gate_stride[0] +
                               s * p.gate_stride[1] + h * p.gate_stride[2] + c * VEC);
      }
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        const Acc gj = p.gate ? Io<T>::template load<Acc>(g.v[j]) : Acc(1);
        f.v[j] = Io<T>::template store<Acc>(Io<T>::template load<Acc>(f.v[j]) + gj * cv[j]);
      }
    }
    store_chunk<T, VEC>(out, f);
  }
}

// Row mode: the gate gradient of padding rows (past the sequence), which no tile visits.
template <class T, int VEC>
__global__ void zero_tail_rows_kernel(const CombineLaunchParams p, std::int64_t first_row) {
  const std::int64_t chunks = p.head_dim / VEC, tail = p.rows - first_row;
  const std::int64_t total = p.batch * tail * p.heads * chunks;
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  Chunk<T, VEC> zero;
#pragma unroll
  for (int j = 0; j < VEC; ++j) zero.v[j] = Io<T>::template store<float>(0.f);
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total; i += step) {
    const std::int64_t c = i % chunks;
    std::int64_t r = i / chunks;
    const std::int64_t h = r % p.heads;
    r /= p.heads;
    const std::int64_t s = first_row + r % tail, b = r / tail;
    store_chunk<T, VEC>(static_cast<T*>(p.grad_gate) + b * p.grad_gate_stride[0] +
                            s * p.grad_gate_stride[1] + h * p.grad_gate_stride[2] + c * VEC,
                        zero);
  }
}

constexpr int kBackwardThreads = 128;

// One block per (batch, tile, head). Threads split into `lanes` groups of slots times
// `per_pass` column chunks; lane partial sums meet in shared memory in lane order.
template <class T, class C, class Acc, int VEC>
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
  const int tile_size = p.block_sizes ? p.block_sizes[tile * p.block_sizes_stride] : 0;
  const C* coarse = static_cast<const C*>(p.coarse) + b * p.coarse_stride[0] +
                    tile * p.coarse_stride[1] + h * p.coarse_stride[2];
  for (int pass = 0; pass < chunks; pass += per_pass) {
    const int c = pass + col;
    Acc acc[VEC];
#pragma unroll
    for (int j = 0; j < VEC; ++j) acc[j] = Acc(0);
    if (lane < lanes && c < chunks) {
      Acc cv[VEC];
      load_acc<C, Acc, VEC>(coarse + c * VEC, cv);
      for (std::int64_t v = lane; v < p.tile_volume; v += lanes) {
        const SlotRow at = row_of_slot(p, tile, v, tile_size);
        if (at.row < 0) continue;
        T* grad_gate = p.grad_gate ? static_cast<T*>(p.grad_gate) + b * p.grad_gate_stride[0] +
                                         at.row * p.grad_gate_stride[1] +
                                         h * p.grad_gate_stride[2] + c * VEC
                                   : nullptr;
        if (at.token) {
          const Chunk<T, VEC> go = load_chunk<T, VEC>(
              static_cast<const T*>(p.fine) + b * p.fine_stride[0] +
              at.row * p.fine_stride[1] + h * p.fine_stride[2] + c * VEC);
          Chunk<T, VEC> g;
          if (p.gate)
            g = load_chunk<T, VEC>(static_cast<const T*>(p.gate) + b * p.gate_stride[0] +
                                   at.row * p.gate_stride[1] + h * p.gate_stride[2] + c * VEC);
          Chunk<T, VEC> gg;
#pragma unroll
          for (int j = 0; j < VEC; ++j) {
            const Acc goj = Io<T>::template load<Acc>(go.v[j]);
            acc[j] += p.gate ? goj * Io<T>::template load<Acc>(g.v[j]) : goj;
            gg.v[j] = Io<T>::template store<Acc>(goj * cv[j]);
          }
          if (grad_gate) store_chunk<T, VEC>(grad_gate, gg);
        } else if (grad_gate) {
          Chunk<T, VEC> zero;
#pragma unroll
          for (int j = 0; j < VEC; ++j) zero.v[j] = Io<T>::template store<Acc>(Acc(0));
          store_chunk<T, VEC>(grad_gate, zero);
        }
      }
    }
#pragma unroll
    for (int j = 0; j < VEC; ++j) partial[threadIdx.x * VEC + j] = acc[j];
    __syncthreads();
    if (lane == 0 && c < chunks) {
      Acc sum[VEC];
#pragma unroll
      for (int j = 0; j < VEC; ++j) {
        sum[j] = Acc(0);
        for (int l = 0; l < lanes; ++l) sum[j] += partial[(l * per_pass + col) * VEC + j];
      }
      store_acc<C, Acc, VEC>(static_cast<C*>(p.grad_coarse) + b * p.grad_coarse_stride[0] +
                                 tile * p.grad_coarse_stride[1] +
                                 h * p.grad_coarse_stride[2] + c * VEC,
                             sum);
    }
    __syncthreads();
  }
}

// fn(T{}, C{}, Acc{}) for the storage type T, the coarse type C (T, or float32 coarse with
// 16-bit rows) and the accumulator Acc.
template <class Fn>
const char* visit_dtypes(int dtype, int coarse_dtype, Fn&& fn) {
  const bool wide = coarse_dtype != dtype;
  if (wide && coarse_dtype != 0) return "vsa_combine: unsupported coarse dtype";
  switch (dtype) {
    case 0: return fn(float{}, float{}, float{});
    case 1: return wide ? fn(__half{}, float{}, float{}) : fn(__half{}, __half{}, float{});
    case 2:
      return wide ? fn(__nv_bfloat16{}, float{}, float{})
                  : fn(__nv_bfloat16{}, __nv_bfloat16{}, float{});
    case 3: return wide ? "vsa_combine: unsupported coarse dtype" : fn(double{}, double{}, double{});
    default: return "vsa_combine: unsupported dtype";
  }
}

const char* status(const char* what) {
  const cudaError_t e = cudaGetLastError();
  return e == cudaSuccess ? nullptr : what;
}

unsigned grid_for(std::int64_t work, int threads) {
  return static_cast<unsigned>(work / threads + 1 < 65536LL * 16 ? work / threads + 1
                                                                 : 65536LL * 16);
}

}  // namespace

const char* launch_vsa_combine_cuda(const CombineLaunchParams& p) {
  const std::int64_t elems = p.batch * p.rows * p.heads * p.head_dim;
  if (elems == 0) return nullptr;
  auto stream = static_cast<cudaStream_t>(p.stream);
  return visit_dtypes(p.dtype, p.coarse_dtype, [&](auto t, auto c, auto acc) -> const char* {
    using T = decltype(t);
    using C = decltype(c);
    using Acc = decltype(acc);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = p.vectorize && p.head_dim % kVec == 0;
    const int threads = 256;
    if (vec)
      vsa_combine_kernel<T, C, Acc, kVec>
          <<<grid_for(elems / kVec, threads), threads, 0, stream>>>(p);
    else
      vsa_combine_kernel<T, C, Acc, 1><<<grid_for(elems, threads), threads, 0, stream>>>(p);
    return status("vsa_combine kernel launch failed");
  });
}

const char* launch_vsa_combine_backward_cuda(const CombineLaunchParams& p) {
  const std::int64_t blocks = p.batch * p.tiles * p.heads;
  if (p.head_dim == 0 || p.batch * p.heads == 0) return nullptr;
  if (blocks > 0x7fffffff) return "vsa_combine_backward: too many (batch, tile, head) blocks";
  auto stream = static_cast<cudaStream_t>(p.stream);
  return visit_dtypes(p.dtype, p.coarse_dtype, [&](auto t, auto c, auto acc) -> const char* {
    using T = decltype(t);
    using C = decltype(c);
    using Acc = decltype(acc);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = p.vectorize && p.head_dim % kVec == 0;
    if (blocks > 0) {
      if (vec)
        vsa_combine_backward_kernel<T, C, Acc, kVec>
            <<<static_cast<unsigned>(blocks), kBackwardThreads, 0, stream>>>(p);
      else
        vsa_combine_backward_kernel<T, C, Acc, 1>
            <<<static_cast<unsigned>(blocks), kBackwardThreads, 0, stream>>>(p);
    }
    // Row mode: rows past the sequence belong to no tile; their gate gradient is 0.
    const std::int64_t first_tail =
        p.num_tokens - p.first_token < 0 ? 0 : p.num_tokens - p.first_token;
    if (p.token_to_slot && p.grad_gate && first_tail < p.rows) {
      const std::int64_t work = p.batch * (p.rows - first_tail) * p.heads * p.head_dim;
      if (vec)
        zero_tail_rows_kernel<T, kVec>
            <<<grid_for(work / kVec, 256), 256, 0, stream>>>(p, first_tail);
      else
        zero_tail_rows_kernel<T, 1><<<grid_for(work, 256), 256, 0, stream>>>(p, first_tail);
    }
    return status("vsa_combine_backward kernel launch failed");
  });
}

}  // namespace vidattn::detail
