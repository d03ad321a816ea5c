// RoPE backend entry points. They receive calls that describe_rope has validated.
#pragma once

#include "vidattn/rope.h"

namespace vidattn::detail {

void cpu_rope(const RopeProblem& p, const TensorView& x, const TensorView& cos,
              const TensorView& sin, const TensorView& out, const RopeOptions& options);

#ifdef VIDATTN_WITH_CUDA
// CUDA (src/cuda/rope/rope.cu): the same call, for a non-empty x; asynchronous on
// options.stream. CUDA errors throw std::runtime_error.
void cuda_rope(const RopeProblem& p, const TensorView& x, const TensorView& cos,
               const TensorView& sin, const TensorView& out, const RopeOptions& options);
#endif

}  // namespace vidattn::detail
