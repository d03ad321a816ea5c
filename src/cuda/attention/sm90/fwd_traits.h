// Compile-time shape of the sm_90a forward: tile sizes, shared-memory layouts (128-byte
// swizzle, or 64-byte for the 96-wide tile: the layout both TMA writes and wgmma reads), the
// two warpgroup MMAs and the TMA descriptor types.
//
// A CTA holds one producer warpgroup and kStreams * kWGPerStream consumer warpgroups. A
// "stream" is a Q tile of 64 * kWGPerStream rows with its own K/V pipeline: dense runs one
// stream of two warpgroups (128 query rows share every K/V tile: half the L2 traffic of two
// 64-row streams); 64-token block-sparse runs two single-warpgroup streams, because each
// 64-row query tile has its own key-tile list.
#pragma once

#include <type_traits>

#include <cute/tensor.hpp>
#include <cute/arch/copy_sm90_tma.hpp>
#include <cute/atom/copy_traits_sm90_tma.hpp>
#include <cute/atom/mma_traits_sm90_gmma.hpp>
#include <cute/arch/mma_sm90.hpp>
#include <cutlass/numeric_types.h>

#include "fwd_config.h"
#include "fwd_tile.h"

namespace vidattn::cuda_sm90 {

// The compile-time shape of one named configuration (fwd_config.h) for one element type.
template <class Element_, FwdConfig kConfig_>
struct FwdTraits {
  using Element = Element_;  // cutlass::bfloat16_t or cutlass::half_t
  static constexpr FwdConfig kConfig = kConfig_;
  static constexpr int kHeadDim = kConfig.head_dim;   // q, k
  static constexpr int kHeadDimV = kConfig.width_v();  // v, out
  static constexpr int kBlockN = kConfig.block_n;
  static constexpr int kWGPerStream = kConfig.wg_per_stream;
  static constexpr int kStreams = kConfig.streams;
  static constexpr int kStagesK = kConfig.stages_k;
  static constexpr int kStagesV = kConfig.stages_v;
  static constexpr bool kHalfLoads = kConfig.half_loads;
  static constexpr bool kStreamItems = kConfig.schedule == Schedule::kStreamItems;
  static constexpr bool kFusedCombine = kConfig.fused_combine;
  static constexpr int kClusterM = kConfig.cluster_m;
  static constexpr bool kTmaStoreO = kConfig.tma_store_o;
  static_assert(!kTmaStoreO || (!kStreamItems && kClusterM == 1),
                "the TMA output store serves the dense single-CTA kernel");
  // Pairs only: at most 30 clusters of four fit an H200 at once (120 of its 132 SMs: the GPCs'
  // SM counts are not multiples of four), and with two or three K / V slots they ran 2-6%
  // slower than pairs; per working SM and clock they matched them (docs/perf-history.md, Hopper
  // v21 and "Clusters of four").
  static_assert(kClusterM == 1 || (kClusterM == 2 && !kStreamItems && !kHalfLoads),
                "multicast K / V serves the dense static schedule, in pairs");
  // The features of the configuration, by name (fwd_config.h says what each does), and the
  // shapes each of them needs.
  static constexpr bool kOneBlock = kConfig.one_block;
  static constexpr bool kSplitTail = kConfig.split_tail;
  static constexpr bool kPrefixLoads = kConfig.prefix_loads;
  static constexpr bool kRotatedWalk = kConfig.rotated_walk;
  static constexpr bool kUniformControl = kConfig.uniform_control;
  static constexpr bool kEarlyTileSetup = kConfig.early_tile_setup;
  static constexpr bool kPaddedHeadDim = kConfig.padded_head_dim;
  static_assert(!kPaddedHeadDim || (!kPrefixLoads && !kFusedCombine),
                "padded widths: the dense kernels (the prefix loads' descriptors and the "
                "combination assume D = Dv = the width)");
  static_assert(kHeadDimV == kHeadDim || (kPaddedHeadDim && kClusterM == 1 && !kHalfLoads),
                "a width of v's own: the dense single-CTA kernels of padded widths");
  static_assert(!kOneBlock || (kWGPerStream == 3 && kStagesK == 1 && kStagesV == 1),
                "one block per tile: the three-warpgroup tile with one K and one V slot");
  static_assert(!kSplitTail || (kWGPerStream == 3 && kStreams == 1 && !kStreamItems &&
                                kClusterM == 1 && kTmaStoreO),
                "split pieces: the dense three-warpgroup kernels on the static schedule");
  static constexpr int kLoadRows = kHalfLoads ? kBlockN / 2 : kBlockN;  // rows per TMA load
  static_assert(!kPrefixLoads || (kHalfLoads && kLoadRows == 64),
                "prefix loads: 64-token key tiles loaded one by one");
  static_assert(!kRotatedWalk || kStreamItems, "rotated walks: stream items");
  static constexpr int kBlockMStream = 64 * kWGPerStream;
  static constexpr int kBlockM = kBlockMStream * kStreams;  // query rows per CTA tile
  static constexpr int kConsumerWGs = kStreams * kWGPerStream;
  static constexpr int kThreads = 128 * (1 + kConsumerWGs);
  // setmaxnreg: the producer keeps a few, the consumers take the rest (64K per SM).
  // setmaxnreg only moves registers within the CTA's launch allocation (168 x 384 = 64512
  // here), not the SM's 65536: 32 for the producer warpgroup (the combining warps) with 240
  // for the consumers asked for 1024 more than exist, and the consumers' setmaxnreg.inc
  // waited forever (the H200 run of the fused kernel hung). 24 + 2 x 240 is exactly 64512.
  // kFusedCombine keeps 24 too: 40 for the producer warpgroup with 232 for the consumers
  // cleared its spills but added ~100 register moves to the consumers' loop, and the fused
  // kernel ran 3% slower (perf-history, Hopper v17).
  static constexpr int kProducerRegs = 24;
  // Without setmaxnreg the same consumer code spilled 504 bytes at the 168-register cap of
  // 9-12 warps; with it, none. Three consumer warpgroups (512 threads) get 160 each: at
  // D = 64 the main loop then spills ~11 values per key block and still wins on long key
  // loops (Dense64WideTraits, fwd_launch_impl.h).
  static constexpr int kConsumerRegs = kConsumerWGs == 2 ? 240 : 160;
  static constexpr bool kSpeculativeSoftmax = kConfig.speculation == Speculation::kOverlapped;
  static constexpr bool kSpeculateAfterPV = kConfig.speculation == Speculation::kAfterPV;
  // The overlapped speculation's second P (32 registers) made the three-warpgroup key loops
  // spill (160 registers; 1 -> 117 local accesses at D = 64: perf-history, Hopper v39); after
  // P V, in place, it fits them (dense D = 64 +15%, D = 128 at 257-512 keys +7-16%: v40).
  static_assert(!kSpeculativeSoftmax || kConsumerWGs == 2,
                "overlapped speculation: two consumer warpgroups of 240 registers");
  static_assert(!kSpeculateAfterPV || (kConsumerWGs == 3 && !kOneBlock),
                "speculation after P V: the three-warpgroup loop kernels");
  static_assert(kOneBlock == (kConfig.speculation == Speculation::kNone),
                "a tile of one key block has no earlier max to speculate on");
  // Widths of whole swizzle atoms (kAtomCols below).
  static_assert(kHeadDim % 32 == 0 && kHeadDimV % 32 == 0 && kBlockN % 16 == 0);
  static_assert(!kFusedCombine || (kStreamItems && kWGPerStream == 1 && kStreams <= 2),
                "the combining warps are warps 2 and 3 of the producer warpgroup");
  // Within the launch allocation: at most 168 per thread at launch (64K / 384 threads, in
  // steps of 8), and 3 x 128 threads with 160 fit the same budget.
  static_assert(kProducerRegs * 128 + kConsumerRegs * 128 * kConsumerWGs <=
                (65536 / kThreads) / 8 * 8 * kThreads);

