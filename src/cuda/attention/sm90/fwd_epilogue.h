// Epilogue of the sm_90a forward: normalises the output accumulator, writes exact zeros (LSE
// -inf) for rows that saw no key or are padded queries (query mask; block-sparse: slots at
// or past `row_limit`, the end of the tile's valid slots), and writes O (16-byte stores of 8
// columns gathered across each quad, or, in the dense single-CTA kernel, a TMA store from
// shared memory) and the LSE (natural log, fp32). Rows past the sequence are not written.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "cuda/common/mma_utils.h"
#include "cuda/common/tile_io.h"
#include "fwd_kernel_params.h"
#include "fwd_output_stsm.h"
#include "fwd_params.h"
#include "fwd_softmax.h"
#include "kernel_utils.h"

namespace vidattn::cuda_sm90 {

using cuda_common::Sequence;

// The 4 x 4 transpose of 32-bit words across a quad (lanes 4k .. 4k + 3, which share a row of
// the accumulator) in two butterfly stages: lane q starts with words (q, 0 .. 3) and ends with
// words (0 .. 3, q). Every lane of the warp takes part.
__device__ __forceinline__ void quad_transpose(std::uint32_t (&a)[4], int lane) {
  const bool odd = lane & 1, upper = lane & 2;
  std::uint32_t x0 = odd ? a[0] : a[1], x1 = odd ? a[2] : a[3];
  std::uint32_t y0 = __shfl_xor_sync(0xffffffffu, x0, 1);
  std::uint32_t y1 = __shfl_xor_sync(0xffffffffu, x1, 1);
  if (odd) a[0] = y0, a[2] = y1;
  else a[1] = y0, a[3] = y1;
  x0 = upper ? a[0] : a[2], x1 = upper ? a[1] : a[3];
  y0 = __shfl_xor_sync(0xffffffffu, x0, 2);
  y1 = __shfl_xor_sync(0xffffffffu, x1, 2);
  if (upper) a[0] = y0, a[1] = y1;
  else a[2] = y0, a[3] = y1;
}

// One output row's end, shared by both stores: the row's sum over its quad, whether the row
// exists (valid), whether it is written as zeros with LSE -inf (empty: it saw no key, it is a
// padded query, or a block-sparse slot at or past row_limit) and the normaliser.
struct OutputRow {
  std::int64_t i;  // query row in the sequence
  float sum, inv;
  bool valid, empty;
};

// quad_row_sum: the row's sum over its quad (cuda_common::quad_sum, which every lane runs).
__device__ __forceinline__ OutputRow end_output_row(const AttentionParams& p, const Sequence& seq,
                                                    std::int64_t i, float quad_row_sum,
                                                    std::int64_t row_limit) {
  OutputRow row;
  row.sum = quad_row_sum;
  row.i = i;
  row.valid = i < seq.len_q;
  // Empty means no visible key: the sum is exactly 0. A NaN sum (a NaN in the row's q, or in
  // k or v of a key it sees) is not empty: it is normalised like any row and writes NaN, and
  // the LSE comes out NaN too (docs/conventions.md). The same one compare as `!(sum > 0)`,
  // here only, once per row: the key loop's max (fmaxf, which drops NaN) stays as it is.
  row.empty = row.sum == 0.f;
  if (row.valid && p.query_mask &&
      !p.query_mask[seq.batch * p.query_mask_batch + i * p.query_mask_row])
    row.empty = true;
  if (i >= row_limit) row.empty = true;
  // MUFU's reciprocal (2 ulp, against the output's 8 or 11 bits): the IEEE division's
  // refinement and slow-path branch sat between a short tile's last product and its store.
  row.inv = row.empty ? 0.f : __fdividef(1.f, row.sum);
  return row;
}

// A row's LSE in the project's convention (natural log) from its base and log2 of its sum,
// both in log2 units.
__device__ __forceinline__ float natural_lse(float row_max, float log2_sum) {
  return (row_max + log2_sum) * 0.6931471805599453f;
}

// The row's LSE (-inf for an empty row); row_max is in log2 units. MUFU's log2 (~2^-22
// absolute): logf's ~30 instructions ran once per row in every tile's epilogue.
__device__ __forceinline__ void store_lse(const AttentionParams& p, const Sequence& seq, int h,
                                          const OutputRow& row, float row_max) {
  p.lse[cuda_common::q_side_offset(p, p.lse_strides, seq, row.i, h)] =
      row.empty ? -INFINITY : natural_lse(row_max, __log2f(row.sum));
}

// o: the thread's output accumulator; coords(v): (row, column) of value v in the stream tile
// (wgmma's layout: column 8 (v / 4) + 2 (lane % 4) + v % 2). A quad holds 8 consecutive
// columns of its row for each v / 4; transposed across the quad, each lane stores 16 bytes
// of the row at once (4-byte stores straight from the accumulator used half of every 32-byte
// sector: short key loops are bound by their output).
// kPaddedCols: out has p.head_dim_v <= the tile's columns (a padded instance); octets past
// it are not stored (Dv is a multiple of 8, so an octet is all in or all out).
template <class Element, bool kPaddedCols, class Frag, class Coords>
__device__ __forceinline__ void write_output_octets(const AttentionParams& p, const Sequence& seq,
                                                    int h, std::int64_t q0, const Frag& o,
                                                    const Coords& coords, OnlineSoftmax& sm,
                                                    std::int64_t row_limit) {
  constexpr int kVals = decltype(cute::size(o))::value;
  static_assert(kVals % 16 == 0, "groups of 4 column octets per row half");
  const int lane = threadIdx.x & 31;
  const int quad_lane = lane & 3;
  auto* out = static_cast<std::uint16_t*>(p.out);
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const OutputRow row = end_output_row(p, seq, q0 + cute::get<0>(coords(2 * r)),
                                         cuda_common::quad_sum(sm.row_sum[r]), row_limit);
    std::uint16_t* dst = out + cuda_common::q_side_offset(p, p.out_strides, seq, row.i, h);
    const int col0 = cute::get<1>(coords(2 * r)) - 2 * quad_lane;  // column of octet 0
#pragma unroll
    for (int g = 0; g < kVals / 16; ++g) {
      std::uint32_t words[4];
#pragma unroll
      for (int t = 0; t < 4; ++t) {
        const int v = 4 * (4 * g + t) + 2 * r;
        // Exact zeros: a padded row's accumulator may hold anything (its inputs are not read
        // by contract), and 0 * NaN is NaN.
        words[t] = row.empty ? 0u : pack_pair<Element>(o(v) * row.inv, o(v + 1) * row.inv);
      }
      quad_transpose(words, lane);
      const int col = col0 + 8 * (4 * g + quad_lane);
      if (row.valid && (!kPaddedCols || col < p.head_dim_v))
        *reinterpret_cast<uint4*>(dst + col) =
            make_uint4(words[0], words[1], words[2], words[3]);
    }
    if (row.valid && quad_lane == 0) store_lse(p, seq, h, row, sm.row_max[r]);
  }
}

