// AVX2/FMA register-blocked products for the float forward path: 6 rows x 16 columns of
// accumulators (12 ymm registers) per tile, the shape that keeps both FMA pipes busy while
// loads stay under two per cycle. They replace BLAS calls on small attention blocks, where
// BLAS spends much of its time packing operands it sees only once.
#pragma once

#if defined(__AVX2__) && defined(__FMA__)
#define VIDATTN_CPU_AVX2 1
#include <immintrin.h>

#include <algorithm>

namespace vidattn::cpu::avx2 {

constexpr int kRows = 6;   // rows per register tile
constexpr int kPanel = 16; // columns per register tile; K is packed in panels this wide

// Packs rows [0, n) of a row-major [n x dim] matrix into panels of kPanel rows, each stored
// dimension-major ([dim][kPanel]), zero-padded to a whole panel.
inline void pack_panels(const float* src, int n, int dim, float* dst) {
  for (int p = 0; p < n; p += kPanel) {
    float* panel = dst + static_cast<long>(p) * dim;
    const int width = std::min(kPanel, n - p);
    for (int d = 0; d < dim; ++d) {
      for (int c = 0; c < width; ++c) panel[d * kPanel + c] = src[static_cast<long>(p + c) * dim + d];
      for (int c = width; c < kPanel; ++c) panel[d * kPanel + c] = 0.0f;
    }
  }
}

// C[MR x 16] (+)= A[MR x K] * B[K x 16], B row-major with leading dim ldb (kPanel for a
// packed panel); kAccumulate adds to C instead of overwriting it.
template <int MR, bool kAccumulate>
inline void gemm_tile(int K, const float* A, int lda, const float* B, long ldb, float* C,
                      int ldc) {
  __m256 acc[MR][2];
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    acc[r][0] = kAccumulate ? _mm256_loadu_ps(C + r * ldc) : _mm256_setzero_ps();
    acc[r][1] = kAccumulate ? _mm256_loadu_ps(C + r * ldc + 8) : _mm256_setzero_ps();
  }
  for (int k = 0; k < K; ++k) {
    const __m256 b0 = _mm256_loadu_ps(B + k * ldb);
    const __m256 b1 = _mm256_loadu_ps(B + k * ldb + 8);
#pragma GCC unroll 6
    for (int r = 0; r < MR; ++r) {
      const __m256 a = _mm256_broadcast_ss(A + r * lda + k);
      acc[r][0] = _mm256_fmadd_ps(a, b0, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(a, b1, acc[r][1]);
    }
  }
#pragma GCC unroll 6
  for (int r = 0; r < MR; ++r) {
    _mm256_storeu_ps(C + r * ldc, acc[r][0]);
    _mm256_storeu_ps(C + r * ldc + 8, acc[r][1]);
  }
}

template <class Tile>
inline void for_row_tiles(int rows, Tile&& tile) {
  int r = 0;
  for (; r + kRows <= rows; r += kRows) tile(r, std::integral_constant<int, kRows>{});
  switch (rows - r) {
    case 5: tile(r, std::integral_constant<int, 5>{}); break;
    case 4: tile(r, std::integral_constant<int, 4>{}); break;
    case 3: tile(r, std::integral_constant<int, 3>{}); break;
    case 2: tile(r, std::integral_constant<int, 2>{}); break;
    case 1: tile(r, std::integral_constant<int, 1>{}); break;
    default: break;
  }
}

// S[rows x 16*panels] = A[rows x K] * (panels of B)^T, B packed by pack_panels.
inline void gemm_nt_panels(int rows, int panels, int K, const float* A, int lda,
                           const float* packed_b, float* S, int lds) {
  for (int p = 0; p < panels; ++p)
    for_row_tiles(rows, [&](int r, auto mr) {
      gemm_tile<decltype(mr)::value, false>(K, A + r * lda, lda,
                                            packed_b + static_cast<long>(p) * kPanel * K, kPanel,
                                            S + r * lds + p * kPanel, lds);
    });
}

// C[rows x N] += A[rows x K] * B[K x N], B row-major (ldb); columns past the last whole
// 16-wide tile take a scalar loop.
inline void gemm_nn_acc(int rows, int N, int K, const float* A, int lda, const float* B,
                        int ldb, float* C, int ldc) {
  int c = 0;
  for (; c + kPanel <= N; c += kPanel)
    for_row_tiles(rows, [&](int r, auto mr) {
      gemm_tile<decltype(mr)::value, true>(K, A + r * lda, lda, B + c, ldb, C + r * ldc + c,
                                           ldc);
    });
  for (int r = 0; r < rows; ++r)
    for (int k = 0; k < K; ++k) {
      const float a = A[r * lda + k];
      for (int j = c; j < N; ++j) C[r * ldc + j] += a * B[static_cast<long>(k) * ldb + j];
    }
}

// exp of 8 floats: the polynomial of cpu::exp_approx (same constants, same results up to
// FMA contraction); inputs below the float range, -inf included, give exactly 0.
inline __m256 exp8(__m256 x) {
  const __m256 underflow = _mm256_cmp_ps(x, _mm256_set1_ps(-87.33654f), _CMP_LT_OQ);
  // MAXPS/MINPS return their second operand when either is NaN: x goes second, so that a NaN
  // logit stays NaN (docs/conventions.md, non-finite values) at no extra instruction.
  x = _mm256_min_ps(_mm256_set1_ps(88.37626f), _mm256_max_ps(_mm256_set1_ps(-87.33654f), x));
  const __m256 n = _mm256_floor_ps(
      _mm256_fmadd_ps(x, _mm256_set1_ps(1.44269504088896341f), _mm256_set1_ps(0.5f)));
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fmadd_ps(n, _mm256_set1_ps(2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  const __m256 y = _mm256_add_ps(_mm256_fmadd_ps(_mm256_mul_ps(p, r), r, r), _mm256_set1_ps(1.0f));
  const __m256i bits = _mm256_slli_epi32(
      _mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_andnot_ps(underflow, _mm256_mul_ps(y, _mm256_castsi256_ps(bits)));
}

inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

inline float hmax8(__m256 v) {
  __m128 s = _mm_max_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_max_ps(s, _mm_movehl_ps(s, s));
  s = _mm_max_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

// max of s[0, n), -inf for n == 0.
inline float row_max(const float* s, int n) {
  __m256 m = _mm256_set1_ps(-__builtin_inff());
  int x = 0;
  for (; x + 8 <= n; x += 8) m = _mm256_max_ps(m, _mm256_loadu_ps(s + x));
  float result = hmax8(m);
  for (; x < n; ++x) result = std::max(result, s[x]);
  return result;
}

// s[x] = exp(s[x] - shift) for x in [0, n); returns the sum of the new values.
inline float exp_shift_sum(float* s, int n, float shift) {
  const __m256 vshift = _mm256_set1_ps(shift);
  __m256 sum = _mm256_setzero_ps();
  int x = 0;
  for (; x + 8 <= n; x += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(s + x), vshift));
    _mm256_storeu_ps(s + x, e);
    sum = _mm256_add_ps(sum, e);
  }
  if (x < n) {  // tail: pad with -inf, which exp8 maps to 0
    alignas(32) float tail[8];
    for (int i = 0; i < 8; ++i) tail[i] = x + i < n ? s[x + i] - shift : -__builtin_inff();
    const __m256 e = exp8(_mm256_load_ps(tail));
    _mm256_store_ps(tail, e);
    for (int i = 0; x + i < n; ++i) s[x + i] = tail[i];
    sum = _mm256_add_ps(sum, e);
  }
  return hsum8(sum);
}

}  // namespace vidattn::cpu::avx2
#endif
