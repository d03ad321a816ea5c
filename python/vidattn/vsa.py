"""Video Sparse Attention (VSA): tiling, block-sparse attention and the VSA op.

Every kernel here is one ``torch.ops.vidattn`` op (schemas, CPU and Meta kernels and autograd
in C++, torch/vsa_ops.cpp); the functions below only compose them.
"""
from __future__ import annotations

import math
import operator
from typing import Optional, Sequence, Tuple

import torch

_ops = torch.ops.vidattn

_SUPPORTED_VOLUMES = (64, 128, 256)


def _grid3(value, name: str) -> Tuple[int, int, int]:
    """Three integers (T, H, W). Python and NumPy integers and integral 0-d tensors pass;
    anything that int() would truncate (4.7, a float tensor, "4") is refused, not rounded."""
    try:
        parts = list(value)
    except TypeError:
        parts = None
    if parts is None or len(parts) != 3 or not all(_is_integer(x) for x in parts):
        raise ValueError(f"{name} must be three integers (T, H, W), got {value!r}")
    t, h, w = (operator.index(x) for x in parts)
    return t, h, w


def _is_integer(x) -> bool:
    if isinstance(x, bool):
        return False
    try:
        operator.index(x)
    except TypeError:
        return False
    return True


class VideoTiling:
    """Cuts one video's ``T x H x W`` token grid (or several packed videos) into tiles.

    ``VideoTiling(grid=(T, H, W), tile=(4, 4, 4), device=...)`` for one video;
    ``VideoTiling(grids=[(T1, H1, W1), ...], ...)`` packs several videos back to back (their
    tokens, tiles and slots are concatenated; ``cu_tiles`` / ``cu_tokens`` hold the per-video
    offsets as int32 tensors on the device). Tile volumes 64, 128 and 256 are supported.

    Attributes: ``block_sizes`` (int32 [num_tiles], valid tokens per tile), ``num_tiles``,
    ``padded_len`` (num_tiles * tile volume), ``num_tokens``, ``tile_volume``.
    ``tile(x)`` maps raster ``[B, num_tokens, H, D]`` to the tiled layout
    ``[B, padded_len, H, D]`` (zeros in padding); ``untile`` is its inverse. Both are ops
    with autograd. All metadata is built once here; nothing syncs with the host afterwards.
    """

    def __init__(self, grid=None, tile=(4, 4, 4), device=None, *, grids=None):
        if (grid is None) == (grids is None):
            raise ValueError("VideoTiling needs exactly one of grid=(T, H, W) or grids=[...]")
        grid_list = [grid] if grid is not None else list(grids)
        if not grid_list:
            raise ValueError("VideoTiling(grids=...) needs at least one grid")
        self.grids = [_grid3(g, "grid") for g in grid_list]
        self.tile_shape = _grid3(tile, "tile")
        self.tile_volume = math.prod(self.tile_shape)
        if self.tile_volume not in _SUPPORTED_VOLUMES:
            raise ValueError(
                f"tile {self.tile_shape} has volume {self.tile_volume}; VSA supports tile volumes "
                "64, 128 and 256 (e.g. (4, 4, 4), (4, 4, 8), (2, 8, 8), (4, 8, 8))")
        flat = [x for g in self.grids for x in g]
        # One int32 tensor, built on the host: [cu_tiles | cu_tokens | block_sizes |
        # slot_to_token | token_to_slot] (see torch/vsa_ops.cpp).
        meta = _ops.vsa_tiling_metadata(flat, list(self.tile_shape))
        n = len(self.grids)
        cu_tiles, cu_tokens = meta[:n + 1], meta[n + 1:2 * n + 2]
        self.packed = grids is not None
        # Host integers, known at construction.
        self.tiles_per_video = [int(x) for x in torch.diff(cu_tiles).tolist()]
        self.num_tiles = int(cu_tiles[-1])
        self.num_tokens = int(cu_tokens[-1])
        self.padded_len = self.num_tiles * self.tile_volume
        sizes, s2t, t2s = torch.split(meta[2 * n + 2:],
                                      [self.num_tiles, self.padded_len, self.num_tokens])
        self.max_tiles_per_video = max(self.tiles_per_video)
        self.device = torch.device(device) if device is not None else torch.device("cpu")
        self.block_sizes = sizes.to(self.device)
        self.slot_to_token = s2t.to(self.device)
        self.token_to_slot = t2s.to(self.device)
        self.cu_tiles = cu_tiles.to(self.device)
        self.cu_tokens = cu_tokens.to(self.device)
        # Slot -> its tile, and which slots hold a token: broadcast of per-tile results.
        self.slot_tile = torch.arange(self.num_tiles, dtype=torch.int32).repeat_interleave(
            self.tile_volume).to(self.device)
        self.slot_valid = (s2t >= 0).to(self.device)

    @property
    def grid(self) -> Tuple[int, int, int]:
        if self.packed:
            raise AttributeError("a packed VideoTiling has several grids; use .grids")
        return self.grids[0]

    def __repr__(self) -> str:
        what = f"grids={self.grids}" if self.packed else f"grid={self.grids[0]}"
        return (f"VideoTiling({what}, tile={self.tile_shape}, num_tiles={self.num_tiles}, "
                f"padded_len={self.padded_len})")

    def _check(self, x: torch.Tensor, length: int, what: str, name: str) -> None:
        if not isinstance(x, torch.Tensor) or x.dim() != 4:
            raise ValueError(f"{name} expects a 4-D [B, S, H, D] tensor, got "
                             f"{tuple(x.shape) if isinstance(x, torch.Tensor) else type(x)}")
        if x.shape[1] != length:
            raise ValueError(f"{name}: the tensor has {x.shape[1]} tokens but the tiling "
                             f"{self!r} has {length} {what}")

    def tile(self, x: torch.Tensor) -> torch.Tensor:
        """Raster ``[B, num_tokens, H, D]`` -> tiled ``[B, padded_len, H, D]``."""
        self._check(x, self.num_tokens, "tokens", "VideoTiling.tile")
        return _ops.gather_tokens(x, self.slot_to_token, self.token_to_slot)

    def untile(self, x: torch.Tensor) -> torch.Tensor:
        """Tiled ``[B, padded_len, H, D]`` -> raster ``[B, num_tokens, H, D]`` (drops padding)."""
        self._check(x, self.padded_len, "tiled slots", "VideoTiling.untile")
        return _ops.gather_tokens(x, self.token_to_slot, self.slot_to_token)

    def broadcast_tiles(self, per_tile: torch.Tensor) -> torch.Tensor:
        """``[B, num_tiles, H, D]`` -> ``[B, padded_len, H, D]``: each tile's value on its valid
        slots, zero on padding."""
        expanded = per_tile.index_select(1, self.slot_tile)
        return expanded * self.slot_valid.to(per_tile.dtype)[None, :, None, None]


