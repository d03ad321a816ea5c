// The VSA PyTorch ops: schemas (defined here, once), CPU and Meta kernels, and autograd on
// the differentiable ones (tile/untile gathers, tile pooling, block-sparse attention). The
// kernels allocate outputs and call the torch-free C++ API in vidattn/vsa.h.
#include <ATen/ATen.h>
#include <ATen/DeviceGuard.h>
#include <ATen/Parallel.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <torch/autograd.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "tensor_adapter.h"
#include "vidattn/vsa.h"

namespace vidattn::torch_ops {
namespace {

using at::Tensor;
using OptTensor = std::optional<Tensor>;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

int threads() { return at::get_num_threads(); }

Tensor int32_empty(c10::SymIntArrayRef shape, const Tensor& like) {
  return at::empty_symint(shape, like.options().dtype(at::kInt));
}

at::ScalarType lse_scalar_type(const Tensor& q) {
  return q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

// ---- tiling metadata (host ints in, int32 tensors out) --------------------------------

TilingLayout layout_of(c10::IntArrayRef grids, c10::IntArrayRef tile, const char* fn) {
  TORCH_CHECK_VALUE(tile.size() == 3, fn, ": 'tile' must be (t, h, w), got ", tile.size(),
                    " values");
  TORCH_CHECK_VALUE(!grids.empty() && grids.size() % 3 == 0, fn,
                    ": 'grids' must hold (T, H, W) of each video back to back, got ",
                    grids.size(), " values");
  std::vector<VideoGrid> g;
  for (std::size_t i = 0; i < grids.size(); i += 3) g.push_back({grids[i], grids[i + 1], grids[i + 2]});
  return translate_errors([&] { return describe_tiling(g, {tile[0], tile[1], tile[2]}); });
}

// All metadata in one int32 tensor, so that the op is a plain tensor constructor (fake
// tensor mode then runs it with device=meta): [cu_tiles (N + 1) | cu_tokens (N + 1) |
// block_sizes (num_tiles) | slot_to_token (padded_len) | token_to_slot (num_tokens)].
Tensor tiling_metadata_kernel(c10::IntArrayRef grids, c10::IntArrayRef tile,
                              std::optional<at::Device> device) {
  constexpr const char* fn = "vidattn.vsa_tiling_metadata";
  const TilingLayout layout = layout_of(grids, tile, fn);
  const auto n = static_cast<int64_t>(layout.grids.size());
  const int64_t total = 2 * (n + 1) + layout.num_tiles + layout.padded_len() + layout.num_tokens;
  if (device && device->is_meta()) return at::empty({total}, at::TensorOptions().dtype(at::kInt).device(*device));
  Tensor all = at::empty({total}, at::TensorOptions().dtype(at::kInt));
  int64_t at_ = 0;
  auto part = [&](int64_t len) {
    Tensor t = all.narrow(0, at_, len);
    at_ += len;
    return t;
  };
  Tensor cu_tiles = part(n + 1), cu_tokens = part(n + 1), sizes = part(layout.num_tiles),
         s2t = part(layout.padded_len()), t2s = part(layout.num_tokens);
  translate_errors([&] {
    tiling_metadata(layout, view_of(sizes, fn, "block_sizes"), view_of(s2t, fn, "slot_to_token"),
                    view_of(t2s, fn, "token_to_slot"), view_of(cu_tiles, fn, "cu_tiles"),
                    view_of(cu_tokens, fn, "cu_tokens"));
  });
  return device ? all.to(*device) : all;
}

// ---- gather_tokens: tile / untile -------------------------------------------------------

// The checks gather_tokens' kernels share (the real one adds the length of inverse_index):
// one device, then x 4-D before any of its dimensions is read by position.
void check_gather_args(const char* fn, const Tensor& x, const Tensor& index,
                       const Tensor& inverse_index) {
  check_same_device(fn, {{"x", x}, {"index", index}, {"inverse_index", inverse_index}});
  TORCH_CHECK_VALUE(x.dim() == 4, fn, ": argument 'x' must be 4-D [B, S, H, D], got a ", x.dim(),
                    "-D tensor of shape ", x.sym_sizes());
  TORCH_CHECK_VALUE(index.dim() == 1 && inverse_index.dim() == 1, fn,
                    ": 'index' and 'inverse_index' must be 1-D, got ", index.dim(), "-D and ",
                    inverse_index.dim(), "-D");
  require_int32(index, fn, "index");
  require_int32(inverse_index, fn, "inverse_index");
}

Tensor gather_tokens_kernel(const Tensor& x, const Tensor& index, const Tensor& inverse_index) {
  constexpr const char* fn = "vidattn.gather_tokens";
  check_gather_args(fn, x, index, inverse_index);
  const at::OptionalDeviceGuard device_guard(at::device_of(x));  // run on the inputs' device
  return translate_errors([&] {
    const TensorView xv = view_of(x, fn, "x");
    TORCH_CHECK_VALUE(inverse_index.size(0) == x.size(1), fn,
                      ": argument 'inverse_index' must have one entry per token of x (",
                      x.size(1), ", x's dimension 1 of [B, S, H, D]), got shape ",
                      inverse_index.sizes(), "; the tiling does not match the tensor's length");
    Tensor out = at::empty({x.size(0), index.size(0), x.size(2), x.size(3)}, x.options());
    gather_tokens(xv, view_of(index, fn, "index"), view_of(out, fn, "out"), threads(),
                  stream_of(x));
    return out;
  });
}

Tensor gather_tokens_meta(const Tensor& x, const Tensor& index, const Tensor& inverse_index) {
  check_gather_args("vidattn.gather_tokens", x, index, inverse_index);
  return at::empty_symint({x.sym_size(0), index.sym_size(0), x.sym_size(2), x.sym_size(3)},
                          x.options());
}

class GatherTokensFunction : public torch::autograd::Function<GatherTokensFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& index,
                        const Tensor& inverse_index) {
    static auto op = find_op<decltype(gather_tokens_kernel)>("vidattn::gather_tokens");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({index, inverse_index});
    return op.call(x, index, inverse_index);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op = find_op<decltype(gather_tokens_kernel)>("vidattn::gather_tokens");
    const auto saved = ctx->get_saved_variables();
    const Tensor grad = unit_stride_grad(grads[0]);
    // index and inverse_index are inverse partial permutations: the gather's transpose is the
    // gather with the two swapped (slots that hold padding receive no gradient).
    return {op.call(grad, saved[1], saved[0]), Tensor(), Tensor()};
  }
};

Tensor gather_tokens_autograd(const Tensor& x, const Tensor& index, const Tensor& inverse_index) {
  return GatherTokensFunction::apply(x, index, inverse_index);
}

// ---- tile_mean_pool ---------------------------------------------------------------------

Tensor tile_mean_pool_kernel(const Tensor& x, const Tensor& block_sizes, int64_t tile_volume) {
  constexpr const char* fn = "vidattn.tile_mean_pool";
  check_same_device(fn, {{"x", x}, {"block_sizes", block_sizes}});
  const at::OptionalDeviceGuard device_guard(at::device_of(x));  // run on the inputs' device
  require_int32(block_sizes, fn, "block_sizes");
  return translate_errors([&] {
    const TensorView xv = view_of(x, fn, "x");
    TORCH_CHECK_VALUE(x.dim() == 4, fn, ": argument 'x' must be 4-D [B, S, H, D], got ", x.dim(), "-D");
    TORCH_CHECK_VALUE(is_supported_tile_volume(tile_volume), fn,
                      ": tile volume must be 64, 128 or 256, got ", tile_volume);
    Tensor out = at::empty({x.size(0), x.size(1) / tile_volume, x.size(2), x.size(3)}, x.options());
    tile_mean_pool(xv, view_of(block_sizes, fn, "block_sizes"), tile_volume,
                   view_of(out, fn, "out"), threads(), stream_of(x));
    return out;
  });
}

Tensor tile_mean_pool_meta(const Tensor& x, const Tensor& block_sizes, int64_t tile_volume) {
  constexpr const char* fn = "vidattn.tile_mean_pool";
  check_same_device(fn, {{"x", x}, {"block_sizes", block_sizes}});
  require_int32(block_sizes, fn, "block_sizes");
  TORCH_CHECK_VALUE(x.dim() == 4, fn, ": argument 'x' must be 4-D [B, S, H, D], got ", x.dim(), "-D");
  TORCH_CHECK_VALUE(is_supported_tile_volume(tile_volume), fn,
                    ": tile volume must be 64, 128 or 256, got ", tile_volume);
  return at::empty_symint({x.sym_size(0), x.sym_size(1) / tile_volume, x.sym_size(2), x.sym_size(3)},
                          x.options());
}

Tensor tile_mean_pool_backward_kernel(const Tensor& grad_out, const Tensor& block_sizes,
                                      int64_t tile_volume) {
  constexpr const char* fn = "vidattn.tile_mean_pool_backward";
  check_same_device(fn, {{"grad_out", grad_out}, {"block_sizes", block_sizes}});
  const at::OptionalDeviceGuard device_guard(at::device_of(grad_out));  // run on the inputs' device
  require_int32(block_sizes, fn, "block_sizes");
  return translate_errors([&] {
    const TensorView gv = view_of(grad_out, fn, "grad_out");
    TORCH_CHECK_VALUE(grad_out.dim() == 4, fn, ": argument 'grad_out' must be 4-D");
    Tensor gx = at::empty({grad_out.size(0), grad_out.size(1) * tile_volume, grad_out.size(2),
                           grad_out.size(3)},
                          grad_out.options());
    tile_mean_pool_backward(gv, view_of(block_sizes, fn, "block_sizes"), tile_volume,
                            view_of(gx, fn, "grad_x"), threads(), stream_of(grad_out));
    return gx;
  });
}

Tensor tile_mean_pool_backward_meta(const Tensor& grad_out, const Tensor& block_sizes,
                                    int64_t tile_volume) {
  check_same_device("vidattn.tile_mean_pool_backward",
                    {{"grad_out", grad_out}, {"block_sizes", block_sizes}});
  TORCH_CHECK_VALUE(grad_out.dim() == 4, "vidattn.tile_mean_pool_backward: 'grad_out' must be 4-D");
  return at::empty_symint({grad_out.sym_size(0), grad_out.sym_size(1) * tile_volume,
                           grad_out.sym_size(2), grad_out.sym_size(3)},
                          grad_out.options());
}

class TileMeanPoolFunction : public torch::autograd::Function<TileMeanPoolFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& block_sizes,
                        int64_t tile_volume) {
    static auto op = find_op<decltype(tile_mean_pool_kernel)>("vidattn::tile_mean_pool");
    at::AutoDispatchBelowADInplaceOrView guard;
    ctx->save_for_backward({block_sizes});
    ctx->saved_data["tile_volume"] = tile_volume;
    return op.call(x, block_sizes, tile_volume);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto op =
        find_op<decltype(tile_mean_pool_backward_kernel)>("vidattn::tile_mean_pool_backward");
    const Tensor grad = unit_stride_grad(grads[0]);
    return {op.call(grad, ctx->get_saved_variables()[0], ctx->saved_data["tile_volume"].toInt()),
            Tensor(), Tensor()};
  }
};

