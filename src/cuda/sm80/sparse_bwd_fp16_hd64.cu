// Block-sparse backward instantiation: fp16, head dim 64.
#include "launch_impl.h"

namespace vidattn::cuda_sm80 {
template void launch_block_sparse_backward<__half, 64>(const AttentionParams&, cudaStream_t);
}  // namespace vidattn::cuda_sm80
