// The vidattn PyTorch ops: schemas (defined once, here), CPU and Meta kernels, and autograd
// registered on the ops themselves. The kernels are thin: they allocate outputs and call
// the torch-free C++ API.
#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <cmath>
#include <vector>

#include "tensor_adapter.h"
#include "vidattn/attention.h"

namespace vidattn::torch_ops {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Everything the attention ops take besides q, k and v.
struct AttentionArgs {
  std::optional<double> scale;
  bool causal = false;
  OptTensor key_padding_mask, query_padding_mask;  // batched ops
  OptTensor cu_seqlens_q, cu_seqlens_k;            // varlen ops
  int64_t max_seqlen_q = 0, max_seqlen_k = 0;
  bool deterministic = true;  // the backward's; saved by the forward for it
  bool validate_index = true;  // varlen forward: check cu_seqlens on the device (CUDA)
  bool varlen() const { return cu_seqlens_q.has_value(); }
};

// check_same_device over q, k, v, the attention arguments and (backward) the others.
void check_devices(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v,
                   const AttentionArgs& a, const Tensor* grad_out = nullptr,
                   const Tensor* out = nullptr, const Tensor* lse = nullptr) {
  const Tensor none;
  check_same_device(fn, {{"q", q},
                         {"k", k},
                         {"v", v},
                         {"key_padding_mask", a.key_padding_mask},
                         {"query_padding_mask", a.query_padding_mask},
                         {"cu_seqlens_q", a.cu_seqlens_q},
                         {"cu_seqlens_k", a.cu_seqlens_k},
                         {"grad_out", grad_out ? *grad_out : none},
                         {"out", out ? *out : none},
                         {"lse", lse ? *lse : none}});
}

AttentionOptions options_of(const AttentionArgs& a, const char* fn, const Tensor& q) {
  AttentionOptions o;
  o.scale = a.scale;
  o.causal = a.causal;
  o.key_padding_mask = view_of(a.key_padding_mask, fn, "key_padding_mask");
  o.query_padding_mask = view_of(a.query_padding_mask, fn, "query_padding_mask");
  o.cu_seqlens_q = view_of(a.cu_seqlens_q, fn, "cu_seqlens_q");
  o.cu_seqlens_k = view_of(a.cu_seqlens_k, fn, "cu_seqlens_k");
  o.max_seqlen_q = a.max_seqlen_q;
  o.max_seqlen_k = a.max_seqlen_k;
  o.deterministic = a.deterministic;
  o.validate_index = a.validate_index;
  o.num_threads = at::get_num_threads();
  o.stream = stream_of(q);
  return o;
}

at::ScalarType lse_scalar_type(const Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

std::vector<int64_t> to_vector(const std::int64_t* shape, int n) {
  return std::vector<int64_t>(shape, shape + n);
}

// ---- compute kernels (CPU, and CUDA when built with it: the same functions) -----------

std::tuple<Tensor, Tensor> forward_kernel(const char* fn, const Tensor& q, const Tensor& k,
                                          const Tensor& v, const AttentionArgs& a) {
  check_devices(fn, q, k, v, a);
  const at::OptionalDeviceGuard device_guard(at::device_of(q));  // q's GPU, not the current one
  return translate_errors([&] {
    const TensorView qv = view_of(q, fn, "q"), kv = view_of(k, fn, "k"), vv = view_of(v, fn, "v");
    const AttentionOptions o = options_of(a, fn, q);
    const AttentionProblem p = describe_attention(qv, kv, vv, o);
    std::int64_t shape[kMaxDims];
    p.out_shape(shape);
    Tensor out = at::empty(to_vector(shape, p.out_ndim()), q.options());
    p.lse_shape(shape);
    Tensor lse = at::empty(to_vector(shape, p.lse_ndim()), q.options().dtype(lse_scalar_type(q)));
    attention_forward(qv, kv, vv, view_of(out, fn, "out"), view_of(lse, fn, "lse"), o);
    return std::make_tuple(out, lse);
  });
}

std::tuple<Tensor, Tensor> attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v,
                                            std::optional<double> scale, bool causal,
                                            const OptTensor& key_padding_mask,
                                            const OptTensor& query_padding_mask,
                                            bool deterministic) {
  return forward_kernel(
      "vidattn.attention", q, k, v,
      {scale, causal, key_padding_mask, query_padding_mask, {}, {}, 0, 0, deterministic});
}

std::tuple<Tensor, Tensor> attention_varlen_kernel(const Tensor& q, const Tensor& k,
                                                   const Tensor& v, const Tensor& cu_seqlens_q,
                                                   const Tensor& cu_seqlens_k,
                                                   int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                   std::optional<double> scale, bool causal,
                                                   bool deterministic, bool validate_index) {
  AttentionArgs a{scale,        causal,        {}, {}, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                  max_seqlen_k, deterministic, validate_index};
  return forward_kernel("vidattn.attention_varlen", q, k, v, a);
}

std::tuple<Tensor, Tensor, Tensor> attention_backward_kernel(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, std::optional<double> scale, bool causal, const OptTensor& key_padding_mask,
    const OptTensor& query_padding_mask, const OptTensor& cu_seqlens_q,
    const OptTensor& cu_seqlens_k, int64_t max_seqlen_q, int64_t max_seqlen_k,
    bool deterministic) {
  constexpr const char* fn = "vidattn.attention_backward";
  // The offsets come from the forward, which checked them (or was told to trust them).
  const AttentionArgs a{scale,        causal,       key_padding_mask, query_padding_mask,
                        cu_seqlens_q, cu_seqlens_k, max_seqlen_q,     max_seqlen_k,
                        deterministic, /*validate_index=*/false};
  check_devices(fn, q, k, v, a, &grad_out, &out, &lse);
  const at::OptionalDeviceGuard device_guard(at::device_of(q));
  return translate_errors([&] {
    Tensor dq = at::empty(q.sizes(), q.options());
    Tensor dk = at::empty(k.sizes(), k.options());
    Tensor dv = at::empty(v.sizes(), v.options());
    attention_backward(view_of(q, fn, "q"), view_of(k, fn, "k"), view_of(v, fn, "v"),
                       view_of(out, fn, "out"), view_of(lse, fn, "lse"),
                       view_of(grad_out, fn, "grad_out"), view_of(dq, fn, "dq"),
                       view_of(dk, fn, "dk"), view_of(dv, fn, "dv"), options_of(a, fn, q));
    return std::make_tuple(dq, dk, dv);
  });
}

// ---- Meta kernels: shapes, dtypes and strides of the real ones; symbolic sizes pass ----

std::tuple<Tensor, Tensor> forward_meta(const char* fn, const Tensor& q, const Tensor& k,
                                        const Tensor& v, const AttentionArgs& a) {
  check_devices(fn, q, k, v, a);
  const bool varlen = a.varlen();
  const int64_t nd = varlen ? 3 : 4;
  TORCH_CHECK_VALUE(q.dim() == nd && k.dim() == nd && v.dim() == nd, fn,
                    ": q, k and v must be ", nd, "-D, got ", q.dim(), "-D, ", k.dim(), "-D and ",
                    v.dim(), "-D");
  if (is_concrete(q) && is_concrete(k) && is_concrete(v))
    translate_errors([&] {
      describe_attention(view_of(q, fn, "q"), view_of(k, fn, "k"), view_of(v, fn, "v"),
                         options_of(a, fn, q));
    });
  std::vector<c10::SymInt> out_shape(q.sym_sizes().begin(), q.sym_sizes().end());
  out_shape.back() = v.sym_size(-1);  // the output's head dim is v's
  std::vector<c10::SymInt> lse_shape;
  if (varlen)
    lse_shape = {q.sym_size(1), q.sym_size(0)};
  else
    lse_shape = {q.sym_size(0), q.sym_size(2), q.sym_size(1)};
  return std::make_tuple(at::empty_symint(out_shape, q.options()),
                         at::empty_symint(lse_shape, q.options().dtype(lse_scalar_type(q))));
}

std::tuple<Tensor, Tensor> attention_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                          std::optional<double> scale, bool causal,
                                          const OptTensor& key_padding_mask,
                                          const OptTensor& query_padding_mask, bool) {
  return forward_meta("vidattn.attention", q, k, v,
                      {scale, causal, key_padding_mask, query_padding_mask});
}

