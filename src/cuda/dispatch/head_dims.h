// Which sm_80 instance serves a problem's head dims (q / k: D, v / out: Dv), host code of
// dispatch/. The rule (docs/kernel-map.md):
//   D = Dv = 64 or 128            -> the exact instance of that width (no padding code);
//   otherwise W = the smallest of 64, 96, 128, 192, 256 that is >= max(D, Dv)
//                                 -> the padded instance of width W.
// One width for both operands: the tiles of q, k, v, dO share one layout and the kernels one
// mainloop, so padding Dv separately would multiply the instances by the pairs of widths for a
// saving only where D and Dv differ by more than a width step (the kernels skip the mma steps
// past each real dim at run time, so a padded width costs shared memory and registers, not
// products). The widths: 64 and 128 exist for the exact dims; 96 serves 72 / 80 / 96 (common
// in DiTs) with 25% smaller tiles than 128; 192 and 256 are the two sizes above 128 whose O
// accumulator (W / 2 registers per thread with one m-tile per warp) and tiles fit every sm_80
// class GPU's forward. 160 and 224 would only shrink tiles, on dims no model we target uses,
// for 18 more instances. Keep in step with tools/codegen/gen_sm80_instances.py.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

#include "vidattn/tensor_view.h"

namespace vidattn::cuda_dispatch {

constexpr std::int64_t kMaxHeadDim = 256;

// Whether an sm_80 instance serves (D, Dv): both multiples of 8 in [8, 256].
inline bool sm80_head_dims_supported(std::int64_t d, std::int64_t dv) {
  auto ok = [](std::int64_t x) { return x >= 8 && x <= kMaxHeadDim && x % 8 == 0; };
  return ok(d) && ok(dv);
}

// Whether the sm_90a kernels of exact widths serve (D, Dv): D = Dv = 64 or 128. The backward
// and the block-sparse forward exist only at these; the dense forward has padded widths too.
inline bool sm90_exact_head_dims(std::int64_t d, std::int64_t dv) {
  return d == dv && (d == 64 || d == 128);
}

// The sm_90a dense forward: the exact widths, and padded instances of width 96, 128, 192 and 256
// (attention/sm90/fwd_config.h, padded_head_dim) for every other (D, Dv) with
// 64 < max(D, Dv) <= 256. Up to 64 (D = 8 .. 56, or Dv != D there) the portable kernels
// serve: no model we target uses those dims, and a width-64 padded instance would add four
// more instances for them.
inline bool sm90_dense_forward_head_dims(std::int64_t d, std::int64_t dv) {
  const std::int64_t m = d > dv ? d : dv;
  return sm90_exact_head_dims(d, dv) || (m > 64 && m <= kMaxHeadDim);
}

// fn(T{}, integral_constant<int, W>{}, bool_constant<kPadded>{}, integral_constant<int, Wv>{})
// for a (dtype, D, Dv) that sm90_dense_forward_head_dims admits: the exact instance, else the
// padded one of width W = Wv = the smallest of 96, 128, 192, 256 that is >= max(D, Dv), except
// that 128 < D <= 192 with Dv <= 128 takes W = 192, Wv = 128 (a third less P V work than
// 192 for both; D = 192 / Dv = 128 is a common pair), and that up to 128 a width of 64 for
// the narrower operand pair where it fits (W = 128 / Wv = 64, W = 64 / Wv = 128: half of one
// product skipped). The 96-wide tile (64-byte swizzle atoms, fwd_traits.h) serves 80 and 96
// with a quarter fewer products than the 128 tile: +10-16% at 96 (H100, 4096-32760 tokens,
// cross attention to 257 / 512 keys). Only where both dims are multiples of 16: at 72 (rows of
// 144 bytes, every other one starting mid-sector, read in 64-byte boxes) it ran 6% behind the
// 128 tile at 4096 tokens and on cross attention, +10% only on 32K-token self attention.
// Keep in step with tools/codegen/gen_sm90_instances.py.
template <class Fn>
void dispatch_sm90_dense_forward_head_dims(DType dtype, std::int64_t d, std::int64_t dv,
                                           Fn&& fn) {
  using I64 = std::integral_constant<int, 64>;
  using I96 = std::integral_constant<int, 96>;
  using I128 = std::integral_constant<int, 128>;
  using I192 = std::integral_constant<int, 192>;
  using I256 = std::integral_constant<int, 256>;
  auto with_width = [&](auto t) {
    using T = decltype(t);
    const std::int64_t m = d > dv ? d : dv;
    if (d == dv && m == 64) return fn(T{}, I64{}, std::false_type{}, I64{});
    if (d == dv && m == 128) return fn(T{}, I128{}, std::false_type{}, I128{});
    if (m <= 96 && d % 16 == 0 && dv % 16 == 0) return fn(T{}, I96{}, std::true_type{}, I96{});
    if (m <= 128 && dv <= 64) return fn(T{}, I128{}, std::true_type{}, I64{});
    if (m <= 128 && d <= 64) return fn(T{}, I64{}, std::true_type{}, I128{});
    if (m <= 128) return fn(T{}, I128{}, std::true_type{}, I128{});
    if (m <= 192 && dv <= 128) return fn(T{}, I192{}, std::true_type{}, I128{});
    if (m <= 192) return fn(T{}, I192{}, std::true_type{}, I192{});
    return fn(T{}, I256{}, std::true_type{}, I256{});
  };
  if (dtype == DType::kBFloat16) with_width(__nv_bfloat16{});
  else with_width(__half{});
}

// fn(T{}, integral_constant<int, W>{}, bool_constant<kPadded>{}) for a supported (dtype, D, Dv)
// (the caller checked sm80_head_dims_supported); the rule above.
template <class Fn>
void dispatch_sm80_head_dims(DType dtype, std::int64_t d, std::int64_t dv, Fn&& fn) {
  auto with_width = [&](auto t) {
    using T = decltype(t);
    const std::int64_t m = d > dv ? d : dv;
    if (d == dv && m == 64) return fn(T{}, std::integral_constant<int, 64>{}, std::false_type{});
    if (d == dv && m == 128) return fn(T{}, std::integral_constant<int, 128>{}, std::false_type{});
    if (m <= 64) return fn(T{}, std::integral_constant<int, 64>{}, std::true_type{});
    if (m <= 96) return fn(T{}, std::integral_constant<int, 96>{}, std::true_type{});
    if (m <= 128) return fn(T{}, std::integral_constant<int, 128>{}, std::true_type{});
    if (m <= 192) return fn(T{}, std::integral_constant<int, 192>{}, std::true_type{});
    return fn(T{}, std::integral_constant<int, 256>{}, std::true_type{});
  };
  if (dtype == DType::kBFloat16) with_width(__nv_bfloat16{});
  else with_width(__half{});
}

}  // namespace vidattn::cuda_dispatch
