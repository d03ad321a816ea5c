// dQ inside the sm_90a dK / dV kernel (BwdTraits::kFusedDq): one query block's contribution of
// the CTA's keys, dQ_block = dS K, added into the fp32 workspace of BwdKernelParams::dq_accum.
// The consumer warpgroups hold dS^T (keys as rows), but the product needs dS with queries as
// rows, so dS goes through shared memory:
//   1. each thread stores its dS^T words at (query, key) of SmemLayoutdS;
//   2. the warpgroups that share the product wait for each other (named barrier), then
//      multiply with the stationary K (wgmma, both operands in shared memory);
//   3. the fp32 result goes to one of two shared buffers in fragment order (conflict-free
//      16-byte stores; bwd_dq_convert.h reads the same order back), and one thread adds the
//      buffer into the workspace with a bulk reduce-add (cp.reduce.async.bulk .add.f32).
// A buffer is refilled two blocks later; the issuing thread waits for that reduce to have
// read it before the barrier of step 2, so no thread writes it early.
// The reduce-adds of different CTAs (key tiles) into one query tile land in any order: fp32
// addition is not associative, so dQ may differ in its last bits between runs.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "bwd_kernel_params.h"
#include "kernel_utils.h"
#include "query_visit.h"

namespace vidattn::cuda_sm90 {

// Named barriers of the fused dQ (0 is __syncthreads, 1-2 the tail-row zeroing); with a key
// split each warpgroup has its own pair.
constexpr int kBarDsReady = 3;
constexpr int kBarDqReady = 5;
// The stationary K rows of keys that take no part, zeroed before the first block (bwd_dkdv.h);
// 2 is the second stream's tail zeroing, and a fused dQ runs one stream.
constexpr int kBarDeadKeyRows = 2;

__device__ __forceinline__ void bulk_reduce_add_f32(float* gmem, const float* smem,
                                                    std::uint32_t bytes) {
  asm volatile(
      "cp.reduce.async.bulk.global.shared::cta.bulk_group.add.f32 [%0], [%1], %2;\n" ::"l"(gmem),
      "r"(cute::cast_smem_ptr_to_uint(smem)), "r"(bytes)
      : "memory");
}

// Every bulk operation this thread committed has completed (its writes too).
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;\n" ::: "memory");
}

// The index of fragment value v of thread t in a dQ tile: groups of four values, one 16-byte
// word per thread, consecutive threads adjacent.
template <class Traits>
__device__ __forceinline__ int dq_fragment_index(int v, int t) {
  return ((v / 4) * Traits::kDqThreads + t) * 4 + v % 4;
}

// The thread of a dQ product's warpgroups that issues its reduce-adds.
template <class Traits>
__device__ __forceinline__ bool dq_issuer(int tid) {
  return tid % Traits::kDqThreads == 0;
}

