// Attention forward (FlashAttention-2 scheme): one CTA per (query block, head, batch); each
// warp owns 32 query rows (two m16 tiles); key/value blocks stream through shared memory with
// cp.async (the V load overlaps Q K^T, the next K load overlaps P V). One mainloop for dense
// attention (kSparse = false: the key blocks of a range) and block-sparse attention
// (kSparse = true: the key tiles of the query tile's q2k list, key_visit.h).
// D is the instance's head-dim width (the shared tiles' row length). kPadded: the real head
// dims p.head_dim (q, k) and p.head_dim_v (v, out) may be smaller multiples of 8; the loads
// zero-fill the columns past them (zeros add nothing to Q K^T, and zero V columns give zero
// output columns) and the stores skip them. Without kPadded the predicates do not exist.
#pragma once

#include <cstdint>

#include "cuda/common/mma_utils.h"
#include "cuda/common/params.h"
#include "cuda/common/tile_io.h"
#include "key_visit.h"
#include "softmax_mask.h"

namespace vidattn::cuda_sm80 {

using namespace cuda_common;  // params, tile I/O and warp math shared with the sm_90a kernels

template <int D, int BLOCK_Q = 128>
struct FwdConfig {
  // Warps of 2 m-tiles (32 query rows) each: every K / V fragment read from shared memory
  // feeds two mma instead of one (16-row warps are bound by shared-memory bandwidth). 128
  // query rows (4 warps; at <= 255 registers two CTAs share an SM) by default; 64 (2 warps)
  // for block-sparse tiles of 64 tokens, whose query block must not span two tiles (4 warps
  // of one m-tile measured 18% slower there on an H200: 194 against 236 TFLOP/s).
  // Wider heads: the O accumulator takes D / 2 registers per m-tile, so above D = 128 two
  // m-tiles (D + 64 registers for O and S) no longer fit in 255 and warps own one m-tile.
  // Above D = 192 the query block is 64 rows whatever BLOCK_Q asks (64 divides every tile
  // volume, so a sparse CTA still stays in one tile): 128 rows would need 128 KiB of shared
  // memory, more than the 99 KiB an sm_86 / sm_89 block may have; 64 rows take 96 KiB.
  static_assert(BLOCK_Q == 64 || BLOCK_Q == 128, "query block of 64 or 128 rows");
  static_assert(D % 32 == 0 && D <= 256, "head-dim width: a multiple of 32 up to 256");
  static constexpr int kMTiles = D <= 128 ? 2 : 1;
  static constexpr int kRequestedQ = D <= 192 ? BLOCK_Q : 64;
  static constexpr int kWarps = kRequestedQ / (16 * kMTiles);
  static constexpr int kThreads = kWarps * 32;
  static constexpr int kMinBlocks = 256 / kThreads;  // CTAs per SM the registers must allow
  static constexpr int kBlockQ = 16 * kMTiles * kWarps;
  static constexpr int kBlockK = 64;
  static constexpr int kSmemBytes = (kBlockQ + 2 * kBlockK) * D * 2;
};

template <class T, int D, int BLOCK_Q, bool kSparse, bool kPadded>
__global__ void __launch_bounds__(FwdConfig<D, BLOCK_Q>::kThreads, FwdConfig<D, BLOCK_Q>::kMinBlocks)
    attention_fwd_kernel(const AttentionParams p) {
  using C = FwdConfig<D, BLOCK_Q>;
  constexpr int BQ = C::kBlockQ, BK = C::kBlockK, MT = C::kMTiles;
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
  const MaskInfo mask = mask_info(p, seq);
  // Valid query rows of the block (the rest are zero-filled and written as empty rows) and
  // the key blocks they visit.
  std::int64_t rows;
  const auto visit = query_block_visit<kSparse, BK>(p, seq, mask, b, h, q0, BQ, rows);
  const int steps = visit.steps();
  int step = visit.next(0);

  const auto* q = static_cast<const std::uint16_t*>(p.q) + q_side_offset(p, p.q_strides, seq, q0, h);
  const auto* k = static_cast<const std::uint16_t*>(p.k) + k_side_offset(p, p.k_strides, seq, 0, hk);
  const auto* v = static_cast<const std::uint16_t*>(p.v) + k_side_offset(p, p.v_strides, seq, 0, hk);
  // Real columns of the q / k and the v tiles (exact instances: the width, a constant).
  const int cols_qk = kPadded ? p.head_dim : D, cols_v = kPadded ? p.head_dim_v : D;

  load_head_tile<BQ, D, C::kThreads, kPadded>(q_tile, q, p.q_strides.row, rows, p.aligned16,
                                              cols_qk);
  if (step < steps) {
    const RowBlock kb = visit.block(step);
    load_head_tile<BK, D, C::kThreads, kPadded>(k_tile, k + kb.start * p.k_strides.row,
                                                p.k_strides.row, kb.valid, p.aligned16, cols_qk);
  }
  cp_async_commit();
  cp_async_wait_all();
  __syncthreads();

  const int warp_row0 = warp * 16 * MT;  // first row of this warp in the block
  float o[MT][D / 8][4];
  float row_max[MT][2], row_sum[MT][2];  // row_sum: this thread's partial sums
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int n = 0; n < D / 8; ++n) o[mt][n][0] = o[mt][n][1] = o[mt][n][2] = o[mt][n][3] = 0.f;
    row_max[mt][0] = row_max[mt][1] = -INFINITY;
    row_sum[mt][0] = row_sum[mt][1] = 0.f;
  }
  const std::int64_t q_row = q0 + warp_row0 + (lane >> 2);  // + 16 * mt + 8 * half

  while (step < steps) {
    const RowBlock kb = visit.block(step);
    const std::int64_t k0 = kb.start;
    // K(k0) is resident; fetch V(k0) behind the logits.
    load_head_tile<BK, D, C::kThreads, kPadded>(v_tile, v + k0 * p.v_strides.row, p.v_strides.row,
                                                kb.valid, p.aligned16, cols_v);
    cp_async_commit();

    // S = Q K^T, the same mma chain per element as qk_logits (k-order 0 .. D/16 - 1, padded:
    // up to the last step with real columns, from a zero accumulator), so the backward's
    // recomputed logits are bit-identical.
    float s[MT][BK / 8][4];
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
#pragma unroll
      for (int n = 0; n < BK / 8; ++n) s[mt][n][0] = s[mt][n][1] = s[mt][n][2] = s[mt][n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < D / 16; ++kk) {
      if (kPadded && kk * 16 >= cols_qk) break;  // padded: the rest adds exact zeros
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
        ldmatrix_x4(a[mt], smem_addr(q_tile + swizzle<D>(warp_row0 + mt * 16 + (lane & 15),
                                                        kk * 2 + (lane >> 4))));
#pragma unroll
      for (int np = 0; np < BK / 16; ++np) {
        std::uint32_t bk[4];
        ldmatrix_x4(bk, smem_addr(k_tile + swizzle<D>(np * 16 + (lane & 7) + ((lane >> 4) << 3),
                                                      kk * 2 + ((lane >> 3) & 1))));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(s[mt][2 * np], a[mt], bk[0], bk[1]);
          Mma<T>::run(s[mt][2 * np + 1], a[mt], bk[2], bk[3]);
        }
      }
    }
    // Sparse: only a partial key block (slots past the tile's block size) needs a mask.
    const MaskInfo block_mask = kSparse ? key_limit_mask(seq.len_q, k0 + kb.valid) : mask;
    const bool needs_mask = kSparse ? kb.valid < BK : mask.block_needs_mask(q0, k0, BK);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      scale_and_mask<BK>(s[mt], p.scale, block_mask, needs_mask, q_row + 16 * mt, k0);
      // Online softmax; a row with nothing visible yet keeps max -inf and adds nothing.
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        float mx = row_max[mt][r];
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) mx = fmaxf(mx, fmaxf(s[mt][n][2 * r], s[mt][n][2 * r + 1]));
        mx = quad_max(mx);
        const float base = mx == -INFINITY ? 0.f : mx * kLog2e;
        const float alpha = exp2_approx(row_max[mt][r] * kLog2e - base);
        row_max[mt][r] = mx;
        float sum = 0.f;
