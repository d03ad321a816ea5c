// Test support for the torch-free attention API: host tensors of every dtype with any
// physical layout (transposed, padded rows) and NaN poisoning, and a naive attention
// reference (forward and backward) that runs in float64 either exactly or rounding its
// stages to a low-precision dtype, which gives the "same math in the kernel's dtype"
// baseline of the accuracy rule in docs/conventions.md.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include "vidattn/vidattn.h"

namespace vidattn_test {

using vidattn::DType;
using vidattn::TensorView;

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// n standard-normal doubles from a seeded generator.
inline std::vector<double> random_vector(std::size_t n, unsigned seed) {
  std::mt19937 gen(seed);
  std::normal_distribution<double> dist;
  std::vector<double> v(n);
  for (double& x : v) x = dist(gen);
  return v;
}

// ---- number formats ---------------------------------------------------------------------

struct Format {
  int significand_bits;  // including the implicit leading bit
  int min_normal_exp;    // smallest normal number is 2^min_normal_exp
  double max_finite;
  double eps;            // 2^(1 - significand_bits)
};

inline Format format_of(DType t) {
  switch (t) {
    case DType::kFloat16: return {11, -14, 65504.0, std::ldexp(1.0, -10)};
    case DType::kBFloat16: return {8, -126, 3.3895313892515355e38, std::ldexp(1.0, -7)};
    case DType::kFloat32: return {24, -126, 3.4028234663852886e38, std::ldexp(1.0, -23)};
    default: return {53, -1022, std::numeric_limits<double>::max(), std::ldexp(1.0, -52)};
  }
}

// Rounds x to the nearest value of dtype t (ties to even), with subnormals and overflow.
// Written from the definition (scale to an integer quantum, nearbyint), independently of
// the library's bit-level conversions.
inline double round_to(DType t, double x) {
  if (t == DType::kFloat64 || !std::isfinite(x) || x == 0.0) return x;
  const Format f = format_of(t);
  int e;
  std::frexp(x, &e);  // |x| = m * 2^e with m in [0.5, 1)
  const int quantum_exp = std::max(e, f.min_normal_exp + 1) - f.significand_bits;
  const double r = std::ldexp(std::nearbyint(std::ldexp(x, -quantum_exp)), quantum_exp);
  return std::fabs(r) > f.max_finite ? std::copysign(kInf, x) : r;
}

// One unit in the last place of dtype t at magnitude x (> 0).
inline double ulp(DType t, double x) {
  if (x <= 0.0 || !std::isfinite(x)) return 0.0;
  return format_of(t).eps * std::ldexp(1.0, std::ilogb(x));
}

inline std::uint16_t encode_fp16(double x) {
  const double r = round_to(DType::kFloat16, x);
  const std::uint16_t sign = std::signbit(r) ? 0x8000 : 0;
  const double a = std::fabs(r);
  if (std::isnan(r)) return 0x7e00;
  if (std::isinf(a)) return sign | 0x7c00;
  if (a < std::ldexp(1.0, -14)) return sign | static_cast<std::uint16_t>(std::ldexp(a, 24));
  int e;
  const double m = std::frexp(a, &e);  // a = 2m * 2^(e-1), 2m in [1, 2)
  const auto mantissa = static_cast<std::uint16_t>(std::ldexp(2.0 * m - 1.0, 10));
  return sign | static_cast<std::uint16_t>((e - 1 + 15) << 10) | mantissa;
}

inline double decode_fp16(std::uint16_t h) {
  const double sign = (h & 0x8000) ? -1.0 : 1.0;
  const int e = (h >> 10) & 0x1f, mantissa = h & 0x3ff;
  if (e == 0x1f) return mantissa ? std::numeric_limits<double>::quiet_NaN() : sign * kInf;
  if (e == 0) return sign * std::ldexp(mantissa, -24);
  return sign * std::ldexp(1.0 + mantissa / 1024.0, e - 15);
}

inline std::uint16_t encode_bf16(double x) {
  if (std::isnan(x)) return 0x7fc0;
  const float f = static_cast<float>(round_to(DType::kBFloat16, x));  // exact in float
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return static_cast<std::uint16_t>(u >> 16);
}

inline double decode_bf16(std::uint16_t h) {
  const std::uint32_t u = std::uint32_t(h) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline const char* short_name(DType t) {
  switch (t) {
    case DType::kFloat32: return "f32";
    case DType::kFloat16: return "f16";
    case DType::kBFloat16: return "bf16";
    case DType::kFloat64: return "f64";
    case DType::kInt32: return "i32";
    case DType::kBool: return "bool";
  }
  return "?";
}

// ---- host tensors -------------------------------------------------------------------------

// A tensor of logical shape `shape` whose memory layout is any order of its dimensions
// (listed outermost first), with `row_pad` unused elements after every row of the last
// logical dimension. The storage is NaN-poisoned at
// creation, so a test can check that a kernel wrote every element of the view and nothing
// outside it.
class HostTensor {
 public:
  HostTensor() = default;
  HostTensor(DType dtype, std::vector<std::int64_t> shape, std::vector<int> order = {},
             std::int64_t row_pad = 0)
      : dtype_(dtype), shape_(std::move(shape)), stride_(shape_.size()) {
    const int n = static_cast<int>(shape_.size());
    if (order.empty()) {
      order.resize(n);
      std::iota(order.begin(), order.end(), 0);
    }
    std::int64_t step = 1;
    for (int i = n - 1; i >= 0; --i) {
      const int d = order[i];
      stride_[d] = step;
      step *= shape_[d] + (d == n - 1 ? row_pad : 0);
    }
    storage_elems_ = n == 0 ? 1 : step;
    bytes_.assign(static_cast<std::size_t>(storage_elems_ * vidattn::dtype_size(dtype_)), 0);
    poison();
  }

  DType dtype() const { return dtype_; }
  const std::vector<std::int64_t>& shape() const { return shape_; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto s : shape_) n *= s;
    return n;
  }

  TensorView view() const {
    TensorView t;
    t.data = numel() > 0 ? const_cast<unsigned char*>(bytes_.data()) : nullptr;
    t.dtype = dtype_;
    t.ndim = static_cast<int>(shape_.size());
    for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape_[i], t.stride[i] = stride_[i];
    return t;
  }

  // Storage offset of the element with row-major logical index `flat`.
  std::int64_t offset(std::int64_t flat) const {
    std::int64_t off = 0;
    for (int d = static_cast<int>(shape_.size()) - 1; d >= 0; --d) {
      off += (flat % shape_[d]) * stride_[d];
      flat /= shape_[d];
    }
    return off;
  }

  double get(std::int64_t flat) const { return load(offset(flat)); }
  void set(std::int64_t flat, double x) { store(offset(flat), x); }

  // Every logical element, row-major.
  std::vector<double> values() const {
    std::vector<double> v(static_cast<std::size_t>(numel()));
    for (std::int64_t i = 0; i < numel(); ++i) v[i] = get(i);
    return v;
  }
  void set_values(const std::vector<double>& v) {
    for (std::int64_t i = 0; i < numel(); ++i) set(i, v[i]);
  }

  // Fills with N(0, scale^2) values rounded to the dtype; returns them (exact in double).
  std::vector<double> randomize(std::mt19937_64& rng, double scale = 1.0) {
    std::normal_distribution<double> normal(0.0, scale);
    for (std::int64_t i = 0; i < numel(); ++i) set(i, normal(rng));
    return values();
  }

  void poison() {
    for (std::int64_t i = 0; i < storage_elems_; ++i) store_nan(i);
  }

  // Elements of the view that are NaN (unwritten, or a NaN result).
  std::int64_t count_nan() const {
    std::int64_t n = 0;
    for (std::int64_t i = 0; i < numel(); ++i) n += std::isnan(get(i));
    return n;
  }

  // Storage elements outside the view that no longer hold the poison.
  std::int64_t count_touched_outside_view() const {
    std::vector<char> in_view(static_cast<std::size_t>(storage_elems_), 0);
    for (std::int64_t i = 0; i < numel(); ++i) in_view[offset(i)] = 1;
    std::int64_t n = 0;
    for (std::int64_t o = 0; o < storage_elems_; ++o)
      if (!in_view[o] && !std::isnan(load(o))) ++n;
    return n;
  }

  const std::vector<unsigned char>& bytes() const { return bytes_; }

 private:
  double load(std::int64_t o) const {
    const unsigned char* p = bytes_.data();
    switch (dtype_) {
      case DType::kFloat64: return reinterpret_cast<const double*>(p)[o];
      case DType::kFloat32: return reinterpret_cast<const float*>(p)[o];
      case DType::kFloat16: return decode_fp16(reinterpret_cast<const std::uint16_t*>(p)[o]);
      case DType::kBFloat16: return decode_bf16(reinterpret_cast<const std::uint16_t*>(p)[o]);
      case DType::kInt32: return reinterpret_cast<const std::int32_t*>(p)[o];
      case DType::kBool: return reinterpret_cast<const std::uint8_t*>(p)[o];
    }
    return 0.0;
  }
  void store(std::int64_t o, double x) {
    unsigned char* p = bytes_.data();
    switch (dtype_) {
      case DType::kFloat64: reinterpret_cast<double*>(p)[o] = x; break;
      case DType::kFloat32: reinterpret_cast<float*>(p)[o] = static_cast<float>(x); break;
      case DType::kFloat16: reinterpret_cast<std::uint16_t*>(p)[o] = encode_fp16(x); break;
      case DType::kBFloat16: reinterpret_cast<std::uint16_t*>(p)[o] = encode_bf16(x); break;
      case DType::kInt32: reinterpret_cast<std::int32_t*>(p)[o] = static_cast<std::int32_t>(x); break;
      case DType::kBool: reinterpret_cast<std::uint8_t*>(p)[o] = x != 0.0; break;
    }
  }
  void store_nan(std::int64_t o) {
    if (dtype_ == DType::kInt32 || dtype_ == DType::kBool) return store(o, 0);
    store(o, std::numeric_limits<double>::quiet_NaN());
  }

  DType dtype_ = DType::kFloat32;
  std::vector<std::int64_t> shape_, stride_;
  std::int64_t storage_elems_ = 1;
  std::vector<unsigned char> bytes_;
};

inline HostTensor int32_tensor(const std::vector<std::int64_t>& values) {
  HostTensor t(DType::kInt32, {static_cast<std::int64_t>(values.size())});
  for (std::size_t i = 0; i < values.size(); ++i) t.set(i, static_cast<double>(values[i]));
  return t;
}

inline std::vector<std::int64_t> offsets_of(const std::vector<std::int64_t>& lengths) {
  std::vector<std::int64_t> cu{0};
  for (auto l : lengths) cu.push_back(cu.back() + l);
  return cu;
}

inline double max_abs(const std::vector<double>& x) {
  double m = 0.0;
  for (double e : x)
    if (std::isfinite(e)) m = std::max(m, std::fabs(e));
  return m;
}

// ---- naive reference ----------------------------------------------------------------------

// What the reference computes, in "token rows": row r of q is token r of [B * Sq] (batched)
// or [Tq] (varlen); sequence s owns q rows q_start[s] .. + q_len[s], likewise for k / v.
struct RefProblem {
  std::int64_t heads_q = 1, heads_kv = 1, head_dim = 1, head_dim_v = 1;
  double scale = 1.0;
  bool causal = false;
  std::vector<std::int64_t> q_start, q_len, k_start, k_len;
  std::vector<std::uint8_t> key_valid, query_valid;  // per token row; empty = all valid
  bool varlen = false;
  std::int64_t batch = 0, seqlen_q = 0;  // batched: for the [B, H, Sq] LSE layout

