// The RoPE op: schema, CPU (and CUDA when built) and Meta kernels, and autograd on the op.
// The backward of the map is its transpose (for one angle per pair, the rotation by -angle),
// so it is the same op with `transpose` flipped; double backward comes for free.
#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "tensor_adapter.h"
#include "vidattn/rope.h"

namespace vidattn::torch_ops {
namespace {

using at::Tensor;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

constexpr const char* kFn = "vidattn.apply_rope";

RopeOptions rope_options(const Tensor& x, bool interleaved, bool transpose) {
  RopeOptions o;
  o.interleaved = interleaved;
  o.transpose = transpose;
  o.num_threads = at::get_num_threads();
  o.stream = stream_of(x);
  return o;
}

Tensor apply_rope_kernel(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved,
                         bool transpose) {
  check_same_device(kFn, {{"x", x}, {"cos", cos}, {"sin", sin}});
  const at::OptionalDeviceGuard device_guard(at::device_of(x));  // x's GPU, not the current one
  return translate_errors([&] {
    const TensorView xv = view_of(x, kFn, "x");
    const TensorView cv = view_of(cos, kFn, "cos"), sv = view_of(sin, kFn, "sin");
    const RopeOptions o = rope_options(x, interleaved, transpose);
    describe_rope(xv, cv, sv, o);
    Tensor out = at::empty(x.sizes(), x.options());
    apply_rope(xv, cv, sv, view_of(out, kFn, "out"), o);
    return out;
  });
}

// Same shape, dtype and (contiguous) strides as the real kernel; symbolic sizes pass.
Tensor apply_rope_meta(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved,
                       bool transpose) {
  check_same_device(kFn, {{"x", x}, {"cos", cos}, {"sin", sin}});
  TORCH_CHECK_VALUE(x.dim() == 4, kFn, ": argument 'x' must be 4-D [B, S, H, D], got a ",
                    x.dim(), "-D tensor");
  TORCH_CHECK_VALUE(cos.dim() == 2 && sin.dim() == 2, kFn,
                    ": arguments 'cos' and 'sin' must be 2-D [S, D] or [S, D/2], got ",
                    cos.dim(), "-D and ", sin.dim(), "-D");
  if (is_concrete(x) && is_concrete(cos) && is_concrete(sin))
    translate_errors([&] {
      describe_rope(view_of(x, kFn, "x"), view_of(cos, kFn, "cos"), view_of(sin, kFn, "sin"),
                    rope_options(x, interleaved, transpose));
    });
  return at::empty_symint(x.sym_sizes(), x.options());
}

Tensor call_rope_op(const Tensor& x, const Tensor& cos, const Tensor& sin, bool interleaved,
                    bool transpose) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("vidattn::apply_rope", "")
                       .typed<decltype(apply_rope_kernel)>();
  return op.call(x, cos, sin, interleaved, transpose);
}

// Gradients flow to x only: cos and sin are treated as constant tables.
class RopeFunction : public torch::autograd::Function<RopeFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& cos,
                               const Tensor& sin, bool interleaved, bool transpose) {
    Tensor out;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      out = call_rope_op(x, cos, sin, interleaved, transpose);
    }
    ctx->save_for_backward({cos, sin});
    ctx->saved_data["interleaved"] = interleaved;
    ctx->saved_data["transpose"] = transpose;
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto saved = ctx->get_saved_variables();
    Tensor grad = grads[0];
    if (!grad.defined()) return {Tensor(), Tensor(), Tensor(), Tensor(), Tensor()};
    if (grad.dim() > 0 && grad.stride(-1) != 1) grad = grad.contiguous();
    // Through the dispatcher (autograd included), so the backward is differentiable too.
    Tensor dx = call_rope_op(grad, saved[0], saved[1], ctx->saved_data["interleaved"].toBool(),
                             !ctx->saved_data["transpose"].toBool());
    return {dx, Tensor(), Tensor(), Tensor(), Tensor()};
  }
};

Tensor apply_rope_autograd(const Tensor& x, const Tensor& cos, const Tensor& sin,
                           bool interleaved, bool transpose) {
  return RopeFunction::apply(x, cos, sin, interleaved, transpose)[0];
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vidattn, m) {
  m.def(
      "apply_rope(Tensor x, Tensor cos, Tensor sin, *, bool interleaved=True, "
      "bool transpose=False) -> Tensor",
      {at::Tag::pt2_compliant_tag});
}

TORCH_LIBRARY_IMPL(vidattn, CPU, m) { m.impl("apply_rope", &apply_rope_kernel); }
#ifdef VIDATTN_TORCH_CUDA
TORCH_LIBRARY_IMPL(vidattn, CUDA, m) { m.impl("apply_rope", &apply_rope_kernel); }
#endif
TORCH_LIBRARY_IMPL(vidattn, Meta, m) { m.impl("apply_rope", &apply_rope_meta); }
TORCH_LIBRARY_IMPL(vidattn, Autograd, m) { m.impl("apply_rope", &apply_rope_autograd); }

}  // namespace vidattn::torch_ops
