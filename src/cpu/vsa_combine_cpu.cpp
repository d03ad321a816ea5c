// CPU kernels of the fused VSA combine. One forward and one backward serve both modes; a
// mode says which tile a row of fine / gate / out lies in, and which row holds a tile's slot.
//  * tiled (vsa_combine): row = slot, in tile slot / V where the slot is below the tile's
//    block size;
//  * rows (vsa_combine_rows): row r holds raster token first_token + r, in the tile of
//    token_to_slot[token].
// A row in no tile (a padded slot, a row past the sequence) passes fine through and gets a
// zero gate gradient.
#include <omp.h>

#include <algorithm>
#include <vector>

#include "../core/vsa_combine_backends.h"
#include "cpu_math.h"
#include "vsa_cpu.h"

namespace vidattn::detail {
namespace {

using cpu::Storage;
using cpu_vsa::threads_of;

struct TiledRows {
  std::vector<std::int32_t> sizes;
  std::int64_t volume;
  std::int64_t tile_of_row(std::int64_t row) const {
    const std::int64_t tile = row / volume;
    return row % volume < sizes[std::size_t(tile)] ? tile : -1;
  }
  std::int64_t row_of_slot(std::int64_t tile, std::int64_t v) const {
    return v < sizes[std::size_t(tile)] ? tile * volume + v : -1;
  }
};

struct RasterRows {
  std::vector<std::int32_t> token_to_slot, slot_to_token;
  std::int64_t volume, first_token, rows;
  std::int64_t tile_of_row(std::int64_t row) const {
    const std::int64_t token = first_token + row;
    return token < std::int64_t(token_to_slot.size())
               ? token_to_slot[std::size_t(token)] / volume
               : -1;
  }
  std::int64_t row_of_slot(std::int64_t tile, std::int64_t v) const {
    const std::int64_t token = slot_to_token[std::size_t(tile * volume + v)];
    const std::int64_t row = token - first_token;
    return token >= 0 && row >= 0 && row < rows ? row : -1;
  }
};

// The tiling's maps, checked: token t in slot token_to_slot[t], and slot_to_token its inverse
// (-1 on padded slots).
RasterRows read_raster_rows(const ArgChecker& check, const TensorView& token_to_slot,
                            const TensorView& slot_to_token, std::int64_t tile_volume,
                            std::int64_t first_token, std::int64_t rows) {
  RasterRows m{{}, {}, tile_volume, first_token, rows};
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

// Calls fn(tag of the rows' dtype, tag of coarse's dtype): coarse is the rows' dtype or
// float32.
template <class Fn>
void visit_row_dtypes(DType rows, DType coarse, Fn&& fn) {
  cpu::visit_float_dtype(rows, [&](auto row_tag) {
    if (coarse == rows)
      fn(row_tag, row_tag);
    else
      fn(row_tag, std::integral_constant<DType, DType::kFloat32>{});
  });
}

template <class E>
E* row_at(const TensorView& t, std::int64_t b, std::int64_t r, std::int64_t h) {
  return static_cast<E*>(t.data) + b * t.stride[0] + r * t.stride[1] + h * t.stride[2];
}

template <class Mode>
void combine_forward(const TensorView& fine, const TensorView& coarse,
                     const std::optional<TensorView>& gate, const TensorView& out,
                     const Mode& mode, int num_threads) {
  const std::int64_t B = fine.shape[0], R = fine.shape[1], H = fine.shape[2], D = fine.shape[3];
  visit_row_dtypes(fine.dtype, coarse.dtype, [&](auto row_tag, auto coarse_tag) {
    using S = Storage<decltype(row_tag)::value>;
    using SC = Storage<decltype(coarse_tag)::value>;
    using E = typename S::type;
    using EC = typename SC::type;
    using Acc = std::conditional_t<decltype(row_tag)::value == DType::kFloat64, double, float>;
#pragma omp parallel for schedule(static) num_threads(threads_of(num_threads))
    for (std::int64_t br = 0; br < B * R; ++br) {
      const std::int64_t b = br / R, r = br % R, tile = mode.tile_of_row(r);
      for (std::int64_t h = 0; h < H; ++h) {
        const E* f = row_at<const E>(fine, b, r, h);
        E* o = row_at<E>(out, b, r, h);
        if (tile < 0) {
          for (std::int64_t d = 0; d < D; ++d) o[d] = f[d];
          continue;
        }
        const EC* c = row_at<const EC>(coarse, b, tile, h);
        const E* g = gate ? row_at<const E>(*gate, b, r, h) : nullptr;
        for (std::int64_t d = 0; d < D; ++d) {
          const Acc gd = g ? S::template load<Acc>(g[d]) : Acc(1);
          o[d] = S::template store<Acc>(S::template load<Acc>(f[d]) +
                                        gd * SC::template load<Acc>(c[d]));
        }
      }
    }
  });
}

template <class Mode>
void combine_backward(const TensorView& grad_out, const TensorView& coarse,
                      const std::optional<TensorView>& gate, const TensorView& grad_coarse,
                      const std::optional<TensorView>& grad_gate, const Mode& mode,
                      std::int64_t tile_volume, int num_threads) {
  const std::int64_t B = grad_out.shape[0], R = grad_out.shape[1], H = grad_out.shape[2],
                     D = grad_out.shape[3], T = coarse.shape[1];
  visit_row_dtypes(grad_out.dtype, coarse.dtype, [&](auto row_tag, auto coarse_tag) {
    using S = Storage<decltype(row_tag)::value>;
    using SC = Storage<decltype(coarse_tag)::value>;
    using E = typename S::type;
    using EC = typename SC::type;
    using Acc = std::conditional_t<decltype(row_tag)::value == DType::kFloat64, double, float>;
#pragma omp parallel num_threads(threads_of(num_threads))
    {
      // grad_coarse: per (batch, tile, head), the tile's rows in slot order (deterministic).
      std::vector<Acc> sum(static_cast<std::size_t>(D));
#pragma omp for schedule(static)
      for (std::int64_t bth = 0; bth < B * T * H; ++bth) {
        const std::int64_t b = bth / (T * H), t = (bth / H) % T, h = bth % H;
        std::fill(sum.begin(), sum.end(), Acc(0));
        const EC* c = row_at<const EC>(coarse, b, t, h);
        for (std::int64_t v = 0; v < tile_volume; ++v) {
          const std::int64_t r = mode.row_of_slot(t, v);
          if (r < 0) continue;
          const E* go = row_at<const E>(grad_out, b, r, h);
          const E* g = gate ? row_at<const E>(*gate, b, r, h) : nullptr;
          E* gg = grad_gate ? row_at<E>(*grad_gate, b, r, h) : nullptr;
          for (std::int64_t d = 0; d < D; ++d) {
            const Acc god = S::template load<Acc>(go[d]);
            sum[d] += g ? god * S::template load<Acc>(g[d]) : god;
            if (gg) gg[d] = S::template store<Acc>(god * SC::template load<Acc>(c[d]));
          }
        }
        EC* dst = row_at<EC>(grad_coarse, b, t, h);
        for (std::int64_t d = 0; d < D; ++d) dst[d] = SC::template store<Acc>(sum[d]);
      }
      // Rows in no tile get a zero gate gradient, whatever they hold.
      if (grad_gate) {
#pragma omp for schedule(static)
        for (std::int64_t br = 0; br < B * R; ++br) {
          const std::int64_t b = br / R, r = br % R;
          if (mode.tile_of_row(r) >= 0) continue;
          for (std::int64_t h = 0; h < H; ++h) {
            E* gg = row_at<E>(*grad_gate, b, r, h);
            for (std::int64_t d = 0; d < D; ++d) gg[d] = S::template store<Acc>(Acc(0));
          }
        }
      }
    }
  });
}

TiledRows read_tiled_rows(const ArgChecker& check, const TensorView& block_sizes,
                          std::int64_t tiles, std::int64_t tile_volume) {
  return {cpu_vsa::read_block_sizes(check, &block_sizes, "block_sizes", tiles, tile_volume),
          tile_volume};
}

}  // namespace

void cpu_vsa_combine(const TensorView& fine, const TensorView& coarse,
                     const std::optional<TensorView>& gate, const TensorView& block_sizes,
                     std::int64_t tile_volume, const TensorView& out, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine");
  combine_forward(fine, coarse, gate, out,
                  read_tiled_rows(check, block_sizes, coarse.shape[1], tile_volume),
                  num_threads);
}

void cpu_vsa_combine_backward(const TensorView& grad_out, const TensorView& coarse,
                              const std::optional<TensorView>& gate,
                              const TensorView& block_sizes, std::int64_t tile_volume,
                              const TensorView& grad_coarse,
                              const std::optional<TensorView>& grad_gate, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine_backward");
  combine_backward(grad_out, coarse, gate, grad_coarse, grad_gate,
                   read_tiled_rows(check, block_sizes, coarse.shape[1], tile_volume),
                   tile_volume, num_threads);
}

void cpu_vsa_combine_rows(const TensorView& fine, const TensorView& coarse,
                          const std::optional<TensorView>& gate, const TensorView& token_to_slot,
                          const TensorView& slot_to_token, std::int64_t tile_volume,
                          std::int64_t first_token, const TensorView& out, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine_rows");
  combine_forward(fine, coarse, gate, out,
                  read_raster_rows(check, token_to_slot, slot_to_token, tile_volume,
                                   first_token, fine.shape[1]),
                  num_threads);
}

void cpu_vsa_combine_rows_backward(const TensorView& grad_out, const TensorView& coarse,
                                   const std::optional<TensorView>& gate,
                                   const TensorView& token_to_slot,
                                   const TensorView& slot_to_token, std::int64_t tile_volume,
                                   std::int64_t first_token, const TensorView& grad_coarse,
                                   const std::optional<TensorView>& grad_gate, int num_threads) {
  const ArgChecker check("vidattn::vsa_combine_rows_backward");
  combine_backward(grad_out, coarse, gate, grad_coarse, grad_gate,
                   read_raster_rows(check, token_to_slot, slot_to_token, tile_volume,
                                    first_token, grad_out.shape[1]),
                   tile_volume, num_threads);
}

}  // namespace vidattn::detail
