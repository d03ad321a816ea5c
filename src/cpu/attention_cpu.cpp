// CPU attention: blocked online softmax (flash style), O(S * D) extra memory, threads over
// (batch, head, query block) in the forward and over key blocks / query blocks in the two
// backward passes. Every output element is owned by one task, so results are deterministic
// whatever the thread count.
//
// One mainloop serves dense and block-sparse attention; a key-visit policy (DenseVisit,
// SparseVisit) says which key spans a query block visits (dense: consecutive key blocks up to
// the causal bound; block-sparse: the key tiles the query tile selected) and, for the dK/dV
// pass, which query blocks visit a key block (dense: all, causal-skipped; block-sparse: the
// transposed k2q index).
//
// The inputs are first packed into contiguous [heads][rows][dim] buffers in the accumulator
// type (float, or double for float64 inputs): this settles dtype conversion and arbitrary
// strides once, in O(S * D), before the O(S^2 * D) block products, which then run on BLAS.
#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <limits>
#include <utility>
#include <vector>

#include "../core/backends.h"
#include "../core/vsa_backends.h"
#include "../core/check.h"
#include "cpu_math.h"
#include "microkernels_avx2.h"
#include "vsa_cpu.h"

namespace vidattn::detail {
namespace {

using cpu::Storage;
using cpu::visit_float_dtype;
#if VIDATTN_CPU_AVX2
namespace avx2 = cpu::avx2;
#endif

#if VIDATTN_CPU_AVX2
constexpr bool kHaveAvx2 = true;
#else
constexpr bool kHaveAvx2 = false;
#endif
// The float path computes logits and P @ V with the AVX2 register tiles (k packed in
// panels); float64, and machines without AVX2, use BLAS.
template <class Acc>
constexpr bool kUseTiles = kHaveAvx2 && std::is_same_v<Acc, float>;

// Block sizes: the forward and both backward passes use the same grid, so the logits they
// compute for one (query, key) pair are bit-identical.
constexpr int kBlockQ = 128;

// Elementwise passes (packing) smaller than this run on the calling thread: on a busy machine
// each parallel region can cost a scheduler time slice, far more than the work itself.
constexpr std::int64_t kMinParallelElements = std::int64_t(1) << 16;
constexpr int kBlockK = 256;

int threads_for(int threads, std::size_t tasks) {
  return static_cast<int>(std::clamp<std::size_t>(tasks, 1, static_cast<std::size_t>(threads)));
}

// Where row r (a token) and head h of a [B, S, H, ...] or varlen [T, H, ...] tensor live;
// rows count tokens of all sequences back to back.
struct RowLayout {
  std::int64_t rows_per_batch = 1;
  std::int64_t batch_stride = 0, row_stride = 0, head_stride = 0;
  std::int64_t offset(std::int64_t r, std::int64_t h) const {
    return (r / rows_per_batch) * batch_stride + (r % rows_per_batch) * row_stride +
           h * head_stride;
  }
};

RowLayout token_rows(const TensorView& t, bool varlen) {
  if (varlen) return {std::max<std::int64_t>(t.shape[0], 1), 0, t.stride[0], t.stride[1]};
  return {std::max<std::int64_t>(t.shape[1], 1), t.stride[0], t.stride[1], t.stride[2]};
}

// lse is [B, H, Sq] or [H, Tq].
RowLayout lse_rows(const TensorView& t, bool varlen) {
  if (varlen) return {std::max<std::int64_t>(t.shape[1], 1), 0, t.stride[1], t.stride[0]};
  return {std::max<std::int64_t>(t.shape[2], 1), t.stride[0], t.stride[2], t.stride[1]};
}

struct Sequences {
  std::vector<std::int64_t> q_start, q_len, k_start, k_len;
};

void read_offsets(const ArgChecker& check, const TensorView& cu, const char* name,
                  std::int64_t total, std::int64_t max_len, std::vector<std::int64_t>& start,
                  std::vector<std::int64_t>& len) {
  const auto* data = static_cast<const std::int32_t*>(cu.data);
  auto at = [&](std::int64_t i) { return std::int64_t(data[i * cu.stride[0]]); };
  check_cu_seqlens(check, name, cu.shape[0], at, total, max_len);
  const std::int64_t n = cu.shape[0] - 1;
  start.resize(n), len.resize(n);
  for (std::int64_t i = 0; i < n; ++i) start[i] = at(i), len[i] = at(i + 1) - at(i);
}

Sequences resolve_sequences(const ArgChecker& check, const AttentionProblem& p,
                            const TensorView& q, const TensorView& k,
                            const AttentionOptions& o) {
  Sequences s;
  if (p.varlen) {
    read_offsets(check, *o.cu_seqlens_q, "cu_seqlens_q", q.shape[0], p.seqlen_q, s.q_start,
                 s.q_len);
    read_offsets(check, *o.cu_seqlens_k, "cu_seqlens_k", k.shape[0], p.seqlen_k, s.k_start,
                 s.k_len);
    return s;
  }
  for (std::int64_t b = 0; b < p.batch; ++b) {
    s.q_start.push_back(b * p.seqlen_q), s.q_len.push_back(p.seqlen_q);
    s.k_start.push_back(b * p.seqlen_k), s.k_len.push_back(p.seqlen_k);
  }
  return s;
}

// Packs [rows, heads, dim] of a strided tensor into contiguous [heads][rows][dim].
template <class Acc>
std::vector<Acc> pack(const char* fn, const char* what, const TensorView& t, bool varlen,
                      std::int64_t rows, std::int64_t heads, std::int64_t dim, int threads,
                      Acc mul = Acc(1)) {
  std::vector<Acc> out = cpu::working_buffer<Acc>(fn, what, rows * heads * dim);
  const RowLayout layout = token_rows(t, varlen);
  visit_float_dtype(t.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    const auto* src = static_cast<const typename S::type*>(t.data);
#pragma omp parallel for num_threads(threads) schedule(static) \
    if (heads * rows * dim >= kMinParallelElements)
    for (std::int64_t hr = 0; hr < heads * rows; ++hr) {
      const std::int64_t h = hr / rows, r = hr % rows;
      const auto* in = src + layout.offset(r, h);
      Acc* o = out.data() + hr * dim;
      for (std::int64_t d = 0; d < dim; ++d) o[d] = S::template load<Acc>(in[d]) * mul;
    }
  });
  return out;
}

std::vector<std::uint8_t> pack_mask(const std::optional<TensorView>& mask, std::int64_t batch,
                                    std::int64_t len) {
  std::vector<std::uint8_t> valid(static_cast<std::size_t>(batch * len), 1);
  if (!mask) return valid;
  const auto* m = static_cast<const std::uint8_t*>(mask->data);
  for (std::int64_t b = 0; b < batch; ++b)
    for (std::int64_t s = 0; s < len; ++s)
      valid[b * len + s] = m[b * mask->stride[0] + s * mask->stride[1]] != 0;
  return valid;
}

template <class Acc>
void store_row(const TensorView& t, std::int64_t offset, const Acc* src, std::int64_t n,
               Acc mul) {
  visit_float_dtype(t.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    auto* dst = static_cast<typename S::type*>(t.data) + offset;
    for (std::int64_t d = 0; d < n; ++d) dst[d] = S::template store<Acc>(src[d] * mul);
  });
}

