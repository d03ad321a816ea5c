// TEMPORARY home of the policy-driven attention mainloop (to move into attention_cpu.cpp).
#include <omp.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../core/vsa_backends.h"
#include "cpu_math.h"
#include "vsa_cpu.h"

namespace vidattn::detail {
namespace {

using cpu::Storage;
using cpu::visit_float_dtype;

constexpr int kBlockQ = 128;
constexpr int kBlockK = 256;

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

RowLayout lse_rows(const TensorView& t, bool varlen) {
  if (varlen) return {std::max<std::int64_t>(t.shape[1], 1), 0, t.stride[1], t.stride[0]};
  return {std::max<std::int64_t>(t.shape[2], 1), t.stride[0], t.stride[2], t.stride[1]};
}

template <class Acc>
std::vector<Acc> pack(const TensorView& t, bool varlen, std::int64_t rows, std::int64_t heads,
                      std::int64_t dim, int threads, Acc mul = Acc(1)) {
  std::vector<Acc> out(static_cast<std::size_t>(rows * heads * dim));
  const RowLayout layout = token_rows(t, varlen);
  visit_float_dtype(t.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    const auto* src = static_cast<const typename S::type*>(t.data);
#pragma omp parallel for num_threads(threads) schedule(static)
    for (std::int64_t hr = 0; hr < heads * rows; ++hr) {
      const std::int64_t h = hr / rows, r = hr % rows;
      const auto* in = src + layout.offset(r, h);
      Acc* o = out.data() + hr * dim;
      for (std::int64_t d = 0; d < dim; ++d) o[d] = S::template load<Acc>(in[d]) * mul;
    }
  });
  return out;
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

// ---- the mainloop: shared by every attention pattern ----------------------------------
//
// A pattern (policy) says which work exists:
//   query_blocks()               blocks of <= kBlockQ query rows of one (sequence, q head);
//                                rows [valid_rows, rows) are padding: output 0, LSE -inf.
//   for_each_key_span(qb, f)     the key spans (<= kBlockK consecutive packed key rows) that
//                                query block qb visits, in a fixed order.
//   mask(qb, span, S)            -inf on the logits qb may not see inside a span.
//   key_blocks()                 blocks of <= kBlockK key rows of one (sequence, kv head);
//                                rows [valid_cols, cols) are padding: dK = dV = 0.
//   for_each_query_block(kb, f)  the query blocks (of any q head of the group) whose spans
//                                include key block kb, in a fixed order; f(qb, span).
//   query_row_valid(row)         false for a padded query row of a dense call.

struct QueryBlock {
  std::int64_t b, h, row0, pos;  // pos: the pattern's own coordinate (position or tile)
  int rows, valid_rows;
};
struct KeySpan {
  std::int64_t row0, pos;
  int cols;
};
struct KeyBlock {
  std::int64_t b, hk, row0, pos;
  int cols, valid_cols;
};

// q (pre-multiplied by the softmax scale), k, v packed as contiguous [H][rows][dim].
template <class Acc>
struct PackedHeads {
  std::int64_t rows_q, rows_k, heads_q, heads_kv, D, Dv;
  int threads;
  std::vector<Acc> q, k, v;

  PackedHeads(const TensorView& qt, const TensorView& kt, const TensorView& vt, bool varlen,
              double scale, int num_threads)
      : rows_q(qt.shape[0] * (varlen ? 1 : qt.shape[1])),
        rows_k(kt.shape[0] * (varlen ? 1 : kt.shape[1])),
        heads_q(qt.shape[qt.ndim - 2]),
        heads_kv(kt.shape[kt.ndim - 2]),
        D(qt.shape[qt.ndim - 1]),
        Dv(vt.shape[vt.ndim - 1]),
        threads(num_threads > 0 ? num_threads : omp_get_max_threads()) {
    q = pack<Acc>(qt, varlen, rows_q, heads_q, D, threads, Acc(scale));
    k = pack<Acc>(kt, varlen, rows_k, heads_kv, D, threads);
    v = pack<Acc>(vt, varlen, rows_k, heads_kv, Dv, threads);
  }
  std::int64_t kv_head(std::int64_t hq) const { return hq / (heads_q / heads_kv); }
  const Acc* q_rows(std::int64_t h, std::int64_t row) const { return q.data() + (h * rows_q + row) * D; }
  const Acc* k_rows(std::int64_t h, std::int64_t row) const { return k.data() + (h * rows_k + row) * D; }
  const Acc* v_rows(std::int64_t h, std::int64_t row) const { return v.data() + (h * rows_k + row) * Dv; }

