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
    for (int i = 0; i < Traits::kStages; ++i) {
      Barrier::init(&st.full[i], 1);
      Barrier::init(&st.empty[i], 128 * Traits::kConsumerWGs);
    }
    cutlass::arch::fence_barrier_init();
  }
  __syncthreads();
}

template <class Traits, class Visit>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sm90_attention_bwd_dkdv_kernel(const __grid_constant__ BwdKernelParams<Traits> p) {
#ifdef VIDATTN_SM90_DEVICE_CODE
  extern __shared__ char smem_raw[];
  auto& st = bwd_shared_storage<Traits>(smem_raw);
  const int hk = blockIdx.y;
  const cuda_common::Sequence seq = cuda_common::sequence_of(p.attn, blockIdx.z);
  const std::int64_t k0 = static_cast<std::int64_t>(blockIdx.x) * Traits::kRows;
  if (k0 >= seq.len_k) return;  // a shorter varlen sequence: the whole CTA leaves
  const Visit visit(p.attn, seq, hk, k0, p.attn.group);
  const int n = visit.num_blocks();
  bwd_init_barriers<Traits>(st);
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x < 32 && n > 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(p.tma_u.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_w.get_tma_descriptor());
      dkdv_producer<Traits>(p, st, seq, visit, n, hk, k0);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    dkdv_consumer<Traits>(p, st, seq, visit, n, hk, k0, threadIdx.x - 128);
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
  const Visit visit(p.attn, SparseKeyListArgs{}, seq, h, q0, Traits::kRows);
  const int n = visit.num_blocks();
  bwd_init_barriers<Traits>(st);
  if (threadIdx.x < 128) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    if (threadIdx.x < 32 && n > 0 && cute::elect_one_sync()) {
      cute::prefetch_tma_descriptor(p.tma_u.get_tma_descriptor());
      cute::prefetch_tma_descriptor(p.tma_w.get_tma_descriptor());
      dq_producer<Traits>(p, st, seq, visit, n, h, q0);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    dq_consumer<Traits>(p, st, seq, visit, n, h, q0, threadIdx.x - 128);
  }
#endif
}

}  // namespace vidattn::cuda_sm90
