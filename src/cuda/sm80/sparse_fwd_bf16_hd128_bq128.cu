// Block-sparse forward instantiation: bf16, head dim 128, 128-row query blocks.
#include "launch_impl.h"

namespace vidattn::cuda_sm80 {
template void launch_block_sparse_forward<__nv_bfloat16, 128, 128>(const AttentionParams&, cudaStream_t);
}  // namespace vidattn::cuda_sm80
