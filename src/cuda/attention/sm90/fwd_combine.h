// VSA's combination inside the 64-token block-sparse kernel (FwdTraits::kFusedCombine,
// inference): out = fine + gate * coarse[tile] on a query tile's valid slots, out = fine on
// its padded slots, computed exactly as vsa_combine does (fine rounded to the element type
// first, one fma in fp32), so the fused op and the two passes give the same bits.
//
// Who does it: one warp of the producer warpgroup per stream (warps 2 and 3; warps 0 and 1
// issue the loads), on the tile the stream's consumers have just written, while they compute
// the next one. The fine rows are read back from L2 moments after the consumers stored them;
// only the last tile of each stream is combined after its consumers are done. (A combine in
// the consumers' own epilogue stalled every tile's end on the gate loads and changed the
// main loop's code: docs/perf-history.md, Hopper v9 and v13.)
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include <cutlass/arch/barrier.h>

#include "cuda/common/dtype_io.cuh"
#include "cuda/common/tile_io.h"
#include "fwd_kernel_params.h"
#include "kernel_utils.h"

namespace vidattn::cuda_sm90 {

// Combines one stream tile (query rows [t.q0, t.q0 + 64) of head t.head) with the 32 lanes
// of a warp: lane l takes column chunk l % (D / 8) of every (32 / (D / 8))-th row.
// Not inlined: inlined, it pushed the producer's loop (same warpgroup, same 24 registers) into
// 10 spills per key block; as a call, 2, and the fused kernel ran 1% faster (perf-history,
// Hopper v17).
template <class Traits>
__device__ __noinline__ void combine_tile(const FwdKernelParams<Traits>& p,
                                          const cuda_common::Sequence& seq, std::int64_t q0,
                                          int head, int batch, int lane) {
  using T = std::conditional_t<cute::is_same_v<typename Traits::Element, cutlass::bfloat16_t>,
                               __nv_bfloat16, __half>;
  using Io = cuda_common::Io<T>;
  // 16-byte chunks: 8-byte ones (half the registers) ran the 480p op 1.7% slower.
  constexpr int kVec = 8;  // elements per chunk
  using Chunk = uint4;
  constexpr int kChunksPerRow = Traits::kHeadDim / kVec;
  constexpr int kRowsPerPass = 32 / kChunksPerRow;
  constexpr int kRows = Traits::kBlockMStream;
  static_assert(32 % kChunksPerRow == 0 && kRows % kRowsPerPass == 0);
  const CombineArgs& c = p.combine;
  const int chunk = lane % kChunksPerRow;
  // The stream's rows are one query tile (kRows == tile_volume): its first `valid` are tokens.
  const std::int64_t tile = q0 / p.attn.tile_volume;
  const int valid = p.attn.q_block_sizes
                        ? __ldg(p.attn.q_block_sizes + tile * p.attn.q_block_sizes_stride)
                        : kRows;
  // One row per step, and the coarse chunk loaded again each step (an L1 hit): the warp has
  // 24 registers (kProducerRegs), and holding two rows or the coarse values spilled.
  const Chunk* coarse = reinterpret_cast<const Chunk*>(
      static_cast<const T*>(c.coarse) + batch * c.coarse_batch + tile * c.coarse_tile +
      head * c.coarse_head + chunk * kVec);
  const int first = lane / kChunksPerRow;
  const T* fine =
      static_cast<const T*>(p.attn.out) + chunk * kVec +
      cuda_common::q_side_offset(p.attn, p.attn.out_strides, seq, q0 + first, head);
  const T* gate =
      c.gate ? static_cast<const T*>(c.gate) + chunk * kVec +
                   cuda_common::q_side_offset(p.attn, c.gate_strides, seq, q0 + first, head)
             : nullptr;
  T* out = static_cast<T*>(c.out) + chunk * kVec +
           cuda_common::q_side_offset(p.attn, c.out_strides, seq, q0 + first, head);
#pragma unroll 1
  for (int r = first; r < kRows; r += kRowsPerPass) {
    // fine was written by this kernel's consumers: a coherent load (from L2), not the
    // read-only path. fine and gate are read once and out written once: kept out of L1, which
    // holds the producer's index reads and spills.
    Chunk f = __ldcg(reinterpret_cast<const Chunk*>(fine));
    if (r < valid) {
      const Chunk g = gate ? __ldcs(reinterpret_cast<const Chunk*>(gate)) : Chunk{};
      const Chunk cc = __ldg(coarse);
      T* fv = reinterpret_cast<T*>(&f);
      const T* gv = reinterpret_cast<const T*>(&g);
      const T* cv = reinterpret_cast<const T*>(&cc);
#pragma unroll
      for (int j = 0; j < kVec; ++j) {
        const float gj = gate ? Io::template load<float>(gv[j]) : 1.f;
        fv[j] = Io::template store<float>(__fmaf_rn(gj, Io::template load<float>(cv[j]),
                                                    Io::template load<float>(fv[j])));
      }
    }
    __stcs(reinterpret_cast<Chunk*>(out), f);
    fine += kRowsPerPass * p.attn.out_strides.row;
    if (gate) gate += kRowsPerPass * c.gate_strides.row;
    out += kRowsPerPass * c.out_strides.row;
  }
}

// A combining warp's loop: each tile its stream's consumers hand over, until item -1.
template <class Traits>
__device__ __forceinline__ void combine_loop(const FwdKernelParams<Traits>& p,
                                             typename Traits::StreamStorage& st, int lane) {
  uint32_t phase = 0;
  for (;;) {
    Barrier::wait(&st.o_ready, phase);  // acquire: the consumers' stores of the tile
    phase ^= 1u;
    // Lane 0 alone reads the item and frees the slot, so that every read of done_item is
    // ordered before the arrive that lets the consumers write it again.
    int item = 0;
    if (lane == 0) {
      item = st.done_item;
      Barrier::arrive(&st.o_free);
    }
    item = __shfl_sync(0xffffffffu, item, 0);
    if (item < 0) break;
    const TileCoord tc = p.items.decode(item);
    const cuda_common::Sequence seq = cuda_common::sequence_of(p.attn, tc.batch);
    combine_tile<Traits>(p, seq, static_cast<std::int64_t>(tc.m_block) * Traits::kBlockMStream,
                         tc.head, tc.batch, lane);
  }
}

}  // namespace vidattn::cuda_sm90
