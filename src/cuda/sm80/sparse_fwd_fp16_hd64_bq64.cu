// Block-sparse forward instantiation: fp16, head dim 64, 64-row query blocks.
#include "launch_impl.h"

namespace vidattn::cuda_sm80 {
template void launch_block_sparse_forward<__half, 64, 64>(const AttentionParams&, cudaStream_t);
}  // namespace vidattn::cuda_sm80
