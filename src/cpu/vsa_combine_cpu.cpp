// CPU kernels of the fused VSA combine: one pass over the tiled slots per (batch, tile).
#include <omp.h>

#include <algorithm>
#include <vector>

#include "../core/vsa_combine_backends.h"
#include "cpu_math.h"
#include "vsa_cpu.h"

namespace vidattn::detail {

using cpu::Storage;
using cpu::visit_float_dtype;
using cpu_vsa::threads_of;

void cpu_vsa_combine(const TensorView& fine, const TensorView& coarse,
                     const std::optional<TensorView>& gate, const TensorView& block_sizes,
                     std::int64_t tile_volume, const TensorView& out, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine");
  const std::int64_t B = fine.shape[0], T = coarse.shape[1], H = fine.shape[2],
                     D = fine.shape[3];
  const std::vector<std::int32_t> sizes =
      cpu_vsa::read_block_sizes(check, &block_sizes, "block_sizes", T, tile_volume);
  visit_float_dtype(fine.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    using E = typename S::type;
    using Acc = std::conditional_t<decltype(tag)::value == DType::kFloat64, double, float>;
#pragma omp parallel for schedule(static) num_threads(threads_of(num_threads))
    for (std::int64_t bt = 0; bt < B * T; ++bt) {
      const std::int64_t b = bt / T, t = bt % T;
      for (std::int64_t v = 0; v < tile_volume; ++v) {
        const std::int64_t s = t * tile_volume + v;
        const bool valid = v < sizes[t];
        for (std::int64_t h = 0; h < H; ++h) {
          const E* f = static_cast<const E*>(fine.data) + b * fine.stride[0] +
                       s * fine.stride[1] + h * fine.stride[2];
          E* o = static_cast<E*>(out.data) + b * out.stride[0] + s * out.stride[1] +
                 h * out.stride[2];
          if (!valid) {
            for (std::int64_t d = 0; d < D; ++d) o[d] = f[d];
            continue;
          }
          const E* c = static_cast<const E*>(coarse.data) + b * coarse.stride[0] +
                       t * coarse.stride[1] + h * coarse.stride[2];
          const E* g = gate ? static_cast<const E*>(gate->data) + b * gate->stride[0] +
                                  s * gate->stride[1] + h * gate->stride[2]
                            : nullptr;
          for (std::int64_t d = 0; d < D; ++d) {
            const Acc gd = g ? S::template load<Acc>(g[d]) : Acc(1);
            o[d] = S::template store<Acc>(S::template load<Acc>(f[d]) +
                                          gd * S::template load<Acc>(c[d]));
          }
        }
      }
    }
  });
}

void cpu_vsa_combine_backward(const TensorView& grad_out, const TensorView& coarse,
                              const std::optional<TensorView>& gate,
                              const TensorView& block_sizes, std::int64_t tile_volume,
                              const TensorView& grad_coarse,
                              const std::optional<TensorView>& grad_gate, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine_backward");
  const std::int64_t B = grad_out.shape[0], T = coarse.shape[1], H = grad_out.shape[2],
                     D = grad_out.shape[3];
  const std::vector<std::int32_t> sizes =
      cpu_vsa::read_block_sizes(check, &block_sizes, "block_sizes", T, tile_volume);
  visit_float_dtype(grad_out.dtype, [&](auto tag) {
    using S = Storage<decltype(tag)::value>;
    using E = typename S::type;
    using Acc = std::conditional_t<decltype(tag)::value == DType::kFloat64, double, float>;
#pragma omp parallel num_threads(threads_of(num_threads))
    {
      std::vector<Acc> sum(static_cast<std::size_t>(D));
#pragma omp for schedule(static)
      for (std::int64_t bth = 0; bth < B * T * H; ++bth) {
        const std::int64_t b = bth / (T * H), t = (bth / H) % T, h = bth % H;
        std::fill(sum.begin(), sum.end(), Acc(0));
        const E* c = static_cast<const E*>(coarse.data) + b * coarse.stride[0] +
                     t * coarse.stride[1] + h * coarse.stride[2];
        for (std::int64_t v = 0; v < tile_volume; ++v) {
          const std::int64_t s = t * tile_volume + v;
          const bool valid = v < sizes[t];
          const E* go = static_cast<const E*>(grad_out.data) + b * grad_out.stride[0] +
                        s * grad_out.stride[1] + h * grad_out.stride[2];
          const E* g = gate ? static_cast<const E*>(gate->data) + b * gate->stride[0] +
                                  s * gate->stride[1] + h * gate->stride[2]
                            : nullptr;
          E* gg = grad_gate ? static_cast<E*>(grad_gate->data) + b * grad_gate->stride[0] +
                                  s * grad_gate->stride[1] + h * grad_gate->stride[2]
                            : nullptr;
          for (std::int64_t d = 0; d < D; ++d) {
            // Padded slots contribute nothing and get a zero gradient, whatever they hold.
            if (!valid) {
              if (gg) gg[d] = S::template store<Acc>(Acc(0));
              continue;
            }
            const Acc god = S::template load<Acc>(go[d]);
            sum[d] += g ? god * S::template load<Acc>(g[d]) : god;
            if (gg) gg[d] = S::template store<Acc>(god * S::template load<Acc>(c[d]));
          }
        }
        E* dst = static_cast<E*>(grad_coarse.data) + b * grad_coarse.stride[0] +
                 t * grad_coarse.stride[1] + h * grad_coarse.stride[2];
        for (std::int64_t d = 0; d < D; ++d) dst[d] = S::template store<Acc>(sum[d]);
      }
    }
  });
}

}  // namespace vidattn::detail

