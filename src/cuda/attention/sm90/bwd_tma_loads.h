// The TMA loads of the sm_90a backward kernels: one tile of rows of two tensors that travel
// together (Q and dO, K and V), whether a kernel's stationary pair (loaded once) or a pair
// streamed through its ring; and the zeros for a streamed tile's rows past its valid ones.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>
#include <cutlass/arch/barrier.h>

#include "kernel_utils.h"

namespace vidattn::cuda_sm90 {

// R rows from row `row` of head `head` (batch `tb`) of the (rows, D, heads, batch) views that
// tma_a and tma_b describe, into sA and sB; both loads complete on `bar`, whose expected
// bytes the caller has set.
template <int R, int D, class TmaA, class TmaB, class SmemA, class SmemB>
__device__ __forceinline__ void load_tile_pair(const TmaA& tma_a, const TmaB& tma_b, int rows,
                                               int heads, int batch, int row, int head, int tb,
                                               SmemA&& sA, SmemB&& sB, std::uint64_t& bar) {
  using namespace cute;
  Tensor mA = tma_a.get_tma_tensor(make_shape(rows, Int<D>{}, heads, batch));
  Tensor mB = tma_b.get_tma_tensor(make_shape(rows, Int<D>{}, heads, batch));
  auto cta_a = tma_a.get_slice(_0{});
  auto cta_b = tma_b.get_slice(_0{});
  copy(tma_a.with(bar),
       cta_a.partition_S(local_tile(domain_offset(make_coord(row, _0{}), mA(_, _, head, tb)),
                                    Shape<Int<R>, Int<D>>{}, make_coord(_0{}, _0{}))),
       cta_a.partition_D(sA));
  copy(tma_b.with(bar),
       cta_b.partition_S(local_tile(domain_offset(make_coord(row, _0{}), mB(_, _, head, tb)),
                                    Shape<Int<R>, Int<D>>{}, make_coord(_0{}, _0{}))),
       cta_b.partition_D(sB));
}

// tid: the thread's index among the consumer threads (0 .. 255).
// Rows [valid, kCols) of streamed slot s of a tensor pair (Q and dO, or K and V) to zero, by
// the warpgroups that read the slot (one with two streams, both with one), which then wait
// for each other: no product reads the slot before every write is done and made visible to
// wgmma (the async proxy). Those rows are loaded past the valid ones (the next sequence's,
// a tile's padded slots), and masking leaves them only exact-zero factors: 0 times a
// non-finite value is NaN (docs/conventions.md). Not inlined: the call is taken only for a
// partial block, and inlined its swizzled addresses took the dQ kernel's key loop from 408
// to 554 instructions (417 as a call).
template <class Traits, class TensorA, class TensorB>
__device__ __noinline__ void zero_tail_rows(TensorA& sA, TensorB& sB, int s, int valid,
                                            int stream, int tid) {
  using namespace cute;
  constexpr int kChunks = Traits::kHeadDim / 8;  // 16-byte chunks per row
  constexpr int kReaders = Traits::kSlotReleases;  // threads reading the slot
  const int t = Traits::kStreams == 1 ? tid : tid % 128;
  for (int i = t; i < (Traits::kCols - valid) * kChunks; i += kReaders) {
    const int r = valid + i / kChunks, c = 8 * (i % kChunks);
    *reinterpret_cast<uint4*>(&sA(r, c, s)) = make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(&sB(r, c, s)) = make_uint4(0, 0, 0, 0);
  }
  cutlass::arch::fence_view_async_shared();
  // Named barriers 1 (one stream) or 1 + stream (two); 0 is __syncthreads.
  named_barrier_sync(1 + (Traits::kStreams == 1 ? 0 : stream), kReaders);
}

}  // namespace vidattn::cuda_sm90
