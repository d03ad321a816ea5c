// Video Sparse Attention (VSA) building blocks: video tiling, the coarse stage (tile mean
// pooling, top-k tile selection) and index-native block-sparse attention. Torch-free; every
// tensor is a TensorView. The algorithm follows the project's VSA spec (docs/vsa.md);
// the attention itself runs on the same CPU mainloop as dense attention (attention_cpu.cpp).
//
// Tiled layout. A T x H x W token grid (raster order) is cut into tiles of tile.t x tile.h x
// tile.w tokens, t-major then h then w; edge tiles are truncated. Tile i owns the slots
// [i * V, (i + 1) * V) of the tiled layout (V = tile volume, 64, 128 or 256): its valid tokens
// first, in raster order, then padding. block_sizes[i] (int32) is the number of valid tokens.
// Several videos can be packed back to back ("packed" / varlen): their tiles, slots and tokens
// are concatenated; cu_tiles and cu_tokens (int32 [N + 1]) give each video's range.
//
// Block-sparse index format (per batch b and query head h):
//   q2k_index int32 [B, Hq, Qtiles, MaxK]: the key tiles query tile t attends, strictly
//             ascending in the first q2k_count[b, h, t] slots; later slots are ignored
//             (the selection ops fill them with -1).
//   q2k_count int32 [B, Hq, Qtiles], each in [0, MaxK].
// Its transpose for the dK/dV pass is compressed by key tile (CSR), built with a counting
// pass and no sorting, in a fixed order (ascending query tile), so the backward is
// deterministic:
//   k2q_offsets int32 [B, Hq, KVtiles + 1]: the query tiles that selected key tile j are
//             k2q_index[b, h, k2q_offsets[b, h, j] : k2q_offsets[b, h, j + 1]], ascending.
//   k2q_index   int32 [B, Hq, Qtiles * MaxK]; entries past k2q_offsets[b, h, KVtiles] are -1.
//
// Decisions:
// - A query tile with count 0 (or with block size 0) outputs zeros with LSE -inf (like a dense
//   row that sees no key) and gets zero dQ.
// - Padded query slots (slots >= block_sizes of their tile) output 0 with LSE -inf and get
//   zero dQ; padded key slots are never attended and get zero dK, dV. Inputs in padded slots
//   are never attended, so their content does not matter as long as it is finite (query
//   slots may even hold NaN). Finite, because the Hopper forward multiplies the V rows of
//   padded key slots by an exact-zero probability, and 0 * NaN is NaN; VideoTiling.tile
//   writes zeros there. Its 64-token kernel also loads only the valid prefix of a partial
//   key tile, beside rows that an earlier tile left in shared memory: a non-finite V value
//   can then reach the outputs of query tiles that did not select its tile.
// - Zero-size key tiles in the index are skipped (no exp(-inf - -inf)).
// - A key tile no query selected gets exactly zero dK, dV.
// - The CPU backward is always deterministic. On CUDA `deterministic = true` keeps it so (no
//   atomics on dQ, dK, dV; k2q built in a fixed order); false lets the Hopper backward of
//   128- and 256-token tiles reduce dQ in an order that varies (faster; 64-token tiles and
//   the portable kernels stay deterministic).
//
// CUDA backend (bfloat16 / float16, D and Dv multiples of 8 up to 256, tile volumes 64 / 128 /
// 256, GQA):
// - Index validation. The CPU checks the index on the host. On CUDA, the forward and the
//   transpose run a small device kernel over the index (counts in [0, MaxK], ids in range and
//   strictly ascending, block sizes in [0, V]) and copy its 8-byte verdict to the host, which
//   waits for the stream, then throw the same ValueError as the CPU. While the stream is being
//   captured into a CUDA graph the check is skipped (no host synchronisation there), and the
//   backward never checks (its index comes from a checked forward and transpose).
//   `validate_index = false` skips it too: video_sparse_attention passes it for the index
//   its own top-k built, so an eager VSA step does not wait on the host either. Unchecked,
//   the kernels still never read outside the tensors: ids outside [0, KVtiles) are skipped,
//   counts and k2q offsets are clamped; a non-ascending row then only gives wrong numbers.
// - Nothing else synchronises with the host: the forward + backward is capturable.
#pragma once

#include <cstdint>
#include <optional>
#include <vector>

#include "vidattn/tensor_view.h"