void store_zero_row(const TensorView& t, std::int64_t offset, std::int64_t n) {
  visit_float_dtype(t.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    auto* dst = static_cast<typename S::type*>(t.data) + offset;
    for (std::int64_t d = 0; d < n; ++d) dst[d] = S::template store<float>(0.0f);
  });
}

void store_scalar(const TensorView& t, std::int64_t offset, double value) {
  if (t.dtype == DType::kFloat64)
    static_cast<double*>(t.data)[offset] = value;
  else
    static_cast<float*>(t.data)[offset] = static_cast<float>(value);
}

// Packed inputs of one call: q (pre-multiplied by the softmax scale), k, v as contiguous
// [H][rows][D] in the accumulator type, and the sequences that rows belong to.
template <class Acc>
struct Context {
  const char* function;  // the entry point, for messages
  Sequences seq;
  std::int64_t rows_q, rows_k;  // token rows of q and of k/v
  std::int64_t heads_q, heads_kv, head_dim, head_dim_v;
  std::vector<Acc> q, k, v;     // [H][rows][D]
  int threads;

  Context(const char* fn, Sequences sequences, const TensorView& qt, const TensorView& kt,
          const TensorView& vt, bool varlen, double scale, int num_threads,
          const std::optional<TensorView>& key_mask = std::nullopt,
          const std::optional<TensorView>& query_mask = std::nullopt)
      : function(fn),
        seq(std::move(sequences)),
        rows_q(qt.shape[0] * (varlen ? 1 : qt.shape[1])),
        rows_k(kt.shape[0] * (varlen ? 1 : kt.shape[1])),
        heads_q(qt.shape[qt.ndim - 2]),
        heads_kv(kt.shape[kt.ndim - 2]),
        head_dim(qt.shape[qt.ndim - 1]),
        head_dim_v(vt.shape[vt.ndim - 1]),
        threads(num_threads > 0 ? num_threads : omp_get_max_threads()) {
    // q is packed pre-multiplied by the softmax scale: the logits come straight out of the
    // block product, and forward and backward share this one rounding.
    // The key panels and the BLAS calls take a sequence's key count as an int.
    for (const std::int64_t len : seq.k_len)
      if (len > std::numeric_limits<int>::max())
        throw_value_error(fn, ": the CPU backend takes at most 2^31 - 1 keys per sequence, got ",
                          len, " (argument 'k')");
    q = pack<Acc>(fn, "'q'", qt, varlen, rows_q, heads_q, head_dim, threads, Acc(scale));
    k = pack<Acc>(fn, "'k'", kt, varlen, rows_k, heads_kv, head_dim, threads);
    v = pack<Acc>(fn, "'v'", vt, varlen, rows_k, heads_kv, head_dim_v, threads);
    zero_masked_rows(key_mask, k, rows_k, heads_kv, head_dim);
    zero_masked_rows(key_mask, v, rows_k, heads_kv, head_dim_v);
    zero_masked_rows(query_mask, q, rows_q, heads_q, head_dim);
    if constexpr (kUseTiles<Acc>) pack_k_panels();
  }

  // Zeroes the packed rows [heads][rows][dim] of tokens a padding mask [B, S] (batched calls)
  // marks invalid. A masked key meets exact-zero probabilities in P @ V and dP, a padded query
  // an exact-zero dS in dK = dS^T Q, and 0 * NaN would carry a NaN the caller masked into
  // other rows (docs/conventions.md). O(S * D), on the copies only.
  static void zero_masked_rows(const std::optional<TensorView>& mask, std::vector<Acc>& x,
                               std::int64_t rows, std::int64_t heads, std::int64_t dim) {
    if (!mask) return;
    const auto* m = static_cast<const std::uint8_t*>(mask->data);
    const std::int64_t batch = mask->shape[0], len = mask->shape[1];
    for (std::int64_t b = 0; b < batch; ++b)
      for (std::int64_t j = 0; j < len; ++j) {
        if (m[b * mask->stride[0] + j * mask->stride[1]]) continue;
        for (std::int64_t h = 0; h < heads; ++h) {
          Acc* row = x.data() + (h * rows + b * len + j) * dim;
          std::fill(row, row + dim, Acc(0));
        }
      }
  }

#if VIDATTN_CPU_AVX2
  // k of every (head, sequence) in 16-key panels, each sequence starting on a new panel.
  std::vector<float> k_panels;
  std::vector<std::int64_t> panel_row0;  // first panel row of each sequence
  std::int64_t panel_rows = 0;           // panel rows per head