  std::int64_t rows_q() const { return q_len.empty() ? 0 : q_start.back() + q_len.back(); }
  std::int64_t rows_k() const { return k_len.empty() ? 0 : k_start.back() + k_len.back(); }

  static RefProblem batched(std::int64_t batch, std::int64_t seqlen_q, std::int64_t seqlen_k) {
    RefProblem p;
    p.batch = batch, p.seqlen_q = seqlen_q;
    for (std::int64_t b = 0; b < batch; ++b) {
      p.q_start.push_back(b * seqlen_q), p.q_len.push_back(seqlen_q);
      p.k_start.push_back(b * seqlen_k), p.k_len.push_back(seqlen_k);
    }
    return p;
  }
  static RefProblem packed(const std::vector<std::int64_t>& q_lens,
                           const std::vector<std::int64_t>& k_lens) {
    RefProblem p;
    p.varlen = true;
    const auto cq = offsets_of(q_lens), ck = offsets_of(k_lens);
    p.q_start.assign(cq.begin(), cq.end() - 1), p.q_len = q_lens;
    p.k_start.assign(ck.begin(), ck.end() - 1), p.k_len = k_lens;
    p.batch = static_cast<std::int64_t>(q_lens.size());
    return p;
  }

  // Row-major index into the LSE tensor ([B, Hq, Sq] or [Hq, Tq]) of (token row, head).
  std::int64_t lse_index(std::int64_t row, std::int64_t h) const {
    if (varlen) return h * rows_q() + row;
    const std::int64_t b = row / seqlen_q, i = row % seqlen_q;
    return (b * heads_q + h) * seqlen_q + i;
  }
};

struct RefResult {
  std::vector<double> out, lse, dq, dk, dv;  // logical row-major layouts of the outputs
  // Extra floors for the gradients: bounds of two float32 roundings of any flash-style
  // backward that eager math does not make (see test_attention.cpp).
  double dq_floor = 0.0, dk_floor = 0.0, dv_floor = 0.0;
};

// Rounds a value to the precision the emulated computation keeps between stages.
using Rounding = double (*)(double);
inline double exact(double x) { return x; }
template <DType T>
double rounded(double x) {
  return round_to(T, x);
}
inline Rounding rounding_for(DType t) {
  switch (t) {
    case DType::kFloat32: return rounded<DType::kFloat32>;
    case DType::kFloat16: return rounded<DType::kFloat16>;
    case DType::kBFloat16: return rounded<DType::kBFloat16>;
    default: return exact;
  }
}

// The accumulator of PyTorch's CPU math in dtype t: float32 for every low-precision
// dtype (bf16 / fp16 matmuls and softmax accumulate in float32), float64 for float64.
inline Rounding accumulator_for(DType t) {
  return t == DType::kFloat64 ? exact : rounded<DType::kFloat32>;
}

// Naive attention forward and backward. With the default (exact) roundings it is the
// float64 reference. With rnd = rounding_for(t) and acc = accumulator_for(t) it mimics
// PyTorch's eager math in dtype t: every stage's result (q.k, the scaled scores, the
// probabilities, P.V, dO.V, dS, the gradients) is rounded to t, and every sum inside a
// stage accumulates in acc's precision, one rounding per fused multiply-add.
inline RefResult naive_attention(const RefProblem& p, const std::vector<double>& q,
                                 const std::vector<double>& k, const std::vector<double>& v,
                                 const std::vector<double>* grad_out, Rounding rnd = exact,
                                 Rounding acc = exact) {
  const std::int64_t Hq = p.heads_q, Hkv = p.heads_kv, D = p.head_dim, Dv = p.head_dim_v;
  const std::int64_t group = Hq / Hkv, rows_q = p.rows_q(), rows_k = p.rows_k();
  RefResult r;
  r.out.assign(rows_q * Hq * Dv, 0.0);
  r.lse.assign(rows_q * Hq, -kInf);
  std::vector<double> dk_acc, dv_acc, dk_mag, dv_mag;
  const double eps32 = format_of(DType::kFloat32).eps;
  if (grad_out) {
    r.dq.assign(rows_q * Hq * D, 0.0);
    dk_acc.assign(rows_k * Hkv * D, 0.0), dv_acc.assign(rows_k * Hkv * Dv, 0.0);
    dk_mag.assign(rows_k * Hkv * D, 0.0), dv_mag.assign(rows_k * Hkv * Dv, 0.0);
  }
  auto qp = [&](std::int64_t row, std::int64_t h) { return &q[(row * Hq + h) * D]; };
  auto kp = [&](std::int64_t row, std::int64_t h) { return &k[(row * Hkv + h) * D]; };
  auto vp = [&](std::int64_t row, std::int64_t h) { return &v[(row * Hkv + h) * Dv]; };
  std::vector<double> s, prob, prob_exact, dp, a;
  double dq_mag_max = 0.0;

  for (std::size_t seq = 0; seq < p.q_len.size(); ++seq) {
    const std::int64_t ql = p.q_len[seq], kl = p.k_len[seq];
    for (std::int64_t h = 0; h < Hq; ++h) {
      const std::int64_t hk = h / group;
      for (std::int64_t i = 0; i < ql; ++i) {
        const std::int64_t row = p.q_start[seq] + i;
        if (!p.query_valid.empty() && !p.query_valid[row]) continue;
        s.assign(kl, -kInf);
        double m = -kInf;
        for (std::int64_t j = 0; j < kl; ++j) {
          const std::int64_t col = p.k_start[seq] + j;
          const bool visible = (p.key_valid.empty() || p.key_valid[col]) &&
                               (!p.causal || j <= i + kl - ql);
          if (!visible) continue;
          double dot = 0.0;
          for (std::int64_t d = 0; d < D; ++d) dot = acc(dot + qp(row, h)[d] * kp(col, hk)[d]);
          s[j] = rnd(rnd(dot) * p.scale);
          m = std::max(m, s[j]);
        }
        if (m == -kInf) continue;  // no visible key: out 0, LSE -inf, no gradient
        double l = 0.0, l_exact = 0.0;
        for (std::int64_t j = 0; j < kl; ++j) {
          l = acc(l + acc(std::exp(acc(s[j] - m))));
          l_exact += std::exp(s[j] - m);
        }
        r.lse[p.lse_index(row, h)] = rnd(acc(m + std::log(l)));
        prob.resize(kl), prob_exact.resize(kl);
        for (std::int64_t j = 0; j < kl; ++j) {
          prob_exact[j] = std::exp(s[j] - m) / l_exact;
          prob[j] = rnd(acc(acc(std::exp(acc(s[j] - m))) / l));
        }
        double* o = &r.out[(row * Hq + h) * Dv];
        for (std::int64_t d = 0; d < Dv; ++d) {
          double sum = 0.0;
          for (std::int64_t j = 0; j < kl; ++j)
            sum = acc(sum + prob[j] * vp(p.k_start[seq] + j, hk)[d]);
          o[d] = rnd(sum);
        }
        if (!grad_out) continue;

        const double* g = &(*grad_out)[(row * Hq + h) * Dv];
        dp.assign(kl, 0.0), a.assign(kl, 0.0);
        double delta = 0.0, go_abs = 0.0;
        for (std::int64_t d = 0; d < Dv; ++d) go_abs += std::fabs(g[d] * o[d]);
        for (std::int64_t j = 0; j < kl; ++j) {
          if (prob[j] == 0.0 && prob_exact[j] == 0.0) continue;
          const double* vj = vp(p.k_start[seq] + j, hk);
          double dot = 0.0, mag = 0.0;
          for (std::int64_t d = 0; d < Dv; ++d) {
            dot = acc(dot + g[d] * vj[d]);
            mag += std::fabs(g[d] * vj[d]);
          }
          dp[j] = rnd(dot);
          a[j] = mag + go_abs;
          delta = acc(delta + prob[j] * dp[j]);
        }
        // Floors: 2 eps32 |P| A bounds the float32 cancellation noise of dP - delta; a
        // relative eps32 |LSE| error in P (recomputed as exp(S - LSE)) adds
        // eps32 |LSE| P |dP - delta| to dS and eps32 |LSE| P |dO| to dV.
        const double lse_exact = std::fabs(m + std::log(l_exact));
        double* dq = &r.dq[(row * Hq + h) * D];
        std::vector<double> dq_acc(D, 0.0), dq_mag(D, 0.0);
        for (std::int64_t j = 0; j < kl; ++j) {
          if (prob[j] == 0.0 && prob_exact[j] == 0.0) continue;
          const std::int64_t col = p.k_start[seq] + j;
          const double ds = rnd(rnd(acc(prob[j] * acc(dp[j] - delta))) * p.scale);
          const double mag = std::fabs(p.scale) * prob_exact[j] *
                             (2 * eps32 * a[j] + eps32 * lse_exact * std::fabs(dp[j] - delta));
          for (std::int64_t d = 0; d < D; ++d) {
            double& dk_sum = dk_acc[(col * Hkv + hk) * D + d];
            dq_acc[d] = acc(dq_acc[d] + ds * kp(col, hk)[d]);
            dk_sum = acc(dk_sum + ds * qp(row, h)[d]);
            dq_mag[d] += mag * std::fabs(kp(col, hk)[d]);
            dk_mag[(col * Hkv + hk) * D + d] += mag * std::fabs(qp(row, h)[d]);
          }
          for (std::int64_t d = 0; d < Dv; ++d) {
            double& dv_sum = dv_acc[(col * Hkv + hk) * Dv + d];
            dv_sum = acc(dv_sum + prob[j] * g[d]);
            dv_mag[(col * Hkv + hk) * Dv + d] += prob_exact[j] * eps32 * lse_exact * std::fabs(g[d]);
          }
        }
        for (std::int64_t d = 0; d < D; ++d) {
          dq[d] = rnd(dq_acc[d]);
          dq_mag_max = std::max(dq_mag_max, dq_mag[d]);
        }
      }
    }
  }
  if (grad_out) {
    r.dk.resize(dk_acc.size()), r.dv.resize(dv_acc.size());
    std::transform(dk_acc.begin(), dk_acc.end(), r.dk.begin(), rnd);
    std::transform(dv_acc.begin(), dv_acc.end(), r.dv.begin(), rnd);
    r.dq_floor = dq_mag_max;
    r.dk_floor = max_abs(dk_mag);
    r.dv_floor = max_abs(dv_mag);
  }
  return r;
}

// ---- the accuracy rule --------------------------------------------------------------------

// Largest |a - b| over entries where the reference is finite; -inf / inf entries of the
// reference must be matched exactly (counted in `inf_mismatches`).
inline double max_error(const std::vector<double>& got, const std::vector<double>& ref,
                        std::int64_t* inf_mismatches = nullptr) {
  double e = 0.0;
  for (std::size_t i = 0; i < ref.size(); ++i) {
    if (std::isinf(ref[i]) || std::isinf(got[i])) {
      if (got[i] != ref[i] && inf_mismatches) ++*inf_mismatches;
      continue;
    }
    e = std::max(e, std::isnan(got[i]) ? kInf : std::fabs(got[i] - ref[i]));
  }
  return e;
}

// float64: 1e-10 at unit magnitude (relative once the tensor's magnitude passes 1).
// Otherwise: factor x the low-precision baseline's error + one ulp of the dtype at the
// tensor's largest magnitude (the kernel rounds each stored value once, half an ulp; a tiny
// case can make the baseline exact) + `extra_floor`.
inline void expect_within_rule(const char* name, const std::vector<double>& got,
                               const std::vector<double>& ref,
                               const std::vector<double>* baseline, DType dtype,
                               double factor = 2.0, double extra_floor = 0.0) {
  ASSERT_EQ(got.size(), ref.size()) << name;
  std::int64_t nan = 0, inf_mismatch = 0;
  for (double x : got) nan += std::isnan(x);
  EXPECT_EQ(nan, 0) << name << ": NaN (unwritten) elements";
  const double err = max_error(got, ref, &inf_mismatch);
  EXPECT_EQ(inf_mismatch, 0) << name << ": infinite entries differ from the reference";
  const double top = max_abs(ref);
  if (dtype == DType::kFloat64) {
    EXPECT_LE(err, 1e-10 * std::max(1.0, top)) << name << " (float64)";
    return;
  }
  ASSERT_NE(baseline, nullptr);
  const double base = max_error(*baseline, ref);
  ASSERT_TRUE(std::isfinite(base)) << name << ": the low-precision baseline overflowed";
  const double bound = factor * base + ulp(dtype, top) + extra_floor;
  EXPECT_LE(err, bound) << name << ": error " << err << ", baseline error " << base
                        << ", floor " << ulp(dtype, top) << " + " << extra_floor;
}

}  // namespace vidattn_test
