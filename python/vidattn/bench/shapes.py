"""Problem sizes and the named presets of ``--shapes``."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class Shape:
    """One attention problem: q ``[batch, q_len, heads, head_dim]``, k and v
    ``[batch, kv_len, heads, head_dim]``."""

    batch: int
    heads: int
    q_len: int
    kv_len: int
    head_dim: int
    causal: bool = False
    name: str = ""  # model it comes from, if any (e.g. "Wan2.1-14B 720p")
    # Video sparse attention problems: the token grid (T, H, W), the tile and the sparsity;
    # q_len = kv_len is then the tiled (padded) length. Block-sparse kernel problems have a
    # sparsity and no grid: q_len = kv_len is a whole number of full 64-token tiles.
    grid: Optional[tuple[int, int, int]] = None
    tile: tuple[int, int, int] = (4, 4, 4)
    sparsity: Optional[float] = None

    @property
    def kind(self) -> str:
        """``dense``, ``blocksparse`` (a sparsity, no grid) or ``vsa`` (a video grid)."""
        if self.grid is not None:
            return "vsa"
        return "dense" if self.sparsity is None else "blocksparse"

    @property
    def label(self) -> str:
        if self.grid is not None:
            t, h, w = self.grid
            return (f"B{self.batch} H{self.heads} {t}x{h}x{w} S{self.q_len} D{self.head_dim} "
                    f"s{self.sparsity:g}")
        kv = f"k{self.kv_len}" if self.kv_len != self.q_len else ""
        return (f"B{self.batch} H{self.heads} S{self.q_len}{kv} D{self.head_dim}"
                + (" causal" if self.causal else "")
                + (f" s{self.sparsity:g}" if self.sparsity is not None else ""))

    def to_json(self) -> dict:
        out = {"batch": self.batch, "heads": self.heads, "q_len": self.q_len,
               "kv_len": self.kv_len, "head_dim": self.head_dim, "causal": self.causal,
               "name": self.name}
        if self.grid is not None:
            out.update(grid=list(self.grid), tile=list(self.tile), sparsity=self.sparsity)
        elif self.sparsity is not None:
            out.update(sparsity=self.sparsity, tile_volume=BLOCK_SPARSE_TILE)
        return out


def dense(batch: int, heads: int, seq: int, head_dim: int, name: str = "") -> Shape:
    return Shape(batch, heads, seq, seq, head_dim, name=name)


def cross(batch: int, heads: int, q_len: int, kv_len: int, head_dim: int,
          name: str = "") -> Shape:
    """Dense attention of ``q_len`` queries to ``kv_len`` keys (a video's tokens to text or
    image tokens)."""
    return Shape(batch, heads, q_len, kv_len, head_dim, name=name)


# Tokens per tile of the block-sparse kernel problems (4 x 4 x 4 video tiles).
BLOCK_SPARSE_TILE = 64


def block_sparse(batch: int, heads: int, seq: int, head_dim: int, sparsity: float,
                 name: str = "") -> Shape:
    """Block-sparse attention over ``seq`` tokens (a multiple of 64) in full 64-token tiles,
    each query tile attending to ``topk_from_sparsity(sparsity, seq / 64)`` key tiles."""
    if seq % BLOCK_SPARSE_TILE:
        raise ValueError(f"--shapes: a block-sparse length must be a multiple of "
                         f"{BLOCK_SPARSE_TILE}, got {seq}")
    if not 0.0 <= sparsity < 1.0:
        raise ValueError(f"--shapes: sparsity must be in [0, 1), got {sparsity}")
    return Shape(batch, heads, seq, seq, head_dim, name=name, sparsity=float(sparsity))


def vsa(batch: int, heads: int, grid: tuple[int, int, int], head_dim: int, sparsity: float,
        name: str = "", tile: tuple[int, int, int] = (4, 4, 4)) -> Shape:
    """A video of ``grid`` tokens in the tiled layout of ``tile`` (docs/vsa.md)."""
    tiles = math.prod(-(-g // t) for g, t in zip(grid, tile))
    padded = tiles * math.prod(tile)
    return Shape(batch, heads, padded, padded, head_dim, name=name, grid=tuple(grid),
                 tile=tuple(tile), sparsity=sparsity)


@dataclass(frozen=True)
class Preset:
    shapes: tuple[Shape, ...]
    directions: tuple[str, ...] = ("fwd", "bwd")
    dtypes: Optional[tuple[str, ...]] = None  # None: the device's default dtypes
    about: str = ""
    cpu_min_repeats: int = 3  # timed CPU rounds at least, when --repeats is not given


PRESETS: dict[str, Preset] = {
    "tiny": Preset((dense(1, 2, 128, 32),), about="seconds; for tests"),
    "tiny-vsa": Preset((vsa(1, 2, (5, 7, 9), 32, 0.75),), directions=("fwd",),
                       about="seconds; for tests of the vsa case"),
    "quick": Preset((dense(1, 4, 1024, 64), dense(1, 4, 1024, 128),
                     vsa(1, 2, (8, 16, 24), 64, 0.9, "small video")),
                    about="the CPU default: small, forward and backward"),
    # VSA against dense attention on the same tiled tensors: a Wan-480p-like grid
    # (21 x 30 x 52) with fewer frames, so that dense attention takes seconds on a CPU.
    "vsa-cpu": Preset((vsa(1, 2, (12, 30, 52), 64, 0.9, "Wan-like grid, CPU scale"),),
                      directions=("fwd",), dtypes=("fp32", "bf16"),
                      about="VSA vs dense on the CPU at sparsity 0.9 (forward)"),
    "vsa-video": Preset((vsa(1, 12, (21, 30, 52), 128, 0.9, "Wan2.1-1.3B 480p"),
                         vsa(1, 40, (21, 45, 80), 128, 0.9, "Wan2.1-14B 720p")),
                        directions=("fwd",),
                        about="VSA vs dense at the Wan shapes (GPU)"),
    "vsa-480p": Preset((vsa(1, 12, (21, 30, 52), 128, 0.9, "Wan2.1-1.3B 480p"),),
                       about="VSA vs dense at Wan2.1-1.3B 480p, forward and backward (GPU)"),
    "cpu-4k": Preset((dense(1, 4, 4096, 64), dense(1, 4, 4096, 128)), directions=("fwd",),
                     dtypes=("fp32", "bf16"), cpu_min_repeats=7,
                     about="the CPU acceptance measurement: forward, fp32 and bf16"),
    # The video models' tiled lengths with 64-token tiles, batch 1 (the inference case).
    "video": Preset((dense(1, 12, 39936, 128, "Wan2.1-1.3B 480p"),
                     dense(1, 40, 92160, 128, "Wan2.1-14B 720p"),
                     dense(1, 24, 115200, 128, "HunyuanVideo 720p")),
                    about="the GPU default: the video models' shapes"),
    # The dense peers' shapes.
    "gpu-dense": Preset((dense(1, 12, 32768, 128), dense(2, 32, 16384, 64)),
                        about="the dense peers' shapes"),
    # Block-sparse kernels (64-token tiles) against FlexAttention and FastVideo's Triton kernel
    # on one shared random selection: the Wan shapes at 87.5% and 90%
    # sparsity, and the dense peers' shape.
    "gpu-sparse": Preset(tuple(
        block_sparse(1, heads, seq, 128, sparsity, name)
        for heads, seq, name in ((12, 39936, "Wan2.1-1.3B 480p"), (40, 92160, "Wan2.1-14B 720p"))
        for sparsity in (0.875, 0.9)) + (block_sparse(1, 12, 32768, 128, 0.875),),
        dtypes=("bf16",), about="block-sparse fwd+bwd vs FlexAttention and FastVideo (GPU)"),
    # The side-by-side run: dense, block-sparse and the whole VSA op at the video models'
    # shapes (plus the dense peers' shapes: S=32768 H12 D128, and B2 H32
    # S16384 D64 for the D = 64 target), each case against its peers; and the cross
    # attention Wan runs in every block (its 32,760 / 75,600 video tokens to 512 text tokens,
    # and to 257 image tokens in image-to-video).
    "gpu-suite": Preset(
        (dense(1, 12, 39936, 128, "Wan2.1-1.3B 480p"), dense(1, 40, 92160, 128, "Wan2.1-14B 720p"),
         dense(1, 24, 115200, 128, "HunyuanVideo 720p"), dense(1, 12, 32768, 128),
         dense(2, 32, 16384, 64), dense(4, 16, 2048, 64),
         cross(1, 12, 32760, 512, 128, "Wan2.1-1.3B 480p text cross attention"),
         cross(1, 40, 75600, 512, 128, "Wan2.1-14B 720p text cross attention"),
         cross(1, 40, 75600, 257, 128, "Wan2.1-14B 720p image cross attention"))
        + tuple(block_sparse(1, heads, seq, 128, sparsity, name)
                for heads, seq, name in ((12, 39936, "Wan2.1-1.3B 480p"),
                                         (40, 92160, "Wan2.1-14B 720p"))
                for sparsity in (0.875, 0.9))
        + (block_sparse(1, 24, 115200, 128, 0.9, "HunyuanVideo 720p"),
           block_sparse(1, 12, 32768, 128, 0.875),
           vsa(1, 12, (21, 30, 52), 128, 0.9, "Wan2.1-1.3B 480p"),
           vsa(1, 40, (21, 45, 80), 128, 0.9, "Wan2.1-14B 720p"),
           vsa(1, 24, (30, 48, 80), 128, 0.9, "HunyuanVideo 720p")),
        dtypes=("bf16",), about="dense + block-sparse + whole VSA vs all peers (GPU)"),
    "tiny-sparse": Preset((block_sparse(1, 3, 320, 32, 0.6),),
                          about="seconds; for tests of the block-sparse case"),
}

_SPEC = re.compile(r"^b(\d+)h(\d+)s(\d+)(?:k(\d+))?d(\d+)(c?)(?:sp([0-9.]+))?$")


def parse_shape(spec: str) -> Shape:
    """``b1h4s1024d64``; ``k512`` after the q length sets another kv length, a trailing ``c``
    makes it causal, a trailing ``sp0.875`` makes it block-sparse (64-token tiles) at that
    sparsity."""
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(f"--shapes: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         "shape like b1h4s1024d64, b1h4s1024k512d64, b1h4s1024d64c (causal) or "
                         "b1h12s39936d128sp0.875 (block-sparse)")
    b, h, sq, sk, d, causal, sparsity = m.groups()
    shape = Shape(int(b), int(h), int(sq), int(sk or sq), int(d), causal == "c")
    if min(shape.batch, shape.heads, shape.q_len, shape.kv_len, shape.head_dim) < 1:
        raise ValueError(f"--shapes: {spec!r} has a zero size; every size must be >= 1")
    if sparsity is not None:
        if sk is not None or causal:
            raise ValueError(f"--shapes: {spec!r}: a block-sparse shape has one length and is "
                             "not causal")
        try:
            value = float(sparsity)
        except ValueError:
            raise ValueError(f"--shapes: {spec!r}: bad sparsity {sparsity!r}") from None
        return block_sparse(shape.batch, shape.heads, shape.q_len, shape.head_dim, value)
    return shape


def resolve(specs: Sequence[str]) -> Preset:
    """Turn ``--shapes`` items (presets or shape specs) into one preset.

    A single preset keeps its default directions and dtypes; a mix uses the global defaults.
    """
    if len(specs) == 1 and specs[0] in PRESETS:
        return PRESETS[specs[0]]
    shapes: list[Shape] = []
    for spec in specs:
        shapes.extend(PRESETS[spec].shapes if spec in PRESETS else (parse_shape(spec),))
    return Preset(tuple(shapes))
