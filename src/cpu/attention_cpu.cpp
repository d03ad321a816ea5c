// CPU attention: blocked online softmax (flash style), O(S * D) extra memory, threads over
// (batch, head, query block) in the forward and over key blocks / query blocks in the two
// backward passes. Every output element is owned by one task, so results are deterministic
// whatever the thread count.
//
// The inputs are first packed into contiguous [heads][rows][dim] buffers in the accumulator
// type (float, or double for float64 inputs): this settles dtype conversion and arbitrary
// strides once, in O(S * D), before the O(S^2 * D) block products, which then run on BLAS.
#include <omp.h>

#include <algorithm>
#include <type_traits>
#include <cmath>
#include <limits>
#include <vector>

#include "../core/backends.h"
#include "../core/check.h"
#include "cpu_math.h"
#include "microkernels_avx2.h"

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
  const std::int64_t n = cu.shape[0] - 1;
  start.resize(n), len.resize(n);
  auto at = [&](std::int64_t i) { return std::int64_t(data[i * cu.stride[0]]); };
  if (at(0) != 0) check.fail("argument '", name, "' must start at 0, got ", at(0));
  for (std::int64_t i = 0; i < n; ++i) {
    start[i] = at(i);
    len[i] = at(i + 1) - at(i);
    if (len[i] < 0)
      check.fail("argument '", name, "' must be non-decreasing, but entry ", i + 1, " (",
                 at(i + 1), ") is below entry ", i, " (", at(i), ")");
    if (len[i] > max_len)
      check.fail("sequence ", i, " of '", name, "' has length ", len[i],
                 ", more than the max_seqlen given (", max_len, ")");
  }
  if (at(n) != total)
    check.fail("argument '", name, "' must end at the number of rows (", total, "), got ",
               at(n));
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
std::vector<Acc> pack(const TensorView& t, bool varlen, std::int64_t rows, std::int64_t heads,
                      std::int64_t dim, int threads, Acc mul = Acc(1)) {
  std::vector<Acc> out(static_cast<std::size_t>(rows * heads * dim));
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

void store_scalar(const TensorView& t, std::int64_t offset, double value) {
  if (t.dtype == DType::kFloat64)
    static_cast<double*>(t.data)[offset] = value;
  else
    static_cast<float*>(t.data)[offset] = static_cast<float>(value);
}

// Everything a block task reads: packed inputs, sequences and masks.
template <class Acc>
struct Context {
  const AttentionProblem& p;
  Sequences seq;
  std::int64_t rows_q, rows_k;  // token rows of q and of k/v
  std::vector<Acc> q, k, v;     // [H][rows][D]
  std::vector<std::uint8_t> k_valid, q_valid;
  bool has_key_mask;
  int threads;

  Context(const AttentionProblem& problem, const TensorView& qt, const TensorView& kt,
          const TensorView& vt, const AttentionOptions& o, const ArgChecker& check)
      : p(problem),
        seq(resolve_sequences(check, problem, qt, kt, o)),
        rows_q(qt.shape[0] * (problem.varlen ? 1 : qt.shape[1])),
        rows_k(kt.shape[0] * (problem.varlen ? 1 : kt.shape[1])),
        has_key_mask(o.key_padding_mask.has_value()),
        threads(o.num_threads > 0 ? o.num_threads : omp_get_max_threads()) {
    // q is packed pre-multiplied by the softmax scale: the logits come straight out of the
    // block product, and forward and backward share this one rounding.
    q = pack<Acc>(qt, p.varlen, rows_q, p.heads_q, p.head_dim, threads, Acc(p.scale));
    k = pack<Acc>(kt, p.varlen, rows_k, p.heads_kv, p.head_dim, threads);
    v = pack<Acc>(vt, p.varlen, rows_k, p.heads_kv, p.head_dim_v, threads);
    if constexpr (kUseTiles<Acc>) pack_k_panels();
    if (!p.varlen) {
      k_valid = pack_mask(o.key_padding_mask, p.batch, p.seqlen_k);
      q_valid = pack_mask(o.query_padding_mask, p.batch, p.seqlen_q);
    } else {
      q_valid.assign(static_cast<std::size_t>(rows_q), 1);
    }
  }

#if VIDATTN_CPU_AVX2
  // k of every (head, sequence) in 16-key panels, each sequence starting on a new panel.
  std::vector<float> k_panels;
  std::vector<std::int64_t> panel_row0;  // first panel row of each sequence
  std::int64_t panel_rows = 0;           // panel rows per head

  void pack_k_panels() {
    for (std::int64_t b = 0; b < p.batch; ++b) {
      panel_row0.push_back(panel_rows);
      panel_rows += (seq.k_len[b] + avx2::kPanel - 1) / avx2::kPanel * avx2::kPanel;
    }
    k_panels.resize(static_cast<std::size_t>(p.heads_kv * panel_rows * p.head_dim));
#pragma omp parallel for collapse(2) num_threads(threads) schedule(static) \
    if (p.heads_kv * panel_rows * p.head_dim >= kMinParallelElements)
    for (std::int64_t h = 0; h < p.heads_kv; ++h)
      for (std::int64_t b = 0; b < p.batch; ++b)
        avx2::pack_panels(k_rows(h, seq.k_start[b]), static_cast<int>(seq.k_len[b]),
                          static_cast<int>(p.head_dim), k_panel(h, b, 0));
  }
  float* k_panel(std::int64_t h, std::int64_t b, std::int64_t j0) {
    return k_panels.data() + (h * panel_rows + panel_row0[b] + j0) * p.head_dim;
  }
  const float* k_panel(std::int64_t h, std::int64_t b, std::int64_t j0) const {
    return k_panels.data() + (h * panel_rows + panel_row0[b] + j0) * p.head_dim;
  }
#else
  void pack_k_panels() {}
#endif

  std::int64_t kv_head(std::int64_t hq) const { return hq / (p.heads_q / p.heads_kv); }
  const Acc* q_rows(std::int64_t h, std::int64_t row) const {
    return q.data() + (h * rows_q + row) * p.head_dim;
  }
  const Acc* k_rows(std::int64_t h, std::int64_t row) const {
    return k.data() + (h * rows_k + row) * p.head_dim;
  }
  const Acc* v_rows(std::int64_t h, std::int64_t row) const {
    return v.data() + (h * rows_k + row) * p.head_dim_v;
  }
  // Keys [0, key_end) of sequence b are visible to some query of the block [i0, i0 + rows).
  std::int64_t key_end(std::int64_t b, std::int64_t i0, std::int64_t rows) const {
    const std::int64_t kl = seq.k_len[b];
    if (!p.causal) return kl;
    return std::clamp<std::int64_t>(i0 + rows + kl - seq.q_len[b], 0, kl);
  }

  // Scaled, masked logits S[rows x cols] (leading dim kBlockK) of queries i0.. of head hq
  // against keys j0.. of sequence b (q is packed pre-scaled). The forward and the backward
  // both call this, so the backward recomputes exactly the forward's logits.
  void scores(std::int64_t b, std::int64_t hq, std::int64_t i0, int rows, std::int64_t j0,
              int cols, Acc* S) const {
    const int D = static_cast<int>(p.head_dim);
#if VIDATTN_CPU_AVX2
    if constexpr (kUseTiles<Acc>)
      avx2::gemm_nt_panels(rows, (cols + avx2::kPanel - 1) / avx2::kPanel, D,
                           q_rows(hq, seq.q_start[b] + i0), D, k_panel(kv_head(hq), b, j0), S,
                           kBlockK);
    else
#endif
      cpu::gemm_nt<Acc>(rows, cols, D, q_rows(hq, seq.q_start[b] + i0), D,
                        k_rows(kv_head(hq), seq.k_start[b] + j0), D, Acc(0), S, kBlockK);
    const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
    const std::int64_t causal_shift = seq.k_len[b] - seq.q_len[b];
    const std::uint8_t* kv = has_key_mask ? k_valid.data() + seq.k_start[b] + j0 : nullptr;
    if (!p.causal && !kv) return;
    for (int r = 0; r < rows; ++r) {
      Acc* s = S + r * kBlockK;
      if (p.causal) {
        const std::int64_t last = i0 + r + causal_shift - j0;  // last visible column
        for (std::int64_t c = std::max<std::int64_t>(last + 1, 0); c < cols; ++c) s[c] = neg_inf;
      }
      if (kv)
        for (int c = 0; c < cols; ++c)
          if (!kv[c]) s[c] = neg_inf;
    }
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

template <class Acc>
void forward(const AttentionProblem& p, const TensorView& qt, const TensorView& kt,
             const TensorView& vt, const TensorView& out, const TensorView& lse,
             const AttentionOptions& o, const ArgChecker& check) {
  const Context<Acc> c(p, qt, kt, vt, o, check);
  const RowLayout out_layout = token_rows(out, p.varlen);
  const RowLayout lse_layout = lse_rows(lse, p.varlen);
  const std::int64_t Dv = p.head_dim_v;

  struct Task { std::int64_t b, h, i0; };
  std::vector<Task> tasks;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_q; ++h)
      for (std::int64_t i0 = 0; i0 < c.seq.q_len[b]; i0 += kBlockQ) tasks.push_back({b, h, i0});

  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();
#pragma omp parallel num_threads(threads_for(c.threads, tasks.size()))
  {
    std::vector<Acc> S(kBlockQ * kBlockK), acc(kBlockQ * Dv), m(kBlockQ), l(kBlockQ);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < tasks.size(); ++t) {
      const auto [b, h, i0] = tasks[t];
      const int rows = static_cast<int>(std::min<std::int64_t>(kBlockQ, c.seq.q_len[b] - i0));
      std::fill(acc.begin(), acc.end(), Acc(0));
      std::fill(m.begin(), m.end(), neg_inf);
      std::fill(l.begin(), l.end(), Acc(0));
      const std::int64_t j_end = c.key_end(b, i0, rows);
      for (std::int64_t j0 = 0; j0 < j_end; j0 += kBlockK) {
        const int cols = static_cast<int>(std::min<std::int64_t>(kBlockK, c.seq.k_len[b] - j0));
        c.scores(b, h, i0, rows, j0, cols, S.data());
        for (int r = 0; r < rows; ++r) {
          Acc* s = S.data() + r * kBlockK;
          const Acc m_new = std::max(m[r], row_max(s, cols));
          if (m_new == neg_inf) {  // nothing visible yet: keep the row empty, avoid inf - inf
            std::fill(s, s + cols, Acc(0));
            continue;
          }
          const Acc sum = exp_shift_sum(s, cols, m_new);
          const Acc alpha = cpu::exp_approx(m[r] - m_new);
          if (alpha != Acc(1)) {
            Acc* a = acc.data() + r * Dv;
#pragma omp simd
            for (std::int64_t d = 0; d < Dv; ++d) a[d] *= alpha;
          }
          l[r] = l[r] * alpha + sum;
          m[r] = m_new;
        }
        const Acc* v_block = c.v_rows(c.kv_head(h), c.seq.k_start[b] + j0);
#if VIDATTN_CPU_AVX2
        if constexpr (kUseTiles<Acc>)
          avx2::gemm_nn_acc(rows, static_cast<int>(Dv), cols, S.data(), kBlockK, v_block,
                            static_cast<int>(Dv), acc.data(), static_cast<int>(Dv));
        else
#endif
          cpu::gemm_nn<Acc>(rows, static_cast<int>(Dv), cols, S.data(), kBlockK, v_block,
                            static_cast<int>(Dv), Acc(1), acc.data(), static_cast<int>(Dv));
      }
      for (int r = 0; r < rows; ++r) {
        const std::int64_t row = c.seq.q_start[b] + i0 + r;
        const bool empty = l[r] == Acc(0) || !c.q_valid[row];
        const Acc inv = empty ? Acc(0) : Acc(1) / l[r];
        if (empty) std::fill(acc.begin() + r * Dv, acc.begin() + (r + 1) * Dv, Acc(0));
        store_row<Acc>(out, out_layout.offset(row, h), acc.data() + r * Dv, Dv, inv);
        store_scalar(lse, lse_layout.offset(row, h),
                     empty ? -std::numeric_limits<double>::infinity()
                           : double(m[r] + std::log(l[r])));
      }
    }
  }
}

template <class Acc>
void backward(const AttentionProblem& p, const TensorView& qt, const TensorView& kt,
              const TensorView& vt, const TensorView& out, const TensorView& lse_t,
              const TensorView& grad_out, const TensorView& dq, const TensorView& dk,
              const TensorView& dv, const AttentionOptions& o, const ArgChecker& check) {
  const Context<Acc> c(p, qt, kt, vt, o, check);
  const std::int64_t D = p.head_dim, Dv = p.head_dim_v, Hq = p.heads_q;
  const std::int64_t group = p.heads_q / p.heads_kv;
  const Acc scale = static_cast<Acc>(p.scale);
  const Acc neg_inf = -std::numeric_limits<Acc>::infinity();

  // Per query row: dO packed, delta = rowsum(dO * O), and the forward's LSE (-inf marks a
  // row with no visible key, or a padded query: such rows get P = 0).
  const std::vector<Acc> dout = pack<Acc>(grad_out, p.varlen, c.rows_q, Hq, Dv, c.threads);
  const std::vector<Acc> o_packed = pack<Acc>(out, p.varlen, c.rows_q, Hq, Dv, c.threads);
  std::vector<Acc> delta(static_cast<std::size_t>(Hq * c.rows_q)), lse(delta.size());
  const RowLayout lse_layout = lse_rows(lse_t, p.varlen);
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
    lse[hr] = c.q_valid[r] ? value : neg_inf;
  }

  // P = exp(S - lse) and dS = P * (dO V^T - delta) of one block, in place in S and dP.
  auto probs_and_dscores = [&](std::int64_t b, std::int64_t h, std::int64_t i0, int rows,
                               std::int64_t j0, int cols, Acc* S, Acc* dP) {
    c.scores(b, h, i0, rows, j0, cols, S);
    const std::int64_t row0 = h * c.rows_q + c.seq.q_start[b] + i0;
    cpu::gemm_nt<Acc>(rows, cols, static_cast<int>(Dv), dout.data() + row0 * Dv,
                      static_cast<int>(Dv), c.v_rows(c.kv_head(h), c.seq.k_start[b] + j0),
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

  const RowLayout dq_layout = token_rows(dq, p.varlen);
  const RowLayout dk_layout = token_rows(dk, p.varlen);
  const RowLayout dv_layout = token_rows(dv, p.varlen);
  struct Task { std::int64_t b, h, start; };

  // Pass 1: dK and dV, one task per (sequence, kv head, key block).
  std::vector<Task> kv_tasks;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < p.heads_kv; ++h)
      for (std::int64_t j0 = 0; j0 < c.seq.k_len[b]; j0 += kBlockK) kv_tasks.push_back({b, h, j0});
#pragma omp parallel num_threads(threads_for(c.threads, kv_tasks.size()))
  {
    std::vector<Acc> S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK);
    std::vector<Acc> dk_acc(kBlockK * D), dv_acc(kBlockK * Dv);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < kv_tasks.size(); ++t) {
      const auto [b, hk, j0] = kv_tasks[t];
      const int cols = static_cast<int>(std::min<std::int64_t>(kBlockK, c.seq.k_len[b] - j0));
      std::fill(dk_acc.begin(), dk_acc.end(), Acc(0));
      std::fill(dv_acc.begin(), dv_acc.end(), Acc(0));
      for (std::int64_t h = hk * group; h < (hk + 1) * group; ++h)
        for (std::int64_t i0 = 0; i0 < c.seq.q_len[b]; i0 += kBlockQ) {
          const int rows = static_cast<int>(std::min<std::int64_t>(kBlockQ, c.seq.q_len[b] - i0));
          if (c.key_end(b, i0, rows) <= j0) continue;  // causal: the block sees none of these keys
          probs_and_dscores(b, h, i0, rows, j0, cols, S.data(), dP.data());
          const std::int64_t row0 = h * c.rows_q + c.seq.q_start[b] + i0;
          cpu::gemm_tn<Acc>(cols, static_cast<int>(Dv), rows, S.data(), kBlockK,
                            dout.data() + row0 * Dv, static_cast<int>(Dv), Acc(1),
                            dv_acc.data(), static_cast<int>(Dv));
          cpu::gemm_tn<Acc>(cols, static_cast<int>(D), rows, dP.data(), kBlockK,
                            c.q_rows(h, c.seq.q_start[b] + i0), static_cast<int>(D), Acc(1),
                            dk_acc.data(), static_cast<int>(D));
        }
      for (int x = 0; x < cols; ++x) {
        const std::int64_t row = c.seq.k_start[b] + j0 + x;
        // dK = scale * dS^T Q: the scale is already in the packed q.
        store_row<Acc>(dk, dk_layout.offset(row, hk), dk_acc.data() + x * D, D, Acc(1));
        store_row<Acc>(dv, dv_layout.offset(row, hk), dv_acc.data() + x * Dv, Dv, Acc(1));
      }
    }
  }

  // Pass 2: dQ, one task per (sequence, q head, query block).
  std::vector<Task> q_tasks;
  for (std::int64_t b = 0; b < p.batch; ++b)
    for (std::int64_t h = 0; h < Hq; ++h)
      for (std::int64_t i0 = 0; i0 < c.seq.q_len[b]; i0 += kBlockQ) q_tasks.push_back({b, h, i0});
