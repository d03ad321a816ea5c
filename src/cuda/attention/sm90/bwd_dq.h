// Mainloop of the sm_90a dQ kernel (Q-stationary). A CTA owns kRows query rows of one head (64
// per consumer warpgroup); its producer loads their Q and dO once, then streams the key blocks
// the forward visited (the forward's key-visit policy, key_visit.h) through the ring: K and V.
// Per block each consumer warpgroup computes, for its 64 queries:
//   S = Q K^T, dP = dO V^T                               (wgmma SS, issued together)
//   P = exp2(S scale log2(e) - lse2), dS = P (dP - delta) (rows = queries)
//   dQ += dS K                                            (wgmma RS: dS from registers)
// and at the end stores scale * dQ. Each query row has one owner and the key blocks are summed
// in visit order: the same bits on every run.
#pragma once

#include <cmath>

#include <cute/tensor.hpp>

#include "bwd_epilogue.h"
#include "bwd_kernel_params.h"
#include "bwd_tma_loads.h"
#include "cuda/common/mma_utils.h"
#include "cuda/common/tile_io.h"
#include "fwd_params.h"
#include "kernel_utils.h"
#include "key_visit.h"

namespace vidattn::cuda_sm90 {

// Q and dO of the CTA's kRows queries, once (producer warp 0).
template <class Traits>
__device__ __forceinline__ void dq_load_stationary(const BwdKernelParams<Traits>& p,
                                                   typename Traits::SharedStorage& st,
                                                   const cuda_common::Sequence& seq, int h,
                                                   std::int64_t q0) {
  using namespace cute;
  const cuda_common::AttentionParams& a = p.attn;
  const int tb = a.varlen ? 0 : static_cast<int>(seq.batch);
  const int q_base = static_cast<int>(a.varlen ? seq.first_q : 0);
  Barrier::arrive_and_expect_tx(&st.rows_full, 2 * Traits::kRowsBytes);
  load_tile_pair<Traits::kRows, Traits::kHeadDim>(
      p.tma_x, p.tma_y, p.q_rows, a.heads_q, p.tma_batch, q_base + static_cast<int>(q0), h, tb,
      make_tensor(make_smem_ptr(st.x.data()), typename Traits::SmemLayoutRows{}),
      make_tensor(make_smem_ptr(st.y.data()), typename Traits::SmemLayoutRows{}), st.rows_full);
}

// One stream's ring: K and V of each key block its visit names.
template <class Traits, class Visit>
__device__ __forceinline__ void dq_producer(const BwdKernelParams<Traits>& p,
                                            typename Traits::SharedStorage& st,
                                            const cuda_common::Sequence& seq, const Visit& visit,
                                            int n, int h, int stream) {
  using namespace cute;
  const cuda_common::AttentionParams& a = p.attn;
  const int tb = a.varlen ? 0 : static_cast<int>(seq.batch);
  const int k_base = static_cast<int>(a.varlen ? seq.first_k : 0);
  const int hk = h / a.group;
  Tensor sK = make_tensor(make_smem_ptr(st.u.data()), typename Traits::SmemLayoutCols{});
  Tensor sV = make_tensor(make_smem_ptr(st.w.data()), typename Traits::SmemLayoutCols{});
  RingState<Traits::kStages> ring;
  for (int i = 0; i < n; ++i) {
    const KeyBlock kb = visit.block(i);
    const int s = stream * Traits::kStages + ring.stage;
    Barrier::wait(&st.empty[s], ring.phase ^ 1u);
    Barrier::arrive_and_expect_tx(&st.full[s], 2 * Traits::kColsBytes);
    load_tile_pair<Traits::kCols, Traits::kHeadDim>(
        p.tma_u, p.tma_w, p.kv_rows, a.heads_kv, p.tma_batch, k_base + static_cast<int>(kb.start),
        hk, tb, sK(_, _, s), sV(_, _, s), st.full[s]);
    ring.advance();
  }
}

// tid: the thread's index among the consumer threads (0 .. 255).
// q0: the CTA's first query; the stream's rows start at q0 + stream * kStreamRows, which is
// where its visit starts too.
template <class Traits, class Visit>
__device__ __forceinline__ void dq_consumer(const BwdKernelParams<Traits>& p,
                                            typename Traits::SharedStorage& st,
                                            const cuda_common::Sequence& seq, const Visit& visit,
                                            int n, int h, std::int64_t q0, int stream, int tid) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int D = Traits::kHeadDim, R = Traits::kRows, C = Traits::kCols;
  const cuda_common::AttentionParams& a = p.attn;
  typename Traits::MmaSS mma_ss;
  typename Traits::MmaRS mma_rs;
  const int wg = warp_uniform(tid / 128);
  auto wg_ss = mma_ss.get_thread_slice(wg * 128);
  auto wg_rs = mma_rs.get_thread_slice(wg * 128);
  auto thr_ss = mma_ss.get_thread_slice(tid);
  auto thr_rs = mma_rs.get_thread_slice(tid);
  Tensor sQ = make_tensor(make_smem_ptr(st.x.data()), typename Traits::SmemLayoutRows{});
  Tensor sdO = make_tensor(make_smem_ptr(st.y.data()), typename Traits::SmemLayoutRows{});
  Tensor sK = make_tensor(make_smem_ptr(st.u.data()), typename Traits::SmemLayoutCols{});
  Tensor sV = make_tensor(make_smem_ptr(st.w.data()), typename Traits::SmemLayoutCols{});
  Tensor sKt = make_tensor(make_smem_ptr(st.u.data()), typename Traits::SmemLayoutColsT{});
  Tensor tSrQ = wg_ss.partition_fragment_A(sQ);
  Tensor tSrK = wg_ss.partition_fragment_B(sK);     // (mma, n, k, stage)
  Tensor tdPrdO = wg_ss.partition_fragment_A(sdO);
  Tensor tdPrV = wg_ss.partition_fragment_B(sV);
  Tensor tdQrK = wg_rs.partition_fragment_B(sKt);   // (mma, d, keys, stage)
  Tensor tSrS = partition_fragment_C(mma_ss, Shape<Int<R>, Int<C>>{});
  Tensor tdPrdP = partition_fragment_C(mma_ss, Shape<Int<R>, Int<C>>{});
  Tensor tdQrdQ = partition_fragment_C(mma_rs, Shape<Int<R>, Int<D>>{});
  Tensor tScS = thr_ss.partition_C(make_identity_tensor(Shape<Int<R>, Int<C>>{}));
  Tensor tdQcdQ = thr_rs.partition_C(make_identity_tensor(Shape<Int<R>, Int<D>>{}));
  Tensor tdSrdS = make_tensor<Element>(typename Traits::OperandLayout{});
  Tensor tdSrdS32 = recast<uint32_t>(tdSrdS);
  constexpr int kVals = decltype(size(tSrS))::value;
  clear(tdQrdQ);
  const float scale_log2 = a.scale * cuda_common::kLog2e;
  // The thread's two query rows (value v is in row 2 ((v / 2) % 2) of its pair).
  // A row that takes no gradient (lse2 = +inf: padded, masked, past the sequence) gets P = 0
  // and dS = 0 by selection, not by arithmetic: its Q and dO may hold anything (padded slots
  // are never to be read), and exp2(NaN - inf) is NaN.
  float lse2[2], delta[2];
  bool dead[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const std::int64_t o = p.stats.offset(blockIdx.z, h, a.heads_q, q0 + get<0>(tScS(2 * r)));
    lse2[r] = p.stats.lse2[o];
    delta[r] = p.stats.delta[o];
    dead[r] = lse2[r] == INFINITY;
  }

