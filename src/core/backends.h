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

// Block-sparse attention forward over selected key tiles on the sm_90a kernels (standalone;
// the public block-sparse op routes here on sm_90). q [B, Sq, Hq, D], k and v [B, Sk, Hkv, D]
// in the tiled layout, out like q, lse fp32 [B, Hq, Sq]; q2k_index int32 [B, Hq, Sq / tile,
// MaxK], q2k_count int32 [B, Hq, Sq / tile], kv_block_sizes int32 [Sk / tile] or null (full
// tiles). q_block_sizes int32 [Sq / tile] or null (full tiles): slots past a tile's size get
// out 0 and lse -inf. A query tile with count 0 gets out 0 and lse -inf. Returns false, launching nothing, where this device or
// build has no sm_90a path or a view is not TMA-compatible. Throws ValueError / TypeError on
// bad arguments. Asynchronous on `stream`.
//
// `combine` (vsa_fine_combine_forward, arguments checked there): also writes VSA's
// combination of `out` into combine->out, inside the 64-token kernel; returns false, launching
// nothing, where that fused kernel cannot run (other tile volumes, views it cannot address),
// and the caller then runs the two passes.
bool cuda_sm90_block_sparse_forward(const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& out,
                                    const TensorView& lse, const TensorView& q2k_index,
                                    const TensorView& q2k_count,
                                    const TensorView* kv_block_sizes, int tile_volume,
                                    double scale, int sm_margin, void* stream,
                                    const TensorView* q_block_sizes = nullptr,
                                    const CombineViews* combine = nullptr);
#endif

// Launches of the sm_90a (Hopper) forward kernels so far in this process: lets tests check
// which path ran (torch.ops.vidattn._sm90_forward_launches). Thread-safe.
void note_sm90_forward_launch() noexcept;
std::int64_t sm90_forward_launch_count() noexcept;

}  // namespace vidattn::detail