Tensor tile_mean_pool_autograd(const Tensor& x, const Tensor& block_sizes, int64_t tile_volume) {
  return TileMeanPoolFunction::apply(x, block_sizes, tile_volume);
}

// ---- top-k selection --------------------------------------------------------------------

void check_topk_devices(const char* fn, const Tensor& q_pooled, const Tensor& k_pooled,
                        const OptTensor& cu_tiles_q, const OptTensor& cu_tiles_k) {
  check_same_device(fn, {{"q_pooled", q_pooled},
                         {"k_pooled", k_pooled},
                         {"cu_tiles_q", cu_tiles_q},
                         {"cu_tiles_k", cu_tiles_k}});
}

std::tuple<Tensor, Tensor> topk_tiles_kernel(const Tensor& q_pooled, const Tensor& k_pooled,
                                             int64_t topk, std::optional<double> sparsity,
                                             std::optional<double> scale,
                                             const OptTensor& cu_tiles_q,
                                             const OptTensor& cu_tiles_k) {
  constexpr const char* fn = "vidattn.topk_tiles";
  check_topk_devices(fn, q_pooled, k_pooled, cu_tiles_q, cu_tiles_k);
  const at::OptionalDeviceGuard device_guard(at::device_of(q_pooled));  // run on the inputs' device
  require_int32(cu_tiles_q, fn, "cu_tiles_q");
  require_int32(cu_tiles_k, fn, "cu_tiles_k");
  return translate_errors([&] {
    TORCH_CHECK_VALUE(q_pooled.dim() == 4 && k_pooled.dim() == 4, fn,
                      ": q_pooled and k_pooled must be 4-D [B, Tiles, H, D]");
    TORCH_CHECK_VALUE(topk >= 1, fn, ": topk must be >= 1, got ", topk);
    TopkOptions o;
    o.topk = topk;
    o.sparsity = sparsity;
    o.scale = scale;
    o.cu_tiles_q = view_of(cu_tiles_q, fn, "cu_tiles_q");
    o.cu_tiles_k = view_of(cu_tiles_k, fn, "cu_tiles_k");
    o.num_threads = threads();
    o.stream = stream_of(q_pooled);
    const int64_t B = q_pooled.size(0), Qt = q_pooled.size(1), H = q_pooled.size(2);
    Tensor index = at::empty({B, H, Qt, topk_max_k(topk, k_pooled.size(1))},
                             q_pooled.options().dtype(at::kInt));
    Tensor count = at::empty({B, H, Qt}, q_pooled.options().dtype(at::kInt));
    select_topk_tiles(view_of(q_pooled, fn, "q_pooled"), view_of(k_pooled, fn, "k_pooled"), o,
                      view_of(index, fn, "q2k_index"), view_of(count, fn, "q2k_count"));
    return std::make_tuple(index, count);
  });
}

