// The last step of VSA in one pass: out = fine + gate * coarse broadcast over each tile's
// valid slots. Written out of place with torch ops it is four full-size passes (broadcast,
// padding mask, gate product, sum); fused it reads fine and gate once and writes out once,
// which matters because at 90% sparsity the fine attention itself is only ~10x the traffic.
#pragma once

#include <cstdint>
#include <optional>

#include "vidattn/tensor_view.h"

namespace vidattn {

// out[b, s, h] = fine[b, s, h] + g[b, s, h] * coarse[b, s / V, h] where slot s is valid
// (s % V < block_sizes[s / V]), and out = fine on padded slots. g = gate, or 1 without one.
// fine, gate, out [B, Tiles * V, H, D]; coarse [B, Tiles, H, D]; block_sizes int32 [Tiles]
// on the same device; one float dtype throughout; unit-stride last dimensions. Throws
// ValueError / TypeError. `stream` is the CUDA stream (cudaStream_t) for GPU tensors.
void vsa_combine(const TensorView& fine, const TensorView& coarse,
                 const std::optional<TensorView>& gate, const TensorView& block_sizes,
                 std::int64_t tile_volume, const TensorView& out, int num_threads = 0,
                 void* stream = nullptr);

// Its backward for coarse and gate (the fine branch's gradient is grad_out itself):
//   grad_coarse[b, t, h] = sum over valid slots s of tile t of grad_out[b, s, h] * g[b, s, h]
//                          (float32 sums; float64 for float64)
//   grad_gate[b, s, h]   = grad_out[b, s, h] * coarse[b, s / V, h] on valid slots, else 0
// grad_gate is written only when given (and then gate must be given too).
void vsa_combine_backward(const TensorView& grad_out, const TensorView& coarse,
                          const std::optional<TensorView>& gate, const TensorView& block_sizes,
                          std::int64_t tile_volume, const TensorView& grad_coarse,
                          const std::optional<TensorView>& grad_gate, int num_threads = 0,
                          void* stream = nullptr);

// The same combination on rows in raster order, for callers that hold a contiguous run of a
// video's tokens rather than its tiles: the sequence-parallel layer combines on each rank's
// own rows, so the gate never crosses the link and only the small coarse output does.
// Row r of fine, gate and out holds token first_token + r; token t lies in slot
// token_to_slot[t] of the tiled layout, i.e. in tile token_to_slot[t] / V:
//   out[b, r, h] = fine[b, r, h] + g[b, r, h] * coarse[b, tile(first_token + r), h]
// Rows whose token is >= num_tokens (= token_to_slot's length) are padding: out = fine.
// fine, gate, out [B, R, H, D], one float dtype; coarse [B, Tiles, H, D] in that dtype or in
// float32 (exact sums across ranks, below); token_to_slot int32 [num_tokens], slot_to_token
// int32 [Tiles * V] (-1 on padded slots): the maps of one VideoTiling, trusted as built
// (CPU checks them; CUDA kernels treat a slot out of range as padding).
void vsa_combine_rows(const TensorView& fine, const TensorView& coarse,
                      const std::optional<TensorView>& gate, const TensorView& token_to_slot,
                      const TensorView& slot_to_token, std::int64_t tile_volume,
                      std::int64_t first_token, const TensorView& out, int num_threads = 0,
                      void* stream = nullptr);

// Its backward: grad_coarse (coarse's dtype) sums, per tile, grad_out * g over the tile's
// tokens that lie in this range of rows (float32 sums, float64 for float64; 0 for a tile with
// none), so that the partial sums of ranks holding different rows add up to the whole;
// grad_gate = grad_out * coarse on token rows and 0 on padding rows.
void vsa_combine_rows_backward(const TensorView& grad_out, const TensorView& coarse,
                               const std::optional<TensorView>& gate,
                               const TensorView& token_to_slot, const TensorView& slot_to_token,
                               std::int64_t tile_volume, std::int64_t first_token,
                               const TensorView& grad_coarse,
                               const std::optional<TensorView>& grad_gate, int num_threads = 0,
                               void* stream = nullptr);

}  // namespace vidattn
