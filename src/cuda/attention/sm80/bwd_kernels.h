// Attention backward, deterministic (no atomics, every output element has one owner):
//   1. delta = rowsum(dO * O), one warp per (row, head), into a [Hq][rows_q] workspace;
//   2. dK, dV: one CTA per (key block, kv head, batch), looping over the query blocks of
//      every q head of its group, accumulating in registers;
//   3. dQ: one CTA per (query block, head, batch), looping over key blocks.
// Both 2 and 3 recompute P = exp(S - LSE) from the same logits the forward computed
// (softmax_mask.h says why they are bit-identical). kSparse = false: dense (the blocks of a
// range); kSparse = true: block-sparse, dK/dV over the key tile's k2q list and dQ over the
// query tile's q2k list, in list order (key_visit.h), so reruns are bit-identical.
// D is the instance's head-dim width; kPadded as in fwd_kernel.h: q, k, dQ, dK have
// p.head_dim columns and v, out, dO, dV p.head_dim_v, both at most D; the loads zero-fill the
// rest of each tile row (so dP = dO V^T and the logits match the forward's) and the stores
// skip it.
#pragma once

#include <cstdint>

#include "cuda/common/mma_utils.h"
#include "cuda/common/params.h"
#include "cuda/common/tile_io.h"
#include "key_visit.h"
#include "softmax_mask.h"

