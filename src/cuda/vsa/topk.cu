// Top-k key-tile selection on CUDA: select_topk_tiles (coarse scores from pooled q and k, then
// the selection) and topk_tiles_from_scores (the selection from given scores). The CPU
// reference is cpu_select_topk_tiles / cpu_topk_tiles_from_scores (src/cpu/vsa_cpu.cpp).
//
// Design: one CTA scores a block of up to 16 query tiles against the key tiles of their videos
// into shared memory; then one warp per row selects there. No score tensor reaches global
// memory. Every path gives the CPU's exact rule: exactly k per row, ties to the lowest index,
// NaN ranked as -inf, +0 == -0, indices strictly ascending.
//  * Tensor-core scores (bf16 / fp16, head dim 32, 64, 128 or 256, 16-byte aligned rows):
//    vsa_select_topk_bins_kernel. While scoring it fills a histogram of value bins per row,
//    then one pass per row keeps the bins above the k-th largest and ranks the few candidates
//    of its bin (bins_select_row); rows whose bin holds too many candidates take the radix
//    select below.
//  * Anything else (float32, float64, other head dims, unaligned views):
//    vsa_select_topk_kernel, register-tiled SIMT products over shared-memory slices of q and
//    k (fp32 accumulation, fp64 for fp64), then a radix select per row (warp_select_row: an
//    8-bit-digit radix select on order-preserving integer keys and an index-ordered warp
//    compaction).
//  * Given scores: vsa_topk_from_scores_kernel, the radix select on rows read from global
//    memory.
// The two score paths differ only in how the fp32 sums are ordered and rounded (the products
// of 16-bit floats are exact in fp32).
//
// cu_tiles offsets cannot be checked without a host sync, so the kernels clamp them to
// [0, tiles] (a query tile outside every video gets count 0); valid offsets give exactly the
// CPU results.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cfloat>
#include <climits>
#include <cstdint>
#include <type_traits>

#include "../../core/check.h"
#include "../../core/vsa_backends.h"
#include "../common/check.h"
#include "../common/device_guard.h"
#include "../common/dtype_dispatch.h"
#include "../common/dtype_io.cuh"
#include "../common/mma_utils.h"
#include "launch_utils.h"

