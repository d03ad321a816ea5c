// Standalone host entry of the sm_90a block-sparse forward (index-native VSA format,
// spec/vsa.md section 4): checks the arguments, fills the kernel parameters and dispatches on
// (dtype, head dim). The public block-sparse op routes here on sm_90 devices.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../../core/backends.h"
#include "../../core/check.h"
#include "../sm80/host_common.h"
#include "sm90_dispatch.h"
#include "sm90_fwd_launch.h"

namespace vidattn::detail {

namespace {

void expect_shape(const char* fn, const TensorView& t, const char* name,
                  std::initializer_list<std::int64_t> shape) {
  bool ok = t.ndim == static_cast<int>(shape.size());
  int d = 0;
  for (std::int64_t s : shape) ok = ok && t.shape[d++] == s;
  if (!ok) {
    std::string want = "[";
    d = 0;
    for (std::int64_t s : shape) want += (d++ ? ", " : "") + std::to_string(s);
    throw_value_error(fn, ": argument '", name, "' must have shape ", want, "], got ",
                      shape_string(t));
  }
}

void expect_dtype(const char* fn, const TensorView& t, const char* name, DType dtype) {
  if (t.dtype != dtype)
    throw_type_error(fn, ": argument '", name, "' must be ", dtype_name(dtype), ", got ",
                     dtype_name(t.dtype));
}

}  // namespace

bool cuda_sm90_block_sparse_forward(const TensorView& q, const TensorView& k,
                                    const TensorView& v, const TensorView& out,
                                    const TensorView& lse, const TensorView& q2k_index,
                                    const TensorView& q2k_count,
                                    const TensorView* kv_block_sizes, int tile_volume,
                                    double scale, int sm_margin, void* stream,
                                    const TensorView* q_block_sizes,
                                    const CombineViews* combine) {
  constexpr const char* fn = "vidattn._block_sparse_forward_sm90";
  if (q.ndim != 4 || k.ndim != 4 || v.ndim != 4)
    throw_value_error(fn, ": q, k, v must be 4-D [B, S, H, D], got ", shape_string(q), ", ",
                      shape_string(k), ", ", shape_string(v));
  if (q.dtype != DType::kBFloat16 && q.dtype != DType::kFloat16)
    throw_type_error(fn, ": argument 'q' must be bfloat16 or float16, got ", dtype_name(q.dtype));
  expect_dtype(fn, k, "k", q.dtype);
  expect_dtype(fn, v, "v", q.dtype);
  expect_dtype(fn, out, "out", q.dtype);
  expect_dtype(fn, lse, "lse", DType::kFloat32);
  const std::int64_t B = q.shape[0], Sq = q.shape[1], Hq = q.shape[2], D = q.shape[3];
  const std::int64_t Sk = k.shape[1], Hkv = k.shape[2];
  if (D != 64 && D != 128)
    throw_value_error(fn, ": head dim must be 64 or 128, got ", D);
  expect_shape(fn, k, "k", {B, Sk, Hkv, D});
  expect_shape(fn, v, "v", {B, Sk, Hkv, D});
  if (Hkv <= 0 || Hq % Hkv != 0)
    throw_value_error(fn, ": q heads (", Hq, ") must be a multiple of k heads (", Hkv, ")");
  if (tile_volume != 64 && tile_volume != 128 && tile_volume != 256)
    throw_value_error(fn, ": argument 'tile_volume' must be 64, 128 or 256, got ", tile_volume);
  if (Sq % tile_volume != 0 || Sk % tile_volume != 0)
    throw_value_error(fn, ": q and k lengths (", Sq, ", ", Sk,
                      ") must be multiples of tile_volume ", tile_volume, " (tiled layout)");
  const std::int64_t q_tiles = Sq / tile_volume, kv_tiles = Sk / tile_volume;
  expect_dtype(fn, q2k_index, "q2k_index", DType::kInt32);
  expect_dtype(fn, q2k_count, "q2k_count", DType::kInt32);
  if (kv_block_sizes) expect_dtype(fn, *kv_block_sizes, "kv_block_sizes", DType::kInt32);
  if (q_block_sizes) expect_dtype(fn, *q_block_sizes, "q_block_sizes", DType::kInt32);
  if (q2k_index.ndim != 4)
    throw_value_error(fn, ": argument 'q2k_index' must be 4-D [B, H, Qtiles, MaxK], got ",
                      shape_string(q2k_index));
  const std::int64_t max_k = q2k_index.shape[3];
  expect_shape(fn, q2k_index, "q2k_index", {B, Hq, q_tiles, max_k});
  expect_shape(fn, q2k_count, "q2k_count", {B, Hq, q_tiles});
  if (kv_block_sizes) expect_shape(fn, *kv_block_sizes, "kv_block_sizes", {kv_tiles});
  if (q_block_sizes) expect_shape(fn, *q_block_sizes, "q_block_sizes", {q_tiles});
  expect_shape(fn, out, "out", {B, Sq, Hq, D});
  expect_shape(fn, lse, "lse", {B, Hq, Sq});
  if (max_k > 1 && q2k_index.stride[3] != 1)
    throw_value_error(fn, ": argument 'q2k_index' must be contiguous in its last dimension");
  if (kv_block_sizes && kv_tiles > 1 && kv_block_sizes->stride[0] != 1)
    throw_value_error(fn, ": argument 'kv_block_sizes' must be contiguous");
  if (B == 0 || Sq == 0 || Hq == 0) return true;

  if (!cuda_sm90::sm90_path_enabled(q.device.index) || Sk == 0) return false;
  for (const TensorView* t : {&q, &k, &v, &out})
    if (!cuda_sm90::tma_compatible(*t)) return false;
  if (!(scale > 0.0)) return false;
  cuda_sm90::CombineArgs combine_args;
  if (combine) {  // the fused kernel: 64-token tiles, views it addresses in 16-byte chunks
    if (tile_volume != 64) return false;
    for (const TensorView* t : {combine->coarse, combine->gate, combine->out})
      if (t && !cuda_sm90::tma_compatible(*t)) return false;
    combine_args.out = combine->out->data;
    combine_args.out_strides = cuda_sm80::token_strides(*combine->out, false);
    if (combine->gate) {
      combine_args.gate = combine->gate->data;
      combine_args.gate_strides = cuda_sm80::token_strides(*combine->gate, false);
    }
    const TensorView& c = *combine->coarse;
    combine_args.coarse = c.data;
    combine_args.coarse_batch = c.stride[0];
    combine_args.coarse_tile = c.stride[1];
    combine_args.coarse_head = c.stride[2];
  }

  // TMA-compatible (checked above): every row starts on 16 bytes.
  cuda_sm80::AttentionParams kp =
      cuda_sm80::layout_params(q, k, v, out, lse, B, Hq, Hkv, Sq, Sk, scale, false);
  kp.out_aligned4 = true;
  kp.tile_volume = tile_volume;
  if (q_block_sizes) {  // the epilogue zeroes padded query slots
    kp.q_block_sizes = static_cast<const std::int32_t*>(q_block_sizes->data);
    kp.q_block_sizes_stride = q_block_sizes->stride[0];
  }
  kp.sm_margin = sm_margin;

  cuda_sm90::SparseKeyListArgs s;
  s.q2k_index = static_cast<const std::int32_t*>(q2k_index.data);
  s.index_batch = q2k_index.stride[0], s.index_head = q2k_index.stride[1];
  s.index_tile = q2k_index.stride[2];
  s.q2k_count = static_cast<const std::int32_t*>(q2k_count.data);
  s.count_batch = q2k_count.stride[0], s.count_head = q2k_count.stride[1];
  s.count_tile = q2k_count.stride[2];
  s.kv_block_sizes =
      kv_block_sizes ? static_cast<const std::int32_t*>(kv_block_sizes->data) : nullptr;
  s.tile_volume = tile_volume;
  s.max_k = static_cast<int>(max_k);
  s.q_tiles = static_cast<int>(q_tiles);
  s.kv_tiles = static_cast<int>(kv_tiles);

  int previous = -1;
  cuda_sm80::check_cuda(cudaGetDevice(&previous), "cudaGetDevice");
  if (previous != q.device.index) cuda_sm80::check_cuda(cudaSetDevice(q.device.index), "cudaSetDevice");
  bool launched = false;
  try {
    const auto st = static_cast<cudaStream_t>(stream);
#ifdef VIDATTN_WITH_CUTLASS
    cuda_sm80::dispatch_dtype_head_dim(q.dtype == DType::kBFloat16, D, [&](auto t, auto d) {
      using T = decltype(t);
      constexpr int kD = decltype(d)::value;
      launched = combine ? cuda_sm90::launch_sparse_combine_forward<T, kD>(kp, s, combine_args, st)
                         : cuda_sm90::launch_sparse_forward<T, kD>(kp, s, st);
    });
#else
    (void)st;
#endif
  } catch (...) {
    if (previous != q.device.index) cudaSetDevice(previous);
    throw;
  }
  if (previous != q.device.index) cudaSetDevice(previous);
  return launched;
}

}  // namespace vidattn::detail
