// RoPE on CUDA (vidattn/rope.h). Memory bound; the math is in float (double for float64 x),
// like the CPU kernel (src/cpu/rope_cpu.cpp).
//  * 16-bit x with 16-byte aligned rows and heads (the usual case): one thread per 16-byte
//    unit (4 interleaved pairs, or 8 first-half elements with their 8 partners of the second
//    half), 16-byte loads and stores, 32-bit index math; for interleaved pairs the thread
//    walks all heads of its (batch, position).
//  * anything else: one thread per (batch, position, head, pair), grid-stride.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../core/rope_backends.h"
#include "../common/check.h"
#include "../common/device_guard.h"
#include "../common/dtype_dispatch.h"
#include "../common/dtype_io.cuh"

namespace vidattn::cuda_rope_kernels {
namespace {

using cuda_common::Io;

struct RopeParams {
  const void* x = nullptr;
  void* out = nullptr;
  const void* cos = nullptr;
  const void* sin = nullptr;
  std::int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  std::int64_t x_stride[3] = {};    // batch, position, head (the head dim is unit-stride)
  std::int64_t out_stride[3] = {};
  std::int64_t cos_stride[2] = {};  // position, column
  std::int64_t sin_stride[2] = {};
  bool half_table = false, interleaved = true, transpose = false;
};

template <class X, class C, class Acc>
__global__ void rope_kernel(RopeParams p) {
  const auto* x = static_cast<const X*>(p.x);
  auto* out = static_cast<X*>(p.out);
  const auto* cos = static_cast<const C*>(p.cos);
  const auto* sin = static_cast<const C*>(p.sin);
  const std::int64_t half = p.head_dim / 2;
  const std::int64_t total = p.batch * p.seqlen * p.heads * half;
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const std::int64_t k = i % half;
    std::int64_t t = i / half;
    const std::int64_t h = t % p.heads;
    t /= p.heads;
    const std::int64_t s = t % p.seqlen, b = t / p.seqlen;
    const std::int64_t ia = p.interleaved ? 2 * k : k;
    const std::int64_t ib = p.interleaved ? ia + 1 : k + half;
    const std::int64_t ja = p.half_table ? k : ia, jb = p.half_table ? k : ib;
    const C* c_row = cos + s * p.cos_stride[0];
    const C* s_row = sin + s * p.sin_stride[0];
    const Acc ca = Io<C>::template load<Acc>(c_row[ja * p.cos_stride[1]]);
    const Acc sa = Io<C>::template load<Acc>(s_row[ja * p.sin_stride[1]]);
    const Acc cb = Io<C>::template load<Acc>(c_row[jb * p.cos_stride[1]]);
    const Acc sb = Io<C>::template load<Acc>(s_row[jb * p.sin_stride[1]]);
    const X* xp = x + b * p.x_stride[0] + s * p.x_stride[1] + h * p.x_stride[2];
    X* op = out + b * p.out_stride[0] + s * p.out_stride[1] + h * p.out_stride[2];
    const Acc xa = Io<X>::template load<Acc>(xp[ia]);
    const Acc xb = Io<X>::template load<Acc>(xp[ib]);
    Acc ya, yb;
    if (p.transpose) {
      ya = xa * ca + xb * sb;
      yb = xb * cb - xa * sa;
    } else {
      ya = xa * ca - xb * sa;
      yb = xb * cb + xa * sb;
    }
    op[ia] = Io<X>::template store<Acc>(ya);
    op[ib] = Io<X>::template store<Acc>(yb);
  }
}

// Eight 16-bit values as one 16-byte word.
template <class X>
struct alignas(16) Vec8 {
  X v[8];
};

// The 16-byte path (see the file comment) for NeoX halves; x and out are 2-byte types, float
// math. Unit u of a head: columns [8u, 8u + 8) and their partners [8u + D/2, 8u + D/2 + 8).
template <class X, class C>
__global__ void rope_vec_halves_kernel(RopeParams p, std::uint32_t units_per_head,
                                       std::uint32_t total) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const std::uint32_t u = i % units_per_head;
  std::uint32_t t = i / units_per_head;
  const std::uint32_t h = t % std::uint32_t(p.heads);
  t /= std::uint32_t(p.heads);
  const std::uint32_t s = t % std::uint32_t(p.seqlen), b = t / std::uint32_t(p.seqlen);
  const auto* x = static_cast<const X*>(p.x) + b * p.x_stride[0] + s * p.x_stride[1] +
                  h * p.x_stride[2];
  auto* out = static_cast<X*>(p.out) + b * p.out_stride[0] + s * p.out_stride[1] +
              h * p.out_stride[2];
  const C* c_row = static_cast<const C*>(p.cos) + s * p.cos_stride[0];
  const C* s_row = static_cast<const C*>(p.sin) + s * p.sin_stride[0];
  auto table = [&](const C* row, std::int64_t stride, std::int64_t col) {
    return Io<C>::template load<float>(row[col * stride]);
  };
  const std::int64_t half = p.head_dim / 2;
  const int col0 = 8 * int(u);
  const Vec8<X> in_a = *reinterpret_cast<const Vec8<X>*>(x + col0);
  const Vec8<X> in_b = *reinterpret_cast<const Vec8<X>*>(x + col0 + half);
  Vec8<X> res_a, res_b;
#pragma unroll
  for (int j = 0; j < 8; ++j) {
    const std::int64_t k = col0 + j;
    const std::int64_t ja = k, jb = p.half_table ? k : k + half;
    const float ca = table(c_row, p.cos_stride[1], ja), sa = table(s_row, p.sin_stride[1], ja);
    const float cb = table(c_row, p.cos_stride[1], jb), sb = table(s_row, p.sin_stride[1], jb);
    const float xa = Io<X>::template load<float>(in_a.v[j]);
    const float xb = Io<X>::template load<float>(in_b.v[j]);
    res_a.v[j] = Io<X>::template store<float>(p.transpose ? xa * ca + xb * sb
                                                          : xa * ca - xb * sa);
    res_b.v[j] = Io<X>::template store<float>(p.transpose ? xb * cb - xa * sa
                                                          : xb * cb + xa * sb);
  }
  *reinterpret_cast<Vec8<X>*>(out + col0) = res_a;
  *reinterpret_cast<Vec8<X>*>(out + col0 + half) = res_b;
}