namespace vidattn::cuda_vsa {
namespace {

using cuda_common::Io;

// select_topk_tiles (scores from q, k) or, with `scores` set, the selection from given scores.
struct TopkParams {
  const void* q = nullptr;        // q_pooled [B, Qtiles, Hq, D]
  const void* k = nullptr;        // k_pooled [B, Ktiles, Hkv, D]
  const void* scores = nullptr;   // [B, H, Qtiles, Ktiles], topk_tiles_from_scores only
  std::int64_t batch = 0, q_tiles = 0, k_tiles = 0, heads_q = 0, heads_kv = 0, head_dim = 0;
  std::int64_t q_stride[3] = {}, k_stride[3] = {};
  std::int64_t scores_stride[3] = {};  // batch, head, query tile (unit-stride key tiles)
  double scale = 1.0;
  std::int64_t topk = 1, max_k = 0;
  bool has_sparsity = false;
  double sparsity = 0.0;
  const std::int32_t* cu_tiles_q = nullptr;  // [num_videos + 1] or null
  const std::int32_t* cu_tiles_k = nullptr;
  std::int64_t cu_q_stride = 1, cu_k_stride = 1, num_videos = 0;
  std::int32_t* index = nullptr;  // q2k_index [B, H, Qtiles, MaxK]
  std::int64_t index_stride[4] = {};
  std::int32_t* count = nullptr;  // q2k_count [B, H, Qtiles]
  std::int64_t count_stride[3] = {};
};

// ---- top-k selection ------------------------------------------------------------------------

// Order-preserving unsigned keys: a > b as floats <=> key(a) > key(b), with NaN as -inf and
// -0 as +0 (the CPU compares with == and >, for which they are equal).
__device__ __forceinline__ std::uint32_t order_key(float v) {
  if (v != v) v = -INFINITY;
  if (v == 0.0f) v = 0.0f;
  const std::uint32_t u = __float_as_uint(v);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ __forceinline__ std::uint64_t order_key(double v) {
  if (v != v) v = -INFINITY;
  if (v == 0.0) v = 0.0;
  const auto u = static_cast<std::uint64_t>(__double_as_longlong(v));
  return (u >> 63) ? ~u : (u | (std::uint64_t(1) << 63));
}

// vidattn::topk_from_sparsity, with the same double rounding (no contraction into an fma).
__device__ std::int64_t device_topk_from_sparsity(double sparsity, std::int64_t n) {
  const double kept = ceil(__dsub_rn(__dmul_rn(1.0 - sparsity, double(n)), 1e-9));
  std::int64_t k = static_cast<std::int64_t>(kept);
  return k < 1 ? 1 : (k > n ? n : k);
}

// The bin of a 256-bin histogram (bins in ascending value order) that holds the k-th largest
// counted element (1 <= k <= the total count), found by one warp: lane L owns bins
// [8L, 8L + 8). Only lane `owner` holds the answer: the bin, how many of its elements are
// among the k largest (`need`) and how many it holds (`count`); callers broadcast the fields
// they use. The radix select (per 8-bit digit) and the binned selection (per value bin) share
// it.
struct ThresholdBin {
  int owner, bin, need, count;
};
__device__ __forceinline__ ThresholdBin find_threshold_bin(const int* hist, int k) {
  const int lane = threadIdx.x & 31;
  int c[8], local = 0;
#pragma unroll
  for (int i = 0; i < 8; ++i) local += (c[i] = hist[lane * 8 + i]);
  int inclusive = local;  // counts of this lane's bins and every higher lane's
#pragma unroll
  for (int off = 1; off < 32; off <<= 1) {
    const int v = __shfl_down_sync(0xffffffffu, inclusive, off);
    if (lane + off < 32) inclusive += v;
  }
  const int above = inclusive - local;
  const unsigned owners = __ballot_sync(0xffffffffu, above < k && k <= inclusive);
  ThresholdBin found{__ffs(owners) - 1, 0, k, 0};
  if (lane == found.owner) {
    int cum = above;
    for (int i = 7; i >= 0; --i) {
      if (cum + c[i] >= k) {
        found.bin = lane * 8 + i;
        found.need = k - cum;
        found.count = c[i];
        break;
      }
      cum += c[i];
    }
  }
  return found;
}

// One warp writes the top `k` of score(0 .. n-1) as `offset + j`, ascending, into
// out[0, k) and -1 into out[k, max_k). `hist` is this warp's 256 ints of shared memory.
template <class Acc, class Score>
__device__ void warp_select_row(const Score& score, int n, int k, int max_k, int offset,
                                std::int32_t* out, std::int64_t out_stride, int* hist) {
  const int lane = threadIdx.x & 31;
  if (k >= n || k <= 0) {  // everything or nothing: no ranking needed
    const int take = k <= 0 ? 0 : n;
    for (int slot = lane; slot < max_k; slot += 32)
      out[slot * out_stride] = slot < take ? offset + slot : -1;
    return;
  }
  using Key = decltype(order_key(Acc(0)));
  constexpr int kBits = 8 * sizeof(Key);
  Key prefix = 0, mask = 0;
  int remaining = k;  // how many still to take among the keys that match `prefix`
  for (int shift = kBits - 8; shift >= 0; shift -= 8) {
    for (int i = lane; i < 256; i += 32) hist[i] = 0;
    __syncwarp();
    for (int j = lane; j < n; j += 32) {
      const Key key = order_key(score(j));
      if ((key & mask) == prefix) atomicAdd(&hist[int((key >> shift) & 255)], 1);
    }
    __syncwarp();
    // The digit whose bin holds the remaining-th largest.
    const ThresholdBin found = find_threshold_bin(hist, remaining);
    const int digit = __shfl_sync(0xffffffffu, found.bin, found.owner);
    remaining = __shfl_sync(0xffffffffu, found.need, found.owner);
    prefix |= Key(digit) << shift;
    mask |= Key(255) << shift;
    __syncwarp();
  }
  // prefix is now the k-th largest key; all larger keys are taken, and the first `remaining`
  // equal ones in index order. A compaction in index order keeps the output ascending.
  const unsigned lower = (1u << lane) - 1u;
  int written = 0, equal_seen = 0;
  for (int base = 0; base < n; base += 32) {
    const int j = base + lane;
    const Key key = j < n ? order_key(score(j)) : Key(0);
    const bool greater = j < n && key > prefix, equal = j < n && key == prefix;
    const unsigned eq_bits = __ballot_sync(0xffffffffu, equal);
    const bool take = greater || (equal && equal_seen + __popc(eq_bits & lower) < remaining);
    const unsigned take_bits = __ballot_sync(0xffffffffu, take);
    if (take) out[(written + __popc(take_bits & lower)) * out_stride] = offset + j;
    written += __popc(take_bits);
    equal_seen += __popc(eq_bits);
  }
  for (int slot = k + lane; slot < max_k; slot += 32) out[slot * out_stride] = -1;
}

constexpr int kTopkThreads = 128;  // 4 warps
constexpr int kRowsMax = 16;       // query tiles scored together at most (4 per warp)
constexpr int kKeyChunk = 256;     // key tiles per product step (8 per lane)
constexpr int kDSlice = 32;        // head-dim slice staged in shared memory
constexpr int kKeyPad = 1;         // keeps the transposed k stores free of bank conflicts

template <class Acc>
std::size_t topk_smem_bytes(int rows, std::int64_t k_tiles) {
  return sizeof(Acc) * (std::size_t(rows) * std::size_t(k_tiles) +
                        std::size_t(kDSlice) * (kKeyChunk + kKeyPad) + kRowsMax * kDSlice) +
         sizeof(int) * (4 * 256 + 2 * kRowsMax);
}

// The key-tile range [k0, k0 + n) of query tile t: its video's (packed) or all of them.
__device__ void video_range(const TopkParams& p, std::int64_t t, int* k0, int* n) {
  if (!p.cu_tiles_q) {
    *k0 = 0;
    *n = int(p.k_tiles);
    return;
  }
  auto clamp_q = [&](std::int64_t i) {
    std::int64_t v = p.cu_tiles_q[i * p.cu_q_stride];
    return v < 0 ? 0 : (v > p.q_tiles ? p.q_tiles : v);
  };
  auto clamp_k = [&](std::int64_t i) {
    std::int64_t v = p.cu_tiles_k[i * p.cu_k_stride];
    return v < 0 ? 0 : (v > p.k_tiles ? p.k_tiles : v);
  };
  // The last video whose first tile is <= t (empty videos before it are skipped).
  std::int64_t lo = 0, hi = p.num_videos - 1;
  if (hi < 0 || clamp_q(0) > t) {
    *k0 = 0;
    *n = 0;
    return;
  }
  while (lo < hi) {
    const std::int64_t mid = (lo + hi + 1) / 2;
    if (clamp_q(mid) <= t) lo = mid;
    else hi = mid - 1;
  }
  if (t >= clamp_q(lo + 1)) {  // past the last video (cu_tiles_q ends early)
    *k0 = 0;
    *n = 0;
    return;
  }
  const std::int64_t begin = clamp_k(lo), end = clamp_k(lo + 1);
  *k0 = int(begin);
  *n = end > begin ? int(end - begin) : 0;
}

__device__ int row_topk(const TopkParams& p, int n) {
  std::int64_t want = p.topk < n ? p.topk : n;
  if (p.has_sparsity && n > 0) {
    want = device_topk_from_sparsity(p.sparsity, n);
    if (want > p.max_k) want = p.max_k;
  }
  return int(want < n ? want : n);
}

// Threads 0 .. kRowsMax - 1 record the key range of the CTA's query tiles t0 + r (an empty
// range for rows past `rows` or the last tile). Read after the next __syncthreads.
__device__ __forceinline__ void record_row_ranges(const TopkParams& p, std::int64_t t0,
                                                  int rows, int* row_k0, int* row_n) {
  const int tid = threadIdx.x;
  if (tid < kRowsMax) {
    int k0 = 0, n = 0;
    if (tid < rows && t0 + tid < p.q_tiles) video_range(p, t0 + tid, &k0, &n);
    row_k0[tid] = k0;
    row_n[tid] = n;
  }
}

// The union [kmin, kmax) of the rows' key ranges (one range unless the CTA straddles videos).
__device__ __forceinline__ void key_range_union(const int* row_k0, const int* row_n, int rows,
                                                int* kmin, int* kmax) {
  int lo = 0x7fffffff, hi = 0;
  for (int r = 0; r < rows; ++r)
    if (row_n[r] > 0) {
      lo = min(lo, row_k0[r]);
      hi = max(hi, row_k0[r] + row_n[r]);
    }
  *kmin = hi == 0 ? 0 : lo;
  *kmax = hi;
}

// Each warp selects the top-k of rows warp, warp + kWarps, ... from their scores (row r's
// key j at scores[r * k_cap + row_k0[r] - kmin + j]) and writes index and count.
template <int kWarps, class Acc>
__device__ __forceinline__ void select_rows(const TopkParams& p, const Acc* scores,
                                            std::int64_t k_cap, int kmin, const int* row_k0,
                                            const int* row_n, std::int64_t t0, int rows,
                                            int* hist) {
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  for (int r = warp; r < rows; r += kWarps) {
    const std::int64_t t = t0 + r;
    if (t >= p.q_tiles) break;
    const int n = row_n[r], want = row_topk(p, n);
    const Acc* row = scores + std::int64_t(r) * k_cap + (row_k0[r] - kmin);
    std::int32_t* out =
        p.index + b * p.index_stride[0] + h * p.index_stride[1] + t * p.index_stride[2];
    warp_select_row<Acc>([row](int j) { return row[j]; }, n, want, int(p.max_k), row_k0[r], out,
                         p.index_stride[3], hist + warp * 256);
    if (lane == 0)
      p.count[b * p.count_stride[0] + h * p.count_stride[1] + t * p.count_stride[2]] = want;
  }
}

// Stages k[kc .. kc + kKeyChunk) x [ds, ds + kDSlice) into ks (transposed, as Acc). With kVec,
// each thread copies 16-byte runs of the head dim (launch_simt_selection checks alignment
// and that D is a multiple of the run); the loads of a thread are independent and issued together.
template <class T, bool kVec>
__device__ __forceinline__ void stage_keys(const T* k, std::int64_t key_stride, int kc, int kmax,
                                           std::int64_t ds, std::int64_t D, float* ks_f,
                                           double* ks_d) {
  using Acc = cuda_common::AccumulatorOf<T>;
  Acc* ks = [&] {
    if constexpr (std::is_same<Acc, double>::value) return ks_d;
    else return ks_f;
  }();
  constexpr int kStride = kKeyChunk + kKeyPad;
  if constexpr (kVec) {
    constexpr int kRun = 16 / int(sizeof(T));            // elements per 16-byte load
    constexpr int kRunsPerKey = kDSlice / kRun;
    constexpr int kLoads = kKeyChunk * kRunsPerKey / kTopkThreads;
    uint4 buf[kLoads];
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int e = threadIdx.x + l * kTopkThreads;
      const int key = e / kRunsPerKey, d0 = (e % kRunsPerKey) * kRun;
      const std::int64_t j = std::int64_t(kc) + key;
      buf[l] = make_uint4(0, 0, 0, 0);
      if (j < kmax && ds + d0 < D)
        buf[l] = *reinterpret_cast<const uint4*>(k + j * key_stride + ds + d0);
    }
#pragma unroll
    for (int l = 0; l < kLoads; ++l) {
      const int e = threadIdx.x + l * kTopkThreads;
      const int key = e / kRunsPerKey, d0 = (e % kRunsPerKey) * kRun;
      const T* v = reinterpret_cast<const T*>(&buf[l]);
#pragma unroll
      for (int i = 0; i < kRun; ++i) ks[(d0 + i) * kStride + key] = Io<T>::template load<Acc>(v[i]);
    }
  } else {
    for (int e = threadIdx.x; e < kKeyChunk * kDSlice; e += kTopkThreads) {
      const int key = e / kDSlice, dd = e % kDSlice;  // consecutive threads: consecutive d
      const std::int64_t j = std::int64_t(kc) + key;
      ks[dd * kStride + key] = (j < kmax && ds + dd < D)
                                   ? Io<T>::template load<Acc>(k[j * key_stride + ds + dd])
                                   : Acc(0);
    }
  }
}

// kRowsPerWarp: 4 (16 query tiles per CTA) or 2 (8, when the grid would be too small).
template <class T, int kRowsPerWarp, bool kVec>
__global__ void __launch_bounds__(kTopkThreads) vsa_select_topk_kernel(TopkParams p, int rows) {
  using Acc = cuda_common::AccumulatorOf<T>;
  constexpr int kRows = 4 * kRowsPerWarp;
  extern __shared__ __align__(16) unsigned char smem[];
  const std::int64_t k_cap = p.k_tiles;
  Acc* scores = reinterpret_cast<Acc*>(smem);                 // [rows][k_cap]
  Acc* ks = scores + std::int64_t(rows) * k_cap;              // [kDSlice][kKeyChunk + pad]
  Acc* qs = ks + kDSlice * (kKeyChunk + kKeyPad);             // [kRows][kDSlice]
  int* hist = reinterpret_cast<int*>(qs + kRowsMax * kDSlice);  // [4][256]
  int* row_k0 = hist + 4 * 256;
  int* row_n = row_k0 + kRowsMax;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const std::int64_t t0 = std::int64_t(blockIdx.x) * rows;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  const std::int64_t hk = h / (p.heads_q / p.heads_kv);
  const auto* q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[2];
  const auto* k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[2];

  record_row_ranges(p, t0, rows, row_k0, row_n);
  __syncthreads();
  int kmin, kmax;
  key_range_union(row_k0, row_n, rows, &kmin, &kmax);

  for (int kc = kmin; kc < kmax; kc += kKeyChunk) {
    Acc acc[kRowsPerWarp][8];
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[i][j] = Acc(0);
    for (std::int64_t ds = 0; ds < p.head_dim; ds += kDSlice) {
      __syncthreads();  // the previous slice has been read
      for (int e = tid; e < kRows * kDSlice; e += kTopkThreads) {
        const int r = e / kDSlice, dd = e % kDSlice;
        const std::int64_t t = t0 + r;
        qs[e] = (r < rows && t < p.q_tiles && ds + dd < p.head_dim)
                    ? Io<T>::template load<Acc>(q[t * p.q_stride[1] + ds + dd])
                    : Acc(0);
      }
      stage_keys<T, kVec>(k, p.k_stride[1], kc, kmax, ds, p.head_dim,
                          reinterpret_cast<float*>(ks), reinterpret_cast<double*>(ks));
      __syncthreads();
#pragma unroll 8
      for (int dd = 0; dd < kDSlice; ++dd) {
        Acc qv[kRowsPerWarp], kv[8];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i) qv[i] = qs[(warp * kRowsPerWarp + i) * kDSlice + dd];
#pragma unroll
        for (int j = 0; j < 8; ++j) kv[j] = ks[dd * (kKeyChunk + kKeyPad) + lane + 32 * j];
#pragma unroll
        for (int i = 0; i < kRowsPerWarp; ++i)
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[i][j] = fma(qv[i], kv[j], acc[i][j]);
      }
    }
#pragma unroll
    for (int i = 0; i < kRowsPerWarp; ++i) {
      const int r = warp * kRowsPerWarp + i;
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        const int key = kc + lane + 32 * j;
        if (r < rows && key < kmax)
          scores[std::int64_t(r) * k_cap + (key - kmin)] = acc[i][j] * Acc(p.scale);
      }
    }
  }
  __syncthreads();
  select_rows<kTopkThreads / 32>(p, scores, k_cap, kmin, row_k0, row_n, t0, rows, hist);
}

