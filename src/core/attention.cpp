// Validation and backend dispatch for dense attention. Backends see only validated calls.
#include "vidattn/attention.h"

#include <cmath>

#include "backends.h"
#include "check.h"

namespace vidattn {

void AttentionProblem::out_shape(std::int64_t* shape) const {
  if (varlen) {
    shape[0] = total_q, shape[1] = heads_q, shape[2] = head_dim_v;
  } else {
    shape[0] = batch, shape[1] = seqlen_q, shape[2] = heads_q, shape[3] = head_dim_v;
  }
}

void AttentionProblem::lse_shape(std::int64_t* shape) const {
  if (varlen) {
    shape[0] = heads_q, shape[1] = total_q;
  } else {
    shape[0] = batch, shape[1] = heads_q, shape[2] = seqlen_q;
  }
}

namespace {

void check_output(const detail::ArgChecker& check, const TensorView& t, const char* name,
                  int ndim, const std::int64_t* shape, DType dtype, Device device) {
  check.non_null(t, name);
  check.dtype(t, name, dtype);
  check.same_device(t, name, device);
  check.shape(t, name, shape, ndim);
}

void check_same_as(const detail::ArgChecker& check, const TensorView& t, const char* name,
                   const TensorView& like, const char* like_name) {
  check.non_null(t, name);
  check.dtype(t, name, like.dtype);
  check.same_device(t, name, like.device);
  bool same = t.ndim == like.ndim;
  for (int i = 0; same && i < t.ndim; ++i) same = t.shape[i] == like.shape[i];
  if (!same)
    check.fail("argument '", name, "' must have the shape of ", like_name, ", ",
               shape_string(like), ", got ", shape_string(t));
  check.unit_last_stride(t, name);
}

AttentionProblem describe(const char* function, const TensorView& q, const TensorView& k,
                          const TensorView& v, const AttentionOptions& o) {
  const detail::ArgChecker check(function);
  AttentionProblem p;
  p.varlen = o.cu_seqlens_q.has_value() || o.cu_seqlens_k.has_value();
  if (p.varlen && !(o.cu_seqlens_q && o.cu_seqlens_k))
    check.fail("varlen mode needs both 'cu_seqlens_q' and 'cu_seqlens_k'");
  if (p.varlen && (o.key_padding_mask || o.query_padding_mask))
    check.fail("padding masks are for batched [B, S, H, D] inputs; in varlen mode the "
               "sequence lengths in 'cu_seqlens_q' / 'cu_seqlens_k' say what is valid");

  const int nd = p.varlen ? 3 : 4;
  const char* q_layout = p.varlen ? "[Tq, Hq, D]" : "[B, Sq, Hq, D]";
  check.ndim(q, "q", nd, q_layout);
  check.ndim(k, "k", nd, p.varlen ? "[Tk, Hkv, D]" : "[B, Sk, Hkv, D]");
  check.ndim(v, "v", nd, p.varlen ? "[Tk, Hkv, Dv]" : "[B, Sk, Hkv, Dv]");
  if (!detail::is_float_dtype(q.dtype))
    detail::throw_type_error(function, ": argument 'q' must be float32, float16, bfloat16 or "
                             "float64, got ", dtype_name(q.dtype));
  check.dtype(k, "k", q.dtype);
  check.dtype(v, "v", q.dtype);
  check.same_device(k, "k", q.device);
  check.same_device(v, "v", q.device);
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) {
    check.unit_last_stride(*t, name);
    for (int d = 0; d < nd; ++d)
      if (t->shape[d] < 0) check.fail("argument '", name, "' has a negative size");
  }

  const int h = nd - 2;  // heads dimension
  p.dtype = q.dtype;
  p.lse_dtype = q.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  p.device = q.device;
  p.heads_q = q.shape[h];
  p.heads_kv = k.shape[h];
  p.head_dim = q.shape[h + 1];
  p.head_dim_v = v.shape[h + 1];
  if (p.heads_kv < 1 || p.heads_q < 1)
    check.fail("q and k need at least one head, got Hq = ", p.heads_q, ", Hkv = ", p.heads_kv);
  if (p.heads_q % p.heads_kv != 0)
    check.fail("the number of q heads (", p.heads_q,
               ") must be a multiple of the number of k/v heads (", p.heads_kv, ")");
  if (p.head_dim < 1 || p.head_dim_v < 1)
    check.fail("head dims must be at least 1, got D = ", p.head_dim, ", Dv = ", p.head_dim_v);
  check.dim_equals(k, "k", h + 1, p.head_dim, "the head dim D of q");
  check.dim_equals(v, "v", h, p.heads_kv, "the number of heads of k");
  check.dim_equals(v, "v", 0, k.shape[0], p.varlen ? "the tokens of k" : "the batch of k");