  // Scaled logits S[rows x cols] (leading dim kBlockK) of a query block against a key span.
  // Forward and backward both call this, so the backward recomputes the forward's logits.
  template <class Pattern>
  void scores(const Pattern& pattern, const QueryBlock& qb, int rows, const KeySpan& sp,
              Acc* S) const {
    cpu::gemm_nt<Acc>(rows, sp.cols, static_cast<int>(D), q_rows(qb.h, qb.row0),
                      static_cast<int>(D), k_rows(kv_head(qb.h), sp.row0), static_cast<int>(D),
                      Acc(0), S, kBlockK);
    pattern.mask(qb, rows, sp, S);
  }
};

template <class Acc, class Pattern>
void forward_mainloop(const PackedHeads<Acc>& c, const Pattern& pattern, bool varlen,
                      const TensorView& out, const TensorView& lse) {
  const RowLayout out_layout = token_rows(out, varlen);
  const RowLayout lse_layout = lse_rows(lse, varlen);
  const std::int64_t Dv = c.Dv;
  const std::vector<QueryBlock> blocks = pattern.query_blocks();
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
#pragma omp parallel num_threads(c.threads)
  {
    std::vector<Acc> S(kBlockQ * kBlockK), acc(kBlockQ * Dv), m(kBlockQ), l(kBlockQ);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < blocks.size(); ++t) {
      const QueryBlock& qb = blocks[t];
      const int rows = qb.valid_rows;
      std::fill(acc.begin(), acc.end(), Acc(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), Acc(0));
      if (rows > 0)
        pattern.for_each_key_span(qb, [&](const KeySpan& sp) {
          const int cols = sp.cols;
          c.scores(pattern, qb, rows, sp, S.data());
          for (int r = 0; r < rows; ++r) {
            Acc* s = S.data() + r * kBlockK;
            Acc row_max = neg_inf;
#pragma omp simd reduction(max : row_max)
            for (int x = 0; x < cols; ++x) row_max = std::max(row_max, s[x]);
            const Acc m_new = std::max(m[r], row_max);
            if (m_new == neg_inf) {  // nothing visible yet: keep the row empty, avoid inf - inf
              std::fill(s, s + cols, Acc(0));
              continue;
            }
            Acc sum = 0;
#pragma omp simd reduction(+ : sum)
            for (int x = 0; x < cols; ++x) {
              s[x] = cpu::exp_approx(s[x] - m_new);
              sum += s[x];
            }
            const Acc alpha = cpu::exp_approx(m[r] - m_new);
            if (alpha != Acc(1)) {
              Acc* a = acc.data() + r * Dv;
#pragma omp simd
              for (std::int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
            }
            l[r] = l[r] * alpha + sum;
            m[r] = m_new;
          }
          cpu::gemm_nn<Acc>(rows, static_cast<int>(Dv), cols, S.data(), kBlockK,
                            c.v_rows(c.kv_head(qb.h), sp.row0), static_cast<int>(Dv), Acc(1),
                            acc.data(), static_cast<int>(Dv));
        });
      for (int r = 0; r < qb.rows; ++r) {
        const std::int64_t row = qb.row0 + r;
        const bool empty = r >= rows || l[r] == Acc(0) || !pattern.query_row_valid(row);
        if (empty) {
          store_zero_row(out, out_layout.offset(row, qb.h), Dv);
          store_scalar(lse, lse_layout.offset(row, qb.h), -std::numeric_limits<double>::infinity());
          continue;
        }
        store_row<Acc>(out, out_layout.offset(row, qb.h), acc.data() + r * Dv, Dv,
                       Acc(1) / l[r]);
        store_scalar(lse, lse_layout.offset(row, qb.h), double(m[r] + std::log(l[r])));
      }
    }
  }
}

template <class Acc, class Pattern>
void backward_mainloop(const PackedHeads<Acc>& c, const Pattern& pattern, bool varlen,
                       double scale_d, const TensorView& out, const TensorView& lse_t,
                       const TensorView& grad_out, const TensorView& dq, const TensorView& dk,
                       const TensorView& dv) {
  const std::int64_t D = c.D, Dv = c.Dv, Hq = c.heads_q;
  const Acc scale = static_cast<Acc>(scale_d);
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();

  // Per query row: dO packed, delta = rowsum(dO * O), and the forward's LSE (-inf marks a
  // row with no visible key, or a padded query: such rows get P = 0).
  const std::vector<Acc> dout = pack<Acc>(grad_out, varlen, c.rows_q, Hq, Dv, c.threads);
  const std::vector<Acc> o_packed = pack<Acc>(out, varlen, c.rows_q, Hq, Dv, c.threads);
  std::vector<Acc> delta(static_cast<std::size_t>(Hq * c.rows_q)), lse(delta.size());
  const RowLayout lse_layout = lse_rows(lse_t, varlen);
#pragma omp parallel for num_threads(c.threads) schedule(static)
  for (std::int64_t hr = 0; hr < Hq * c.rows_q; ++hr) {
    const std::int64_t h = hr / c.rows_q, r = hr % c.rows_q;
    Acc sum = 0;
    for (std::int64_t d = 0; d < Dv; ++d) sum += dout[hr * Dv + d] * o_packed[hr * Dv + d];
    delta[hr] = sum;
    const std::int64_t off = lse_layout.offset(r, h);
    const Acc value = lse_t.dtype == DType::kFloat64
                          ? Acc(static_cast<const double*>(lse_t.data)[off])
                          : Acc(static_cast<const float*>(lse_t.data)[off]);
    lse[hr] = pattern.query_row_valid(r) ? value : neg_inf;
  }

  // P = exp(S - lse) and dS = P * (dO V^T - delta) of one block, in place in S and dP.
  auto probs_and_dscores = [&](const QueryBlock& qb, int rows, const KeySpan& sp, Acc* S,
                               Acc* dP) {
    const int cols = sp.cols;
    c.scores(pattern, qb, rows, sp, S);
    const std::int64_t row0 = qb.h * c.rows_q + qb.row0;
    cpu::gemm_nt<Acc>(rows, cols, static_cast<int>(Dv), dout.data() + row0 * Dv,
                      static_cast<int>(Dv), c.v_rows(c.kv_head(qb.h), sp.row0),
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
#pragma omp simd
      for (int x = 0; x < cols; ++x) {
        s[x] = cpu::exp_approx(s[x] - row_lse);
        dp[x] = s[x] * (dp[x] - row_delta);
      }
    }
  };

  const RowLayout dq_layout = token_rows(dq, varlen);
  const RowLayout dk_layout = token_rows(dk, varlen);
  const RowLayout dv_layout = token_rows(dv, varlen);

  // Pass 1: dK and dV, one task per key block.
  const std::vector<KeyBlock> key_blocks = pattern.key_blocks();
#pragma omp parallel num_threads(c.threads)
  {
    std::vector<Acc> S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK);
    std::vector<Acc> dk_acc(kBlockK * D), dv_acc(kBlockK * Dv);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < key_blocks.size(); ++t) {
      const KeyBlock& kb = key_blocks[t];
      std::fill(dk_acc.begin(), dk_acc.end(), Acc(0));
      std::fill(dv_acc.begin(), dv_acc.end(), Acc(0));
      if (kb.valid_cols > 0)
        pattern.for_each_query_block(kb, [&](const QueryBlock& qb, const KeySpan& sp) {
          const int rows = qb.valid_rows;
          if (rows == 0) return;
          probs_and_dscores(qb, rows, sp, S.data(), dP.data());
          const std::int64_t row0 = qb.h * c.rows_q + qb.row0;
          cpu::gemm_tn<Acc>(sp.cols, static_cast<int>(Dv), rows, S.data(), kBlockK,
                            dout.data() + row0 * Dv, static_cast<int>(Dv), Acc(1),
                            dv_acc.data(), static_cast<int>(Dv));
          cpu::gemm_tn<Acc>(sp.cols, static_cast<int>(D), rows, dP.data(), kBlockK,
                            c.q_rows(qb.h, qb.row0), static_cast<int>(D), Acc(1),
                            dk_acc.data(), static_cast<int>(D));
        });
      for (int x = 0; x < kb.cols; ++x) {
        const std::int64_t row = kb.row0 + x;
        if (x >= kb.valid_cols) {
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
  const std::vector<QueryBlock> q_blocks = pattern.query_blocks();
#pragma omp parallel num_threads(c.threads)
  {
    std::vector<Acc> S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK), dq_acc(kBlockQ * D);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < q_blocks.size(); ++t) {
      const QueryBlock& qb = q_blocks[t];
      const int rows = qb.valid_rows;
      std::fill(dq_acc.begin(), dq_acc.end(), Acc(0));
      if (rows > 0)
        pattern.for_each_key_span(qb, [&](const KeySpan& sp) {
          probs_and_dscores(qb, rows, sp, S.data(), dP.data());
          cpu::gemm_nn<Acc>(rows, static_cast<int>(D), sp.cols, dP.data(), kBlockK,
                            c.k_rows(c.kv_head(qb.h), sp.row0), static_cast<int>(D), Acc(1),
                            dq_acc.data(), static_cast<int>(D));
        });
      for (int r = 0; r < qb.rows; ++r) {
        const std::int64_t row = qb.row0 + r;
        if (r >= rows)
          store_zero_row(dq, dq_layout.offset(row, qb.h), D);
        else
          store_row<Acc>(dq, dq_layout.offset(row, qb.h), dq_acc.data() + r * D, D, scale);
      }
    }
  }
}

// ---- block-sparse pattern: query tiles visit their selected key tiles ----------------------

struct SparsePattern {
  const BlockSparseProblem& p;
  std::vector<std::int32_t> q_sizes, kv_sizes;
  const TensorView& q2k_index;
  const TensorView& q2k_count;
  const TensorView* k2q_offsets = nullptr;
  const TensorView* k2q_index = nullptr;
  int sub_blocks;  // query blocks per tile (a 256-slot tile is two blocks of 128 rows)

