// One attention problem for the C++ tests: random inputs in a chosen memory layout, the
// options that describe it, NaN-poisoned outputs, and the kernel run.
#pragma once

#include <functional>
#include <sstream>

#include "attention_test_util.h"

namespace vidattn_test {

struct Case {
  DType dtype = DType::kFloat32;
  std::int64_t batch = 1, seqlen_q = 1, seqlen_k = 1;  // batched mode
  std::int64_t heads_q = 1, heads_kv = 1, head_dim = 16, head_dim_v = 16;
  bool causal = false, key_mask = false, query_mask = false;
  double input_scale = 1.0;
  // Inputs and outputs as transposed views ([B, H, S, D] memory for [B, S, H, D]) with
  // padded rows, instead of contiguous tensors.
  bool strided = false;
  bool varlen = false;  // packed mode: q_lens / k_lens instead of batch / seqlen_*
  std::vector<std::int64_t> q_lens, k_lens;
  std::optional<double> scale;

  std::string name() const {
    std::ostringstream s;
    s << short_name(dtype) << '_';
    if (varlen) {
      s << "varlen";
      for (auto l : q_lens) s << '_' << l;
      s << "_k";
      for (auto l : k_lens) s << '_' << l;
    } else {
      s << 'B' << batch << "_Sq" << seqlen_q << "_Sk" << seqlen_k;
    }
    s << "_H" << heads_q << 'x' << heads_kv << "_D" << head_dim << "_Dv" << head_dim_v;
    if (causal) s << "_causal";
    if (key_mask) s << "_kmask";
    if (query_mask) s << "_qmask";
    if (strided) s << "_strided";
    s << "_x" << input_scale;
    return s.str();
  }
};

// gtest prints a test parameter with this instead of its bytes.
inline void PrintTo(const Case& c, std::ostream* os) { *os << c.name(); }

struct Problem {
  Case c;
  HostTensor q, k, v, grad_out, key_mask, query_mask, cu_q, cu_k;
  std::vector<double> qv, kv, vv, gv;  // the inputs' values, row-major
  RefProblem ref;
  vidattn::AttentionOptions options;
};

struct Outputs {
  HostTensor out, lse, dq, dk, dv;
};

// Memory layouts: tokens-major [.., S, H, D] logical, heads-major memory when strided.
inline HostTensor make_tensor(const Case& c, DType dtype, std::vector<std::int64_t> shape) {
  if (!c.strided) return HostTensor(dtype, std::move(shape));
  if (shape.size() == 4) return HostTensor(dtype, std::move(shape), {0, 2, 1, 3}, 3);
  return HostTensor(dtype, std::move(shape), {1, 0, 2}, 5);  // varlen [T, H, D]
}

inline HostTensor make_lse(const Case& c, std::vector<std::int64_t> shape) {
  const DType t = c.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  if (!c.strided) return HostTensor(t, std::move(shape));
  if (shape.size() == 3) return HostTensor(t, std::move(shape), {1, 0, 2}, 2);
  return HostTensor(t, std::move(shape), {0, 1}, 2);
}

inline std::uint64_t seed_of(const std::string& s) {
  std::uint64_t h = 1469598103934665603ull;  // FNV-1a: stable across platforms
  for (unsigned char ch : s) h = (h ^ ch) * 1099511628211ull;
  return h;
}

inline Problem make_problem(const Case& c, std::uint64_t seed) {
  Problem p;
  p.c = c;
  std::mt19937_64 rng(seed);
  std::int64_t rows_q, rows_k;
  if (c.varlen) {
    p.ref = RefProblem::packed(c.q_lens, c.k_lens);
    rows_q = p.ref.rows_q(), rows_k = p.ref.rows_k();
    p.q = make_tensor(c, c.dtype, {rows_q, c.heads_q, c.head_dim});
    p.k = make_tensor(c, c.dtype, {rows_k, c.heads_kv, c.head_dim});
    p.v = make_tensor(c, c.dtype, {rows_k, c.heads_kv, c.head_dim_v});
    p.grad_out = make_tensor(c, c.dtype, {rows_q, c.heads_q, c.head_dim_v});
    p.cu_q = int32_tensor(offsets_of(c.q_lens));
    p.cu_k = int32_tensor(offsets_of(c.k_lens));
    p.options.cu_seqlens_q = p.cu_q.view();
    p.options.cu_seqlens_k = p.cu_k.view();
    auto longest = [](const std::vector<std::int64_t>& l) {
      return l.empty() ? 0 : *std::max_element(l.begin(), l.end());
    };
    p.options.max_seqlen_q = longest(c.q_lens);
    p.options.max_seqlen_k = longest(c.k_lens);
  } else {
    p.ref = RefProblem::batched(c.batch, c.seqlen_q, c.seqlen_k);
    rows_q = c.batch * c.seqlen_q, rows_k = c.batch * c.seqlen_k;
    p.q = make_tensor(c, c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim});
    p.k = make_tensor(c, c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim});
    p.v = make_tensor(c, c.dtype, {c.batch, c.seqlen_k, c.heads_kv, c.head_dim_v});
    p.grad_out = make_tensor(c, c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim_v});
  }
  p.qv = p.q.randomize(rng, c.input_scale);
  p.kv = p.k.randomize(rng, c.input_scale);
  p.vv = p.v.randomize(rng, c.input_scale);
  p.gv = p.grad_out.randomize(rng);

  // Masks: ~70% valid; with B > 1 the last sequence has no valid key and the first no
  // valid query, so rows with nothing to attend to are always part of the test.
  std::bernoulli_distribution valid(0.7);
  auto make_mask = [&](std::int64_t len, std::int64_t fully_padded, HostTensor& t,
                       std::vector<std::uint8_t>& per_row) {
    // [B, S] mask stored transposed ([S, B] memory) when strided.
    t = c.strided ? HostTensor(DType::kBool, {c.batch, len}, {1, 0})
                  : HostTensor(DType::kBool, {c.batch, len});
    per_row.assign(c.batch * len, 0);
    for (std::int64_t b = 0; b < c.batch; ++b)
      for (std::int64_t s = 0; s < len; ++s) {
        const bool ok = valid(rng) && !(c.batch > 1 && b == fully_padded);
        t.set(b * len + s, ok);
        per_row[b * len + s] = ok;
      }
  };
  if (c.key_mask) {
    make_mask(c.seqlen_k, c.batch - 1, p.key_mask, p.ref.key_valid);
    p.options.key_padding_mask = p.key_mask.view();
  }
  if (c.query_mask) {
    make_mask(c.seqlen_q, 0, p.query_mask, p.ref.query_valid);
    p.options.query_padding_mask = p.query_mask.view();
  }

  p.ref.heads_q = c.heads_q, p.ref.heads_kv = c.heads_kv;
  p.ref.head_dim = c.head_dim, p.ref.head_dim_v = c.head_dim_v;
  p.ref.scale = c.scale ? *c.scale : 1.0 / std::sqrt(static_cast<double>(c.head_dim));
  p.ref.causal = c.causal;
  p.options.scale = c.scale;
  p.options.causal = c.causal;
  return p;
}