  if (p.varlen) {
    const TensorView& cq = *o.cu_seqlens_q;
    const TensorView& ck = *o.cu_seqlens_k;
    check.ndim(cq, "cu_seqlens_q", 1, "[N + 1]");
    check.ndim(ck, "cu_seqlens_k", 1, "[N + 1]");
    check.dtype(cq, "cu_seqlens_q", DType::kInt32);
    check.dtype(ck, "cu_seqlens_k", DType::kInt32);
    check.same_device(cq, "cu_seqlens_q", q.device);
    check.same_device(ck, "cu_seqlens_k", q.device);
    if (cq.shape[0] < 1) check.fail("argument 'cu_seqlens_q' must hold at least one offset");
    check.dim_equals(ck, "cu_seqlens_k", 0, cq.shape[0], "the length of cu_seqlens_q");
    if (o.max_seqlen_q < 0 || o.max_seqlen_k < 0)
      check.fail("max_seqlen_q and max_seqlen_k must be >= 0, got ", o.max_seqlen_q, " and ",
                 o.max_seqlen_k);
    p.batch = cq.shape[0] - 1;
    p.seqlen_q = o.max_seqlen_q;
    p.seqlen_k = o.max_seqlen_k;
    p.total_q = q.shape[0];
  } else {
    p.batch = q.shape[0];
    p.seqlen_q = q.shape[1];
    p.seqlen_k = k.shape[1];
    p.total_q = p.batch * p.seqlen_q;
    check.dim_equals(k, "k", 0, p.batch, "the batch of q");
    check.dim_equals(v, "v", 1, p.seqlen_k, "the sequence length of k");
    if (o.key_padding_mask) {
      const TensorView& m = *o.key_padding_mask;
      check.ndim(m, "key_padding_mask", 2, "[B, Sk]");
      check.dtype(m, "key_padding_mask", DType::kBool);
      check.same_device(m, "key_padding_mask", q.device);
      check.dim_equals(m, "key_padding_mask", 0, p.batch, "the batch B");
      check.dim_equals(m, "key_padding_mask", 1, p.seqlen_k, "the key length Sk");
    }
    if (o.query_padding_mask) {
      const TensorView& m = *o.query_padding_mask;
      check.ndim(m, "query_padding_mask", 2, "[B, Sq]");
      check.dtype(m, "query_padding_mask", DType::kBool);
      check.same_device(m, "query_padding_mask", q.device);
      check.dim_equals(m, "query_padding_mask", 0, p.batch, "the batch B");
      check.dim_equals(m, "query_padding_mask", 1, p.seqlen_q, "the query length Sq");
    }
  }

  p.scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  if (!std::isfinite(p.scale)) check.fail("argument 'scale' must be finite, got ", p.scale);
  p.causal = o.causal;
  if (o.num_threads < 0) check.fail("num_threads must be >= 0, got ", o.num_threads);
  return p;
}

void check_outputs(const detail::ArgChecker& check, const AttentionProblem& p,
                   const TensorView& out, const TensorView& lse) {
  std::int64_t shape[kMaxDims];
  p.out_shape(shape);
  check_output(check, out, "out", p.out_ndim(), shape, p.dtype, p.device);
  check.unit_last_stride(out, "out");
  p.lse_shape(shape);
  check_output(check, lse, "lse", p.lse_ndim(), shape, p.lse_dtype, p.device);
}

// describe() checks metadata only; the compute entry points also need the data.
void check_data(const detail::ArgChecker& check, const TensorView& q, const TensorView& k,
                const TensorView& v, const AttentionOptions& o) {
  check.non_null(q, "q");
  check.non_null(k, "k");
  check.non_null(v, "v");
  if (o.key_padding_mask) check.non_null(*o.key_padding_mask, "key_padding_mask");
  if (o.query_padding_mask) check.non_null(*o.query_padding_mask, "query_padding_mask");
  if (o.cu_seqlens_q) check.non_null(*o.cu_seqlens_q, "cu_seqlens_q");
  if (o.cu_seqlens_k) check.non_null(*o.cu_seqlens_k, "cu_seqlens_k");
}

#ifndef VIDATTN_WITH_CUDA
[[noreturn]] void no_cuda(const char* function) {
  throw NotImplementedError(detail::concat(
      function, ": this build of vidattn has no CUDA backend; pass CPU tensors"));
}
#endif

}  // namespace

AttentionProblem describe_attention(const TensorView& q, const TensorView& k,
                                    const TensorView& v, const AttentionOptions& options) {
  return describe("vidattn::describe_attention", q, k, v, options);
}

void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView& lse,
                       const AttentionOptions& options) {
  constexpr const char* kFn = "vidattn::attention_forward";
  const detail::ArgChecker check(kFn);
  const AttentionProblem p = describe(kFn, q, k, v, options);
  check_data(check, q, k, v, options);
  check_outputs(check, p, out, lse);
  if (p.device.kind == DeviceKind::kCPU)
    return detail::cpu_attention_forward(p, q, k, v, out, lse, options);
#ifdef VIDATTN_WITH_CUDA
  return detail::cuda_attention_forward(p, q, k, v, out, lse, options);
#else
  no_cuda(kFn);
#endif
}

void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse,
                        const TensorView& grad_out, const TensorView& dq,
                        const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options) {
  constexpr const char* kFn = "vidattn::attention_backward";
  const detail::ArgChecker check(kFn);
  const AttentionProblem p = describe(kFn, q, k, v, options);
  check_data(check, q, k, v, options);
  check_outputs(check, p, out, lse);
  check_same_as(check, grad_out, "grad_out", out, "out");
  check_same_as(check, dq, "dq", q, "q");
  check_same_as(check, dk, "dk", k, "k");
  check_same_as(check, dv, "dv", v, "v");
  if (p.device.kind == DeviceKind::kCPU)
    return detail::cpu_attention_backward(p, q, k, v, out, lse, grad_out, dq, dk, dv, options);
#ifdef VIDATTN_WITH_CUDA
  return detail::cuda_attention_backward(p, q, k, v, out, lse, grad_out, dq, dk, dv, options);
#else
  no_cuda(kFn);
#endif
}

}  // namespace vidattn
