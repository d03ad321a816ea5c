// Launchers of the sm_90a (Hopper) attention forward. One explicit instantiation per
// (dtype, head dim, variant) lives in its own generated .cu under instances/
// (tools/codegen/gen_sm90_instances.py), so the build runs in parallel and a subset builds
// alone. This header is CuTe-free: the host dispatch (dispatch/attention.cu,
// dispatch/block_sparse.cu) includes it.
#pragma once

#include <cuda_runtime.h>

#include "fwd_params.h"

namespace vidattn::cuda_sm90 {

// T is __nv_bfloat16 or __half, D is 64 or 128 (the dense forward: see kPadded). Both return
// false, launching nothing, when this build holds no sm_90a code for the kernel (CUTLASS
// missing, or 90a not among the targets); the caller then takes the portable path. Asynchronous
// on `stream`; throw std::runtime_error when a launch fails.
//
// Dense (batched or varlen, masks, causal, GQA). Preconditions the caller checks
// (sm90_dense_fits in dispatch/attention.cu): q, k, v, out rows 16-byte aligned, every stride a
// multiple of 8 elements, Sq > 0, Sk > 0, scale > 0.
// kPadded: the padded instance of width D (FwdConfig::padded_head_dim), which serves every
// D, Dv up to D (multiples of 8, rows as above); D is then 96, 128, 192 or 256. Dv != D: v
// and out padded to Dv of their own (D = 192 / Dv = 128, D = 128 / Dv = 64, D = 64 /
// Dv = 128).
template <class T, int D, bool kPadded = false, int Dv = D>
bool launch_dense_forward(const AttentionParams& p, cudaStream_t stream);

// Block-sparse over key tiles (batched, no masks, no causal; GQA allowed). Same alignment
// preconditions; q and k lengths are multiples of s.tile_volume.
template <class T, int D>
bool launch_sparse_forward(const AttentionParams& p, const SparseKeyListArgs& s,
                           cudaStream_t stream);

// The same with 64-token tiles, plus VSA's combination into c.out (CombineArgs): p.out gets
// the fine output, c.out the combined one. Preconditions as above, and c's rows 16-byte
// aligned with strides that are multiples of 8 elements.
template <class T, int D>
bool launch_sparse_combine_forward(const AttentionParams& p, const SparseKeyListArgs& s,
                                   const CombineArgs& c, cudaStream_t stream);

}  // namespace vidattn::cuda_sm90
