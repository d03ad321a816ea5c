#include "vidattn/tensor_view.h"

#include <sstream>

#include "check.h"

namespace vidattn {

TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     Device device) {
  if (shape.size() > static_cast<std::size_t>(kMaxDims))
    detail::throw_value_error("vidattn::make_view: at most ", kMaxDims, " dimensions, got ",
                              shape.size());
  TensorView t;
  t.data = data;
  t.dtype = dtype;
  t.device = device;
  t.ndim = static_cast<int>(shape.size());
  int i = 0;
  for (std::int64_t s : shape) t.shape[i++] = s;
  std::int64_t stride = 1;
  for (int d = t.ndim - 1; d >= 0; --d) {
    t.stride[d] = stride;
    stride *= t.shape[d];
  }
  return t;
}

std::size_t dtype_size(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return 4;
    case DType::kFloat16: return 2;
    case DType::kBFloat16: return 2;
    case DType::kFloat64: return 8;
    case DType::kInt32: return 4;
    case DType::kBool: return 1;
  }
  return 0;
}

const char* dtype_name(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return "float32";
    case DType::kFloat16: return "float16";
    case DType::kBFloat16: return "bfloat16";
    case DType::kFloat64: return "float64";
    case DType::kInt32: return "int32";
    case DType::kBool: return "bool";
  }
  return "unknown";
}

std::string device_name(Device device) {
  return device.kind == DeviceKind::kCPU ? std::string("cpu")
                                         : "cuda:" + std::to_string(device.index);
}

std::string shape_string(const TensorView& t) {
  std::ostringstream s;
  s << '[';
  for (int i = 0; i < t.ndim; ++i) s << (i ? ", " : "") << t.shape[i];
  s << ']';
  return s.str();
}

}  // namespace vidattn
