// Validation and backend dispatch for RoPE.
#include "vidattn/rope.h"

#include <utility>

#include "check.h"
#include "rope_backends.h"

namespace vidattn {
namespace {

RopeProblem describe(const char* function, const TensorView& x, const TensorView& cos,
                     const TensorView& sin, const RopeOptions& o) {
  const detail::ArgChecker check(function);
  check.ndim(x, "x", 4, "[B, S, H, D]");
  if (!detail::is_float_dtype(x.dtype))
    detail::throw_type_error(function, ": argument 'x' must be float32, float16, bfloat16 or "
                             "float64, got ", dtype_name(x.dtype));
  // An empty tensor's strides are arbitrary (e.g. the expanded gradient of sum()).
  if (x.numel() > 0) check.unit_last_stride(x, "x");
  for (int d = 0; d < 4; ++d)
    if (x.shape[d] < 0) check.fail("argument 'x' has a negative size");
  RopeProblem p;
  p.batch = x.shape[0], p.seqlen = x.shape[1], p.heads = x.shape[2], p.head_dim = x.shape[3];
  p.dtype = x.dtype;
  p.device = x.device;
  if (p.head_dim % 2 != 0)
    check.fail("the head dim D of 'x' must be even (RoPE rotates pairs), got D = ", p.head_dim);

  check.ndim(cos, "cos", 2, "[S, D] or [S, D/2]");
  check.ndim(sin, "sin", 2, "[S, D] or [S, D/2]");
  if (!detail::is_float_dtype(cos.dtype))
    detail::throw_type_error(function, ": argument 'cos' must be float32, float16, bfloat16 or "
                             "float64, got ", dtype_name(cos.dtype));
  check.dtype(sin, "sin", cos.dtype);
  for (auto [t, name] : {std::pair{&cos, "cos"}, {&sin, "sin"}})
    if (!(t->device == x.device))
      check.fail("argument '", name, "' must be on ", device_name(x.device), " like x, got ",
                 device_name(t->device));
  if (cos.shape[0] != p.seqlen || (cos.shape[1] != p.head_dim && cos.shape[1] != p.head_dim / 2))
    check.fail("argument 'cos' must be [S, D] = [", p.seqlen, ", ", p.head_dim, "] or [S, D/2] = [",
               p.seqlen, ", ", p.head_dim / 2, "] for x of shape ", shape_string(x), ", got ",
               shape_string(cos));
  if (sin.shape[0] != cos.shape[0] || sin.shape[1] != cos.shape[1])
    check.fail("argument 'sin' must have the shape of cos, ", shape_string(cos), ", got ",
               shape_string(sin));
  p.half_table = cos.shape[1] == p.head_dim / 2;
  p.table_dtype = cos.dtype;
  if (o.num_threads < 0) check.fail("num_threads must be >= 0, got ", o.num_threads);
  return p;
}

}  // namespace

RopeProblem describe_rope(const TensorView& x, const TensorView& cos, const TensorView& sin,
                          const RopeOptions& options) {
  return describe("vidattn::describe_rope", x, cos, sin, options);
}

void apply_rope(const TensorView& x, const TensorView& cos, const TensorView& sin,
                const TensorView& out, const RopeOptions& options) {
  constexpr const char* kFn = "vidattn::apply_rope";
  const detail::ArgChecker check(kFn);
  const RopeProblem p = describe(kFn, x, cos, sin, options);
  check.non_null(x, "x");
  check.non_null(cos, "cos");
  check.non_null(sin, "sin");
  check.non_null(out, "out");
  check.dtype(out, "out", x.dtype);
  if (!(out.device == x.device))
    check.fail("argument 'out' must be on ", device_name(x.device), " like x, got ",
               device_name(out.device));
  bool same = out.ndim == 4;
  for (int d = 0; same && d < 4; ++d) same = out.shape[d] == x.shape[d];
  if (!same)
    check.fail("argument 'out' must have the shape of x, ", shape_string(x), ", got ",
               shape_string(out));
  if (x.numel() == 0) return;
  check.unit_last_stride(out, "out");
  if (p.device.kind == DeviceKind::kCPU) return detail::cpu_rope(p, x, cos, sin, out, options);
#if VIDATTN_WITH_CUDA
  return detail::cuda_rope(p, x, cos, sin, out, options);
#else
  throw NotImplementedError(detail::concat(
      kFn, ": this build of vidattn has no CUDA backend; pass CPU tensors"));
#endif
}

}  // namespace vidattn
