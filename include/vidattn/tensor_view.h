// A torch-free, non-owning view of a strided tensor: what every vidattn entry point takes.
#pragma once

#include <cstdint>
#include <string>

namespace vidattn {

enum class DType : std::uint8_t { kFloat32, kFloat16, kBFloat16, kFloat64, kInt32, kBool };
enum class DeviceKind : std::uint8_t { kCPU, kCUDA };

struct Device {
  DeviceKind kind = DeviceKind::kCPU;
  int index = 0;
  friend bool operator==(const Device&, const Device&) = default;
};

inline constexpr int kMaxDims = 4;

// Shape and strides are in elements. Strides may be anything (transposed and sliced views
// are fine); each entry point says which dimensions must be unit-stride.
struct TensorView {
  void* data = nullptr;
  DType dtype = DType::kFloat32;
  int ndim = 0;
  std::int64_t shape[kMaxDims] = {};
  std::int64_t stride[kMaxDims] = {};
  Device device{};

  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  std::int64_t size(int dim) const { return shape[dim < 0 ? dim + ndim : dim]; }
};

// Builds a view of a contiguous (row-major) tensor.
TensorView make_view(void* data, DType dtype, std::initializer_list<std::int64_t> shape,
                     Device device = {});

std::size_t dtype_size(DType dtype);
const char* dtype_name(DType dtype);
std::string device_name(Device device);
std::string shape_string(const TensorView& t);

}  // namespace vidattn
