// VSA backend entry points. They receive calls that src/core/vsa.cpp has validated (shapes,
// dtypes, devices); checks that need tensor data (index ranges) are the backends' job.
#pragma once

#include "vidattn/vsa.h"

namespace vidattn::detail {

void cpu_tiling_metadata(const TilingLayout& layout, const TensorView& block_sizes,
                         const TensorView& slot_to_token, const TensorView& token_to_slot,
                         const TensorView& cu_tiles, const TensorView& cu_tokens);
void cpu_gather_tokens(const TensorView& x, const TensorView& index, const TensorView& out,
                       int num_threads);
void cpu_tile_mean_pool(const TensorView& x, const TensorView& block_sizes,
                        std::int64_t tile_volume, const TensorView& out, int num_threads);
void cpu_tile_mean_pool_backward(const TensorView& grad_out, const TensorView& block_sizes,
                                 std::int64_t tile_volume, const TensorView& grad_x,
                                 int num_threads);
void cpu_select_topk_tiles(const TensorView& q_pooled, const TensorView& k_pooled,
                           const TopkOptions& options, double scale, const TensorView& q2k_index,
                           const TensorView& q2k_count);
void cpu_topk_tiles_from_scores(const TensorView& scores, std::int64_t topk,
                                const TensorView& q2k_index, const TensorView& q2k_count,
                                int num_threads);
void cpu_block_sparse_transpose_index(const TensorView& q2k_index, const TensorView& q2k_count,
                                      std::int64_t num_kv_tiles, const TensorView& k2q_offsets,
                                      const TensorView& k2q_index, int num_threads);
void cpu_block_sparse_forward(const BlockSparseProblem& p, const TensorView& q,
                              const TensorView& k, const TensorView& v,
                              const TensorView& q2k_index, const TensorView& q2k_count,
                              const TensorView& out, const TensorView& lse,
                              const BlockSparseOptions& options);
void cpu_block_sparse_backward(const BlockSparseProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, const TensorView& grad_out,
                               const TensorView& q2k_index, const TensorView& q2k_count,
                               const TensorView& k2q_offsets, const TensorView& k2q_index,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const BlockSparseOptions& options);

#ifdef VIDATTN_WITH_CUDA
// CUDA (sm_80 and newer; src/cuda/dispatch/block_sparse.cu, src/cuda/vsa/k2q_transpose.cu): bfloat16 / float16, D = Dv in
// {64, 128}; anything else throws NotImplementedError. Asynchronous on the given stream,
// except the index check of the forward and of the transpose (vsa.h), which is skipped while
// the stream is being captured or when validate_index is false.
// With `combine` (vsa_fine_combine_forward) it returns whether the combination was written
// too (the fused sm_90a kernel); false: only out and lse were, and the caller combines.
struct CombineViews;
bool cuda_block_sparse_forward(const BlockSparseProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v,
                               const TensorView& q2k_index, const TensorView& q2k_count,
                               const TensorView& out, const TensorView& lse,
                               const BlockSparseOptions& options,
                               const CombineViews* combine = nullptr);
void cuda_block_sparse_transpose_index(const TensorView& q2k_index, const TensorView& q2k_count,
                                       std::int64_t num_kv_tiles, const TensorView& k2q_offsets,
                                       const TensorView& k2q_index, void* stream,
                                       bool validate_index);
void cuda_block_sparse_backward(const BlockSparseProblem& p, const TensorView& q,
                                const TensorView& k, const TensorView& v, const TensorView& out,
                                const TensorView& lse, const TensorView& grad_out,
                                const TensorView& q2k_index, const TensorView& q2k_count,
                                const TensorView& k2q_offsets, const TensorView& k2q_index,
                                const TensorView& dq, const TensorView& dk, const TensorView& dv,
                                const BlockSparseOptions& options);
#endif

}  // namespace vidattn::detail
