// Argument checking shared by every entry point: messages name the entry point, the
// argument and what was expected.
#pragma once

#include <cstdint>
#include <sstream>
#include <string>
#include <utility>

#include "vidattn/error.h"
#include "vidattn/tensor_view.h"

namespace vidattn::detail {

template <class... Parts>
std::string concat(Parts&&... parts) {
  std::ostringstream s;
  (s << ... << std::forward<Parts>(parts));
  return s.str();
}

template <class... Parts>
[[noreturn]] void throw_value_error(Parts&&... parts) {
  throw ValueError(concat(std::forward<Parts>(parts)...));
}

template <class... Parts>
[[noreturn]] void throw_type_error(Parts&&... parts) {
  throw TypeError(concat(std::forward<Parts>(parts)...));
}

// The floating-point storage types every op accepts somewhere (backends narrow it further).
inline bool is_float_dtype(DType t) {
  return t == DType::kFloat32 || t == DType::kFloat16 || t == DType::kBFloat16 ||
         t == DType::kFloat64;
}

// One checker per entry point, so every message starts with the function's public name.
class ArgChecker {
 public:
  explicit ArgChecker(const char* function) : function_(function) {}

  void ndim(const TensorView& t, const char* name, int expected, const char* layout) const {
    if (t.ndim != expected)
      throw_value_error(function_, ": argument '", name, "' must be ", expected, "-D ", layout,
                        ", got a ", t.ndim, "-D tensor of shape ", shape_string(t));
  }
  void dtype(const TensorView& t, const char* name, DType expected) const {
    if (t.dtype != expected)
      throw_type_error(function_, ": argument '", name, "' must have dtype ",
                       dtype_name(expected), ", got ", dtype_name(t.dtype));
  }
  void same_device(const TensorView& t, const char* name, Device expected) const {
    if (!(t.device == expected))
      throw_value_error(function_, ": argument '", name, "' must be on ", device_name(expected),
                        " like q, got ", device_name(t.device));
  }
  void dim_equals(const TensorView& t, const char* name, int dim, std::int64_t expected,
                  const char* what) const {
    if (t.shape[dim] != expected)
      throw_value_error(function_, ": argument '", name, "' has shape ", shape_string(t),
                        "; expected size ", expected, " in dimension ", dim, " (", what, ")");
  }
  // t must be exactly `ndim`-D with sizes `expected`; `layout` (e.g. "[B, Hq, Qtiles]") is
  // added to the message when given.
  void shape(const TensorView& t, const char* name, const std::int64_t* expected, int ndim,
             const char* layout = "") const {
    bool same = t.ndim == ndim;
    for (int i = 0; same && i < ndim; ++i) same = t.shape[i] == expected[i];
    if (same) return;
    TensorView want;
    want.ndim = ndim;
    for (int i = 0; i < ndim; ++i) want.shape[i] = expected[i];
    fail("argument '", name, "' must have shape ", shape_string(want), *layout ? " " : "",
         layout, ", got ", shape_string(t));
  }
  void unit_last_stride(const TensorView& t, const char* name) const {
    if (t.ndim > 0 && t.shape[t.ndim - 1] > 1 && t.stride[t.ndim - 1] != 1)
      throw_value_error(function_, ": argument '", name,
                        "' must have a unit stride in its last dimension, got stride ",
                        t.stride[t.ndim - 1]);
  }
  void non_null(const TensorView& t, const char* name) const {
    if (t.data == nullptr && t.numel() > 0)
      throw_value_error(function_, ": argument '", name, "' has no data pointer");
  }
  template <class... Parts>
  [[noreturn]] void fail(Parts&&... parts) const {
    throw_value_error(function_, ": ", std::forward<Parts>(parts)...);
  }
  const char* function() const { return function_; }

 private:
  const char* function_;
};

// The rule of varlen offsets (docs/conventions.md): `entries` = N + 1 int32 values with
// c[0] = 0, c[i] <= c[i + 1], every length c[i + 1] - c[i] at most max_len, and c[N] = rows.
// at(i) reads entry i on the host. The CPU backend runs it on every call; the CUDA backend
// runs a device version and, when that finds a fault, this one on a host copy for the message,
// so both backends raise the same ValueError.
template <class At>
void check_cu_seqlens(const ArgChecker& check, const char* name, std::int64_t entries, At at,
                      std::int64_t rows, std::int64_t max_len) {
  if (entries < 1) check.fail("argument '", name, "' must hold at least one offset");
  if (at(0) != 0) check.fail("argument '", name, "' must start at 0, got ", at(0));
  for (std::int64_t i = 0; i + 1 < entries; ++i) {
    const std::int64_t len = std::int64_t(at(i + 1)) - at(i);
    if (len < 0)
      check.fail("argument '", name, "' must be non-decreasing, but entry ", i + 1, " (",
                 at(i + 1), ") is below entry ", i, " (", at(i), ")");
    if (len > max_len)
      check.fail("sequence ", i, " of '", name, "' has length ", len,
                 ", more than the max_seqlen given (", max_len, ")");
  }
  if (at(entries - 1) != rows)
    check.fail("argument '", name, "' must end at the number of rows (", rows, "), got ",
               at(entries - 1));
}

}  // namespace vidattn::detail
