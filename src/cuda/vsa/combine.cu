// The fused VSA combine on CUDA (vidattn/vsa_combine.h): out = fine + gate * coarse on the
// valid slots (tiled mode) or on the rows of a raster sequence (row mode), and its backward.
// The CPU reference is src/cpu/vsa_combine_cpu.cpp. Memory bound: the forward streams fine and
// gate once in 16-byte vectors where aligned; the backward gives each (batch, tile, head) one
// block that writes grad_gate and reduces grad_coarse over the tile's slots in registers and
// shared memory (fixed order: deterministic).
//
// Block sizes and the row mode's maps cannot be checked without a host sync: a slot past its
// tile's block size or a map entry out of range makes a row belong to no tile.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <optional>

#include "../../core/check.h"
#include "../../core/vsa_combine_backends.h"
#include "../common/check.h"
#include "../common/device_guard.h"
#include "../common/dtype_dispatch.h"
#include "../common/dtype_io.cuh"

namespace vidattn::cuda_vsa {
namespace {

using cuda_common::Io;

struct CombineParams {
  // Tiled mode (block_sizes set) or row mode (token_to_slot and slot_to_token set).
  // Forward: fine, coarse, gate (may be null) -> out.
  // Backward: grad_out (in `fine`), coarse, gate -> grad_coarse, grad_gate (may be null).
  const void* fine = nullptr;
  const void* coarse = nullptr;
  const void* gate = nullptr;
  const std::int32_t* block_sizes = nullptr;
  void* out = nullptr;
  void* grad_coarse = nullptr;
  void* grad_gate = nullptr;
  std::int64_t batch = 0, tiles = 0, tile_volume = 0, heads = 0, head_dim = 0;
  std::int64_t block_sizes_stride = 1;
  // Rows of fine / gate / out per batch: tiles * tile_volume slots in the tiled mode; in the
  // row mode (token_to_slot set) tokens first_token ... of a raster sequence of num_tokens.
  std::int64_t rows = 0;
  const std::int32_t* token_to_slot = nullptr;
  const std::int32_t* slot_to_token = nullptr;
  std::int64_t num_tokens = 0, first_token = 0;
  // Strides (elements) of batch, slot (or tile for coarse tensors) and head; D is unit-stride.
  std::int64_t fine_stride[3] = {}, coarse_stride[3] = {}, gate_stride[3] = {};
  std::int64_t out_stride[3] = {}, grad_coarse_stride[3] = {}, grad_gate_stride[3] = {};
};

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
__device__ std::int64_t tile_of_row(const CombineParams& p, std::int64_t row) {
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
__device__ SlotRow row_of_slot(const CombineParams& p, std::int64_t tile, std::int64_t v,
                               int tile_size) {
  const std::int64_t slot = tile * p.tile_volume + v;
  if (p.slot_to_token == nullptr) return {slot, v < tile_size};
  const std::int64_t row = std::int64_t(p.slot_to_token[slot]) - p.first_token;
  const bool ok = p.slot_to_token[slot] >= 0 && row >= 0 && row < p.rows;
  return {ok ? row : -1, ok};
}

template <class T, class C, class Acc, int VEC>
__global__ void vsa_combine_kernel(const CombineParams p) {
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
__global__ void zero_tail_rows_kernel(const CombineParams p, std::int64_t first_row) {
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
    vsa_combine_backward_kernel(const CombineParams p) {
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

// fn(T{}, C{}, Acc{}) for the storage type T of the rows, the coarse type C (T, or float32
// coarse with 16-bit rows: vsa_combine.cpp admits no other pair) and the accumulator Acc.
template <class Fn>
void dispatch_dtypes(DType dtype, DType coarse_dtype, Fn&& fn) {
  cuda_common::dispatch_float_dtype(dtype, [&](auto tag) {
    using T = decltype(tag);
    using Acc = cuda_common::AccumulatorOf<T>;
    if constexpr (sizeof(T) == 2) {
      if (coarse_dtype != dtype) return fn(T{}, float{}, Acc{});
    }
    fn(T{}, T{}, Acc{});
  });
}

unsigned grid_for(std::int64_t work, int threads) {
  return static_cast<unsigned>(work / threads + 1 < 65536LL * 16 ? work / threads + 1
                                                                 : 65536LL * 16);
}

// Every row start of t 16-byte aligned (its data pointer and every stride but the last).
bool aligned16(const TensorView& t) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % 16 != 0) return false;
  const std::int64_t elems = 16 / static_cast<std::int64_t>(dtype_size(t.dtype));
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.shape[d] > 1 && t.stride[d] % elems != 0) return false;
  return true;
}

void copy_strides(std::int64_t (&dst)[3], const TensorView& t) {
  for (int d = 0; d < 3; ++d) dst[d] = t.stride[d];
}

// The parameters both modes share; `slots` is fine (forward) or grad_out (backward) and `tiles`
// the coarse tiles. Row mode: set_row_mode adds the maps.
CombineParams combine_params(const TensorView& slots, const TensorView& coarse,
                             const std::optional<TensorView>& gate,
                             const TensorView* block_sizes, std::int64_t tile_volume) {
  CombineParams p;
  p.fine = slots.data;
  p.coarse = coarse.data;
  p.gate = gate ? gate->data : nullptr;
  if (block_sizes) {
    p.block_sizes = static_cast<const std::int32_t*>(block_sizes->data);
    p.block_sizes_stride = block_sizes->stride[0];
  }
  p.batch = slots.shape[0], p.tiles = coarse.shape[1], p.tile_volume = tile_volume;
  p.heads = slots.shape[2], p.head_dim = slots.shape[3];
  p.rows = slots.shape[1];
  copy_strides(p.fine_stride, slots);
  copy_strides(p.coarse_stride, coarse);
  if (gate) copy_strides(p.gate_stride, *gate);
  return p;
}

void set_row_mode(CombineParams& p, const TensorView& token_to_slot,
                  const TensorView& slot_to_token, std::int64_t first_token) {
  p.token_to_slot = static_cast<const std::int32_t*>(token_to_slot.data);
  p.slot_to_token = static_cast<const std::int32_t*>(slot_to_token.data);
  p.num_tokens = token_to_slot.shape[0];
  p.first_token = first_token;
}

// The 16-byte kernels run where every row start is 16-byte aligned and D is a multiple of
// the vector.
void launch_forward(const char* launch, CombineParams p, const TensorView& fine,
                    const TensorView& coarse, const std::optional<TensorView>& gate,
                    const TensorView& out, void* stream_ptr) {
  p.out = out.data;
  copy_strides(p.out_stride, out);
  const bool vectorize =
      aligned16(fine) && aligned16(coarse) && (!gate || aligned16(*gate)) && aligned16(out);
  const std::int64_t elems = p.batch * p.rows * p.heads * p.head_dim;
  const cuda_common::DeviceGuard guard(fine.device.index);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch_dtypes(fine.dtype, coarse.dtype, [&](auto t, auto c, auto acc) {
    using T = decltype(t);
    using C = decltype(c);
    using Acc = decltype(acc);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = vectorize && p.head_dim % kVec == 0;
    const int threads = 256;
    if (vec)
      vsa_combine_kernel<T, C, Acc, kVec>
          <<<grid_for(elems / kVec, threads), threads, 0, stream>>>(p);
    else
      vsa_combine_kernel<T, C, Acc, 1><<<grid_for(elems, threads), threads, 0, stream>>>(p);
  });
  cuda_common::check_last_launch(launch);
}

void launch_backward(const char* function, const char* launch, CombineParams p,
                     const TensorView& grad_out,
                     const TensorView& coarse, const std::optional<TensorView>& gate,
                     const TensorView& grad_coarse, const std::optional<TensorView>& grad_gate,
                     void* stream_ptr) {
  p.grad_coarse = grad_coarse.data;
  copy_strides(p.grad_coarse_stride, grad_coarse);
  if (grad_gate) {
    p.grad_gate = grad_gate->data;
    copy_strides(p.grad_gate_stride, *grad_gate);
  }
  const bool vectorize = aligned16(grad_out) && aligned16(coarse) &&
                         (!gate || aligned16(*gate)) && aligned16(grad_coarse) &&
                         (!grad_gate || aligned16(*grad_gate));
  const std::int64_t blocks = p.batch * p.tiles * p.heads;
  if (blocks > 0x7fffffff)
    throw NotImplementedError(detail::concat(
        function, ": the CUDA backend supports at most 2^31 - 1 (batch, tile, head) blocks, got ",
        blocks));
  const cuda_common::DeviceGuard guard(grad_out.device.index);
  auto stream = static_cast<cudaStream_t>(stream_ptr);
  dispatch_dtypes(grad_out.dtype, coarse.dtype, [&](auto t, auto c, auto acc) {
    using T = decltype(t);
    using C = decltype(c);
    using Acc = decltype(acc);
    constexpr int kVec = 16 / sizeof(T);
    const bool vec = vectorize && p.head_dim % kVec == 0;
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
  });
  cuda_common::check_last_launch(launch);
}

}  // namespace
}  // namespace vidattn::cuda_vsa

namespace vidattn::detail {

using cuda_vsa::combine_params;

void cuda_vsa_combine(const TensorView& fine, const TensorView& coarse,
                      const std::optional<TensorView>& gate, const TensorView& block_sizes,
                      std::int64_t tile_volume, const TensorView& out, void* stream) {
  cuda_vsa::launch_forward("vidattn::vsa_combine kernel launch",
                           combine_params(fine, coarse, gate, &block_sizes, tile_volume), fine,
                           coarse, gate, out, stream);
}

void cuda_vsa_combine_backward(const TensorView& grad_out, const TensorView& coarse,
                               const std::optional<TensorView>& gate,
                               const TensorView& block_sizes, std::int64_t tile_volume,
                               const TensorView& grad_coarse,
                               const std::optional<TensorView>& grad_gate, void* stream) {
  cuda_vsa::launch_backward("vidattn::vsa_combine_backward",
                            "vidattn::vsa_combine_backward kernel launch",
                            combine_params(grad_out, coarse, gate, &block_sizes, tile_volume),
                            grad_out, coarse, gate, grad_coarse, grad_gate, stream);
}

void cuda_vsa_combine_rows(const TensorView& fine, const TensorView& coarse,
                           const std::optional<TensorView>& gate,
                           const TensorView& token_to_slot, const TensorView& slot_to_token,
                           std::int64_t tile_volume, std::int64_t first_token,
                           const TensorView& out, void* stream) {
  cuda_vsa::CombineParams p = combine_params(fine, coarse, gate, nullptr, tile_volume);
  cuda_vsa::set_row_mode(p, token_to_slot, slot_to_token, first_token);
  cuda_vsa::launch_forward("vidattn::vsa_combine_rows kernel launch", p, fine, coarse, gate, out,
                           stream);
}

void cuda_vsa_combine_rows_backward(const TensorView& grad_out, const TensorView& coarse,
                                    const std::optional<TensorView>& gate,
                                    const TensorView& token_to_slot,
                                    const TensorView& slot_to_token, std::int64_t tile_volume,
                                    std::int64_t first_token, const TensorView& grad_coarse,
                                    const std::optional<TensorView>& grad_gate, void* stream) {
  cuda_vsa::CombineParams p = combine_params(grad_out, coarse, gate, nullptr, tile_volume);
  cuda_vsa::set_row_mode(p, token_to_slot, slot_to_token, first_token);
  cuda_vsa::launch_backward("vidattn::vsa_combine_rows_backward",
                            "vidattn::vsa_combine_rows_backward kernel launch", p, grad_out,
                            coarse, gate, grad_coarse, grad_gate, stream);
}

}  // namespace vidattn::detail