// Tensor-core scores for bf16 / fp16 with head dim kD (a multiple of 32): one CTA of 8 warps
// takes up to kRowsMax query tiles (the 16 rows of one mma m16n8k16 A operand, rows past
// `rows` or the last tile are zeros) and computes their scores against the key range of their
// videos with fp32 accumulation (vsa_select_topk_bins_kernel below).
//
// Operand layout without shared-memory staging: for each 32-wide slice c of the head dim, lane
// (g = lane / 4, q4 = lane % 4) loads 16 bytes, d in [32c + 8 q4, 32c + 8 q4 + 8), of query rows
// g and g + 8 (A) and of key g of an 8-key group (B). The dot product does not depend on which
// k-slot of the mma a given d lands in, only on q and k using the same assignment: words 0, 1
// of the run feed k-step 2c (k-slots 2 q4, 2 q4 + 1 and 2 q4 + 8, 2 q4 + 9), words 2, 3 feed
// k-step 2c + 1, in the register positions that A (a0/a2 for row g, a1/a3 for row g + 8) and B
// (b0, b1) use for those k-slots. So every d pairs q[row][d] with k[key][d] exactly once. Each
// lane's loads cover 8 keys x 64 contiguous bytes per warp instruction.
constexpr int kMmaThreads = 256;
constexpr int kMmaWarps = kMmaThreads / 32;

// 8-key groups per warp step: 4 16-byte loads per lane and step (8 for kD = 256). The next
// step's loads are issued before this step's mma (a register double buffer, except for
// kD = 256), so a warp keeps two steps of loads in flight. Registers (ptxas, sm_80 / sm_90a):
// kD <= 64 within 80, so 3 CTAs of 8 warps per SM; kD = 128 about 96 and kD = 256 about 116,
// so 2 (the rows of scores of 1440 key tiles allow 2 anyway).
template <int kD>
constexpr int mma_key_groups() {
  return kD >= 128 ? 1 : 128 / kD;
}