std::tuple<Tensor, Tensor> topk_tiles_meta(const Tensor& q_pooled, const Tensor& k_pooled,
                                           int64_t topk, std::optional<double>,
                                           std::optional<double>, const OptTensor& cu_tiles_q,
                                           const OptTensor& cu_tiles_k) {
  constexpr const char* fn = "vidattn.topk_tiles";
  check_topk_devices(fn, q_pooled, k_pooled, cu_tiles_q, cu_tiles_k);
  TORCH_CHECK_VALUE(q_pooled.dim() == 4 && k_pooled.dim() == 4, fn,
                    ": q_pooled and k_pooled must be 4-D [B, Tiles, H, D]");
  TORCH_CHECK_VALUE(topk >= 1, fn, ": topk must be >= 1, got ", topk);
  const c10::SymInt max_k = k_pooled.sym_size(1).min(c10::SymInt(topk));
  return std::make_tuple(
      int32_empty({q_pooled.sym_size(0), q_pooled.sym_size(2), q_pooled.sym_size(1), max_k}, q_pooled),
      int32_empty({q_pooled.sym_size(0), q_pooled.sym_size(2), q_pooled.sym_size(1)}, q_pooled));
}

std::tuple<Tensor, Tensor> topk_tiles_from_scores_kernel(const Tensor& scores, int64_t topk) {
  constexpr const char* fn = "vidattn.topk_tiles_from_scores";
  check_same_device(fn, {{"scores", scores}});
  const at::OptionalDeviceGuard device_guard(at::device_of(scores));  // run on the inputs' device
  return translate_errors([&] {
    TORCH_CHECK_VALUE(scores.dim() == 4, fn, ": 'scores' must be 4-D [B, H, Qtiles, Ktiles], got ",
                      scores.dim(), "-D");
    TORCH_CHECK_VALUE(topk >= 1, fn, ": topk must be >= 1, got ", topk);
    const auto s = scores.sizes();
    Tensor index = at::empty({s[0], s[1], s[2], topk_max_k(topk, s[3])},
                             scores.options().dtype(at::kInt));
    Tensor count = at::empty({s[0], s[1], s[2]}, scores.options().dtype(at::kInt));
    topk_tiles_from_scores(view_of(scores, fn, "scores"), topk, view_of(index, fn, "q2k_index"),
                           view_of(count, fn, "q2k_count"), threads(), stream_of(scores));
    return std::make_tuple(index, count);
  });
}

