// Online softmax on a warpgroup MMA accumulator fragment. In the 64xN fp32 accumulator of a
// warpgroup, value v = c + 2 r + 4 j of a thread sits at row (lane / 4 + 8 r) of its warp's
// 16 rows and column (8 j + 2 (lane % 4) + c): each thread holds two rows, and a row is spread
// over the 4 threads of a quad. Row statistics are kept in log2 units of the scaled logits
// (scale > 0, so max(s) * scale is the max of the scaled logits), one FFMA + EX2 per element.
#pragma once

#include <cmath>

#include "../sm80/mma_utils.h"
#include "../sm80/softmax_mask.h"

namespace vidattn::cuda_sm90 {

struct OnlineSoftmax {
  float row_max[2];  // running max of s * scale * log2(e); -inf while the row saw nothing
  float row_sum[2];  // this thread's partial sum of exp2(s * scale_log2 - row_max)
  float scale_log2;

  __device__ __forceinline__ explicit OnlineSoftmax(float scale) {
    scale_log2 = scale * cuda_sm80::kLog2e;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Turns the logits s into unnormalised probabilities in place. alpha[r] is the factor the
  // output accumulated so far must be multiplied by (unused on the first block).
  template <bool kFirst, class Frag>
  __device__ __forceinline__ void update(Frag& s, float (&alpha)[2]) {
    constexpr int kCols = decltype(cute::size(s))::value / 4;  // column groups of 8 (j)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = -INFINITY;
#pragma unroll
      for (int j = 0; j < kCols; ++j) mx = fmaxf(mx, fmaxf(s(4 * j + 2 * r), s(4 * j + 2 * r + 1)));
      mx = cuda_sm80::quad_max(mx);
      const float new_max = fmaxf(row_max[r], mx * scale_log2);
      // A row with nothing visible yet keeps -inf and adds exp2(-inf) = 0.
      const float base = new_max == -INFINITY ? 0.f : new_max;
      alpha[r] = kFirst ? 1.f : cuda_sm80::exp2_approx(row_max[r] - base);
      float sum = 0.f;
#pragma unroll
      for (int j = 0; j < kCols; ++j)
#pragma unroll
        for (int c = 0; c < 2; ++c) {
          const int v = 4 * j + 2 * r + c;
          s(v) = cuda_sm80::exp2_approx(fmaf(s(v), scale_log2, -base));
          sum += s(v);
        }
      row_sum[r] = kFirst ? sum : row_sum[r] * alpha[r] + sum;
      row_max[r] = new_max;
    }
  }
};

// Multiplies each row of an output accumulator fragment by its alpha.
template <class Frag>
__device__ __forceinline__ void rescale_rows(Frag& o, const float (&alpha)[2]) {
#pragma unroll
  for (int v = 0; v < decltype(cute::size(o))::value; ++v) o(v) *= alpha[(v >> 1) & 1];
}

}  // namespace vidattn::cuda_sm90
