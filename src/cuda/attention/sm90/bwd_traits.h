// Compile-time shape of the sm_90a backward kernels (bwd_kernels.h). Both kernels have the
// same skeleton, one producer warpgroup and two consumer warpgroups:
//   * a stationary tile of kRows = 128 rows (64 per consumer warpgroup) of two tensors, loaded
//     once: K and V for the dK / dV kernel, Q and dO for the dQ kernel;
//   * a ring of kStages slots through which kCols-row tiles of the two other tensors stream
//     (64; 128 or 80 for the dense deterministic kernels, below):
//     Q and dO (with their rows' LSE and row sums) for dK / dV, K and V for dQ.
// kStreams = 1: both warpgroups share one ring (dense; block-sparse tiles of 128 and 256
// tokens, where the CTA's rows lie in one tile and share its list). kStreams = 2: each
// warpgroup has a ring of its own, fed by its own producer warp (block-sparse 64-token tiles:
// the warpgroups' 64 rows are two tiles with two lists).
// With A the stationary pair (X, Y) and B the streamed pair (U, W), every step runs
//   S = X U^T and dP = Y W^T (wgmma, both operands in shared memory: MmaSS),
//   P and dS = P (dP - delta) in registers,
//   and one or two products with P or dS as the register operand and a streamed tile seen
//   transposed (MmaRS): dV += P^T dO and dK += dS^T Q, or dQ += dS K.
// So the two kernels share one tile vocabulary: the dK / dV kernel computes S^T (keys as rows),
// the dQ kernel S (queries as rows).
// kFusedDq (one stream only): the dK / dV kernel computes dQ too, and no dQ kernel runs. Per
// query block it writes dS to shared memory (queries as rows), computes dQ_block = dS K with
// the stationary K, and adds it into an fp32 workspace with a bulk reduce-add (bwd_dkdv.h); a
// convert kernel scales it to dQ (bwd_dq_convert.h). Five products per block instead of the
// seven of the two kernels, but the adds of different CTAs land in any order: not
// deterministic.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
// The N = 80 atoms (MmaSS at kCols = 80), which cute includes only with
// CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED; that switch also widens ss_op_selector's choices for
// every other kernel, so the headers are taken alone.
#include <cute/arch/mma_sm90_gmma_ext.hpp>
#include <cute/atom/mma_traits_sm90_gmma_ext.hpp>
#include <cutlass/numeric_types.h>

namespace vidattn::cuda_sm90 {

// kCols_: rows of one streamed tile. 64; or more rows per block for the dense deterministic
// kernels, whose 64-row products are too short to hide a block's softmax, barriers and
// statistics loads: 128 at D = 64, 80 for the dK / dV kernel at D = 128 (registers allow no
// more there: dK and dV take 128 a thread). FlashAttention-3's Hopper backward makes the same
// choices. The fused dQ takes 64 only.
template <class Element_, int kHeadDim_, int kStreams_ = 1, bool kFusedDq_ = false,
          int kCols_ = 64>
struct BwdTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr int kHeadDim = kHeadDim_;
  static constexpr int kConsumerWGs = 2;
  static constexpr int kRows = 64 * kConsumerWGs;  // stationary rows per CTA
  static constexpr int kCols = kCols_;             // rows of one streamed tile
  static_assert(kCols == 64 || (kStreams_ == 1 && !kFusedDq_ &&
                                 ((kCols == 128 && kHeadDim == 64) ||
                                  (kCols == 80 && kHeadDim == 128))));
  // The row statistics' rows per (batch, head) are a multiple of this (launch): every
  // streamed block and every stationary tile lies inside them.
  static constexpr int kStatsRowsMultiple = kRows % kCols == 0 ? kRows : 5 * kRows;
  static constexpr int kStages = 2;
  static constexpr int kStreams = kStreams_;
  static_assert(kStreams == 1 || kStreams == kConsumerWGs);
  static constexpr bool kFusedDq = kFusedDq_;
  static_assert(!kFusedDq || kStreams == 1, "a fused dQ needs both warpgroups on one block");
  static constexpr int kStreamRows = kRows / kStreams;  // stationary rows per stream
  static constexpr int kSlots = kStages * kStreams;      // ring slots of all streams
  // Arrivals that free a slot: the threads of the warpgroups reading it.
  static constexpr int kSlotReleases = 128 * kConsumerWGs / kStreams;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  // 24 + 2 x 240 registers: exactly the launch allocation of 384 threads at 168 (64512).
  // The dK / dV consumers hold dK and dV (2 x D / 2 fp32 values per thread), S and dP
  // (kCols / 2 each) and the 16-bit P and dS operands (kCols / 4 words each).
  static constexpr int kProducerRegs = 24;
  static constexpr int kConsumerRegs = 240;
  static_assert(kHeadDim == 64 || kHeadDim == 128);
  static constexpr bool kPaddedHeadDim = false;  // D = Dv = the width (launch_utils.h)

