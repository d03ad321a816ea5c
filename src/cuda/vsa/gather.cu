// The tiling gathers on CUDA: gather_tokens, which tiles (raster -> tiled layout) and untiles
// (tiled -> raster) with the tiling's slot_to_token / token_to_slot maps. The CPU reference
// is cpu_gather_tokens (src/cpu/vsa_cpu.cpp).
//
// An index outside [-1, S) cannot be reported without a host sync, so it gives a zero row
// (like -1, a padding slot) instead of an error; valid indices give exactly the CPU result.
#include <cuda_runtime.h>

#include <cstdint>

#include "../../core/vsa_backends.h"
#include "../common/check.h"
#include "../common/device_guard.h"
#include "launch_utils.h"

namespace vidattn::cuda_vsa {
namespace {

struct GatherParams {
  const void* x = nullptr;
  void* out = nullptr;
  const std::int32_t* index = nullptr;  // int32 [N]
  std::int64_t index_stride = 1;
  std::int64_t batch = 0, seqlen = 0, rows = 0, heads = 0, head_dim = 0;  // rows = N
  std::int64_t x_stride[3] = {};    // batch, token, head (unit-stride head dim)
  std::int64_t out_stride[3] = {};
};

// One thread per Vec-sized chunk of a [D] row; Vec is the widest copy unit that the row length,
// the pointers and the strides allow (16 bytes for bf16/fp16 D % 8 == 0 on aligned tensors).
template <class Vec>
__global__ void vsa_gather_tokens_kernel(GatherParams p, std::int64_t elem_size) {
  const std::int64_t chunks = p.head_dim * elem_size / std::int64_t(sizeof(Vec));
  const std::int64_t total = p.batch * p.rows * p.heads * chunks;
  const auto* x = static_cast<const char*>(p.x);
  auto* out = static_cast<char*>(p.out);
  const std::int64_t step = std::int64_t(gridDim.x) * blockDim.x;
  for (std::int64_t i = std::int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < total;
       i += step) {
    const std::int64_t c = i % chunks;
    std::int64_t r = i / chunks;
    const std::int64_t h = r % p.heads;
    r /= p.heads;
    const std::int64_t n = r % p.rows, b = r / p.rows;
    const std::int32_t src = p.index[n * p.index_stride];
    Vec v{};  // zero bits are +0 in every float dtype
    if (src >= 0 && src < p.seqlen)
      v = *reinterpret_cast<const Vec*>(
          x + (b * p.x_stride[0] + src * p.x_stride[1] + h * p.x_stride[2]) * elem_size +
          c * std::int64_t(sizeof(Vec)));
    *reinterpret_cast<Vec*>(out +
                            (b * p.out_stride[0] + n * p.out_stride[1] + h * p.out_stride[2]) *
                                elem_size +
                            c * std::int64_t(sizeof(Vec))) = v;
  }
}

}  // namespace
}  // namespace vidattn::cuda_vsa

namespace vidattn::detail {

void cuda_gather_tokens(const TensorView& x, const TensorView& index, const TensorView& out,
                        void* stream) {
  using namespace cuda_vsa;
  GatherParams p;
  p.x = x.data, p.out = out.data, p.index = static_cast<const std::int32_t*>(index.data);
  p.index_stride = index.stride[0];
  p.batch = x.shape[0], p.seqlen = x.shape[1], p.rows = index.shape[0];
  p.heads = x.shape[2], p.head_dim = x.shape[3];
  for (int d = 0; d < 3; ++d) p.x_stride[d] = x.stride[d], p.out_stride[d] = out.stride[d];
  if (p.batch * p.rows * p.heads * p.head_dim == 0) return;
  const cuda_common::DeviceGuard guard(x.device.index);
  const auto es = std::int64_t(dtype_size(x.dtype));
  // The widest copy unit that divides the row and every address the kernel forms.
  std::int64_t width = 16;
  for (; width > es; width /= 2) {
    bool ok = (p.head_dim * es) % width == 0 && aligned(p.x, width) && aligned(p.out, width);
    for (int d = 0; d < 3 && ok; ++d)
      ok = (p.x_stride[d] * es) % width == 0 && (p.out_stride[d] * es) % width == 0;
    if (ok) break;
  }
  const std::int64_t total = p.batch * p.rows * p.heads * (p.head_dim * es / width);
  constexpr int kThreads = 256;
  auto s = static_cast<cudaStream_t>(stream);
  const unsigned grid = grid_for(total, kThreads);
  switch (width) {
    case 16: vsa_gather_tokens_kernel<uint4><<<grid, kThreads, 0, s>>>(p, es); break;
    case 8: vsa_gather_tokens_kernel<uint2><<<grid, kThreads, 0, s>>>(p, es); break;
    case 4: vsa_gather_tokens_kernel<std::uint32_t><<<grid, kThreads, 0, s>>>(p, es); break;
    default: vsa_gather_tokens_kernel<std::uint16_t><<<grid, kThreads, 0, s>>>(p, es); break;
  }
  cuda_common::check_last_launch("vidattn::gather_tokens kernel launch");
}

}  // namespace vidattn::detail