// The A operand of the tensor-core scores: query tiles t0 + g and t0 + g + 8 of the CTA
// (zeros for rows past `rows` or the last tile) in the register order described above; every
// warp holds all 16 rows.
template <class T, int kSlices>
__device__ __forceinline__ void load_query_operand(const TopkParams& p, const T* q,
                                                   std::int64_t t0, int rows, int g, int q4,
                                                   std::uint32_t (&a)[2 * kSlices][4]) {
  const bool lo_ok = g < rows && t0 + g < p.q_tiles;
  const bool hi_ok = g + 8 < rows && t0 + g + 8 < p.q_tiles;
  const T* q_lo = q + (t0 + g) * p.q_stride[1] + 8 * q4;
  const T* q_hi = q + (t0 + g + 8) * p.q_stride[1] + 8 * q4;
#pragma unroll
  for (int c = 0; c < kSlices; ++c) {
    const uint4 lo =
        lo_ok ? __ldg(reinterpret_cast<const uint4*>(q_lo + 32 * c)) : make_uint4(0, 0, 0, 0);
    const uint4 hi =
        hi_ok ? __ldg(reinterpret_cast<const uint4*>(q_hi + 32 * c)) : make_uint4(0, 0, 0, 0);
    a[2 * c][0] = lo.x;
    a[2 * c][1] = hi.x;
    a[2 * c][2] = lo.y;
    a[2 * c][3] = hi.y;
    a[2 * c + 1][0] = lo.z;
    a[2 * c + 1][1] = hi.z;
    a[2 * c + 1][2] = lo.w;
    a[2 * c + 1][3] = hi.w;
  }
}

// The B operands of the kGroups 8-key groups at `base`: zeros for keys past kmax (never
// stored).
template <class T, int kGroups, int kSlices>
__device__ __forceinline__ void load_key_groups(const T* k, std::int64_t key_stride, int base,
                                                int kmax, int g, int q4,
                                                uint4 (&kv)[kGroups][kSlices]) {
#pragma unroll
  for (int j = 0; j < kGroups; ++j) {
    const int key = base + 8 * j + g;
    const T* src = k + std::int64_t(key) * key_stride + 8 * q4;
#pragma unroll
    for (int c = 0; c < kSlices; ++c)
      kv[j][c] = key < kmax ? __ldg(reinterpret_cast<const uint4*>(src + 32 * c))
                            : make_uint4(0, 0, 0, 0);
  }
}

// acc[j]: the fp32 scores of key group j, (row g, keys 2 q4, 2 q4 + 1), then the same keys of
// row g + 8 (unscaled). One fixed mma order, so every kernel that uses it gets the same bits.
template <class T, int kGroups, int kSlices>
__device__ __forceinline__ void score_key_groups(const std::uint32_t (&a)[2 * kSlices][4],
                                                 const uint4 (&kv)[kGroups][kSlices],
                                                 float (&acc)[kGroups][4]) {
#pragma unroll
  for (int j = 0; j < kGroups; ++j)
#pragma unroll
    for (int i = 0; i < 4; ++i) acc[j][i] = 0.0f;
#pragma unroll
  for (int c = 0; c < kSlices; ++c)
#pragma unroll
    for (int j = 0; j < kGroups; ++j) {
      cuda_common::Mma<T>::run(acc[j], a[2 * c], kv[j][c].x, kv[j][c].y);
      cuda_common::Mma<T>::run(acc[j], a[2 * c + 1], kv[j][c].z, kv[j][c].w);
    }
}

// Where a tensor-core selection CTA works: its first query tile t0 (of `rows`), head and
// batch, the q rows of that head and the k rows of its kv head, and the thread's lane, warp
// and place in the mma fragments (g: row group, q4: column pair).
template <class T>
struct MmaTopkCta {
  int lane, warp, g, q4;
  std::int64_t t0, h, b;
  const T* q;
  const T* k;
  __device__ __forceinline__ MmaTopkCta(const TopkParams& p, int rows) {
    lane = threadIdx.x & 31;
    warp = threadIdx.x >> 5;
    g = lane >> 2;
    q4 = lane & 3;
    t0 = std::int64_t(blockIdx.x) * rows;
    h = blockIdx.y;
    b = blockIdx.z;
    const std::int64_t hk = h / (p.heads_q / p.heads_kv);
    q = static_cast<const T*>(p.q) + b * p.q_stride[0] + h * p.q_stride[2];
    k = static_cast<const T*>(p.k) + b * p.k_stride[0] + hk * p.k_stride[2];
  }
};

// The key tiles [kmin, kmax) streamed through one warp's mma in steps of kKeysPerStep (the
// warps of the CTA interleaved). For kD <= 128 the next step's loads are issued before this
// step's products (a register double buffer); the first step's are issued at construction,
// so a caller can overlap them with other work.
template <class T, int kD>
struct KeyStream {
  static constexpr int kSlices = kD / 32;
  static constexpr int kGroups = mma_key_groups<kD>();
  static constexpr int kKeysPerStep = 8 * kGroups;
  static constexpr int kWarpStride = kMmaWarps * kKeysPerStep;
  static constexpr bool kPrefetch = kD <= 128;
  const T* k;
  std::int64_t key_stride;
  int kmax, first, g, q4;  // first: this warp's first step
  uint4 kv[kGroups][kSlices];

  __device__ __forceinline__ KeyStream(const T* k_, std::int64_t key_stride_, int kmin,
                                       int kmax_, int warp, int g_, int q4_)
      : k(k_), key_stride(key_stride_), kmax(kmax_), first(kmin + warp * kKeysPerStep),
        g(g_), q4(q4_) {
    if constexpr (kPrefetch) load(first, kv);
  }
  __device__ __forceinline__ void load(int base, uint4 (&dst)[kGroups][kSlices]) const {
    load_key_groups<T, kGroups, kSlices>(k, key_stride, base, kmax, g, q4, dst);
  }
  // fn(key, score of row g, score of row g + 8) for every key below kmax this lane holds
  // (unscaled fp32 scores).
  template <class Fn>
  __device__ __forceinline__ void score_all(const std::uint32_t (&a)[2 * kSlices][4], Fn&& fn) {
    for (int base = first; base < kmax; base += kWarpStride) {
      uint4 next[kGroups][kSlices];
      if constexpr (kPrefetch) load(base + kWarpStride, next);
      else load(base, kv);
      float acc[kGroups][4];
      score_key_groups<T, kGroups, kSlices>(a, kv, acc);
#pragma unroll
      for (int j = 0; j < kGroups; ++j)
#pragma unroll
        for (int col = 0; col < 2; ++col) {
          const int key = base + 8 * j + 2 * q4 + col;
          if (key < kmax) fn(key, acc[j][col], acc[j][2 + col]);
        }
      if constexpr (kPrefetch) {
#pragma unroll
        for (int j = 0; j < kGroups; ++j)
#pragma unroll
          for (int c = 0; c < kSlices; ++c) kv[j][c] = next[j][c];
      }
    }
  }
};