  if (n > 0) Barrier::wait(&st.rows_full, 0);
  RingState<Traits::kStages> ring;
  for (int i = 0; i < n; ++i) {
    KeyBlock kb = visit.block(i);
    if constexpr (Visit::kKeyFlags) kb.key_flags = visit.lane_key_flags(kb.start);
    const int s = warp_uniform(stream * Traits::kStages + ring.stage);
    Barrier::wait(&st.full[s], ring.phase);
    static_assert(!Visit::kHalves, "zero_tail_rows zeroes one tail, not a half block's two");
    if (tail_rows_need_zeros<Visit>(a, kb.valid, kb.valid_hi))
      zero_tail_rows<Traits>(sK, sV, s, kb.valid, stream, tid);
    warpgroup_gemm(mma_ss, tSrQ, tSrK(_, _, _, s), tSrS, true);
    warpgroup_gemm(mma_ss, tdPrdO, tdPrV(_, _, _, s), tdPrdP, true);
    warpgroup_wait<1>();  // S is ready; dP may still run
    warpgroup_fence_operand(tSrS);
    // apply_mask reads rows relative to the visit's first row (dense: the CTA's tile; a
    // second stream has its own block-sparse visit, whose masks read no rows).
    if (kb.needs_mask) apply_mask(tSrS, tScS, visit, kb, q0);
#pragma unroll
    for (int v = 0; v < kVals; ++v)
      tSrS(v) = cuda_common::exp2_approx(fmaf(tSrS(v), scale_log2, -lse2[(v >> 1) & 1]));
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdPrdP);
#pragma unroll
    for (int w = 0; w < kVals / 2; ++w) {
      const int r = w & 1;  // values 2w and 2w + 1 share row (w % 2)
      const float ds0 = tSrS(2 * w) * (tdPrdP(2 * w) - delta[r]);
      const float ds1 = tSrS(2 * w + 1) * (tdPrdP(2 * w + 1) - delta[r]);
      tdSrdS32(w) = dead[r] ? 0u : pack_pair<Element>(ds0, ds1);
    }
    warpgroup_fence_operand(tdSrdS);
    warpgroup_gemm(mma_rs, tdSrdS, tdQrK(_, _, _, s), tdQrdQ, false);
    warpgroup_wait<0>();
    warpgroup_fence_operand(tdQrdQ);
    Barrier::arrive(&st.empty[s]);
    ring.advance();
  }

  auto* dq = static_cast<std::uint16_t*>(a.dq) +
             cuda_common::q_side_offset(a, a.dq_strides, seq, q0, h);
  store_gradient_rows<Element>(dq, a.dq_strides.row, tdQrdQ, tdQcdQ, a.scale, seq.len_q - q0,
                               a.out_aligned4, [](int) { return false; });
}

}  // namespace vidattn::cuda_sm90
