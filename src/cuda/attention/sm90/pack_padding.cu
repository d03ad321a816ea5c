// Key padding as varlen (pack_padding.h): ranks of the valid rows, varlen offsets,
// row gathers into packed buffers and the scatter of the output back. Memory-bound helpers;
// at Wan 480p they move ~1 GB against ~10 ms of attention.
#include "pack_padding.h"

#include <cstdint>
#include <cstdlib>
#include <limits>

#include "cuda/common/workspace.h"
#include "cuda/common/check.h"

namespace vidattn::cuda_sm90 {
namespace {

using cuda_common::check_cuda;

constexpr int kScanThreads = 1024;
constexpr int kCopyThreads = 256;
// Rows after the last packed row that are zeroed: a sequence's partial last block loads up to
// a block's rows past its end (the next sequence's rows, or these), and the masked products of
// those rows must stay finite (0 * NaN would reach the output through P V).
constexpr int kTailRows = 256;

// Inclusive sum of x over the first k lanes of the warp, for lane k.
__device__ __forceinline__ int warp_inclusive_sum(int x, int lane) {
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const int y = __shfl_up_sync(0xffffffffu, x, o);
    if (lane >= o) x += y;
  }
  return x;
}

// One step of a scan over kScanThreads values, one per thread of the CTA: returns the sum of
// the values of this thread and the ones before it, and sets `total` to the step's sum.
// warp_sums: kScanThreads / 32 ints of shared memory. Every thread must call it.
__device__ __forceinline__ int block_inclusive_sum(int x, int* warp_sums, int& total) {
  constexpr int kWarps = kScanThreads / 32;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  x = warp_inclusive_sum(x, lane);
  if (lane == 31) warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) warp_sums[lane] = warp_inclusive_sum(warp_sums[lane], lane);
  __syncthreads();
  const int inclusive = (warp > 0 ? warp_sums[warp - 1] : 0) + x;
  total = warp_sums[kWarps - 1];
  __syncthreads();  // warp_sums is rewritten by the next step
  return inclusive;
}

// pos[b * S + s]: how many valid rows of sequence b come before row s, or -1 where s is
// padding; cu[b + 1]: sequence b's valid rows. One CTA per sequence walks its mask in steps
// of kScanThreads rows.
__global__ void __launch_bounds__(kScanThreads)
    mask_ranks_kernel(const std::uint8_t* mask, std::int64_t mask_batch, std::int64_t mask_row,
                      std::int64_t S, std::int32_t* pos, std::int32_t* cu) {
  __shared__ int warp_sums[kScanThreads / 32];
  const int b = blockIdx.x;
  const std::uint8_t* m = mask + b * mask_batch;
  std::int32_t* ranks = pos + b * S;
  int carry = 0;
  for (std::int64_t base = 0; base < S; base += kScanThreads) {
    const std::int64_t s = base + threadIdx.x;
    const bool valid = s < S && m[s * mask_row] != 0;
    int step = 0;
    const int upto = block_inclusive_sum(valid ? 1 : 0, warp_sums, step);
    if (s < S) ranks[s] = valid ? carry + upto - 1 : -1;
    carry += step;
  }
  if (threadIdx.x == 0) cu[b + 1] = carry;
}

// cu[0 .. B]: uniform > 0: b * uniform (every row valid); else the running sum of the counts
// in cu[1 .. B] (written by mask_ranks_kernel), in place, after cu[0] = 0. One CTA.
__global__ void __launch_bounds__(kScanThreads)
    offsets_kernel(std::int32_t* cu, int B, std::int32_t uniform) {
  __shared__ int warp_sums[kScanThreads / 32];
  if (uniform > 0) {
    for (int b = threadIdx.x; b <= B; b += kScanThreads) cu[b] = b * uniform;
    return;
  }
  int carry = 0;
  for (int base = 0; base < B; base += kScanThreads) {
    const int i = base + threadIdx.x;
    int step = 0;
    const int upto = block_inclusive_sum(i < B ? cu[i + 1] : 0, warp_sums, step);
    if (i < B) cu[i + 1] = carry + upto;
    carry += step;
  }
  if (threadIdx.x == 0) cu[0] = 0;
}

