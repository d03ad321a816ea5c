// The sm_90a attention backward kernels: barrier setup and the split into one producer warp
// (TMA; its warpgroup's registers lowered with setmaxnreg) and two consumer warpgroups
// (raised). dK / dV: one CTA per (key tile, key head, sequence), bwd_dkdv.h; dQ: one CTA per
// (query tile, head, sequence), bwd_dq.h. The two are independent (neither reads what the
// other writes), and neither uses atomics: the backward is deterministic.
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "bwd_dkdv.h"
#include "bwd_dq.h"
#include "kernel_utils.h"

namespace vidattn::cuda_sm90 {

template <class Traits>
__device__ __forceinline__ typename Traits::SharedStorage& bwd_shared_storage(char* raw) {
  const auto base = (reinterpret_cast<std::uintptr_t>(raw) + 1023) & ~std::uintptr_t(1023);
  return *reinterpret_cast<typename Traits::SharedStorage*>(base);
}

template <class Traits>
__device__ __forceinline__ void bwd_init_barriers(typename Traits::SharedStorage& st) {
  if (threadIdx.x == 0) {
    Barrier::init(&st.rows_full, 1);
    for (int i = 0; i < Traits::kSlots; ++i) {
      Barrier::init(&st.full[i], 1);
      Barrier::init(&st.empty[i], Traits::kSlotReleases);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

// The stream of a consumer thread (tid: 0 .. 255): its warpgroup with two streams, else 0.
template <class Traits>
__device__ __forceinline__ int bwd_stream_of(int tid) {
  return Traits::kStreams == 1 ? 0 : warp_uniform(tid / 128);
}

// Producer warp w < kStreams feeds stream w; warp 0 also loads the stationary tiles, and waits
// for them before it leaves, so that no load is in flight when a CTA whose streams visit
// nothing ends.
template <class Traits, class Visit>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sm90_attention_bwd_dkdv_kernel(const __grid_constant__ BwdKernelParams<Traits> p) {
#ifdef VIDATTN_SM90_DEVICE_CODE
  extern __shared__ char smem_raw[];
  auto& st = bwd_shared_storage<Traits>(smem_raw);
  const int hk = blockIdx.y, b = blockIdx.z;
  const cuda_common::Sequence seq = cuda_common::sequence_of(p.attn, b);
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.x) * Traits::kRows;
  if (k0 >= seq.len_k) return;  // a shorter varlen sequence: the whole CTA leaves
  bwd_init_barriers<Traits>(st);
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (warp < Traits::kStreams && cute::elect_one_sync()) {
      if (warp == 0) {
        cute::prefetch_tma_descriptor(p.tma_u.get_tma_descriptor());
        cute::prefetch_tma_descriptor(p.tma_w.get_tma_descriptor());
        dkdv_load_stationary<Traits>(p, st, seq, hk, k0);
      }
      dkdv_producer<Traits>(p, st, seq, Visit(p.attn, seq, b, hk, k0 + warp * Traits::kStreamRows),
                            warp);
      if (warp == 0) Barrier::wait(&st.rows_full, 0);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int tid = threadIdx.x - 128;
    const int stream = bwd_stream_of<Traits>(tid);
    dkdv_consumer<Traits>(p, st, seq, Visit(p.attn, seq, b, hk, k0 + stream * Traits::kStreamRows),
                          stream, hk, k0, tid);
  }
#endif
}

template <class Traits, class Visit>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sm90_attention_bwd_dq_kernel(const __grid_constant__ BwdKernelParams<Traits> p) {
#ifdef VIDATTN_SM90_DEVICE_CODE
  extern __shared__ char smem_raw[];
  auto& st = bwd_shared_storage<Traits>(smem_raw);
  const int h = blockIdx.y;
  const cuda_common::Sequence seq = cuda_common::sequence_of(p.attn, blockIdx.z);
  const std::int64_t q0 = static_cast<std::int64_t>(blockIdx.x) * Traits::kRows;
  if (q0 >= seq.len_q) return;
  bwd_init_barriers<Traits>(st);
  // The key blocks of stream s's rows (from q0 + s * kStreamRows; none past the sequence:
  // a block-sparse visit there would read its tile's list out of bounds).
  auto stream_visit = [&](int s, int& n) {
    const std::int64_t row = q0 + s * Traits::kStreamRows;
    const bool live = row < seq.len_q;
    const Visit visit(p.attn, p.sparse, seq, h, live ? row : q0, Traits::kStreamRows);
    n = live ? visit.num_blocks() : 0;
    return visit;
  };
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (warp < Traits::kStreams && cute::elect_one_sync()) {
      if (warp == 0) {
        cute::prefetch_tma_descriptor(p.tma_u.get_tma_descriptor());
        cute::prefetch_tma_descriptor(p.tma_w.get_tma_descriptor());
        dq_load_stationary<Traits>(p, st, seq, h, q0);
      }
      int n = 0;
      const Visit visit = stream_visit(warp, n);
      dq_producer<Traits>(p, st, seq, visit, n, h, warp);
      if (warp == 0) Barrier::wait(&st.rows_full, 0);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int tid = threadIdx.x - 128;
    const int stream = bwd_stream_of<Traits>(tid);
    int n = 0;
    const Visit visit = stream_visit(stream, n);
    dq_consumer<Traits>(p, st, seq, visit, n, h, q0, stream, tid);
  }
#endif
}

}  // namespace vidattn::cuda_sm90
