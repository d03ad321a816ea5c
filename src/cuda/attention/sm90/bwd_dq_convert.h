// The last kernel of the fused backward (BwdTraits::kFusedDq): the fp32 dQ workspace, summed by
// the dK / dV kernel's reduce-adds, scaled (S = scale Q K^T) and written to dQ in the input's
// dtype. One CTA of kDqThreads threads per (64-row tile, head, sequence): thread t reads the
// values it would hold as an accumulator of Traits::MmaDq (the fragment order of
// bwd_fused_dq.h, coalesced 16-byte loads), then stores them like the other kernels' epilogue.
// With a key split (D = 64) the workspace tile is the sum of the two warpgroups' partial tiles,
// which share one fragment order.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "bwd_epilogue.h"
#include "bwd_fused_dq.h"
#include "bwd_kernel_params.h"
#include "cuda/common/tile_io.h"
#include "kernel_utils.h"

namespace vidattn::cuda_sm90 {

template <class Traits>
__global__ void __launch_bounds__(Traits::kDqThreads)
    sm90_attention_bwd_dq_convert_kernel(const cuda_common::AttentionParams a,
                                         const float* __restrict__ dq_accum,
                                         const BwdRowStats stats) {
#ifdef VIDATTN_SM90_DEVICE_CODE
  using namespace cute;
  constexpr int C = Traits::kCols, D = Traits::kHeadDim;
  const int h = blockIdx.y;
  const cuda_common::Sequence seq = cuda_common::sequence_of(a, blockIdx.z);
  const std::int64_t q0 = static_cast<std::int64_t>(blockIdx.x) * C;
  if (q0 >= seq.len_q) return;
  const int t = threadIdx.x;
  const float* tile = dq_accum + dq_tile_offset<Traits>(stats, a.heads_q, blockIdx.z, h, q0);
  typename Traits::MmaDq mma;
  Tensor acc = partition_fragment_C(mma, Shape<Int<C>, Int<D>>{});
  Tensor coords = mma.get_thread_slice(t).partition_C(make_identity_tensor(Shape<Int<C>, Int<D>>{}));
#pragma unroll
  for (int v = 0; v < 32; v += 4) {
    const float4 x = __ldg(reinterpret_cast<const float4*>(tile + dq_fragment_index<Traits>(v, t)));
    acc(v) = x.x, acc(v + 1) = x.y, acc(v + 2) = x.z, acc(v + 3) = x.w;
  }
  auto* dq = static_cast<std::uint16_t*>(a.dq) +
             cuda_common::q_side_offset(a, a.dq_strides, seq, q0, h);
  store_gradient_rows<typename Traits::Element>(dq, a.dq_strides.row, acc, coords, a.scale,
                                                seq.len_q - q0, a.out_aligned4,
                                                [](int) { return false; });
#endif
}

}  // namespace vidattn::cuda_sm90