// ---- the binned selection: value bins built while scoring, one pass per row ----------------
//
// Why: a radix select (warp_select_row) costs each row four 8-bit passes over its scores (each
// a histogram clear, an order_key per element, shared atomics that pile onto 2-4 bins in the
// first pass because all scores share their sign and top exponent bits, a 256-bin scan) plus
// an index-ordered compaction pass: about 5 full passes of 10-15 instructions per element.
// The binned selection keeps the tensor-core scores and the exact selection rule, and cuts the
// per-row work to one pass over the row:
//  1. Sample: before the main product every warp scores 8 of 64 key tiles spread over the
//     CTA's key range; per row the min / max of the finite sampled scores define 256 linear
//     value bins over [min - r/8, max + r/8] (r = max - min). The sample only tunes the bins'
//     resolution: any lo / scale give a correct selection (3.).
//  2. The product's epilogue stores the canonical score (NaN -> -inf, -0 -> +0, so plain
//     float comparisons order exactly like order_key) and adds it to its row's histogram of
//     value bins (shared atomics spread over 256 bins x 16 rows: no pile-up). This work hides
//     in the L2 latency of the key stream.
//  3. value_bin is monotone non-decreasing in the value (fsub / fmul by a scale >= 0 round
//     monotonically, fmax / fmin / truncation keep order; NaN from inf * 0 clamps to bin 0,
//     which is also where every smaller value goes). So every score in a bin above the
//     threshold bin (the bin holding the k-th largest) beats every score in it, and every
//     score in a bin below loses: the top-k is all of the higher bins plus the top `need`
//     of the threshold bin's `cnt` candidates, by (value desc, index asc).
//  4. Per row (one warp): a 256-bin scan finds the threshold bin; then ONE pass over the row
//     computes each score's bin again (same function, same lo / scale, same float: the same
//     bin), stages the indices of the kept scores (higher bins and candidates) in index order
//     in place over the row's own scores (a compaction never writes past what it has read),
//     and copies the candidates' values to a small per-warp list. The candidates rank
//     themselves exactly (cnt <= 64, typically a handful: for Gaussian-like rows ~0.5% of the
//     row falls in one bin), and a pass over the ~k staged entries writes the output in index
//     order. Rows with more than 64 candidates (many ties, all-equal or NaN rows, degenerate
//     ranges) take the radix select on the same scores: exact, only slower.
// Per element of a row this is ~20 warp instructions once instead of ~70 over five passes.
// With the cheaper selection a CTA takes 16 query tiles where the grid allows it (8 would
// stream every key tile from L2 twice as often).
constexpr int kBins = 256;          // value bins per row (the scan of warp_select_row)
constexpr int kCandMax = 64;        // threshold-bin candidates ranked in the fast path
constexpr int kSampleKeys = 8 * kMmaWarps;  // one 8-key mma group per warp
constexpr int kStageBatch = 4;      // 32-element chunks loaded before any is staged

// The score as the selection compares it: order_key(a) < order_key(b) <=> a' < b' for the
// canonical values a', b' (NaN as -inf, -0 as +0), and key equality is float equality.
__device__ __forceinline__ float canonical_score(float v) {
  if (v != v) v = -INFINITY;
  if (v == 0.0f) v = 0.0f;
  return v;
}

// Monotone non-decreasing in v for any finite lo and any scale >= 0 (inf included): see 3.
// The _rn intrinsics keep the compiler from contracting the two steps into an fma, so the
// epilogue and the selection compute the same bin.
__device__ __forceinline__ int value_bin(float v, float lo, float scale) {
  float x = __fmul_rn(__fsub_rn(v, lo), scale);
  x = fmaxf(x, 0.0f);  // fmaxf(NaN, 0) = 0
  x = fminf(x, float(kBins - 1));
  return __float2int_rz(x);
}

// Inverse of order_key for finite floats.
__device__ __forceinline__ float finite_from_key(std::uint32_t key) {
  return __uint_as_float((key & 0x80000000u) ? (key & 0x7fffffffu) : ~key);
}

// Bin parameters of one row from its sampled finite extremes (lo_key > hi_key: none sampled).
// Degenerate ranges give scale 0 (one bin: the exact fallback takes the row).
__device__ __forceinline__ void bin_params(std::uint32_t lo_key, std::uint32_t hi_key, float* lo,
                                           float* scale) {
  *lo = 0.0f;
  *scale = 0.0f;
  if (lo_key > hi_key) return;
  const float a = finite_from_key(lo_key), b = finite_from_key(hi_key);
  const float range = __fsub_rn(b, a);
  const float margin = __fmul_rn(range, 0.125f);
  const float span = __fadd_rn(range, __fmul_rn(margin, 2.0f));
  const float base = __fsub_rn(a, margin);
  *lo = a;
  if (!(span > 0.0f) || !(span <= FLT_MAX) || !(base >= -FLT_MAX)) return;
  *lo = base;
  *scale = __fdiv_rn(float(kBins - 1), span);
}

std::size_t topk_bins_row_stride(std::int64_t k_tiles) {
  // A multiple of 32 words plus 8: the epilogue's stores from the 8 rows of an mma fragment
  // land in different banks (2-way at most; an unpadded stride of 0 mod 32, like k_tiles = 1440,
  // is 8-way).
  return std::size_t((k_tiles + 31) / 32 * 32 + 8);
}

std::size_t topk_bins_smem_bytes(int rows, std::int64_t k_tiles) {
  return sizeof(float) * (std::size_t(rows) * topk_bins_row_stride(k_tiles) +
                          std::size_t(kMmaWarps) * kCandMax) +
         sizeof(int) * (std::size_t(rows) * kBins + 6 * kRowsMax);
}

// One warp writes the top `k` of the canonical scores row[0 .. n) as `offset + j`, ascending,
// into out[0, k) and -1 into out[k, max_k); hist is the row's histogram of value bins (it is
// also the scratch of the fallback), cand the warp's kCandMax floats. Overwrites row.
__device__ void bins_select_row(float* row, int n, int k, int max_k, int offset,
                                std::int32_t* out, std::int64_t out_stride, int* hist,
                                float* cand, float lo, float scale) {
  const int lane = threadIdx.x & 31;
  if (k >= n || k <= 0) {  // everything or nothing: no ranking needed
    const int take = k <= 0 ? 0 : n;
    for (int slot = lane; slot < max_k; slot += 32)
      out[slot * out_stride] = slot < take ? offset + slot : -1;
    return;
  }
  // The threshold bin (holding the k-th largest).
  const ThresholdBin found = find_threshold_bin(hist, k);
  const int bin = __shfl_sync(0xffffffffu, found.bin, found.owner);
  const int need = __shfl_sync(0xffffffffu, found.need, found.owner);
  const int cnt = __shfl_sync(0xffffffffu, found.count, found.owner);
  __syncwarp();  // every lane has read hist before the fallback reuses it
  if (cnt > kCandMax) {
    warp_select_row<float>([row](int j) { return row[j]; }, n, k, max_k, offset, out, out_stride,
                           hist);
    return;
  }
  // One pass: stage kept indices (bit 31 marks a candidate) in place, candidates' values to
  // cand. Stores go to positions below the end of the loaded batch, never past what is read.
  const unsigned lower = (1u << lane) - 1u;
  int kept = 0, seen = 0;
  for (int base = 0; base < n; base += 32 * kStageBatch) {
    float v[kStageBatch];
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int j = base + 32 * u + lane;
      v[u] = j < n ? row[j] : 0.0f;
    }
    // The stores below may overwrite what other lanes of this batch just read: order them.
    __syncwarp();
#pragma unroll
    for (int u = 0; u < kStageBatch; ++u) {
      const int j = base + 32 * u + lane;
      const int b = value_bin(v[u], lo, scale);
      const bool keep = j < n && b >= bin, eq = j < n && b == bin;
      const unsigned keep_bits = __ballot_sync(0xffffffffu, keep);
      const unsigned eq_bits = __ballot_sync(0xffffffffu, eq);
      if (keep)
        row[kept + __popc(keep_bits & lower)] =
            __int_as_float(int(unsigned(j) | (eq ? 0x80000000u : 0u)));
      if (eq) {
        const int pos = seen + __popc(eq_bits & lower);
        if (pos < kCandMax) cand[pos] = v[u];
      }
      kept += __popc(keep_bits);
      seen += __popc(eq_bits);
    }
  }
  __syncwarp();
  // Rank the candidates (index order = list order): candidate m is taken when fewer than
  // `need` candidates beat it (larger, or equal with a lower index).
  const float c0 = lane < cnt ? cand[lane] : 0.0f;
  const float c1 = lane + 32 < cnt ? cand[lane + 32] : 0.0f;
  int beat0 = 0, beat1 = 0;
  for (int m = 0; m < cnt; ++m) {
    const float x = cand[m];
    beat0 += (x > c0 || (x == c0 && m < lane)) ? 1 : 0;
    beat1 += (x > c1 || (x == c1 && m < lane + 32)) ? 1 : 0;
  }
  const unsigned taken_lo = __ballot_sync(0xffffffffu, lane < cnt && beat0 < need);
  const unsigned taken_hi = __ballot_sync(0xffffffffu, lane + 32 < cnt && beat1 < need);
  // The staged entries in index order: higher-bin scores always, candidates when taken.
  int written = 0, cand_seen = 0;
  for (int base = 0; base < kept; base += 32) {
    const int s = base + lane;
    const int e = s < kept ? __float_as_int(row[s]) : 0;
    const bool is_cand = e < 0;
    const unsigned cand_bits = __ballot_sync(0xffffffffu, is_cand);
    const int ord = cand_seen + __popc(cand_bits & lower);
    const unsigned taken_bit =
        ord < 32 ? (taken_lo >> ord) & 1u : (ord < 64 ? (taken_hi >> (ord - 32)) & 1u : 0u);
    const bool take = s < kept && (!is_cand || taken_bit);
    const unsigned take_bits = __ballot_sync(0xffffffffu, take);
    if (take) out[(written + __popc(take_bits & lower)) * out_stride] = offset + (e & 0x7fffffff);
    written += __popc(take_bits);
    cand_seen += __popc(cand_bits);
  }
  for (int slot = k + lane; slot < max_k; slot += 32) out[slot * out_stride] = -1;
}

