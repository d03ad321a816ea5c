// The dtype dispatch of the CUDA host code: a vidattn::DType turned into the element type a
// kernel template takes. Callers check the dtype first (validation happens once, in
// src/core); these helpers only map.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "vidattn/tensor_view.h"

namespace vidattn::cuda_common {

// fn(T{}) with the storage type of any float dtype: float, double, __half, __nv_bfloat16.
template <class Fn>
decltype(auto) dispatch_float_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat16: return fn(__half{});
    case DType::kBFloat16: return fn(__nv_bfloat16{});
    case DType::kFloat64: return fn(double{});
    default: return fn(float{});
  }
}

// The accumulator of a storage type: double for double, float otherwise.
template <class T>
using AccumulatorOf = std::conditional_t<std::is_same_v<T, double>, double, float>;

// fn(T{}, integral_constant<int, D>{}) for the sm_90a attention kernels' (16-bit dtype, head
// dim) pairs: bfloat16 / float16 and D = Dv = 64 / 128 (the caller checked the dims; the sm_80
// kernels take cuda_dispatch::dispatch_sm80_head_dims).
template <class Fn>
void dispatch_dtype_head_dim(DType dtype, std::int64_t head_dim, Fn&& fn) {
  const bool bf16 = dtype == DType::kBFloat16;
  if (head_dim == 64) {
    if (bf16) fn(__nv_bfloat16{}, std::integral_constant<int, 64>{});
    else fn(__half{}, std::integral_constant<int, 64>{});
  } else {
    if (bf16) fn(__nv_bfloat16{}, std::integral_constant<int, 128>{});
    else fn(__half{}, std::integral_constant<int, 128>{});
  }
}

}  // namespace vidattn::cuda_common
