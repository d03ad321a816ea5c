// A stream's query tile as the producer decodes it from its slot (fwd_mainloop.h) and
// publishes it to the stream's consumers in shared memory (FwdTraits::StreamStorage).
#pragma once

#include <cstdint>

#include "cuda/common/sequence.h"

namespace vidattn::cuda_sm90 {

// The sequence, the stream's first query row and whether the stream has rows in this tile.
struct StreamTile {
  cuda_common::Sequence seq;
  std::int64_t q0;
  int head, batch;
  bool active;
  int piece;  // Traits::kSplitTail: the 64-row piece of a split tile (q0 is its first row), or -1
};

}  // namespace vidattn::cuda_sm90