std::tuple<Tensor, Tensor> topk_tiles_from_scores_meta(const Tensor& scores, int64_t topk) {
  constexpr const char* fn = "vidattn.topk_tiles_from_scores";
  check_same_device(fn, {{"scores", scores}});
  TORCH_CHECK_VALUE(scores.dim() == 4, fn, ": 'scores' must be 4-D [B, H, Qtiles, Ktiles]");
  TORCH_CHECK_VALUE(topk >= 1, fn, ": topk must be >= 1, got ", topk);
  const c10::SymInt max_k = scores.sym_size(3).min(c10::SymInt(topk));
  return std::make_tuple(
      int32_empty({scores.sym_size(0), scores.sym_size(1), scores.sym_size(2), max_k}, scores),
      int32_empty({scores.sym_size(0), scores.sym_size(1), scores.sym_size(2)}, scores));
}

// ---- block-sparse attention ---------------------------------------------------------------

struct SparseArgs {
  int64_t tile_volume = 64;
  OptTensor q_block_sizes, kv_block_sizes;
  std::optional<double> scale;
  bool deterministic = true;
  bool validate_index = true;
  int64_t sm_margin = 0;
};

BlockSparseOptions options_of(const SparseArgs& a, const char* fn, const Tensor& q) {
  BlockSparseOptions o;
  o.stream = stream_of(q);
  o.tile_volume = a.tile_volume;
  o.q_block_sizes = view_of(a.q_block_sizes, fn, "q_block_sizes");
  o.kv_block_sizes = view_of(a.kv_block_sizes, fn, "kv_block_sizes");
  o.scale = a.scale;
  o.deterministic = a.deterministic;
  o.validate_index = a.validate_index;
  o.sm_margin = static_cast<int>(std::clamp<int64_t>(a.sm_margin, -1, 1 << 20));
  o.num_threads = threads();
  return o;
}

// check_same_device over a block-sparse forward's tensors (and the fused combination's).
void check_sparse_devices(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v,
                          const Tensor& q2k_index, const Tensor& q2k_count,
                          const OptTensor& q_block_sizes, const OptTensor& kv_block_sizes,
                          const OptTensor& coarse = {}, const OptTensor& gate = {}) {
  check_same_device(fn, {{"q", q},
                         {"k", k},
                         {"v", v},
                         {"q2k_index", q2k_index},
                         {"q2k_count", q2k_count},
                         {"q_block_sizes", q_block_sizes},
                         {"kv_block_sizes", kv_block_sizes},
                         {"coarse", coarse},
                         {"gate", gate}});
}

// The index and block-size tensors of the block-sparse ops: int32 (checked before any view).
void require_sparse_int32(const char* fn, const Tensor& q2k_index, const Tensor& q2k_count,
                          const OptTensor& q_block_sizes, const OptTensor& kv_block_sizes) {
  require_int32(q2k_index, fn, "q2k_index");
  require_int32(q2k_count, fn, "q2k_count");
  require_int32(q_block_sizes, fn, "q_block_sizes");
  require_int32(kv_block_sizes, fn, "kv_block_sizes");
}

// A block-sparse forward's inputs as views, its options, and its out / lse allocated.
struct SparseForward {
  TensorView q, k, v, index, count;
  BlockSparseOptions options;
  Tensor out, lse;
};

SparseForward sparse_forward(const char* fn, const Tensor& q, const Tensor& k, const Tensor& v,
                             const Tensor& q2k_index, const Tensor& q2k_count,
                             const SparseArgs& a) {
  SparseForward f{view_of(q, fn, "q"), view_of(k, fn, "k"), view_of(v, fn, "v"),
                  view_of(q2k_index, fn, "q2k_index"), view_of(q2k_count, fn, "q2k_count"),
                  options_of(a, fn, q), Tensor(), Tensor()};
  const BlockSparseProblem p =
      describe_block_sparse_attention(f.q, f.k, f.v, f.index, f.count, f.options);
  f.out = at::empty({p.batch, p.seqlen_q, p.heads_q, p.head_dim_v}, q.options());
  f.lse = at::empty({p.batch, p.heads_q, p.seqlen_q}, q.options().dtype(lse_scalar_type(q)));
  return f;
}

std::tuple<Tensor, Tensor> block_sparse_attention_kernel(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q2k_index,
    const Tensor& q2k_count, int64_t tile_volume, const OptTensor& q_block_sizes,
    const OptTensor& kv_block_sizes, std::optional<double> scale, bool deterministic,
    bool validate_index, int64_t sm_margin) {
  constexpr const char* fn = "vidattn.block_sparse_attention";
  check_sparse_devices(fn, q, k, v, q2k_index, q2k_count, q_block_sizes, kv_block_sizes);
  const at::OptionalDeviceGuard device_guard(at::device_of(q));  // run on the inputs' device
  require_sparse_int32(fn, q2k_index, q2k_count, q_block_sizes, kv_block_sizes);
  return translate_errors([&] {
    const SparseForward f = sparse_forward(
        fn, q, k, v, q2k_index, q2k_count,
        {tile_volume, q_block_sizes, kv_block_sizes, scale, deterministic, validate_index,
         sm_margin});
    block_sparse_attention_forward(f.q, f.k, f.v, f.index, f.count, view_of(f.out, fn, "out"),
                                   view_of(f.lse, fn, "lse"), f.options);
    return std::make_tuple(f.out, f.lse);
  });
}