// One query block. ds_words: the thread's dS^T values packed in pairs (pack_pair), in the
// order of the wgmma accumulator; key_dead[r]: its key row r (words w with w % 2 = r) takes
// no part in dQ (masked, padded, past the sequence); buf: the dQ buffer, 0/1;
// release_slot(): called once the products issued before this call (dV, dK: they read the
// streamed slot) are complete.
template <class Traits, class Words, class Release>
__device__ __forceinline__ void fused_dq_block(const BwdKernelParams<Traits>& p,
                                               typename Traits::SharedStorage& st,
                                               const Words& ds_words,
                                               const bool (&key_dead)[2], const QueryBlock& qb,
                                               int buf, int tid, Release&& release_slot) {
  using namespace cute;
  constexpr int C = Traits::kCols, D = Traits::kHeadDim, KK = Traits::kDqKeys;
  constexpr int kWords = decltype(size(ds_words))::value;
  const int wg = warp_uniform(tid / 128);
  const int part = Traits::kDqSplitsD ? 0 : wg;  // the warpgroup's barrier pair and tile
  const int t = tid % Traits::kDqThreads;

  // 1. dS^T words to (query, key): the pair's queries are adjacent, so one 32-bit store. The
  // address is written out rather than taken from SmemLayoutdS, whose swizzle the compiler
  // cannot fold into per-word constants: it would keep one address register per word and
  // spill. Word w of the thread (wgmma accumulator of 64 rows: warp q of the warpgroup, lane
  // l) is key row 16 q + l / 4 + 8 (w % 2) of the warpgroup's 64 and query column
  // 8 (w / 2) + 2 (l % 4). In the (64 queries x 8 keys) atoms of 1024 bytes, key row r sits
  // at 128 (r % 8) and its 16-byte chunk c / 8 is swizzled to (c / 8) ^ (r % 8); r % 8 = l / 4
  // for both of the thread's rows. So the byte offset is
  //   ((thread | (l / 4) << 4) ^ (w / 2) << 4) + 1024 (w % 2),
  // thread = 1024 (8 wg + 2 q) + 128 (l / 4) + 4 (l % 4) (its bits 4-6 are clear).
  static_assert(kWords == 16 && C == 64, "one 64 x 64 accumulator per warpgroup");
  {
    const int lane = tid % 32, q = (tid / 32) % 4;
    const std::uint32_t thread = 1024u * (8 * wg + 2 * q) + 128u * (lane / 4) + 4u * (lane % 4);
    const std::uint32_t base = thread | (static_cast<std::uint32_t>(lane / 4) << 4);
    char* ds = reinterpret_cast<char*>(st.fused.ds.data());
#pragma unroll
    for (int w = 0; w < kWords; ++w)  // selected, not overwritten: dK's product reads them
      *reinterpret_cast<std::uint32_t*>(ds + ((base ^ ((w / 2) << 4)) + 1024 * (w % 2))) =
          key_dead[w % 2] ? 0u : ds_words(w);
  }
  if (dq_issuer<Traits>(tid)) cute::tma_store_wait<1>();  // buffer `buf` is read out
  cutlass::arch::fence_view_async_shared();
  named_barrier_sync(kBarDsReady + part, Traits::kDqThreads);

  // 2. dQ_block = dS K over the product's keys (all of the CTA's, or the warpgroup's own).
  typename Traits::MmaDq mma;
  auto wg_mma = mma.get_thread_slice(Traits::kDqSplitsD ? wg * 128 : 0);
  Tensor sA = make_tensor(make_smem_ptr(st.fused.ds.data() + part * C * KK),
                          typename Traits::SmemLayoutdSPart{});
  Tensor sB = make_tensor(make_smem_ptr(st.x.data() + part * KK * D),
                          typename Traits::SmemLayoutKPartT{});
  Tensor tA = wg_mma.partition_fragment_A(sA);
  Tensor tB = wg_mma.partition_fragment_B(sB);
  Tensor acc = partition_fragment_C(mma, Shape<Int<C>, Int<D>>{});
  static_assert(decltype(size(acc))::value == 32);
  warpgroup_gemm(mma, tA, tB, acc, true);
  warpgroup_wait<1>();  // commit groups retire in order: dV and dK are done
  release_slot();
  warpgroup_wait<0>();
  warpgroup_fence_operand(acc);

  // 3. To the shared buffer in fragment order, then one reduce-add of the whole tile.
  float* tile = st.fused.dq[buf].data() + part * Traits::kDqTileFloats;
#pragma unroll
  for (int v = 0; v < 32; v += 4)
    *reinterpret_cast<float4*>(tile + dq_fragment_index<Traits>(v, t)) =
        make_float4(acc(v), acc(v + 1), acc(v + 2), acc(v + 3));
  cutlass::arch::fence_view_async_shared();
  named_barrier_sync(kBarDqReady + part, Traits::kDqThreads);
  if (dq_issuer<Traits>(tid)) {
    bulk_reduce_add_f32(p.dq_accum + dq_tile_offset<Traits>(p.stats, p.attn.heads_q, blockIdx.z, qb.head, qb.q0), tile,
                        Traits::kDqTileFloats * sizeof(float));
    cute::tma_store_arrive();
  }
}

}  // namespace vidattn::cuda_sm90