// Traits::kTmaStoreO: the warpgroup's 64 rows (from row q0 + 64 wg of the stream tile) into
// its shared-memory slot by stmatrix, then one TMA store by one thread; zeros and the LSE as
// above. TMA drops rows past the view's end (batched layouts); the caller takes the threads'
// own stores when a varlen sequence ends inside the warpgroup's rows. The slot is rewritten
// only after the previous store has read it (bulk wait_group.read before the first barrier).
template <class Traits, class Frag, class Coords>
__device__ __forceinline__ void write_output_by_tma(const FwdKernelParams<Traits>& p,
                                                    typename Traits::StreamStorage& st,
                                                    const Sequence& seq, int h, int tb,
                                                    std::int64_t q0, const Frag& o,
                                                    const Coords& coords, OnlineSoftmax& sm,
                                                    std::int64_t row_limit, int wg, int wg_tid) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int D = Traits::kHeadDimV;  // out's tile width
  constexpr int kPairs = decltype(size(o))::value / 2;
  static_assert(Traits::kStreams == 1, "named barriers 4 + wg serve one stream");
  static_assert(sizeof(Element) == 2 && kPairs == D / 4, "64 x D 16-bit output per warpgroup");
  const AttentionParams& a = p.attn;
  const int lane = threadIdx.x & 31;
  float sum[2], inv[2];
  for (int r = 0; r < 2; ++r) sum[r] = cuda_common::quad_sum(sm.row_sum[r]);
  // Plain rows, the usual case: the warpgroup's 64 rows exist, none is a padded query or past
  // row_limit, and each saw a key (sum > 0; a NaN sum fails it and takes the other branch,
  // which writes NaN). Then no row needs zeros, and the normaliser is
  // MUFU's reciprocal alone, its log2 too: the base is at or below the row's max, whose key
  // adds exp2(~0) = ~1, so the sum is ~1 or more and has no denormal or overflow to handle.
  const std::int64_t rows_end = q0 + 64 * (wg + 1);
  const bool rows_exist = !a.query_mask && rows_end <= seq.len_q && rows_end <= row_limit;
  const bool plain = __all_sync(0xffffffffu, sum[0] > 0.f && sum[1] > 0.f) && rows_exist;
  std::uint32_t out32[kPairs];
  if (plain) {
    for (int r = 0; r < 2; ++r) inv[r] = cuda_common::rcp_approx(sum[r]);
    if ((lane & 3) == 0) {
      float* lse = a.lse + cuda_common::q_side_offset(a, a.lse_strides, seq, q0, h);
      for (int r = 0; r < 2; ++r)
        lse[get<0>(coords(2 * r)) * a.lse_strides.row] =
            natural_lse(sm.row_max[r], cuda_common::log2_approx(sum[r]));
    }
#pragma unroll
    for (int j = 0; j < kPairs; ++j)
      out32[j] = pack_pair<Element>(o(2 * j) * inv[j & 1], o(2 * j + 1) * inv[j & 1]);
  } else {
    OutputRow rows[2];  // the thread's two rows (wgmma's accumulator: row halves)
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      rows[r] = end_output_row(a, seq, q0 + get<0>(coords(2 * r)), sum[r], row_limit);
      if (rows[r].valid && (lane & 3) == 0) store_lse(a, seq, h, rows[r], sm.row_max[r]);
    }
    // Exact zeros for empty rows (0 * NaN is NaN).