  SparsePattern(const BlockSparseProblem& problem, const BlockSparseOptions& o,
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

  int block_rows() const { return static_cast<int>(std::min<std::int64_t>(kBlockQ, p.tile_volume)); }

  QueryBlock query_block(std::int64_t b, std::int64_t h, std::int64_t tile, int sub) const {
    const int rows = block_rows();
    const int valid = std::clamp(q_sizes[tile] - sub * rows, 0, rows);
    return {b, h, b * p.seqlen_q + tile * p.tile_volume + sub * rows, tile, rows, valid};
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

  KeySpan span_of(std::int64_t b, std::int64_t tile) const {
    return {b * p.seqlen_k + tile * p.tile_volume, tile, kv_sizes[tile]};
  }

  template <class F>
  void for_each_key_span(const QueryBlock& qb, F&& f) const {
    const auto* idx = static_cast<const std::int32_t*>(q2k_index.data) +
                      qb.b * q2k_index.stride[0] + qb.h * q2k_index.stride[1] +
                      qb.pos * q2k_index.stride[2];
    const std::int32_t n = static_cast<const std::int32_t*>(q2k_count.data)
                               [qb.b * q2k_count.stride[0] + qb.h * q2k_count.stride[1] +
                                qb.pos * q2k_count.stride[2]];
    for (std::int32_t s = 0; s < n; ++s) {
      const KeySpan sp = span_of(qb.b, idx[s * q2k_index.stride[3]]);
      if (sp.cols > 0) f(sp);  // zero-size tiles: nothing to attend
    }
  }

  // Key slots past a tile's block size are left out of the span, not masked.
  template <class Acc>
  void mask(const QueryBlock&, int, const KeySpan&, Acc*) const {}

  bool query_row_valid(std::int64_t) const { return true; }

  std::vector<KeyBlock> key_blocks() const {
    std::vector<KeyBlock> blocks;
    for (std::int64_t b = 0; b < p.batch; ++b)
      for (std::int64_t hk = 0; hk < p.heads_kv; ++hk)
        for (std::int64_t t = 0; t < p.kv_tiles; ++t)
          blocks.push_back({b, hk, b * p.seqlen_k + t * p.tile_volume, t,
                            static_cast<int>(p.tile_volume), kv_sizes[t]});
    return blocks;
  }

  template <class F>
  void for_each_query_block(const KeyBlock& kb, F&& f) const {
    const KeySpan sp = span_of(kb.b, kb.pos);
    const std::int64_t group = p.heads_q / p.heads_kv;
    const auto* offsets = static_cast<const std::int32_t*>(k2q_offsets->data);
    const auto* index = static_cast<const std::int32_t*>(k2q_index->data);
    for (std::int64_t h = kb.hk * group; h < (kb.hk + 1) * group; ++h) {
      const std::int64_t ob = kb.b * k2q_offsets->stride[0] + h * k2q_offsets->stride[1];
      const std::int64_t ib = kb.b * k2q_index->stride[0] + h * k2q_index->stride[1];
      const std::int32_t begin = offsets[ob + kb.pos * k2q_offsets->stride[2]];
      const std::int32_t end = offsets[ob + (kb.pos + 1) * k2q_offsets->stride[2]];
      for (std::int32_t e = begin; e < end; ++e) {
        const std::int64_t tile = index[ib + e * k2q_index->stride[2]];
        for (int sub = 0; sub < sub_blocks; ++sub) f(query_block(kb.b, h, tile, sub), sp);
      }
    }
  }
};

}  // namespace

void cpu_block_sparse_forward(const BlockSparseProblem& p, const TensorView& q,
                              const TensorView& k, const TensorView& v,
                              const TensorView& q2k_index, const TensorView& q2k_count,
                              const TensorView& out, const TensorView& lse,
                              const BlockSparseOptions& o) {
  const ArgChecker check("vidattn::block_sparse_attention_forward");
  const SparsePattern pattern(p, o, q2k_index, q2k_count, check);
  auto run = [&](auto acc_tag) {
    using Acc = decltype(acc_tag);
    const PackedHeads<Acc> c(q, k, v, false, p.scale, o.num_threads);
    forward_mainloop(c, pattern, false, out, lse);
  };
  if (p.dtype == DType::kFloat64)
    run(double{});
  else
    run(float{});
}

void cpu_block_sparse_backward(const BlockSparseProblem& p, const TensorView& q,
                               const TensorView& k, const TensorView& v, const TensorView& out,
                               const TensorView& lse, const TensorView& grad_out,
                               const TensorView& q2k_index, const TensorView& q2k_count,
                               const TensorView& k2q_offsets, const TensorView& k2q_index,
                               const TensorView& dq, const TensorView& dk, const TensorView& dv,
                               const BlockSparseOptions& o) {
  const ArgChecker check("vidattn::block_sparse_attention_backward");
  SparsePattern pattern(p, o, q2k_index, q2k_count, check);
  pattern.k2q_offsets = &k2q_offsets;
  pattern.k2q_index = &k2q_index;
  // The transpose must describe the same selection; a cheap consistency check on its size.
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
  auto run = [&](auto acc_tag) {
    using Acc = decltype(acc_tag);
    const PackedHeads<Acc> c(q, k, v, false, p.scale, o.num_threads);
    backward_mainloop(c, pattern, false, p.scale, out, lse, grad_out, dq, dk, dv);
  };
  if (p.dtype == DType::kFloat64)
    run(double{});
  else
    run(float{});
}

}  // namespace vidattn::detail