namespace vidattn::cuda_sm80 {

using namespace cuda_common;  // params, tile I/O and warp math shared with the sm_90a kernels

// Shared memory: 512 D + 16 KiB bytes (dK / dV) and 512 D (dQ); above D = 128 that exceeds
// the 99 KiB of an sm_86 / sm_89 block (A100 and H100 class GPUs fit D = 256), which the
// launcher reports as NotImplementedError.
template <int D>
struct BwdConfig {
  static constexpr int kBlockQ = 64;
  static constexpr int kBlockK = 64;
  // dK/dV kernel: 8 warps; for S and dP warp w owns query rows 16 * (w % 4) and keys
  // 32 * (w / 4); for dK and dV it owns keys 16 * (w % 4) and head-dim half w / 4.
  static constexpr int kDkdvWarps = 8;
  static constexpr int kDkdvThreads = kDkdvWarps * 32;
  static constexpr int kDkdvSmemBytes = (2 * kBlockK * D + 2 * kBlockQ * D + 2 * kBlockQ * kBlockK) * 2;
  // dQ kernel: 4 warps of 16 query rows each.
  static constexpr int kDqWarps = 4;
  static constexpr int kDqThreads = kDqWarps * 32;
  static constexpr int kDqSmemBytes = (2 * kBlockQ * D + 2 * kBlockK * D) * 2;
};

template <class T, int D, bool kPadded>
__global__ void __launch_bounds__(256) attention_bwd_delta_kernel(const AttentionParams p) {
  const std::int64_t task = static_cast<std::int64_t>(blockIdx.x) * (blockDim.x / 32) + threadIdx.x / 32;
  const int lane = threadIdx.x & 31;
  if (task >= p.rows_q * p.heads_q) return;
  const int h = static_cast<int>(task / p.rows_q);
  const std::int64_t row = task % p.rows_q;
  auto offset = [&](const RowStrides& st) {
    if (p.varlen) return row * st.row + h * st.head;
    const std::int64_t b = row / p.seqlen_q, i = row % p.seqlen_q;
    return b * st.batch + i * st.row + h * st.head;
  };
  const auto* o = static_cast<const std::uint16_t*>(p.out) + offset(p.out_strides);
  const auto* g = static_cast<const std::uint16_t*>(p.grad_out) + offset(p.grad_out_strides);
  float sum = 0.f;
  const int width = kPadded ? p.head_dim_v : D;
#pragma unroll
  for (int d = lane; d < width; d += 32) sum += Mma<T>::to_float(o[d]) * Mma<T>::to_float(g[d]);
#pragma unroll
  for (int m = 16; m > 0; m >>= 1) sum += __shfl_xor_sync(0xffffffffu, sum, m);
  if (lane == 0) p.delta[task] = sum;
}

// LSE and delta of one query row; a dead row (padded, out of range, or saw no key in the
// forward) has P = 0 and so contributes and receives no gradient.
struct RowStats {
  float lse_log2 = 0.f;
  float delta = 0.f;
  bool dead = true;
};

__device__ __forceinline__ RowStats row_stats(const AttentionParams& p, const Sequence& seq,
                                              std::int64_t i, int h, bool live = true) {
  RowStats r;
  if (!live || i >= seq.len_q) return r;
  if (p.query_mask && !p.query_mask[seq.batch * p.query_mask_batch + i * p.query_mask_row])
    return r;
  const float lse = p.lse[q_side_offset(p, p.lse_strides, seq, i, h)];
  if (lse == -INFINITY) return r;
  r.dead = false;
  r.lse_log2 = lse * kLog2e;
  r.delta = p.delta[static_cast<std::int64_t>(h) * p.rows_q + seq.first_q + i];
  return r;
}

// In place: s (scaled, masked logits) -> P, dp -> dS = P * (dP - delta).
template <int KEYS>
__device__ __forceinline__ void probs_and_dscores(float (&s)[KEYS / 8][4], float (&dp)[KEYS / 8][4],
                                                  const RowStats (&rs)[2]) {
#pragma unroll
  for (int n = 0; n < KEYS / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const RowStats& r = rs[e >> 1];
      const float prob = r.dead ? 0.f : exp2_approx(fmaf(s[n][e], kLog2e, -r.lse_log2));
      s[n][e] = prob;
      dp[n][e] = prob * (dp[n][e] - r.delta);
    }
}

template <class T, int D, bool kSparse, bool kPadded>
__global__ void __launch_bounds__(BwdConfig<D>::kDkdvThreads)
    attention_bwd_dkdv_kernel(const AttentionParams p) {
  using C = BwdConfig<D>;
  constexpr int BQ = C::kBlockQ, BK = C::kBlockK;
  constexpr int KW = BK / 2;  // keys of one warp in the S / dP phase
  constexpr int DW = D / 2;   // head-dim columns of one warp in the dK / dV phase
  extern __shared__ __align__(128) std::uint16_t smem[];
  std::uint16_t* k_tile = smem;
  std::uint16_t* v_tile = k_tile + BK * D;
  std::uint16_t* q_tile = v_tile + BK * D;
  std::uint16_t* do_tile = q_tile + BQ * D;
  std::uint16_t* p_tile = do_tile + BQ * D;  // [BQ][BK]
  std::uint16_t* ds_tile = p_tile + BQ * BK;  // [BQ][BK]

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int wq = warp & 3, wk = warp >> 2;
  const int hk = blockIdx.y, b = blockIdx.z;
  const Sequence seq = sequence_of(p, b);
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.x) * BK;
  if (k0 >= seq.len_k) return;
  // Sparse: the key tile of this block and its valid keys (a prefix; 0 skips every query).
  const std::int64_t key_tile = k0 / p.tile_volume;
  std::int64_t k_valid = seq.len_k - k0;
  if constexpr (kSparse) {
    k_valid = tile_size(p.kv_block_sizes, p.kv_block_sizes_stride, key_tile, p.tile_volume) -
              (k0 - key_tile * p.tile_volume);
    k_valid = clamp64(k_valid, 0, BK);
  }
  const MaskInfo mask = kSparse ? key_limit_mask(seq.len_q, k0 + k_valid) : mask_info(p, seq);

  const auto* k = static_cast<const std::uint16_t*>(p.k) + k_side_offset(p, p.k_strides, seq, k0, hk);
  const auto* v = static_cast<const std::uint16_t*>(p.v) + k_side_offset(p, p.v_strides, seq, k0, hk);
  // Real columns of the q / k and the v / dO tiles (exact instances: the width, a constant).
  const int cols_qk = kPadded ? p.head_dim : D, cols_v = kPadded ? p.head_dim_v : D;
  load_head_tile<BK, D, C::kDkdvThreads, kPadded>(k_tile, k, p.k_strides.row, k_valid, p.aligned16,
                                                  cols_qk);
  load_head_tile<BK, D, C::kDkdvThreads, kPadded>(v_tile, v, p.v_strides.row, k_valid, p.aligned16,
                                                  cols_v);
  cp_async_commit();

  float dk[DW / 8][4], dv[DW / 8][4];
#pragma unroll
  for (int n = 0; n < DW / 8; ++n)
#pragma unroll
    for (int e = 0; e < 4; ++e) dk[n][e] = dv[n][e] = 0.f;