// The 16-byte path for interleaved pairs: a thread owns unit u of one (batch, position) and
// walks all its heads (unit u of a head: columns [8u, 8u + 8), pairs 4u .. 4u + 3), so the
// table values (which do not depend on the head) and the index math are paid once per thread
// instead of once per 16 bytes moved (at [1, 75600, 40, 128] bf16 on an H200: 0.434 ms, against
// 0.645 ms with one head per thread). NeoX halves keep one head per thread (the kernel above):
// walking the heads measured slower for them (0.504 ms against 0.452 ms; two 16-byte loads per
// head and 32 table values per thread).
template <class X, class C>
__global__ void rope_vec_interleaved_kernel(RopeParams p, std::uint32_t units_per_head,
                                            std::uint32_t total) {
  const std::uint32_t i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= total) return;
  const std::uint32_t u = i % units_per_head;
  const std::uint32_t t = i / units_per_head;
  const std::uint32_t s = t % std::uint32_t(p.seqlen), b = t / std::uint32_t(p.seqlen);
  const C* c_row = static_cast<const C*>(p.cos) + s * p.cos_stride[0];
  const C* s_row = static_cast<const C*>(p.sin) + s * p.sin_stride[0];
  auto table = [&](const C* row, std::int64_t stride, std::int64_t col) {
    return Io<C>::template load<float>(row[col * stride]);
  };
  const int col0 = 8 * int(u);
  float ca[4], sa[4], cb[4], sb[4];  // at each pair's first and second element
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    const int ia = col0 + 2 * j, ib = ia + 1;
    const int ja = p.half_table ? ia / 2 : ia, jb = p.half_table ? ia / 2 : ib;
    ca[j] = table(c_row, p.cos_stride[1], ja);
    sa[j] = table(s_row, p.sin_stride[1], ja);
    cb[j] = table(c_row, p.cos_stride[1], jb);
    sb[j] = table(s_row, p.sin_stride[1], jb);
  }
  const auto* x = static_cast<const X*>(p.x) + b * p.x_stride[0] + s * p.x_stride[1] + col0;
  auto* out = static_cast<X*>(p.out) + b * p.out_stride[0] + s * p.out_stride[1] + col0;
