"""vidattn: attention kernels for video diffusion transformers.

Every function here is a thin door onto one ``torch.ops.vidattn`` op, whose schema, kernels
(CPU, CUDA where built, Meta) and autograd are registered in C++.
"""
from __future__ import annotations

import os as _os

import torch as _torch

_torch.ops.load_library(_os.path.join(_os.path.dirname(__file__), "_vidattn_ops.so"))

from ._attention import attention, attention_varlen  # noqa: E402
from .rope import apply_rope  # noqa: E402
from .distributed import DistributedAttention  # noqa: E402
from .vsa import (  # noqa: E402
    VideoTiling,
    block_sparse_attention,
    pack_videos,
    select_topk_tiles,
    tile_mean_pool,
    topk_from_sparsity,
    topk_tiles_from_scores,
    unpack_videos,
    video_sparse_attention,
)

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_varlen",
    "apply_rope",
    "DistributedAttention",
    "VideoTiling",
    "block_sparse_attention",
    "pack_videos",
    "select_topk_tiles",
    "tile_mean_pool",
    "topk_from_sparsity",
    "topk_tiles_from_scores",
    "unpack_videos",
    "video_sparse_attention",
    "__version__",
]