  // K-major (head dim contiguous) tiles with the 128-byte swizzle atom, as TMA writes them.
  using SmemAtom = cute::GMMA::Layout_K_SW128_Atom<Element>;
  using SmemLayoutRows = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>>{}));
  using SmemLayoutCols = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kCols>, cute::Int<kHeadDim>, cute::Int<kSlots>>{}));
  // A streamed tile seen as the B operand of the register-operand products: (head dim, rows),
  // head dim contiguous (MN-major). A view of the same bytes.
  using SmemLayoutColsT = decltype(cute::composition(
      SmemLayoutCols{},
      cute::make_ordered_layout(
          cute::Shape<cute::Int<kHeadDim>, cute::Int<kCols>, cute::Int<kSlots>>{},
          cute::Step<cute::_2, cute::_1, cute::_3>{})));

  using WGLayout = cute::Layout<cute::Shape<cute::Int<kConsumerWGs>, cute::_1, cute::_1>>;
  // ss_op_selector offers N = 80 only with CUTE_SM90_EXTENDED_MMA_SHAPES_ENABLED (else it
  // picks 5 x N = 16), which would change the selection of every other kernel: name the atom.
  using MmaSSAtom = std::conditional_t<
      kCols == 80,
      std::conditional_t<std::is_same_v<Element, cutlass::bfloat16_t>,
                         cute::SM90::GMMA::MMA_64x80x16_F32BF16BF16_SS<cute::GMMA::Major::K,
                                                                        cute::GMMA::Major::K>,
                         cute::SM90::GMMA::MMA_64x80x16_F32F16F16_SS<cute::GMMA::Major::K,
                                                                      cute::GMMA::Major::K>>,
      decltype(cute::GMMA::ss_op_selector<Element, Element, float,
                                          cute::Shape<cute::Int<kRows>, cute::Int<kCols>,
                                                      cute::Int<kHeadDim>>>())>;
  using MmaSS = decltype(cute::make_tiled_mma(MmaSSAtom{}, WGLayout{}));
  using MmaRS = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kRows>, cute::Int<kHeadDim>,
                                             cute::Int<kCols>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WGLayout{}));
  // P or dS as the A operand of MmaRS: the accumulator's value order, k-blocks of 16.
  using OperandLayout =
      cute::Layout<cute::Shape<cute::Shape<cute::_2, cute::_2, cute::_2>, cute::_1,
                               cute::Int<kCols / 16>>>;

  // Fused dQ: dQ_block (kCols x D) = dS (kCols x kRows keys) K (kRows x D).
  // D = 128: the warpgroups split D (each 64 x 64 x 128 keys): one fp32 tile per block.
  // D = 64: a 32-column split would cut the 128-byte swizzle atom of K, so each warpgroup
  // multiplies its own 64 keys (64 x 64 x 64) and reduces its own partial tile: two per block.
  // Either way a thread holds 32 fp32 dQ values.
  // A fused dQ streams 64-row blocks (the static_assert above); the names below are defined
  // for every kCols, at 64 rows, so that traits of other block sizes still instantiate.
  static constexpr int kDqCols = 64;
  static constexpr bool kDqSplitsD = kHeadDim == 128;
  static constexpr int kDqThreads = kDqSplitsD ? 128 * kConsumerWGs : 128;  // per dQ tile
  static constexpr int kDqParts = kDqSplitsD ? 1 : kConsumerWGs;  // partial tiles per block
  static constexpr int kDqKeys = kDqSplitsD ? kRows : 64;  // keys of one dQ product
  static constexpr int kDqTileFloats = kDqCols * kHeadDim;
  // dS with queries contiguous: the accumulator's column pairs are 32-bit stores, and the 128-
  // byte swizzle spreads a warp's eight key rows over all banks.
  using SmemLayoutdS = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kDqCols>, cute::Int<kRows>>{}));
  // The operands of one dQ product: the whole of the two above (D = 128), or one warpgroup's
  // 64 keys of them (D = 64), at an offset of whole swizzle atoms.
  using SmemLayoutdSPart = decltype(cute::tile_to_shape(
      cute::GMMA::Layout_MN_SW128_Atom<Element>{},
      cute::Shape<cute::Int<kDqCols>, cute::Int<kDqKeys>>{}));
  using SmemLayoutKPartT = decltype(cute::composition(
      cute::tile_to_shape(SmemAtom{}, cute::Shape<cute::Int<kDqKeys>, cute::Int<kHeadDim>>{}),
      cute::make_ordered_layout(cute::Shape<cute::Int<kHeadDim>, cute::Int<kDqKeys>>{},
                                cute::Step<cute::_2, cute::_1>{})));
  using MmaDq = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kDqCols>,
                                             cute::Int<kHeadDim / (kDqSplitsD ? 2 : 1)>,
                                             cute::Int<kDqKeys>>,
                                 cute::GMMA::Major::MN, cute::GMMA::Major::MN>(),
      cute::Layout<cute::Shape<cute::_1, cute::Int<kDqSplitsD ? 2 : 1>, cute::_1>>{}));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), 64-bit strides.
  using GmemLayout =
      cute::Layout<cute::Shape<int32_t, cute::Int<kHeadDim>, int32_t, int32_t>,
                   cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(
      cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}));
  using TmaRows = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                               SmemLayoutRows{}));
  using TmaCols = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                               cute::take<0, 2>(SmemLayoutCols{})));
  static constexpr uint32_t kRowsBytes = kRows * kHeadDim * sizeof(Element);
  static constexpr uint32_t kColsBytes = kCols * kHeadDim * sizeof(Element);
  static constexpr uint32_t kStatsBytes = kCols * sizeof(float);

  // Fused dQ: dS of the current block, and two fp32 dQ buffers (a block's reduce-add reads one
  // while the next block fills the other). A buffer holds kDqParts tiles, each in the
  // fragment order of bwd_dq_convert.h.
  struct DqStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutdS>, 1024> ds;
    cute::array_aligned<float, kDqTileFloats * kDqParts, 128> dq[2];
  };
  struct NoDqStorage {};

  struct SharedStorage {
    // 1024-byte alignment: the swizzle pattern repeats every 1024 bytes, and TMA and wgmma
    // must agree on where it starts.
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutRows>, 1024> x, y;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutCols>, 1024> u, w;
    // dK / dV kernel: the streamed query rows' LSE (log2 units) and row sums.
    alignas(16) float lse2[kSlots][kCols];
    alignas(16) float delta[kSlots][kCols];
    uint64_t rows_full;
    uint64_t full[kSlots], empty[kSlots];  // slot stream * kStages + stage
    std::conditional_t<kFusedDq, DqStorage, NoDqStorage> fused;
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + manual alignment
};

}  // namespace vidattn::cuda_sm90
