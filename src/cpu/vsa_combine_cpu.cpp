// CPU kernels of the fused VSA combine: one pass over the tiled slots per (batch, tile).
#include <omp.h>

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