std::tuple<Tensor, Tensor> block_sparse_attention_meta(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q2k_index,
    const Tensor& q2k_count, int64_t tile_volume, const OptTensor& q_block_sizes,
    const OptTensor& kv_block_sizes, std::optional<double> scale, bool deterministic,
    bool validate_index, int64_t sm_margin) {
  constexpr const char* fn = "vidattn.block_sparse_attention";
  check_sparse_devices(fn, q, k, v, q2k_index, q2k_count, q_block_sizes, kv_block_sizes);
  require_sparse_int32(fn, q2k_index, q2k_count, q_block_sizes, kv_block_sizes);
  TORCH_CHECK_VALUE(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, fn,
                    ": q, k and v must be 4-D [B, S, H, D], got ", q.dim(), "-D, ", k.dim(),
                    "-D and ", v.dim(), "-D");
  if (is_concrete(q) && is_concrete(k) && is_concrete(v) && is_concrete(q2k_index) &&
      is_concrete(q2k_count))
    translate_errors([&] {
      const SparseArgs a{tile_volume, q_block_sizes, kv_block_sizes, scale, deterministic,
                       validate_index, sm_margin};
      describe_block_sparse_attention(view_of(q, fn, "q"), view_of(k, fn, "k"), view_of(v, fn, "v"),
                                      view_of(q2k_index, fn, "q2k_index"),
                                      view_of(q2k_count, fn, "q2k_count"), options_of(a, fn, q));
    });
  // The output's head dim is v's.
  return std::make_tuple(
      at::empty_symint({q.sym_size(0), q.sym_size(1), q.sym_size(2), v.sym_size(3)}, q.options()),
      at::empty_symint({q.sym_size(0), q.sym_size(2), q.sym_size(1)},
                       q.options().dtype(lse_scalar_type(q))));
}

std::tuple<Tensor, Tensor> transpose_index_kernel(const Tensor& q2k_index, const Tensor& q2k_count,
                                                  int64_t num_kv_tiles, bool validate_index) {
  constexpr const char* fn = "vidattn.block_sparse_transpose_index";
  check_same_device(fn, {{"q2k_index", q2k_index}, {"q2k_count", q2k_count}});
  const at::OptionalDeviceGuard device_guard(at::device_of(q2k_index));  // run on the inputs' device
  require_int32(q2k_index, fn, "q2k_index");
  require_int32(q2k_count, fn, "q2k_count");
  return translate_errors([&] {
    TORCH_CHECK_VALUE(q2k_index.dim() == 4, fn, ": 'q2k_index' must be 4-D [B, Hq, Qtiles, MaxK]");
    TORCH_CHECK_VALUE(num_kv_tiles >= 0, fn, ": num_kv_tiles must be >= 0, got ", num_kv_tiles);
    const auto s = q2k_index.sizes();
    Tensor offsets = at::empty({s[0], s[1], num_kv_tiles + 1}, q2k_index.options());
    Tensor index = at::empty({s[0], s[1], s[2] * s[3]}, q2k_index.options());
    block_sparse_transpose_index(view_of(q2k_index, fn, "q2k_index"),
                                 view_of(q2k_count, fn, "q2k_count"), num_kv_tiles,
                                 view_of(offsets, fn, "k2q_offsets"), view_of(index, fn, "k2q_index"),
                                 threads(), stream_of(q2k_index), validate_index);
    return std::make_tuple(offsets, index);
  });
}

std::tuple<Tensor, Tensor> transpose_index_meta(const Tensor& q2k_index, const Tensor& q2k_count,
                                                int64_t num_kv_tiles, bool) {
  constexpr const char* fn = "vidattn.block_sparse_transpose_index";
  check_same_device(fn, {{"q2k_index", q2k_index}, {"q2k_count", q2k_count}});
  TORCH_CHECK_VALUE(q2k_index.dim() == 4, fn, ": 'q2k_index' must be 4-D [B, Hq, Qtiles, MaxK]");
  TORCH_CHECK_VALUE(num_kv_tiles >= 0, fn, ": num_kv_tiles must be >= 0, got ", num_kv_tiles);
  return std::make_tuple(
      int32_empty({q2k_index.sym_size(0), q2k_index.sym_size(1), c10::SymInt(num_kv_tiles + 1)},
                  q2k_index),
      int32_empty({q2k_index.sym_size(0), q2k_index.sym_size(1),
                   q2k_index.sym_size(2) * q2k_index.sym_size(3)},
                  q2k_index));
}

void check_sparse_backward_devices(const char* fn, const Tensor& grad_out, const Tensor& q,
                                   const Tensor& k, const Tensor& v, const Tensor& out,
                                   const Tensor& lse, const Tensor& q2k_index,
                                   const Tensor& q2k_count, const Tensor& k2q_offsets,
                                   const Tensor& k2q_index, const OptTensor& q_block_sizes,
                                   const OptTensor& kv_block_sizes) {
  check_same_device(fn, {{"grad_out", grad_out},
                         {"q", q},
                         {"k", k},
                         {"v", v},
                         {"out", out},
                         {"lse", lse},
                         {"q2k_index", q2k_index},
                         {"q2k_count", q2k_count},
                         {"k2q_offsets", k2q_offsets},
                         {"k2q_index", k2q_index},
                         {"q_block_sizes", q_block_sizes},
                         {"kv_block_sizes", kv_block_sizes}});
}

