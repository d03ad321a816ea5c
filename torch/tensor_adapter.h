// at::Tensor <-> vidattn::TensorView, and vidattn's exceptions as PyTorch's.
#pragma once

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/core/stack.h>
#include <c10/util/Exception.h>
#include <torch/csrc/autograd/functions/basic_ops.h>
#include <torch/csrc/autograd/functions/utils.h>
#include <torch/library.h>

#ifdef VIDATTN_TORCH_CUDA
#include <ATen/cuda/CUDAContext.h>
#endif

#include <initializer_list>
#include <optional>
#include <string>
#include <vector>

#include "vidattn/error.h"
#include "vidattn/tensor_view.h"

namespace vidattn::torch_ops {

inline DType dtype_of(const at::Tensor& t, const char* fn, const char* name) {
  switch (t.scalar_type()) {
    case at::kFloat: return DType::kFloat32;
    case at::kHalf: return DType::kFloat16;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kDouble: return DType::kFloat64;
    case at::kInt: return DType::kInt32;
    case at::kBool: return DType::kBool;
    default:
      TORCH_CHECK_TYPE(false, fn, ": argument '", name, "' has unsupported dtype ",
                       t.scalar_type());
  }
}

// True when every size and stride of t is a concrete integer (not a symbolic one).
inline bool is_concrete(const at::Tensor& t) {
  for (const auto& s : t.sym_sizes())
    if (!s.maybe_as_int()) return false;
  for (const auto& s : t.sym_strides())
    if (!s.maybe_as_int()) return false;
  return true;
}

// One tensor argument of an op, by name, for check_same_device; an absent optional tensor
// (None) is skipped.
struct DeviceArg {
  const char* name;
  const at::Tensor* tensor;
  DeviceArg(const char* n, const at::Tensor& t) : name(n), tensor(&t) {}
  DeviceArg(const char* n, const std::optional<at::Tensor>& t)
      : name(n), tensor(t && t->defined() ? &*t : nullptr) {}
};

inline bool same_device(const at::Device& a, const at::Device& b) {
  if (a.type() != b.type()) return false;
  return a.type() != at::kCUDA || a.index() == b.index();
}

// Every op's first check, in its CPU / CUDA kernel and in its Meta kernel alike: all its
// tensor arguments on one device, else a ValueError naming the argument and both devices.
// The kernels cannot take it for granted: the dispatcher picks one kernel from the union of
// the arguments' devices, so one meta argument sends the whole call to the Meta kernel
// (which would return uninitialised memory on the other arguments' device) and one CUDA
// argument sends CPU arguments to the CUDA kernel. Being in the ops, it holds for
// torch.ops.vidattn.* called directly as well as through the Python functions.
inline void check_same_device(const char* fn, std::initializer_list<DeviceArg> args) {
  const DeviceArg* first = nullptr;
  for (const DeviceArg& a : args) {
    if (!a.tensor || !a.tensor->defined()) continue;
    if (!first) {
      first = &a;
      continue;
    }
    const at::Device expected = first->tensor->device(), got = a.tensor->device();
    TORCH_CHECK_VALUE(same_device(expected, got), fn, ": argument '", a.name, "' must be on ",
                      expected, " like '", first->name, "', got ", got,
                      " (all tensor arguments of an op must be on one device; meta tensors "
                      "only together with meta tensors)");
  }
}

// A view of t. Meta tensors give views with no data (enough for describe_* checks).
inline TensorView view_of(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK_VALUE(t.dim() <= kMaxDims, fn, ": argument '", name, "' must have at most ",
                    kMaxDims, " dimensions, got ", t.dim());
  TensorView v;
  v.dtype = dtype_of(t, fn, name);
  v.ndim = static_cast<int>(t.dim());
  for (int i = 0; i < v.ndim; ++i) {
    v.shape[i] = t.size(i);
    v.stride[i] = t.stride(i);
  }
  if (t.is_cuda()) {
    v.device = {DeviceKind::kCUDA, t.get_device()};
  } else {
    v.device = {DeviceKind::kCPU, 0};
  }
  v.data = t.is_meta() ? nullptr : t.data_ptr();
  return v;
}

inline std::optional<TensorView> view_of(const std::optional<at::Tensor>& t, const char* fn,
                                         const char* name) {
  if (!t || !t->defined()) return std::nullopt;
  return view_of(*t, fn, name);
}

// A gradient the kernels can take: they need a unit-stride last dimension, an expanded
// gradient (from .sum()) has stride 0 there, and contiguous() leaves an empty tensor's
// strides as they are. Symbolic sizes pass (this runs under torch.compile's tracing too).
inline at::Tensor unit_stride_grad(const at::Tensor& grad) {
  if (grad.sym_numel() == 0) return at::empty_symint(grad.sym_sizes(), grad.options());
  return grad.sym_stride(-1) == 1 ? grad : grad.contiguous();
}

// Runs f, turning vidattn's exceptions into the PyTorch ones Python maps to ValueError,
// TypeError, NotImplementedError and torch.OutOfMemoryError.
template <class F>
decltype(auto) translate_errors(F&& f) {
  try {
    return f();
  } catch (const vidattn::TypeError& e) {
    TORCH_CHECK_TYPE(false, e.what());
  } catch (const vidattn::ValueError& e) {
    TORCH_CHECK_VALUE(false, e.what());
  } catch (const vidattn::NotImplementedError& e) {
    TORCH_CHECK_NOT_IMPLEMENTED(false, e.what());
  } catch (const vidattn::OutOfMemoryError& e) {
    TORCH_CHECK_WITH(OutOfMemoryError, false, e.what());
  }
}

// The stream the CUDA kernels run on: PyTorch's current stream of t's device (null for CPU).
inline void* stream_of(const at::Tensor& t) {
#ifdef VIDATTN_TORCH_CUDA
  if (t.is_cuda()) return at::cuda::getCurrentCUDAStream(t.get_device()).stream();
#endif
  (void)t;
  return nullptr;
}

// An op of this library by its schema name, typed (for calls from autograd functions).
template <class Signature>
auto find_op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Signature>();
}