// The tensor-core selection: the scores of the operand layout above (KeyStream), the sample
// (1.), the binned epilogue (2.) and bins_select_row (4.).
// `stride` is the row stride of the scores in shared memory (topk_bins_row_stride).
template <class T, int kD>
__global__ void __launch_bounds__(kMmaThreads, kD >= 128 ? 2 : 3)
    vsa_select_topk_bins_kernel(TopkParams p, int rows, int stride) {
  static_assert(kD % 32 == 0, "the head dim is consumed in 32-wide slices");
  constexpr int kSlices = kD / 32;
  extern __shared__ __align__(16) unsigned char smem[];
  float* scores = reinterpret_cast<float*>(smem);                    // [rows][stride]
  float* cand = scores + std::int64_t(rows) * stride;                // [8][kCandMax]
  int* hist = reinterpret_cast<int*>(cand + kMmaWarps * kCandMax);   // [rows][kBins]
  int* row_k0 = hist + rows * kBins;
  int* row_n = row_k0 + kRowsMax;
  auto* row_lo_key = reinterpret_cast<unsigned*>(row_n + kRowsMax);
  auto* row_hi_key = row_lo_key + kRowsMax;
  auto* row_bin_lo = reinterpret_cast<float*>(row_hi_key + kRowsMax);
  float* row_bin_scale = row_bin_lo + kRowsMax;

  const MmaTopkCta<T> cta(p, rows);
  const int tid = threadIdx.x, lane = cta.lane, warp = cta.warp, g = cta.g, q4 = cta.q4;
  const std::int64_t t0 = cta.t0, h = cta.h, b = cta.b;

  record_row_ranges(p, t0, rows, row_k0, row_n);
  for (int i = tid; i < rows * kBins; i += kMmaThreads) hist[i] = 0;
  if (tid < kRowsMax) {
    row_lo_key[tid] = 0xffffffffu;
    row_hi_key[tid] = 0u;
  }
  std::uint32_t a[2 * kSlices][4];
  load_query_operand<T, kSlices>(p, cta.q, t0, rows, g, q4, a);
  __syncthreads();
  int kmin, kmax;
  key_range_union(row_k0, row_n, rows, &kmin, &kmax);
  // This lane's two rows (g, g + 8) and their key ranges: a CTA that straddles videos scores
  // the union of its rows' ranges, but a row's histogram counts its own range only.
  const bool row_lo = g < rows, row_hi = g + 8 < rows;
  const int lo_begin = row_k0[g], lo_end = lo_begin + row_n[g];
  const int hi_begin = row_k0[g + 8], hi_end = hi_begin + row_n[g + 8];
  const float scale = float(p.scale);

  // The product's first keys are in flight during the sample.
  KeyStream<T, kD> keys(cta.k, p.k_stride[1], kmin, kmax, warp, g, q4);

  // 1. The sample: sample s is key kmin + s * (kmax - kmin) / kSampleKeys.
  const int span = kmax - kmin;
  if (span > 0) {
    auto sample_key = [&](int s) { return kmin + int(std::int64_t(s) * span / kSampleKeys); };
    uint4 sv[1][kSlices];
    const T* src = cta.k + std::int64_t(sample_key(warp * 8 + g)) * p.k_stride[1] + 8 * q4;
#pragma unroll
    for (int c = 0; c < kSlices; ++c) sv[0][c] = __ldg(reinterpret_cast<const uint4*>(src + 32 * c));
    float scored[1][4];
    score_key_groups<T, 1, kSlices>(a, sv, scored);
    const float(&acc)[4] = scored[0];
    std::uint32_t mn_lo = 0xffffffffu, mx_lo = 0u, mn_hi = 0xffffffffu, mx_hi = 0u;
#pragma unroll
    for (int col = 0; col < 2; ++col) {
      const int key = sample_key(warp * 8 + 2 * q4 + col);
      const float v_lo = acc[col] * scale, v_hi = acc[2 + col] * scale;
      if (key >= lo_begin && key < lo_end && fabsf(v_lo) <= FLT_MAX) {
        const std::uint32_t kk = order_key(v_lo);
        mn_lo = min(mn_lo, kk);
        mx_lo = max(mx_lo, kk);
      }
      if (key >= hi_begin && key < hi_end && fabsf(v_hi) <= FLT_MAX) {
        const std::uint32_t kk = order_key(v_hi);
        mn_hi = min(mn_hi, kk);
        mx_hi = max(mx_hi, kk);
      }
    }
#pragma unroll
    for (int off = 1; off < 4; off <<= 1) {  // the 4 lanes of a row
      mn_lo = min(mn_lo, __shfl_xor_sync(0xffffffffu, mn_lo, off));
      mx_lo = max(mx_lo, __shfl_xor_sync(0xffffffffu, mx_lo, off));
      mn_hi = min(mn_hi, __shfl_xor_sync(0xffffffffu, mn_hi, off));
      mx_hi = max(mx_hi, __shfl_xor_sync(0xffffffffu, mx_hi, off));
    }
    if (q4 == 0) {
      if (mn_lo <= mx_lo) {
        atomicMin(&row_lo_key[g], mn_lo);
        atomicMax(&row_hi_key[g], mx_lo);
      }
      if (mn_hi <= mx_hi) {
        atomicMin(&row_lo_key[g + 8], mn_hi);
        atomicMax(&row_hi_key[g + 8], mx_hi);
      }
    }
  }
  __syncthreads();
  if (tid < kRowsMax) bin_params(row_lo_key[tid], row_hi_key[tid], &row_bin_lo[tid], &row_bin_scale[tid]);
  __syncthreads();
  const float bin_lo_lo = row_bin_lo[g], bin_scale_lo = row_bin_scale[g];
  const float bin_lo_hi = row_bin_lo[g + 8], bin_scale_hi = row_bin_scale[g + 8];

  // 2. The product with the binned epilogue.
  keys.score_all(a, [&](int key, float lo, float hi) {
    if (row_lo) {
      const float v = canonical_score(lo * scale);
      scores[std::int64_t(g) * stride + (key - kmin)] = v;
      if (key >= lo_begin && key < lo_end)
        atomicAdd(&hist[g * kBins + value_bin(v, bin_lo_lo, bin_scale_lo)], 1);
    }
    if (row_hi) {
      const float v = canonical_score(hi * scale);
      scores[std::int64_t(g + 8) * stride + (key - kmin)] = v;
      if (key >= hi_begin && key < hi_end)
        atomicAdd(&hist[(g + 8) * kBins + value_bin(v, bin_lo_hi, bin_scale_hi)], 1);
    }
  });
  __syncthreads();
  // 4. One warp per row.
  for (int r = warp; r < rows; r += kMmaWarps) {
    const std::int64_t t = t0 + r;
    if (t >= p.q_tiles) break;
    const int n = row_n[r], want = row_topk(p, n);
    std::int32_t* out =
        p.index + b * p.index_stride[0] + h * p.index_stride[1] + t * p.index_stride[2];
    bins_select_row(scores + std::int64_t(r) * stride + (row_k0[r] - kmin), n, want,
                    int(p.max_k), row_k0[r], out, p.index_stride[3], hist + r * kBins,
                    cand + warp * kCandMax, row_bin_lo[r], row_bin_scale[r]);
    if (lane == 0)
      p.count[b * p.count_stride[0] + h * p.count_stride[1] + t * p.count_stride[2]] = want;
  }
}

