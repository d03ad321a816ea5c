// One sequence of a (batched or varlen) attention problem. A header of its own, free of
// device code, so host code (the sm_90a traits in a host test) can hold one.
#pragma once

#include <cstdint>

namespace vidattn::cuda_common {

// One sequence of the problem: its lengths, and where its row 0 lives.
struct Sequence {
  std::int64_t len_q = 0, len_k = 0;
  std::int64_t first_q = 0, first_k = 0;  // row index into the flat rows of q / k
  std::int64_t batch = 0;                 // b (batched), 0 (varlen; offsets are in first_*)
};

}  // namespace vidattn::cuda_common
