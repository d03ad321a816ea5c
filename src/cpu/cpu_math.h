// Scalar building blocks of the CPU backend: dtype conversion, a vectorizable exp, and the
// block matrix products (BLAS when the build found one, plain loops otherwise).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <new>
#include <stdexcept>
#include <vector>

#include "../core/check.h"
#include "vidattn/tensor_view.h"

#if VIDATTN_HAVE_CBLAS
#include <cblas.h>
#endif

namespace vidattn::cpu {

// A working buffer of the CPU backend: n elements of T, each `fill`. The backend's copies of
// its inputs (packed in the accumulator type) come from here, outside parallel regions (no
// exception may leave one), so that a size that cannot be had raises an OutOfMemoryError
// naming the entry point `fn` and the buffer instead of a bare std::bad_alloc.
template <class T>
std::vector<T> working_buffer(const char* fn, const char* what, std::int64_t n, T fill = T()) {
  const auto bytes = static_cast<double>(n) * sizeof(T);
  try {
    return std::vector<T>(static_cast<std::size_t>(n), fill);
  } catch (const std::bad_alloc&) {
  } catch (const std::length_error&) {
  }
  throw OutOfMemoryError(detail::concat(
      fn, ": the CPU backend cannot allocate its working copy of ", what, " (", n,
      " elements, ", bytes / (1u << 30), " GiB); the CPU backend keeps a copy of each input in "
      "float32 (float64 for float64 inputs)"));
}

inline float bits_to_float(std::uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
inline std::uint32_t float_to_bits(float f) {
  std::uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}

inline float bf16_to_float(std::uint16_t h) { return bits_to_float(std::uint32_t(h) << 16); }

inline std::uint16_t float_to_bf16(float f) {  // round to nearest even; NaN stays NaN
  std::uint32_t u = float_to_bits(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return std::uint16_t((u >> 16) | 0x40);
  u += 0x7fffu + ((u >> 16) & 1u);
  return std::uint16_t(u >> 16);
}

inline float fp16_to_float(std::uint16_t h) {
  const std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  const std::uint32_t exp = (h >> 10) & 0x1fu;
  const std::uint32_t mant = h & 0x3ffu;
  if (exp == 0) {  // zero or subnormal: mant * 2^-24
    const float mag = float(mant) * 5.9604644775390625e-8f;
    return sign ? -mag : mag;
  }
  if (exp == 31) return bits_to_float(sign | 0x7f800000u | (mant << 13));
  return bits_to_float(sign | ((exp + 112u) << 23) | (mant << 13));
}

inline std::uint16_t float_to_fp16(float f) {  // round to nearest even
  std::uint32_t x = float_to_bits(f);
  const std::uint16_t sign = std::uint16_t((x >> 16) & 0x8000u);
  x &= 0x7fffffffu;
  if (x >= 0x7f800000u) return std::uint16_t(sign | 0x7c00u | (x > 0x7f800000u ? 0x200u : 0u));
  if (x >= 0x477ff000u) return std::uint16_t(sign | 0x7c00u);  // rounds past 65504
  if (x < 0x38800000u) {  // result is subnormal in fp16: mant = round(|f| * 2^24)
    const float mag = bits_to_float(x) * 16777216.0f;
    return std::uint16_t(sign | std::uint16_t(std::nearbyint(mag)));
  }
  x += 0xc8000fffu + ((x >> 13) & 1u);  // rebias exponent 127 -> 15, round to nearest even
  return std::uint16_t(sign | (x >> 13));
}

// Storage type of each float dtype, with loads to and stores from the accumulator type.
template <DType T>
struct Storage;
template <>
struct Storage<DType::kFloat32> {
  using type = float;
  template <class Acc> static Acc load(float x) { return Acc(x); }
  template <class Acc> static float store(Acc x) { return float(x); }
};
template <>
struct Storage<DType::kFloat64> {
  using type = double;
  template <class Acc> static Acc load(double x) { return Acc(x); }
  template <class Acc> static double store(Acc x) { return double(x); }
};
template <>
struct Storage<DType::kBFloat16> {
  using type = std::uint16_t;
  template <class Acc> static Acc load(std::uint16_t x) { return Acc(bf16_to_float(x)); }
  template <class Acc> static std::uint16_t store(Acc x) { return float_to_bf16(float(x)); }
};
template <>
struct Storage<DType::kFloat16> {
  using type = std::uint16_t;
  template <class Acc> static Acc load(std::uint16_t x) { return Acc(fp16_to_float(x)); }
  template <class Acc> static std::uint16_t store(Acc x) { return float_to_fp16(float(x)); }
};

// Calls fn(std::integral_constant<DType, T>{}) for the float dtype T of a tensor.
template <class Fn>
decltype(auto) visit_float_dtype(DType dtype, Fn&& fn) {
  switch (dtype) {
    case DType::kFloat64: return fn(std::integral_constant<DType, DType::kFloat64>{});
    case DType::kFloat16: return fn(std::integral_constant<DType, DType::kFloat16>{});
    case DType::kBFloat16: return fn(std::integral_constant<DType, DType::kBFloat16>{});
    default: return fn(std::integral_constant<DType, DType::kFloat32>{});
  }
}

// exp for the float path: Cephes' polynomial (about 1 ulp), written without branches so
// the softmax loops vectorize. Inputs below the float range (and -inf) give exactly 0.
inline float exp_approx(float x) {
  const bool underflow = x < -87.33654f;
  x = std::min(std::max(x, -87.33654f), 88.37626f);
  const float n = std::floor(x * 1.44269504088896341f + 0.5f);
  float r = x - n * 0.693359375f;
  r = r + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float y = p * r * r + r + 1.0f;
  const float scale = bits_to_float(std::uint32_t(std::int32_t(n) + 127) << 23);
  return underflow ? 0.0f : y * scale;
}
inline double exp_approx(double x) { return std::exp(x); }

// Row-major block products on contiguous buffers with leading dimensions.
// C[M x N] = A[M x K] * B[N x K]^T + beta * C
template <class T>
void gemm_nt(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc);
// C[M x N] = A[M x K] * B[K x N] + beta * C
template <class T>
void gemm_nn(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc);
// C[M x N] = A[K x M]^T * B[K x N] + beta * C
template <class T>
void gemm_tn(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc);

// vidattn runs one BLAS call per OpenMP thread: keep OpenBLAS from adding threads of its own.
inline void blas_use_one_thread() {
#if VIDATTN_HAVE_CBLAS && defined(OPENBLAS_VERSION)
  if (openblas_get_num_threads() != 1) openblas_set_num_threads(1);
#endif
}

#if VIDATTN_HAVE_CBLAS
inline void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K,
                      const float* A, int lda, const float* B, int ldb, float beta, float* C,
                      int ldc) {
  cblas_sgemm(CblasRowMajor, ta, tb, M, N, K, 1.0f, A, lda, B, ldb, beta, C, ldc);
}
inline void blas_gemm(CBLAS_TRANSPOSE ta, CBLAS_TRANSPOSE tb, int M, int N, int K,
                      const double* A, int lda, const double* B, int ldb, double beta, double* C,
                      int ldc) {
  cblas_dgemm(CblasRowMajor, ta, tb, M, N, K, 1.0, A, lda, B, ldb, beta, C, ldc);
}
template <class T>
void gemm_nt(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc) {
  if (M == 0 || N == 0) return;
  blas_gemm(CblasNoTrans, CblasTrans, M, N, K, A, lda, B, ldb, beta, C, ldc);
}
template <class T>
void gemm_nn(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc) {
  if (M == 0 || N == 0) return;
  blas_gemm(CblasNoTrans, CblasNoTrans, M, N, K, A, lda, B, ldb, beta, C, ldc);
}
template <class T>
void gemm_tn(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc) {
  if (M == 0 || N == 0) return;
  blas_gemm(CblasTrans, CblasNoTrans, M, N, K, A, lda, B, ldb, beta, C, ldc);
}
#else
template <class T>
void gemm_nt(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc) {
  for (int i = 0; i < M; ++i)
    for (int j = 0; j < N; ++j) {
      T acc = 0;
#pragma omp simd reduction(+ : acc)
      for (int k = 0; k < K; ++k) acc += A[i * lda + k] * B[j * ldb + k];
      C[i * ldc + j] = acc + (beta == T(0) ? T(0) : beta * C[i * ldc + j]);
    }
}
template <class T>
void gemm_nn(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc) {
  for (int i = 0; i < M; ++i) {
    T* c = C + i * ldc;
    for (int j = 0; j < N; ++j) c[j] = beta == T(0) ? T(0) : beta * c[j];
    for (int k = 0; k < K; ++k) {
      const T a = A[i * lda + k];
      const T* b = B + k * ldb;
#pragma omp simd
      for (int j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}
template <class T>
void gemm_tn(int M, int N, int K, const T* A, int lda, const T* B, int ldb, T beta, T* C,
             int ldc) {
  for (int i = 0; i < M; ++i) {
    T* c = C + i * ldc;
    for (int j = 0; j < N; ++j) c[j] = beta == T(0) ? T(0) : beta * c[j];
    for (int k = 0; k < K; ++k) {
      const T a = A[k * lda + i];
      const T* b = B + k * ldb;
#pragma omp simd
      for (int j = 0; j < N; ++j) c[j] += a * b[j];
    }
  }
}
#endif

}  // namespace vidattn::cpu
