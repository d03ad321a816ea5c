// Dense attention, forward and backward: the torch-free C++ API.
//
// Layouts (any strides on every dimension but the last, which must be unit-stride, so a
// [B, H, S, D] tensor passed as a transposed view works without a copy):
//   batched: q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv], out [B, Sq, Hq, Dv],
//            lse [B, Hq, Sq]
//   varlen (cu_seqlens_q and cu_seqlens_k given): q [Tq, Hq, D], k [Tk, Hkv, D],
//            v [Tk, Hkv, Dv], out [Tq, Hq, Dv], lse [Hq, Tq]; sequence i owns rows
//            cu_seqlens[i] .. cu_seqlens[i+1] of its tensor.
// Hq must be a multiple of Hkv (grouped heads: q head h reads kv head h / (Hq / Hkv)).
//
// LSE: natural-log log-sum-exp of the scaled scores, float32 (float64 when the inputs are
// float64, so that the float64 path is a reference to 1e-10). A query row that sees no key
// (all keys masked, Sk == 0, or a padded query) outputs 0 and has LSE -inf; it receives and
// contributes zero gradient. A NaN in q, or in k of a key the row sees, makes the row's output
// and LSE NaN; a NaN in v of a seen key reaches its column; values at masked positions never
// affect a result (docs/conventions.md, non-finite values).
//
// Varlen offsets: each cu_seqlens starts at 0, never decreases, ends at the rows of its
// tensor (q for cu_seqlens_q, k for cu_seqlens_k), and no sequence is longer than its
// max_seqlen; otherwise ValueError naming the argument. The CPU checks them on the host on
// every call.
//
// CUDA tensors: bfloat16 / float16 with D and Dv multiples of 8 from 8 to 256 (anything
// else throws NotImplementedError); the work is queued on options.stream. The varlen forward checks the
// offsets on the device (one small kernel and a 4-byte read-back, so one host
// synchronisation) and throws the CPU's ValueError, unless options.validate_index is false
// or the stream is being captured into a CUDA graph (no host synchronisation there): the
// rule of the block-sparse index (vidattn/vsa.h). The backward never checks (its offsets
// come from a checked forward). Unchecked, offsets are clamped to the rows of q / k and
// lengths to max_seqlen_*, so bad offsets cannot access out of bounds but give wrong results
// for the sequences concerned. Nothing else synchronises with the host.
#pragma once

#include <cstdint>
#include <optional>

#include "vidattn/tensor_view.h"

namespace vidattn {

struct AttentionOptions {
  std::optional<double> scale;  // softmax scale; default 1 / sqrt(D)
  // Causal, aligned to the bottom-right corner when Sq != Sk (FlashAttention's rule):
  // query i sees key j iff j <= i + Sk - Sq (per sequence in varlen mode).
  bool causal = false;
  std::optional<TensorView> key_padding_mask;    // bool [B, Sk], true = valid key
  std::optional<TensorView> query_padding_mask;  // bool [B, Sq], true = valid query
  std::optional<TensorView> cu_seqlens_q;        // int32 [N + 1]; selects varlen mode
  std::optional<TensorView> cu_seqlens_k;        // int32 [N + 1]
  std::int64_t max_seqlen_q = 0;                 // varlen: longest q sequence
  std::int64_t max_seqlen_k = 0;                 // varlen: longest k sequence
  // Backward: true gives the same bits on every run. false lets the CUDA Hopper backward add
  // dQ in an order that varies between runs (faster); the CPU and the portable CUDA backward
  // are deterministic either way.
  bool deterministic = true;
  // Varlen forward on CUDA: check cu_seqlens_q / cu_seqlens_k on the device first (one host
  // synchronisation; skipped during CUDA-graph capture). False for offsets known to be valid
  // (e.g. built by vidattn itself); the CPU always checks (no synchronisation there).
  bool validate_index = true;
  int num_threads = 0;                           // CPU worker threads; 0 = runtime default
  void* stream = nullptr;                        // CUDA: cudaStream_t to run on
};

// What a validated call computes; returned by describe_attention.
struct AttentionProblem {
  bool varlen = false;
  std::int64_t batch = 0;       // B, or the number of sequences in varlen mode
  std::int64_t seqlen_q = 0;    // Sq, or max_seqlen_q in varlen mode
  std::int64_t seqlen_k = 0;    // Sk, or max_seqlen_k in varlen mode
  std::int64_t total_q = 0;     // rows of q (B * Sq when batched)
  std::int64_t heads_q = 0;
  std::int64_t heads_kv = 0;
  std::int64_t head_dim = 0;    // D of q and k
  std::int64_t head_dim_v = 0;  // Dv of v and out
  double scale = 0.0;
  bool causal = false;
  DType dtype = DType::kFloat32;
  DType lse_dtype = DType::kFloat32;
  Device device{};

  // Shapes of the outputs the caller must allocate.
  int out_ndim() const { return varlen ? 3 : 4; }
  void out_shape(std::int64_t* shape) const;  // out_ndim() entries
  int lse_ndim() const { return varlen ? 2 : 3; }
  void lse_shape(std::int64_t* shape) const;  // lse_ndim() entries
};

// Checks q, k, v and the options (shapes, dtypes, devices, strides) without touching
// tensor data, and says what the call computes. Throws ValueError / TypeError.
AttentionProblem describe_attention(const TensorView& q, const TensorView& k,
                                    const TensorView& v, const AttentionOptions& options);

// out and lse are written in full (every element, including rows that see no key).
void attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                       const TensorView& out, const TensorView& lse,
                       const AttentionOptions& options);

// dq, dk, dv have the shapes of q, k, v (any strides, unit-stride last dimension) and are
// written in full. out and lse are the forward's outputs; the result is deterministic unless
// options.deterministic is false.
void attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                        const TensorView& out, const TensorView& lse,
                        const TensorView& grad_out, const TensorView& dq,
                        const TensorView& dk, const TensorView& dv,
                        const AttentionOptions& options);

}  // namespace vidattn
