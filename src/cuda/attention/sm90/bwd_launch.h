// Launchers of the sm_90a (Hopper) attention backward. One explicit instantiation per
// (dtype, head dim, variant) lives in its own generated .cu under instances/
// (tools/codegen/gen_sm90_instances.py). This header is CuTe-free: the host dispatch
// (dispatch/attention.cu) includes it.
#pragma once

#include <cuda_runtime.h>

#include "fwd_params.h"

namespace vidattn::cuda_sm90 {

// T is __nv_bfloat16 or __half, D is 64 or 128. Returns false, launching nothing, when this
// build holds no sm_90a code for the kernels (the caller then takes the portable path).
// Asynchronous on `stream`; throws std::runtime_error when a launch fails or no workspace can
// be had.
//
// Dense (batched or varlen, padding masks, causal, GQA). Preconditions the caller checks
// (sm90_dense_fits in dispatch/attention.cu): q, k, v, out, grad_out rows 16-byte aligned with
// strides that are multiples of 8 elements, Sq > 0, Sk > 0, scale > 0; p.grad_out, p.dq, p.dk,
// p.dv and their strides set (p.delta is not used).
// deterministic: a dK / dV kernel and a dQ kernel, each output element summed by one owner in
// a fixed order (the same bits on every run). Otherwise one kernel computes all three, adding
// dQ into an fp32 workspace in an order that varies (bwd_fused_dq.h): five products per
// (query, key) block instead of seven.
template <class T, int D>
bool launch_dense_backward(const AttentionParams& p, bool deterministic, cudaStream_t stream);

// Block-sparse (batched, no masks, no causal; GQA allowed): dK / dV over the k2q lists in p
// (k2q_offsets, k2q_index), dQ over s's q2k lists, or fused as above when not deterministic
// and the tiles hold 128 or 256 tokens (a 64-token CTA's two warpgroups visit different query
// tiles, so they cannot share the dQ product: always deterministic). Same alignment
// preconditions; q and k lengths are multiples of s.tile_volume (64, 128 or 256); padded
// slots as p.q_block_sizes and s.kv_block_sizes say (unit stride).
template <class T, int D>
bool launch_sparse_backward(const AttentionParams& p, const SparseKeyListArgs& s,
                            bool deterministic, cudaStream_t stream);

}  // namespace vidattn::cuda_sm90
