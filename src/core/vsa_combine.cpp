// Validation and backend dispatch of the fused VSA combine (vidattn/vsa_combine.h).
#include "vidattn/vsa_combine.h"

#include "check.h"
#include "vidattn/vsa.h"
#include "vsa_combine_backends.h"

namespace vidattn {
namespace {

using detail::ArgChecker;

struct CombineShape {
  std::int64_t batch, tiles, heads, head_dim;
};

void check_tile_volume(const ArgChecker& check, std::int64_t tile_volume) {
  if (!is_supported_tile_volume(tile_volume))
    check.fail("tile volume must be 64, 128 or 256, got ", tile_volume);
}

void check_float(const ArgChecker& check, const TensorView& rows, const char* rows_name) {
  if (!detail::is_float_dtype(rows.dtype))
    detail::throw_type_error(check.function(), ": argument '", rows_name,
                             "' must be float32, float16, bfloat16 or float64, got ",
                             dtype_name(rows.dtype));
}

// What both modes ask of the full-size tensors and of coarse once its shape and dtype are
// checked: gate like the rows, unit-stride rows, data present.
void check_rows_gate_coarse(const ArgChecker& check, const TensorView& rows,
                            const char* rows_name, const TensorView& coarse,
                            const std::optional<TensorView>& gate, const char* gate_layout) {
  check.same_device(coarse, "coarse", rows.device);
  if (gate) {
    check.shape(*gate, "gate", rows.shape, 4, gate_layout);
    check.dtype(*gate, "gate", rows.dtype);
    check.same_device(*gate, "gate", rows.device);
    check.unit_last_stride(*gate, "gate");
    check.non_null(*gate, "gate");
  }
  check.unit_last_stride(rows, rows_name);
  check.unit_last_stride(coarse, "coarse");
  check.non_null(rows, rows_name);
  check.non_null(coarse, "coarse");
}

// `slots` is the tiled tensor every full-size argument must match (fine or grad_out);
// `coarse` is [B, Tiles, H, D]. Checks dtype, device, shapes, strides and data.
void check_combine(const ArgChecker& check, const TensorView& slots,
                           const char* slots_name, const TensorView& coarse,
                           const std::optional<TensorView>& gate, const TensorView& block_sizes,
                           std::int64_t tile_volume) {
  check_tile_volume(check, tile_volume);
  check.ndim(slots, slots_name, 4, "[B, Tiles * V, H, D]");
  check_float(check, slots, slots_name);
  if (slots.shape[1] % tile_volume != 0)
    check.fail("argument '", slots_name, "' has ", slots.shape[1],
               " slots, not a multiple of the tile volume ", tile_volume);
  const CombineShape s{slots.shape[0], slots.shape[1] / tile_volume, slots.shape[2],
                       slots.shape[3]};
  const std::int64_t coarse_shape[4] = {s.batch, s.tiles, s.heads, s.head_dim};
  check.shape(coarse, "coarse", coarse_shape, 4, "[B, Tiles, H, D]");
  check.dtype(coarse, "coarse", slots.dtype);
  check.ndim(block_sizes, "block_sizes", 1, "[Tiles]");
  check.dtype(block_sizes, "block_sizes", DType::kInt32);
  check.same_device(block_sizes, "block_sizes", slots.device);
  check.dim_equals(block_sizes, "block_sizes", 0, s.tiles, "one entry per tile");
  check.non_null(block_sizes, "block_sizes");
  check_rows_gate_coarse(check, slots, slots_name, coarse, gate, "(the tiled shape)");
}

void check_output(const ArgChecker& check, const TensorView& out, const char* name,
                  const TensorView& like) {
  check.shape(out, name, like.shape, like.ndim);
  check.dtype(out, name, like.dtype);
  check.same_device(out, name, like.device);
  check.unit_last_stride(out, name);
  check.non_null(out, name);
}

void check_backward_outputs(const ArgChecker& check, const TensorView& grad_out,
                            const TensorView& coarse, const std::optional<TensorView>& gate,
                            const TensorView& grad_coarse,
                            const std::optional<TensorView>& grad_gate) {
  check_output(check, grad_coarse, "grad_coarse", coarse);
  if (grad_gate) {
    if (!gate) check.fail("argument 'grad_gate' needs 'gate'");
    check_output(check, *grad_gate, "grad_gate", grad_out);
  }
}

#if !VIDATTN_WITH_CUDA
[[noreturn]] void throw_no_cuda(const char* fn) {
  throw NotImplementedError(
      detail::concat(fn, ": this build of vidattn has no CUDA backend; pass CPU tensors"));
}
#endif

[[maybe_unused]] bool on_cpu(const TensorView& t) { return t.device.kind == DeviceKind::kCPU; }

}  // namespace

namespace detail {
void check_vsa_combine_arguments(const char* function, const TensorView& fine,
                                 const TensorView& coarse, const std::optional<TensorView>& gate,
                                 const TensorView& block_sizes, std::int64_t tile_volume,
                                 const TensorView& out) {
  const ArgChecker check(function);
  check_combine(check, fine, "fine", coarse, gate, block_sizes, tile_volume);
  check_output(check, out, "out", fine);
}
}  // namespace detail

void vsa_combine(const TensorView& fine, const TensorView& coarse,
                 const std::optional<TensorView>& gate, const TensorView& block_sizes,
                 std::int64_t tile_volume, const TensorView& out, int num_threads,
                 void* stream) {
  constexpr const char* kFn = "vidattn::vsa_combine";
  const ArgChecker check(kFn);
  check_combine(check, fine, "fine", coarse, gate, block_sizes, tile_volume);
  check_output(check, out, "out", fine);
  if (fine.numel() == 0) return;
  if (on_cpu(fine))
    return detail::cpu_vsa_combine(fine, coarse, gate, block_sizes, tile_volume, out,
                                   num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_vsa_combine(fine, coarse, gate, block_sizes, tile_volume, out, stream);
#else
  (void)stream;
  throw_no_cuda(kFn);
#endif
}

void vsa_combine_backward(const TensorView& grad_out, const TensorView& coarse,
                          const std::optional<TensorView>& gate, const TensorView& block_sizes,
                          std::int64_t tile_volume, const TensorView& grad_coarse,
                          const std::optional<TensorView>& grad_gate, int num_threads,
                          void* stream) {
  constexpr const char* kFn = "vidattn::vsa_combine_backward";
  const ArgChecker check(kFn);
  check_combine(check, grad_out, "grad_out", coarse, gate, block_sizes, tile_volume);
  check_backward_outputs(check, grad_out, coarse, gate, grad_coarse, grad_gate);
  if (coarse.numel() == 0 && grad_out.numel() == 0) return;
  if (on_cpu(grad_out))
    return detail::cpu_vsa_combine_backward(grad_out, coarse, gate, block_sizes, tile_volume,
                                            grad_coarse, grad_gate, num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_vsa_combine_backward(grad_out, coarse, gate, block_sizes, tile_volume,
                                    grad_coarse, grad_gate, stream);
#else
  (void)stream;
  throw_no_cuda(kFn);
#endif
}

namespace {

// Row mode (vsa_combine_rows): `rows` [B, R, H, D] of a raster sequence, coarse [B, Tiles, H,
// D] in the rows' dtype or float32, the tiling's two maps.
void check_combine_rows(const ArgChecker& check, const TensorView& rows,
                                const char* rows_name, const TensorView& coarse,
                                const std::optional<TensorView>& gate,
                                const TensorView& token_to_slot,
                                const TensorView& slot_to_token, std::int64_t tile_volume,
                                std::int64_t first_token) {
  check_tile_volume(check, tile_volume);
  if (first_token < 0) check.fail("first_token must be >= 0, got ", first_token);
  check.ndim(rows, rows_name, 4, "[B, R, H, D]");
  check_float(check, rows, rows_name);
  check.ndim(slot_to_token, "slot_to_token", 1, "[Tiles * V]");
  check.ndim(token_to_slot, "token_to_slot", 1, "[num_tokens]");
  for (const auto& [map, name] : {std::pair{&slot_to_token, "slot_to_token"},
                                  std::pair{&token_to_slot, "token_to_slot"}}) {
    check.dtype(*map, name, DType::kInt32);
    check.same_device(*map, name, rows.device);
    check.unit_last_stride(*map, name);
    check.non_null(*map, name);
  }
  if (slot_to_token.shape[0] % tile_volume != 0)
    check.fail("argument 'slot_to_token' has ", slot_to_token.shape[0],
               " slots, not a multiple of the tile volume ", tile_volume);
  const CombineShape s{rows.shape[0], slot_to_token.shape[0] / tile_volume, rows.shape[2],
                       rows.shape[3]};
  const std::int64_t coarse_shape[4] = {s.batch, s.tiles, s.heads, s.head_dim};
  check.shape(coarse, "coarse", coarse_shape, 4, "[B, Tiles, H, D]");
  if (coarse.dtype != rows.dtype && coarse.dtype != DType::kFloat32)
    detail::throw_type_error(check.function(), ": argument 'coarse' must have dtype ",
                             dtype_name(rows.dtype), " (that of '", rows_name,
                             "') or float32, got ", dtype_name(coarse.dtype));
  if (coarse.dtype != rows.dtype && rows.dtype == DType::kFloat64)
    detail::throw_type_error(check.function(),
                             ": argument 'coarse' must be float64 with float64 rows, got ",
                             dtype_name(coarse.dtype));
  check_rows_gate_coarse(check, rows, rows_name, coarse, gate, "(the shape of the rows)");
}


}  // namespace

void vsa_combine_rows(const TensorView& fine, const TensorView& coarse,
                      const std::optional<TensorView>& gate, const TensorView& token_to_slot,
                      const TensorView& slot_to_token, std::int64_t tile_volume,
                      std::int64_t first_token, const TensorView& out, int num_threads,
                      void* stream) {
  constexpr const char* kFn = "vidattn::vsa_combine_rows";
  const ArgChecker check(kFn);
  check_combine_rows(check, fine, "fine", coarse, gate, token_to_slot, slot_to_token,
                     tile_volume, first_token);
  check_output(check, out, "out", fine);
  if (fine.numel() == 0) return;
  if (on_cpu(fine))
    return detail::cpu_vsa_combine_rows(fine, coarse, gate, token_to_slot, slot_to_token,
                                        tile_volume, first_token, out, num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_vsa_combine_rows(fine, coarse, gate, token_to_slot, slot_to_token, tile_volume,
                                first_token, out, stream);
#else
  (void)stream;
  throw_no_cuda(kFn);
#endif
}

void vsa_combine_rows_backward(const TensorView& grad_out, const TensorView& coarse,
                               const std::optional<TensorView>& gate,
                               const TensorView& token_to_slot, const TensorView& slot_to_token,
                               std::int64_t tile_volume, std::int64_t first_token,
                               const TensorView& grad_coarse,
                               const std::optional<TensorView>& grad_gate, int num_threads,
                               void* stream) {
  constexpr const char* kFn = "vidattn::vsa_combine_rows_backward";
  const ArgChecker check(kFn);
  check_combine_rows(check, grad_out, "grad_out", coarse, gate, token_to_slot, slot_to_token,
                     tile_volume, first_token);
  check_backward_outputs(check, grad_out, coarse, gate, grad_coarse, grad_gate);
  if (coarse.numel() == 0 && grad_out.numel() == 0) return;
  if (on_cpu(grad_out))
    return detail::cpu_vsa_combine_rows_backward(grad_out, coarse, gate, token_to_slot,
                                                 slot_to_token, tile_volume, first_token,
                                                 grad_coarse, grad_gate, num_threads);
#if VIDATTN_WITH_CUDA
  detail::cuda_vsa_combine_rows_backward(grad_out, coarse, gate, token_to_slot, slot_to_token,
                                         tile_volume, first_token, grad_coarse, grad_gate,
                                         stream);
#else
  (void)stream;
  throw_no_cuda(kFn);
#endif
}

}  // namespace vidattn
