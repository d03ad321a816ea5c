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

// Launches of the sm_90a (Hopper) forward kernels so far in this process: lets tests check
// which path ran (torch.ops.vidattn._sm90_forward_launches). Thread-safe.
void note_sm90_forward_launch() noexcept;
std::int64_t sm90_forward_launch_count() noexcept;

}  // namespace vidattn::detail