  void pack_k_panels() {
    const auto batch = static_cast<std::int64_t>(seq.k_len.size());
    for (std::int64_t b = 0; b < batch; ++b) {
      panel_row0.push_back(panel_rows);
      panel_rows += (seq.k_len[b] + avx2::kPanel - 1) / avx2::kPanel * avx2::kPanel;
    }
    k_panels = cpu::working_buffer<float>(function, "'k' (in key panels)",
                                          heads_kv * panel_rows * head_dim);
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if (heads_kv * panel_rows * head_dim >= kMinParallelElements)
    for (std::int64_t h = 0; h < heads_kv; ++h)
      for (std::int64_t b = 0; b < batch; ++b)
        avx2::pack_panels(k_rows(h, seq.k_start[b]), static_cast<int>(seq.k_len[b]),
                          static_cast<int>(head_dim), k_panel(h, b, 0));
  }
  float* k_panel(std::int64_t h, std::int64_t b, std::int64_t j0) {
    return k_panels.data() + (h * panel_rows + panel_row0[b] + j0) * head_dim;
  }
  const float* k_panel(std::int64_t h, std::int64_t b, std::int64_t j0) const {
    return k_panels.data() + (h * panel_rows + panel_row0[b] + j0) * head_dim;
  }
#else
  void pack_k_panels() {}
#endif

  std::int64_t kv_head(std::int64_t hq) const { return hq / (heads_q / heads_kv); }
  const Acc* q_rows(std::int64_t h, std::int64_t row) const {
    return q.data() + (h * rows_q + row) * head_dim;
  }
  const Acc* k_rows(std::int64_t h, std::int64_t row) const {
    return k.data() + (h * rows_k + row) * head_dim;
  }
  const Acc* v_rows(std::int64_t h, std::int64_t row) const {
    return v.data() + (h * rows_k + row) * head_dim_v;
  }

  // Scaled logits S[rows x cols] (leading dim kBlockK) of queries i0.. of head hq against
  // keys j0.. of sequence b, before the key-visit policy's mask (q is packed pre-scaled). Forward and
  // backward both call this, so the backward recomputes exactly the forward's logits. With
  // the AVX2 tiles, columns up to the next multiple of 16 are written too (and ignored).
  void scores(std::int64_t b, std::int64_t hq, std::int64_t i0, int rows, std::int64_t j0,
              int cols, Acc* S) const {
    const int D = static_cast<int>(head_dim);
#if VIDATTN_CPU_AVX2
    if constexpr (kUseTiles<Acc>)
      avx2::gemm_nt_panels(rows, (cols + avx2::kPanel - 1) / avx2::kPanel, D,
                           q_rows(hq, seq.q_start[b] + i0), D, k_panel(kv_head(hq), b, j0), S,
                           kBlockK);
    else
#endif
      cpu::gemm_nt<Acc>(rows, cols, D, q_rows(hq, seq.q_start[b] + i0), D,
                        k_rows(kv_head(hq), seq.k_start[b] + j0), D, Acc(0), S, kBlockK);
  }
};

template <class Acc>
Acc row_max(const Acc* s, int n) {
#if VIDATTN_CPU_AVX2
  if constexpr (kUseTiles<Acc>) return avx2::row_max(s, n);
#endif
  Acc result = -std::numeric_limits<Acc>::infinity();
  for (int x = 0; x < n; ++x) result = std::max(result, s[x]);
  return result;
}

// s[x] = exp(s[x] - shift); returns their sum.
template <class Acc>
Acc exp_shift_sum(Acc* s, int n, Acc shift) {
#if VIDATTN_CPU_AVX2
  if constexpr (kUseTiles<Acc>) return avx2::exp_shift_sum(s, n, shift);
#endif
  Acc sum = 0;
  for (int x = 0; x < n; ++x) sum += (s[x] = cpu::exp_approx(s[x] - shift));
  return sum;
}

// ---- key-visit policies ---------------------------------------------------------------
//
// A key-visit policy says which work exists (rows and columns are relative to sequence b's
// start):
//   query_blocks()               blocks of <= kBlockQ query rows of one (sequence, q head);
//                                rows [valid_rows, rows) are padding: output 0, LSE -inf.
//   for_each_key_span(qb, f)     the key spans (<= kBlockK consecutive keys) that query
//                                block qb visits, in a fixed order: f(span).
//   mask(qb, rows, span, S)      -inf on the logits qb may not see inside a span.
//   query_row_valid(row)         false for a query row masked out by the caller (global row).
//   key_blocks()                 blocks of <= kBlockK keys of one (sequence, kv head); rows
//                                [valid_cols, cols) are padding: dK = dV = 0.
//   for_each_query_block(kb, f)  the query blocks (any q head of kb's group) whose spans
//                                include key block kb, in a fixed order: f(qb, span).

struct QueryBlock {
  std::int64_t b, h, i0;
  int rows, valid_rows;
  std::int64_t tile;  // block-sparse: the query tile
};
struct KeySpan {
  std::int64_t j0;
  int cols;
};
struct KeyBlock {
  std::int64_t b, hk, j0;
  int cols, valid_cols;
  std::int64_t tile;  // block-sparse: the key tile
};