std::tuple<Tensor, Tensor, Tensor> block_sparse_backward_kernel(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const Tensor& q2k_index, const Tensor& q2k_count, const Tensor& k2q_offsets,
    const Tensor& k2q_index, int64_t tile_volume, const OptTensor& q_block_sizes,
    const OptTensor& kv_block_sizes, std::optional<double> scale, bool deterministic) {
  constexpr const char* fn = "vidattn.block_sparse_attention_backward";
  check_sparse_backward_devices(fn, grad_out, q, k, v, out, lse, q2k_index, q2k_count,
                                k2q_offsets, k2q_index, q_block_sizes, kv_block_sizes);
  const at::OptionalDeviceGuard device_guard(at::device_of(q));  // run on the inputs' device
  require_int32(q2k_index, fn, "q2k_index");
  require_int32(q2k_count, fn, "q2k_count");
  require_int32(k2q_offsets, fn, "k2q_offsets");
  require_int32(k2q_index, fn, "k2q_index");
  return translate_errors([&] {
    const SparseArgs a{tile_volume, q_block_sizes, kv_block_sizes, scale, deterministic};
    Tensor dq = at::empty(q.sizes(), q.options());
    Tensor dk = at::empty(k.sizes(), k.options());
    Tensor dv = at::empty(v.sizes(), v.options());
    block_sparse_attention_backward(
        view_of(q, fn, "q"), view_of(k, fn, "k"), view_of(v, fn, "v"), view_of(out, fn, "out"),
        view_of(lse, fn, "lse"), view_of(grad_out, fn, "grad_out"),
        view_of(q2k_index, fn, "q2k_index"), view_of(q2k_count, fn, "q2k_count"),
        view_of(k2q_offsets, fn, "k2q_offsets"), view_of(k2q_index, fn, "k2q_index"),
        view_of(dq, fn, "dq"), view_of(dk, fn, "dk"), view_of(dv, fn, "dv"), options_of(a, fn, q));
    return std::make_tuple(dq, dk, dv);
  });
}

std::tuple<Tensor, Tensor, Tensor> block_sparse_backward_meta(
    const Tensor& grad_out, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
    const Tensor& lse, const Tensor& q2k_index, const Tensor& q2k_count,
    const Tensor& k2q_offsets, const Tensor& k2q_index, int64_t, const OptTensor& q_block_sizes,
    const OptTensor& kv_block_sizes, std::optional<double>, bool) {
  check_sparse_backward_devices("vidattn.block_sparse_attention_backward", grad_out, q, k, v,
                                out, lse, q2k_index, q2k_count, k2q_offsets, k2q_index,
                                q_block_sizes, kv_block_sizes);
  return std::make_tuple(at::empty_symint(q.sym_sizes(), q.options()),
                         at::empty_symint(k.sym_sizes(), k.options()),
                         at::empty_symint(v.sym_sizes(), v.options()));
}

c10::IValue optional_tensor(const OptTensor& t) { return t ? c10::IValue(*t) : c10::IValue(); }
OptTensor get_optional_tensor(const c10::IValue& v) {
  return v.isNone() ? OptTensor() : OptTensor(v.toTensor());
}

class BlockSparseFunction : public torch::autograd::Function<BlockSparseFunction> {
 public:
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, const Tensor& q2k_index, const Tensor& q2k_count,
                               const SparseArgs& a) {
    static auto op =
        find_op<decltype(block_sparse_attention_kernel)>("vidattn::block_sparse_attention");
    Tensor out, lse;
    {
      at::AutoDispatchBelowADInplaceOrView guard;
      std::tie(out, lse) = op.call(q, k, v, q2k_index, q2k_count, a.tile_volume, a.q_block_sizes,
                                   a.kv_block_sizes, a.scale, a.deterministic, a.validate_index,
                                   a.sm_margin);
    }
    ctx->save_for_backward({q, k, v, out, lse, q2k_index, q2k_count});
    ctx->saved_data["tile_volume"] = a.tile_volume;
    ctx->saved_data["q_block_sizes"] = optional_tensor(a.q_block_sizes);
    ctx->saved_data["kv_block_sizes"] = optional_tensor(a.kv_block_sizes);
    ctx->saved_data["scale"] = a.scale;
    ctx->saved_data["deterministic"] = a.deterministic;
    ctx->mark_non_differentiable({lse});
    return {out, lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static auto transpose = find_op<decltype(transpose_index_kernel)>(
        "vidattn::block_sparse_transpose_index");
    static auto op = find_op<decltype(block_sparse_backward_kernel)>(
        "vidattn::block_sparse_attention_backward");
    const auto s = ctx->get_saved_variables();
    const Tensor& out = s[3];
    const Tensor grad = grads[0].defined() ? unit_stride_grad(grads[0]) : at::zeros_like(out);
    const auto& d = ctx->saved_data;
    const int64_t tile_volume = d.at("tile_volume").toInt();
    // The transposed index exists only here, when a gradient is wanted.
    // The forward checked (or was told to trust) this index: no second check.
    auto [k2q_offsets, k2q_index] =
        transpose.call(s[5], s[6], s[1].size(1) / tile_volume, /*validate_index=*/false);
    auto [dq, dk, dv] =
        op.call(grad, s[0], s[1], s[2], out, s[4], s[5], s[6], k2q_offsets, k2q_index, tile_volume,
                get_optional_tensor(d.at("q_block_sizes")), get_optional_tensor(d.at("kv_block_sizes")),
                d.at("scale").toOptional<double>(), d.at("deterministic").toBool());
    return {dq, dk, dv, Tensor(), Tensor(), Tensor()};
  }
};