// Fresh NaN-poisoned outputs for p, in p's layout.
inline Outputs make_outputs(const Problem& p) {
  const Case& c = p.c;
  Outputs o;
  const std::int64_t rows_q = p.ref.rows_q();
  if (c.varlen) {
    o.out = make_tensor(c, c.dtype, {rows_q, c.heads_q, c.head_dim_v});
    o.lse = make_lse(c, {c.heads_q, rows_q});
  } else {
    o.out = make_tensor(c, c.dtype, {c.batch, c.seqlen_q, c.heads_q, c.head_dim_v});
    o.lse = make_lse(c, {c.batch, c.heads_q, c.seqlen_q});
  }
  o.dq = make_tensor(c, c.dtype, p.q.shape());
  o.dk = make_tensor(c, c.dtype, p.k.shape());
  o.dv = make_tensor(c, c.dtype, p.v.shape());
  return o;
}

inline void run_forward(const Problem& p, Outputs& o, int num_threads = 0) {
  vidattn::AttentionOptions options = p.options;
  options.num_threads = num_threads;
  vidattn::attention_forward(p.q.view(), p.k.view(), p.v.view(), o.out.view(), o.lse.view(),
                             options);
}

inline void run_backward(const Problem& p, Outputs& o, int num_threads = 0) {
  vidattn::AttentionOptions options = p.options;
  options.num_threads = num_threads;
  vidattn::attention_backward(p.q.view(), p.k.view(), p.v.view(), o.out.view(), o.lse.view(),
                              p.grad_out.view(), o.dq.view(), o.dk.view(), o.dv.view(),
                              options);
}

// Every element of t written (no poison left, no NaN result) and nothing outside its view.
inline void expect_fully_written(const char* name, const HostTensor& t) {
  EXPECT_EQ(t.count_nan(), 0) << name << ": elements left unwritten (NaN)";
  EXPECT_EQ(t.count_touched_outside_view(), 0) << name << ": wrote outside its view";
}

}  // namespace vidattn_test
