// The fused VSA combine ops: schemas, CPU / CUDA / Meta kernels and autograd on the ops.
// out = fine + gate * coarse broadcast over each tile's valid slots (vidattn/vsa_combine.h);
// vsa_combine_rows does the same on a run of raster rows (the sequence-parallel layer).
#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include "tensor_adapter.h"
#include "vidattn/vsa_combine.h"

namespace vidattn::torch_ops {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

bool has(const OptTensor& t) { return t && t->defined(); }

// check_same_device over the tensors of the combine ops: `first` is fine or grad_out, `out`
// the destination of vsa_combine_rows_into; the row mode passes token_to_slot and
// slot_to_token as the two index tensors, the tile mode block_sizes as the first.
void check_devices(const char* fn, const char* first_name, const Tensor& first,
                   const Tensor& coarse, const OptTensor& gate, const char* index_name,
                   const Tensor& index, const Tensor* slot_to_token = nullptr,
                   const Tensor* out = nullptr) {
  const Tensor none;
  check_same_device(fn, {{"out", out ? *out : none},
                         {first_name, first},
                         {"coarse", coarse},
                         {"gate", gate},
                         {index_name, index},
                         {"slot_to_token", slot_to_token ? *slot_to_token : none}});
}

// The backward ops of both modes return grad_gate as an empty [0] tensor when there is no
// gate (op returns cannot be optional).
Tensor empty_grad_gate(const Tensor& grad_out, const OptTensor& gate) {
  return has(gate) ? at::empty_like(grad_out, at::MemoryFormat::Contiguous)
                   : at::empty({0}, grad_out.options());
}

std::optional<TensorView> grad_gate_view(const Tensor& grad_gate, const OptTensor& gate,
                                         const char* fn) {
  return has(gate) ? std::optional<TensorView>(view_of(grad_gate, fn, "grad_gate"))
                   : std::nullopt;
}

std::tuple<Tensor, Tensor> backward_meta(const Tensor& grad_out, const Tensor& coarse,
                                         const OptTensor& gate) {
  Tensor grad_gate = has(gate) ? at::empty_symint(grad_out.sym_sizes(), grad_out.options())
                               : at::empty({0}, grad_out.options());
  return std::make_tuple(at::empty_symint(coarse.sym_sizes(), coarse.options()), grad_gate);
}

Tensor vsa_combine_kernel(const Tensor& fine, const Tensor& coarse, const OptTensor& gate,
                          const Tensor& block_sizes, int64_t tile_volume) {
  constexpr const char* fn = "vidattn.vsa_combine";
  check_devices(fn, "fine", fine, coarse, gate, "block_sizes", block_sizes);
  const at::OptionalDeviceGuard device_guard(at::device_of(fine));
  require_int32(block_sizes, fn, "block_sizes");
  return translate_errors([&] {
    const TensorView fv = view_of(fine, fn, "fine");
    Tensor out = at::empty_like(fine, at::MemoryFormat::Contiguous);
    vsa_combine(fv, view_of(coarse, fn, "coarse"), view_of(gate, fn, "gate"),
                view_of(block_sizes, fn, "block_sizes"), tile_volume, view_of(out, fn, "out"),
                at::get_num_threads(), stream_of(fine));
    return out;
  });
}

Tensor vsa_combine_meta(const Tensor& fine, const Tensor& coarse, const OptTensor& gate,
                        const Tensor& block_sizes, int64_t) {
  check_devices("vidattn.vsa_combine", "fine", fine, coarse, gate, "block_sizes", block_sizes);
  return at::empty_symint(fine.sym_sizes(), fine.options());
}

std::tuple<Tensor, Tensor> vsa_combine_backward_kernel(const Tensor& grad_out,
                                                       const Tensor& coarse,
                                                       const OptTensor& gate,
                                                       const Tensor& block_sizes,
                                                       int64_t tile_volume) {
  constexpr const char* fn = "vidattn.vsa_combine_backward";
  check_devices(fn, "grad_out", grad_out, coarse, gate, "block_sizes", block_sizes);
  const at::OptionalDeviceGuard device_guard(at::device_of(grad_out));
  require_int32(block_sizes, fn, "block_sizes");
  return translate_errors([&] {
    const TensorView gv = view_of(grad_out, fn, "grad_out");
    Tensor grad_coarse = at::empty_like(coarse, at::MemoryFormat::Contiguous);
    Tensor grad_gate = empty_grad_gate(grad_out, gate);
    vsa_combine_backward(gv, view_of(coarse, fn, "coarse"), view_of(gate, fn, "gate"),
                         view_of(block_sizes, fn, "block_sizes"), tile_volume,
                         view_of(grad_coarse, fn, "grad_coarse"),
                         grad_gate_view(grad_gate, gate, fn),
                         at::get_num_threads(), stream_of(grad_out));
    return std::make_tuple(grad_coarse, grad_gate);
  });
}

std::tuple<Tensor, Tensor> vsa_combine_backward_meta(const Tensor& grad_out,
                                                     const Tensor& coarse, const OptTensor& gate,
                                                     const Tensor& block_sizes, int64_t) {
  check_devices("vidattn.vsa_combine_backward", "grad_out", grad_out, coarse, gate, "block_sizes",
                block_sizes);
  return backward_meta(grad_out, coarse, gate);
}

class VsaCombineFunction : public torch::autograd::Function<VsaCombineFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& fine, const Tensor& coarse,
                        const OptTensor& gate, const Tensor& block_sizes, int64_t tile_volume) {
    static auto op = find_op<decltype(vsa_combine_kernel)>("vidattn::vsa_combine");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({coarse, has(gate) ? *gate : Tensor(), block_sizes});
    ctx->saved_data["tile_volume"] = tile_volume;
    return op.call(fine, coarse, gate, block_sizes, tile_volume);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        find_op<decltype(vsa_combine_backward_kernel)>("vidattn::vsa_combine_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor grad = unit_stride_grad(grads[0]);
    const OptTensor gate = saved[1].defined() ? OptTensor(saved[1]) : std::nullopt;
    auto [grad_coarse, grad_gate] =
        op.call(grad, saved[0], gate, saved[2], ctx->saved_data["tile_volume"].toInt());
    // d out / d fine is the identity.
    return {grads[0], grad_coarse, gate ? grad_gate : Tensor(), Tensor(), Tensor()};
  }
};

