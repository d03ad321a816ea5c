// CPU RoPE: threads over (batch, position) rows. Each row converts its cos / sin entries to
// the accumulator type once and reuses them for every head.
#include <omp.h>

#include <type_traits>
#include <vector>

#include "../core/rope_backends.h"
#include "cpu_math.h"

namespace vidattn::detail {
namespace {

using cpu::Storage;
using cpu::visit_float_dtype;

// Below this many elements the thread start-up costs more than the work.
constexpr std::int64_t kMinElementsPerThread = 1 << 15;

template <DType XT, DType CT>
void run(const RopeProblem& p, const TensorView& x, const TensorView& cos, const TensorView& sin,
         const TensorView& out, const RopeOptions& o) {
  using XS = Storage<XT>;
  using CS = Storage<CT>;
  using X = typename XS::type;
  using C = typename CS::type;
  using Acc = std::conditional_t<XT == DType::kFloat64, double, float>;

  const std::int64_t half = p.head_dim / 2;
  const std::int64_t rows = p.batch * p.seqlen;
  const std::int64_t work = rows * p.heads * p.head_dim;
  const int max_threads = o.num_threads > 0 ? o.num_threads : omp_get_max_threads();
  const int threads = static_cast<int>(
      std::max<std::int64_t>(1, std::min<std::int64_t>(max_threads, work / kMinElementsPerThread)));
  // Element i of pair k: a = first(k), b = second(k).
  const std::int64_t a_step = o.interleaved ? 2 : 1, b_offset = o.interleaved ? 1 : half;
  const auto* x_data = static_cast<const X*>(x.data);
  auto* out_data = static_cast<X*>(out.data);
  const auto* cos_data = static_cast<const C*>(cos.data);
  const auto* sin_data = static_cast<const C*>(sin.data);

#pragma omp parallel num_threads(threads)
  {
    // Per pair: the cos / sin each member uses (equal for [S, D/2] tables).
    std::vector<Acc> cos_a(half), sin_a(half), cos_b(half), sin_b(half);
#pragma omp for schedule(static)
    for (std::int64_t r = 0; r < rows; ++r) {
      const std::int64_t b = r / p.seqlen, s = r % p.seqlen;
      const C* c_row = cos_data + s * cos.stride[0];
      const C* s_row = sin_data + s * sin.stride[0];
      for (std::int64_t k = 0; k < half; ++k) {
        const std::int64_t ja = p.half_table ? k : k * a_step;
        const std::int64_t jb = p.half_table ? k : k * a_step + b_offset;
        cos_a[k] = CS::template load<Acc>(c_row[ja * cos.stride[1]]);
        sin_a[k] = CS::template load<Acc>(s_row[ja * sin.stride[1]]);
        cos_b[k] = CS::template load<Acc>(c_row[jb * cos.stride[1]]);
        sin_b[k] = CS::template load<Acc>(s_row[jb * sin.stride[1]]);
      }
      for (std::int64_t h = 0; h < p.heads; ++h) {
        const X* xp = x_data + b * x.stride[0] + s * x.stride[1] + h * x.stride[2];
        X* op = out_data + b * out.stride[0] + s * out.stride[1] + h * out.stride[2];
        for (std::int64_t k = 0; k < half; ++k) {
          const std::int64_t ia = k * a_step, ib = ia + b_offset;
          const Acc xa = XS::template load<Acc>(xp[ia]);
          const Acc xb = XS::template load<Acc>(xp[ib]);
          Acc ya, yb;
          if (o.transpose) {
            ya = xa * cos_a[k] + xb * sin_b[k];
            yb = xb * cos_b[k] - xa * sin_a[k];
          } else {
            ya = xa * cos_a[k] - xb * sin_a[k];
            yb = xb * cos_b[k] + xa * sin_b[k];
          }
          op[ia] = XS::template store<Acc>(ya);
          op[ib] = XS::template store<Acc>(yb);
        }
      }
    }
  }
}

}  // namespace

void cpu_rope(const RopeProblem& p, const TensorView& x, const TensorView& cos,
              const TensorView& sin, const TensorView& out, const RopeOptions& options) {
  visit_float_dtype(p.dtype, [&](auto xt) {
    visit_float_dtype(p.table_dtype, [&](auto ct) {
      run<decltype(xt)::value, decltype(ct)::value>(p, x, cos, sin, out, options);
    });
  });
}

}  // namespace vidattn::detail
