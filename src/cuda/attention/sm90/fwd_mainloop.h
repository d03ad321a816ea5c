// Mainloop of the sm_90a forward, warp-specialised:
//  * producer: one thread per stream issues the TMA loads of Q and of each visited K / V
//    block into rings of kStagesK / kStagesV slots (a block is one load, or two of half its
//    rows from two places: kHalfLoads); full barriers count the bytes landed (expect_tx),
//    empty barriers the consumer threads that are done reading a slot. In a cluster
//    (kClusterM > 1) each producer loads its share of every block into all the cluster's
//    CTAs, and a slot is free once every CTA's consumer warps have said so.
//  * consumers: each warpgroup owns 64 query rows. Per key block: S = Q K^T (wgmma SS), mask
//    (only blocks that need it), online softmax, O += P V (wgmma RS, P straight from
//    registers). The softmax of block i overlaps the P V product of block i - 1: the QK^T
//    product of block i and the PV product of block i - 1 are issued back to back, the
//    softmax waits only for the first (wgmma.wait_group 1).
// The key-visit policy (DenseVisit / SparseVisit, key_visit.h) is the only difference
// between dense and block-sparse.
#pragma once

#include <cute/tensor.hpp>
#include <cute/arch/cluster_sm90.hpp>
#include <cutlass/arch/barrier.h>

#include "fwd_epilogue.h"
#include "kernel_utils.h"
#include "fwd_kernel_params.h"
#include "key_visit.h"
#include "fwd_softmax.h"
#include "fwd_tile.h"