Tensor vsa_combine_autograd(const Tensor& fine, const Tensor& coarse, const OptTensor& gate,
                            const Tensor& block_sizes, int64_t tile_volume) {
  return VsaCombineFunction::apply(fine, coarse, gate, block_sizes, tile_volume);
}

// ---- the row mode: raster rows first_token ... (vidattn/vsa_combine.h) ----

// The rows combination of both row ops: into *out, or (out null) into a new contiguous tensor
// like fine, made once fine's own checks have passed so that a bad fine is named as 'fine'.
Tensor combine_rows(const char* fn, const Tensor* out, const Tensor& fine, const Tensor& coarse,
                    const OptTensor& gate, const Tensor& token_to_slot,
                    const Tensor& slot_to_token, int64_t tile_volume, int64_t first_token) {
  check_devices(fn, "fine", fine, coarse, gate, "token_to_slot", token_to_slot, &slot_to_token, out);
  const at::OptionalDeviceGuard device_guard(at::device_of(fine));
  require_int32(token_to_slot, fn, "token_to_slot");
  require_int32(slot_to_token, fn, "slot_to_token");
  return translate_errors([&] {
    const TensorView fv = view_of(fine, fn, "fine");
    Tensor result = out ? *out : at::empty_like(fine, at::MemoryFormat::Contiguous);
    vsa_combine_rows(fv, view_of(coarse, fn, "coarse"), view_of(gate, fn, "gate"),
                     view_of(token_to_slot, fn, "token_to_slot"),
                     view_of(slot_to_token, fn, "slot_to_token"), tile_volume, first_token,
                     view_of(result, fn, "out"), at::get_num_threads(), stream_of(fine));
    return result;
  });
}

Tensor vsa_combine_rows_kernel(const Tensor& fine, const Tensor& coarse, const OptTensor& gate,
                               const Tensor& token_to_slot, const Tensor& slot_to_token,
                               int64_t tile_volume, int64_t first_token) {
  return combine_rows("vidattn.vsa_combine_rows", nullptr, fine, coarse, gate, token_to_slot,
                      slot_to_token, tile_volume, first_token);
}

Tensor vsa_combine_rows_meta(const Tensor& fine, const Tensor& coarse, const OptTensor& gate,
                             const Tensor& token_to_slot, const Tensor& slot_to_token, int64_t,
                             int64_t) {
  check_devices("vidattn.vsa_combine_rows", "fine", fine, coarse, gate, "token_to_slot",
                token_to_slot, &slot_to_token);
  return at::empty_symint(fine.sym_sizes(), fine.options());
}

