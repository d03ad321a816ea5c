// Dense attention through the torch-free C++ API against a naive float64 reference,
// forward (out, LSE) and backward (dQ, dK, dV), with NaN-poisoned outputs.
//
// Accuracy rule (docs/conventions.md): float64 inputs match the reference to 1e-10 (relative once a
// tensor's magnitude passes 1); other dtypes must be within 2x (3x for dQ) of the error of
// the same naive math run in that dtype (naive_attention with per-stage rounding), plus one
// ulp at the tensor's magnitude, plus for the gradients the bounds of two float32 roundings
// that any flash-style backward makes and eager math does not:
//  - dS = P (dP - delta) with delta = rowsum(dO * O) from the stored output: for a one-hot
//    softmax row the exact dS is ~0 while float32 sums leave eps32 * sum|dO||V| of noise
//    (the baseline differentiates the softmax directly and cancels exactly there);
//  - P recomputed as exp(S - LSE) from a float32 LSE: a relative error eps32 * |LSE| in P,
//    which with logits around 60 is as large as the whole float32 baseline error.
// Both are float32 effects, negligible next to a bf16 / fp16 baseline; for float32 inputs
// they dominate the bound of the gradients (measured: 4-19x the baseline error).
#include "attention_case.h"

namespace vidattn_test {
namespace {

constexpr DType f64 = DType::kFloat64, f32 = DType::kFloat32, bf16 = DType::kBFloat16,
                f16 = DType::kFloat16;

Case batched(DType dtype, std::int64_t b, std::int64_t sq, std::int64_t sk, std::int64_t hq,
             std::int64_t hkv, std::int64_t d, std::int64_t dv, bool causal, bool kmask,
             bool qmask, double input_scale, bool strided) {
  Case c;
  c.dtype = dtype, c.batch = b, c.seqlen_q = sq, c.seqlen_k = sk, c.heads_q = hq;
  c.heads_kv = hkv, c.head_dim = d, c.head_dim_v = dv, c.causal = causal, c.key_mask = kmask;
  c.query_mask = qmask, c.input_scale = input_scale, c.strided = strided;
  return c;
}

Case packed(DType dtype, std::vector<std::int64_t> q_lens, std::vector<std::int64_t> k_lens,
            std::int64_t hq, std::int64_t hkv, std::int64_t d, std::int64_t dv, bool causal,
            double input_scale, bool strided, std::optional<double> scale = std::nullopt) {
  Case c;
  c.dtype = dtype, c.varlen = true, c.q_lens = std::move(q_lens), c.k_lens = std::move(k_lens);
  c.heads_q = hq, c.heads_kv = hkv, c.head_dim = d, c.head_dim_v = dv, c.causal = causal;
  c.input_scale = input_scale, c.strided = strided, c.scale = scale;
  return c;
}

// The CPU kernel tiles 128 queries x 256 keys: lengths 1, 127-130, 255-260, 300 cross and
// straddle those tiles. Causal with Sq > Sk leaves rows with no visible key.
std::vector<Case> accuracy_cases() {
  return {
      batched(f64, 2, 65, 63, 3, 1, 32, 48, true, true, false, 1, true),
      batched(f64, 1, 130, 257, 4, 2, 64, 64, true, false, true, 16, false),
      batched(f64, 3, 1, 1, 2, 2, 16, 16, false, true, true, 4, false),
      batched(f32, 2, 129, 129, 6, 3, 32, 32, true, true, true, 4, true),
      batched(f32, 1, 300, 70, 1, 1, 48, 24, true, false, false, 16, false),
      batched(bf16, 2, 64, 65, 4, 1, 64, 32, false, true, false, 1, true),
      batched(bf16, 1, 257, 130, 3, 3, 32, 64, true, false, true, 4, false),
      batched(bf16, 3, 17, 1, 2, 1, 32, 32, true, true, true, 16, false),
      batched(f16, 2, 63, 128, 4, 2, 32, 32, true, true, false, 4, true),
      batched(f16, 1, 1, 300, 2, 2, 64, 16, false, false, false, 1, false),
      batched(f16, 1, 100, 100, 3, 1, 16, 16, true, false, true, 16, false),
      packed(f64, {0, 65, 1, 0, 130}, {3, 64, 0, 0, 257}, 4, 2, 32, 16, true, 1, false),
      packed(f32, {5, 0, 17}, {0, 9, 17}, 3, 3, 16, 32, false, 4, true, 0.3),
      packed(bf16, {129, 1, 40}, {1, 260, 40}, 2, 1, 32, 32, true, 1, false),
      packed(f16, {64, 0, 3}, {64, 3, 0}, 2, 2, 64, 64, false, 16, true),
      // Empty inputs: batch 0, no queries, no keys, no sequences, only empty sequences.
      batched(f32, 0, 5, 7, 2, 1, 16, 8, false, true, true, 1, false),
      batched(bf16, 2, 0, 7, 2, 2, 16, 16, true, true, false, 1, true),
      batched(f64, 2, 5, 0, 4, 2, 16, 8, true, false, true, 1, false),
      batched(f16, 2, 0, 0, 1, 1, 8, 8, false, false, false, 1, false),
      packed(f32, {}, {}, 2, 1, 16, 16, true, 1, false),
      packed(bf16, {0, 0}, {0, 0}, 2, 2, 16, 8, false, 1, true),
      packed(f64, {0, 4}, {3, 0}, 2, 1, 16, 16, true, 1, false),
  };
}

class AttentionAccuracy : public ::testing::TestWithParam<Case> {};

TEST_P(AttentionAccuracy, MatchesReferenceForwardAndBackward) {
  const Case& c = GetParam();
  const Problem p = make_problem(c, seed_of(c.name()));
  Outputs o = make_outputs(p);
  run_forward(p, o);
  expect_fully_written("out", o.out);
  expect_fully_written("lse", o.lse);
  run_backward(p, o);
  expect_fully_written("dq", o.dq);
  expect_fully_written("dk", o.dk);
  expect_fully_written("dv", o.dv);

  const RefResult ref = naive_attention(p.ref, p.qv, p.kv, p.vv, &p.gv);
  std::optional<RefResult> base;
  if (c.dtype != f64)
    base = naive_attention(p.ref, p.qv, p.kv, p.vv, &p.gv, rounding_for(c.dtype),
                           accumulator_for(c.dtype));
  auto b = [&](std::vector<double> RefResult::*field) { return base ? &(*base.*field) : nullptr; };
  expect_within_rule("out", o.out.values(), ref.out, b(&RefResult::out), c.dtype);
  expect_within_rule("lse", o.lse.values(), ref.lse, b(&RefResult::lse), c.dtype);
  expect_within_rule("dq", o.dq.values(), ref.dq, b(&RefResult::dq), c.dtype, 3.0,
                     ref.dq_floor);
  expect_within_rule("dk", o.dk.values(), ref.dk, b(&RefResult::dk), c.dtype, 2.0,
                     ref.dk_floor);
  expect_within_rule("dv", o.dv.values(), ref.dv, b(&RefResult::dv), c.dtype, 2.0,
                     ref.dv_floor);
}

INSTANTIATE_TEST_SUITE_P(Cases, AttentionAccuracy, ::testing::ValuesIn(accuracy_cases()),
                         [](const auto& info) { return info.param.name(); });

// The reference itself: a hand-computed case (two keys, one query, D = 1).
TEST(NaiveReference, HandComputedCase) {
  RefProblem p = RefProblem::batched(1, 1, 2);
  p.scale = 1.0;
  const std::vector<double> q{1.0}, k{0.0, std::log(3.0)}, v{2.0, 6.0}, g{1.0};
  const RefResult r = naive_attention(p, q, k, v, &g);
  // Scores 0 and log 3: P = (1/4, 3/4), out = 0.5 + 4.5 = 5, LSE = log 4.
  EXPECT_NEAR(r.out[0], 5.0, 1e-15);
  EXPECT_NEAR(r.lse[0], std::log(4.0), 1e-15);
  // dV = P * g; dP = v; delta = 5; dS = P (dP - 5) = (-3/4, 3/4); dq = dS . k; dk = dS q.
  EXPECT_NEAR(r.dv[0], 0.25, 1e-15);
  EXPECT_NEAR(r.dv[1], 0.75, 1e-15);
  EXPECT_NEAR(r.dq[0], 0.75 * std::log(3.0), 1e-15);
  EXPECT_NEAR(r.dk[0], -0.75, 1e-15);
  EXPECT_NEAR(r.dk[1], 0.75, 1e-15);
}

TEST(NumberFormats, RoundingAndEncoding) {
  EXPECT_EQ(encode_bf16(1.0), 0x3f80);
  EXPECT_EQ(encode_fp16(1.0), 0x3c00);
  EXPECT_EQ(encode_fp16(-2.0), 0xc000);
  EXPECT_EQ(encode_fp16(65504.0), 0x7bff);
  EXPECT_EQ(encode_fp16(65520.0), 0x7c00);  // rounds past the largest finite value
  EXPECT_EQ(encode_fp16(std::ldexp(1.0, -24)), 0x0001);  // smallest subnormal
  EXPECT_EQ(round_to(bf16, 1.0 + std::ldexp(1.0, -8)), 1.0);  // tie to even
  EXPECT_EQ(round_to(bf16, 1.0 + 3 * std::ldexp(1.0, -8)), 1.0 + std::ldexp(1.0, -6));
  for (double x : {0.1, -3.75, 1e-6, 1234.5, 6e-8})
    EXPECT_EQ(decode_fp16(encode_fp16(x)), round_to(f16, x)) << x;
  for (double x : {0.1, -3.75, 1e-30, 1e30})
    EXPECT_EQ(decode_bf16(encode_bf16(x)), round_to(bf16, x)) << x;
}

// Rows that see no key: exact zeros, LSE -inf, zero gradients, padded keys get zero dK/dV.
// Sequence 0 has no valid query, sequence 2 no valid key (make_problem's masks), sequence 1
// has its first two keys padded; causal with Sq = 70 > Sk = 5 hides every key from the
// first 65 rows.
TEST(Attention, RowsWithoutVisibleKeysAreExactlyZero) {
  constexpr std::int64_t B = 3, Sq = 70, Sk = 5, H = 2, D = 32, Dv = 16;
  for (DType dtype : {f64, f32, bf16, f16}) {
    SCOPED_TRACE(short_name(dtype));
    Case c = batched(dtype, B, Sq, Sk, H, 1, D, Dv, true, true, true, 4, false);
    Problem p = make_problem(c, 7);
    for (std::int64_t j = 0; j < Sk; ++j)
      p.key_mask.set(Sk + j, j >= 2), p.ref.key_valid[Sk + j] = j >= 2;
    for (std::int64_t i = 0; i < Sq; ++i)
      p.query_mask.set(Sq + i, 1), p.ref.query_valid[Sq + i] = 1;
    Outputs o = make_outputs(p);
    run_forward(p, o);
    run_backward(p, o);
    for (auto* t : {&o.out, &o.lse, &o.dq, &o.dk, &o.dv}) EXPECT_EQ(t->count_nan(), 0);
    std::int64_t empty_rows = 0;
    for (std::int64_t b = 0; b < B; ++b)
      for (std::int64_t i = 0; i < Sq; ++i) {
        bool sees_key = false;
        for (std::int64_t j = 0; j <= i + Sk - Sq; ++j)
          sees_key |= p.ref.key_valid[b * Sk + j] && p.ref.query_valid[b * Sq + i];
        empty_rows += !sees_key;
        for (std::int64_t h = 0; h < H; ++h) {
          const double lse = o.lse.get((b * H + h) * Sq + i);
          EXPECT_EQ(lse == -kInf, !sees_key) << "b " << b << " i " << i;
          if (sees_key) continue;
          for (std::int64_t d = 0; d < Dv; ++d)
            EXPECT_EQ(o.out.get(((b * Sq + i) * H + h) * Dv + d), 0.0);
          for (std::int64_t d = 0; d < D; ++d)
            EXPECT_EQ(o.dq.get(((b * Sq + i) * H + h) * D + d), 0.0);
        }
      }
    EXPECT_GT(empty_rows, 2 * Sq + Sq - Sk);  // sanity of the setup
    for (std::int64_t row = 0; row < B * Sk; ++row)
      if (!p.ref.key_valid[row]) {
        for (std::int64_t d = 0; d < D; ++d) EXPECT_EQ(o.dk.get(row * D + d), 0.0);
        for (std::int64_t d = 0; d < Dv; ++d) EXPECT_EQ(o.dv.get(row * Dv + d), 0.0);
      }
  }
}

TEST(Attention, TransposedViewsGiveTheContiguousResult) {
  // A [B, H, S, D] buffer described as a [B, S, H, D] view: same bits as contiguous input.
  Case c = batched(f32, 2, 130, 70, 4, 2, 32, 16, true, true, false, 1, false);
  Case s = c;
  s.strided = true;
  const Problem pc = make_problem(c, 11), ps = make_problem(s, 11);
  ASSERT_EQ(pc.qv, ps.qv);
  ASSERT_EQ(pc.gv, ps.gv);
  ASSERT_NE(ps.q.view().stride[2], pc.q.view().stride[2]);
  Outputs oc = make_outputs(pc), os = make_outputs(ps);
  run_forward(pc, oc), run_backward(pc, oc);
  run_forward(ps, os), run_backward(ps, os);
  EXPECT_EQ(oc.out.values(), os.out.values());
  EXPECT_EQ(oc.lse.values(), os.lse.values());
  EXPECT_EQ(oc.dq.values(), os.dq.values());
  EXPECT_EQ(oc.dk.values(), os.dk.values());
  EXPECT_EQ(oc.dv.values(), os.dv.values());
}

TEST(Attention, DescribeReportsTheProblem) {
  Case c = batched(bf16, 2, 9, 7, 6, 2, 64, 40, true, false, false, 1, true);
  const Problem p = make_problem(c, 1);
  const vidattn::AttentionProblem d =
      vidattn::describe_attention(p.q.view(), p.k.view(), p.v.view(), p.options);
  EXPECT_FALSE(d.varlen);
  EXPECT_EQ(d.batch, 2);
  EXPECT_EQ(d.seqlen_q, 9);
  EXPECT_EQ(d.seqlen_k, 7);
  EXPECT_EQ(d.total_q, 18);
  EXPECT_EQ(d.heads_q, 6);
  EXPECT_EQ(d.heads_kv, 2);
  EXPECT_EQ(d.head_dim, 64);
  EXPECT_EQ(d.head_dim_v, 40);
  EXPECT_DOUBLE_EQ(d.scale, 0.125);
  EXPECT_TRUE(d.causal);
  EXPECT_EQ(d.dtype, bf16);
  EXPECT_EQ(d.lse_dtype, f32);
  std::int64_t shape[4];
  ASSERT_EQ(d.out_ndim(), 4);
  d.out_shape(shape);
  EXPECT_EQ(std::vector<std::int64_t>(shape, shape + 4), (std::vector<std::int64_t>{2, 9, 6, 40}));
  ASSERT_EQ(d.lse_ndim(), 3);
  d.lse_shape(shape);
  EXPECT_EQ(std::vector<std::int64_t>(shape, shape + 3), (std::vector<std::int64_t>{2, 6, 9}));

  Case v = packed(f64, {3, 0, 5}, {2, 4, 4}, 4, 4, 16, 8, false, 1, false, 0.5);
  const Problem pv = make_problem(v, 1);
  const vidattn::AttentionProblem dv =
      vidattn::describe_attention(pv.q.view(), pv.k.view(), pv.v.view(), pv.options);
  EXPECT_TRUE(dv.varlen);
  EXPECT_EQ(dv.batch, 3);
  EXPECT_EQ(dv.seqlen_q, 5);
  EXPECT_EQ(dv.seqlen_k, 4);
  EXPECT_EQ(dv.total_q, 8);
  EXPECT_DOUBLE_EQ(dv.scale, 0.5);
  EXPECT_EQ(dv.lse_dtype, f64);
  ASSERT_EQ(dv.out_ndim(), 3);
  dv.out_shape(shape);
  EXPECT_EQ(std::vector<std::int64_t>(shape, shape + 3), (std::vector<std::int64_t>{8, 4, 8}));
  ASSERT_EQ(dv.lse_ndim(), 2);
  dv.lse_shape(shape);
  EXPECT_EQ(std::vector<std::int64_t>(shape, shape + 2), (std::vector<std::int64_t>{4, 8}));
}

}  // namespace
}  // namespace vidattn_test