namespace vidattn::cuda_sm90 {

template <class Traits>
__device__ __forceinline__ StreamTile stream_tile(const FwdKernelParams<Traits>& p, int slot,
                                                  int stream) {
  TileCoord c;
  if constexpr (Traits::kSplitTail) c = p.split.decode(p.sched, slot);
  else c = p.sched.decode(slot);
  StreamTile t;
  t.piece = c.piece;
  if (!c.valid) {
    t.active = false;
    return t;
  }
  t.seq = cuda_common::sequence_of(p.attn, c.batch);
  t.q0 = static_cast<std::int64_t>(c.m_block) * Traits::kBlockM +
         (c.piece >= 0 ? 64 * c.piece : stream * Traits::kBlockMStream);
  t.head = c.head;
  t.batch = c.batch;
  t.active = t.q0 < t.seq.len_q;
  return t;
}

// The tile of a stream item (Traits::kStreamItems): its own query tile, whichever stream
// takes it.
template <class Traits>
__device__ __forceinline__ StreamTile stream_item(const FwdKernelParams<Traits>& p, int item) {
  const TileCoord c = p.items.decode(item);
  StreamTile t;
  t.piece = -1;
  t.seq = cuda_common::sequence_of(p.attn, c.batch);
  t.q0 = static_cast<std::int64_t>(c.m_block) * Traits::kBlockMStream;
  t.head = c.head;
  t.batch = c.batch;
  t.active = c.valid && t.q0 < t.seq.len_q;
  return t;
}

// The tile of `slot`: a stream item (Traits::kStreamItems) or a slot of the static schedule.
template <class Traits>
__device__ __forceinline__ StreamTile tile_of_slot(const FwdKernelParams<Traits>& p, int slot,
                                                   int stream) {
  if constexpr (Traits::kStreamItems) return stream_item(p, slot);
  else return stream_tile<Traits>(p, slot, stream);
}

// `second` where kSecond, else `first`: a compile-time choice between two register operands
// (kept as fixed registers, which a runtime index would not be).
template <bool kSecond, class First, class Second>
__device__ __forceinline__ auto& pick_operand(First& first, Second& second) {
  if constexpr (kSecond) return second;
  else return first;
}

template <class Traits, class Visit>
__device__ __forceinline__ void producer_loop(const FwdKernelParams<Traits>& p,
                                              typename Traits::StreamStorage& st, int stream) {
  using namespace cute;
  constexpr int D = Traits::kHeadDim, DV = Traits::kHeadDimV, BM = Traits::kBlockMStream;
  Tensor sQ = make_tensor(make_smem_ptr(st.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(st.k.data()), typename Traits::SmemLayoutK{});
  Tensor sV = make_tensor(make_smem_ptr(st.v.data()), typename Traits::SmemLayoutV{});
  Tensor mQ = p.tma_q.get_tma_tensor(make_shape(p.q_rows, Int<D>{}, p.attn.heads_q, p.tma_batch));
  Tensor mK = p.tma_k.get_tma_tensor(make_shape(p.kv_rows, Int<D>{}, p.attn.heads_kv, p.tma_batch));
  Tensor mV = p.tma_v.get_tma_tensor(make_shape(p.kv_rows, Int<DV>{}, p.attn.heads_kv, p.tma_batch));
  auto cta_q = p.tma_q.get_slice(_0{});
  // kClusterM > 1: this CTA's share of each K / V block, multicast to the whole cluster.
  auto kv_slice = [](auto const& tma) {
    if constexpr (Traits::kClusterM > 1) return tma.get_slice(cute::block_rank_in_cluster());
    else return tma.get_slice(_0{});
  };
  auto cta_k = kv_slice(p.tma_k);
  auto cta_v = kv_slice(p.tma_v);
  constexpr uint16_t kClusterMask = (1u << Traits::kClusterM) - 1;
  // One block into slot `slot` of sX: one load, or two half loads (rows kb.start and
  // kb.start_hi of the sequence). kPrefixLoads: a key tile with fewer valid keys than rows
  // loads only its prefix (`prefix_map`: K's or V's 16-row descriptor).
  // cols: the tensor's tile width (Int<D> for K, Int<DV> for V).
  auto load_block = [&](auto const& tma, auto const& cta, auto const& mX, auto sX_slot,
                        uint64_t* full, const KeyBlock& kb, int k_base, int hk, int tb,
                        const cute::TmaDescriptor* prefix_map, auto cols) {
    using Cols = decltype(cols);
    constexpr int R = Traits::kLoadRows;
    CUTE_UNROLL
    for (int h = 0; h < (Traits::kHalfLoads ? 2 : 1); ++h) {
      const int row = k_base + static_cast<int>(h == 0 ? kb.start : kb.start_hi);
      if constexpr (Traits::kPrefixLoads) {
        const int rows = PrefixLoadMaps::rows_of<R>(h == 0 ? kb.valid : kb.valid_hi);
        if (rows < R && p.prefix.enabled) {
          // The slot's 64-column chunks lie kBlockN * 64 elements apart (K-major, swizzled).
          load_key_rows<D>(prefix_map, full, raw_pointer_cast(&sX_slot(R * h, 0)),
                           Traits::kBlockN * 64, rows, row, hk, tb);
          continue;
        }
      }
      Tensor gX = local_tile(domain_offset(make_coord(row, _0{}), mX(_, _, hk, tb)),
                             Shape<Int<R>, Cols>{}, make_coord(_0{}, _0{}));
      Tensor sX = local_tile(sX_slot, Shape<Int<R>, Cols>{}, make_coord(h, _0{}));
      if constexpr (Traits::kClusterM > 1)
        copy(tma.with(*full, kClusterMask), cta.partition_S(gX), cta.partition_D(sX));
      else
        copy(tma.with(*full), cta.partition_S(gX), cta.partition_D(sX));
    }
  };
  const cute::TmaDescriptor* prefix_map_k = nullptr;
  const cute::TmaDescriptor* prefix_map_v = nullptr;
  if constexpr (Traits::kPrefixLoads) prefix_map_k = &p.prefix.k, prefix_map_v = &p.prefix.v;
  RingState<Traits::kStagesK> k_ring;
  RingState<Traits::kStagesV> v_ring;
  uint32_t q_phase = 0;
  // Static schedule: the slots of this CTA. Stream items: taken one at a time, each once the
  // previous tile's loads are issued, so the atomic's latency passes while the consumers
  // finish that tile and no stream holds an item it cannot start soon.
  for (int slot = blockIdx.x;; slot += gridDim.x) {
    if constexpr (Traits::kStreamItems) {
      slot = p.items.take();
      if (slot < 0) break;
    } else if (slot >= p.sched.slots_end) {
      break;
    }
    // Assigned, not initialised: ptxas reorders the producer's setup for the other form,
    // which measured slower (docs/perf-history.md, Hopper v16).
    StreamTile t;
    t = tile_of_slot(p, slot, stream);
    if (!t.active) continue;
    // Varlen: sequences are row ranges of one [T, H, D] view (batch extent 1).
    const int tb = p.attn.varlen ? 0 : t.batch;
    const int q_base = static_cast<int>(p.attn.varlen ? t.seq.first_q : 0);
    const int k_base = static_cast<int>(p.attn.varlen ? t.seq.first_k : 0);
    const int hk = t.head / p.attn.group;
    const Visit visit(p.attn, p.sparse, t.seq, t.head, t.q0, BM);
    const int n = visit.num_blocks();

    Barrier::wait(&st.q_empty, q_phase ^ 1u);
    // The tile as decoded here, published by the arrive below (release; kEarlyTileSetup: on
    // tile_full, before Q lands) and the consumers' wait (acquire): they read it instead of
    // decoding the slot themselves.
    st.tile[q_phase] = t;
    st.tile_slot[q_phase] = slot;
    st.tile_blocks[q_phase] = n;
    if constexpr (Traits::kEarlyTileSetup) Barrier::arrive(&st.tile_full);
    Barrier::arrive_and_expect_tx(&st.q_full, Traits::kQBytes);
    bool q_loaded = false;
    if constexpr (Traits::kSplitTail) {
      if (t.piece >= 0) {
        // A split piece: its 64 rows into every warpgroup's slice (the same bytes in all).
        auto cta_piece = p.tma_q_piece.get_slice(_0{});
        Tensor mQp = p.tma_q_piece.get_tma_tensor(
            make_shape(p.q_rows, Int<D>{}, p.attn.heads_q, p.tma_batch));
        Tensor gQp = local_tile(domain_offset(make_coord(q_base + static_cast<int>(t.q0), _0{}),
                                              mQp(_, _, t.head, tb)),
                                Shape<_64, Int<D>>{}, make_coord(_0{}, _0{}));
        CUTE_UNROLL
        for (int w = 0; w < Traits::kWGPerStream; ++w)
          copy(p.tma_q_piece.with(st.q_full), cta_piece.partition_S(gQp),
               cta_piece.partition_D(local_tile(sQ, Shape<_64, Int<D>>{}, make_coord(w, _0{}))));
        q_loaded = true;
      }
    }
    if (!q_loaded) {
      Tensor gQ = local_tile(domain_offset(make_coord(q_base + static_cast<int>(t.q0), _0{}),
                                           mQ(_, _, t.head, tb)),
                             Shape<Int<BM>, Int<D>>{}, make_coord(_0{}, _0{}));
      copy(p.tma_q.with(st.q_full), cta_q.partition_S(gQ), cta_q.partition_D(sQ));
    }
    q_phase ^= 1u;

    // K of block i waits for the consumers to finish S of block i - kStagesK; V of block i
    // for P V of block i - kStagesV (a block later than its S). kRotatedWalk: the blocks
    // from first_block on, wrapping (the consumers take each block's record from the
    // producer, so only this loop knows the order).
    static_assert(!Traits::kRotatedWalk || Visit::kProducerRecordsBlocks,
                  "a rotated walk needs the consumers to read the producer's block records");
    int first = 0;
    if constexpr (Traits::kRotatedWalk) first = p.items.first_block(slot, n);
    for (int i = 0; i < n; ++i) {
      int b = i + first;
      if (b >= n) b -= n;
      const KeyBlock kb = visit.block(b);
      // The bytes the block's loads complete: a whole slot, or its prefixes (kPrefixLoads).
      uint32_t k_bytes = Traits::kKBytes, v_bytes = Traits::kVBytes;
      if constexpr (Traits::kPrefixLoads) {
        constexpr int R = Traits::kLoadRows;
        if (p.prefix.enabled) {
          int rows = PrefixLoadMaps::rows_of<R>(kb.valid);
          if constexpr (Traits::kHalfLoads) rows += PrefixLoadMaps::rows_of<R>(kb.valid_hi);
          k_bytes = v_bytes = rows * D * sizeof(typename Traits::Element);
        }
      }
      Barrier::wait(&st.k_empty[k_ring.stage], k_ring.phase ^ 1u);
      // Published to the consumers by the arrive below (release) and their wait (acquire).
      if constexpr (Visit::kProducerRecordsBlocks) {
        st.block_valid[k_ring.stage][0] = kb.valid;
        st.block_valid[k_ring.stage][1] = kb.valid_hi;
      }
      Barrier::arrive_and_expect_tx(&st.k_full[k_ring.stage], k_bytes);
      load_block(p.tma_k, cta_k, mK, sK(_, _, k_ring.stage), &st.k_full[k_ring.stage], kb,
                 k_base, hk, tb, prefix_map_k, Int<D>{});
      k_ring.advance();
      Barrier::wait(&st.v_empty[v_ring.stage], v_ring.phase ^ 1u);
      Barrier::arrive_and_expect_tx(&st.v_full[v_ring.stage], v_bytes);
      load_block(p.tma_v, cta_v, mV, sV(_, _, v_ring.stage), &st.v_full[v_ring.stage], kb,
                 k_base, hk, tb, prefix_map_v, Int<DV>{});
      v_ring.advance();
    }
  }
  // No more tiles: a record of slot -1 (with an empty Q, a plain arrive) ends the consumers'
  // loop.
  Barrier::wait(&st.q_empty, q_phase ^ 1u);
  st.tile_slot[q_phase] = -1;
  Barrier::arrive(Traits::kEarlyTileSetup ? &st.tile_full : &st.q_full);
  if constexpr (Traits::kClusterM > 1) {
    // The other CTAs' consumers free this CTA's slots remotely: wait until every slot is
    // free, so the CTA (and its barriers) outlives their last arrivals.
    for (int i = 0; i < Traits::kStagesK; ++i, k_ring.advance())
      Barrier::wait(&st.k_empty[k_ring.stage], k_ring.phase ^ 1u);
    for (int i = 0; i < Traits::kStagesV; ++i, v_ring.advance())
      Barrier::wait(&st.v_empty[v_ring.stage], v_ring.phase ^ 1u);
  }
}

// Ping-pong between the warpgroups of a stream: each issues its products only in its turn
// (named barrier 8 + its index) and then hands the turn to the next one, so that one
// warpgroup's softmax runs while another's products keep the tensor cores busy. All
// warpgroups of a stream issue the same number of product batches per tile (n + 1), so the
// turns stay in step across the persistent tiles; the last warpgroup grants the first turn
// once, at start. Each barrier has 256 participants: its owner (sync) and its predecessor
// (arrive).
struct PingPong {
  bool on;
  int self_bar, next_bar;
  __device__ __forceinline__ PingPong(int wg, int wgs, int stream) {
    on = wgs > 1;
    const int base = 8 + stream * wgs;
    self_bar = base + wg;
    next_bar = base + (wg + 1 == wgs ? 0 : wg + 1);
    if (on && wg == wgs - 1) arrive(base);
  }
  static __device__ __forceinline__ void arrive(int bar) {
    asm volatile("bar.arrive %0, 256;\n" ::"r"(bar) : "memory");
  }
  __device__ __forceinline__ void wait_turn() const {
    if (on) asm volatile("bar.sync %0, 256;\n" ::"r"(self_bar) : "memory");
  }
  __device__ __forceinline__ void pass_turn() const {
    if (on) arrive(next_bar);
  }
};

// Zeros the rows of V slot `stage` past a block's valid keys (rows [valid, kBlockN), or with
// halves [valid, kBlockN / 2) and [kBlockN / 2 + valid_hi, kBlockN)), then makes the stores
// visible to wgmma and waits for the `threads` threads that share the slot's product (named
// barrier `bar`); t: the thread's index among them. See tail_rows_need_zeros (key_visit.h).
// Not inlined: the call is taken only for a partial block, and inlined its address arithmetic
// took registers in the loops around it (the three-warpgroup split loop 628 -> 816
// instructions with 3 local accesses; as a call, 646 and none).
// The addresses are written out (slot_piece_offset, fwd_output_stsm.h) rather than taken from
// the cute layout, whose swizzle costs registers where O is live (fwd_traits.h asserts the
// layout).
template <class Traits, bool kHalves>
__device__ __noinline__ void zero_v_tail_rows(typename Traits::Element* v, int stage, int valid,
                                              int valid_hi, int t, int threads, int bar) {
  constexpr int kChunks = Traits::kHeadDimV / 8;  // 16-byte pieces per row
  constexpr int kRows = Traits::kBlockN, kHalf = kHalves ? kRows / 2 : kRows;
  const int n0 = kHalf - valid;
  const int n1 = kHalves ? kHalf - valid_hi : 0;
  char* slot = reinterpret_cast<char*>(v) + stage * (kRows * Traits::kHeadDimV * 2);
  for (int i = t; i < (n0 + n1) * kChunks; i += threads) {
    const int k = i / kChunks, j = i % kChunks;
    const int r = k < n0 ? valid + k : kHalf + valid_hi + (k - n0);
    char* piece = slot + slot_piece_offset<Traits::kAtomCols, kRows>(r, j);
    *reinterpret_cast<uint4*>(piece) = make_uint4(0u, 0u, 0u, 0u);
  }
  cutlass::arch::fence_view_async_shared();
  named_barrier_sync(bar, threads);
}

// Named barriers of the consumers (0 is __syncthreads): 2 the split pieces' combination,
// 4 + warpgroup the output store and a split piece's V zeros (one warpgroup each), 8 and up
// the warpgroups' turns (PingPong), 14 + stream a stream's V zeros (its warpgroups).
constexpr int kBarStreamZeros = 14;

// tid: the thread's index among the stream's consumer threads.
template <class Traits, class Visit>
__device__ __forceinline__ void consumer_loop(const FwdKernelParams<Traits>& p,
                                              typename Traits::StreamStorage& st, int stream,
                                              int tid) {
  using namespace cute;
  using Element = typename Traits::Element;
  constexpr int DV = Traits::kHeadDimV, BM = Traits::kBlockMStream, BN = Traits::kBlockN;
  typename Traits::MmaQK mma_qk;
  typename Traits::MmaPV mma_pv;
  // The thread's warpgroup, warp-uniform to the compiler: the shared-memory descriptors of
  // Q, K and V (the same for every thread of a warpgroup) then live in uniform registers,
  // computed there, instead of in ~16 ordinary registers per operand with two R2UR moves per
  // descriptor before each wgmma (the ring slots likewise: k_slot / v_slot below).
  const int wg = warp_uniform(tid / 128);
  auto thr_qk = mma_qk.get_thread_slice(tid);
  auto thr_pv = mma_pv.get_thread_slice(tid);
  auto wg_qk = mma_qk.get_thread_slice(wg * 128);  // operand descriptors: per warpgroup
  auto wg_pv = mma_pv.get_thread_slice(wg * 128);
  Tensor sQ = make_tensor(make_smem_ptr(st.q.data()), typename Traits::SmemLayoutQ{});
  Tensor sK = make_tensor(make_smem_ptr(st.k.data()), typename Traits::SmemLayoutK{});
  Tensor sVt = make_tensor(make_smem_ptr(st.v.data()), typename Traits::SmemLayoutVt{});
  // A block's tail rows as the V zeros need them: valid | valid_hi << 16, or -1 when the block
  // needs none.
  auto v_tail = [&](const KeyBlock& b) {
    return tail_rows_need_zeros<Visit>(p.attn, b.valid, b.valid_hi) ? b.valid | b.valid_hi << 16
                                                                     : -1;
  };
  // Zeros block `tail`'s V rows in slot `stage` with the stream's warpgroups (all of them run
  // every block's P V).
  auto zero_v_tail = [&](int stage, int tail) {
    if (tail >= 0)
      zero_v_tail_rows<Traits, Visit::kHalves>(st.v.data(), stage, tail & 0xffff, tail >> 16,
                                               tid, 128 * Traits::kWGPerStream,
                                               kBarStreamZeros + stream);
  };
  Tensor tSrQ = wg_qk.partition_fragment_A(sQ);   // smem descriptors
  Tensor tSrK = wg_qk.partition_fragment_B(sK);   // (mma, n, k, stage)
  Tensor tOrV = wg_pv.partition_fragment_B(sVt);  // (mma, d, keys, stage)
  // The descriptors of ring slot `stage`, its index made warp-uniform (the ring position is
  // loop-carried and the compiler keeps it per thread; perf-history, Hopper v34).
  auto k_slot = [&](int stage) { return tSrK(_, _, _, warp_uniform(stage)); };
  auto v_slot = [&](int stage) { return tOrV(_, _, _, warp_uniform(stage)); };
  Tensor tSrS = partition_fragment_C(mma_qk, Shape<Int<BM>, Int<BN>>{});
  Tensor tOrO = partition_fragment_C(mma_pv, Shape<Int<BM>, Int<DV>>{});
  // P as the A operand of the RS product: value order of the accumulator, k-blocks of 16.
  using PLayout = Layout<Shape<Shape<_2, _2, _2>, _1, Int<BN / 16>>>;
  Tensor tOrP = make_tensor<Element>(PLayout{});
  static_assert(decltype(size(tSrS))::value == decltype(size(tOrP))::value);
  Tensor tScS = thr_qk.partition_C(make_identity_tensor(Shape<Int<BM>, Int<BN>>{}));
  Tensor tOcO = thr_pv.partition_C(make_identity_tensor(Shape<Int<BM>, Int<DV>>{}));
  Tensor tOrP32 = recast<uint32_t>(tOrP);
  // kAltP (the speculating two-warpgroup kernels): a second P operand. Key blocks alternate
  // between the two, so that a block's speculated P is written straight into the operand its
  // P V product reads while the previous block's product still reads the other one (no 32-word
  // copy per block; perf-history, Hopper v41). The key loops run in pairs of blocks so that each step's
  // operands are fixed registers; a loop of an odd number of steps moves P back once.
  constexpr bool kAltP = Traits::kSpeculativeSoftmax;
  Tensor tOrPAlt = make_tensor<Element>(PLayout{});  // never read where !kAltP (dead code)
  Tensor tOrPAlt32 = recast<uint32_t>(tOrPAlt);
  constexpr int kPWords = decltype(size(tOrP32))::value;
  auto convert_p = [&](auto& p32) {
    CUTE_UNROLL
    for (int i = 0; i < kPWords; ++i) p32(i) = pack_pair<Element>(tSrS(2 * i), tSrS(2 * i + 1));
  };
  // The second operand's P into the first (after a loop of an odd number of steps). `| zero`: a
  // plain copy lets ptxas forward the source registers into the next product (see zero).
  auto move_alt_p = [&]() {
    if constexpr (kAltP) {
      CUTE_UNROLL
      for (int k = 0; k < kPWords; ++k) tOrP32(k) = tOrPAlt32(k) | p.zero;
    }
  };

  const PingPong turns(wg, Traits::kWGPerStream, stream);
  // Frees a K / V slot. kClusterM > 1: every CTA of the cluster loads into it, so lane c of
  // each warp tells CTA c (after wgmma.wait_group, which the warp runs converged).
  auto release = [&](uint64_t* empty) {
    if constexpr (Traits::kClusterM == 1) {
      Barrier::arrive(empty);
    } else {
      const uint32_t lane = tid % 32;
      Barrier::arrive(empty, lane < Traits::kClusterM ? lane : 0, lane < Traits::kClusterM);
    }
  };
  RingState<Traits::kStagesK> ring;  // K of the block whose S is next
  // V of the same block: with as many V slots as K slots it is the K position itself (one
  // register pair fewer through the loop).
  constexpr bool kOneRing = Traits::kStagesK == Traits::kStagesV;
  RingState<Traits::kStagesV> v_ring_own;
  auto v_ring = [&]() -> RingState<Traits::kStagesV> {
    if constexpr (kOneRing) return ring; else return v_ring_own;
  };
  auto advance_rings = [&]() {
    ring.advance();
    if constexpr (!kOneRing) v_ring_own.advance();
  };
  uint32_t q_phase = 0;
  // kFusedCombine: hands the tile just written (or -1 at the end) to the stream's combining
  // warp, once it has taken the previous one. Each thread arrives after its own stores.
  uint32_t o_phase = 0;
  auto hand_over = [&](int item) {
    if constexpr (Traits::kFusedCombine) {
      Barrier::wait(&st.o_free, o_phase ^ 1u);
      o_phase ^= 1u;
      if (tid == 0) st.done_item = item;
      Barrier::arrive(&st.o_ready);
    }
  };
  // Each tile as the producer decoded it, published with its Q or, kEarlyTileSetup, before it;
  // slot -1: no more. The record stays readable until this tile's epilogue: the producer
  // writes the other one next. Its loop-steering values warp-uniform where that pays
  // (Traits::kUniformControl).
  auto control = [](int x) {
    if constexpr (Traits::kUniformControl) return warp_uniform(x);
    else return x;
  };
  for (;;) {
    Barrier::wait(Traits::kEarlyTileSetup ? &st.tile_full : &st.q_full, q_phase);
    const uint32_t record = q_phase;
    if constexpr (!Traits::kEarlyTileSetup) q_phase ^= 1u;
    const int slot = control(st.tile_slot[record]);
    if (slot < 0) break;
    StreamTile t = st.tile[record];
    if constexpr (Traits::kSplitTail) t.piece = control(t.piece);
    Visit visit(p.attn, p.sparse, t.seq, t.head, t.q0, BM);
    const int n = control(st.tile_blocks[record]);
    // Block-sparse: the end of the stream's query tile's valid slots (a stream's rows lie in
    // one tile); loaded now, read by the epilogue.
    auto query_row_limit = [&]() {
      std::int64_t limit = INT64_MAX;
      if (p.attn.q_block_sizes) {
        const std::int64_t tile = t.q0 / p.attn.tile_volume;
        limit = tile * p.attn.tile_volume +
                __ldg(p.attn.q_block_sizes + tile * p.attn.q_block_sizes_stride);
      }
      return limit;
    };
    std::int64_t row_limit = query_row_limit();
    OnlineSoftmax softmax(p.attn.scale);
    float alpha[2];
    // The normalised output of tOrO, as the 64 rows from q0 + 64 rows_wg: by TMA from shared memory
    // (Traits::kTmaStoreO), or each thread's own stores (the other configurations, and a
    // varlen sequence that ends inside those rows).
    auto write_output = [&](int rows_wg) __attribute__((always_inline)) {
      bool stored = false;
      if constexpr (Traits::kTmaStoreO) {
        if (!p.attn.varlen || t.q0 + 64 * (rows_wg + 1) <= t.seq.len_q) {
          write_output_by_tma<Traits>(p, st, t.seq, t.head, p.attn.varlen ? 0 : t.batch, t.q0,
                                      tOrO, tOcO, softmax, row_limit, rows_wg, tid % 128);
          stored = true;
        }
      }
      if (!stored)
        write_output_octets<Element, Traits::kPaddedHeadDim>(p.attn, t.seq, t.head, t.q0, tOrO,
                                                             tOcO, softmax, row_limit);
    };

    // The key block of ring slot `stage`, whose K has landed: the producer's record of it
    // where the policy reads the index (no global load in this loop), else the policy.
    auto landed_block = [&](int i, int stage) {
      if constexpr (Visit::kProducerRecordsBlocks) {
        KeyBlock b;
        b.valid = st.block_valid[stage][0];
        b.valid_hi = st.block_valid[stage][1];
        b.needs_mask = Visit::needs_mask(b.valid, b.valid_hi);
        return b;
      } else {
        KeyBlock b = visit.block(i);
        if constexpr (Visit::kKeyFlags) b.key_flags = visit.lane_key_flags(b.start);
        return b;
      }
    };
    if constexpr (Traits::kEarlyTileSetup) {
      Barrier::wait(&st.q_full, q_phase);  // the tile's Q has landed
      q_phase ^= 1u;
    }
    if constexpr (Traits::kSplitTail) {
      if (t.piece >= 0) {
        // A split piece: every warpgroup holds the same 64 query rows and takes every third
        // key block; the others' blocks it only frees once they have landed (a slot's empty
        // barrier counts every consumer thread, in the ring's order). Each block runs S,
        // softmax, P V in turn: the three warpgroups keep the tensor cores busy between them.
        bool first = true;
        // kOneBlock: at most one block (a constant trip count, so that no accumulator is live
        // across iterations).
        for (int i = 0; i < (Traits::kOneBlock ? 1 : n); ++i) {
          if (Traits::kOneBlock && i >= n) break;
          const RingState<Traits::kStagesV> vs = v_ring();
          Barrier::wait(&st.k_full[ring.stage], ring.phase);
          if (i % Traits::kWGPerStream != wg) {
            release(&st.k_empty[ring.stage]);
            Barrier::wait(&st.v_full[vs.stage], vs.phase);
            release(&st.v_empty[vs.stage]);
            advance_rings();
            continue;
          }
          const KeyBlock b = landed_block(i, ring.stage);
          warpgroup_gemm(mma_qk, tSrQ, k_slot(ring.stage), tSrS, true);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tSrS);
          release(&st.k_empty[ring.stage]);
          if (b.needs_mask) apply_mask(tSrS, tScS, visit, b, t.q0);
          if (first) {
            softmax.template update<true>(tSrS, alpha);
          } else {
            const bool moved = softmax.template update<false>(tSrS, alpha);
            if (__any_sync(0xffffffffu, moved)) rescale_rows(tOrO, alpha);
          }
          convert_p(tOrP32);
          Barrier::wait(&st.v_full[vs.stage], vs.phase);
          // This warpgroup alone reads the block's V.
          if (tail_rows_need_zeros<Visit>(p.attn, b.valid, b.valid_hi))
            zero_v_tail_rows<Traits, Visit::kHalves>(st.v.data(), vs.stage, b.valid, b.valid_hi,
                                                     tid % 128, 128, 4 + wg);
          if constexpr (Traits::kOneBlock) clear(tOrO);  // see the tile's last P V below
          warpgroup_fence_operand(tOrP);
          warpgroup_gemm(mma_pv, tOrP, v_slot(vs.stage), tOrO, first);
          warpgroup_wait<0>();
          warpgroup_fence_operand(tOrO);
          release(&st.v_empty[vs.stage]);
          first = false;
          advance_rings();
        }
        Barrier::arrive(&st.q_empty);
        if (first) clear(tOrO);  // no block of its own: nothing to add (max -inf, sum 0)
        combine_split_piece<Traits>(st, tOrO, softmax, wg, tid % 128);
        if (wg == 0) write_output(0);  // the piece's rows, from warpgroup 0's accumulator
        continue;
      }
    }
    if (n == 0) {  // no key to see: zeros and LSE -inf, by the tile's usual store
      Barrier::arrive(&st.q_empty);
      clear(tOrO);
      write_output(wg);
      hand_over(slot);
      continue;
    }

    // Block 0: S, softmax; its P V product is issued together with block 1's S.
    Barrier::wait(&st.k_full[ring.stage], ring.phase);
    const KeyBlock kb = landed_block(0, ring.stage);
    turns.wait_turn();
    warpgroup_gemm(mma_qk, tSrQ, k_slot(ring.stage), tSrS, true);
    turns.pass_turn();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tSrS);
    release(&st.k_empty[ring.stage]);
    if (n == 1) Barrier::arrive(&st.q_empty);
    if (kb.needs_mask) apply_mask(tSrS, tScS, visit, kb, t.q0);
    softmax.template update<true>(tSrS, alpha);
    convert_p(tOrP32);
    RingState<Traits::kStagesV> prev = v_ring();  // V of the block whose P V is next
    // Its rows to zero (v_tail), kept through the loop where any block may be partial; a
    // masked-suffix policy's (dense) only partial block is the last, zeroed after the loop.
    int prev_tail = -1;
    if constexpr (!Visit::kMaskedSuffix) prev_tail = v_tail(kb);
    advance_rings();

    // Block i: its S and the P V product of block i - 1 are issued together; the softmax of
    // block i runs while that P V product does. kMask: 0 never masks (no mask code in the
    // loop that runs most blocks: fewer live registers), 1 always, 2 as the block says.
    // kAlt: block i - 1's P is in operand kAlt, block i's goes to the other (kAltP).
    auto step = [&](int i, auto kMask, auto kAlt) __attribute__((always_inline)) {
      constexpr int kMaskMode = decltype(kMask)::value;
      constexpr bool kCurIsAlt = kAltP && decltype(kAlt)::value;
      constexpr bool kNextIsAlt = kAltP && !decltype(kAlt)::value;
      auto& p_cur = pick_operand<kCurIsAlt>(tOrP, tOrPAlt);
      auto& p_next32 = pick_operand<kNextIsAlt>(tOrP32, tOrPAlt32);
      Barrier::wait(&st.k_full[ring.stage], ring.phase);
      KeyBlock b;
      if constexpr (kMaskMode != 0) b = landed_block(i, ring.stage);
      Barrier::wait(&st.v_full[prev.stage], prev.phase);
      if constexpr (kMaskMode == 2) zero_v_tail(prev.stage, prev_tail);
      turns.wait_turn();
      warpgroup_gemm(mma_qk, tSrQ, k_slot(ring.stage), tSrS, true);
      warpgroup_fence_operand(p_cur);
      warpgroup_gemm(mma_pv, p_cur, v_slot(prev.stage), tOrO, i == 1);
      turns.pass_turn();
      warpgroup_wait<1>();  // S of block i is ready; P V of block i - 1 still runs
      warpgroup_fence_operand(tSrS);
      release(&st.k_empty[ring.stage]);
      if (i == n - 1) Barrier::arrive(&st.q_empty);
      if constexpr (kMaskMode == 1) apply_mask(tSrS, tScS, visit, b, t.q0);
      if constexpr (kMaskMode == 2)
        if (b.needs_mask) apply_mask(tSrS, tScS, visit, b, t.q0);
      // Most blocks leave every row's base in place (OnlineSoftmax::slack), so the exponentials
      // are taken against the current base first and only a warp whose check fails takes the
      // block's max and redoes the block in place. kSpeculativeSoftmax writes them to the other
      // P operand while P V of block i - 1 still reads this one; kSpeculateAfterPV (one
      // operand, no registers to spare) waits for that product and writes them into it.
      constexpr bool kSpeculate = Traits::kSpeculativeSoftmax || Traits::kSpeculateAfterPV;
      auto finish_previous_pv = [&]() __attribute__((always_inline)) {
        warpgroup_wait<0>();  // P V of block i - 1 done: O and P are free
        warpgroup_fence_operand(tOrO);
        warpgroup_fence_operand(p_cur);
        release(&st.v_empty[prev.stage]);
      };
      if constexpr (Traits::kSpeculateAfterPV) finish_previous_pv();
      bool exact = true, moved = false;
      if constexpr (kSpeculate) {
        float block_sum[2];
        exact = !__all_sync(0xffffffffu, softmax.speculate(tSrS, block_sum,
            [&](int i, float p0, float p1) { p_next32(i) = pack_pair<Element>(p0, p1); }));
        if (exact) moved = softmax.template update<false>(tSrS, alpha);
        else softmax.commit(block_sum);
      } else {
        moved = softmax.template update<false>(tSrS, alpha);
      }
      if constexpr (!Traits::kSpeculateAfterPV) finish_previous_pv();
      if (exact) {
        if (__any_sync(0xffffffffu, moved)) rescale_rows(tOrO, alpha);
        convert_p(p_next32);
      }
      prev = v_ring();
      if constexpr (kMaskMode == 2) prev_tail = v_tail(b);
      advance_rings();
    };
    // Blocks [i, end), leaving the last one's P in the first operand.
    auto run_steps = [&](int& i, int end, auto kMask) __attribute__((always_inline)) {
      if constexpr (kAltP) {
        for (; i + 1 < end; i += 2) {
          step(i, kMask, cute::Int<0>{});
          step(i + 1, kMask, cute::Int<1>{});
        }
        if (i < end) {
          step(i, kMask, cute::Int<0>{});
          move_alt_p();
          ++i;
        }
      } else {
        for (; i < end; ++i) step(i, kMask, cute::Int<0>{});
      }
    };
    if constexpr (Traits::kOneBlock) {
      // n == 1 (the dispatch's key limit): block 0 was the whole loop.
    } else if constexpr (Visit::kMaskedSuffix) {
      const int unmasked_end = control(min(visit.first_masked_block(), n));
      int i = 1;
      run_steps(i, unmasked_end, cute::Int<0>{});
      // The tile's description (sequence, policy, row limit: ~25 registers of 64-bit values)
      // is read again from the producer's record here instead of being kept through the
      // unmasked loop, where three consumer warpgroups (160 registers each) spill (less so
      // with this: +3-4% at D = 64). The loop's barriers clobber memory, so this is a reload.
      t = st.tile[record];
      visit = Visit(p.attn, p.sparse, t.seq, t.head, t.q0, BM);
      row_limit = query_row_limit();
      run_steps(i, n, cute::Int<1>{});
    } else {
      int i = 1;
      run_steps(i, n, cute::Int<2>{});
    }
    Barrier::wait(&st.v_full[prev.stage], prev.phase);
    if constexpr (Visit::kMaskedSuffix) prev_tail = v_tail(visit.block(n - 1));
    zero_v_tail(prev.stage, prev_tail);
    // kOneBlock: O defined here, so that the product's operand fence does not keep the last
    // tile's O live through this tile's S (64 + 64 values and P: past 160 registers, and
    // ptxas serialises the wgmma).
    if constexpr (Traits::kOneBlock) clear(tOrO);
    turns.wait_turn();
    warpgroup_fence_operand(tOrP);
    warpgroup_gemm(mma_pv, tOrP, v_slot(prev.stage), tOrO, Traits::kOneBlock || n == 1);
    turns.pass_turn();
    warpgroup_wait<0>();
    warpgroup_fence_operand(tOrO);
    release(&st.v_empty[prev.stage]);
    write_output(wg);
    hand_over(slot);
  }
  hand_over(-1);
  // The shared-memory slot must outlive the TMA store's reads of it.
  if constexpr (Traits::kTmaStoreO)
    if (tid % 128 == 0) cute::tma_store_wait<0>();
}

}  // namespace vidattn::cuda_sm90
