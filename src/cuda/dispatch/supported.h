// What the CUDA attention kernels (dense and block-sparse, both architectures) are compiled
// for; a call outside it is valid input the backend cannot serve: NotImplementedError.
#pragma once

#include <cstdint>

#include "core/check.h"
#include "vidattn/error.h"
#include "vidattn/tensor_view.h"

namespace vidattn::cuda_dispatch {

inline void check_attention_kernels_support(const char* fn, DType dtype, std::int64_t head_dim,
                                            std::int64_t head_dim_v) {
  if (dtype != DType::kBFloat16 && dtype != DType::kFloat16)
    throw NotImplementedError(detail::concat(
        fn, ": the CUDA backend supports bfloat16 and float16 inputs, got ", dtype_name(dtype),
        "; cast to bfloat16 / float16 or use CPU tensors"));
  if ((head_dim != 64 && head_dim != 128) || head_dim_v != head_dim)
    throw NotImplementedError(detail::concat(
        fn, ": the CUDA backend supports head dims D = Dv = 64 or 128, got D = ", head_dim,
        ", Dv = ", head_dim_v, "; pad the head dim or use CPU tensors"));
}

}  // namespace vidattn::cuda_dispatch