// Dense attention: every key, with causal and key/query padding masks.
struct DenseVisit {
  const AttentionProblem& p;
  const Sequences& seq;
  std::vector<std::uint8_t> k_valid, q_valid;
  bool has_key_mask;

  DenseVisit(const AttentionProblem& problem, const Sequences& sequences,
               const AttentionOptions& o, std::int64_t rows_q)
      : p(problem), seq(sequences), has_key_mask(o.key_padding_mask.has_value()) {
    if (!p.varlen) {
      k_valid = pack_mask(o.key_padding_mask, p.batch, p.seqlen_k);
      q_valid = pack_mask(o.query_padding_mask, p.batch, p.seqlen_q);
    } else {
      q_valid.assign(static_cast<std::size_t>(rows_q), 1);
    }
  }

  // Keys [0, key_end) of sequence b are visible to some query of the block [i0, i0 + rows).
  std::int64_t key_end(std::int64_t b, std::int64_t i0, std::int64_t rows) const {
    const std::int64_t kl = seq.k_len[b];
    if (!p.causal) return kl;
    return std::clamp<std::int64_t>(i0 + rows + kl - seq.q_len[b], 0, kl);
  }

  QueryBlock query_block(std::int64_t b, std::int64_t h, std::int64_t i0) const {
    const int rows = static_cast<int>(std::min<std::int64_t>(kBlockQ, seq.q_len[b] - i0));
    return {b, h, i0, rows, rows, 0};
  }

  std::vector<QueryBlock> query_blocks() const {
    std::vector<QueryBlock> blocks;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.heads_q; ++h)
        for (std::int64_t i0 = 0; i0 < seq.q_len[b]; i0 += kBlockQ)
          blocks.push_back(query_block(b, h, i0));
    return blocks;
  }

  template <class F>
  void for_each_key_span(const QueryBlock& qb, F&& f) const {
    const std::int64_t j_end = key_end(qb.b, qb.i0, qb.rows);
    for (std::int64_t j0 = 0; j0 < j_end; j0 += kBlockK)
      f(KeySpan{j0, static_cast<int>(std::min<std::int64_t>(kBlockK, seq.k_len[qb.b] - j0))});
  }

  template <class Acc>
  void mask(const QueryBlock& qb, int rows, const KeySpan& sp, Acc* S) const {
    const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
    const std::int64_t causal_shift = seq.k_len[qb.b] - seq.q_len[qb.b];
    const std::uint8_t* kv = has_key_mask ? k_valid.data() + seq.k_start[qb.b] + sp.j0 : nullptr;
    if (!p.causal && !kv) return;
    for (int r = 0; r < rows; ++r) {
      Acc* s = S + r * kBlockK;
      if (p.causal) {
        const std::int64_t last = qb.i0 + r + causal_shift - sp.j0;  // last visible column
        for (std::int64_t c = std::max<std::int64_t>(last + 1, 0); c < sp.cols; ++c) s[c] = neg_inf;
      }
      if (kv)
        for (int c = 0; c < sp.cols; ++c)
          if (!kv[c]) s[c] = neg_inf;
    }
  }

  bool query_row_valid(std::int64_t row) const { return q_valid[row] != 0; }
  // False for a key (global row) masked out by the key padding mask.
  bool key_row_valid(std::int64_t row) const { return !has_key_mask || k_valid[row] != 0; }

  std::vector<KeyBlock> key_blocks() const {
    std::vector<KeyBlock> blocks;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.heads_kv; ++h)
        for (std::int64_t j0 = 0; j0 < seq.k_len[b]; j0 += kBlockK) {
          const int cols = static_cast<int>(std::min<std::int64_t>(kBlockK, seq.k_len[b] - j0));
          blocks.push_back({b, h, j0, cols, cols, 0});
        }
    return blocks;
  }

  template <class F>
  void for_each_query_block(const KeyBlock& kb, F&& f) const {
    const std::int64_t group = p.heads_q / p.heads_kv;
    for (std::int64_t h = kb.hk * group; h < (kb.hk + 1) * group; ++h)
      for (std::int64_t i0 = 0; i0 < seq.q_len[kb.b]; i0 += kBlockQ) {
        const QueryBlock qb = query_block(kb.b, h, i0);
        if (key_end(kb.b, i0, qb.rows) <= kb.j0) continue;  // causal: sees none of these keys
        f(qb, KeySpan{kb.j0, kb.cols});
      }
  }
};

// Block-sparse attention: a query tile visits the key tiles it selected (q2k); a key tile is
// visited by the query tiles that selected it (k2q). Key slots past a tile's block size are
// left out of its span rather than masked; zero-size tiles are skipped.
struct SparseVisit {
  const BlockSparseProblem& p;
  std::vector<std::int32_t> q_sizes, kv_sizes;
  const TensorView& q2k_index;
  const TensorView& q2k_count;
  const TensorView* k2q_offsets = nullptr;
  const TensorView* k2q_index = nullptr;
  int sub_blocks;  // query blocks per tile (a 256-slot tile is two blocks of 128 rows)