// Byte strides of a [B, S, H, D] tensor; at(): the offset of 16-byte piece c of (b, s, h).
struct ByteStrides {
  std::int64_t batch = 0, row = 0, head = 0;
  __device__ __forceinline__ std::int64_t at(int b, std::int64_t s, int h, int c) const {
    return b * batch + s * row + h * head + c * 16;
  }
};

// A [B, S, H, D] tensor and its packed [B * S, H, D] contiguous buffer.
struct RowSource {
  const char* src = nullptr;
  ByteStrides strides;
  char* dst = nullptr;
};

// Tensors of one side (query or key) gathered by one launch: the same heads and map.
struct RowSources {
  static constexpr int kMax = 2;
  RowSource t[kMax];
  int count = 0;
};

// Row of sequence b's row s in the packed buffers, or -1 for padding.
__device__ __forceinline__ std::int64_t packed_row(const std::int32_t* pos, const std::int32_t* cu,
                                                   int b, std::int64_t s, std::int64_t S) {
  const std::int64_t r = pos ? pos[b * S + s] : s;
  return r < 0 ? -1 : cu[b] + r;
}

// One warp per row: copies each valid row of every source to its packed row in 16-byte
// pieces; the warps past B * S zero kTailRows rows after the last packed row.
__global__ void __launch_bounds__(kCopyThreads)
    gather_rows_kernel(RowSources in, const std::int32_t* pos, const std::int32_t* cu, int B,
                       std::int64_t S, int heads, int head_vecs) {
  const int lane = threadIdx.x & 31;
  const std::int64_t rows = static_cast<std::int64_t>(B) * S;
  const int row_vecs = heads * head_vecs;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kCopyThreads / 32);
  const std::int64_t first_warp =
      (static_cast<std::int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x) / 32;
  for (std::int64_t item = first_warp; item < rows + kTailRows; item += warps) {
    const bool tail = item >= rows;
    const int bi = tail ? 0 : static_cast<int>(item / S);
    const std::int64_t s = item - bi * S;
    const std::int64_t t = tail ? cu[B] + (item - rows) : packed_row(pos, cu, bi, s, S);
    if (t < 0 || t >= rows) continue;
#pragma unroll
    for (int n = 0; n < RowSources::kMax; ++n) {  // unrolled: in.t stays in the parameters
      if (n >= in.count) break;
      const RowSource& r = in.t[n];
      auto* dst = reinterpret_cast<uint4*>(r.dst) + t * row_vecs;
      for (int j = lane; j < row_vecs; j += 32) {
        const int h = j / head_vecs, c = j - h * head_vecs;
        dst[j] = tail ? make_uint4(0, 0, 0, 0)
                      : *reinterpret_cast<const uint4*>(r.src + r.strides.at(bi, s, h, c));
      }
    }
  }
}

struct OutputScatter {
  const char* packed_out = nullptr;  // null: the kernel wrote out in place
  char* out = nullptr;
  ByteStrides out_strides;
  const float* packed_lse = nullptr;                       // [H, B * S]
  float* lse = nullptr;
  std::int64_t lse_batch = 0, lse_row = 0, lse_head = 0;  // elements
};

// One warp per row of the batched output: its packed row (or zeros on a padded query row)
// and its LSE per head (-inf on padded rows).
__global__ void __launch_bounds__(kCopyThreads)
    scatter_output_kernel(OutputScatter o, const std::int32_t* pos, const std::int32_t* cu, int B,
                          std::int64_t S, int heads, int head_vecs) {
  const int lane = threadIdx.x & 31;
  const std::int64_t rows = static_cast<std::int64_t>(B) * S;
  const int row_vecs = heads * head_vecs;
  const std::int64_t warps = static_cast<std::int64_t>(gridDim.x) * (kCopyThreads / 32);
  const std::int64_t first_warp =
      (static_cast<std::int64_t>(blockIdx.x) * kCopyThreads + threadIdx.x) / 32;
  for (std::int64_t item = first_warp; item < rows; item += warps) {
    const int bi = static_cast<int>(item / S);
    const std::int64_t s = item - bi * S;
    const std::int64_t t = packed_row(pos, cu, bi, s, S);
    if (o.packed_out || t < 0) {
      for (int j = lane; j < row_vecs; j += 32) {
        const int h = j / head_vecs, c = j - h * head_vecs;
        *reinterpret_cast<uint4*>(o.out + o.out_strides.at(bi, s, h, c)) =
            t < 0 ? make_uint4(0, 0, 0, 0)
                  : reinterpret_cast<const uint4*>(o.packed_out)[t * row_vecs + j];
      }
    }
    for (int h = lane; h < heads; h += 32)
      o.lse[bi * o.lse_batch + s * o.lse_row + h * o.lse_head] =
          t < 0 ? -std::numeric_limits<float>::infinity() : o.packed_lse[h * rows + t];
  }
}

