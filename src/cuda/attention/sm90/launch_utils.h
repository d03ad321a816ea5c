// Host helpers of the sm_90a launchers, forward and backward: the CUTLASS element type of a
// CUDA one, the global views TMA descriptors are made from, and whether a kernel has sm_90a
// machine code in this build.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include <cute/tensor.hpp>
#include <cutlass/numeric_types.h>

#include "cuda/common/params.h"

namespace vidattn::cuda_sm90 {
namespace launch_detail {

using cuda_common::RowStrides;

template <class T>
using CutlassElement =
    std::conditional_t<std::is_same_v<T, __nv_bfloat16>, cutlass::bfloat16_t, cutlass::half_t>;

// The (rows, D, heads, batch) view TMA reads. Strides of extent-1 dimensions never matter to
// the addresses; they are replaced by packed values so that the descriptor's 16-byte stride
// rule holds for any view. `cols`: the tensor's head dim, read by padded instances
// (Traits::kPaddedHeadDim: TMA fills the tile's columns past it with zeros); the others have
// exactly Traits::kHeadDim.
template <class Traits>
typename Traits::GmemTensor gmem_view(const void* ptr, std::int64_t rows, int heads, int batch,
                                      const RowStrides& st, int cols = Traits::kHeadDim) {
  using namespace cute;
  constexpr int D = Traits::kHeadDim;
  const std::int64_t head = heads > 1 ? st.head : cols;
  const std::int64_t row = rows > 1 ? st.row : head * heads;
  const std::int64_t bat = batch > 1 ? st.batch : row * rows;
  auto width = [&] {
    if constexpr (Traits::kPaddedHeadDim) return static_cast<int32_t>(cols);
    else return Int<D>{};
  };
  auto layout = make_layout(
      make_shape(static_cast<int32_t>(rows), width(), static_cast<int32_t>(heads),
                 static_cast<int32_t>(batch)),
      make_stride(row, _1{}, head, bat));
  return make_tensor(make_gmem_ptr(static_cast<typename Traits::Element const*>(ptr)), layout);
}

// Whether the kernel has sm_90a machine code in this build (not just the empty sm_80 body).
template <class Kernel>
bool has_sm90a_code(Kernel kernel) {
  cudaFuncAttributes attr{};
  if (cudaFuncGetAttributes(&attr, kernel) != cudaSuccess) {
    (void)cudaGetLastError();
    return false;
  }
  return attr.binaryVersion >= 90;
}

}  // namespace launch_detail
}  // namespace vidattn::cuda_sm90
