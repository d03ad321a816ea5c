// Online softmax on a warpgroup MMA accumulator fragment. In the 64xN fp32 accumulator of a
// warpgroup, value v = c + 2 r + 4 j of a thread sits at row (lane / 4 + 8 r) of its warp's
// 16 rows and column (8 j + 2 (lane % 4) + c): each thread holds two rows, and a row is spread
// over the 4 threads of a quad. Row statistics are kept in log2 units of the scaled logits
// (scale > 0, so max(s) * scale is the max of the scaled logits), one FFMA + EX2 per element.
#pragma once

#include <cmath>

#include "cuda/common/mma_utils.h"
#include "cuda/common/mma_utils.h"

namespace vidattn::cuda_sm90 {

struct OnlineSoftmax {
  float row_max[2];  // the base of the exponentials: s * scale * log2(e) units; -inf while
                     // the row saw nothing
  float row_sum[2];  // this thread's partial sum of exp2(s * scale_log2 - row_max)
  float scale_log2;
  // The base moves only when a block's max exceeds it by more than this (log2 units):
  // probabilities stay <= 2^slack (fine for fp32 sums and 16-bit P), and the output
  // accumulator is rescaled on the few blocks that move it instead of on every block. The
  // result is the same math: numerator and denominator share the base.
  static constexpr float slack = 8.f;
  // 2^slack: no probability above it leaves the base in place.
  static constexpr float sum_limit = 256.f;

  __device__ __forceinline__ explicit OnlineSoftmax(float scale) {
    scale_log2 = scale * cuda_common::kLog2e;
    row_max[0] = row_max[1] = -INFINITY;
    row_sum[0] = row_sum[1] = 0.f;
  }

  // Row r's probabilities exp2(s * scale_log2 - base), pair by pair (values v and v + 1 of the
  // fragment) to put(v, p0, p1), and their sum: the part update and speculate share, so that
  // a speculated block's sums are update's to the bit (the same four chains, the same order).
  template <class Frag, class Put>
  __device__ __forceinline__ float exponentiate_row(const Frag& s, int r, float base,
                                                    Put&& put) const {
    constexpr int kCols = decltype(cute::size(s))::value / 4;  // column groups of 8 (j)
    float sum[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
    for (int j = 0; j < kCols; ++j) {
      const int v = 4 * j + 2 * r;
      const float p0 = cuda_common::exp2_approx(fmaf(s(v), scale_log2, -base));
      const float p1 = cuda_common::exp2_approx(fmaf(s(v + 1), scale_log2, -base));
      sum[(j & 1) * 2] += p0;
      sum[(j & 1) * 2 + 1] += p1;
      put(v, p0, p1);
    }
    return (sum[0] + sum[1]) + (sum[2] + sum[3]);
  }

  // A later block's probabilities against the rows' current bases, without the block's max:
  // that reduction (64 FMNMX, two quad shuffles per row) stands between S and the
  // exponentials, and dropping it took the unsafe probe's key loops from 517 to 427
  // instructions and +6-10% (docs/perf-history.md, Hopper v39). Each pair of probabilities
  // goes to put(pair, p0, p1), pair = value / 2 as convert_p packs them; s and the statistics
  // stay as they are. Returns whether this thread's share is what update<false> computes
  // without moving the base: both rows have one, and every probability is at most 2^slack (the
  // partial sums bound them; infinities and NaNs fail too). Then commit(block_sum) completes
  // the block; otherwise the warp runs update<false> on s instead.
  template <class Frag, class Put>
  __device__ __forceinline__ bool speculate(const Frag& s, float (&block_sum)[2],
                                            Put&& put) const {
    bool ok = true;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float base = row_max[r];
      block_sum[r] = exponentiate_row(s, r, base,
                                      [&](int v, float p0, float p1) { put(v / 2, p0, p1); });
      ok = ok && base != -INFINITY && block_sum[r] <= sum_limit;
    }
    return ok;
  }
  __device__ __forceinline__ void commit(const float (&block_sum)[2]) {
    row_sum[0] += block_sum[0];
    row_sum[1] += block_sum[1];
  }

  // Turns the logits s into unnormalised probabilities in place. alpha[r] is the factor the
  // output accumulated so far must be multiplied by (unused on the first block). Returns
  // whether some alpha of this thread differs from 1.
  template <bool kFirst, class Frag>
  __device__ __forceinline__ bool update(Frag& s, float (&alpha)[2]) {
    constexpr int kCols = decltype(cute::size(s))::value / 4;  // column groups of 8 (j)
    static_assert(kCols % 2 == 0);
    bool moved = false;
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      // Two independent max chains and four sum chains: the reductions are latency, not
      // throughput (two consumer warps per scheduler).
      float mx0 = -INFINITY, mx1 = -INFINITY;
#pragma unroll
      for (int j = 0; j < kCols; j += 2) {
        mx0 = fmaxf(mx0, fmaxf(s(4 * j + 2 * r), s(4 * j + 2 * r + 1)));
        mx1 = fmaxf(mx1, fmaxf(s(4 * j + 4 + 2 * r), s(4 * j + 4 + 2 * r + 1)));
      }
      const float block_max = cuda_common::quad_max(fmaxf(mx0, mx1)) * scale_log2;
      float new_max = row_max[r];
      if (kFirst || block_max > row_max[r] + slack) new_max = fmaxf(row_max[r], block_max);
      // A row with nothing visible yet keeps -inf and adds exp2(-inf) = 0.
      const float base = new_max == -INFINITY ? 0.f : new_max;
      alpha[r] = (kFirst || new_max == row_max[r]) ? 1.f
                                                   : cuda_common::exp2_approx(row_max[r] - base);
      moved = moved || alpha[r] != 1.f;
      const float block_sum = exponentiate_row(s, r, base, [&](int v, float p0, float p1) {
        s(v) = p0;
        s(v + 1) = p1;
      });
      row_sum[r] = kFirst ? block_sum : row_sum[r] * alpha[r] + block_sum;
      row_max[r] = new_max;
    }
    return moved;
  }
};

// Multiplies each row of an output accumulator fragment by its alpha.
template <class Frag>
__device__ __forceinline__ void rescale_rows(Frag& o, const float (&alpha)[2]) {
#pragma unroll
  for (int v = 0; v < decltype(cute::size(o))::value; ++v) o(v) *= alpha[(v >> 1) & 1];
}

}  // namespace vidattn::cuda_sm90