def topk_from_sparsity(sparsity: float, num_kv_tiles: int) -> int:
    """``clamp(ceil((1 - sparsity) * num_kv_tiles), 1, num_kv_tiles)`` (num_kv_tiles counts
    tiles, padding included). A 1e-9 slack keeps float noise from rounding up
    ((1 - 0.8) * 10 is 2.0000000000000004 in floats, and gives 2)."""
    sparsity = float(sparsity)
    if not 0.0 <= sparsity <= 1.0:
        raise ValueError(f"sparsity must be in [0, 1], got {sparsity}")
    if int(num_kv_tiles) < 1:
        raise ValueError(f"num_kv_tiles must be >= 1, got {num_kv_tiles}")
    kept = math.ceil((1.0 - sparsity) * int(num_kv_tiles) - 1e-9)
    return max(1, min(int(num_kv_tiles), kept))


def block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    q2k_index: torch.Tensor,
    q2k_count: torch.Tensor,
    *,
    tile_volume: int = 64,
    q_block_sizes: Optional[torch.Tensor] = None,
    kv_block_sizes: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    deterministic: bool = True,
    return_lse: bool = False,
    validate_index: bool = True,
    sm_margin: int = 0,
):
    """Attention of each query tile over its selected key tiles only.

    q ``[B, Sq, Hq, D]``, k ``[B, Sk, Hkv, D]``, v ``[B, Sk, Hkv, Dv]`` in the tiled layout
    (Sq, Sk multiples of ``tile_volume``). ``q2k_index`` int32 ``[B, Hq, Qtiles, MaxK]``: the
    key tiles of each query tile, strictly ascending in the first ``q2k_count[b, h, t]`` slots
    (later slots ignored; -1 by convention). Key slots past ``kv_block_sizes[tile]`` are masked;
    query slots past ``q_block_sizes[tile]`` output 0 (LSE -inf). A query tile with count 0
    outputs zeros with LSE -inf. Key tiles nobody selected get zero dK, dV. The transposed index
    for the backward is built only when a gradient is needed. ``deterministic=False`` lets the
    Hopper backward of 128- and 256-token tiles add dQ in an order that varies (faster;
    docs/design.md, "Determinism"); the CPU, the portable CUDA kernels and 64-token tiles are
    deterministic whatever it says. Returns out
    ``[B, Sq, Hq, Dv]`` and with ``return_lse`` the natural-log LSE ``[B, Hq, Sq]`` (float32;
    float64 for float64 inputs).

    The index is checked (ids in range and ascending, counts in ``[0, MaxK]``) and a bad one
    raises ``ValueError``. On CUDA the check runs on the device and waits for its verdict (one
    host synchronisation; skipped inside CUDA-graph capture); ``validate_index=False`` skips it
    for an index known to be valid (kernels never read out of bounds either way).

    ``sm_margin``: streaming multiprocessors the persistent Hopper forward kernel leaves free
    so that kernels on other streams (e.g. NCCL collectives) run alongside it; 0 uses all of
    them. Other devices ignore it.
    """
    out, lse = _ops.block_sparse_attention(
        q, k, v, q2k_index, q2k_count, tile_volume=int(tile_volume),
        q_block_sizes=q_block_sizes, kv_block_sizes=kv_block_sizes, scale=scale,
        deterministic=bool(deterministic), validate_index=bool(validate_index),
        sm_margin=int(sm_margin))
    return (out, lse) if return_lse else out