std::tuple<Tensor, Tensor> attention_varlen_meta(const Tensor& q, const Tensor& k, const Tensor& v,
                                                 const Tensor& cu_seqlens_q,
                                                 const Tensor& cu_seqlens_k, int64_t max_seqlen_q,
                                                 int64_t max_seqlen_k, std::optional<double> scale,
                                                 bool causal, bool, bool) {
  AttentionArgs a{scale, causal, {}, {}, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k};
  return forward_meta("vidattn.attention_varlen", q, k, v, a);
}

std::tuple<Tensor, Tensor, Tensor> attention_backward_meta(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, std::optional<double>, bool, const OptTensor& key_padding_mask,
    const OptTensor& query_padding_mask, const OptTensor& cu_seqlens_q,
    const OptTensor& cu_seqlens_k, int64_t, int64_t, bool) {
  check_devices("vidattn.attention_backward", q, k, v,
                {{}, false, key_padding_mask, query_padding_mask, cu_seqlens_q, cu_seqlens_k},
                &grad_out, &out, &lse);
  return std::make_tuple(at::empty_symint(q.sym_sizes(), q.options()),
                         at::empty_symint(k.sym_sizes(), k.options()),
                         at::empty_symint(v.sym_sizes(), v.options()));
}

// ---- autograd, registered on the ops ------------------------------------------------

