// Kernel parameters from validated TensorViews: the row strides of [B, S, H, D] / [T, H, D]
// views and the fields every attention launch fills the same way (host code of dispatch/).
#pragma once

#include <cstdint>

#include "cuda/common/params.h"
#include "vidattn/tensor_view.h"

namespace vidattn::cuda_common {

inline RowStrides token_strides(const TensorView& t, bool varlen) {
  if (varlen) return {0, t.stride[0], t.stride[1]};
  return {t.stride[0], t.stride[1], t.stride[2]};
}

inline RowStrides lse_strides(const TensorView& t, bool varlen) {
  if (varlen) return {0, t.stride[1], t.stride[0]};  // [H, T]
  return {t.stride[0], t.stride[2], t.stride[1]};    // [B, H, S]
}

// Every row start of t is a multiple of `bytes` (pointer and the strides of every dimension
// that has more than one entry).
inline bool rows_aligned(const TensorView& t, std::size_t bytes) {
  if (reinterpret_cast<std::uintptr_t>(t.data) % bytes != 0) return false;
  const std::int64_t elems = static_cast<std::int64_t>(bytes / dtype_size(t.dtype));
  for (int d = 0; d + 1 < t.ndim; ++d)
    if (t.shape[d] > 1 && t.stride[d] % elems != 0) return false;
  return true;
}

// The fields every forward fills the same way, dense or block-sparse, sm_80 or sm_90a: the
// tensors and their strides ([B, S, H, D]; varlen: [T, H, D] rows), head counts, lengths, the
// scale and whether q, k, v rows start on 16 bytes. Callers add their own (masks, the tile
// index, ...).
inline AttentionParams layout_params(const TensorView& q, const TensorView& k,
                                     const TensorView& v, const TensorView& out,
                                     const TensorView& lse, std::int64_t batch,
                                     std::int64_t heads_q, std::int64_t heads_kv,
                                     std::int64_t seqlen_q, std::int64_t seqlen_k, double scale,
                                     bool varlen) {
  AttentionParams kp;
  kp.q = q.data, kp.k = k.data, kp.v = v.data;
  kp.out = out.data;
  kp.lse = static_cast<float*>(lse.data);
  kp.q_strides = token_strides(q, varlen);
  kp.k_strides = token_strides(k, varlen);
  kp.v_strides = token_strides(v, varlen);
  kp.out_strides = token_strides(out, varlen);
  kp.lse_strides = lse_strides(lse, varlen);
  kp.varlen = varlen;
  kp.batch = static_cast<int>(batch);
  kp.heads_q = static_cast<int>(heads_q);
  kp.heads_kv = static_cast<int>(heads_kv);
  kp.group = static_cast<int>(heads_q / heads_kv);
  kp.seqlen_q = seqlen_q;
  kp.seqlen_k = seqlen_k;
  kp.rows_q = varlen ? q.shape[0] : batch * seqlen_q;
  kp.rows_k = varlen ? k.shape[0] : batch * seqlen_k;
  kp.head_dim = static_cast<int>(q.shape[q.ndim - 1]);
  kp.head_dim_v = static_cast<int>(v.shape[v.ndim - 1]);
  kp.scale = static_cast<float>(scale);
  kp.aligned16 = rows_aligned(q, 16) && rows_aligned(k, 16) && rows_aligned(v, 16);
  return kp;
}

}  // namespace vidattn::cuda_common