std::tuple<Tensor, Tensor> block_sparse_attention_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q2k_index,
    const Tensor& q2k_count, int64_t tile_volume, const OptTensor& q_block_sizes,
    const OptTensor& kv_block_sizes, std::optional<double> scale, bool deterministic,
    bool validate_index, int64_t sm_margin) {
  auto r = BlockSparseFunction::apply(
      q, k, v, q2k_index, q2k_count,
      SparseArgs{tile_volume, q_block_sizes, kv_block_sizes, scale, deterministic,
                 validate_index, sm_margin});
  return std::make_tuple(r[0], r[1]);
}

// ---- VSA's fine branch and combination in one op (inference) ------------------------------

std::tuple<Tensor, Tensor, Tensor> vsa_fine_combined_kernel(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q2k_index,
    const Tensor& q2k_count, const Tensor& coarse, const OptTensor& gate,
    const Tensor& q_block_sizes, int64_t tile_volume, const OptTensor& kv_block_sizes,
    std::optional<double> scale, bool validate_index, int64_t sm_margin) {
  constexpr const char* fn = "vidattn.vsa_fine_combined";
  check_sparse_devices(fn, q, k, v, q2k_index, q2k_count, q_block_sizes, kv_block_sizes, coarse,
                       gate);
  const at::OptionalDeviceGuard device_guard(at::device_of(q));
  require_sparse_int32(fn, q2k_index, q2k_count, q_block_sizes, kv_block_sizes);
  return translate_errors([&] {
    // f.out is the fine branch's output; `out` the combination.
    const SparseForward f = sparse_forward(
        fn, q, k, v, q2k_index, q2k_count,
        {tile_volume, q_block_sizes, kv_block_sizes, scale, true, validate_index, sm_margin});
    Tensor out = at::empty_like(f.out);
    vsa_fine_combine_forward(f.q, f.k, f.v, f.index, f.count, view_of(coarse, fn, "coarse"),
                             view_of(gate, fn, "gate"), view_of(f.out, fn, "fine"),
                             view_of(f.lse, fn, "lse"), view_of(out, fn, "out"), f.options);
    return std::make_tuple(out, f.out, f.lse);
  });
}

std::tuple<Tensor, Tensor, Tensor> vsa_fine_combined_meta(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q2k_index,
    const Tensor& q2k_count, const Tensor& coarse, const OptTensor& gate,
    const Tensor& q_block_sizes, int64_t tile_volume, const OptTensor& kv_block_sizes,
    std::optional<double> scale, bool validate_index, int64_t sm_margin) {
  constexpr const char* fn = "vidattn.vsa_fine_combined";
  check_sparse_devices(fn, q, k, v, q2k_index, q2k_count, q_block_sizes, kv_block_sizes, coarse,
                       gate);
  // Checked under this op's name first (block_sparse_attention_meta names its own).
  require_sparse_int32(fn, q2k_index, q2k_count, q_block_sizes, kv_block_sizes);
  auto [fine, lse] = block_sparse_attention_meta(q, k, v, q2k_index, q2k_count, tile_volume,
                                                 q_block_sizes, kv_block_sizes, scale, true,
                                                 validate_index, sm_margin);
  TORCH_CHECK_VALUE(coarse.dim() == 4, fn, ": 'coarse' must be 4-D [B, Qtiles, H, D], got ",
                    coarse.dim(), "-D");
  TORCH_CHECK_VALUE(!(gate && gate->defined()) || gate->dim() == 4, fn, ": 'gate' must be 4-D like q");
  return std::make_tuple(at::empty_like(fine), fine, lse);
}