std::tuple<Tensor, Tensor> call_forward_op(const Tensor& q, const Tensor& k, const Tensor& v,
                                           const AttentionArgs& a) {
  if (a.varlen()) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("vidattn::attention_varlen", "")
                         .typed<decltype(attention_varlen_kernel)>();
    return op.call(q, k, v, *a.cu_seqlens_q, *a.cu_seqlens_k, a.max_seqlen_q, a.max_seqlen_k,
                   a.scale, a.causal, a.deterministic, a.validate_index);
  }
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("vidattn::attention", "")
                       .typed<decltype(attention_kernel)>();
  return op.call(q, k, v, a.scale, a.causal, a.key_padding_mask, a.query_padding_mask,
                 a.deterministic);
}

c10::IValue optional_tensor(const OptTensor& t) { return t ? c10::IValue(*t) : c10::IValue(); }
OptTensor get_optional_tensor(const c10::IValue& v) {
  return v.isNone() ? OptTensor() : OptTensor(v.toTensor());
}

class AttentionFunction : public torch::autograd::Function<AttentionFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const AttentionArgs& a) {
    Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, lse) = call_forward_op(q, k, v, a);
    }
    ctx->save_for_backward({q, k, v, out, lse});
    ctx->saved_data["scale"] = a.scale;
    ctx->saved_data["causal"] = a.causal;
    ctx->saved_data["key_padding_mask"] = optional_tensor(a.key_padding_mask);
    ctx->saved_data["query_padding_mask"] = optional_tensor(a.query_padding_mask);
    ctx->saved_data["cu_seqlens_q"] = optional_tensor(a.cu_seqlens_q);
    ctx->saved_data["cu_seqlens_k"] = optional_tensor(a.cu_seqlens_k);
    ctx->saved_data["max_seqlen_q"] = a.max_seqlen_q;
    ctx->saved_data["max_seqlen_k"] = a.max_seqlen_k;
    ctx->saved_data["deterministic"] = a.deterministic;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = c10::Dispatcher::singleton()
                         .findSchemaOrThrow("vidattn::attention_backward", "")
                         .typed<decltype(attention_backward_kernel)>();
    const auto saved = ctx->get_saved_variables();
    const Tensor& out = saved[3];
    const Tensor grad = unit_stride_grad(grads[0].defined() ? grads[0] : at::zeros_like(out));
    const auto& d = ctx->saved_data;
    auto [dq, dk, dv] = op.call(
        grad, saved[0], saved[1], saved[2], out, saved[4], d.at("scale").toOptional<double>(),
        d.at("causal").toBool(), get_optional_tensor(d.at("key_padding_mask")),
        get_optional_tensor(d.at("query_padding_mask")),
        get_optional_tensor(d.at("cu_seqlens_q")), get_optional_tensor(d.at("cu_seqlens_k")),
        d.at("max_seqlen_q").toInt(), d.at("max_seqlen_k").toInt(),
        d.at("deterministic").toBool());
    return {dq, dk, dv, Tensor()};
  }
};

