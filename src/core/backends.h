// Backend entry points. They receive calls that describe_attention has validated.
#pragma once

#include <cstdint>

#include "vidattn/attention.h"

namespace vidattn::detail {

void cpu_attention_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse,
                           const AttentionOptions& options);

void cpu_attention_backward(const AttentionProblem& p, const TensorView& q,
                            const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, const TensorView& grad_out,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const AttentionOptions& options);

// VSA's combination (vsa_combine) of a block-sparse forward's output, for the backends that
// fuse it into their fine kernel (vsa_fine_combine_forward).
struct CombineViews {
  const TensorView* coarse = nullptr;  // [B, Qtiles, Hq, D]
  const TensorView* gate = nullptr;    // like q, or null (a gate of 1)
  const TensorView* out = nullptr;     // like q
};

#ifdef VIDATTN_WITH_CUDA
// CUDA (sm_80 and newer): bfloat16 / float16, head dims 64 and 128 (Dv == D); anything else
// throws NotImplementedError. Asynchronous on options.stream.
void cuda_attention_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                            const TensorView& v, const TensorView& out, const TensorView& lse,
                            const AttentionOptions& options);

void cuda_attention_backward(const AttentionProblem& p, const TensorView& q,
                             const TensorView& k, const TensorView& v, const TensorView& out,
                             const TensorView& lse, const TensorView& grad_out,
                             const TensorView& dq, const TensorView& dk, const TensorView& dv,
                             const AttentionOptions& options);
#endif


}  // namespace vidattn::detail