  SparseVisit(const BlockSparseProblem& problem, const BlockSparseOptions& o,
                const TensorView& idx, const TensorView& cnt, const ArgChecker& check)
      : p(problem),
        q_sizes(cpu_vsa::read_block_sizes(check, o.q_block_sizes ? &*o.q_block_sizes : nullptr,
                                          "q_block_sizes", p.q_tiles, p.tile_volume)),
        kv_sizes(cpu_vsa::read_block_sizes(check, o.kv_block_sizes ? &*o.kv_block_sizes : nullptr,
                                           "kv_block_sizes", p.kv_tiles, p.tile_volume)),
        q2k_index(idx),
        q2k_count(cnt),
        sub_blocks(static_cast<int>((p.tile_volume + kBlockQ - 1) / kBlockQ)) {
    cpu_vsa::check_q2k_index(check, idx, cnt, p.kv_tiles);
  }

  QueryBlock query_block(std::int64_t b, std::int64_t h, std::int64_t tile, int sub) const {
    const int rows = static_cast<int>(std::min<std::int64_t>(kBlockQ, p.tile_volume));
    const int valid = std::clamp(q_sizes[tile] - sub * rows, 0, rows);
    return {b, h, tile * p.tile_volume + sub * rows, rows, valid, tile};
  }

  std::vector<QueryBlock> query_blocks() const {
    std::vector<QueryBlock> blocks;
    blocks.reserve(static_cast<std::size_t>(p.batch * p.heads_q * p.q_tiles * sub_blocks));
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t h = 0; h < p.heads_q; ++h)
        for (std::int64_t t = 0; t < p.q_tiles; ++t)
          for (int sub = 0; sub < sub_blocks; ++sub) blocks.push_back(query_block(b, h, t, sub));
    return blocks;
  }

  template <class F>
  void for_each_key_span(const QueryBlock& qb, F&& f) const {
    const auto* idx = static_cast<const std::int32_t*>(q2k_index.data) +
                      qb.b * q2k_index.stride[0] + qb.h * q2k_index.stride[1] +
                      qb.tile * q2k_index.stride[2];
    const std::int32_t n = static_cast<const std::int32_t*>(q2k_count.data)
        [qb.b * q2k_count.stride[0] + qb.h * q2k_count.stride[1] + qb.tile * q2k_count.stride[2]];
    // Consecutive selected tiles are one span while the keys stay contiguous (every tile but
    // the last of a span is full) and the span fits a key block: fewer, longer products.
    KeySpan span{0, 0};
    for (std::int32_t s = 0; s < n; ++s) {
      const std::int32_t tile = idx[s * q2k_index.stride[3]];
      const int size = kv_sizes[tile];
      if (size == 0) continue;
      const std::int64_t j0 = tile * p.tile_volume;
      if (span.cols > 0 && span.j0 + span.cols == j0 && span.cols + size <= kBlockK) {
        span.cols += size;
        continue;
      }
      if (span.cols > 0) f(span);
      span = KeySpan{j0, size};
    }
    if (span.cols > 0) f(span);
  }

  template <class Acc>
  void mask(const QueryBlock&, int, const KeySpan&, Acc*) const {}

  bool query_row_valid(std::int64_t) const { return true; }
  bool key_row_valid(std::int64_t) const { return true; }

  std::vector<KeyBlock> key_blocks() const {
    std::vector<KeyBlock> blocks;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t hk = 0; hk < p.heads_kv; ++hk)
        for (std::int64_t t = 0; t < p.kv_tiles; ++t)
          blocks.push_back({b, hk, t * p.tile_volume, static_cast<int>(p.tile_volume),
                            kv_sizes[t], t});
    return blocks;
  }

  template <class F>
  void for_each_query_block(const KeyBlock& kb, F&& f) const {
    const KeySpan span{kb.j0, kb.valid_cols};
    const std::int64_t group = p.heads_q / p.heads_kv;
    const auto* offsets = static_cast<const std::int32_t*>(k2q_offsets->data);
    const auto* index = static_cast<const std::int32_t*>(k2q_index->data);
    for (std::int64_t h = kb.hk * group; h < (kb.hk + 1) * group; ++h) {
      const std::int64_t ob = kb.b * k2q_offsets->stride[0] + h * k2q_offsets->stride[1];
      const std::int64_t ib = kb.b * k2q_index->stride[0] + h * k2q_index->stride[1];
      const std::int32_t begin = offsets[ob + kb.tile * k2q_offsets->stride[2]];
      const std::int32_t end = offsets[ob + (kb.tile + 1) * k2q_offsets->stride[2]];
      for (std::int32_t e = begin; e < end; ++e) {
        const std::int64_t tile = index[ib + e * k2q_index->stride[2]];
        for (int sub = 0; sub < sub_blocks; ++sub) f(query_block(kb.b, h, tile, sub), span);
      }
    }
  }
};

// ---- the mainloop -------------------------------------------------------------------------