namespace vidattn {

// ---- tiling -------------------------------------------------------------------------

struct VideoGrid {
  std::int64_t t = 1, h = 1, w = 1;
  std::int64_t numel() const { return t * h * w; }
};

struct TileShape {
  std::int64_t t = 4, h = 4, w = 4;
  std::int64_t volume() const { return t * h * w; }
};

// Tile volumes VSA supports (and every entry point checks).
bool is_supported_tile_volume(std::int64_t volume);

// Sizes of a packed tiling of one or more videos (host integers, known at construction).
struct TilingLayout {
  TileShape tile;
  std::vector<VideoGrid> grids;
  std::vector<std::int64_t> tiles_per_video;  // per video: number of tiles
  std::int64_t num_tiles = 0;                 // all videos
  std::int64_t num_tokens = 0;                // all videos, sum of T * H * W
  std::int64_t padded_len() const { return num_tiles * tile.volume(); }
  std::int64_t max_tiles_per_video() const;
};

// Validates the grids (each dimension >= 1) and the tile (volume 64, 128 or 256; every
// dimension >= 1). Throws ValueError.
TilingLayout describe_tiling(const std::vector<VideoGrid>& grids, TileShape tile);

// Fills the tiling's metadata into host (CPU) int32 tensors, contiguous:
//   block_sizes   [num_tiles]      valid tokens per tile
//   slot_to_token [padded_len]     raster token of each slot, -1 for padding
//   token_to_slot [num_tokens]     slot of each raster token
//   cu_tiles      [N + 1], cu_tokens [N + 1]  per-video offsets (0 first)
void tiling_metadata(const TilingLayout& layout, const TensorView& block_sizes,
                     const TensorView& slot_to_token, const TensorView& token_to_slot,
                     const TensorView& cu_tiles, const TensorView& cu_tokens);

// out[b, i] = x[b, index[i]] for index[i] >= 0, else zeros; x [B, S, H, D], index int32 [N],
// out [B, N, H, D]. tile = gather with slot_to_token, untile = gather with token_to_slot; the
// backward of one is the other. Indices must lie in [-1, S) (checked on the CPU; on CUDA,
// where a check would need a host sync, rows with other indices come out as zeros).
// `stream` (a cudaStream_t) orders the CUDA kernels of this and the coarse-stage functions
// below; nullptr is the default stream. No CUDA path synchronises with the host.
void gather_tokens(const TensorView& x, const TensorView& index, const TensorView& out,
                   int num_threads = 0, void* stream = nullptr);

// ---- coarse stage -------------------------------------------------------------------

// out[b, i, h] = (sum of the first block_sizes[i] slots of tile i of x) / block_sizes[i],
// summed in float32 (float64 for float64); a tile of size 0 gives 0.
// x [B, Tiles * V, H, D] (tiled), block_sizes int32 [Tiles], out [B, Tiles, H, D], same dtype.
// Block sizes must lie in [0, V] (checked on the CPU; clamped to it on CUDA).
void tile_mean_pool(const TensorView& x, const TensorView& block_sizes, std::int64_t tile_volume,
                    const TensorView& out, int num_threads = 0, void* stream = nullptr);

// The pool's backward: grad_x[b, slot] = grad_out[b, tile] / block_sizes[tile] for valid slots,
// 0 for padding. grad_out [B, Tiles, H, D], grad_x [B, Tiles * V, H, D].
void tile_mean_pool_backward(const TensorView& grad_out, const TensorView& block_sizes,
                             std::int64_t tile_volume, const TensorView& grad_x,
                             int num_threads = 0, void* stream = nullptr);

// clamp(ceil((1 - sparsity) * num_kv_tiles), 1, num_kv_tiles); sparsity in [0, 1]. A 1e-9 slack
// inside the ceil keeps float noise from adding a tile ((1 - 0.8) * 10 gives 2, not 3).
std::int64_t topk_from_sparsity(double sparsity, std::int64_t num_kv_tiles);

struct TopkOptions {
  std::int64_t topk = 1;          // >= 1; MaxK of the output
  // When set, row r of video i selects topk_from_sparsity(sparsity, kv tiles of video i)
  // (at most topk) instead of min(topk, kv tiles of video i).
  std::optional<double> sparsity;
  std::optional<double> scale;    // coarse score scale; default 1 / sqrt(D)
  // Packed videos: int32 [N + 1] tile offsets of the queries and keys. A query tile of video i
  // only selects key tiles of video i (indices stay global). Needs B == 1. The offsets are
  // checked on the CPU (start at 0, non-decreasing, end at the tile counts); on CUDA they are
  // clamped to the tile counts and a query tile outside every video gets count 0.
  std::optional<TensorView> cu_tiles_q, cu_tiles_k;
  int num_threads = 0;
  void* stream = nullptr;  // cudaStream_t of the CUDA kernels
};

// Output shape of the selection: MaxK = min(topk, Ktiles).
std::int64_t topk_max_k(std::int64_t topk, std::int64_t num_kv_tiles);

// Top-k key tiles per query tile from the coarse scores s = scale * q_pooled k_pooled^T
// (float32; float64 for float64), with the q2k format above. Exactly min(k_row, key tiles)
// per row; ties go to the lowest tile index; a row of all -inf (NaN counts as -inf) picks the
// first tiles. q_pooled [B, Qtiles, Hq, D], k_pooled [B, Ktiles, Hkv, D] (Hq multiple of Hkv);
// q2k_index [B, Hq, Qtiles, MaxK], q2k_count [B, Hq, Qtiles].
void select_topk_tiles(const TensorView& q_pooled, const TensorView& k_pooled,
                       const TopkOptions& options, const TensorView& q2k_index,
                       const TensorView& q2k_count);

// The same selection from given scores [B, H, Qtiles, Ktiles] (float dtype).
void topk_tiles_from_scores(const TensorView& scores, std::int64_t topk,
                            const TensorView& q2k_index, const TensorView& q2k_count,
                            int num_threads = 0, void* stream = nullptr);

// ---- block-sparse attention ---------------------------------------------------------

struct BlockSparseOptions {
  std::int64_t tile_volume = 64;
  std::optional<TensorView> q_block_sizes;   // int32 [Qtiles]; default: every tile full
  std::optional<TensorView> kv_block_sizes;  // int32 [KVtiles]; default: every tile full
  std::optional<double> scale;               // default 1 / sqrt(D)
  bool deterministic = true;                 // the CPU is always deterministic
  // CUDA: check the index on the device before use, which costs one host synchronisation.
  // False for an index vidattn built itself (select_topk_tiles in video_sparse_attention);
  // the CPU always checks (no synchronisation there).
  bool validate_index = true;
  // CUDA on Hopper: streaming multiprocessors the forward kernel leaves free for kernels
  // running alongside: > 0 runs it on a persistent grid of (SMs - sm_margin) CTAs (never
  // fewer than one). With 0 (default), 64-token tiles run on a persistent grid of one CTA per
  // SM whose query tiles are handed out as CTAs free up, and 128 / 256-token tiles launch one
  // CTA per tile, which the hardware places as SMs free up. Ignored by the other backends.
  int sm_margin = 0;
  int num_threads = 0;
  void* stream = nullptr;  // cudaStream_t for CUDA tensors (null: the legacy default stream)
};

struct BlockSparseProblem {
  std::int64_t batch = 0, seqlen_q = 0, seqlen_k = 0;
  std::int64_t q_tiles = 0, kv_tiles = 0, max_k = 0, tile_volume = 0;
  std::int64_t heads_q = 0, heads_kv = 0, head_dim = 0, head_dim_v = 0;
  double scale = 0.0;
  DType dtype = DType::kFloat32;
  DType lse_dtype = DType::kFloat32;
  Device device{};
};

// q [B, Sq, Hq, D], k [B, Sk, Hkv, D], v [B, Sk, Hkv, Dv] in the tiled layout (Sq, Sk
// multiples of the tile volume; unit-stride last dimension), the q2k index as above.
// Checks metadata only (shapes, dtypes, devices). Throws ValueError / TypeError.
BlockSparseProblem describe_block_sparse_attention(const TensorView& q, const TensorView& k,
                                                   const TensorView& v,
                                                   const TensorView& q2k_index,
                                                   const TensorView& q2k_count,
                                                   const BlockSparseOptions& options);

// out [B, Sq, Hq, Dv], lse [B, Hq, Sq] (float32; float64 for float64), written in full. The
// index is validated (tile ids in range and ascending, counts in [0, MaxK]).
void block_sparse_attention_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                                    const TensorView& q2k_index, const TensorView& q2k_count,
                                    const TensorView& out, const TensorView& lse,
                                    const BlockSparseOptions& options);

