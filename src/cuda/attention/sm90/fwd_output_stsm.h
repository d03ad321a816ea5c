// Where each thread's stmatrix stores put the output accumulator in a warpgroup's 64 x D
// shared-memory slot before the TMA store (fwd_epilogue.h). Torch- and cute-free, so the
// host test tests/cpp/test_sm90_output_stsm.cpp can check it against cute's layout.
#pragma once

#include <cuda_runtime.h>  // __host__ / __device__ for a host compiler

#include <cstdint>

namespace vidattn::cuda_sm90 {

// Byte offset of 16-byte piece `piece` of row `row` within one column chunk of a K-major tile
// of 16-bit elements in swizzled atoms of 8 rows x kAtomCols columns: 64 (128-byte swizzle) or
// 32 (64-byte swizzle), rows 2 kAtomCols bytes apart. The swizzle XORs the piece's index with
// address bits 7 and up (the row mod 8 for 128-byte rows, the row / 2 mod 4 for 64-byte rows).
// The epilogue's stmatrix stores and slot_piece_offset (below) address the tiles through it.
template <int kAtomCols>
__host__ __device__ constexpr int swizzled_piece_offset(int row, int piece) {
  static_assert(kAtomCols == 64 || kAtomCols == 32, "the 128- and 64-byte swizzle atoms");
  constexpr int kRowBytes = 2 * kAtomCols;
  return row * kRowBytes + 16 * (piece ^ (((row * kRowBytes) >> 7) & (kAtomCols / 8 - 1)));
}

// Byte offset of 16-byte piece j (column 8 j) of row `row` in a K-major slot of kRows rows:
// its chunks of kAtomCols columns one after the other (kRows x 2 kAtomCols bytes each), and
// swizzled_piece_offset within a chunk. The forward's V tail zeroing addresses V slots
// through it.
template <int kAtomCols, int kRows>
__host__ __device__ constexpr int slot_piece_offset(int row, int j) {
  constexpr int kAtomPieces = kAtomCols / 8;  // 16-byte pieces per chunk row
  return (j / kAtomPieces) * (kRows * 2 * kAtomCols) +
         swizzled_piece_offset<kAtomCols>(row, j % kAtomPieces);
}

// The stmatrix (.x4) addresses of a warpgroup's 64 x D output slot in shared memory
// (SmemLayoutO, 16-bit elements: swizzled atoms of 8 rows x kAtomCols columns, 64 (128-byte
// swizzle) or 32 (64-byte swizzle), down the rows, then across the column chunks). Store s
// covers columns 16 s .. 16 s + 15 of the warp's 16 rows: lane l gives the address of row
// 16 w + 8 ((l >> 3) & 1) + (l & 7), column octet 2 s + (l >> 4) (swizzled_piece_offset).
// Worked out here once per thread: cute's partition applied the swizzle to each store's 64-bit
// generic address (about six integer instructions per store, in every tile's epilogue).
template <int kAtomCols>
__host__ __device__ constexpr std::uint32_t stsm_o_lane_offset(int wg_tid) {
  const int lane = wg_tid & 31, warp = wg_tid >> 5;
  const int row = 16 * warp + 8 * ((lane >> 3) & 1) + (lane & 7);
  return static_cast<std::uint32_t>(swizzled_piece_offset<kAtomCols>(row, (lane >> 4) & 1));
}
// Store s from the lane's address of store 0 (which has row-aligned bits above the chunk).
template <int kAtomCols>
__host__ __device__ constexpr std::uint32_t stsm_o_address(std::uint32_t lane_address0, int s) {
  constexpr int kStoresPerChunk = kAtomCols / 16;
  constexpr std::uint32_t kChunkBytes = 64u * 2u * kAtomCols;
  return (lane_address0 ^ (32u * static_cast<std::uint32_t>(s % kStoresPerChunk))) +
         kChunkBytes * static_cast<std::uint32_t>(s / kStoresPerChunk);
}
#if defined(__CUDACC__)
// Store s's four matrices are value pairs 4 s .. 4 s + 3 of the thread's accumulator (pair j:
// values 2 j, 2 j + 1, row half j % 2, column octet j / 2), in stmatrix's matrix order.
__device__ __forceinline__ void stsm_x4(std::uint32_t address, std::uint32_t r0, std::uint32_t r1,
                                        std::uint32_t r2, std::uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.x4.m8n8.shared.b16 [%0], {%1, %2, %3, %4};\n" ::"r"(address),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
#endif

}  // namespace vidattn::cuda_sm90
