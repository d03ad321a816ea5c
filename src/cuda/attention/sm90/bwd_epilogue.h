// Epilogue of the sm_90a backward kernels: a warpgroup's 64 x D fp32 gradient accumulator,
// scaled, to 16-bit rows of dQ, dK or dV. Each thread stores its column pairs as 32-bit words
// (two 16-bit stores where the rows are not 4-byte aligned); rows past the sequence are not
// written, and rows the caller marks as zero get exact zeros (a masked key's accumulator
// holds only zero products, but the caller's rule is the contract).
#pragma once

#include <cstdint>

#include <cute/tensor.hpp>

#include "kernel_utils.h"

namespace vidattn::cuda_sm90 {

// acc: the thread's accumulator values; coords(v): (row, column) of value v in the CTA's
// tile; row 0 of the tile is at `tile` (element pointer, head applied) with rows
// `row_stride` elements apart; rows [0, valid_rows) exist. zero_row(row): write zeros.
template <class Element, class Frag, class Coords, class ZeroRow>
__device__ __forceinline__ void store_gradient_rows(std::uint16_t* tile, std::int64_t row_stride,
                                                    const Frag& acc, const Coords& coords,
                                                    float scale, std::int64_t valid_rows,
                                                    bool aligned4, ZeroRow&& zero_row) {
  constexpr int kVals = decltype(cute::size(acc))::value;
#pragma unroll
  for (int v = 0; v < kVals; v += 2) {
    const int row = cute::get<0>(coords(v)), col = cute::get<1>(coords(v));
    if (row >= valid_rows) continue;
    const bool zero = zero_row(row);
    const std::uint32_t word = zero ? 0u : pack_pair<Element>(acc(v) * scale, acc(v + 1) * scale);
    std::uint16_t* dst = tile + row * row_stride + col;
    if (aligned4) {
      *reinterpret_cast<std::uint32_t*>(dst) = word;
    } else {
      dst[0] = static_cast<std::uint16_t>(word & 0xFFFFu);
      dst[1] = static_cast<std::uint16_t>(word >> 16);
    }
  }
}

}  // namespace vidattn::cuda_sm90