  const std::int64_t q_begin = kSparse ? 0 : query_begin(mask, k0);
  for (int g = 0; g < p.group; ++g) {
    const int h = hk * p.group + g;
    const auto* q = static_cast<const std::uint16_t*>(p.q) + q_side_offset(p, p.q_strides, seq, 0, h);
    const auto* go = static_cast<const std::uint16_t*>(p.grad_out) +
                     q_side_offset(p, p.grad_out_strides, seq, 0, h);
    const auto visit = [&] {
      if constexpr (kSparse) {
        SparseVisit w = sparse_query_visit(p, b, h, key_tile);
        if (k_valid <= 0) w.n_steps = 0;
        return w;
      } else {
        return DenseVisit<BQ>{q_begin, seq.len_q, seq.len_q};
      }
    }();
    const int steps = visit.steps();
    for (int step = visit.next(0); step < steps; step = visit.next(step + 1)) {
      const RowBlock qb = visit.block(step);
      const std::int64_t q0 = qb.start;
      __syncthreads();  // the previous block's tiles are no longer read
      load_head_tile<BQ, D, C::kDkdvThreads, kPadded>(q_tile, q + q0 * p.q_strides.row,
                                                      p.q_strides.row, qb.valid, p.aligned16,
                                                      cols_qk);
      load_head_tile<BQ, D, C::kDkdvThreads, kPadded>(do_tile, go + q0 * p.grad_out_strides.row,
                                                      p.grad_out_strides.row, qb.valid, p.aligned16,
                                                      cols_v);
      cp_async_commit();
      const std::int64_t q_row = q0 + wq * 16 + (lane >> 2);
      // Sparse: padded query slots (past the valid prefix) are dead rows.
      const RowStats rs[2] = {row_stats(p, seq, q_row, h, !kSparse || q_row - q0 < qb.valid),
                              row_stats(p, seq, q_row + 8, h, !kSparse || q_row + 8 - q0 < qb.valid)};
      cp_async_wait_all();
      __syncthreads();

      float s[KW / 8][4], dp[KW / 8][4];
      qk_logits<T, D, KW, kPadded>(s, q_tile, wq * 16, k_tile, wk * KW, cols_qk);
      const bool needs_mask = kSparse ? k_valid < BK : mask.block_needs_mask(q0, k0, BK);
      scale_and_mask<KW>(s, p.scale, mask, needs_mask, q_row, k0 + wk * KW);
      qk_logits<T, D, KW, kPadded>(dp, do_tile, wq * 16, v_tile, wk * KW, cols_v);
      probs_and_dscores<KW>(s, dp, rs);
#pragma unroll
      for (int n = 0; n < KW / 8; ++n)
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const int row = wq * 16 + (lane >> 2) + 8 * r;
          const int at = swizzle<BK>(row, wk * (KW / 8) + n) + (lane & 3) * 2;
          *reinterpret_cast<std::uint32_t*>(p_tile + at) = Mma<T>::pack(s[n][2 * r], s[n][2 * r + 1]);
          *reinterpret_cast<std::uint32_t*>(ds_tile + at) = Mma<T>::pack(dp[n][2 * r], dp[n][2 * r + 1]);
        }
      __syncthreads();

      // dV += P^T dO and dK += dS^T Q over this warp's 16 keys and DW head-dim columns.
#pragma unroll
      for (int kt = 0; kt < BQ / 16; ++kt) {
        const int a_at = swizzle<BK>(kt * 16 + (lane & 7) + ((lane >> 4) << 3), wq * 2 + ((lane >> 3) & 1));
        std::uint32_t ap[4], ads[4];
        ldmatrix_x4_trans(ap, smem_addr(p_tile + a_at));
        ldmatrix_x4_trans(ads, smem_addr(ds_tile + a_at));
#pragma unroll
        for (int np = 0; np < DW / 16; ++np) {
          const int b_at = swizzle<D>(kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                      wk * (DW / 8) + np * 2 + (lane >> 4));
          const int col0 = wk * DW + np * 16;  // padded: columns past the real dims stay 0
          std::uint32_t bf[4];
          if (!kPadded || col0 < cols_v) {
            ldmatrix_x4_trans(bf, smem_addr(do_tile + b_at));
            Mma<T>::run(dv[2 * np], ap, bf[0], bf[1]);
            Mma<T>::run(dv[2 * np + 1], ap, bf[2], bf[3]);
          }
          if (!kPadded || col0 < cols_qk) {
            ldmatrix_x4_trans(bf, smem_addr(q_tile + b_at));
            Mma<T>::run(dk[2 * np], ads, bf[0], bf[1]);
            Mma<T>::run(dk[2 * np + 1], ads, bf[2], bf[3]);
          }
        }
      }
    }
  }
  cp_async_wait_all();  // a block with no query rows still owns its K/V load

  auto* dk_out = static_cast<std::uint16_t*>(p.dk);
  auto* dv_out = static_cast<std::uint16_t*>(p.dv);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t j = k0 + wq * 16 + (lane >> 2) + 8 * r;
    if (j >= seq.len_k) continue;
    std::uint16_t* dkr = dk_out + k_side_offset(p, p.dk_strides, seq, j, hk) + wk * DW;
    std::uint16_t* dvr = dv_out + k_side_offset(p, p.dv_strides, seq, j, hk) + wk * DW;