template <class Acc, class Visit>
void forward(const Context<Acc>& c, const Visit& visit, bool varlen, const TensorView& out,
             const TensorView& lse) {
  const RowLayout out_layout = token_rows(out, varlen);
  const RowLayout lse_layout = lse_rows(lse, varlen);
  const std::int64_t Dv = c.head_dim_v;
  const std::vector<QueryBlock> tasks = visit.query_blocks();

  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
#pragma omp parallel num_threads(threads_for(c.threads, tasks.size()))
  {
    std::vector<Acc> S(kBlockQ * kBlockK), acc(kBlockQ * Dv), m(kBlockQ), l(kBlockQ);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < tasks.size(); ++t) {
      const QueryBlock& qb = tasks[t];
      const std::int64_t b = qb.b, h = qb.h, i0 = qb.i0;
      const int rows = qb.valid_rows;
      std::fill(acc.begin(), acc.end(), Acc(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), Acc(0));
      // The span body takes raw pointers and sizes by value, so that the compiler keeps them
      // in registers across the per-row loops.
      auto visit_span = [&c, &visit, &qb, Sp = S.data(), ap = acc.data(), mp = m.data(),
                         lp = l.data(), rows, Dv, b, h, i0, neg_inf](const KeySpan& sp) {
        const int cols = sp.cols;
        c.scores(b, h, i0, rows, sp.j0, cols, Sp);
        visit.mask(qb, rows, sp, Sp);
        for (int r = 0; r < rows; ++r) {
          Acc* s = Sp + r * kBlockK;
          const Acc m_new = std::max(mp[r], row_max(s, cols));
          if (m_new == neg_inf) {  // nothing visible yet: keep the row empty, avoid inf - inf
            // The max drops NaN logits, so a row whose visible logits are all NaN (a NaN in
            // its q) lands here too: it must end NaN, not empty. Rare rows only: the test is
            // off the common path.
            const bool nan_row = std::any_of(s, s + cols, [](Acc x) { return x != x; });
            std::fill(s, s + cols, Acc(0));
            if (nan_row) {
              const Acc nan = std::numeric_limits<Acc>::quiet_NaN();
              mp[r] = nan, lp[r] = nan;
              std::fill(ap + r * Dv, ap + (r + 1) * Dv, nan);
            }
            continue;
          }
          const Acc sum = exp_shift_sum(s, cols, m_new);
          const Acc alpha = cpu::exp_approx(mp[r] - m_new);
          if (alpha != Acc(1)) {
            Acc* a = ap + r * Dv;
#pragma omp simd
            for (std::int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
          }
          lp[r] = lp[r] * alpha + sum;
          mp[r] = m_new;
        }
        const Acc* v_block = c.v_rows(c.kv_head(h), c.seq.k_start[b] + sp.j0);
#if VIDATTN_CPU_AVX2
        if constexpr (kUseTiles<Acc>)
          avx2::gemm_nn_acc(rows, static_cast<int>(Dv), cols, Sp, kBlockK, v_block,
                            static_cast<int>(Dv), ap, static_cast<int>(Dv));
        else
#endif
          cpu::gemm_nn<Acc>(rows, static_cast<int>(Dv), cols, Sp, kBlockK, v_block,
                            static_cast<int>(Dv), Acc(1), ap, static_cast<int>(Dv));
      };
      if (rows > 0) visit.for_each_key_span(qb, visit_span);
      for (int r = 0; r < qb.rows; ++r) {
        const std::int64_t row = c.seq.q_start[b] + i0 + r;
        const bool empty = r >= rows || l[r] == Acc(0) || !visit.query_row_valid(row);
        if (empty) {
          store_zero_row(out, out_layout.offset(row, h), Dv);
          store_scalar(lse, lse_layout.offset(row, h), -std::numeric_limits<double>::infinity());
          continue;
        }
        store_row<Acc>(out, out_layout.offset(row, h), acc.data() + r * Dv, Dv, Acc(1) / l[r]);
        store_scalar(lse, lse_layout.offset(row, h), double(m[r] + std::log(l[r])));
      }
    }
  }
}

