// The sm_90a epilogue's stmatrix stores (src/cuda/attention/sm90/fwd_output_stsm.h), run on the
// host against cute: every (thread, store, matrix row) must land where the output slot's
// layout (FwdTraits::SmemLayoutO, the layout the TMA store reads) puts that row and column,
// the stores of a warpgroup must cover its slot exactly once, and the accumulator values a
// store takes must be the ones that belong there. (The kernels' outputs are
// checked on a GPU: tests/python/test_attention_sm90.py.)
#include <gtest/gtest.h>

#if VIDATTN_TESTS_SM90_SCHEDULER
#include <cuda_runtime.h>  // __host__ / __device__ for a host compiler

#include <cstdint>
#include <vector>

#include <cute/tensor.hpp>

#include "cuda/attention/sm90/fwd_output_stsm.h"
#include "cuda/attention/sm90/fwd_traits.h"

namespace {

using vidattn::cuda_sm90::stsm_o_address;
using vidattn::cuda_sm90::stsm_o_lane_offset;

// Byte offset of (row, column) of warpgroup wg's slot, as cute's swizzled shared-memory tensor
// addresses it (a 1024-byte-aligned base, as the kernels' storage is; nothing is read).
template <class Traits>
std::uint32_t slot_offset(int row, int col, int wg) {
  using Element = typename Traits::Element;
  Element* base = reinterpret_cast<Element*>(std::uintptr_t{1} << 20);
  auto tensor = cute::make_tensor(cute::make_smem_ptr(base), typename Traits::SmemLayoutO{});
  const auto* at = cute::raw_pointer_cast(&tensor(row, col, wg));
  return static_cast<std::uint32_t>(reinterpret_cast<const char*>(at) -
                                    reinterpret_cast<const char*>(base));
}

template <class Traits>
void check_stores() {
  constexpr int D = Traits::kHeadDim, kWG = Traits::kWGPerStream;
  constexpr std::uint32_t kSlotBytes = 64 * D * 2;
  for (int wg = 0; wg < kWG; ++wg) {
    std::vector<int> written(64 * D, 0);
    for (int tid = 0; tid < 128; ++tid) {
      const int warp = tid / 32, lane = tid % 32;
      const std::uint32_t address0 =
          wg * kSlotBytes + stsm_o_lane_offset<Traits::kAtomCols>(tid);
      for (int s = 0; s < D / 16; ++s) {
        // stmatrix .x4: lane l gives row l % 8 of matrix l / 8, whose 8 columns (16 bytes)
        // are contiguous; matrix m is value pair 4 s + m (row half m % 2, octet 2 s + m / 2).
        const int m = lane / 8;
        const int row = 16 * warp + 8 * (m % 2) + lane % 8;
        const int col = 16 * s + 8 * (m / 2);
        const std::uint32_t address = stsm_o_address<Traits::kAtomCols>(address0, s);
        for (int c = 0; c < 8; ++c) {
          ASSERT_EQ(address + 2 * c, slot_offset<Traits>(row, col + c, wg))
              << "D " << D << " wg " << wg << " tid " << tid << " store " << s << " column "
              << col + c;
          ++written[row * D + col + c];
        }
      }
    }
    for (int i = 0; i < 64 * D; ++i) ASSERT_EQ(written[i], 1) << "D " << D << " element " << i;
  }
}

// The values each store takes from a thread: stmatrix puts register m of lane l at row l / 4,
// columns 2 (l % 4) and + 1 of matrix m, so value pair 4 s + m of the accumulator (the
// warpgroup MMA's C fragment, as cute partitions it) must hold exactly that row and column.
template <class Traits>
void check_registers() {
  constexpr int D = Traits::kHeadDim;
  typename Traits::MmaPVOneWG mma;
  for (int tid = 0; tid < 128; ++tid) {
    const int warp = tid / 32, lane = tid % 32;
    auto coords = mma.get_thread_slice(tid).partition_C(
        cute::make_identity_tensor(cute::Shape<cute::_64, cute::Int<D>>{}));
    ASSERT_EQ(int(cute::size(coords)), D / 2);
    for (int s = 0; s < D / 16; ++s)
      for (int m = 0; m < 4; ++m)
        for (int c = 0; c < 2; ++c) {
          const auto at = coords(2 * (4 * s + m) + c);
          ASSERT_EQ(int(cute::get<0>(at)), 16 * warp + 8 * (m % 2) + lane / 4)
              << "D " << D << " tid " << tid << " store " << s << " matrix " << m;
          ASSERT_EQ(int(cute::get<1>(at)), 16 * s + 8 * (m / 2) + 2 * (lane % 4) + c)
              << "D " << D << " tid " << tid << " store " << s << " matrix " << m;
        }
  }
}

// The V slot's 16-byte pieces as the forward's tail zeroing addresses them (zero_v_tail_rows:
// slot_piece_offset) against cute's layout of the slot.
template <class Traits>
void check_v_pieces() {
  using Element = typename Traits::Element;
  constexpr int kAtomCols = Traits::kAtomCols, kRows = Traits::kBlockN;
  Element* base = reinterpret_cast<Element*>(std::uintptr_t{1} << 20);
  auto v = cute::make_tensor(cute::make_smem_ptr(base), typename Traits::SmemLayoutV{});
  for (int r = 0; r < kRows; ++r)
    for (int j = 0; j < Traits::kHeadDimV / 8; ++j) {
      const int at = vidattn::cuda_sm90::slot_piece_offset<kAtomCols, kRows>(r, j);
      const auto* cute_at = cute::raw_pointer_cast(&v(r, 8 * j, 0));
      ASSERT_EQ(at, reinterpret_cast<const char*>(cute_at) - reinterpret_cast<const char*>(base))
          << "width " << Traits::kHeadDimV << " row " << r << " piece " << j;
    }
}

using vidattn::cuda_sm90::FwdTraits;
namespace configs = vidattn::cuda_sm90;

TEST(Sm90OutputStsm, VTailPiecesFollowTheSlotLayout) {
  check_v_pieces<FwdTraits<cutlass::bfloat16_t, configs::dense(128)>>();
  check_v_pieces<FwdTraits<cutlass::bfloat16_t, configs::dense(96)>>();
  check_v_pieces<FwdTraits<cutlass::half_t, configs::dense_short(96)>>();
  check_v_pieces<FwdTraits<cutlass::half_t, configs::dense64_wide()>>();
}

TEST(Sm90OutputStsm, Bf16HeadDim128TwoWarpgroups) {
  check_stores<FwdTraits<cutlass::bfloat16_t, configs::dense(128)>>();
  check_registers<FwdTraits<cutlass::bfloat16_t, configs::dense(128)>>();
}
TEST(Sm90OutputStsm, Bf16HeadDim128ThreeWarpgroups) {
  check_stores<FwdTraits<cutlass::bfloat16_t, configs::dense_short(128)>>();
}
// The 96-wide tile (64-byte swizzle atoms of 32 columns), two and three warpgroups.
TEST(Sm90OutputStsm, Bf16Width96) {
  static_assert(FwdTraits<cutlass::bfloat16_t, configs::dense(96)>::kAtomCols == 32);
  check_stores<FwdTraits<cutlass::bfloat16_t, configs::dense(96)>>();
  check_registers<FwdTraits<cutlass::bfloat16_t, configs::dense(96)>>();
  check_stores<FwdTraits<cutlass::bfloat16_t, configs::dense_short(96)>>();
}
TEST(Sm90OutputStsm, Fp16HeadDim64ThreeWarpgroups) {
  check_stores<FwdTraits<cutlass::half_t, configs::dense64_wide()>>();
  check_registers<FwdTraits<cutlass::half_t, configs::dense64_wide()>>();
}

}  // namespace
#endif