#pragma unroll 2
  for (std::int64_t h = 0; h < p.heads; ++h) {
    const Vec8<X> in = *reinterpret_cast<const Vec8<X>*>(x + h * p.x_stride[2]);
    Vec8<X> res;
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float xa = Io<X>::template load<float>(in.v[2 * j]);
      const float xb = Io<X>::template load<float>(in.v[2 * j + 1]);
      const float ya = p.transpose ? xa * ca[j] + xb * sb[j] : xa * ca[j] - xb * sa[j];
      const float yb = p.transpose ? xb * cb[j] - xa * sa[j] : xb * cb[j] + xa * sb[j];
      res.v[2 * j] = Io<X>::template store<float>(ya);
      res.v[2 * j + 1] = Io<X>::template store<float>(yb);
    }
    *reinterpret_cast<Vec8<X>*>(out + h * p.out_stride[2]) = res;
  }
}

// Whether the 16-byte path applies: 2-byte x, rows and heads of x and out 16-byte aligned,
// whole units per head, and a unit count that 32-bit indices cover.
template <class X>
bool vector_path(const RopeParams& p, std::uint32_t* units_per_head,
                 std::uint32_t* total) {
  if constexpr (sizeof(X) != 2) return false;
  if (p.head_dim % 16 != 0) return false;
  for (int d = 0; d < 3; ++d)
    if (p.x_stride[d] % 8 != 0 || p.out_stride[d] % 8 != 0) return false;
  if (reinterpret_cast<std::uintptr_t>(p.x) % 16 != 0 ||
      reinterpret_cast<std::uintptr_t>(p.out) % 16 != 0)
    return false;
  const std::int64_t per_head = p.interleaved ? p.head_dim / 8 : p.head_dim / 16;
  const std::int64_t n = p.batch * p.seqlen * p.heads * per_head;
  if (n >= (std::int64_t(1) << 31)) return false;
  *units_per_head = std::uint32_t(per_head);
  *total = std::uint32_t(n);
  return true;
}

template <class X, class C>
void launch_typed(const RopeParams& p, cudaStream_t stream) {
  using Acc = cuda_common::AccumulatorOf<X>;
  constexpr int kThreads = 256;
  std::uint32_t units_per_head = 0, units = 0;
  if (vector_path<X>(p, &units_per_head, &units)) {
    if (p.interleaved) {
      const std::uint32_t threads = units / std::uint32_t(p.heads);  // heads walked per thread
      rope_vec_interleaved_kernel<X, C>
          <<<(threads + kThreads - 1) / kThreads, kThreads, 0, stream>>>(p, units_per_head,
                                                                        threads);
    } else {
      rope_vec_halves_kernel<X, C><<<(units + kThreads - 1) / kThreads, kThreads, 0, stream>>>(
          p, units_per_head, units);
    }
    return;
  }
  const std::int64_t total = p.batch * p.seqlen * p.heads * (p.head_dim / 2);
  // Enough blocks to fill any current GPU; the grid-stride loop covers the rest.
  const std::int64_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < 65536 ? blocks : 65536);
  rope_kernel<X, C, Acc><<<grid, kThreads, 0, stream>>>(p);
}

}  // namespace
}  // namespace vidattn::cuda_rope_kernels

namespace vidattn::detail {

void cuda_rope(const RopeProblem& problem, const TensorView& x, const TensorView& cos,
               const TensorView& sin, const TensorView& out, const RopeOptions& options) {
  cuda_rope_kernels::RopeParams p;
  p.x = x.data, p.out = out.data, p.cos = cos.data, p.sin = sin.data;
  p.batch = problem.batch, p.seqlen = problem.seqlen, p.heads = problem.heads;
  p.head_dim = problem.head_dim;
  for (int d = 0; d < 3; ++d) p.x_stride[d] = x.stride[d], p.out_stride[d] = out.stride[d];
  for (int d = 0; d < 2; ++d) p.cos_stride[d] = cos.stride[d], p.sin_stride[d] = sin.stride[d];
  p.half_table = problem.half_table, p.interleaved = options.interleaved;
  p.transpose = options.transpose;
  const cuda_common::DeviceGuard guard(problem.device.index);
  auto stream = static_cast<cudaStream_t>(options.stream);
  cuda_common::dispatch_float_dtype(problem.dtype, [&](auto x_tag) {
    cuda_common::dispatch_float_dtype(problem.table_dtype, [&](auto table_tag) {
      cuda_rope_kernels::launch_typed<decltype(x_tag), decltype(table_tag)>(p, stream);
    });
  });
  cuda_common::check_last_launch("vidattn::apply_rope kernel launch");
}

}  // namespace vidattn::detail