  // K-major (head dim contiguous) tiles with the 128-byte swizzle atom (8 rows x 64 elements),
  // or, where a width is not a multiple of 64 (the 96-wide tile of head dims 72-96: a quarter
  // fewer products than padding them to 128), the 64-byte atom (8 rows x 32 elements). One
  // atom for every tile of the kernel, so that the tail zeroing and the output's stmatrix
  // addresses have one layout to follow.
  static constexpr int kAtomCols = (kHeadDim % 64 == 0 && kHeadDimV % 64 == 0) ? 64 : 32;
  using SmemAtom = std::conditional_t<kAtomCols == 64, cute::GMMA::Layout_K_SW128_Atom<Element>,
                                      cute::GMMA::Layout_K_SW64_Atom<Element>>;
  using SmemLayoutQ = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::Int<kBlockMStream>, cute::Int<kHeadDim>>{}));
  using SmemLayoutK = decltype(cute::tile_to_shape(
      SmemAtom{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDim>, cute::Int<kStagesK>>{}));
  using SmemLayoutV = decltype(cute::tile_to_shape(
      SmemAtom{},
      cute::Shape<cute::Int<kBlockN>, cute::Int<kHeadDimV>, cute::Int<kStagesV>>{}));
  // V seen as the B operand of O = P V: (head dim, keys), head dim contiguous (MN-major).
  // A view of the same bytes, not a second copy.
  using SmemLayoutVt = decltype(cute::composition(
      SmemLayoutV{},
      cute::make_ordered_layout(
          cute::Shape<cute::Int<kHeadDimV>, cute::Int<kBlockN>, cute::Int<kStagesV>>{},
          cute::Step<cute::_2, cute::_1, cute::_3>{})));

  // S = Q K^T from shared memory (SS); O += P V with P from registers (RS). One 64-row atom
  // per warpgroup of the stream.
  using WGLayout = cute::Layout<cute::Shape<cute::Int<kWGPerStream>, cute::_1, cute::_1>>;
  using MmaQK = decltype(cute::make_tiled_mma(
      cute::GMMA::ss_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockMStream>, cute::Int<kBlockN>,
                                             cute::Int<kHeadDim>>>(),
      WGLayout{}));
  using MmaPV = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::Int<kBlockMStream>, cute::Int<kHeadDimV>,
                                             cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>(),
      WGLayout{}));

  // Global tensors as TMA sees them: (rows, head dim, heads, batch), 64-bit strides. A padded
  // instance's head dim is the tensor's own (at most kHeadDim), known at run time.
  using GmemCols = std::conditional_t<kPaddedHeadDim, int32_t, cute::Int<kHeadDim>>;
  using GmemLayout =
      cute::Layout<cute::Shape<int32_t, GmemCols, int32_t, int32_t>,
                   cute::Stride<int64_t, cute::_1, int64_t, int64_t>>;
  using GmemTensor = decltype(cute::make_tensor(
      cute::make_gmem_ptr(static_cast<Element const*>(nullptr)), GmemLayout{}));
  using TmaQ = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                            SmemLayoutQ{}));
  // What one K / V load fills: a whole slot, or its first kLoadRows rows (the second half is
  // the same layout shifted by whole swizzle periods).
  using SmemLayoutKVLoad = decltype(cute::composition(
      cute::take<0, 2>(SmemLayoutK{}),
      cute::Layout<cute::Shape<cute::Int<kLoadRows>, cute::Int<kHeadDim>>,
                   cute::Stride<cute::_1, cute::Int<kBlockN>>>{}));
  using TmaKVOp = std::conditional_t<kClusterM == 1, cute::SM90_TMA_LOAD,
                                     cute::SM90_TMA_LOAD_MULTICAST>;
  using TmaKV = decltype(cute::make_tma_copy(TmaKVOp{}, GmemTensor{}, SmemLayoutKVLoad{},
                                             cute::Int<kClusterM>{}));
  // V's load, of its own width (the same type as K's when kHeadDimV == kHeadDim).
  using SmemLayoutVLoad = decltype(cute::composition(
      cute::take<0, 2>(SmemLayoutV{}),
      cute::Layout<cute::Shape<cute::Int<kLoadRows>, cute::Int<kHeadDimV>>,
                   cute::Stride<cute::_1, cute::Int<kBlockN>>>{}));
  using TmaV = decltype(cute::make_tma_copy(TmaKVOp{}, GmemTensor{}, SmemLayoutVLoad{},
                                            cute::Int<kClusterM>{}));
  // kSplitTail: a 64-row piece of Q loaded into each warpgroup's 64-row slice of the Q slot
  // (the slices' 64-column chunks lie kBlockMStream * 64 elements apart).
  using SmemLayoutQPiece = decltype(cute::composition(
      SmemLayoutQ{}, cute::Layout<cute::Shape<cute::_64, cute::Int<kHeadDim>>,
                                  cute::Stride<cute::_1, cute::Int<kBlockMStream>>>{}));
  using TmaQPiece = decltype(cute::make_tma_copy(cute::SM90_TMA_LOAD{}, GmemTensor{},
                                                 SmemLayoutQPiece{}));
  // A slot's rows lie kAtomCols elements apart within a chunk of kAtomCols columns, and its
  // chunks kBlockN * kAtomCols elements apart (whole swizzle atoms down the rows first): the
  // offsets the prefix loads write to (fwd_prefix_loads.h, 64-column chunks).
  static_assert(!kPrefixLoads || kAtomCols == 64);
  static_assert(SmemLayoutK{}(cute::make_coord(16, 0, 0)) == 16 * kAtomCols);
  static_assert(kHeadDim == kAtomCols ||
                SmemLayoutK{}(cute::make_coord(0, kAtomCols, 0)) == kBlockN * kAtomCols);
  // The same for V, whose tail rows the consumers zero by address (zero_v_tail_rows).
  static_assert(SmemLayoutV{}(cute::make_coord(16, 0, 0)) == 16 * kAtomCols &&
                (kHeadDimV == kAtomCols ||
                 SmemLayoutV{}(cute::make_coord(0, kAtomCols, 0)) == kBlockN * kAtomCols) &&
                SmemLayoutV{}(cute::make_coord(0, 0, kStagesV - 1)) ==
                    (kStagesV - 1) * kBlockN * kHeadDimV);
  // O staged for the TMA store: one 64-row slot per warpgroup of the stream.
  using SmemLayoutO = decltype(cute::tile_to_shape(
      SmemAtom{}, cute::Shape<cute::_64, cute::Int<kHeadDimV>, cute::Int<kWGPerStream>>{}));
  // 128-byte swizzle of byte addresses (bits 4-6 ^= bits 7-9), or 64-byte (bits 4-5 ^= bits
  // 7-8); before it, kAtomCols elements per row, the column chunks 64 x kAtomCols apart, the
  // warpgroups' slots 64 x D apart. The epilogue's stmatrix addresses (fwd_output_stsm.h)
  // rely on it.
  static_assert(std::is_same_v<decltype(SmemLayoutO{}.layout_a()),
                               std::conditional_t<kAtomCols == 64, cute::Swizzle<3, 4, 3>,
                                                  cute::Swizzle<2, 4, 3>>> &&
                sizeof(Element) == 2);
  static_assert(SmemLayoutO{}.layout_b()(cute::make_coord(1, 0, 0)) == kAtomCols &&
                SmemLayoutO{}.layout_b()(cute::make_coord(8, 0, 0)) == 8 * kAtomCols &&
                SmemLayoutO{}.layout_b()(cute::make_coord(0, 1, 0)) == 1 &&
                SmemLayoutO{}.layout_b()(cute::make_coord(0, kHeadDimV - 1, 0)) ==
                    (kHeadDimV - 1) / kAtomCols * 64 * kAtomCols +
                        (kHeadDimV - 1) % kAtomCols &&
                SmemLayoutO{}.layout_b()(cute::make_coord(0, 0, kWGPerStream - 1)) ==
                    (kWGPerStream - 1) * 64 * kHeadDimV);
  using SmemLayoutOStore = decltype(cute::take<0, 2>(SmemLayoutO{}));
  using TmaO = decltype(cute::make_tma_copy(cute::SM90_TMA_STORE{}, GmemTensor{},
                                            SmemLayoutOStore{}));
  // The copy atom from the accumulator's layout (one warpgroup's) into shared memory.
  using MmaPVOneWG = decltype(cute::make_tiled_mma(
      cute::GMMA::rs_op_selector<Element, Element, float,
                                 cute::Shape<cute::_64, cute::Int<kHeadDimV>, cute::Int<kBlockN>>,
                                 cute::GMMA::Major::K, cute::GMMA::Major::MN>()));
  static constexpr uint32_t kQBytes = kBlockMStream * kHeadDim * sizeof(Element);
  static constexpr uint32_t kKBytes = kBlockN * kHeadDim * sizeof(Element);  // per slot
  static constexpr uint32_t kVBytes = kBlockN * kHeadDimV * sizeof(Element);

  // One stream's tiles and barriers. 1024-byte alignment: the swizzle pattern repeats every
  // 1024 bytes and TMA and wgmma must agree on where it starts.
  struct StreamStorage {
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutQ>, 1024> q;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutK>, 1024> k;
    cute::array_aligned<Element, cute::cosize_v<SmemLayoutV>, 1024> v;
    uint64_t q_full, q_empty;
    uint64_t k_full[kStagesK], k_empty[kStagesK];
    uint64_t v_full[kStagesV], v_empty[kStagesV];
    // Keys of the block in each K slot, per load (policies that record it).
    int block_valid[kStagesK][2];
    // The stream's query tiles as the producer decoded them (slot: its schedule slot or
    // stream item, -1 when there are no more; blocks: its key-block count), written before it
    // arrives on q_full (kEarlyTileSetup: on tile_full). Two, by Q's phase: the consumers read
    // a tile's record until its epilogue, after the producer may have published the next tile.
    StreamTile tile[2];
    int tile_slot[2], tile_blocks[2];
    // kFusedCombine: the tile whose output the consumers have written (-1: no more), handed
    // to the stream's combining warp (o_ready: the consumers' stores done; o_free: the item
    // read, so the next may be written).
    uint64_t o_ready, o_free;
    int done_item;
    // kEarlyTileSetup: the tile record is written (the producer's plain arrive; phases as
    // q_full's). Here, in what was padding, so that the other kernels keep their layout.
    uint64_t tile_full;
    // kTmaStoreO: the output rows on their way to the TMA store (last, so that the kernels
    // without it keep their layout).
    struct NoO {};
    std::conditional_t<kTmaStoreO,
                       cute::array_aligned<Element, cute::cosize_v<SmemLayoutO>, 1024>, NoO>
        o;
  };
  struct SharedStorage {
    StreamStorage stream[kStreams];
  };
  static constexpr int kSmemBytes = int(sizeof(SharedStorage)) + 1024;  // + manual alignment
};

}  // namespace vidattn::cuda_sm90