template <class Acc, class Visit>
void backward(const Context<Acc>& c, const Visit& visit, bool varlen, double softmax_scale,
              const TensorView& out, const TensorView& lse_t, const TensorView& grad_out,
              const TensorView& dq, const TensorView& dk, const TensorView& dv) {
  const std::int64_t D = c.head_dim, Dv = c.head_dim_v, Hq = c.heads_q;
  const Acc scale = static_cast<Acc>(softmax_scale);
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();

  // Per query row: dO packed, delta = rowsum(dO * O), and the forward's LSE (-inf marks a
  // row with no visible key, or a padded query: such rows get P = 0).
  const std::vector<Acc> dout =
      pack<Acc>(c.function, "'grad_out'", grad_out, varlen, c.rows_q, Hq, Dv, c.threads);
  const std::vector<Acc> o_packed =
      pack<Acc>(c.function, "'out'", out, varlen, c.rows_q, Hq, Dv, c.threads);
  std::vector<Acc> delta = cpu::working_buffer<Acc>(c.function, "the row sums", Hq * c.rows_q);
  std::vector<Acc> lse = cpu::working_buffer<Acc>(c.function, "'lse'", Hq * c.rows_q);
  const RowLayout lse_layout = lse_rows(lse_t, varlen);
#pragma omp parallel for num_threads(c.threads) schedule(static) \
    if (Hq * c.rows_q * Dv >= kMinParallelElements)
  for (std::int64_t hr = 0; hr < Hq * c.rows_q; ++hr) {
    const std::int64_t h = hr / c.rows_q, r = hr % c.rows_q;
    Acc sum = 0;
    for (std::int64_t d = 0; d < Dv; ++d) sum += dout[hr * Dv + d] * o_packed[hr * Dv + d];
    delta[hr] = sum;
    const std::int64_t off = lse_layout.offset(r, h);
    const Acc value = lse_t.dtype == DType::kFloat64
                          ? Acc(static_cast<const double*>(lse_t.data)[off])
                          : Acc(static_cast<const float*>(lse_t.data)[off]);
    lse[hr] = visit.query_row_valid(r) ? value : neg_inf;
  }

  // P = exp(S - lse) and dS = P * (dO V^T - delta) of one block, in place in S and dP.
  auto probs_and_dscores = [&](const QueryBlock& qb, int rows, const KeySpan& sp, Acc* S,
                               Acc* dP) {
    const std::int64_t b = qb.b, h = qb.h;
    const int cols = sp.cols;
    c.scores(b, h, qb.i0, rows, sp.j0, cols, S);
    visit.mask(qb, rows, sp, S);
    const std::int64_t row0 = h * c.rows_q + c.seq.q_start[b] + qb.i0;
    cpu::gemm_nt<Acc>(rows, cols, static_cast<int>(Dv), dout.data() + row0 * Dv,
                      static_cast<int>(Dv), c.v_rows(c.kv_head(h), c.seq.k_start[b] + sp.j0),
                      static_cast<int>(Dv), Acc(0), dP, kBlockK);
    for (int r = 0; r < rows; ++r) {
      Acc* s = S + r * kBlockK;
      Acc* dp = dP + r * kBlockK;
      const Acc row_lse = lse[row0 + r], row_delta = delta[row0 + r];
      if (row_lse == neg_inf) {
        std::fill(s, s + cols, Acc(0));
        std::fill(dp, dp + cols, Acc(0));
        continue;
      }
      // A masked logit (-inf) gives exactly P = dS = 0, also when the row's LSE or delta is NaN
      // (a NaN reached the row): exp(-inf - NaN) and 0 * NaN are NaN, and a masked key must
      // not take a gradient from a row that does not see it (docs/conventions.md).
#pragma omp simd
      for (int x = 0; x < cols; ++x) {
        const bool masked = s[x] == neg_inf;
        const Acc prob = cpu::exp_approx(s[x] - row_lse);
        s[x] = masked ? Acc(0) : prob;
        dp[x] = masked ? Acc(0) : prob * (dp[x] - row_delta);
      }
    }
  };

  const RowLayout dq_layout = token_rows(dq, varlen);
  const RowLayout dk_layout = token_rows(dk, varlen);
  const RowLayout dv_layout = token_rows(dv, varlen);

  // Pass 1: dK and dV, one task per key block.
  const std::vector<KeyBlock> kv_tasks = visit.key_blocks();
#pragma omp parallel num_threads(threads_for(c.threads, kv_tasks.size()))
  {
    std::vector<Acc> S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK);
    std::vector<Acc> dk_acc(kBlockK * D), dv_acc(kBlockK * Dv);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < kv_tasks.size(); ++t) {
      const KeyBlock& kb = kv_tasks[t];
      std::fill(dk_acc.begin(), dk_acc.end(), Acc(0));
      std::fill(dv_acc.begin(), dv_acc.end(), Acc(0));
      if (kb.valid_cols > 0)
        visit.for_each_query_block(kb, [&](const QueryBlock& qb, const KeySpan& sp) {
          const int rows = qb.valid_rows;
          if (rows == 0) return;
          probs_and_dscores(qb, rows, sp, S.data(), dP.data());
          const std::int64_t row0 = qb.h * c.rows_q + c.seq.q_start[qb.b] + qb.i0;
          cpu::gemm_tn<Acc>(sp.cols, static_cast<int>(Dv), rows, S.data(), kBlockK,
                            dout.data() + row0 * Dv, static_cast<int>(Dv), Acc(1),
                            dv_acc.data(), static_cast<int>(Dv));
          cpu::gemm_tn<Acc>(sp.cols, static_cast<int>(D), rows, dP.data(), kBlockK,
                            c.q_rows(qb.h, c.seq.q_start[qb.b] + qb.i0), static_cast<int>(D),
                            Acc(1), dk_acc.data(), static_cast<int>(D));
        });
      for (int x = 0; x < kb.cols; ++x) {
        const std::int64_t row = c.seq.k_start[kb.b] + kb.j0 + x;
        // A padded slot or a masked key is never attended: exact zeros, also where a NaN q of
        // a row that sees other keys of the block met its zero dS (0 * NaN).
        if (x >= kb.valid_cols || !visit.key_row_valid(row)) {
          store_zero_row(dk, dk_layout.offset(row, kb.hk), D);
          store_zero_row(dv, dv_layout.offset(row, kb.hk), Dv);
          continue;
        }
        // dK = scale * dS^T Q: the scale is already in the packed q.
        store_row<Acc>(dk, dk_layout.offset(row, kb.hk), dk_acc.data() + x * D, D, Acc(1));
        store_row<Acc>(dv, dv_layout.offset(row, kb.hk), dv_acc.data() + x * Dv, Dv, Acc(1));
      }
    }
  }

  // Pass 2: dQ, one task per query block.
  const std::vector<QueryBlock> q_tasks = visit.query_blocks();
#pragma omp parallel num_threads(threads_for(c.threads, q_tasks.size()))
  {
    std::vector<Acc> S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK), dq_acc(kBlockQ * D);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < q_tasks.size(); ++t) {
      const QueryBlock& qb = q_tasks[t];
      const int rows = qb.valid_rows;
      std::fill(dq_acc.begin(), dq_acc.end(), Acc(0));
      if (rows > 0)
        visit.for_each_key_span(qb, [&](const KeySpan& sp) {
          probs_and_dscores(qb, rows, sp, S.data(), dP.data());
          cpu::gemm_nn<Acc>(rows, static_cast<int>(D), sp.cols, dP.data(), kBlockK,
                            c.k_rows(c.kv_head(qb.h), c.seq.k_start[qb.b] + sp.j0),
                            static_cast<int>(D), Acc(1), dq_acc.data(), static_cast<int>(D));
        });
      for (int r = 0; r < qb.rows; ++r) {
        const std::int64_t row = c.seq.q_start[qb.b] + qb.i0 + r;
        if (r >= rows)
          store_zero_row(dq, dq_layout.offset(row, qb.h), D);
        else
          store_row<Acc>(dq, dq_layout.offset(row, qb.h), dq_acc.data() + r * D, D, scale);
      }
    }
  }
}