// Index arguments must be int32; say so before the generic dtype mapping does.
inline void require_int32(const at::Tensor& t, const char* fn, const char* name) {
  TORCH_CHECK_TYPE(t.scalar_type() == at::kInt, fn, ": argument '", name,
                   "' must have dtype int32, got ", t.scalar_type());
}
inline void require_int32(const std::optional<at::Tensor>& t, const char* fn, const char* name) {
  if (t && t->defined()) require_int32(*t, fn, name);
}

// Autograd kernel of the *_backward ops: they have no derivative of their own. Where their
// inputs require grad (create_graph=True through vidattn), the outputs get a node that raises
// if a gradient ever flows back through it (like torch's once_differentiable), instead of
// PyTorch's fallback, which only warns and yields zero second derivatives.
inline void refuse_double_backward(const c10::OperatorHandle& op, c10::DispatchKeySet,
                                   torch::jit::Stack* stack) {
  std::vector<at::Tensor> tracked;
  if (at::GradMode::is_enabled())
    for (const c10::IValue& v : torch::jit::last(*stack, op.schema().arguments().size()))
      if (v.isTensor() && v.toTensor().requires_grad()) tracked.push_back(v.toTensor());
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    op.callBoxed(stack);
  }
  if (tracked.empty()) return;
  auto error = std::shared_ptr<torch::autograd::Error>(
      new torch::autograd::Error(
          std::string(op.schema().name()) +
              ": double backward (a gradient of vidattn's gradients) is not supported",
          torch::autograd::collect_next_edges(tracked)),
      torch::autograd::deleteNode);
  for (const c10::IValue& v : torch::jit::last(*stack, op.schema().returns().size()))
    if (v.isTensor() && v.toTensor().defined() && at::isFloatingType(v.toTensor().scalar_type()))
      torch::autograd::set_history(v.toTensor(), error);
}

inline torch::CppFunction refusing_double_backward() {
  return torch::CppFunction::makeFromBoxedFunction<&refuse_double_backward>();
}

}  // namespace vidattn::torch_ops
