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
    # q_len = kv_len is then the tiled (padded) length.
    grid: Optional[tuple[int, int, int]] = None
    tile: tuple[int, int, int] = (4, 4, 4)
    sparsity: Optional[float] = None

    @property
    def label(self) -> str:
        if self.grid is not None:
            t, h, w = self.grid
            return (f"B{self.batch} H{self.heads} {t}x{h}x{w} S{self.q_len} D{self.head_dim} "
                    f"s{self.sparsity:g}")
        kv = f"k{self.kv_len}" if self.kv_len != self.q_len else ""
        return (f"B{self.batch} H{self.heads} S{self.q_len}{kv} D{self.head_dim}"
                + (" causal" if self.causal else ""))

    def to_json(self) -> dict:
        out = {"batch": self.batch, "heads": self.heads, "q_len": self.q_len,
               "kv_len": self.kv_len, "head_dim": self.head_dim, "causal": self.causal,
               "name": self.name}
        if self.grid is not None:
            out.update(grid=list(self.grid), tile=list(self.tile), sparsity=self.sparsity)
        return out


def dense(batch: int, heads: int, seq: int, head_dim: int, name: str = "") -> Shape:
    return Shape(batch, heads, seq, seq, head_dim, name=name)


def vsa(batch: int, heads: int, grid: tuple[int, int, int], head_dim: int, sparsity: float,
        name: str = "", tile: tuple[int, int, int] = (4, 4, 4)) -> Shape:
    """A video of ``grid`` tokens in the tiled layout of ``tile`` (vsa.md section 1)."""
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
    # VSA against dense attention on the same tiled tensors (vsa.md): a Wan-480p-like grid
    # (21 x 30 x 52) with fewer frames, so that dense attention takes seconds on a CPU.
    "vsa-cpu": Preset((vsa(1, 2, (12, 30, 52), 64, 0.9, "Wan-like grid, CPU scale"),),
                      directions=("fwd",), dtypes=("fp32", "bf16"),
                      about="VSA vs dense on the CPU at sparsity 0.9 (forward)"),
    "vsa-video": Preset((vsa(1, 12, (21, 30, 52), 128, 0.9, "Wan2.1-1.3B 480p"),
                         vsa(1, 40, (21, 45, 80), 128, 0.9, "Wan2.1-14B 720p")),
                        directions=("fwd",),
                        about="VSA vs dense at the Wan shapes of vsa.md (GPU)"),
    "cpu-4k": Preset((dense(1, 4, 4096, 64), dense(1, 4, 4096, 128)), directions=("fwd",),
                     dtypes=("fp32", "bf16"), cpu_min_repeats=7,
                     about="the CPU acceptance measurement (targets.md): forward, fp32 and bf16"),
    # vsa.md section 6: tiled lengths with 64-token tiles, batch 1 (the inference case).
    "video": Preset((dense(1, 12, 39936, 128, "Wan2.1-1.3B 480p"),
                     dense(1, 40, 92160, 128, "Wan2.1-14B 720p"),
                     dense(1, 24, 115200, 128, "HunyuanVideo 720p")),
                    about="the GPU default: video model shapes of vsa.md section 6"),
    # targets.md's measured peers table.
    "gpu-dense": Preset((dense(1, 12, 32768, 128), dense(2, 32, 16384, 64)),
                        about="the dense shapes of targets.md's peer table"),
}

_SPEC = re.compile(r"^b(\d+)h(\d+)s(\d+)(?:k(\d+))?d(\d+)(c?)$")


def parse_shape(spec: str) -> Shape:
    """``b1h4s1024d64``; ``k512`` after the q length sets another kv length, a trailing ``c``
    makes it causal."""
    m = _SPEC.match(spec.strip().lower())
    if not m:
        raise ValueError(f"--shapes: {spec!r} is neither a preset ({', '.join(PRESETS)}) nor a "
                         "shape like b1h4s1024d64, b1h4s1024k512d64 or b1h4s1024d64c (causal)")
    b, h, sq, sk, d, causal = m.groups()
    shape = Shape(int(b), int(h), int(sq), int(sk or sq), int(d), causal == "c")
    if min(shape.batch, shape.heads, shape.q_len, shape.kv_len, shape.head_dim) < 1:
        raise ValueError(f"--shapes: {spec!r} has a zero size; every size must be >= 1")
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