#pragma unroll
    for (int n = 0; n < DW / 8; ++n) {
      const int col = n * 8 + (lane & 3) * 2;
      if (!kPadded || wk * DW + n * 8 < p.head_dim)
        store_pair<T>(dkr + col, dk[n][2 * r] * p.scale, dk[n][2 * r + 1] * p.scale,
                      p.out_aligned4);
      if (!kPadded || wk * DW + n * 8 < p.head_dim_v)
        store_pair<T>(dvr + col, dv[n][2 * r], dv[n][2 * r + 1], p.out_aligned4);
    }
  }
}

template <class T, int D, bool kSparse, bool kPadded>
__global__ void __launch_bounds__(BwdConfig<D>::kDqThreads)
    attention_bwd_dq_kernel(const AttentionParams p) {
  using C = BwdConfig<D>;
  constexpr int BQ = C::kBlockQ, BK = C::kBlockK;
  extern __shared__ __align__(128) std::uint16_t smem[];
  std::uint16_t* q_tile = smem;
  std::uint16_t* do_tile = q_tile + BQ * D;
  std::uint16_t* k_tile = do_tile + BQ * D;
  std::uint16_t* v_tile = k_tile + BK * D;

  const int warp = threadIdx.x / 32, lane = threadIdx.x & 31;
  const int h = blockIdx.y, b = blockIdx.z;
  const int hk = h / p.group;
  const int qblock = p.causal ? gridDim.x - 1 - blockIdx.x : blockIdx.x;
  const Sequence seq = sequence_of(p, b);
  const std::int64_t q0 = static_cast<std::int64_t>(qblock) * BQ;
  if (q0 >= seq.len_q) return;
  const MaskInfo mask = mask_info(p, seq);
  std::int64_t rows;  // valid query rows (sparse: padded slots are zero-filled, dead rows)
  const auto visit = query_block_visit<kSparse, BK>(p, seq, mask, b, h, q0, BQ, rows);
  const int steps = visit.steps();
  int step = visit.next(0);

  const auto* q = static_cast<const std::uint16_t*>(p.q) + q_side_offset(p, p.q_strides, seq, q0, h);
  const auto* go = static_cast<const std::uint16_t*>(p.grad_out) +
                   q_side_offset(p, p.grad_out_strides, seq, q0, h);
  const auto* k = static_cast<const std::uint16_t*>(p.k) + k_side_offset(p, p.k_strides, seq, 0, hk);
  const auto* v = static_cast<const std::uint16_t*>(p.v) + k_side_offset(p, p.v_strides, seq, 0, hk);
  // Real columns of the q / k and the v / dO tiles (exact instances: the width, a constant).
  const int cols_qk = kPadded ? p.head_dim : D, cols_v = kPadded ? p.head_dim_v : D;
  load_head_tile<BQ, D, C::kDqThreads, kPadded>(q_tile, q, p.q_strides.row, rows, p.aligned16,
                                                cols_qk);
  load_head_tile<BQ, D, C::kDqThreads, kPadded>(do_tile, go, p.grad_out_strides.row, rows,
                                                p.aligned16, cols_v);
  if (step < steps) {
    const RowBlock kb = visit.block(step);
    load_head_tile<BK, D, C::kDqThreads, kPadded>(k_tile, k + kb.start * p.k_strides.row,
                                                  p.k_strides.row, kb.valid, p.aligned16, cols_qk);
    load_head_tile<BK, D, C::kDqThreads, kPadded>(v_tile, v + kb.start * p.v_strides.row,
                                                  p.v_strides.row, kb.valid, p.aligned16, cols_v);
  }
  cp_async_commit();
  const std::int64_t q_row = q0 + warp * 16 + (lane >> 2);
  const RowStats rs[2] = {row_stats(p, seq, q_row, h, !kSparse || q_row - q0 < rows),
                          row_stats(p, seq, q_row + 8, h, !kSparse || q_row + 8 - q0 < rows)};
  cp_async_wait_all();
  __syncthreads();

  float dq[D / 8][4];
#pragma unroll
  for (int n = 0; n < D / 8; ++n) dq[n][0] = dq[n][1] = dq[n][2] = dq[n][3] = 0.f;

  while (step < steps) {
    const RowBlock kb = visit.block(step);
    const std::int64_t k0 = kb.start;
    float s[BK / 8][4], dp[BK / 8][4];
    qk_logits<T, D, BK, kPadded>(s, q_tile, warp * 16, k_tile, 0, cols_qk);
    const MaskInfo block_mask = kSparse ? key_limit_mask(seq.len_q, k0 + kb.valid) : mask;
    const bool needs_mask = kSparse ? kb.valid < BK : mask.block_needs_mask(q0, k0, BK);
    scale_and_mask<BK>(s, p.scale, block_mask, needs_mask, q_row, k0);
    qk_logits<T, D, BK, kPadded>(dp, do_tile, warp * 16, v_tile, 0, cols_v);
    probs_and_dscores<BK>(s, dp, rs);
    // dQ += dS K (the scale is applied once at the end).
#pragma unroll
    for (int kt = 0; kt < BK / 16; ++kt) {
      std::uint32_t a[4];
      a[0] = Mma<T>::pack(dp[2 * kt][0], dp[2 * kt][1]);
      a[1] = Mma<T>::pack(dp[2 * kt][2], dp[2 * kt][3]);
      a[2] = Mma<T>::pack(dp[2 * kt + 1][0], dp[2 * kt + 1][1]);
      a[3] = Mma<T>::pack(dp[2 * kt + 1][2], dp[2 * kt + 1][3]);
#pragma unroll
      for (int np = 0; np < D / 16; ++np) {
        if (kPadded && np * 16 >= cols_qk) break;  // padded: dQ columns past D stay 0
        std::uint32_t bk[4];
        ldmatrix_x4_trans(bk, smem_addr(k_tile + swizzle<D>(kt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8,
                                                            np * 2 + (lane >> 4))));
        Mma<T>::run(dq[2 * np], a, bk[0], bk[1]);
        Mma<T>::run(dq[2 * np + 1], a, bk[2], bk[3]);
      }
    }
    __syncthreads();  // every warp is done with K, V of this block
    const int next_step = visit.next(step + 1);
    if (next_step < steps) {
      const RowBlock nb = visit.block(next_step);
      load_head_tile<BK, D, C::kDqThreads, kPadded>(k_tile, k + nb.start * p.k_strides.row,
                                                    p.k_strides.row, nb.valid, p.aligned16,
                                                    cols_qk);
      load_head_tile<BK, D, C::kDqThreads, kPadded>(v_tile, v + nb.start * p.v_strides.row,
                                                    p.v_strides.row, nb.valid, p.aligned16, cols_v);
      cp_async_commit();
      cp_async_wait_all();
      __syncthreads();
    }
    step = next_step;
  }

  auto* dq_out = static_cast<std::uint16_t*>(p.dq);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t i = q_row + 8 * r;
    if (i >= seq.len_q) continue;
    std::uint16_t* dst = dq_out + q_side_offset(p, p.dq_strides, seq, i, h);
#pragma unroll
    for (int n = 0; n < D / 8; ++n)
      if (!kPadded || n * 8 < p.head_dim)
        store_pair<T>(dst + n * 8 + (lane & 3) * 2, dq[n][2 * r] * p.scale,
                      dq[n][2 * r + 1] * p.scale, p.out_aligned4);
  }
}

}  // namespace vidattn::cuda_sm80