def tile_mean_pool(x: torch.Tensor, block_sizes: torch.Tensor, tile_volume: int) -> torch.Tensor:
    """Per-tile mean of the valid tokens of a tiled ``[B, Tiles * V, H, D]`` tensor (fp32 sums,
    divided by the block size) -> ``[B, Tiles, H, D]``."""
    return _ops.tile_mean_pool(x, block_sizes, int(tile_volume))


def select_topk_tiles(q_pooled, k_pooled, topk: int, *, sparsity=None, scale=None,
                      cu_tiles_q=None, cu_tiles_k=None):
    """Top-k key tiles per query tile from the coarse scores ``scale * q_pooled k_pooled^T``:
    returns ``(q2k_index, q2k_count)``. Exactly ``min(topk, key tiles)`` per row, ties to the
    lowest index, all -inf rows pick the first tiles. Not differentiable."""
    return _ops.topk_tiles(q_pooled, k_pooled, int(topk), sparsity=sparsity, scale=scale,
                           cu_tiles_q=cu_tiles_q, cu_tiles_k=cu_tiles_k)


def topk_tiles_from_scores(scores: torch.Tensor, topk: int):
    """The same selection rule on given scores ``[B, H, Qtiles, Ktiles]``."""
    return _ops.topk_tiles_from_scores(scores, int(topk))


def _check_tiled(x, tiling: VideoTiling, name: str, tiling_name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"video_sparse_attention: {name} must be a tensor, got {type(x).__name__}")
    if x.dim() != 4:
        raise ValueError(f"video_sparse_attention: {name} must be 4-D [B, S, H, D] in the tiled "
                         f"layout, got shape {tuple(x.shape)}")
    if x.shape[1] != tiling.padded_len:
        raise ValueError(
            f"video_sparse_attention: {name} has {x.shape[1]} tokens but {tiling_name} "
            f"{tiling!r} expects the tiled length {tiling.padded_len} (tile it with "
            f"{tiling_name}.tile first)")


