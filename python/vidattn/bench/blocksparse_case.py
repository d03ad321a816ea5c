"""The block-sparse case: attention of each 64-token query tile over its selected key tiles,
forward and backward, with one random selection (seeded; ``topk_from_sparsity`` key tiles per
query tile) shared by every implementation, so that all do the same FLOPs.

Rows: ``vidattn`` (vidattn.block_sparse_attention), ``flex`` (FlexAttention with the BlockMask
of the same selection, 64 x 64 blocks, compiled on the GPU) and ``fastvideo-triton``
(fastvideo-kernel's Triton block-sparse kernel, when that package imports; GPU only).
FLOPs: forward ``4 * B * H * Sq * (topk * 64) * D``, backward 2.5x.
Each row is checked against a float64 reference of the same selection (forward: out;
backward: dq, dk, dv), so a peer that computes something else shows a large error.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

import torch
from torch.utils.checkpoint import checkpoint

from . import peers
from .base import Case, Impl, QkvLayoutInputs, missing_vidattn_op
from .peers import selection_to_dense_mask  # noqa: F401  (part of this case's API)
from .reference import RefScope
from .shapes import BLOCK_SPARSE_TILE, Shape

# float64 score elements per reference chunk (scores [b, h, tiles, 64, topk * 64]).
_REF_CHUNK_ELEMS = {"cpu": 1 << 22, "cuda": 1 << 27}


def topk_of(shape: Shape) -> int:
    from ..vsa import topk_from_sparsity

    return topk_from_sparsity(shape.sparsity, shape.kv_len // BLOCK_SPARSE_TILE)


def random_selection(batch: int, heads: int, q_tiles: int, kv_tiles: int, topk: int,
                     generator: torch.Generator, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``topk`` distinct key tiles per query tile, uniformly at random, ascending (vidattn's
    q2k convention): int32 ``index [B, H, Qt, topk]``, ``count [B, H, Qt]`` (all ``topk``)."""
    scores = torch.rand(batch, heads, q_tiles, kv_tiles, generator=generator, device=device)
    index = scores.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32).contiguous()
    count = torch.full((batch, heads, q_tiles), topk, dtype=torch.int32, device=device)
    return index, count


def _sparse_rows64(q_tiles, k_tiles, v_tiles, index, ok_slots, key_ok, scale):
    """float64 attention of query tiles ``q_tiles [b, h, c, T, D]`` over the key tiles
    ``index [b, h, c, K]`` of ``k_tiles``/``v_tiles [b, h, Kt, T, D]``; ``ok_slots [b, h, c, K]``
    marks used slots, ``key_ok [Kt, T]`` valid keys. Rows with no visible key give 0. Written
    with plain differentiable ops, so autograd gives the backward reference."""
    b, h, c, kk = index.shape
    bi = torch.arange(b, device=index.device)[:, None, None, None]
    hi = torch.arange(h, device=index.device)[None, :, None, None]
    kg, vg = k_tiles[bi, hi, index], v_tiles[bi, hi, index]  # [b, h, c, K, T, D]
    s = torch.einsum("bhctd,bhcksd->bhctks", q_tiles, kg) * scale
    ok = ok_slots[:, :, :, None, :, None] & key_ok[index][:, :, :, None]  # [b, h, c, 1, K, T]
    s = s.masked_fill(~ok, float("-inf")).flatten(-2)
    m = s.amax(dim=-1, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)  # exactly 0 where masked; no NaN anywhere (rows with no key: all 0)
    denom = p.sum(dim=-1, keepdim=True)
    o = torch.einsum("bhctn,bhcnd->bhctd", p, vg.flatten(3, 4))
    return o / torch.where(denom > 0, denom, torch.ones_like(denom))