#pragma unroll
        for (int n = 0; n < BK / 8; ++n) {
          s[mt][n][2 * r] = exp2_approx(fmaf(s[mt][n][2 * r], kLog2e, -base));
          s[mt][n][2 * r + 1] = exp2_approx(fmaf(s[mt][n][2 * r + 1], kLog2e, -base));
          sum += s[mt][n][2 * r] + s[mt][n][2 * r + 1];
        }
        row_sum[mt][r] = row_sum[mt][r] * alpha + sum;
#pragma unroll
        for (int n = 0; n < D / 8; ++n) o[mt][n][2 * r] *= alpha, o[mt][n][2 * r + 1] *= alpha;
      }
    }

    cp_async_wait_all();
    __syncthreads();  // V(k0) resident; every warp is done reading K(k0)
    const int next_step = visit.next(step + 1);
    if (next_step < steps) {
      const RowBlock nb = visit.block(next_step);
      load_head_tile<BK, D, C::kThreads, kPadded>(k_tile, k + nb.start * p.k_strides.row,
                                                  p.k_strides.row, nb.valid, p.aligned16, cols_qk);
      cp_async_commit();
    }

    // O += P V: the accumulator layout of P is the A-operand layout of the next mma.
#pragma unroll
    for (int kt = 0; kt < BK / 16; ++kt) {
      std::uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        a[mt][0] = Mma<T>::pack(s[mt][2 * kt][0], s[mt][2 * kt][1]);
        a[mt][1] = Mma<T>::pack(s[mt][2 * kt][2], s[mt][2 * kt][3]);
        a[mt][2] = Mma<T>::pack(s[mt][2 * kt + 1][0], s[mt][2 * kt + 1][1]);
        a[mt][3] = Mma<T>::pack(s[mt][2 * kt + 1][2], s[mt][2 * kt + 1][3]);
      }
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        if (kPadded && np * 16 >= cols_v) break;  // padded: O columns past Dv stay 0
        std::uint32_t bv[4];
        ldmatrix_x4_trans(bv, smem_addr(v_tile + swizzle<D>(kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                            np * 2 + (lane >> 4))));
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          Mma<T>::run(o[mt][2 * np], a[mt], bv[0], bv[1]);
          Mma<T>::run(o[mt][2 * np + 1], a[mt], bv[2], bv[3]);
        }
      }
    }
    cp_async_wait_all();
    __syncthreads();  // the next K resident; every warp is done reading V(k0)
    step = next_step;
  }

  // Epilogue: normalise, zero the rows that saw nothing or are padded queries, write O, LSE.
  auto* out = static_cast<std::uint16_t*>(p.out);
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    const float sums[2] = {quad_sum(row_sum[mt][0]), quad_sum(row_sum[mt][1])};  // whole warp
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const std::int64_t i = q_row + 16 * mt + 8 * r;
      if (i >= seq.len_q) continue;
      const float sum = sums[r];
      // Empty: no visible key, sum exactly 0. A NaN sum (a NaN that took part in the row)
      // writes NaN, LSE NaN (docs/conventions.md).
      bool empty = sum == 0.f;
      if (p.query_mask && !p.query_mask[seq.batch * p.query_mask_batch + i * p.query_mask_row])
        empty = true;
      if (kSparse && i - q0 >= rows) empty = true;  // padded query slot
      const float inv = empty ? 0.f : 1.f / sum;
      std::uint16_t* dst = out + q_side_offset(p, p.out_strides, seq, i, h);
#pragma unroll
      for (int n = 0; n < D / 8; ++n)
        if (!kPadded || n * 8 < cols_v)
          store_pair<T>(dst + n * 8 + (lane & 3) * 2, o[mt][n][2 * r] * inv,
                        o[mt][n][2 * r + 1] * inv, p.out_aligned4);
      if ((lane & 3) == 0)
        p.lse[q_side_offset(p, p.lse_strides, seq, i, h)] =
            empty ? -INFINITY : row_max[mt][r] + logf(sum);
    }
  }
}

}  // namespace vidattn::cuda_sm80
