// Helpers of the sm_90a kernels, forward and backward: the mbarrier type and ring positions
// of the TMA pipelines, warp-uniform values, one warpgroup GEMM as a commit group, named
// barriers, and the packing of two fp32 values into one 32-bit word of a 16-bit operand.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>
#include <cutlass/numeric_types.h>

// Device code of the sm_90a kernels is emitted only for sm_90a; the sm_80 pass of the same .cu
// compiles empty bodies that the launchers never run (they check the binary version first).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define VIDATTN_SM90_DEVICE_CODE 1
#endif

namespace vidattn::cuda_sm90 {

using Barrier = cutlass::arch::ClusterTransactionBarrier;

// Position in a ring of kStages slots; the phase bit flips on every wrap.
template <int kStages>
struct RingState {
  int stage = 0;
  uint32_t phase = 0;
  __device__ __forceinline__ void advance() {
    if (++stage == kStages) stage = 0, phase ^= 1u;
  }
};

// x as lane 0 holds it: the compiler then treats it as the same across the warp (shared-
// memory descriptors built from it stay in uniform registers).
__device__ __forceinline__ int warp_uniform(int x) { return __shfl_sync(0xffffffffu, x, 0); }

// wgmma helper: C (+)= A B over the k-blocks of the operands, one commit group.
template <class Mma, class TA, class TB, class TC>
__device__ __forceinline__ void warpgroup_gemm(Mma& mma, TA const& a, TB const& b, TC& c,
                                               bool zero_init) {
  using namespace cute;
  warpgroup_fence_operand(c);
  warpgroup_arrive();
  mma.accumulate_ = zero_init ? GMMA::ScaleOut::Zero : GMMA::ScaleOut::One;
  CUTE_UNROLL
  for (int k = 0; k < size<2>(a); ++k) {
    cute::gemm(mma, a(_, _, k), b(_, _, k), c);
    mma.accumulate_ = GMMA::ScaleOut::One;
  }
  warpgroup_commit_batch();
  warpgroup_fence_operand(c);
}

// Named barrier `id` (1-15; 0 is __syncthreads) over `threads` threads, a multiple of 32.
__device__ __forceinline__ void named_barrier_sync(int id, int threads) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

template <class Element>
__device__ __forceinline__ std::uint32_t pack_pair(float x, float y) {
  if constexpr (cute::is_same_v<Element, cutlass::bfloat16_t>) {
    __nv_bfloat162 v = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&v);
  } else {
    __half2 v = __floats2half2_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&v);
  }
}

}  // namespace vidattn::cuda_sm90
