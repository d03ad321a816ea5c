// Mainloop of the sm_90a dK / dV kernel (KV-stationary). A CTA owns kRows keys of one key head
// (64 per consumer warpgroup); its producer loads their K and V once, then streams the visited
// query blocks (query_visit.h) through the ring: Q, dO, and the rows' LSE and row sums. Per
// block each consumer warpgroup computes, for its 64 keys:
//   S^T = K Q^T, dP^T = V dO^T                          (wgmma SS, issued together)
//   P^T = exp2(S^T scale log2(e) - lse2), dS^T = P^T (dP^T - delta)   (columns = queries)
//   dV += P^T dO, dK += dS^T Q                            (wgmma RS: P^T, dS^T from registers)
// and at the end stores dV and scale * dK. Every key has one owner and the blocks are summed in
// visit order, so dK and dV are the same bits on every run. With Traits::kFusedDq each block
// also adds its dQ = dS K into an fp32 workspace (bwd_fused_dq.h), and no dQ kernel runs.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "bwd_epilogue.h"
#include "bwd_fused_dq.h"
#include "bwd_kernel_params.h"
#include "bwd_tma_loads.h"
#include "cuda/common/mma_utils.h"
#include "cuda/common/tile_io.h"
#include "kernel_utils.h"
#include "query_visit.h"

