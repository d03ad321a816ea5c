// Validation and backend dispatch for the VSA entry points (vidattn/vsa.h).
#include "vidattn/vsa.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "backends.h"
#include "check.h"
#include "vidattn/vsa_combine.h"
#include "vsa_backends.h"
#include "vsa_combine_backends.h"

namespace vidattn {
namespace {

using detail::ArgChecker;

void float_dtype(const ArgChecker& check, const TensorView& t, const char* name) {
  if (!detail::is_float_dtype(t.dtype))
    detail::throw_type_error(check.function(), ": argument '", name,
                             "' must be float32, float16, bfloat16 or float64, got ",
                             dtype_name(t.dtype));
}

void shape_is(const ArgChecker& check, const TensorView& t, const char* name,
              std::initializer_list<std::int64_t> shape, const char* layout) {
  check.ndim(t, name, static_cast<int>(shape.size()), layout);
  check.shape(t, name, shape.begin(), static_cast<int>(shape.size()), layout);
}

// An int32 [length] vector on `device`; with need_data, also a data pointer (describe_*
// entry points check metadata only, so that Meta tensors pass).
void int32_vector(const ArgChecker& check, const TensorView& t, const char* name,
                  std::int64_t length, Device device, const char* what, bool need_data = true) {
  check.ndim(t, name, 1, what);
  check.dtype(t, name, DType::kInt32);
  check.same_device(t, name, device);
  check.dim_equals(t, name, 0, length, what);
  if (need_data) check.non_null(t, name);
}

void tile_volume_ok(const ArgChecker& check, std::int64_t volume) {
  if (!is_supported_tile_volume(volume))
    check.fail("tile volume must be 64, 128 or 256, got ", volume);
}

[[noreturn]] void no_cuda(const char* function) {
  throw NotImplementedError(detail::concat(
      function, ": this build of vidattn has no CUDA backend for VSA; pass CPU tensors"));
}

bool on_cpu(const TensorView& t) { return t.device.kind == DeviceKind::kCPU; }

// x [B, S, H, D] with a float dtype, unit-stride last dimension and data.
void token_tensor(const ArgChecker& check, const TensorView& x, const char* name) {
  check.ndim(x, name, 4, "[B, S, H, D]");
  float_dtype(check, x, name);
  check.unit_last_stride(x, name);
  check.non_null(x, name);
}

}  // namespace

bool is_supported_tile_volume(std::int64_t volume) {
  return volume == 64 || volume == 128 || volume == 256;
}

std::int64_t TilingLayout::max_tiles_per_video() const {
  std::int64_t m = 0;
  for (std::int64_t n : tiles_per_video) m = std::max(m, n);
  return m;
}

TilingLayout describe_tiling(const std::vector<VideoGrid>& grids, TileShape tile) {
  const ArgChecker check("vidattn::describe_tiling");
  if (tile.t < 1 || tile.h < 1 || tile.w < 1)
    check.fail("every tile dimension must be >= 1, got ", tile.t, "x", tile.h, "x", tile.w);
  if (!is_supported_tile_volume(tile.volume()))
    check.fail("tile ", tile.t, "x", tile.h, "x", tile.w, " has volume ", tile.volume(),
               "; VSA supports tile volumes 64, 128 and 256 (e.g. 4x4x4, 4x4x8, 4x8x8)");
  if (grids.empty()) check.fail("at least one video grid is needed");
  TilingLayout layout;
  layout.tile = tile;
  layout.grids = grids;
  for (const VideoGrid& g : grids) {
    if (g.t < 1 || g.h < 1 || g.w < 1)
      check.fail("every grid dimension must be >= 1, got ", g.t, "x", g.h, "x", g.w);
    const std::int64_t n = ((g.t + tile.t - 1) / tile.t) * ((g.h + tile.h - 1) / tile.h) *
                           ((g.w + tile.w - 1) / tile.w);
    layout.tiles_per_video.push_back(n);
    layout.num_tiles += n;
    layout.num_tokens += g.numel();
  }
  if (layout.padded_len() > std::int64_t(INT32_MAX))
    check.fail("the tiled length ", layout.padded_len(), " does not fit the int32 index");
  return layout;
}

void tiling_metadata(const TilingLayout& layout, const TensorView& block_sizes,
                     const TensorView& slot_to_token, const TensorView& token_to_slot,
                     const TensorView& cu_tiles, const TensorView& cu_tokens) {
  const ArgChecker check("vidattn::tiling_metadata");
  const Device cpu{};
  const auto n = static_cast<std::int64_t>(layout.grids.size());
  int32_vector(check, block_sizes, "block_sizes", layout.num_tiles, cpu, "[num_tiles]");
  int32_vector(check, slot_to_token, "slot_to_token", layout.padded_len(), cpu, "[padded_len]");
  int32_vector(check, token_to_slot, "token_to_slot", layout.num_tokens, cpu, "[num_tokens]");
  int32_vector(check, cu_tiles, "cu_tiles", n + 1, cpu, "[N + 1]");
  int32_vector(check, cu_tokens, "cu_tokens", n + 1, cpu, "[N + 1]");
  detail::cpu_tiling_metadata(layout, block_sizes, slot_to_token, token_to_slot, cu_tiles,
                              cu_tokens);
}

void gather_tokens(const TensorView& x, const TensorView& index, const TensorView& out,
                   int num_threads, void* stream) {
  const ArgChecker check("vidattn::gather_tokens");
  token_tensor(check, x, "x");
  check.ndim(index, "index", 1, "[N]");
  check.dtype(index, "index", DType::kInt32);
  check.same_device(index, "index", x.device);
  check.non_null(index, "index");
  shape_is(check, out, "out", {x.shape[0], index.shape[0], x.shape[2], x.shape[3]},
           "[B, N, H, D]");
  check.dtype(out, "out", x.dtype);
  check.same_device(out, "out", x.device);
  check.unit_last_stride(out, "out");
  check.non_null(out, "out");
  if (on_cpu(x)) return detail::cpu_gather_tokens(x, index, out, num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_gather_tokens(x, index, out, stream);
#else
  (void)stream;
  no_cuda(check.function());
#endif
}

void tile_mean_pool(const TensorView& x, const TensorView& block_sizes, std::int64_t tile_volume,
                    const TensorView& out, int num_threads, void* stream) {
  const ArgChecker check("vidattn::tile_mean_pool");
  tile_volume_ok(check, tile_volume);
  token_tensor(check, x, "x");
  if (x.shape[1] % tile_volume != 0)
    check.fail("argument 'x' has ", x.shape[1], " tokens, not a multiple of the tile volume ",
               tile_volume, " (pass tensors in the tiled layout)");
  const std::int64_t tiles = x.shape[1] / tile_volume;
  int32_vector(check, block_sizes, "block_sizes", tiles, x.device, "one per tile of x");
  shape_is(check, out, "out", {x.shape[0], tiles, x.shape[2], x.shape[3]}, "[B, Tiles, H, D]");
  check.dtype(out, "out", x.dtype);
  check.same_device(out, "out", x.device);
  check.unit_last_stride(out, "out");
  check.non_null(out, "out");
  if (on_cpu(x)) return detail::cpu_tile_mean_pool(x, block_sizes, tile_volume, out, num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_tile_mean_pool(x, block_sizes, tile_volume, out, stream);
#else
  (void)stream;
  no_cuda(check.function());
#endif
}

void tile_mean_pool_backward(const TensorView& grad_out, const TensorView& block_sizes,
                             std::int64_t tile_volume, const TensorView& grad_x,
                             int num_threads, void* stream) {
  const ArgChecker check("vidattn::tile_mean_pool_backward");
  tile_volume_ok(check, tile_volume);
  token_tensor(check, grad_out, "grad_out");
  const std::int64_t tiles = grad_out.shape[1];
  int32_vector(check, block_sizes, "block_sizes", tiles, grad_out.device, "one per tile");
  shape_is(check, grad_x, "grad_x",
           {grad_out.shape[0], tiles * tile_volume, grad_out.shape[2], grad_out.shape[3]},
           "[B, Tiles * V, H, D]");
  check.dtype(grad_x, "grad_x", grad_out.dtype);
  check.same_device(grad_x, "grad_x", grad_out.device);
  check.unit_last_stride(grad_x, "grad_x");
  check.non_null(grad_x, "grad_x");
  if (on_cpu(grad_out))
    return detail::cpu_tile_mean_pool_backward(grad_out, block_sizes, tile_volume, grad_x,
                                               num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_tile_mean_pool_backward(grad_out, block_sizes, tile_volume, grad_x, stream);
#else
  (void)stream;
  no_cuda(check.function());
#endif
}

std::int64_t topk_from_sparsity(double sparsity, std::int64_t num_kv_tiles) {
  const ArgChecker check("vidattn::topk_from_sparsity");
  if (!(sparsity >= 0.0 && sparsity <= 1.0))
    check.fail("sparsity must be in [0, 1], got ", sparsity);
  if (num_kv_tiles < 1) check.fail("num_kv_tiles must be >= 1, got ", num_kv_tiles);
  // A tiny slack keeps (1 - 0.9) * 10 from rounding up to 2.
  const double kept = std::ceil((1.0 - sparsity) * double(num_kv_tiles) - 1e-9);
  return std::clamp<std::int64_t>(static_cast<std::int64_t>(kept), 1, num_kv_tiles);
}

std::int64_t topk_max_k(std::int64_t topk, std::int64_t num_kv_tiles) {
  return std::max<std::int64_t>(std::min(topk, num_kv_tiles), 0);
}

namespace {

void check_index_outputs(const ArgChecker& check, const TensorView& q2k_index,
                         const TensorView& q2k_count, std::int64_t B, std::int64_t H,
                         std::int64_t Qt, std::int64_t max_k, Device device) {
  shape_is(check, q2k_index, "q2k_index", {B, H, Qt, max_k}, "[B, H, Qtiles, MaxK]");
  check.dtype(q2k_index, "q2k_index", DType::kInt32);
  check.same_device(q2k_index, "q2k_index", device);
  check.non_null(q2k_index, "q2k_index");
  shape_is(check, q2k_count, "q2k_count", {B, H, Qt}, "[B, H, Qtiles]");
  check.dtype(q2k_count, "q2k_count", DType::kInt32);
  check.same_device(q2k_count, "q2k_count", device);
  check.non_null(q2k_count, "q2k_count");
}

}  // namespace

void select_topk_tiles(const TensorView& q_pooled, const TensorView& k_pooled,
                       const TopkOptions& o, const TensorView& q2k_index,
                       const TensorView& q2k_count) {
  const ArgChecker check("vidattn::select_topk_tiles");
  token_tensor(check, q_pooled, "q_pooled");
  token_tensor(check, k_pooled, "k_pooled");
  check.dtype(k_pooled, "k_pooled", q_pooled.dtype);
  check.same_device(k_pooled, "k_pooled", q_pooled.device);
  const std::int64_t B = q_pooled.shape[0], Qt = q_pooled.shape[1], Hq = q_pooled.shape[2];
  const std::int64_t Kt = k_pooled.shape[1], Hkv = k_pooled.shape[2];
  check.dim_equals(k_pooled, "k_pooled", 0, B, "the batch of q_pooled");
  check.dim_equals(k_pooled, "k_pooled", 3, q_pooled.shape[3], "the head dim of q_pooled");
  if (Hkv < 1 || Hq % Hkv != 0)
    check.fail("the heads of q_pooled (", Hq, ") must be a multiple of those of k_pooled (", Hkv,
               ")");
  if (o.topk < 1) check.fail("topk must be >= 1, got ", o.topk);
  if (o.sparsity && !(*o.sparsity >= 0.0 && *o.sparsity <= 1.0))
    check.fail("sparsity must be in [0, 1], got ", *o.sparsity);
  if (o.cu_tiles_q.has_value() != o.cu_tiles_k.has_value())
    check.fail("packed videos need both 'cu_tiles_q' and 'cu_tiles_k'");
  if (o.cu_tiles_q) {
    if (B != 1) check.fail("packed videos need batch 1, got B = ", B);
    check.ndim(*o.cu_tiles_q, "cu_tiles_q", 1, "[N + 1]");
    const std::int64_t n1 = o.cu_tiles_q->shape[0];
    if (n1 < 1) check.fail("argument 'cu_tiles_q' must hold at least one offset");
    int32_vector(check, *o.cu_tiles_q, "cu_tiles_q", n1, q_pooled.device, "[N + 1]");
    int32_vector(check, *o.cu_tiles_k, "cu_tiles_k", n1, q_pooled.device,
                 "the length of cu_tiles_q");
  }
  check_index_outputs(check, q2k_index, q2k_count, B, Hq, Qt, topk_max_k(o.topk, Kt),
                      q_pooled.device);
  const double scale =
      o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(q_pooled.shape[3]));
  if (!std::isfinite(scale)) check.fail("argument 'scale' must be finite, got ", scale);
  if (on_cpu(q_pooled))
    return detail::cpu_select_topk_tiles(q_pooled, k_pooled, o, scale, q2k_index, q2k_count);
#if VIDATTN_WITH_CUDA
  detail::cuda_select_topk_tiles(q_pooled, k_pooled, o, scale, q2k_index, q2k_count);
#else
  no_cuda(check.function());
#endif
}

void topk_tiles_from_scores(const TensorView& scores, std::int64_t topk,
                            const TensorView& q2k_index, const TensorView& q2k_count,
                            int num_threads, void* stream) {
  const ArgChecker check("vidattn::topk_tiles_from_scores");
  check.ndim(scores, "scores", 4, "[B, H, Qtiles, Ktiles]");
  float_dtype(check, scores, "scores");
  check.unit_last_stride(scores, "scores");
  check.non_null(scores, "scores");
  if (topk < 1) check.fail("topk must be >= 1, got ", topk);
  check_index_outputs(check, q2k_index, q2k_count, scores.shape[0], scores.shape[1],
                      scores.shape[2], topk_max_k(topk, scores.shape[3]), scores.device);
  if (on_cpu(scores))
    return detail::cpu_topk_tiles_from_scores(scores, topk, q2k_index, q2k_count, num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_topk_tiles_from_scores(scores, topk, q2k_index, q2k_count, stream);
#else
  (void)stream;
  no_cuda(check.function());
#endif
}

// ---- block-sparse attention ---------------------------------------------------------

namespace {

BlockSparseProblem describe_sparse(const char* fn, const TensorView& q, const TensorView& k,
                                   const TensorView& v, const TensorView& q2k_index,
                                   const TensorView& q2k_count, const BlockSparseOptions& o) {
  const ArgChecker check(fn);
  BlockSparseProblem p;
  tile_volume_ok(check, o.tile_volume);
  if (o.sm_margin < 0) check.fail("argument 'sm_margin' must be >= 0, got ", o.sm_margin);
  check.ndim(q, "q", 4, "[B, Sq, Hq, D]");
  check.ndim(k, "k", 4, "[B, Sk, Hkv, D]");
  check.ndim(v, "v", 4, "[B, Sk, Hkv, Dv]");
  float_dtype(check, q, "q");
  check.dtype(k, "k", q.dtype);
  check.dtype(v, "v", q.dtype);
  check.same_device(k, "k", q.device);
  check.same_device(v, "v", q.device);
  for (auto [t, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check.unit_last_stride(*t, name);
  p.batch = q.shape[0];
  p.seqlen_q = q.shape[1];
  p.seqlen_k = k.shape[1];
  p.heads_q = q.shape[2];
  p.heads_kv = k.shape[2];
  p.head_dim = q.shape[3];
  p.head_dim_v = v.shape[3];
  p.tile_volume = o.tile_volume;
  check.dim_equals(k, "k", 0, p.batch, "the batch of q");
  check.dim_equals(v, "v", 0, p.batch, "the batch of q");
  check.dim_equals(k, "k", 3, p.head_dim, "the head dim D of q");
  check.dim_equals(v, "v", 1, p.seqlen_k, "the sequence length of k");
  check.dim_equals(v, "v", 2, p.heads_kv, "the number of heads of k");
  if (p.heads_kv < 1 || p.heads_q < 1 || p.heads_q % p.heads_kv != 0)
    check.fail("the number of q heads (", p.heads_q,
               ") must be a positive multiple of the number of k/v heads (", p.heads_kv, ")");
  if (p.head_dim < 1 || p.head_dim_v < 1)
    check.fail("head dims must be at least 1, got D = ", p.head_dim, ", Dv = ", p.head_dim_v);
  if (p.seqlen_q % o.tile_volume != 0 || p.seqlen_k % o.tile_volume != 0)
    check.fail("q and k lengths (", p.seqlen_q, ", ", p.seqlen_k,
               ") must be multiples of the tile volume ", o.tile_volume,
               " (pass tensors in the tiled layout)");
  p.q_tiles = p.seqlen_q / o.tile_volume;
  p.kv_tiles = p.seqlen_k / o.tile_volume;

  check.ndim(q2k_index, "q2k_index", 4, "[B, Hq, Qtiles, MaxK]");
  check.dtype(q2k_index, "q2k_index", DType::kInt32);
  check.same_device(q2k_index, "q2k_index", q.device);
  check.dim_equals(q2k_index, "q2k_index", 0, p.batch, "the batch B");
  check.dim_equals(q2k_index, "q2k_index", 1, p.heads_q, "the q heads Hq");
  check.dim_equals(q2k_index, "q2k_index", 2, p.q_tiles, "the query tiles Sq / tile_volume");
  p.max_k = q2k_index.shape[3];
  shape_is(check, q2k_count, "q2k_count", {p.batch, p.heads_q, p.q_tiles}, "[B, Hq, Qtiles]");
  check.dtype(q2k_count, "q2k_count", DType::kInt32);
  check.same_device(q2k_count, "q2k_count", q.device);
  if (o.q_block_sizes)
    int32_vector(check, *o.q_block_sizes, "q_block_sizes", p.q_tiles, q.device,
                 "one per query tile", false);
  if (o.kv_block_sizes)
    int32_vector(check, *o.kv_block_sizes, "kv_block_sizes", p.kv_tiles, q.device,
                 "one per key tile", false);

  p.scale = o.scale ? *o.scale : 1.0 / std::sqrt(static_cast<double>(p.head_dim));
  if (!std::isfinite(p.scale)) check.fail("argument 'scale' must be finite, got ", p.scale);
  if (o.num_threads < 0) check.fail("num_threads must be >= 0, got ", o.num_threads);
  p.dtype = q.dtype;
  p.lse_dtype = q.dtype == DType::kFloat64 ? DType::kFloat64 : DType::kFloat32;
  p.device = q.device;
  return p;
}

void check_sparse_data(const ArgChecker& check, const TensorView& q, const TensorView& k,
                       const TensorView& v, const TensorView& q2k_index,
                       const TensorView& q2k_count, const BlockSparseOptions& o) {
  if (o.q_block_sizes) check.non_null(*o.q_block_sizes, "q_block_sizes");
  if (o.kv_block_sizes) check.non_null(*o.kv_block_sizes, "kv_block_sizes");
  check.non_null(q, "q");
  check.non_null(k, "k");
  check.non_null(v, "v");
  check.non_null(q2k_index, "q2k_index");
  check.non_null(q2k_count, "q2k_count");
}

void check_like(const ArgChecker& check, const TensorView& t, const char* name,
                std::initializer_list<std::int64_t> shape, DType dtype, Device device) {
  shape_is(check, t, name, shape, "");
  check.dtype(t, name, dtype);
  check.same_device(t, name, device);
  check.unit_last_stride(t, name);
  check.non_null(t, name);
}

}  // namespace

BlockSparseProblem describe_block_sparse_attention(const TensorView& q, const TensorView& k,
                                                   const TensorView& v,
                                                   const TensorView& q2k_index,
                                                   const TensorView& q2k_count,
                                                   const BlockSparseOptions& options) {
  return describe_sparse("vidattn::describe_block_sparse_attention", q, k, v, q2k_index,
                         q2k_count, options);
}

namespace {
// out and lse of a block-sparse call: the forward's outputs, the backward's inputs.
void check_sparse_outputs(const ArgChecker& check, const BlockSparseProblem& p,
                          const TensorView& out, const TensorView& lse) {
  check_like(check, out, "out", {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, p.dtype,
             p.device);
  check_like(check, lse, "lse", {p.batch, p.heads_q, p.seqlen_q}, p.lse_dtype, p.device);
}
}  // namespace

void block_sparse_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const TensorView& q2k_index, const TensorView& q2k_count,
                                    const TensorView& out, const TensorView& lse,
                                    const BlockSparseOptions& options) {
  constexpr const char* kFn = "vidattn::block_sparse_attention_forward";
  const ArgChecker check(kFn);
  const BlockSparseProblem p = describe_sparse(kFn, q, k, v, q2k_index, q2k_count, options);
  check_sparse_data(check, q, k, v, q2k_index, q2k_count, options);
  check_sparse_outputs(check, p, out, lse);
  if (p.device.kind != DeviceKind::kCPU) {
#ifdef VIDATTN_WITH_CUDA
    detail::cuda_block_sparse_forward(p, q, k, v, q2k_index, q2k_count, out, lse, options);
    return;
#else
    no_cuda(kFn);
#endif
  }
  detail::cpu_block_sparse_forward(p, q, k, v, q2k_index, q2k_count, out, lse, options);
}

void vsa_fine_combine_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& q2k_index, const TensorView& q2k_count,
                              const TensorView& coarse, const std::optional<TensorView>& gate,
                              const TensorView& fine, const TensorView& lse,
                              const TensorView& out, const BlockSparseOptions& options) {
  constexpr const char* kFn = "vidattn::vsa_fine_combine_forward";
  const ArgChecker check(kFn);
  if (!options.q_block_sizes)
    check.fail("options.q_block_sizes is required: the combination's tile sizes");
  const BlockSparseProblem p = describe_sparse(kFn, q, k, v, q2k_index, q2k_count, options);
  check_sparse_data(check, q, k, v, q2k_index, q2k_count, options);
  check_sparse_outputs(check, p, fine, lse);
  detail::check_vsa_combine_arguments(kFn, fine, coarse, gate, *options.q_block_sizes,
                                      options.tile_volume, out);
  if (p.device.kind != DeviceKind::kCPU) {
#ifdef VIDATTN_WITH_CUDA
    const detail::CombineViews views{&coarse, gate ? &*gate : nullptr, &out};
    if (detail::cuda_block_sparse_forward(p, q, k, v, q2k_index, q2k_count, fine, lse, options,
                                          &views))
      return;
#else
    no_cuda(kFn);
#endif
  } else {
    detail::cpu_block_sparse_forward(p, q, k, v, q2k_index, q2k_count, fine, lse, options);
  }
  vsa_combine(fine, coarse, gate, *options.q_block_sizes, options.tile_volume, out,
              options.num_threads, options.stream);
}

void block_sparse_transpose_index(const TensorView& q2k_index, const TensorView& q2k_count,
                                  std::int64_t num_kv_tiles, const TensorView& k2q_offsets,
                                  const TensorView& k2q_index, int num_threads, void* stream,
                                  bool validate_index) {
  const ArgChecker check("vidattn::block_sparse_transpose_index");
  check.ndim(q2k_index, "q2k_index", 4, "[B, Hq, Qtiles, MaxK]");
  check.dtype(q2k_index, "q2k_index", DType::kInt32);
  check.non_null(q2k_index, "q2k_index");
  const std::int64_t B = q2k_index.shape[0], H = q2k_index.shape[1], Qt = q2k_index.shape[2],
                     K = q2k_index.shape[3];
  const Device device = q2k_index.device;
  shape_is(check, q2k_count, "q2k_count", {B, H, Qt}, "[B, Hq, Qtiles]");
  check.dtype(q2k_count, "q2k_count", DType::kInt32);
  check.same_device(q2k_count, "q2k_count", device);
  check.non_null(q2k_count, "q2k_count");
  if (num_kv_tiles < 0) check.fail("num_kv_tiles must be >= 0, got ", num_kv_tiles);
  check_like(check, k2q_offsets, "k2q_offsets", {B, H, num_kv_tiles + 1}, DType::kInt32, device);
  check_like(check, k2q_index, "k2q_index", {B, H, Qt * K}, DType::kInt32, device);
  if (device.kind != DeviceKind::kCPU) {
#ifdef VIDATTN_WITH_CUDA
    return detail::cuda_block_sparse_transpose_index(q2k_index, q2k_count, num_kv_tiles,
                                                     k2q_offsets, k2q_index, stream,
                                                     validate_index);
#else
    (void)stream, (void)validate_index;
    no_cuda(check.function());
#endif
  }
  detail::cpu_block_sparse_transpose_index(q2k_index, q2k_count, num_kv_tiles, k2q_offsets,
                                           k2q_index, num_threads);
}

void block_sparse_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& out, const TensorView& lse,
                                     const TensorView& grad_out, const TensorView& q2k_index,
                                     const TensorView& q2k_count, const TensorView& k2q_offsets,
                                     const TensorView& k2q_index, const TensorView& dq,
                                     const TensorView& dk, const TensorView& dv,
                                     const BlockSparseOptions& options) {
  constexpr const char* kFn = "vidattn::block_sparse_attention_backward";
  const ArgChecker check(kFn);
  const BlockSparseProblem p = describe_sparse(kFn, q, k, v, q2k_index, q2k_count, options);
  check_sparse_data(check, q, k, v, q2k_index, q2k_count, options);
  check_sparse_outputs(check, p, out, lse);
  check_like(check, grad_out, "grad_out", {p.batch, p.seqlen_q, p.heads_q, p.head_dim_v},
             p.dtype, p.device);
  check_like(check, k2q_offsets, "k2q_offsets", {p.batch, p.heads_q, p.kv_tiles + 1},
             DType::kInt32, p.device);
  check_like(check, k2q_index, "k2q_index", {p.batch, p.heads_q, p.q_tiles * p.max_k},
             DType::kInt32, p.device);
  check_like(check, dq, "dq", {q.shape[0], q.shape[1], q.shape[2], q.shape[3]}, p.dtype, p.device);
  check_like(check, dk, "dk", {k.shape[0], k.shape[1], k.shape[2], k.shape[3]}, p.dtype, p.device);
  check_like(check, dv, "dv", {v.shape[0], v.shape[1], v.shape[2], v.shape[3]}, p.dtype, p.device);
  if (p.device.kind != DeviceKind::kCPU) {
#ifdef VIDATTN_WITH_CUDA
    return detail::cuda_block_sparse_backward(p, q, k, v, out, lse, grad_out, q2k_index,
                                              q2k_count, k2q_offsets, k2q_index, dq, dk, dv,
                                              options);
#else
    no_cuda(kFn);
#endif
  }
  detail::cpu_block_sparse_backward(p, q, k, v, out, lse, grad_out, q2k_index, q2k_count,
                                    k2q_offsets, k2q_index, dq, dk, dv, options);
}

}  // namespace vidattn