// Dispatches on the accumulator type: double for float64 inputs, float otherwise.
template <class Fn>
void with_accumulator(DType dtype, Fn&& fn) {
  if (dtype == DType::kFloat64)
    fn(double{});
  else
    fn(float{});
}

// A block-sparse call is a batched call: sequence b owns rows b * S .. (b + 1) * S.
Sequences batch_sequences(std::int64_t batch, std::int64_t seqlen_q, std::int64_t seqlen_k) {
  Sequences s;
  for (std::int64_t b = 0; b < batch; ++b) {
    s.q_start.push_back(b * seqlen_q), s.q_len.push_back(seqlen_q);
    s.k_start.push_back(b * seqlen_k), s.k_len.push_back(seqlen_k);
  }
  return s;
}

// The k2q index must describe the q2k selection it came with (block_sparse_transpose_index).
void check_k2q_index(const ArgChecker& check, const BlockSparseProblem& p,
                     const TensorView& q2k_count, const TensorView& k2q_offsets,
                     const TensorView& k2q_index) {
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h) {
      const auto* off = static_cast<const std::int32_t*>(k2q_offsets.data) +
                        b * k2q_offsets.stride[0] + h * k2q_offsets.stride[1];
      std::int64_t total = 0;
      for (std::int64_t t = 0; t < p.q_tiles; ++t)
        total += static_cast<const std::int32_t*>(q2k_count.data)
            [b * q2k_count.stride[0] + h * q2k_count.stride[1] + t * q2k_count.stride[2]];
      std::int32_t prev = 0;
      for (std::int64_t j = 0; j <= p.kv_tiles; ++j) {
        const std::int32_t x = off[j * k2q_offsets.stride[2]];
        if (x < prev || (j == 0 && x != 0))
          check.fail("k2q_offsets[", b, ", ", h, "] must start at 0 and be non-decreasing");
        prev = x;
      }
      if (prev != total)
        check.fail("k2q_offsets[", b, ", ", h, "] ends at ", prev, " but q2k_count sums to ",
                   total, "; build it with block_sparse_transpose_index");
      for (std::int64_t e = 0; e < total; ++e) {
        const std::int32_t t = static_cast<const std::int32_t*>(k2q_index.data)
            [b * k2q_index.stride[0] + h * k2q_index.stride[1] + e * k2q_index.stride[2]];
        if (t < 0 || t >= p.q_tiles)
          check.fail("k2q_index[", b, ", ", h, ", ", e, "] is ", t, ", out of range for ",
                     p.q_tiles, " query tiles");
      }
    }
}

}  // namespace

void cpu_attention_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse,
                           const AttentionOptions& options) {
  const ArgChecker check("vidattn::attention_forward");
  cpu::blas_use_one_thread();
  with_accumulator(p.dtype, [&](auto acc) {
    using Acc = decltype(acc);
    const Context<Acc> c(check.function(), resolve_sequences(check, p, q, k, options), q, k, v,
                         p.varlen, p.scale, options.num_threads, options.key_padding_mask,
                         options.query_padding_mask);
    forward(c, DenseVisit(p, c.seq, options, c.rows_q), p.varlen, out, lse);
  });
}

void cpu_attention_backward(const AttentionProblem& p, const TensorView& q,
                            const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, const TensorView& grad_out,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const AttentionOptions& options) {
  const ArgChecker check("vidattn::attention_backward");
  cpu::blas_use_one_thread();
  with_accumulator(p.dtype, [&](auto acc) {
    using Acc = decltype(acc);
    const Context<Acc> c(check.function(), resolve_sequences(check, p, q, k, options), q, k, v,
                         p.varlen, p.scale, options.num_threads, options.key_padding_mask,
                         options.query_padding_mask);
    backward(c, DenseVisit(p, c.seq, options, c.rows_q), p.varlen, p.scale, out, lse,
             grad_out, dq, dk, dv);
  });
}

void cpu_block_sparse_forward(const BlockSparseProblem& p, const TensorView& q,
                              const TensorView& k, const TensorView& v,
                              const TensorView& q2k_index, const TensorView& q2k_count,
                              const TensorView& out, const TensorView& lse,
                              const BlockSparseOptions& o) {
  const ArgChecker check("vidattn::block_sparse_attention_forward");
  cpu::blas_use_one_thread();
  const SparseVisit visit(p, o, q2k_index, q2k_count, check);
  with_accumulator(p.dtype, [&](auto acc) {
    using Acc = decltype(acc);
    const Context<Acc> c(check.function(), batch_sequences(p.batch, p.seqlen_q, p.seqlen_k), q, k, v, false,
                         p.scale, o.num_threads);
    forward(c, visit, false, out, lse);
  });
}

void cpu_block_sparse_backward(const BlockSparseProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, const TensorView& grad_out,
                               const TensorView& q2k_index, const TensorView& q2k_count,
                               const TensorView& k2q_offsets, const TensorView& k2q_index,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const BlockSparseOptions& o) {
  const ArgChecker check("vidattn::block_sparse_attention_backward");
  cpu::blas_use_one_thread();
  SparseVisit visit(p, o, q2k_index, q2k_count, check);
  check_k2q_index(check, p, q2k_count, k2q_offsets, k2q_index);
  visit.k2q_offsets = &k2q_offsets;
  visit.k2q_index = &k2q_index;
  with_accumulator(p.dtype, [&](auto acc) {
    using Acc = decltype(acc);
    const Context<Acc> c(check.function(), batch_sequences(p.batch, p.seqlen_q, p.seqlen_k), q, k, v, false,
                         p.scale, o.num_threads);
    backward(c, visit, false, p.scale, out, lse, grad_out, dq, dk, dv);
  });
}

}  // namespace vidattn::detail