std::tuple<Tensor, Tensor> vsa_combine_rows_backward_kernel(
    const Tensor& grad_out, const Tensor& coarse, const OptTensor& gate,
    const Tensor& token_to_slot, const Tensor& slot_to_token, int64_t tile_volume,
    int64_t first_token) {
  constexpr const char* fn = "vidattn.vsa_combine_rows_backward";
  check_devices(fn, "grad_out", grad_out, coarse, gate, "token_to_slot", token_to_slot,
                &slot_to_token);
  const at::OptionalDeviceGuard device_guard(at::device_of(grad_out));
  require_int32(token_to_slot, fn, "token_to_slot");
  require_int32(slot_to_token, fn, "slot_to_token");
  return translate_errors([&] {
    const TensorView gv = view_of(grad_out, fn, "grad_out");
    Tensor grad_coarse = at::empty_like(coarse, at::MemoryFormat::Contiguous);
    Tensor grad_gate = empty_grad_gate(grad_out, gate);
    vsa_combine_rows_backward(
        gv, view_of(coarse, fn, "coarse"), view_of(gate, fn, "gate"),
        view_of(token_to_slot, fn, "token_to_slot"), view_of(slot_to_token, fn, "slot_to_token"),
        tile_volume, first_token, view_of(grad_coarse, fn, "grad_coarse"),
        grad_gate_view(grad_gate, gate, fn),
        at::get_num_threads(), stream_of(grad_out));
    return std::make_tuple(grad_coarse, grad_gate);
  });
}

std::tuple<Tensor, Tensor> vsa_combine_rows_backward_meta(const Tensor& grad_out,
                                                          const Tensor& coarse,
                                                          const OptTensor& gate,
                                                          const Tensor& token_to_slot,
                                                          const Tensor& slot_to_token, int64_t,
                                                          int64_t) {
  check_devices("vidattn.vsa_combine_rows_backward", "grad_out", grad_out, coarse, gate,
                "token_to_slot", token_to_slot, &slot_to_token);
  return backward_meta(grad_out, coarse, gate);
}

// vsa_combine_rows written into `out` (any strides with a unit last one, e.g. some heads of a
// larger tensor) instead of a new tensor: the sequence-parallel layer combines each head
// chunk into the layer's output as the chunk comes back, without a placing copy. Inference
// only: out is mutated, so the Autograd kernel refuses inputs that require grad.
void vsa_combine_rows_into_kernel(const Tensor& out, const Tensor& fine, const Tensor& coarse,
                                  const OptTensor& gate, const Tensor& token_to_slot,
                                  const Tensor& slot_to_token, int64_t tile_volume,
                                  int64_t first_token) {
  combine_rows("vidattn.vsa_combine_rows_into", &out, fine, coarse, gate, token_to_slot,
               slot_to_token, tile_volume, first_token);
}

void vsa_combine_rows_into_meta(const Tensor& out, const Tensor& fine, const Tensor& coarse,
                                const OptTensor& gate, const Tensor& token_to_slot,
                                const Tensor& slot_to_token, int64_t, int64_t) {
  check_devices("vidattn.vsa_combine_rows_into", "fine", fine, coarse, gate, "token_to_slot",
                token_to_slot, &slot_to_token, &out);
}

void vsa_combine_rows_into_autograd(const Tensor& out, const Tensor& fine, const Tensor& coarse,
                                    const OptTensor& gate, const Tensor& token_to_slot,
                                    const Tensor& slot_to_token, int64_t tile_volume,
                                    int64_t first_token) {
  static auto op = find_op<decltype(vsa_combine_rows_into_kernel)>(
      "vidattn::vsa_combine_rows_into");
  TORCH_CHECK(!at::GradMode::is_enabled() ||
                  !(out.requires_grad() || fine.requires_grad() || coarse.requires_grad() ||
                    (has(gate) && gate->requires_grad())),
              "vidattn.vsa_combine_rows_into: writes into 'out' and has no gradient; with "
              "tensors that require grad use vidattn.vsa_combine_rows");
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.call(out, fine, coarse, gate, token_to_slot, slot_to_token, tile_volume, first_token);
  }
  torch::autograd::impl::bump_version(out);  // what ADInplaceOrView does for in-place ops
}