namespace vidattn::cuda_sm90 {

// K and V of the CTA's kRows keys, once (producer warp 0).
template <class Traits>
__device__ __forceinline__ void dkdv_load_stationary(const BwdKernelParams<Traits>& p,
                                                     typename Traits::SharedStorage& st,
                                                     const cuda_common::Sequence& seq, int hk,
                                                     std::int64_t k0) {
  using namespace cute;
  const cuda_common::AttentionParams& a = p.attn;
  const int tb = a.varlen ? 0 : static_cast<int>(seq.batch);
  const int k_base = static_cast<int>(a.varlen ? seq.first_k : 0);
  Barrier::arrive_and_expect_tx(&st.rows_full, 2 * Traits::kRowsBytes);
  load_tile_pair<Traits::kRows, Traits::kHeadDim>(
      p.tma_x, p.tma_y, p.kv_rows, a.heads_kv, p.tma_batch, k_base + static_cast<int>(k0), hk,
      tb, make_tensor(make_smem_ptr(st.x.data()), typename Traits::SmemLayoutRows{}),
      make_tensor(make_smem_ptr(st.y.data()), typename Traits::SmemLayoutRows{}), st.rows_full);
}

// One stream's ring: Q, dO and the rows' statistics of each query block its visit names.
template <class Traits, class Visit>
__device__ __forceinline__ void dkdv_producer(const BwdKernelParams<Traits>& p,
                                              typename Traits::SharedStorage& st,
                                              const cuda_common::Sequence& seq, Visit visit,
                                              int stream) {
  using namespace cute;
  const cuda_common::AttentionParams& a = p.attn;
  const int tb = a.varlen ? 0 : static_cast<int>(seq.batch);
  const int q_base = static_cast<int>(a.varlen ? seq.first_q : 0);
  Tensor sQ = make_tensor(make_smem_ptr(st.u.data()), typename Traits::SmemLayoutCols{});
  Tensor sdO = make_tensor(make_smem_ptr(st.w.data()), typename Traits::SmemLayoutCols{});
  const int n = visit.num_blocks();
  RingState<Traits::kStages> ring;
  for (int i = 0; i < n; ++i) {
    const QueryBlock qb = visit.next();
    const int s = stream * Traits::kStages + ring.stage;
    Barrier::wait(&st.empty[s], ring.phase ^ 1u);
    Barrier::arrive_and_expect_tx(&st.full[s],
                                  2 * Traits::kColsBytes + 2 * Traits::kStatsBytes);
    load_tile_pair<Traits::kCols, Traits::kHeadDim>(
        p.tma_u, p.tma_w, p.q_rows, a.heads_q, p.tma_batch, q_base + static_cast<int>(qb.q0),
        qb.head, tb, sQ(_, _, s), sdO(_, _, s), st.full[s]);
    const std::int64_t stats = p.stats.offset(blockIdx.z, qb.head, a.heads_q, qb.q0);
    SM90_BULK_COPY_G2S::copy(p.stats.lse2 + stats, &st.full[s], st.lse2[s],
                             Traits::kStatsBytes);
    SM90_BULK_COPY_G2S::copy(p.stats.delta + stats, &st.full[s], st.delta[s],
                             Traits::kStatsBytes);
    ring.advance();
  }
}

// k0: the CTA's first key; the stream's tile starts at k0 + row0.
template <class Traits, class Visit>
__device__ __forceinline__ void dkdv_consumer(const BwdKernelParams<Traits>& p,
                                              typename Traits::SharedStorage& st,
                                              const cuda_common::Sequence& seq, Visit visit,
                                              int stream, int hk, std::int64_t k0, int tid) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int D = Traits::kHeadDim, R = Traits::kRows, C = Traits::kCols;
  const cuda_common::AttentionParams& a = p.attn;
  typename Traits::MmaSS mma_ss;
  typename Traits::MmaRS mma_rs;
  // The warpgroup, warp-uniform: the operand descriptors then live in uniform registers.
  const int wg = warp_uniform(tid / 128);
  auto wg_ss = mma_ss.get_thread_slice(wg * 128);
  auto wg_rs = mma_rs.get_thread_slice(wg * 128);
  auto thr_ss = mma_ss.get_thread_slice(tid);
  auto thr_rs = mma_rs.get_thread_slice(tid);
  Tensor sK = make_tensor(make_smem_ptr(st.x.data()), typename Traits::SmemLayoutRows{});
  Tensor sV = make_tensor(make_smem_ptr(st.y.data()), typename Traits::SmemLayoutRows{});
  Tensor sQ = make_tensor(make_smem_ptr(st.u.data()), typename Traits::SmemLayoutCols{});
  Tensor sdO = make_tensor(make_smem_ptr(st.w.data()), typename Traits::SmemLayoutCols{});
  Tensor sQt = make_tensor(make_smem_ptr(st.u.data()), typename Traits::SmemLayoutColsT{});
  Tensor sdOt = make_tensor(make_smem_ptr(st.w.data()), typename Traits::SmemLayoutColsT{});
  Tensor tSrK = wg_ss.partition_fragment_A(sK);
  Tensor tSrQ = wg_ss.partition_fragment_B(sQ);     // (mma, n, k, stage)
  Tensor tdPrV = wg_ss.partition_fragment_A(sV);
  Tensor tdPrdO = wg_ss.partition_fragment_B(sdO);
  Tensor tdVrdO = wg_rs.partition_fragment_B(sdOt);  // (mma, d, queries, stage)
  Tensor tdKrQ = wg_rs.partition_fragment_B(sQt);
  Tensor tSrS = partition_fragment_C(mma_ss, Shape<Int<R>, Int<C>>{});
  Tensor tdPrdP = partition_fragment_C(mma_ss, Shape<Int<R>, Int<C>>{});
  Tensor tdVrdV = partition_fragment_C(mma_rs, Shape<Int<R>, Int<D>>{});
  Tensor tdKrdK = partition_fragment_C(mma_rs, Shape<Int<R>, Int<D>>{});
  Tensor tScS = thr_ss.partition_C(make_identity_tensor(Shape<Int<R>, Int<C>>{}));
  Tensor tdVcdV = thr_rs.partition_C(make_identity_tensor(Shape<Int<R>, Int<D>>{}));
  Tensor tPrP = make_tensor<Element>(typename Traits::OperandLayout{});
  Tensor tdSrdS = make_tensor<Element>(typename Traits::OperandLayout{});
  Tensor tPrP32 = recast<uint32_t>(tPrP);
  Tensor tdSrdS32 = recast<uint32_t>(tdSrdS);
  constexpr int kVals = decltype(size(tSrS))::value;
  static_assert(decltype(size(tPrP))::value == kVals);
  clear(tdVrdV);
  clear(tdKrdK);
  const float scale_log2 = a.scale * cuda_common::kLog2e;
  const int row0 = stream * Traits::kStreamRows;