// VSA's fine branch and its combination in one call, for inference: fine and lse as
// block_sparse_attention_forward writes them, and out as vsa_combine(fine, coarse, gate,
// *options.q_block_sizes, options.tile_volume, out) writes it, bit for bit (vsa_combine.h:
// out = fine + gate * coarse on each tile's valid slots, fine on padded ones). On Hopper with
// 64-token tiles the combination runs inside the fine kernel, on warps that would otherwise
// wait, instead of as a second pass over fine, gate and out; elsewhere it is the two calls.
// options.q_block_sizes is required; coarse [B, Qtiles, Hq, Dv] and gate (optional) and out
// (like fine) in q's dtype, unit-stride last dimensions. Throws ValueError / TypeError.
void vsa_fine_combine_forward(const TensorView& q, const TensorView& k, const TensorView& v,
                              const TensorView& q2k_index, const TensorView& q2k_count,
                              const TensorView& coarse, const std::optional<TensorView>& gate,
                              const TensorView& fine, const TensorView& lse,
                              const TensorView& out, const BlockSparseOptions& options);

// Builds the k2q transpose (format above) of a valid q2k index. `stream` (a cudaStream_t) is
// used for CUDA tensors.
void block_sparse_transpose_index(const TensorView& q2k_index, const TensorView& q2k_count,
                                  std::int64_t num_kv_tiles, const TensorView& k2q_offsets,
                                  const TensorView& k2q_index, int num_threads = 0,
                                  void* stream = nullptr, bool validate_index = true);

// dq, dk, dv shaped like q, k, v, written in full; k2q from block_sparse_transpose_index.
void block_sparse_attention_backward(const TensorView& q, const TensorView& k, const TensorView& v,
                                     const TensorView& out, const TensorView& lse,
                                     const TensorView& grad_out, const TensorView& q2k_index,
                                     const TensorView& q2k_count, const TensorView& k2q_offsets,
                                     const TensorView& k2q_index, const TensorView& dq,
                                     const TensorView& dk, const TensorView& dv,
                                     const BlockSparseOptions& options);

}  // namespace vidattn