// No gradient: the training path keeps the two ops (block_sparse_attention, vsa_combine),
// whose backward needs the fine output anyway.
std::tuple<Tensor, Tensor, Tensor> vsa_fine_combined_autograd(
    const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& q2k_index,
    const Tensor& q2k_count, const Tensor& coarse, const OptTensor& gate,
    const Tensor& q_block_sizes, int64_t tile_volume, const OptTensor& kv_block_sizes,
    std::optional<double> scale, bool validate_index, int64_t sm_margin) {
  static auto op = find_op<decltype(vsa_fine_combined_kernel)>("vidattn::vsa_fine_combined");
  TORCH_CHECK(!at::GradMode::is_enabled() ||
                  !(q.requires_grad() || k.requires_grad() || v.requires_grad() ||
                    coarse.requires_grad() || (gate && gate->defined() && gate->requires_grad())),
              "vidattn.vsa_fine_combined: inference only (no gradient); with tensors that "
              "require grad use vidattn.block_sparse_attention and vidattn.vsa_combine");
  at::AutoDispatchBelowADInplaceOrView guard;
  return op.call(q, k, v, q2k_index, q2k_count, coarse, gate, q_block_sizes, tile_volume,
                 kv_block_sizes, scale, validate_index, sm_margin);
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(vidattn, m) {
  const std::vector<at::Tag> tags{at::Tag::pt2_compliant_tag};
  m.def("vsa_tiling_metadata(int[] grids, int[] tile, *, Device? device=None) -> Tensor", tags);
  m.def("gather_tokens(Tensor x, Tensor index, Tensor inverse_index) -> Tensor", tags);
  m.def("tile_mean_pool(Tensor x, Tensor block_sizes, int tile_volume) -> Tensor", tags);
  m.def("tile_mean_pool_backward(Tensor grad_out, Tensor block_sizes, int tile_volume) -> Tensor",
        tags);
  m.def(
      "topk_tiles(Tensor q_pooled, Tensor k_pooled, int topk, *, float? sparsity=None, "
      "float? scale=None, Tensor? cu_tiles_q=None, Tensor? cu_tiles_k=None) -> "
      "(Tensor q2k_index, Tensor q2k_count)",
      tags);
  m.def("topk_tiles_from_scores(Tensor scores, int topk) -> (Tensor q2k_index, Tensor q2k_count)",
        tags);
  m.def(
      "block_sparse_attention(Tensor q, Tensor k, Tensor v, Tensor q2k_index, Tensor q2k_count, *, "
      "int tile_volume=64, Tensor? q_block_sizes=None, Tensor? kv_block_sizes=None, "
      "float? scale=None, bool deterministic=True, bool validate_index=True, int sm_margin=0) "
      "-> "
      "(Tensor out, Tensor lse)",
      tags);
  m.def(
      "vsa_fine_combined(Tensor q, Tensor k, Tensor v, Tensor q2k_index, Tensor q2k_count, "
      "Tensor coarse, Tensor? gate, Tensor q_block_sizes, *, int tile_volume=64, "
      "Tensor? kv_block_sizes=None, float? scale=None, bool validate_index=True, "
      "int sm_margin=0) -> (Tensor out, Tensor fine, Tensor lse)",
      tags);
  m.def(
      "block_sparse_transpose_index(Tensor q2k_index, Tensor q2k_count, int num_kv_tiles, *, "
      "bool validate_index=True) -> "
      "(Tensor k2q_offsets, Tensor k2q_index)",
      tags);
  m.def(
      "block_sparse_attention_backward(Tensor grad_out, Tensor q, Tensor k, Tensor v, Tensor out, "
      "Tensor lse, Tensor q2k_index, Tensor q2k_count, Tensor k2q_offsets, Tensor k2q_index, *, "
      "int tile_volume, Tensor? q_block_sizes, Tensor? kv_block_sizes, float? scale, "
      "bool deterministic) -> (Tensor dq, Tensor dk, Tensor dv)",
      tags);
}

// The metadata op has no tensor inputs: one kernel serves every backend (it builds on the
// host and moves the result to `device`; meta devices get shapes only).
TORCH_LIBRARY_IMPL(vidattn, CompositeExplicitAutograd, m) {
  m.impl("vsa_tiling_metadata", &tiling_metadata_kernel);
}

// The same kernels serve CPU and CUDA tensors: the core dispatches on the tensors' device
// (on PyTorch's current stream for CUDA), so one list registers both keys.
static void impl_device_kernels(torch::Library& m) {
  m.impl("gather_tokens", &gather_tokens_kernel);
  m.impl("tile_mean_pool", &tile_mean_pool_kernel);
  m.impl("tile_mean_pool_backward", &tile_mean_pool_backward_kernel);
  m.impl("topk_tiles", &topk_tiles_kernel);
  m.impl("topk_tiles_from_scores", &topk_tiles_from_scores_kernel);
  m.impl("block_sparse_attention", &block_sparse_attention_kernel);
  m.impl("vsa_fine_combined", &vsa_fine_combined_kernel);
  m.impl("block_sparse_transpose_index", &transpose_index_kernel);
  m.impl("block_sparse_attention_backward", &block_sparse_backward_kernel);
}

TORCH_LIBRARY_IMPL(vidattn, CPU, m) { impl_device_kernels(m); }
#ifdef VIDATTN_TORCH_CUDA
TORCH_LIBRARY_IMPL(vidattn, CUDA, m) { impl_device_kernels(m); }
#endif

TORCH_LIBRARY_IMPL(vidattn, Meta, m) {
  m.impl("gather_tokens", &gather_tokens_meta);
  m.impl("tile_mean_pool", &tile_mean_pool_meta);
  m.impl("tile_mean_pool_backward", &tile_mean_pool_backward_meta);
  m.impl("topk_tiles", &topk_tiles_meta);
  m.impl("topk_tiles_from_scores", &topk_tiles_from_scores_meta);
  m.impl("block_sparse_attention", &block_sparse_attention_meta);
  m.impl("vsa_fine_combined", &vsa_fine_combined_meta);
  m.impl("block_sparse_transpose_index", &transpose_index_meta);
  m.impl("block_sparse_attention_backward", &block_sparse_backward_meta);
}

TORCH_LIBRARY_IMPL(vidattn, Autograd, m) {
  m.impl("gather_tokens", &gather_tokens_autograd);
  m.impl("tile_mean_pool", &tile_mean_pool_autograd);
  m.impl("block_sparse_attention", &block_sparse_attention_autograd);
  m.impl("vsa_fine_combined", &vsa_fine_combined_autograd);
  m.impl("tile_mean_pool_backward", refusing_double_backward());
  m.impl("block_sparse_attention_backward", refusing_double_backward());
}

}  // namespace vidattn::torch_ops
