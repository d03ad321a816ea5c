// The TMA loads of the sm_90a backward kernels: one tile of rows of two tensors that travel
// together (Q and dO, K and V), whether a kernel's stationary pair (loaded once) or a pair
// streamed through its ring.
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

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

}  // namespace vidattn::cuda_sm90
