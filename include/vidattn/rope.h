// Rotary position embedding (RoPE), applied out of place: the torch-free C++ API.
//
// x and out are [B, S, H, D] (any strides, unit stride on D; D even). Each head vector is cut
// into D/2 pairs (a, b), rotated by the angle of their position s:
//   interleaved = true  (GPT-J / original LLaMA layout): pair i is (2i, 2i + 1)
//   interleaved = false (GPT-NeoX "rotate half" layout):  pair i is (i, i + D/2)
//
// cos and sin are tables of the angles, [S, D/2] or [S, D] (any strides, any float dtype,
// both the same shape and dtype):
//   [S, D/2]: pair i uses cos[s, i] and sin[s, i] for both of its members;
//   [S, D]:   every element j uses its own entry cos[s, j], sin[s, j] (the full-width tables
//             models build by repeating each angle, e.g. cat([f, f]) for NeoX halves or
//             repeat_interleave(f, 2) for interleaved pairs):
//               out[a] = x[a] * cos[s, a] - x[b] * sin[s, a]
//               out[b] = x[b] * cos[s, b] + x[a] * sin[s, b]
//             which is the usual x * cos + rotate(x) * sin; when both members hold the same
//             angle it is the rotation of the pair by that angle.
// Math in float32 (float64 for float64 x); out has x's dtype.
//
// transpose = true applies the transposed (adjoint) map, which is the backward of the
// forward one: for a pair with one angle, the rotation by -angle:
//   out[a] = x[a] * cos[s, a] + x[b] * sin[s, b]
//   out[b] = x[b] * cos[s, b] - x[a] * sin[s, a]
#pragma once

#include <cstdint>

#include "vidattn/tensor_view.h"

namespace vidattn {

struct RopeOptions {
  bool interleaved = true;  // pairs (2i, 2i + 1); false: pairs (i, i + D/2)
  bool transpose = false;   // apply the adjoint map (the backward)
  int num_threads = 0;      // CPU worker threads; 0 = runtime default
  void* stream = nullptr;   // CUDA: cudaStream_t to run on
};

// What a validated call computes; returned by describe_rope.
struct RopeProblem {
  std::int64_t batch = 0, seqlen = 0, heads = 0, head_dim = 0;
  bool half_table = false;  // cos / sin are [S, D/2] (else [S, D])
  DType dtype = DType::kFloat32;
  DType table_dtype = DType::kFloat32;
  Device device{};
};

// Checks x, cos and sin (shapes, dtypes, devices, strides) without touching data.
// Throws ValueError / TypeError naming the argument.
RopeProblem describe_rope(const TensorView& x, const TensorView& cos, const TensorView& sin,
                          const RopeOptions& options);

// Writes every element of out ([B, S, H, D], x's dtype and device, unit stride on D; it must
// not overlap x unless it is x itself).
void apply_rope(const TensorView& x, const TensorView& cos, const TensorView& sin,
                const TensorView& out, const RopeOptions& options);

}  // namespace vidattn