// One warp per row of given scores, read straight from global memory (L1/L2 serve the passes).
template <class T>
__global__ void __launch_bounds__(kTopkThreads) vsa_topk_from_scores_kernel(TopkParams p) {
  using Acc = cuda_common::AccumulatorOf<T>;
  __shared__ int hist[kTopkThreads / 32][256];
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const std::int64_t t = std::int64_t(blockIdx.x) * (kTopkThreads / 32) + warp;
  const std::int64_t h = blockIdx.y, b = blockIdx.z;
  if (t >= p.q_tiles) return;  // whole warps only: the selection's shuffles stay complete
  const auto* row = static_cast<const T*>(p.scores) + b * p.scores_stride[0] +
                    h * p.scores_stride[1] + t * p.scores_stride[2];
  const int n = int(p.k_tiles);
  const int want = int(p.topk < n ? p.topk : n);
  std::int32_t* out = p.index + b * p.index_stride[0] + h * p.index_stride[1] + t * p.index_stride[2];
  warp_select_row<Acc>([row](int j) { return Io<T>::template load<Acc>(row[j]); }, n, want,
                       int(p.max_k), 0, out, p.index_stride[3], hist[warp]);
  if (lane == 0) p.count[b * p.count_stride[0] + h * p.count_stride[1] + t * p.count_stride[2]] = want;
}


constexpr const char* kSelectFn = "vidattn::select_topk_tiles";
constexpr const char* kFromScoresFn = "vidattn::topk_tiles_from_scores";

// Where a CUDA selection kernel cannot run: NotImplementedError, so that callers can fall back
// to CPU tensors.
[[noreturn]] void throw_smem_limit(std::int64_t k_tiles) {
  throw NotImplementedError(detail::concat(
      kSelectFn, ": too many key tiles per row for the CUDA selection's shared memory (", k_tiles,
      " key tiles); use CPU tensors or fewer key tiles"));
}

[[noreturn]] void throw_grid_limit(const char* function, std::int64_t batch, std::int64_t heads) {
  throw NotImplementedError(detail::concat(
      function, ": the CUDA selection supports a batch and heads of at most 65535 each, got B = ",
      batch, ", H = ", heads, "; use CPU tensors"));
}

// A failed attribute call also sets the thread's last error: it is cleared here, so that it
// does not surface again at the launch check.
template <class Kernel>
void set_kernel_attribute(Kernel kernel, cudaFuncAttribute attribute, int value) {
  const cudaError_t status = cudaFuncSetAttribute(kernel, attribute, value);
  if (status != cudaSuccess) cudaGetLastError();
  cuda_common::check_cuda(status, "vidattn::select_topk_tiles: cudaFuncSetAttribute");
}

// The tensor-core selection (bf16 / fp16 T, head dim 32, 64, 128 or 256, aligned rows).
template <class T>
void launch_bins_selection(const TopkParams& p, int max_smem, int sms, cudaStream_t stream) {
  // 16 query tiles per CTA unless the grid would then leave SMs idle (each row's scores are
  // computed the same way whatever the grouping; fewer rows per CTA stream every key tile from
  // L2 more often); halved further while the rows of scores do not fit in shared memory.
  const bool few = ((p.q_tiles + kRowsMax - 1) / kRowsMax) * p.heads_q * p.batch < sms;
  int rows = few ? kRowsMax / 2 : kRowsMax;
  while (rows > 1 && topk_bins_smem_bytes(rows, p.k_tiles) > std::size_t(max_smem)) rows /= 2;
  const std::size_t bytes = topk_bins_smem_bytes(rows, p.k_tiles);
  if (bytes > std::size_t(max_smem)) throw_smem_limit(p.k_tiles);
  const int stride = int(topk_bins_row_stride(p.k_tiles));
  auto launch = [&](auto kernel) {
    set_kernel_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    // Two CTAs of 16 rows x 1448 key tiles (Wan 720p) need the largest carveout.
    set_kernel_attribute(kernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                         int(cudaSharedmemCarveoutMaxShared));
    const dim3 grid(unsigned((p.q_tiles + rows - 1) / rows), unsigned(p.heads_q),
                    unsigned(p.batch));
    kernel<<<grid, kMmaThreads, bytes, stream>>>(p, rows, stride);
  };
  switch (p.head_dim) {
    case 32: return launch(vsa_select_topk_bins_kernel<T, 32>);
    case 64: return launch(vsa_select_topk_bins_kernel<T, 64>);
    case 128: return launch(vsa_select_topk_bins_kernel<T, 128>);
    default: return launch(vsa_select_topk_bins_kernel<T, 256>);
  }
}