// CTAs of a copy kernel with one warp per item: every item, at most 16 CTAs per SM.
int copy_grid(std::int64_t warps_wanted, int sms) {
  const std::int64_t blocks = (warps_wanted + kCopyThreads / 32 - 1) / (kCopyThreads / 32);
  const std::int64_t cap = static_cast<std::int64_t>(sms) * 16;
  return static_cast<int>(blocks < cap ? (blocks > 0 ? blocks : 1) : cap);
}

// Carves one stream-ordered allocation into 256-byte aligned pieces.
struct Carve {
  std::size_t bytes = 0;
  std::size_t take(std::size_t n) {
    const std::size_t at = bytes;
    bytes += (n + 255) / 256 * 256;
    return at;
  }
};

}  // namespace

bool pack_padding_fits(const AttentionParams& p) {
  return p.key_mask != nullptr && !p.causal && !p.varlen;
}

bool forward_padding_packed(const AttentionParams& p, int head_dim, std::size_t elem_bytes,
                            cudaStream_t stream,
                            const std::function<bool(const AttentionParams&)>& run_varlen) {
  const int B = p.batch;
  const std::int64_t Sq = p.seqlen_q, Sk = p.seqlen_k;
  const std::int64_t rows_q = B * Sq, rows_k = B * Sk;
  // q and out are read and written in place when every query row is valid and the rows of
  // consecutive sequences follow each other (varlen row t = b * Sq + s).
  const bool q_in_place =
      p.query_mask == nullptr &&
      (B == 1 || (p.q_strides.batch == Sq * p.q_strides.row &&
                  p.out_strides.batch == Sq * p.out_strides.row));
  const std::size_t q_row_bytes = static_cast<std::size_t>(p.heads_q) * head_dim * elem_bytes;
  const std::size_t k_row_bytes = static_cast<std::size_t>(p.heads_kv) * head_dim * elem_bytes;

  Carve carve;
  const std::size_t at_cu_q = carve.take((B + 1) * sizeof(std::int32_t));
  const std::size_t at_cu_k = carve.take((B + 1) * sizeof(std::int32_t));
  const std::size_t at_pos_k = carve.take(rows_k * sizeof(std::int32_t));
  const std::size_t at_pos_q = p.query_mask ? carve.take(rows_q * sizeof(std::int32_t)) : 0;
  const std::size_t at_k = carve.take(rows_k * k_row_bytes);
  const std::size_t at_v = carve.take(rows_k * k_row_bytes);
  const std::size_t at_q = q_in_place ? 0 : carve.take(rows_q * q_row_bytes);
  const std::size_t at_out = q_in_place ? 0 : carve.take(rows_q * q_row_bytes);
  const std::size_t at_lse = carve.take(rows_q * p.heads_q * sizeof(float));

  // Out of memory: the masked kernel needs no workspace.
  const auto workspace = cuda_common::DeviceWorkspace::try_allocate(carve.bytes, stream);
  char* ws = workspace.as<char>();
  if (ws == nullptr) return false;
  auto* cu_q = reinterpret_cast<std::int32_t*>(ws + at_cu_q);
  auto* cu_k = reinterpret_cast<std::int32_t*>(ws + at_cu_k);
  auto* pos_k = reinterpret_cast<std::int32_t*>(ws + at_pos_k);
  auto* pos_q = p.query_mask ? reinterpret_cast<std::int32_t*>(ws + at_pos_q) : nullptr;
  auto* packed_lse = reinterpret_cast<float*>(ws + at_lse);
  const int head_vecs = static_cast<int>(head_dim * elem_bytes / 16);
  const auto byte_strides = [&](const RowStrides& st) {
    const auto e = static_cast<std::int64_t>(elem_bytes);
    return ByteStrides{st.batch * e, st.row * e, st.head * e};
  };
  const int sms = cuda_common::current_sm_count();

  mask_ranks_kernel<<<B, kScanThreads, 0, stream>>>(p.key_mask, p.key_mask_batch,
                                                    p.key_mask_row, Sk, pos_k, cu_k);
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(cu_k, B, 0);
  if (p.query_mask)
    mask_ranks_kernel<<<B, kScanThreads, 0, stream>>>(p.query_mask, p.query_mask_batch,
                                                      p.query_mask_row, Sq, pos_q, cu_q);
  const std::int32_t every_row = p.query_mask ? 0 : static_cast<std::int32_t>(Sq);
  offsets_kernel<<<1, kScanThreads, 0, stream>>>(cu_q, B, every_row);
  RowSources kv;
  kv.t[0] = {static_cast<const char*>(p.k), byte_strides(p.k_strides), ws + at_k};
  kv.t[1] = {static_cast<const char*>(p.v), byte_strides(p.v_strides), ws + at_v};
  kv.count = 2;
  gather_rows_kernel<<<copy_grid(rows_k + kTailRows, sms), kCopyThreads, 0, stream>>>(
      kv, pos_k, cu_k, B, Sk, p.heads_kv, head_vecs);
  if (!q_in_place) {
    RowSources q;
    q.t[0] = {static_cast<const char*>(p.q), byte_strides(p.q_strides), ws + at_q};
    q.count = 1;
    gather_rows_kernel<<<copy_grid(rows_q + kTailRows, sms), kCopyThreads, 0, stream>>>(
        q, pos_q, cu_q, B, Sq, p.heads_q, head_vecs);
  }
  check_cuda(cudaGetLastError(), "packing the padded rows");

  AttentionParams vp = p;
  vp.varlen = true;
  vp.key_mask = nullptr;
  vp.query_mask = nullptr;
  vp.cu_seqlens_q = cu_q;
  vp.cu_seqlens_k = cu_k;
  vp.cu_seqlens_q_stride = vp.cu_seqlens_k_stride = 1;
  const std::int64_t k_row = static_cast<std::int64_t>(p.heads_kv) * head_dim;
  const std::int64_t q_row = static_cast<std::int64_t>(p.heads_q) * head_dim;
  vp.k = ws + at_k;
  vp.v = ws + at_v;
  vp.k_strides = vp.v_strides = {0, k_row, head_dim};
  if (q_in_place) {
    vp.q_strides = {0, p.q_strides.row, p.q_strides.head};
    vp.out_strides = {0, p.out_strides.row, p.out_strides.head};
  } else {
    vp.q = ws + at_q;
    vp.out = ws + at_out;
    vp.q_strides = vp.out_strides = {0, q_row, head_dim};
  }
  vp.lse = packed_lse;
  vp.lse_strides = {0, 1, rows_q};
  vp.rows_q = rows_q;
  vp.rows_k = rows_k;
  vp.aligned16 = true;  // packed rows; q in place was checked by the caller (TMA)
  const bool launched = run_varlen(vp);
  if (launched) {
    OutputScatter o;
    o.packed_out = q_in_place ? nullptr : ws + at_out;
    o.out = static_cast<char*>(p.out);
    o.out_strides = byte_strides(p.out_strides);
    o.packed_lse = packed_lse;
    o.lse = p.lse;
    o.lse_batch = p.lse_strides.batch;
    o.lse_row = p.lse_strides.row;
    o.lse_head = p.lse_strides.head;
    scatter_output_kernel<<<copy_grid(rows_q, sms), kCopyThreads, 0, stream>>>(
        o, pos_q, cu_q, B, Sq, p.heads_q, head_vecs);
    check_cuda(cudaGetLastError(), "scattering the packed output");
  }
  return launched;
}

}  // namespace vidattn::cuda_sm90