#pragma unroll
    for (int j = 0; j < kPairs; ++j) {
      const OutputRow& row = rows[j & 1];
      out32[j] = row.empty ? 0u : pack_pair<Element>(o(2 * j) * row.inv, o(2 * j + 1) * row.inv);
    }
  }
  const int bar = 4 + wg;
  if (wg_tid == 0) tma_store_wait<0>();
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
  const std::uint32_t address0 =
      cast_smem_ptr_to_uint(st.o.data() + wg * 64 * D) +
      stsm_o_lane_offset<Traits::kAtomCols>(wg_tid);
#pragma unroll
  for (int s = 0; s < D / 16; ++s)
    stsm_x4(stsm_o_address<Traits::kAtomCols>(address0, s), out32[4 * s], out32[4 * s + 1],
            out32[4 * s + 2], out32[4 * s + 3]);
  tma_store_fence();  // the generic-proxy writes above, seen by the TMA store
  asm volatile("bar.sync %0, 128;\n" ::"r"(bar) : "memory");
  if (wg_tid == 0) {
    Tensor sO = make_tensor(make_smem_ptr(st.o.data()), typename Traits::SmemLayoutO{})(_, _, wg);
    Tensor mO = p.tma_o.get_tma_tensor(make_shape(p.q_rows, Int<D>{}, a.heads_q, p.tma_batch));
    const int q_base = a.varlen ? static_cast<int>(seq.first_q) : 0;
    Tensor gO = local_tile(domain_offset(make_coord(q_base + static_cast<int>(q0) + 64 * wg, _0{}),
                                         mO(_, _, h, tb)),
                           Shape<_64, Int<D>>{}, make_coord(_0{}, _0{}));
    auto cta = p.tma_o.get_slice(_0{});
    copy(p.tma_o, cta.partition_S(sO), cta.partition_D(gO));
    tma_store_arrive();
  }
}