def video_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    tiling: VideoTiling,
    kv_tiling: Optional[VideoTiling] = None,
    topk: Optional[int] = None,
    sparsity: Optional[float] = None,
    gate: Optional[torch.Tensor] = None,
    scale: Optional[float] = None,
    return_selection: bool = False,
    deterministic: bool = True,
    sm_margin: int = 0,
):
    """Video Sparse Attention on tiled ``[B, S, H, D]`` tensors.

    Coarse branch: tile means of q, k, v (``tile_mean_pool``), dense attention over the tiles
    (the vidattn attention op; per video for packed tilings), broadcast back to each tile's
    tokens. Selection: the ``topk`` key tiles per query tile with the largest coarse scores
    (or ``topk_from_sparsity(sparsity, key tiles)``; per video when packed). Fine branch:
    ``block_sparse_attention`` over the selected tiles. Output ``o_c * gate + o_s`` (or
    ``o_c + o_s``), composed out of place; padding slots of the output are 0.

    ``tiling`` describes q's tokens, ``kv_tiling`` (default: ``tiling``) those of k and v
    (cross attention); both need the same tile volume. Packed tilings need B == 1 and the
    same number of videos. ``gate`` has the output's shape ``[B, Sq, Hq, Dv]`` (q's shape
    when v's head dim Dv equals D). Gradients flow to q, k, v and gate (the selection is a
    constant). All tensors, and the tilings' metadata, must be on one device. With
    ``return_selection`` also returns ``(q2k_index, q2k_count)``. ``deterministic`` (the
    backward's dQ order) and ``sm_margin`` are passed to the attention of both branches (see
    ``block_sparse_attention``).
    """
    kv_tiling, topk = _check_vsa_args(q, k, v, tiling, kv_tiling, topk, sparsity)
    out_shape = (*q.shape[:-1], v.shape[-1])
    if gate is not None and (not isinstance(gate, torch.Tensor) or tuple(gate.shape) != out_shape):
        raise ValueError(f"video_sparse_attention: gate must have the output's shape {out_shape} "
                         "([B, Sq, Hq, Dv]), got "
                         f"{tuple(gate.shape) if isinstance(gate, torch.Tensor) else type(gate)}")
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, gate)):
        o_s, o_c, selection = _vsa_branches(q, k, v, tiling, kv_tiling, topk, sparsity, scale,
                                             sm_margin, deterministic=deterministic)
        # out = o_s + gate * (o_c on each tile's valid slots), in one pass.
        out = _ops.vsa_combine(o_s, o_c, gate, tiling.block_sizes, tiling.tile_volume)
    else:
        # Inference: the same bits from one op, which on Hopper combines inside the fine kernel.
        o_c, selection = _vsa_coarse_and_selection(q, k, v, tiling, kv_tiling, topk, sparsity,
                                                   scale)
        q2k_index, q2k_count = selection
        out, _, _ = _ops.vsa_fine_combined(
            q, k, v, q2k_index, q2k_count, o_c, gate, tiling.block_sizes,
            tile_volume=tiling.tile_volume, kv_block_sizes=kv_tiling.block_sizes, scale=scale,
            validate_index=False, sm_margin=int(sm_margin))
    return (out, selection) if return_selection else out


def _check_vsa_args(q, k, v, tiling, kv_tiling, topk, sparsity):
    """video_sparse_attention's checks of everything but the gate; returns ``(kv_tiling,
    topk)`` resolved."""
    kv_tiling = tiling if kv_tiling is None else kv_tiling
    if not isinstance(tiling, VideoTiling) or not isinstance(kv_tiling, VideoTiling):
        raise TypeError("video_sparse_attention: tiling and kv_tiling must be VideoTiling objects")
    _check_tiled(q, tiling, "q", "tiling")
    _check_tiled(k, kv_tiling, "k", "kv_tiling")
    _check_tiled(v, kv_tiling, "v", "kv_tiling")
    if tiling.tile_volume != kv_tiling.tile_volume:
        raise ValueError(f"video_sparse_attention: tiling and kv_tiling must share a tile volume, "
                         f"got {tiling.tile_volume} and {kv_tiling.tile_volume}")
    if tiling.packed != kv_tiling.packed or len(tiling.grids) != len(kv_tiling.grids):
        raise ValueError("video_sparse_attention: tiling and kv_tiling must both be packed with "
                         "the same number of videos, or both single videos")
    if tiling.packed and q.shape[0] != 1:
        raise ValueError(f"video_sparse_attention: packed tilings need batch 1, got B = {q.shape[0]}")
    if (topk is None) == (sparsity is None):
        raise ValueError("video_sparse_attention: pass exactly one of topk and sparsity")
    return kv_tiling, _resolve_topk(topk, sparsity, kv_tiling)


def _resolve_topk(topk, sparsity, kv_tiling: VideoTiling) -> int:
    """The selection's MaxK: topk, or from the sparsity the largest per-video count (the
    kernel picks each video's own)."""
    if topk is not None:
        topk = int(topk)
        if topk < 1:
            raise ValueError(f"video_sparse_attention: topk must be >= 1, got {topk}")
        return topk
    return topk_from_sparsity(sparsity, kv_tiling.max_tiles_per_video)