class VsaCombineRowsFunction : public torch::autograd::Function<VsaCombineRowsFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& fine, const Tensor& coarse,
                        const OptTensor& gate, const Tensor& token_to_slot,
                        const Tensor& slot_to_token, int64_t tile_volume, int64_t first_token) {
    static auto op = find_op<decltype(vsa_combine_rows_kernel)>("vidattn::vsa_combine_rows");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({coarse, has(gate) ? *gate : Tensor(), token_to_slot, slot_to_token});
    ctx->saved_data["tile_volume"] = tile_volume;
    ctx->saved_data["first_token"] = first_token;
    return op.call(fine, coarse, gate, token_to_slot, slot_to_token, tile_volume, first_token);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(vsa_combine_rows_backward_kernel)>(
        "vidattn::vsa_combine_rows_backward");
    const auto saved = ctx->get_saved_variables();
    const Tensor grad = unit_stride_grad(grads[0]);
    const OptTensor gate = saved[1].defined() ? OptTensor(saved[1]) : std::nullopt;
    auto [grad_coarse, grad_gate] =
        op.call(grad, saved[0], gate, saved[2], saved[3], ctx->saved_data["tile_volume"].toInt(),
                ctx->saved_data["first_token"].toInt());
    return {grads[0], grad_coarse, gate ? grad_gate : Tensor(), Tensor(), Tensor(), Tensor(),
            Tensor()};
  }
};

Tensor vsa_combine_rows_autograd(const Tensor& fine, const Tensor& coarse, const OptTensor& gate,
                                 const Tensor& token_to_slot, const Tensor& slot_to_token,
                                 int64_t tile_volume, int64_t first_token) {
  return VsaCombineRowsFunction::apply(fine, coarse, gate, token_to_slot, slot_to_token,
                                       tile_volume, first_token);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vidattn, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("vsa_combine(Tensor fine, Tensor coarse, Tensor? gate, Tensor block_sizes, "
        "int tile_volume) -> Tensor",
        tags);
  m.def("vsa_combine_backward(Tensor grad_out, Tensor coarse, Tensor? gate, "
        "Tensor block_sizes, int tile_volume) -> (Tensor grad_coarse, Tensor grad_gate)",
        tags);
  m.def("vsa_combine_rows(Tensor fine, Tensor coarse, Tensor? gate, Tensor token_to_slot, "
        "Tensor slot_to_token, int tile_volume, int first_token) -> Tensor",
        tags);
  m.def("vsa_combine_rows_backward(Tensor grad_out, Tensor coarse, Tensor? gate, "
        "Tensor token_to_slot, Tensor slot_to_token, int tile_volume, int first_token) -> "
        "(Tensor grad_coarse, Tensor grad_gate)",
        tags);
  m.def("vsa_combine_rows_into(Tensor(a!) out, Tensor fine, Tensor coarse, Tensor? gate, "
        "Tensor token_to_slot, Tensor slot_to_token, int tile_volume, int first_token) -> ()",
        tags);
}

// The same kernels serve CPU and CUDA tensors (the core dispatches on the device).
static void impl_combine_kernels(torch::Library& m) {
  m.impl("vsa_combine", &vsa_combine_kernel);
  m.impl("vsa_combine_backward", &vsa_combine_backward_kernel);
  m.impl("vsa_combine_rows", &vsa_combine_rows_kernel);
  m.impl("vsa_combine_rows_backward", &vsa_combine_rows_backward_kernel);
  m.impl("vsa_combine_rows_into", &vsa_combine_rows_into_kernel);
}

TORCH_LIBRARY_IMPL(vidattn, CPU, m) { impl_combine_kernels(m); }
#ifdef VIDATTN_TORCH_CUDA
TORCH_LIBRARY_IMPL(vidattn, CUDA, m) { impl_combine_kernels(m); }
#endif

TORCH_LIBRARY_IMPL(vidattn, Meta, m) {
  m.impl("vsa_combine", &vsa_combine_meta);
  m.impl("vsa_combine_backward", &vsa_combine_backward_meta);
  m.impl("vsa_combine_rows", &vsa_combine_rows_meta);
  m.impl("vsa_combine_rows_backward", &vsa_combine_rows_backward_meta);
  m.impl("vsa_combine_rows_into", &vsa_combine_rows_into_meta);
}

TORCH_LIBRARY_IMPL(vidattn, Autograd, m) {
  m.impl("vsa_combine", &vsa_combine_autograd);
  m.impl("vsa_combine_backward", refusing_double_backward());
  m.impl("vsa_combine_rows", &vsa_combine_rows_autograd);
  m.impl("vsa_combine_rows_backward", refusing_double_backward());
  m.impl("vsa_combine_rows_into", &vsa_combine_rows_into_autograd);
}

}  // namespace vidattn::torch_ops