std::tuple<Tensor, Tensor> attention_autograd(const Tensor& q, const Tensor& k, const Tensor& v,
                                              std::optional<double> scale, bool causal,
                                              const OptTensor& key_padding_mask,
                                              const OptTensor& query_padding_mask,
                                              bool deterministic) {
  auto r = AttentionFunction::apply(
      q, k, v,
      AttentionArgs{scale, causal, key_padding_mask, query_padding_mask, {}, {}, 0, 0,
                    deterministic});
  return std::make_tuple(r[0], r[1]);
}

std::tuple<Tensor, Tensor> attention_varlen_autograd(const Tensor& q, const Tensor& k,
                                                     const Tensor& v, const Tensor& cu_seqlens_q,
                                                     const Tensor& cu_seqlens_k,
                                                     int64_t max_seqlen_q, int64_t max_seqlen_k,
                                                     std::optional<double> scale, bool causal,
                                                     bool deterministic, bool validate_index) {
  auto r = AttentionFunction::apply(
      q, k, v,
      AttentionArgs{scale, causal, {}, {}, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                    deterministic, validate_index});
  return std::make_tuple(r[0], r[1]);
}

}  // namespace

TORCH_LIBRARY(vidattn, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def(
      "attention(Tensor q, Tensor k, Tensor v, *, float? scale=None, bool causal=False, "
      "Tensor? key_padding_mask=None, Tensor? query_padding_mask=None, "
      "bool deterministic=True) -> (Tensor out, Tensor lse)",
      tags);
  m.def(
      "attention_varlen(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, Tensor cu_seqlens_k, "
      "int max_seqlen_q, int max_seqlen_k, *, float? scale=None, bool causal=False, "
      "bool deterministic=True, bool validate_index=True) -> (Tensor out, Tensor lse)",
      tags);
  m.def(
      "attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "*, float? scale, bool causal, Tensor? key_padding_mask, Tensor? query_padding_mask, "
      "Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, "
      "bool deterministic=True) -> (Tensor dq, Tensor dk, Tensor dv)",
      tags);
}

TORCH_LIBRARY_IMPL(vidattn, CPU, m) {
  m.impl("attention", &attention_kernel);
  m.impl("attention_varlen", &attention_varlen_kernel);
  m.impl("attention_backward", &attention_backward_kernel);
}

#ifdef VIDATTN_TORCH_CUDA
// The same kernels: the core dispatches on the tensors' device, on PyTorch's current stream.
TORCH_LIBRARY_IMPL(vidattn, CUDA, m) {
  m.impl("attention", &attention_kernel);
  m.impl("attention_varlen", &attention_varlen_kernel);
  m.impl("attention_backward", &attention_backward_kernel);
}
#endif

TORCH_LIBRARY_IMPL(vidattn, Meta, m) {
  m.impl("attention", &attention_meta);
  m.impl("attention_varlen", &attention_varlen_meta);
  m.impl("attention_backward", &attention_backward_meta);
}

TORCH_LIBRARY_IMPL(vidattn, Autograd, m) {
  m.impl("attention", &attention_autograd);
  m.impl("attention_varlen", &attention_varlen_autograd);
  m.impl("attention_backward", refusing_double_backward());
}

}  // namespace vidattn::torch_ops
