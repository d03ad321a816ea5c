// The device check of varlen offsets: the varlen forward's one host synchronisation, skipped
// while the stream is being captured (the rule of the block-sparse index check,
// vsa/index_check.cu, whose capture query it shares).
#include "varlen_check.h"

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "cuda/common/check.h"
#include "cuda/common/workspace.h"
#include "cuda/vsa/index_check.h"

namespace vidattn::cuda_dispatch {
namespace {

struct Offsets {
  const std::int32_t* data = nullptr;
  std::int64_t stride = 1, entries = 0, rows = 0, max_len = 0;
};

// One thread per entry of either tensor: entry e is faulty when it breaks the rule with its
// successor (or, for the last, with the row count; for the first, with 0). flag gets bit 1
// for a fault in cu_seqlens_q, bit 2 for one in cu_seqlens_k.
__global__ void __launch_bounds__(256)
    varlen_check_offsets_kernel(const Offsets q, const Offsets k, int* flag) {
  const std::int64_t n = q.entries + k.entries;
  const std::int64_t stride = static_cast<std::int64_t>(gridDim.x) * blockDim.x;
  for (std::int64_t i = blockIdx.x * static_cast<std::int64_t>(blockDim.x) + threadIdx.x; i < n;
       i += stride) {
    const bool is_k = i >= q.entries;
    const Offsets& c = is_k ? k : q;
    const std::int64_t e = is_k ? i - q.entries : i;
    const std::int64_t value = c.data[e * c.stride];
    bool bad = e == 0 && value != 0;
    if (e + 1 < c.entries) {
      const std::int64_t len = std::int64_t(c.data[(e + 1) * c.stride]) - value;
      bad = bad || len < 0 || len > c.max_len;
    } else {
      bad = bad || value != c.rows;
    }
    if (bad) atomicOr(flag, is_k ? 2 : 1);
  }
}

Offsets offsets_of(const TensorView& t, std::int64_t rows, std::int64_t max_len) {
  return {static_cast<const std::int32_t*>(t.data), t.stride[0], t.shape[0], rows, max_len};
}

// Copies c's entries to the host and raises the host check's ValueError (a fallback one if
// the host copy passes, which only a concurrent write to the offsets could cause).
[[noreturn]] void describe_fault(const char* fn, const char* name, const Offsets& c,
                                 cudaStream_t stream) {
  const std::int64_t count = c.stride == 0 ? 1 : c.entries;
  std::vector<std::int32_t> host(static_cast<std::size_t>(count));
  const std::size_t width = sizeof(std::int32_t);
  cudaError_t status = cudaMemcpy2DAsync(host.data(), width, c.data,
                                         width * static_cast<std::size_t>(std::max<std::int64_t>(c.stride, 1)),
                                         width, static_cast<std::size_t>(count),
                                         cudaMemcpyDeviceToHost, stream);
  if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  cuda_common::check_cuda(status, "varlen offsets check");
  const detail::ArgChecker check(fn);
  detail::check_cu_seqlens(
      check, name, c.entries,
      [&](std::int64_t i) { return std::int64_t(host[c.stride == 0 ? 0 : i]); }, c.rows,
      c.max_len);
  detail::throw_value_error(fn, ": argument '", name, "' breaks the rule of varlen offsets "
                            "(checked on the device)");
}

}  // namespace

void check_varlen_offsets(const char* fn, const TensorView& cu_seqlens_q, std::int64_t rows_q,
                          std::int64_t max_seqlen_q, const TensorView& cu_seqlens_k,
                          std::int64_t rows_k, std::int64_t max_seqlen_k, cudaStream_t stream) {
  if (cuda_vsa::stream_is_capturing(stream)) return;
  const Offsets q = offsets_of(cu_seqlens_q, rows_q, max_seqlen_q);
  const Offsets k = offsets_of(cu_seqlens_k, rows_k, max_seqlen_k);
  const std::int64_t work = q.entries + k.entries;
  if (work == 0) return;
  int host = 0;
  cudaError_t status = cudaSuccess;
  {
    const cuda_common::DeviceWorkspace flags(sizeof(int), stream, "the varlen offsets check");
    int* flag = flags.as<int>();
    status = cudaMemsetAsync(flag, 0, sizeof(int), stream);
    if (status == cudaSuccess) {
      const unsigned blocks =
          static_cast<unsigned>(std::min<std::int64_t>((work + 255) / 256, 1024));
      varlen_check_offsets_kernel<<<blocks, 256, 0, stream>>>(q, k, flag);
      status = cudaGetLastError();
    }
    if (status == cudaSuccess)
      status = cudaMemcpyAsync(&host, flag, sizeof(int), cudaMemcpyDeviceToHost, stream);
    if (status == cudaSuccess) status = cudaStreamSynchronize(stream);
  }
  cuda_common::check_cuda(status, "varlen offsets check");
  if (host & 1) describe_fault(fn, "cu_seqlens_q", q, stream);
  if (host & 2) describe_fault(fn, "cu_seqlens_k", k, stream);
}

}  // namespace vidattn::cuda_dispatch
