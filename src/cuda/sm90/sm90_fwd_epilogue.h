// Epilogue of the sm_90a forward: normalises the output accumulator, writes exact zeros (LSE
// -inf) for rows that saw no key or are padded queries (query mask; block-sparse: slots at
// or past `row_limit`, the end of the tile's valid slots), and writes O (pairs of columns,
// 4-byte stores) and the LSE (natural log, fp32) straight from registers. Rows past the
// sequence are not written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "../sm80/softmax_mask.h"
#include "../sm80/tile_io.h"
#include "sm90_fwd_params.h"
#include "sm90_fwd_softmax.h"

namespace vidattn::cuda_sm90 {

using cuda_sm80::Sequence;

template <class Element>
__device__ __forceinline__ std::uint32_t pack_pair(float x, float y) {
  if constexpr (cute::is_same_v<Element, cutlass::bfloat16_t>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
}

// o: the thread's output accumulator; coords(v): (row, column) of value v in the stream tile.
template <class Element, class Frag, class Coords>
__device__ __forceinline__ void write_output(const AttentionParams& p, const Sequence& seq, int h,
                                             std::int64_t q0, const Frag& o, const Coords& coords,
                                             OnlineSoftmax& sm, std::int64_t row_limit) {
  constexpr int kVals = decltype(cute::size(o))::value;
  const int lane = threadIdx.x & 31;
  auto* out = static_cast<std::uint16_t*>(p.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const float sum = cuda_sm80::quad_sum(sm.row_sum[r]);  // the whole row (quad)
    const std::int64_t i = q0 + cute::get<0>(coords(2 * r));
    if (i >= seq.len_q) continue;
    bool empty = !(sum > 0.f);
    if (p.query_mask && !p.query_mask[seq.batch * p.query_mask_batch + i * p.query_mask_row])
      empty = true;
    if (i >= row_limit) empty = true;
    const float inv = empty ? 0.f : 1.f / sum;
    std::uint16_t* dst = out + cuda_sm80::q_side_offset(p, p.out_strides, seq, i, h);
#pragma unroll
    for (int j = 0; j < kVals / 4; ++j) {
      const int v = 4 * j + 2 * r;
      // Exact zeros: a padded row's accumulator may hold anything (its inputs are not read
      // by contract), and 0 * NaN is NaN.
      *reinterpret_cast<std::uint32_t*>(dst + cute::get<1>(coords(v))) =
          empty ? 0u : pack_pair<Element>(o(v) * inv, o(v + 1) * inv);
    }
    if ((lane & 3) == 0)
      p.lse[cuda_sm80::q_side_offset(p, p.lse_strides, seq, i, h)] =
          empty ? -INFINITY : sm.row_max[r] * 0.6931471805599453f + logf(sum);
  }
}

}  // namespace vidattn::cuda_sm90