#pragma omp parallel num_threads(threads_for(c.threads, q_tasks.size()))
  {
    std::vector<Acc> S(kBlockQ * kBlockK), dP(kBlockQ * kBlockK), dq_acc(kBlockQ * D);
#pragma omp for schedule(dynamic)
    for (std::size_t t = 0; t < q_tasks.size(); ++t) {
      const auto [b, h, i0] = q_tasks[t];
      const int rows = static_cast<int>(std::min<std::int64_t>(kBlockQ, c.seq.q_len[b] - i0));
      std::fill(dq_acc.begin(), dq_acc.end(), Acc(0));
      const std::int64_t j_end = c.key_end(b, i0, rows);
      for (std::int64_t j0 = 0; j0 < j_end; j0 += kBlockK) {
        const int cols = static_cast<int>(std::min<std::int64_t>(kBlockK, c.seq.k_len[b] - j0));
        probs_and_dscores(b, h, i0, rows, j0, cols, S.data(), dP.data());
        cpu::gemm_nn<Acc>(rows, static_cast<int>(D), cols, dP.data(), kBlockK,
                          c.k_rows(c.kv_head(h), c.seq.k_start[b] + j0), static_cast<int>(D),
                          Acc(1), dq_acc.data(), static_cast<int>(D));
      }
      for (int r = 0; r < rows; ++r) {
        const std::int64_t row = c.seq.q_start[b] + i0 + r;
        store_row<Acc>(dq, dq_layout.offset(row, h), dq_acc.data() + r * D, D, scale);
      }
    }
  }
}

}  // namespace

void cpu_attention_forward(const AttentionProblem& p, const TensorView& q, const TensorView& k,
                           const TensorView& v, const TensorView& out, const TensorView& lse,
                           const AttentionOptions& options) {
  const ArgChecker check("vidattn::attention_forward");
  cpu::blas_use_one_thread();
  if (p.dtype == DType::kFloat64)
    forward<double>(p, q, k, v, out, lse, options, check);
  else
    forward<float>(p, q, k, v, out, lse, options, check);
}

void cpu_attention_backward(const AttentionProblem& p, const TensorView& q,
                            const TensorView& k, const TensorView& v, const TensorView& out,
                            const TensorView& lse, const TensorView& grad_out,
                            const TensorView& dq, const TensorView& dk, const TensorView& dv,
                            const AttentionOptions& options) {
  const ArgChecker check("vidattn::attention_backward");
  cpu::blas_use_one_thread();
  if (p.dtype == DType::kFloat64)
    backward<double>(p, q, k, v, out, lse, grad_out, dq, dk, dv, options, check);
  else
    backward<float>(p, q, k, v, out, lse, grad_out, dq, dk, dv, options, check);
}

}  // namespace vidattn::detail
