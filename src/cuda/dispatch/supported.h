// What the CUDA attention kernels (dense and block-sparse, both architectures) are compiled
// for; a call outside it is valid input the backend cannot serve: NotImplementedError.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "head_dims.h"
#include "vidattn/error.h"
#include "vidattn/tensor_view.h"

namespace vidattn::cuda_dispatch {

inline void check_attention_kernels_support(const char* fn, DType dtype, std::int64_t head_dim,
                                            std::int64_t head_dim_v) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16)
    throw NotImplementedError(detail::concat(
        fn, ": the CUDA backend supports bfloat16 and float16 inputs, got ", dtype_name(dtype),
        "; cast to bfloat16 / float16 or use CPU tensors"));
  if (!sm80_head_dims_supported(head_dim, head_dim_v))
    throw NotImplementedError(detail::concat(
        fn, ": the CUDA backend supports head dims D (q, k) and Dv (v) that are multiples of 8 "
        "from 8 to ", kMaxHeadDim, ", got D = ", head_dim, ", Dv = ", head_dim_v,
        "; pad the head dim to a multiple of 8 or use CPU tensors"));
}

}  // namespace vidattn::cuda_dispatch
