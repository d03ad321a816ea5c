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
// CUDA (src/cuda/vsa/): the same calls as the cpu_* ones above, asynchronous on `stream`
// (options.stream for the selection). Nothing here synchronises with the host, so index data is
// not checked: gather indices outside [-1, S) give zero rows, block sizes are clamped to
// [0, tile volume], cu_tiles offsets to [0, tiles] (a query tile outside every video gets
// count 0). Valid inputs give the CPU backend's results: exactly for the gathers and the
// pooling; the selection sums its fp32 scores in another order, so near-ties may resolve
// differently (with exact scores, the same indices). Failures throw: NotImplementedError
// where the kernels cannot serve a valid call (the selection's key tiles do not fit shared
// memory, a batch or head count above 65535), ValueError for given scores of more than
// 2^31 - 1 key tiles, std::runtime_error for CUDA errors.
void cuda_gather_tokens(const TensorView& x, const TensorView& index, const TensorView& out,
                        void* stream);
void cuda_tile_mean_pool(const TensorView& x, const TensorView& block_sizes,
                         std::int64_t tile_volume, const TensorView& out, void* stream);
void cuda_tile_mean_pool_backward(const TensorView& grad_out, const TensorView& block_sizes,
                                  std::int64_t tile_volume, const TensorView& grad_x,
                                  void* stream);
void cuda_select_topk_tiles(const TensorView& q_pooled, const TensorView& k_pooled,
                            const TopkOptions& options, double scale,
                            const TensorView& q2k_index, const TensorView& q2k_count);
void cuda_topk_tiles_from_scores(const TensorView& scores, std::int64_t topk,
                                 const TensorView& q2k_index, const TensorView& q2k_count,
                                 void* stream);

// CUDA block-sparse attention (sm_80 and newer; src/cuda/dispatch/block_sparse.cu, the
// transpose in src/cuda/vsa/k2q_transpose.cu): bfloat16 / float16, D and Dv multiples of 8
// up to 256; anything else throws NotImplementedError. Asynchronous on the given stream,
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
