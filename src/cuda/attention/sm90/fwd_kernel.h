// The sm_90a attention forward kernel: barrier setup and the split into one producer
// warpgroup (register budget lowered with setmaxnreg; with kFusedCombine its warps 2 and 3
// combine finished tiles) and the consumer warpgroups (raised).
// Device code is emitted only for sm_90a; the sm_80 pass of the same .cu compiles an empty
// body that the launcher never runs (it checks the kernel's binary version first).
#pragma once

#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/reg_reconfig.h>

#include "fwd_combine.h"
#include "fwd_mainloop.h"

namespace vidattn::cuda_sm90 {

// The CTA's threads write zeros over `bytes` (a multiple of 16) of shared memory at `p`.
__device__ __forceinline__ void zero_fill(void* p, std::size_t bytes) {
  auto* v = static_cast<uint4*>(p);
  for (std::size_t i = threadIdx.x; i < bytes / sizeof(uint4); i += blockDim.x)
    v[i] = make_uint4(0, 0, 0, 0);
}

template <class Traits, class Visit>
__global__ void __launch_bounds__(Traits::kThreads, 1)
    sm90_attention_fwd_kernel(const __grid_constant__ FwdKernelParams<Traits> p) {
#ifdef VIDATTN_SM90_DEVICE_CODE
  extern __shared__ char smem_raw[];
  const auto base = (reinterpret_cast<std::uintptr_t>(smem_raw) + 1023) & ~std::uintptr_t(1023);
  auto& shared = *reinterpret_cast<typename Traits::SharedStorage*>(base);
  constexpr int kConsumersPerStream = 128 * Traits::kWGPerStream;
  // Arrivals that free a K / V slot: each consumer thread, or (kClusterM > 1) one lane per
  // consumer warp of every CTA of the cluster, whose loads all write into the slot.
  constexpr int kSlotReleases = Traits::kClusterM == 1
                                    ? kConsumersPerStream
                                    : kConsumersPerStream / 32 * Traits::kClusterM;

  if (threadIdx.x == 0) {
    for (int s = 0; s < Traits::kStreams; ++s) {
      auto& st = shared.stream[s];
      Barrier::init(&st.q_full, 1);
      if constexpr (Traits::kEarlyTileSetup) Barrier::init(&st.tile_full, 1);
      Barrier::init(&st.q_empty, kConsumersPerStream);
      for (int i = 0; i < Traits::kStagesK; ++i) {
        Barrier::init(&st.k_full[i], 1);
        Barrier::init(&st.k_empty[i], kSlotReleases);
      }
      for (int i = 0; i < Traits::kStagesV; ++i) {
        Barrier::init(&st.v_full[i], 1);
        Barrier::init(&st.v_empty[i], kSlotReleases);
      }
      if constexpr (Traits::kFusedCombine) {
        Barrier::init(&st.o_ready, kConsumersPerStream);
        Barrier::init(&st.o_free, 1);
      }
    }
    cutlass::arch::fence_barrier_init();
  }
  if constexpr (Traits::kPrefixLoads) {
    // Prefix loads leave a slot's other rows as they were: zeros until a load fills them
    // (uninitialised shared memory could hold NaN, and 0 * NaN is NaN). The proxy fence
    // orders these writes before the TMA writes and wgmma reads that follow.
    for (int s = 0; s < Traits::kStreams; ++s) {
      auto& st = shared.stream[s];
      zero_fill(st.k.data(), sizeof(st.k));
      zero_fill(st.v.data(), sizeof(st.v));
    }
    cutlass::arch::fence_view_async_shared();
  }
  // A cluster's CTAs load into each other's slots and free each other's: every barrier of
  // the cluster is initialised before any of them is used.
  if constexpr (Traits::kClusterM > 1) cute::cluster_sync();
  else __syncthreads();

  const int warpgroup = threadIdx.x / 128;
  if (warpgroup == 0) {
    cutlass::arch::warpgroup_reg_dealloc<Traits::kProducerRegs>();
    const int warp = threadIdx.x / 32;
    if (warp < Traits::kStreams) {
      if (cute::elect_one_sync()) {
        if (warp == 0) {
          cute::prefetch_tma_descriptor(p.tma_q.get_tma_descriptor());
          cute::prefetch_tma_descriptor(p.tma_k.get_tma_descriptor());
          cute::prefetch_tma_descriptor(p.tma_v.get_tma_descriptor());
          if constexpr (Traits::kPrefixLoads) {
            cute::prefetch_tma_descriptor(&p.prefix.k);
            cute::prefetch_tma_descriptor(&p.prefix.v);
          }
        }
        producer_loop<Traits, Visit>(p, shared.stream[warp], warp);
      }
    } else if constexpr (Traits::kFusedCombine) {
      // A branch of its own, not code after the producer's loop: nothing of the combination
      // stays live across that loop (both roles live in the warpgroup's kProducerRegs).
      if (warp < 2 + Traits::kStreams)
        combine_loop<Traits>(p, shared.stream[warp - 2], threadIdx.x % 32);
    }
  } else {
    cutlass::arch::warpgroup_reg_alloc<Traits::kConsumerRegs>();
    const int consumer = threadIdx.x - 128;
    // Warp-uniform to the compiler, and with it what follows from the stream (the tile's
    // rows and key blocks; the ring slots get their own warp_uniform in consumer_loop).
    const int stream = warp_uniform(consumer / kConsumersPerStream);
    consumer_loop<Traits, Visit>(p, shared.stream[stream], stream,
                                 consumer % kConsumersPerStream);
  }
#endif
}

}  // namespace vidattn::cuda_sm90