namespace vidattn::detail {
namespace {

// The tiling's maps, checked: token t in slot token_to_slot[t], and slot_to_token its inverse
// (-1 on padded slots).
struct RowMaps {
  std::vector<std::int32_t> token_to_slot, slot_to_token;
};

RowMaps read_row_maps(const ArgChecker& check, const TensorView& token_to_slot,
                      const TensorView& slot_to_token) {
  RowMaps m;
  const auto* t2s = static_cast<const std::int32_t*>(token_to_slot.data);
  const auto* s2t = static_cast<const std::int32_t*>(slot_to_token.data);
  m.token_to_slot.assign(t2s, t2s + token_to_slot.shape[0]);
  m.slot_to_token.assign(s2t, s2t + slot_to_token.shape[0]);
  const std::int64_t slots = std::int64_t(m.slot_to_token.size());
  const std::int64_t tokens = std::int64_t(m.token_to_slot.size());
  for (std::int64_t t = 0; t < tokens; ++t) {
    const std::int32_t s = m.token_to_slot[t];
    if (s < 0 || s >= slots || m.slot_to_token[s] != t)
      check.fail("token_to_slot and slot_to_token are not the inverse maps of one tiling "
                 "(token ", t, " -> slot ", s, ")");
  }
  for (std::int64_t s = 0; s < slots; ++s)
    if (m.slot_to_token[s] < -1 || m.slot_to_token[s] >= tokens)
      check.fail("slot_to_token[", s, "] = ", m.slot_to_token[s], " is not -1 or a token below ",
                 tokens);
  return m;
}

// Calls fn(tag of the rows' dtype, tag of coarse's dtype).
template <class Fn>
void visit_row_dtypes(DType rows, DType coarse, Fn&& fn) {
  cpu::visit_float_dtype(rows, [&](auto row_tag) {
    if (coarse == rows)
      fn(row_tag, row_tag);
    else
      fn(row_tag, std::integral_constant<DType, DType::kFloat32>{});
  });
}

}  // namespace

void cpu_vsa_combine_rows(const TensorView& fine, const TensorView& coarse,
                          const std::optional<TensorView>& gate, const TensorView& token_to_slot,
                          const TensorView& slot_to_token, std::int64_t tile_volume,
                          std::int64_t first_token, const TensorView& out, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine_rows");
  const RowMaps maps = read_row_maps(check, token_to_slot, slot_to_token);
  const std::int64_t B = fine.shape[0], R = fine.shape[1], H = fine.shape[2], D = fine.shape[3];
  const std::int64_t tokens = std::int64_t(maps.token_to_slot.size());
  visit_row_dtypes(fine.dtype, coarse.dtype, [&](auto row_tag, auto coarse_tag) {
    using S = Storage<decltype(row_tag)::value>;
    using SC = Storage<decltype(coarse_tag)::value>;
    using E = typename S::type;
    using EC = typename SC::type;
    using Acc = std::conditional_t<decltype(row_tag)::value == DType::kFloat64, double, float>;
#pragma omp parallel for schedule(static) num_threads(threads_of(num_threads))
    for (std::int64_t br = 0; br < B * R; ++br) {
      const std::int64_t b = br / R, r = br % R, token = first_token + r;
      const std::int64_t tile =
          token < tokens ? maps.token_to_slot[std::size_t(token)] / tile_volume : -1;
      for (std::int64_t h = 0; h < H; ++h) {
        const E* f = static_cast<const E*>(fine.data) + b * fine.stride[0] + r * fine.stride[1] +
                     h * fine.stride[2];
        E* o = static_cast<E*>(out.data) + b * out.stride[0] + r * out.stride[1] +
               h * out.stride[2];
        if (tile < 0) {
          for (std::int64_t d = 0; d < D; ++d) o[d] = f[d];
          continue;
        }
        const EC* c = static_cast<const EC*>(coarse.data) + b * coarse.stride[0] +
                      tile * coarse.stride[1] + h * coarse.stride[2];
        const E* g = gate ? static_cast<const E*>(gate->data) + b * gate->stride[0] +
                                r * gate->stride[1] + h * gate->stride[2]
                          : nullptr;
        for (std::int64_t d = 0; d < D; ++d) {
          const Acc gd = g ? S::template load<Acc>(g[d]) : Acc(1);
          o[d] = S::template store<Acc>(S::template load<Acc>(f[d]) +
                                        gd * SC::template load<Acc>(c[d]));
        }
      }
    }
  });
}

void cpu_vsa_combine_rows_backward(const TensorView& grad_out, const TensorView& coarse,
                                   const std::optional<TensorView>& gate,
                                   const TensorView& token_to_slot,
                                   const TensorView& slot_to_token, std::int64_t tile_volume,
                                   std::int64_t first_token, const TensorView& grad_coarse,
                                   const std::optional<TensorView>& grad_gate, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine_rows_backward");
  const RowMaps maps = read_row_maps(check, token_to_slot, slot_to_token);
  const std::int64_t B = grad_out.shape[0], R = grad_out.shape[1], H = grad_out.shape[2],
                     D = grad_out.shape[3], T = coarse.shape[1];
  const std::int64_t tokens = std::int64_t(maps.token_to_slot.size());
  visit_row_dtypes(grad_out.dtype, coarse.dtype, [&](auto row_tag, auto coarse_tag) {
    using S = Storage<decltype(row_tag)::value>;
    using SC = Storage<decltype(coarse_tag)::value>;
    using E = typename S::type;
    using EC = typename SC::type;
    using Acc = std::conditional_t<decltype(row_tag)::value == DType::kFloat64, double, float>;
    auto row_ptr = [&](const TensorView& t, std::int64_t b, std::int64_t r, std::int64_t h) {
      return static_cast<E*>(t.data) + b * t.stride[0] + r * t.stride[1] + h * t.stride[2];
    };
#pragma omp parallel num_threads(threads_of(num_threads))
    {
      std::vector<Acc> sum(static_cast<std::size_t>(D));
#pragma omp for schedule(static)
      for (std::int64_t bth = 0; bth < B * T * H; ++bth) {
        const std::int64_t b = bth / (T * H), t = (bth / H) % T, h = bth % H;
        std::fill(sum.begin(), sum.end(), Acc(0));
        const EC* c = static_cast<const EC*>(coarse.data) + b * coarse.stride[0] +
                      t * coarse.stride[1] + h * coarse.stride[2];
        for (std::int64_t v = 0; v < tile_volume; ++v) {
          const std::int64_t token = maps.slot_to_token[std::size_t(t * tile_volume + v)];
          const std::int64_t r = token - first_token;
          if (token < 0 || r < 0 || r >= R) continue;
          const E* go = row_ptr(grad_out, b, r, h);
          const E* g = gate ? row_ptr(*gate, b, r, h) : nullptr;
          E* gg = grad_gate ? row_ptr(*grad_gate, b, r, h) : nullptr;
          for (std::int64_t d = 0; d < D; ++d) {
            const Acc god = S::template load<Acc>(go[d]);
            sum[d] += g ? god * S::template load<Acc>(g[d]) : god;
            if (gg) gg[d] = S::template store<Acc>(god * SC::template load<Acc>(c[d]));
          }
        }
        EC* dst = static_cast<EC*>(grad_coarse.data) + b * grad_coarse.stride[0] +
                  t * grad_coarse.stride[1] + h * grad_coarse.stride[2];
        for (std::int64_t d = 0; d < D; ++d) dst[d] = SC::template store<Acc>(sum[d]);
      }
      // Padding rows (past the sequence) lie in no tile: their gate gradient is 0.
      if (grad_gate) {
        const std::int64_t first_tail = std::max<std::int64_t>(0, tokens - first_token);
#pragma omp for schedule(static)
        for (std::int64_t br = 0; br < B * R; ++br) {
          const std::int64_t b = br / R, r = br % R;
          if (r < first_tail) continue;
          for (std::int64_t h = 0; h < H; ++h) {
            E* gg = row_ptr(*grad_gate, b, r, h);
            for (std::int64_t d = 0; d < D; ++d) gg[d] = S::template store<Acc>(Acc(0));
          }
        }
      }
    }
  });
}

}  // namespace vidattn::detail
