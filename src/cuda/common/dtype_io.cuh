// Loads and stores of every float storage type through an accumulator type (float, or
// double for float64), shared by the small memory-bound CUDA kernels (RoPE, VSA tiling,
// pooling, combine).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

namespace vidattn::cuda_common {

template <class T> struct Io;
template <> struct Io<float> {
  template <class Acc> __device__ static Acc load(float v) { return Acc(v); }
  template <class Acc> __device__ static float store(Acc v) { return float(v); }
};
template <> struct Io<double> {
  template <class Acc> __device__ static Acc load(double v) { return Acc(v); }
  template <class Acc> __device__ static double store(Acc v) { return double(v); }
};
template <> struct Io<__half> {
  template <class Acc> __device__ static Acc load(__half v) { return Acc(__half2float(v)); }
  template <class Acc> __device__ static __half store(Acc v) { return __float2half_rn(float(v)); }
};
template <> struct Io<__nv_bfloat16> {
  template <class Acc> __device__ static Acc load(__nv_bfloat16 v) {
    return Acc(__bfloat162float(v));
  }
  template <class Acc> __device__ static __nv_bfloat16 store(Acc v) {
    return __float2bfloat16_rn(float(v));
  }
};

}  // namespace vidattn::cuda_common
