// Warp-level building blocks shared by the kernels: tensor-core mma.sync m16n8k16 (fp32
// accumulation), ldmatrix, cp.async, a swizzled shared-memory tile layout, MUFU approximations
// and the row reductions over the four threads of an mma accumulator row.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace vidattn::cuda_common {

// ---- element types ----------------------------------------------------------------------

template <class T>
struct Mma;

template <>
struct Mma<__nv_bfloat16> {
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  // Two floats as one register of two elements, x in the low half (the lower column).
  __device__ static std::uint32_t pack(float x, float y) {
    __nv_bfloat162 h = __floats2bfloat162_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&h);
  }
  __device__ static float to_float(std::uint16_t bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  __device__ static std::uint16_t from_float(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
};

template <>
struct Mma<__half> {
  __device__ static void run(float (&c)[4], const std::uint32_t (&a)[4], std::uint32_t b0,
                             std::uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
  __device__ static std::uint32_t pack(float x, float y) {
    __half2 h = __floats2half2_rn(x, y);
    return *reinterpret_cast<std::uint32_t*>(&h);
  }
  __device__ static float to_float(std::uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  __device__ static std::uint16_t from_float(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
};

// ---- shared memory ----------------------------------------------------------------------

__device__ __forceinline__ std::uint32_t smem_addr(const void* p) {
  return static_cast<std::uint32_t>(__cvta_generic_to_shared(p));
}

// Tiles are [rows][WIDTH] 16-bit elements in 16-byte chunks; chunk c of row r is stored at
// chunk c ^ (r % 8), so that the 8 rows an ldmatrix reads (and the 16-byte cp.async
// writes of 8 consecutive rows) fall in distinct banks. That permutes chunks within groups
// of 8, so it needs WIDTH % 64 == 0. An odd multiple of 32 (WIDTH = 96: rows of 12 chunks)
// permutes within groups of 4 instead, by (r / 2) % 4: consecutive rows then start 4 chunks
// apart modulo the 8 chunks of a 128-byte bank line, so row parity supplies the third bit
// and 8 consecutive rows still hit 8 distinct bank slots.
template <int WIDTH>
__device__ __forceinline__ int swizzle(int row, int chunk) {
  static_assert(WIDTH % 32 == 0, "tile rows of a multiple of 32 elements");
  if constexpr (WIDTH % 64 == 0) {
    return row * WIDTH + ((chunk ^ (row & 7)) << 3);
  } else {
    return row * WIDTH + (((chunk & ~3) | ((chunk ^ (row >> 1)) & 3)) << 3);
  }
}

__device__ __forceinline__ void ldmatrix_x4(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

__device__ __forceinline__ void ldmatrix_x4_trans(std::uint32_t (&r)[4], std::uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}

// 16-byte asynchronous copy global -> shared; src_bytes = 0 zero-fills the destination.
__device__ __forceinline__ void cp_async_16(void* dst, const void* src, int src_bytes) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(smem_addr(dst)),
               "l"(src), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n"); }
__device__ __forceinline__ void cp_async_wait_all() {
  asm volatile("cp.async.wait_group 0;\n" ::: "memory");
}

// 2^x on the special-function unit (relative error ~2^-22, flushes denormal results to 0).
// Used for every exponential of the softmax, in the forward and the backward alike.
__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

// log2(x) and 1 / x on the special-function unit, without the range handling of __log2f and
// __fdividef: for arguments known to be normal and far from overflow (a softmax row's sum).
__device__ __forceinline__ float log2_approx(float x) {
  float y;
  asm("lg2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}
__device__ __forceinline__ float rcp_approx(float x) {
  float y;
  asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

constexpr float kLog2e = 1.4426950408889634f;

// Row max / sum over the 4 threads that share a row of an mma accumulator.
__device__ __forceinline__ float quad_max(float x) {
  x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
  return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x) {
  x += __shfl_xor_sync(0xffffffffu, x, 1);
  return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

}  // namespace vidattn::cuda_common
