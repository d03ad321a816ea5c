// Dense attention forward (FlashAttention-2 scheme): one CTA per (query block, head, batch);
// each warp owns 16 query rows and keeps them in registers; key/value blocks stream through
// shared memory with cp.async (the V load overlaps Q K^T, the next K load overlaps P V).
#pragma once

#include <cstdint>

#include "mma_utils.h"
#include "params.h"
#include "softmax_mask.h"
#include "tile_io.h"

namespace vidattn::cuda_sm80 {

template <int D>
struct FwdConfig {
  static constexpr int kWarps = 8;
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kBlockQ = 16 * kWarps;
  static constexpr int kBlockK = 64;
  static constexpr int kSmemBytes = (kBlockQ + 2 * kBlockK) * D * 2;
};

template <class T, int D>
__global__ void __launch_bounds__(FwdConfig<D>::kThreads)
    attention_fwd_kernel(const AttentionParams p) {
  using C = FwdConfig<D>;
  constexpr int BQ = C::kBlockQ, BK = C::kBlockK;
  extern __shared__ __align__(128) std::uint16_t smem[];
  std::uint16_t* q_tile = smem;
  std::uint16_t* k_tile = q_tile + BQ * D;
  std::uint16_t* v_tile = k_tile + BK * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / p.group;
  // Causal: the longest blocks (last queries) first, so the tail of the grid is short.
  const int qblock = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const Sequence seq = sequence_of(p, b);
  const std::int64_t q0 = static_cast<std::int64_t>(qblock) * BQ;
  if (q0 >= seq.len_q) return;
  const std::int64_t rows = seq.len_q - q0 < BQ ? seq.len_q - q0 : BQ;
  const MaskInfo mask = mask_info(p, seq);
  const std::int64_t k_end = key_end(mask, q0, rows);

  const auto* q = static_cast<const std::uint16_t*>(p.q) + q_side_offset(p, p.q_strides, seq, q0, h);
  const auto* k = static_cast<const std::uint16_t*>(p.k) + k_side_offset(p, p.k_strides, seq, 0, hk);
  const auto* v = static_cast<const std::uint16_t*>(p.v) + k_side_offset(p, p.v_strides, seq, 0, hk);

  load_tile<BQ, D, C::kThreads>(q_tile, q, p.q_strides.row, rows, p.aligned16);
  if (k_end > 0) load_tile<BK, D, C::kThreads>(k_tile, k, p.k_strides.row, seq.len_k, p.aligned16);
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  std::uint32_t qf[D / 16][4];
#pragma unroll
  for (int kk = 0; kk < D / 16; ++kk)
    ldmatrix_x4(qf[kk], smem_addr(q_tile + swizzle<D>(warp * 16 + (lane & 15), kk * 2 + (lane >> 4))));

  float o[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) o[n][0] = o[n][1] = o[n][2] = o[n][3] = 0.f;
  float row_max[2] = {-INFINITY, -INFINITY};
  float row_sum[2] = {0.f, 0.f};  // this thread's partial sums; reduced over the quad at the end
  const std::int64_t q_row = q0 + warp * 16 + (lane >> 2);

  for (std::int64_t k0 = 0; k0 < k_end; k0 += BK) {
    // K(k0) is resident; fetch V(k0) behind the logits.
    load_tile<BK, D, C::kThreads>(v_tile, v + k0 * p.v_strides.row, p.v_strides.row,
                                  seq.len_k - k0, p.aligned16);
    cp_async_commit();

    float s[BK / 8][4];
    qk_logits_reg<T, D, BK>(s, qf, k_tile);
    scale_and_mask<BK>(s, p.scale, mask, mask.block_needs_mask(q0, k0, BK), q_row, k0);

    // Online softmax; a row with nothing visible yet keeps max -inf and adds nothing.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      float mx = row_max[r];
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) mx = fmaxf(mx, fmaxf(s[n][2 * r], s[n][2 * r + 1]));
      mx = quad_max(mx);
      const float base = mx == -INFINITY ? 0.f : mx * kLog2e;
      const float alpha = exp2_approx(row_max[r] * kLog2e - base);
      row_max[r] = mx;
      float sum = 0.f;
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) {
        s[n][2 * r] = exp2_approx(fmaf(s[n][2 * r], kLog2e, -base));
        s[n][2 * r + 1] = exp2_approx(fmaf(s[n][2 * r + 1], kLog2e, -base));
        sum += s[n][2 * r] + s[n][2 * r + 1];
      }
      row_sum[r] = row_sum[r] * alpha + sum;
#pragma unroll
      for (int n = 0; n < D / 8; ++n) o[n][2 * r] *= alpha, o[n][2 * r + 1] *= alpha;
    }

    cp_async_wait_all();
    __syncthreads();  // V(k0) resident; every warp is done reading K(k0)
    if (k0 + BK < k_end) {
      load_tile<BK, D, C::kThreads>(k_tile, k + (k0 + BK) * p.k_strides.row, p.k_strides.row,
                                    seq.len_k - k0 - BK, p.aligned16);
      cp_async_commit();
    }

    // O += P V: the accumulator layout of P is the A-operand layout of the next mma.
#pragma unroll
    for (int kt = 0; kt < BK / 16; ++kt) {
      std::uint32_t a[4];
      a[0] = Mma<T>::pack(s[2 * kt][0], s[2 * kt][1]);
      a[1] = Mma<T>::pack(s[2 * kt][2], s[2 * kt][3]);
      a[2] = Mma<T>::pack(s[2 * kt + 1][0], s[2 * kt + 1][1]);
      a[3] = Mma<T>::pack(s[2 * kt + 1][2], s[2 * kt + 1][3]);
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        std::uint32_t bv[4];
        ldmatrix_x4_trans(bv, smem_addr(v_tile + swizzle<D>(kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                            np * 2 + (lane >> 4))));
        Mma<T>::run(o[2 * np], a, bv[0], bv[1]);
        Mma<T>::run(o[2 * np + 1], a, bv[2], bv[3]);
      }
    }
    cp_async_wait_all();
    __syncthreads();  // K(k0 + BK) resident; every warp is done reading V(k0)
  }

  // Epilogue: normalise, zero the rows that saw nothing or are padded queries, write O, LSE.
  auto* out = static_cast<std::uint16_t*>(p.out);
  const float sums[2] = {quad_sum(row_sum[0]), quad_sum(row_sum[1])};  // whole warp shuffles
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = q_row + 8 * r;
    if (i >= seq.len_q) continue;
    const float sum = sums[r];
    bool empty = !(sum > 0.f);
    if (p.query_mask && !p.query_mask[seq.batch * p.query_mask_batch + i * p.query_mask_row])
      empty = true;
    const float inv = empty ? 0.f : 1.f / sum;
    std::uint16_t* dst = out + q_side_offset(p, p.out_strides, seq, i, h);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      store_pair<T>(dst + n * 8 + (lane & 3) * 2, o[n][2 * r] * inv, o[n][2 * r + 1] * inv,
                    p.out_aligned4);
    if ((lane & 3) == 0)
      p.lse[q_side_offset(p, p.lse_strides, seq, i, h)] =
          empty ? -INFINITY : row_max[r] + logf(sum);
  }
}

}  // namespace vidattn::cuda_sm80