// The SIMT selection (any float T, any head dim, any alignment).
template <class T>
void launch_simt_selection(const TopkParams& p, int max_smem, int sms, cudaStream_t stream) {
  using Acc = cuda_common::AccumulatorOf<T>;
  // Query tiles per CTA: 16, or 8 when that is needed to give every SM a few CTAs (each row's
  // scores are computed the same way whatever the grouping); halved further while the rows of
  // scores do not fit in shared memory.
  const bool half = ((p.q_tiles + kRowsMax - 1) / kRowsMax) * p.heads_q * p.batch < 4 * sms;
  int rows = half ? kRowsMax / 2 : kRowsMax;
  while (rows > 1 && topk_smem_bytes<Acc>(rows, p.k_tiles) > std::size_t(max_smem)) rows /= 2;
  const std::size_t bytes = topk_smem_bytes<Acc>(rows, p.k_tiles);
  if (bytes > std::size_t(max_smem)) throw_smem_limit(p.k_tiles);
  // 16-byte loads of k when every run of the head dim they read is aligned.
  const std::int64_t run = 16 / std::int64_t(sizeof(T));
  const bool vec = !std::is_same<T, double>::value && p.head_dim % run == 0 &&
                   p.k_stride[0] % run == 0 && p.k_stride[1] % run == 0 &&
                   p.k_stride[2] % run == 0 && aligned(p.k, 16);
  auto launch = [&](auto kernel) {
    set_kernel_attribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(bytes));
    const dim3 grid(unsigned((p.q_tiles + rows - 1) / rows), unsigned(p.heads_q),
                    unsigned(p.batch));
    kernel<<<grid, kTopkThreads, bytes, stream>>>(p, rows);
  };
  if (rows <= kRowsMax / 2) {
    if (vec) launch(vsa_select_topk_kernel<T, 2, true>);
    else launch(vsa_select_topk_kernel<T, 2, false>);
  } else {
    if (vec) launch(vsa_select_topk_kernel<T, 4, true>);
    else launch(vsa_select_topk_kernel<T, 4, false>);
  }
}

// q2k_index / q2k_count and the topk of either entry point.
void set_outputs(TopkParams& p, const TensorView& q2k_index, const TensorView& q2k_count,
                 std::int64_t topk) {
  p.topk = topk;
  p.max_k = q2k_index.shape[3];
  p.index = static_cast<std::int32_t*>(q2k_index.data);
  for (int d = 0; d < 4; ++d) p.index_stride[d] = q2k_index.stride[d];
  p.count = static_cast<std::int32_t*>(q2k_count.data);
  for (int d = 0; d < 3; ++d) p.count_stride[d] = q2k_count.stride[d];
}

}  // namespace
}  // namespace vidattn::cuda_vsa

namespace vidattn::detail {

void cuda_select_topk_tiles(const TensorView& q_pooled, const TensorView& k_pooled,
                            const TopkOptions& options, double scale,
                            const TensorView& q2k_index, const TensorView& q2k_count) {
  using namespace cuda_vsa;
  TopkParams p;
  set_outputs(p, q2k_index, q2k_count, options.topk);
  p.q = q_pooled.data, p.k = k_pooled.data;
  p.batch = q_pooled.shape[0], p.q_tiles = q_pooled.shape[1], p.heads_q = q_pooled.shape[2];
  p.k_tiles = k_pooled.shape[1], p.heads_kv = k_pooled.shape[2];
  p.head_dim = q_pooled.shape[3];
  for (int d = 0; d < 3; ++d) {
    p.q_stride[d] = q_pooled.stride[d];
    p.k_stride[d] = k_pooled.stride[d];
  }
  p.scale = scale;
  p.has_sparsity = options.sparsity.has_value();
  p.sparsity = options.sparsity.value_or(0.0);
  if (options.cu_tiles_q) {
    p.cu_tiles_q = static_cast<const std::int32_t*>(options.cu_tiles_q->data);
    p.cu_tiles_k = static_cast<const std::int32_t*>(options.cu_tiles_k->data);
    p.cu_q_stride = options.cu_tiles_q->stride[0], p.cu_k_stride = options.cu_tiles_k->stride[0];
    p.num_videos = options.cu_tiles_q->shape[0] - 1;
  }
  if (p.batch * p.heads_q * p.q_tiles == 0) return;
  if (p.batch > 65535 || p.heads_q > 65535) throw_grid_limit(kSelectFn, p.batch, p.heads_q);
  const int device = q_pooled.device.index;
  const cuda_common::DeviceGuard guard(device);
  int max_smem = 0;
  cuda_common::check_cuda(
      cudaDeviceGetAttribute(&max_smem, cudaDevAttrMaxSharedMemoryPerBlockOptin, device),
      "cudaDeviceGetAttribute (shared memory per block)");
  const int sms = cuda_common::current_sm_count();
  auto stream = static_cast<cudaStream_t>(options.stream);
  // Tensor-core scores: bf16 / fp16, a head dim of 32, 64, 128 or 256, and every 16-byte run of
  // a q or k row that the kernel loads aligned (pointers and strides in multiples of 8 elements).
  const DType dtype = q_pooled.dtype;
  const bool mma_dtype = dtype == DType::kFloat16 || dtype == DType::kBFloat16;
  const bool mma_dim =
      p.head_dim == 32 || p.head_dim == 64 || p.head_dim == 128 || p.head_dim == 256;
  bool mma_aligned = aligned(p.q, 16) && aligned(p.k, 16);
  for (int d = 0; d < 3 && mma_aligned; ++d)
    mma_aligned = p.q_stride[d] % 8 == 0 && p.k_stride[d] % 8 == 0;
  if (mma_dtype && mma_dim && mma_aligned) {
    if (dtype == DType::kFloat16) launch_bins_selection<__half>(p, max_smem, sms, stream);
    else launch_bins_selection<__nv_bfloat16>(p, max_smem, sms, stream);
  } else {
    cuda_common::dispatch_float_dtype(dtype, [&](auto tag) {
      launch_simt_selection<decltype(tag)>(p, max_smem, sms, stream);
    });
  }
  cuda_common::check_last_launch("vidattn::select_topk_tiles kernel launch");
}

void cuda_topk_tiles_from_scores(const TensorView& scores, std::int64_t topk,
                                 const TensorView& q2k_index, const TensorView& q2k_count,
                                 void* stream) {
  using namespace cuda_vsa;
  TopkParams p;
  set_outputs(p, q2k_index, q2k_count, topk);
  p.scores = scores.data;
  p.batch = scores.shape[0], p.heads_q = scores.shape[1], p.heads_kv = scores.shape[1];
  p.q_tiles = scores.shape[2], p.k_tiles = scores.shape[3];
  for (int d = 0; d < 3; ++d) p.scores_stride[d] = scores.stride[d];
  // The kernel counts a row's key tiles in an int.
  if (p.k_tiles > INT32_MAX)
    throw_value_error(kFromScoresFn, ": at most 2^31 - 1 key tiles, got ", p.k_tiles);
  if (p.batch * p.heads_q * p.q_tiles == 0) return;
  if (p.batch > 65535 || p.heads_q > 65535) throw_grid_limit(kFromScoresFn, p.batch, p.heads_q);
  const cuda_common::DeviceGuard guard(scores.device.index);
  constexpr int kRowsPerBlock = kTopkThreads / 32;
  const dim3 grid(unsigned((p.q_tiles + kRowsPerBlock - 1) / kRowsPerBlock), unsigned(p.heads_q),
                  unsigned(p.batch));
  cuda_common::dispatch_float_dtype(scores.dtype, [&](auto tag) {
    using T = decltype(tag);
    vsa_topk_from_scores_kernel<T>
        <<<grid, kTopkThreads, 0, static_cast<cudaStream_t>(stream)>>>(p);
  });
  cuda_common::check_last_launch("vidattn::topk_tiles_from_scores kernel launch");
}

}  // namespace vidattn::detail