// Traits::kSplitTail: the three warpgroups of a split piece each hold the output accumulator
// and softmax state of the same 64 rows over a third of the key blocks; this leaves their sum
// in warpgroup 0 (o, sm), ready for the epilogue. Through the output's staging slot, free once
// the last TMA store has read it: per-thread row bases and sums of every warpgroup, then
// warpgroup 1's accumulator rebased to the common base, warpgroup 2's added to it, and
// warpgroup 0 adds its own (fp32 throughout; the same thread index holds the same (row,
// column) in every warpgroup). Named barrier 2 spans the three consumer warpgroups. A CTA runs
// at most one piece (last_round_split_from); racecheck is clean for that (tools/sm90_smoke.py
// runs a whole tile, then a piece, on one CTA), and reported hazards between this function's
// stats writes and reads when a CTA ran two pieces in a row (docs/perf-history.md, Hopper v32).
template <class Traits, class Frag>
__device__ __forceinline__ void combine_split_piece(typename Traits::StreamStorage& st, Frag& o,
                                                    OnlineSoftmax& sm, int wg, int wg_tid) {
  static_assert(Traits::kWGPerStream == 3 && Traits::kStreams == 1);
  constexpr int kVals = decltype(cute::size(o))::value;
  float* partial = reinterpret_cast<float*>(st.o.data());  // [kVals][128]
  float* stats = partial + kVals * 128;                    // [warpgroup][max0, max1, sum0, sum1][128]
  static_assert((kVals * 128 + 3 * 4 * 128) * sizeof(float) <= sizeof(st.o));
  auto sync = [] { asm volatile("bar.sync 2, 384;\n" ::: "memory"); };
  if (wg_tid == 0) cute::tma_store_wait<0>();  // each thread waits for the stores it issued
  sync();
  float* mine = stats + wg * 4 * 128 + wg_tid;
  mine[0] = sm.row_max[0], mine[128] = sm.row_max[1];
  mine[256] = sm.row_sum[0], mine[384] = sm.row_sum[1];
  sync();
  float scale[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    float m[3], l[3];
#pragma unroll
    for (int w = 0; w < 3; ++w) {
      m[w] = stats[(w * 4 + r) * 128 + wg_tid];
      l[w] = stats[(w * 4 + 2 + r) * 128 + wg_tid];
    }
    const float top = fmaxf(m[0], fmaxf(m[1], m[2]));
    const float base = top == -INFINITY ? 0.f : top;  // every part empty: all factors 0
    float f[3];
#pragma unroll
    for (int w = 0; w < 3; ++w) f[w] = cuda_common::exp2_approx(m[w] - base);
    scale[r] = f[wg];
    if (wg == 0) {
      sm.row_max[r] = top;
      sm.row_sum[r] = l[0] * f[0] + l[1] * f[1] + l[2] * f[2];
    }
  }
  if (wg == 1) {
#pragma unroll
    for (int v = 0; v < kVals; ++v) partial[v * 128 + wg_tid] = o(v) * scale[(v >> 1) & 1];
  }
  sync();
  if (wg == 2) {
#pragma unroll
    for (int v = 0; v < kVals; ++v) partial[v * 128 + wg_tid] += o(v) * scale[(v >> 1) & 1];
  }
  sync();
  if (wg == 0) {
#pragma unroll
    for (int v = 0; v < kVals; ++v) o(v) = o(v) * scale[(v >> 1) & 1] + partial[v * 128 + wg_tid];
  }
}

}  // namespace vidattn::cuda_sm90
