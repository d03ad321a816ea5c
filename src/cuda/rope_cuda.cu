// CUDA RoPE: one thread per (batch, position, head, pair), grid-stride. Memory bound; the
// math is in float (double for float64 x), like the CPU kernel.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "dtype_io.cuh"
#include "rope_launch.h"

namespace vidattn::detail {
namespace {

template <class X, class C, class Acc>
__global__ void rope_kernel(RopeLaunchParams p) {
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

template <class X, class C>
void launch_typed(const RopeLaunchParams& p, cudaStream_t stream) {
  using Acc = typename std::conditional<std::is_same<X, double>::value, double, float>::type;
  constexpr int kThreads = 256;
  const std::int64_t total = p.batch * p.seqlen * p.heads * (p.head_dim / 2);
  // Enough blocks to fill any current GPU; the grid-stride loop covers the rest.
  const std::int64_t blocks = (total + kThreads - 1) / kThreads;
  const unsigned grid = unsigned(blocks < 65536 ? blocks : 65536);
  rope_kernel<X, C, Acc><<<grid, kThreads, 0, stream>>>(p);
}

template <class X>
void launch_table(const RopeLaunchParams& p, cudaStream_t stream) {
  switch (p.table_dtype) {
    case 1: return launch_typed<X, __half>(p, stream);
    case 2: return launch_typed<X, __nv_bfloat16>(p, stream);
    case 3: return launch_typed<X, double>(p, stream);
    default: return launch_typed<X, float>(p, stream);
  }
}

}  // namespace

const char* launch_rope_cuda(const RopeLaunchParams& p) {
  if (p.batch * p.seqlen * p.heads * (p.head_dim / 2) == 0) return nullptr;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) return "cudaGetDevice failed";
  if (previous != p.device && cudaSetDevice(p.device) != cudaSuccess)
    return "cudaSetDevice failed";
  auto stream = static_cast<cudaStream_t>(p.stream);
  switch (p.x_dtype) {
    case 1: launch_table<__half>(p, stream); break;
    case 2: launch_table<__nv_bfloat16>(p, stream); break;
    case 3: launch_table<double>(p, stream); break;
    default: launch_table<float>(p, stream); break;
  }
  const cudaError_t status = cudaGetLastError();
  if (previous != p.device) cudaSetDevice(previous);
  return status == cudaSuccess ? nullptr : cudaGetErrorString(status);
}

}  // namespace vidattn::detail