  // Fused dQ: the thread's two key rows (values 4j + {0, 1} and 4j + {2, 3}) that take no part
  // in dQ. dK and dV of such a key are zeroed at the store, but their dS is not: its P used the
  // row's LSE, which left the key out, so it can be anything up to inf, and a key past the
  // sequence may be the next sequence's.
  bool key_dead[2] = {false, false};
  if constexpr (Traits::kFusedDq) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const std::int64_t key = k0 + get<0>(tScS(2 * r));
      key_dead[r] = key >= seq.len_k || visit.key_dropped(key);
    }
  }

  const int n = visit.num_blocks();
  if (n > 0) Barrier::wait(&st.rows_full, 0);
  if constexpr (Traits::kFusedDq) {
    // The dQ product reads every stationary K row: the rows of keys that take no part (past
    // the sequence, padded slots, masked) to zero, since dS = 0 times a non-finite K is NaN.
    // One row per thread at most (kRows <= 256 threads).
    if (n > 0) {
      static_assert(Traits::kRows <= 128 * Traits::kConsumerWGs);
      if (tid < Traits::kRows &&
          (k0 + tid >= seq.len_k || visit.key_dropped(k0 + tid))) {
#pragma unroll
        for (int c = 0; c < D; c += 8)
          *reinterpret_cast<uint4*>(&sK(tid, c)) = make_uint4(0, 0, 0, 0);
      }
      cutlass::arch::fence_view_async_shared();
      named_barrier_sync(kBarDeadKeyRows, 128 * Traits::kConsumerWGs);
    }
  }
  RingState<Traits::kStages> ring;
  for (int i = 0; i < n; ++i) {
    const QueryBlock qb = visit.next();
    const int s = warp_uniform(stream * Traits::kStages + ring.stage);
    Barrier::wait(&st.full[s], ring.phase);
    if (qb.valid_rows < C) zero_tail_rows<Traits>(sQ, sdO, s, qb.valid_rows, stream, tid);
    warpgroup_gemm(mma_ss, tSrK, tSrQ(_, _, _, s), tSrS, true);
    warpgroup_gemm(mma_ss, tdPrV, tdPrdO(_, _, _, s), tdPrdP, true);
    warpgroup_wait<1>();  // S^T is ready; dP^T may still run
    warpgroup_fence_operand(tSrS);
    if (qb.needs_mask) visit.mask(tSrS, tScS, qb, row0);
    // Value v's column (query) is 8 (v / 4) + 2 (lane % 4) + v % 2: one float2 of each
    // statistic per column pair.
#pragma unroll
    for (int v = 0; v < kVals; v += 2) {
      const int col = get<1>(tScS(v));
      const float2 l = *reinterpret_cast<const float2*>(&st.lse2[s][col]);
      tSrS(v) = cuda_common::exp2_approx(fmaf(tSrS(v), scale_log2, -l.x));
      tSrS(v + 1) = cuda_common::exp2_approx(fmaf(tSrS(v + 1), scale_log2, -l.y));
    }
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdPrdP);
#pragma unroll
    for (int v = 0; v < kVals; v += 2) {
      const int col = get<1>(tScS(v));
      const float2 d = *reinterpret_cast<const float2*>(&st.delta[s][col]);
      tdPrdP(v) = tSrS(v) * (tdPrdP(v) - d.x);
      tdPrdP(v + 1) = tSrS(v + 1) * (tdPrdP(v + 1) - d.y);
    }
#pragma unroll
    for (int w = 0; w < kVals / 2; ++w) {
      tPrP32(w) = pack_pair<Element>(tSrS(2 * w), tSrS(2 * w + 1));
      tdSrdS32(w) = pack_pair<Element>(tdPrdP(2 * w), tdPrdP(2 * w + 1));
    }
    warpgroup_fence_operand(tPrP);
    warpgroup_fence_operand(tdSrdS);
    warpgroup_gemm(mma_rs, tPrP, tdVrdO(_, _, _, s), tdVrdV, false);
    warpgroup_gemm(mma_rs, tdSrdS, tdKrQ(_, _, _, s), tdKrdK, false);
    auto release_slot = [&] {
      warpgroup_fence_operand(tdVrdV);
      warpgroup_fence_operand(tdKrdK);
      Barrier::arrive(&st.empty[s]);
    };
    if constexpr (Traits::kFusedDq) {
      fused_dq_block<Traits>(p, st, tdSrdS32, key_dead, qb, i & 1, tid, release_slot);
    } else {
      warpgroup_wait<0>();
      release_slot();
    }
    ring.advance();
  }
  // The shared dQ buffers must outlive the reduce-adds that read them, and the dQ convert
  // kernel must see their sums.
  if constexpr (Traits::kFusedDq)
    if (dq_issuer<Traits>(tid)) bulk_wait_all();

  // dV and scale * dK (S = scale Q K^T) for the tile's keys of this sequence; a key the policy
  // drops (padding) takes no gradient.
  const std::int64_t valid = seq.len_k - k0;
  auto masked_key = [&](int row) { return visit.key_dropped(k0 + row); };
  auto* dv = static_cast<std::uint16_t*>(a.dv) +
             cuda_common::k_side_offset(a, a.dv_strides, seq, k0, hk);
  auto* dk = static_cast<std::uint16_t*>(a.dk) +
             cuda_common::k_side_offset(a, a.dk_strides, seq, k0, hk);
  store_gradient_rows<Element>(dv, a.dv_strides.row, tdVrdV, tdVcdV, 1.f, valid, a.out_aligned4,
                               masked_key);
  store_gradient_rows<Element>(dk, a.dk_strides.row, tdKrdK, tdVcdV, a.scale, valid,
                               a.out_aligned4, masked_key);
}

}  // namespace vidattn::cuda_sm90
