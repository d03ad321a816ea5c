// Launchers of the sm_80 attention kernels, one explicit instantiation per (direction, dtype,
// head-dim width, padding, variant) in its own .cu file (instances/attn_*_sm80.cu; written by
// tools/codegen/gen_sm80_instances.py) so that the builds run in parallel.
#pragma once

#include <cuda_runtime.h>

#include "cuda/common/params.h"

namespace vidattn::cuda_sm80 {

using namespace cuda_common;  // params, tile I/O and warp math shared with the sm_90a kernels

// T is __nv_bfloat16 or __half. D is the head-dim width of the instance: 64, 96, 128, 192 or
// 256 (head_dims.h maps a problem's (D, Dv) to one). kPadded = false: p.head_dim ==
// p.head_dim_v == D. kPadded = true: both are multiples of 8 up to D, the columns past them
// zero-filled on load and skipped on store. Asynchronous on `stream`; throws
// std::runtime_error when a launch fails, NotImplementedError when the GPU has less shared
// memory per block than the instance needs.
template <class T, int D, bool kPadded>
void launch_forward(const AttentionParams& p, cudaStream_t stream);

// Needs p.delta: a [heads_q][rows_q] float workspace.
template <class T, int D, bool kPadded>
void launch_backward(const AttentionParams& p, cudaStream_t stream);

// Block-sparse attention (p.q2k_index, p.q2k_count, tile sizes set): the same kernels
// walking the q2k list per query block. BLOCK_Q (query rows per CTA) is 64 for 64-token tiles
// and 128 for 128- and 256-token tiles, so that a CTA never spans two query tiles (widths
// above 192 always run 64; FwdConfig says why).
template <class T, int D, int BLOCK_Q, bool kPadded>
void launch_block_sparse_forward(const AttentionParams& p, cudaStream_t stream);

// Needs p.delta and the k2q CSR (p.k2q_offsets, p.k2q_index) besides the forward's fields.
template <class T, int D, bool kPadded>
void launch_block_sparse_backward(const AttentionParams& p, cudaStream_t stream);

}  // namespace vidattn::cuda_sm80
