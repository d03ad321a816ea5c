// Key padding as varlen: a batched, non-causal forward with a key padding mask runs as a
// varlen problem over only the valid keys (and, with a query padding mask, only the valid
// queries), packed into workspace buffers. The masked kernel instance visits every key block,
// pays the mask on each and does the padded keys' FLOPs; packed, the unmasked kernel visits
// only valid keys (a video's tiled layout pads ~18% of its slots at Wan 480p) and masks only
// each sequence's last block. Packing, offsets and the scatter back run on the device, so
// nothing synchronises with the host. CuTe-free: the dense dispatch includes it.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <functional>

#include "fwd_params.h"

namespace vidattn::cuda_sm90 {

// Whether `p` (batched, filled by the dense dispatch) may run packed: a key mask, no causal
// rule (packing moves keys, and causal masks depend on key positions).
bool pack_padding_fits(const AttentionParams& p);

// Packs p's valid keys (and queries, when p has a query mask or q / out are not one row block
// per batch), runs `run_varlen` on the packed varlen problem (it returns whether it launched)
// and writes p.out and p.lse in p's batched layout, 0 / -inf on padded query rows. Returns
// false, having written nothing to p.out / p.lse, when the workspace cannot be allocated or
// run_varlen launched nothing; the caller then runs the masked kernel. `head_dim` is D = Dv,
// `elem_bytes` the size of q's element type.
bool forward_padding_packed(const AttentionParams& p, int head_dim, std::size_t elem_bytes,
                            cudaStream_t stream,
                            const std::function<bool(const AttentionParams&)>& run_varlen);

}  // namespace vidattn::cuda_sm90