def _vsa_branches(q, k, v, tiling: VideoTiling, kv_tiling: VideoTiling, topk: int, sparsity,
                  scale, sm_margin: int, *, deterministic: bool = True):
    """video_sparse_attention before its combination, on arguments checked by
    _check_vsa_args: the fine output ``o_s`` (tiled like q), the coarse output ``o_c``
    ``[B, Tiles, H, Dv]`` and the selection ``(q2k_index, q2k_count)``. The stages are
    separate functions because the sequence-parallel layer runs them as its inputs arrive
    and combines the branches itself, on the rows each rank holds."""
    o_c, selection = _vsa_coarse_and_selection(q, k, v, tiling, kv_tiling, topk, sparsity, scale,
                                               deterministic=deterministic)
    o_s = _vsa_fine(q, k, v, selection, tiling, kv_tiling, scale, sm_margin,
                    deterministic=deterministic)
    return o_s, o_c, selection


def _vsa_coarse_and_selection(q, k, v, tiling: VideoTiling, kv_tiling: VideoTiling, topk: int,
                              sparsity, scale, *, deterministic: bool = True):
    """The coarse output ``o_c`` and the selection, from the tile means of q, k, v."""
    q_c, k_c, v_c = (_vsa_pool(x, t) for x, t in ((q, tiling), (k, kv_tiling), (v, kv_tiling)))
    o_c = _vsa_coarse(q_c, k_c, v_c, tiling, kv_tiling, scale, deterministic=deterministic)
    selection = _vsa_select(q_c, k_c, tiling, kv_tiling, topk, sparsity, scale)
    return o_c, selection


def _vsa_pool(x, tiling: VideoTiling):
    """Tile means [B, Tiles, H, D] of a tiled tensor."""
    return _ops.tile_mean_pool(x, tiling.block_sizes, tiling.tile_volume)


def _vsa_coarse(q_c, k_c, v_c, tiling: VideoTiling, kv_tiling: VideoTiling, scale, *,
                deterministic: bool = True):
    """The coarse branch: dense attention over the tile means (per video when packed)."""
    if tiling.packed:
        o_c, _ = _ops.attention_varlen(
            q_c[0], k_c[0], v_c[0], tiling.cu_tiles, kv_tiling.cu_tiles,
            tiling.max_tiles_per_video, kv_tiling.max_tiles_per_video, scale=scale,
            deterministic=deterministic,
            validate_index=False)  # the tilings' own offsets: valid by construction
        return o_c.unsqueeze(0)
    o_c, _ = _ops.attention(q_c, k_c, v_c, scale=scale, deterministic=deterministic)
    return o_c


def _vsa_select(q_c, k_c, tiling: VideoTiling, kv_tiling: VideoTiling, topk: int, sparsity,
                scale):
    """The top-k key tiles of every query tile by coarse score: ``(q2k_index, q2k_count)``
    (needs q's and k's tile means only)."""
    cu_q, cu_k = (tiling.cu_tiles, kv_tiling.cu_tiles) if tiling.packed else (None, None)
    return _ops.topk_tiles(
        q_c.detach(), k_c.detach(), topk, sparsity=None if sparsity is None else float(sparsity),
        scale=scale, cu_tiles_q=cu_q, cu_tiles_k=cu_k)


def _vsa_fine(q, k, v, selection, tiling: VideoTiling, kv_tiling: VideoTiling, scale,
              sm_margin: int, *, deterministic: bool = True):
    """The fine branch: block-sparse attention over the selected key tiles."""
    q2k_index, q2k_count = selection
    o_s, _ = _ops.block_sparse_attention(
        q, k, v, q2k_index, q2k_count, tile_volume=tiling.tile_volume,
        q_block_sizes=tiling.block_sizes, kv_block_sizes=kv_tiling.block_sizes, scale=scale,
        deterministic=bool(deterministic),
        validate_index=False,  # built by topk_tiles: valid by construction
        sm_margin=int(sm_margin))
    return o_s


def pack_videos(xs: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenates raster ``[1, T_i*H_i*W_i, H, D]`` (or ``[T_i*H_i*W_i, H, D]``) videos into
    one ``[1, sum, H, D]`` tensor for a packed ``VideoTiling(grids=...)``."""
    parts = [x if x.dim() == 4 else x.unsqueeze(0) for x in xs]
    return torch.cat(parts, dim=1)


def unpack_videos(x: torch.Tensor, tiling: VideoTiling):
    """Splits a packed raster ``[1, num_tokens, H, D]`` tensor back into one tensor per video."""
    sizes = [t * h * w for t, h, w in tiling.grids]
    return list(torch.split(x, sizes, dim=1))