def block_sparse_reference(q, k, v, index, count, tile: int, scale: Optional[float] = None,
                           key_valid: Optional[torch.Tensor] = None) -> torch.Tensor:
    """float64 block-sparse attention of ``[b, S, h, D]`` tensors (S a multiple of ``tile``):
    query tile t sees the tokens of key tiles ``index[b, h, t, :count[b, h, t]]`` (those with
    ``key_valid[slot]``, if given). Differentiable (in chunks of query tiles, each
    checkpointed, so the backward needs little memory); returns ``[b, S, h, D]``."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    b, sq, h, d = q.shape
    sk = k.shape[1]
    qt, kt = sq // tile, sk // tile
    q_tiles = q.to(torch.float64).permute(0, 2, 1, 3).reshape(b, h, qt, tile, d)
    k_tiles = k.to(torch.float64).permute(0, 2, 1, 3).reshape(b, h, kt, tile, d)
    v_tiles = v.to(torch.float64).permute(0, 2, 1, 3).reshape(b, h, kt, tile, v.shape[-1])
    slots = torch.arange(index.shape[-1], device=q.device)
    ok_slots = slots < count[..., None].long()
    safe_index = torch.where(ok_slots, index.long(), 0)
    key_ok = (torch.ones(sk, dtype=torch.bool, device=q.device) if key_valid is None
              else key_valid.to(q.device)).view(kt, tile)
    budget = _REF_CHUNK_ELEMS.get(q.device.type, _REF_CHUNK_ELEMS["cpu"])
    chunk = max(1, budget // max(1, b * h * tile * index.shape[-1] * tile))
    outs = []
    for t0 in range(0, qt, chunk):
        t1 = min(qt, t0 + chunk)
        args = (q_tiles[:, :, t0:t1], k_tiles, v_tiles, safe_index[:, :, t0:t1],
                ok_slots[:, :, t0:t1], key_ok, scale)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
            outs.append(checkpoint(_sparse_rows64, *args, use_reentrant=False))
        else:
            outs.append(_sparse_rows64(*args))
    out = torch.cat(outs, dim=2) if outs else q_tiles.new_zeros(b, h, 0, tile, v.shape[-1])
    return out.reshape(b, h, sq, v.shape[-1]).permute(0, 2, 1, 3)


@dataclass(frozen=True)
class BlockSparseInputs(QkvLayoutInputs):
    q: torch.Tensor  # [B, S, H, D], S a multiple of the tile
    k: torch.Tensor
    v: torch.Tensor
    q2k_index: torch.Tensor  # int32 [B, H, Qt, topk], ascending
    q2k_count: torch.Tensor  # int32 [B, H, Qt]
    tile: int = BLOCK_SPARSE_TILE
    scale: Optional[float] = None
    causal: bool = False
    # Derived objects (BlockMask, block sizes) built once per group, outside the timed calls;
    # shared by the copies that requiring_grad / in_layout make.
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def cached(self, key: str, build):
        if key not in self.memo:
            self.memo[key] = build()
        return self.memo[key]

    def full_block_sizes(self) -> torch.Tensor:
        """int32 [Kt] of ``tile``: every key tile whole (FastVideo's variable_block_sizes)."""
        return self.cached("block_sizes", lambda: torch.full(
            (self.k.shape[1] // self.tile,), self.tile, dtype=torch.int32, device=self.k.device))

    def block_mask(self):
        return self.cached("block_mask", lambda: peers.selection_to_block_mask(
            self.q2k_index, self.q2k_count, self.q.shape[1], self.k.shape[1], self.tile))


class VidattnBlockSparse(Impl):
    """vidattn.block_sparse_attention; ``deterministic=False`` is the row "vidattn-nondet"
    (the backward's dQ added in any order)."""
    backend, is_ours = "vidattn.block_sparse_attention", True

    def __init__(self, deterministic: bool = True):
        self.deterministic = deterministic
        self.name = "vidattn" if deterministic else "vidattn-nondet"

    def unavailable_reason(self, device):
        return missing_vidattn_op("block_sparse_attention")

    def forward(self, inputs: BlockSparseInputs) -> torch.Tensor:
        import vidattn

        return vidattn.block_sparse_attention(inputs.q, inputs.k, inputs.v, inputs.q2k_index,
                                              inputs.q2k_count, tile_volume=inputs.tile,
                                              scale=inputs.scale,
                                              deterministic=self.deterministic,
                                              # The bench builds a valid selection, and the
                                              # peers do not check theirs either.
                                              validate_index=False)


class FlexBlockSparse(Impl):
    """FlexAttention on ``[B, H, S, D]`` (contiguous views of the inputs) with the BlockMask of
    the shared selection, 64 x 64 blocks (FlexAttention's own default block is 128: a 64-token
    selection cannot be put in 128 blocks without changing the work)."""

    name = "flex"
    layout = "bhsd"

    def __init__(self, device_type: str):
        mode = "torch.compile" if device_type == "cuda" else "eager"
        self.backend = f"torch FlexAttention, {mode}, BlockMask 64x64"

    def unavailable_reason(self, device):
        return peers.flex_unavailable(device)

    def forward(self, inputs: BlockSparseInputs) -> torch.Tensor:
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        flex = peers.flex_function(q.device.type)
        out = flex(q, k, v, block_mask=inputs.block_mask(), scale=inputs.scale)
        return out.transpose(1, 2)


class FastVideoBlockSparse(Impl):
    """fastvideo-kernel's Triton block-sparse attention (its custom op with autograd) on
    ``[B, H, S, D]`` contiguous views, the shared selection and whole 64-token tiles."""

    name, backend = "fastvideo-triton", "fastvideo_kernel block_sparse_attn_triton (Triton)"
    layout = "bhsd"

    def unavailable_reason(self, device):
        return peers.fastvideo_unavailable(device)

    def skip_reason(self, device, dtype, shape):
        if dtype not in (torch.bfloat16, torch.float16):
            return f"{self.name}: needs bf16/fp16"
        return None

    def forward(self, inputs: BlockSparseInputs) -> torch.Tensor:
        from fastvideo_kernel.block_sparse_attn import block_sparse_attn_triton

        if inputs.scale is not None and inputs.scale != inputs.q.shape[-1] ** -0.5:
            raise NotImplementedError("fastvideo-triton: only the default scale 1/sqrt(D)")
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        out, _ = block_sparse_attn_triton(q, k, v, inputs.q2k_index, inputs.q2k_count,
                                          inputs.full_block_sizes())
        return out.transpose(1, 2)


class _TkFunction(torch.autograd.Function):
    """tk_vsa's forward and backward as one autograd op on [B, H, S, D] contiguous tensors."""

    @staticmethod
    def forward(ctx, q, k, v, q2k_index, q2k_count, k2q_index, k2q_count, block_sizes):
        tk = peers.tk_module()
        out, lse = tk.fwd(q, k, v, q2k_index, q2k_count, block_sizes)
        ctx.save_for_backward(q, k, v, out, lse, k2q_index, k2q_count, block_sizes)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, lse, k2q_index, k2q_count, block_sizes = ctx.saved_tensors
        dq, dk, dv = peers.tk_module().bwd(q, k, v, out, lse, grad_out.contiguous(), k2q_index,
                                           k2q_count, block_sizes)
        return dq, dk, dv, None, None, None, None, None


class ThunderKittensBlockSparse(Impl):
    """FastVideo's ThunderKittens Hopper kernel (tk_vsa: bf16, 64-token tiles) on ``[B, H, S,
    D]`` contiguous views. Its backward walks the key-tile -> query-tiles lists, built once per
    group outside the timed calls (FastVideo builds them in its own op)."""

    name, backend = "fastvideo-tk", "FastVideo ThunderKittens block_sparse_h100 (sm_90a)"
    layout = "bhsd"

    def unavailable_reason(self, device):
        return peers.tk_unavailable(device)

    def skip_reason(self, device, dtype, shape):
        if dtype != torch.bfloat16:
            return f"{self.name}: bf16 only"
        if shape.head_dim not in (64, 128):
            return f"{self.name}: D = 64 or 128 only"
        return None

    def forward(self, inputs: BlockSparseInputs) -> torch.Tensor:
        if inputs.scale is not None and inputs.scale != inputs.q.shape[-1] ** -0.5:
            raise NotImplementedError("fastvideo-tk: only the default scale 1/sqrt(D)")
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        k2q_index, k2q_count = inputs.cached("k2q", lambda: peers.invert_selection(
            inputs.q2k_index, inputs.q2k_count, inputs.k.shape[1] // inputs.tile))
        out = _TkFunction.apply(q, k, v, inputs.q2k_index, inputs.q2k_count, k2q_index,
                                k2q_count, inputs.full_block_sizes())
        return out.transpose(1, 2)


class BlockSparseCase(Case):
    name = "blocksparse"

    def forward_flops(self, shape: Shape) -> float:
        keys = topk_of(shape) * BLOCK_SPARSE_TILE  # the keys each query attends
        return 4.0 * shape.batch * shape.heads * shape.q_len * keys * shape.head_dim

    def make_inputs(self, shape, dtype, device, generator, input_scale=1.0) -> BlockSparseInputs:
        def randn():
            t = torch.randn(shape.batch, shape.q_len, shape.heads, shape.head_dim,
                            device=device, generator=generator, dtype=torch.float32)
            return (t * input_scale).to(dtype)

        q, k, v = randn(), randn(), randn()
        tiles = shape.q_len // BLOCK_SPARSE_TILE
        index, count = random_selection(shape.batch, shape.heads, tiles, tiles, topk_of(shape),
                                        generator, device)
        return BlockSparseInputs(q, k, v, index, count)

    def make_grad_out(self, inputs: BlockSparseInputs, generator) -> torch.Tensor:
        q = inputs.q
        return torch.randn(q.shape, device=q.device, generator=generator,
                           dtype=torch.float32).to(q.dtype)

    def _reference(self, inputs: BlockSparseInputs, scope: RefScope, requires_grad: bool):
        q, k, v = (scope.take(t).to(torch.float64).requires_grad_(requires_grad)
                   for t in (inputs.q, inputs.k, inputs.v))
        out = block_sparse_reference(q, k, v, scope.take_bh(inputs.q2k_index),
                                     scope.take_bh(inputs.q2k_count), inputs.tile, inputs.scale)
        return (q, k, v), out

    def reference_forward(self, inputs, scope, kind=""):
        with torch.no_grad():
            return (self._reference(inputs, scope, False)[1],)

    def reference_backward(self, inputs, grad_out, scope, kind=""):
        with torch.enable_grad():
            leaves, out = self._reference(inputs, scope, True)
            return torch.autograd.grad(out, leaves, scope.take(grad_out).to(torch.float64))


def blocksparse_case(device: torch.device) -> BlockSparseCase:
    impls = [VidattnBlockSparse(), FlexBlockSparse(device.type), FastVideoBlockSparse(),
             ThunderKittensBlockSparse()]
    if device.type == "cuda":  # the CPU backward is deterministic either way
        impls.insert(1, VidattnBlockSparse(deterministic=False))
    # vidattn's x-peer column: FastVideo's Triton kernel first (the strongest peer), then Flex;
    # the JSON has the ratio to every peer that ran.
    return BlockSparseCase(impls, peer_order=("fastvideo-triton", "flex"))
