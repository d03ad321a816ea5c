// RoPE backend entry points. They receive calls that describe_rope has validated.
#pragma once

#include "vidattn/rope.h"

namespace vidattn::detail {

void cpu_rope(const RopeProblem& p, const TensorView& x, const TensorView& cos,
              const TensorView& sin, const TensorView& out, const RopeOptions& options);

}  // namespace vidattn::detail
