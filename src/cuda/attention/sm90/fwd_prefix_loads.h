// Key-tile prefix loads of the block-sparse kernels (FwdTraits::kPrefixLoads: the 64-token
// one): a key tile with fewer valid keys than slots (the edge tiles of a video grid that the
// tile shape does not divide) is loaded in 16-row pieces up to its valid keys only, and a
// load with no valid key (an odd list's last block repeats its tile with 0 keys; an
// out-of-range id) is skipped. The 64-token kernel is bound by what L2 delivers to the SMs
// (docs/perf-history.md, the split probe), and Wan's 480p and 720p grids have 18% padding
// slots.
//
// The slot's rows past the prefix keep what an earlier load left there, or the zeros the
// kernel starts with. Their keys are masked as before (whatever their K holds), and their V
// rows meet exact-zero probabilities, so the results are the bits of whole-tile loads as
// long as V is finite (include/vidattn/vsa.h). The full barrier expects the bytes loaded.
#pragma once

#include <cute/arch/copy_sm90_desc.hpp>
#include <cute/arch/copy_sm90_tma.hpp>

#include <cstdint>

namespace vidattn::cuda_sm90 {

struct PrefixLoadMaps {
  static constexpr int kPieceRows = 16;
  // 16-row boxes over the same (head dim, rows, heads, batch) views as the whole-tile loads.
  cute::TmaDescriptor k, v;
  bool enabled = false;  // false: whole-tile loads

  // Rows loaded for a load of kLoadRows rows with `keys` valid keys: none, the prefix in whole
  // pieces, or all of them.
  template <int kLoadRows>
  static __device__ __forceinline__ int rows_of(int keys) {
    if (keys <= 0) return 0;
    const int rows = (keys + kPieceRows - 1) / kPieceRows * kPieceRows;
    return rows < kLoadRows ? rows : kLoadRows;
  }
};

// The instances without prefix loads carry no descriptors.
struct NoPrefixLoadMaps {};

// `rows` (a multiple of kPieceRows) rows of the sequence from `row` on, of head `head` and
// batch `batch`, into the first rows of a K-major, 128-byte-swizzled slot at `smem` whose
// 64-column chunks lie `chunk_elems` elements apart.
template <int kHeadDim, class Element>
__device__ __forceinline__ void load_key_rows(const cute::TmaDescriptor* map, uint64_t* full,
                                              Element* smem, int chunk_elems, int rows, int row,
                                              int head, int batch) {
  constexpr int kPiece = PrefixLoadMaps::kPieceRows;
  for (int r = 0; r < rows; r += kPiece) {
    CUTE_UNROLL
    for (int c = 0; c < kHeadDim / 64; ++c) {
      // A row of a chunk is 64 elements (128 bytes, the swizzle width), so a piece of
      // kPiece rows starts kPiece * 64 elements further (whole 8-row swizzle atoms).
      cute::SM90_TMA_LOAD_4D::copy(
          map, full, static_cast<uint64_t>(cute::TMA::CacheHintSm90::EVICT_NORMAL),
          smem + c * chunk_elems + r * 64, 64 * c, row + r, head, batch);
    }
  }
}

}  // namespace vidattn::cuda_sm90
