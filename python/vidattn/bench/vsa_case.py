"""The VSA case: the whole Video Sparse Attention op against dense attention on the same
tiled tensors (docs/vsa.md), forward and backward.

Rows: ``vidattn-vsa`` (pool + coarse attention + top-k + block-sparse fine attention +
combine), ``vidattn-dense`` (dense attention over the video's tokens: the pad slots masked as
keys and zeroed as queries), PyTorch SDPA on the same padded tensors (cuDNN on CUDA: what
the whole VSA op's target is set against) and, on CUDA when fastvideo-kernel imports,
``fastvideo-vsa`` (FastVideo's whole VSA op, ``video_sparse_attn``, Triton path). TFLOP/s
counts dense-equivalent FLOPs over the padded length for every row, so the x-peer column is
the speedup over dense. Each row is checked against its own float64 reference (VSA with
vidattn's selection, dense over the tokens, or dense over every slot); the backward's
gradient is 0 on pad slots (a model untiles the output) and gradients are compared on token
slots only.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from . import peers
from .base import Case, Impl, QkvLayoutInputs, missing_vidattn_op
from .blocksparse_case import block_sparse_reference
from .dense_case import SdpaDense
from .reference import RefScope
from .shapes import Shape


@dataclass(frozen=True)
class VsaInputs(QkvLayoutInputs):
    q: torch.Tensor  # tiled [B, padded_len, H, D], zeros in pad slots
    k: torch.Tensor
    v: torch.Tensor
    tiling: object   # vidattn.VideoTiling
    sparsity: float
    scale: Optional[float] = None
    causal: bool = False  # for the dense peers' code path
    memo: dict = field(default_factory=dict, compare=False, repr=False)

    def slot_mask(self) -> torch.Tensor:
        """bool [B, padded_len]: True where a slot holds a token."""
        return self.tiling.slot_valid[None, :].expand(self.q.shape[0], -1)


class VidattnVsa(Impl):
    """vidattn.video_sparse_attention; ``deterministic=False`` is the row "vidattn-vsa-nondet"
    (the backward's dQ added in any order)."""
    backend, is_ours = "vidattn.video_sparse_attention", True
    reference_kind = "vsa"

    def __init__(self, deterministic: bool = True):
        self.deterministic = deterministic
        self.name = "vidattn-vsa" if deterministic else "vidattn-vsa-nondet"

    def unavailable_reason(self, device):
        return missing_vidattn_op("block_sparse_attention")

    def forward(self, inputs: VsaInputs) -> torch.Tensor:
        import vidattn

        return vidattn.video_sparse_attention(inputs.q, inputs.k, inputs.v, tiling=inputs.tiling,
                                              sparsity=inputs.sparsity, scale=inputs.scale,
                                              deterministic=self.deterministic)


class VidattnDenseOverTokens(Impl):
    name, backend = "vidattn-dense", "vidattn.attention (pad slots masked)"
    reference_kind = "dense-tokens"

    def unavailable_reason(self, device):
        return missing_vidattn_op("attention")

    def forward(self, inputs: VsaInputs) -> torch.Tensor:
        import vidattn

        mask = inputs.slot_mask()
        return vidattn.attention(inputs.q, inputs.k, inputs.v, scale=inputs.scale,
                                 key_padding_mask=mask, query_padding_mask=mask)


class SdpaOnPadded(SdpaDense):
    """SDPA on the same padded tensors, no mask: the dense attention a model would run."""

    reference_kind = "dense"


class FastVideoVsa(Impl):
    """FastVideo's whole VSA op (fastvideo_kernel.video_sparse_attn: Triton pooling, coarse
    attention in torch, Triton top-k, Triton block-sparse attention without the compiled
    extension) on ``[B, H, S, D]`` contiguous views of the same tiled tensors. It selects its
    own top-k from its bf16 coarse scores; its pad query slots hold values, which the accuracy
    check zeroes (vidattn's are 0), outside the timed call."""

    name, reference_kind = "fastvideo-vsa", "vsa"
    backend = "fastvideo_kernel.video_sparse_attn (Triton path)"
    layout = "bhsd"

    def unavailable_reason(self, device):
        return peers.fastvideo_unavailable(device)

    def skip_reason(self, device, dtype, shape):
        if dtype not in (torch.bfloat16, torch.float16):
            return f"{self.name}: needs bf16/fp16"
        if shape.tile != (4, 4, 4):
            return f"{self.name}: 4x4x4 tiles only"
        return None

    def forward(self, inputs: VsaInputs) -> torch.Tensor:
        import fastvideo_kernel

        from ..vsa import topk_from_sparsity

        tiling = inputs.tiling
        sizes = inputs.memo.get("block_sizes_i32")
        if sizes is None:
            sizes = inputs.memo["block_sizes_i32"] = tiling.block_sizes.to(torch.int32).contiguous()
        q, k, v = (t.transpose(1, 2) for t in (inputs.q, inputs.k, inputs.v))
        out = fastvideo_kernel.video_sparse_attn(
            q, k, v, sizes, sizes, topk_from_sparsity(inputs.sparsity, tiling.num_tiles),
            block_size=tuple(tiling.tile_shape))
        return out.transpose(1, 2)

    def to_common(self, result, inputs):
        return result * inputs.tiling.slot_valid.to(result.dtype)[None, :, None, None]


def _selection(inputs: VsaInputs):
    """The selection vidattn's op makes on these inputs; where that op cannot run (no kernel
    for the device yet), the same rule (top-k of the coarse scores) computed here in float64."""
    import vidattn

    try:
        with torch.no_grad():
            _, (index, count) = vidattn.video_sparse_attention(
                inputs.q, inputs.k, inputs.v, tiling=inputs.tiling, sparsity=inputs.sparsity,
                scale=inputs.scale, return_selection=True)
        return index, count
    except (NotImplementedError, RuntimeError, AttributeError):
        return _selection64(inputs)


def _selection64(inputs: VsaInputs):
    from ..vsa import topk_from_sparsity

    tiling = inputs.tiling
    b, _, h, d = inputs.q.shape
    sizes = tiling.block_sizes.double().clamp(min=1)[None, :, None, None]
    valid = tiling.slot_valid[None, :, None, None]

    def pool(t):
        t = t.double() * valid
        return t.view(b, tiling.num_tiles, tiling.tile_volume, h, -1).sum(2) / sizes

    scale = inputs.scale if inputs.scale is not None else d ** -0.5
    scores = torch.einsum("bthd,buhd->bhtu", pool(inputs.q), pool(inputs.k)) * scale
    topk = topk_from_sparsity(inputs.sparsity, tiling.num_tiles)
    index = scores.topk(topk, dim=-1).indices.sort(dim=-1).values.to(torch.int32)
    count = torch.full(index.shape[:-1], topk, dtype=torch.int32, device=index.device)
    return index, count


def _vsa_reference64(q, k, v, tiling, index, count, scale, coarse: bool):
    """float64 VSA on tiled ``[b, S, h, D]`` tensors (differentiable): block-sparse attention
    over the selected key tiles' tokens (pad slots masked as keys) plus, with ``coarse``, the
    attention over the tiles' means broadcast to each tile's tokens; pad query slots give 0."""
    valid = tiling.slot_valid[None, :, None, None]
    out = block_sparse_reference(q, k, v, index, count, tiling.tile_volume, scale,
                                 key_valid=tiling.slot_valid)
    if coarse:
        b, h, tiles = q.shape[0], q.shape[2], tiling.num_tiles
        sizes = tiling.block_sizes.double().clamp(min=1)[None, :, None, None]

        def pool(t):
            t = t.double() * valid
            return t.view(b, tiles, tiling.tile_volume, h, -1).sum(2) / sizes

        qc, kc, vc = pool(q), pool(k), pool(v)
        p = torch.softmax(torch.einsum("bthd,buhd->bhtu", qc, kc) * scale, dim=-1)
        out = out + torch.einsum("bhtu,buhd->bthd", p, vc)[:, tiling.slot_tile.long()]
    return out * valid


class VsaCase(Case):
    name = "vsa"

    def accepts(self, shape: Shape) -> bool:
        return shape.grid is not None

    def forward_flops(self, shape: Shape) -> float:
        return 4.0 * shape.batch * shape.heads * shape.q_len * shape.kv_len * shape.head_dim

    def make_inputs(self, shape, dtype, device, generator, input_scale=1.0) -> VsaInputs:
        import vidattn

        tiling = vidattn.VideoTiling(grid=shape.grid, tile=shape.tile, device=device)

        # Tiled with plain torch indexing (what tiling.tile computes), so that the inputs exist
        # on a device where vidattn's gather op has no kernel yet.
        source = tiling.slot_to_token.long().clamp(min=0)
        valid = tiling.slot_valid[None, :, None, None]

        def randn():
            t = torch.randn(shape.batch, tiling.num_tokens, shape.heads, shape.head_dim,
                            device=device, generator=generator, dtype=torch.float32)
            return ((t * input_scale).to(dtype).index_select(1, source) * valid).contiguous()

        return VsaInputs(randn(), randn(), randn(), tiling, shape.sparsity)

    def make_grad_out(self, inputs: VsaInputs, generator) -> torch.Tensor:
        """Random, and 0 on pad slots: a model untiles the output, so no gradient reaches them."""
        q = inputs.q
        g = torch.randn(q.shape, device=q.device, generator=generator, dtype=torch.float32)
        return (g * inputs.tiling.slot_valid[None, :, None, None]).to(q.dtype)

    def common_grads(self, grads, inputs: VsaInputs):
        """Gradients on token slots only: the pad slots' are dropped by untiling (and differ
        by design between implementations, e.g. FastVideo's pooling spreads its gradient over
        whole tiles)."""
        valid = inputs.tiling.slot_valid[None, :, None, None]
        return tuple(g * valid.to(g.dtype) for g in grads)

    def _reference(self, inputs: VsaInputs, scope: RefScope, kind: str, requires_grad: bool):
        q, k, v = (scope.take(t).to(torch.float64).requires_grad_(requires_grad)
                   for t in (inputs.q, inputs.k, inputs.v))
        if kind == "dense":  # attention over every slot, pads included (SDPA on padded tensors)
            tile = inputs.tiling.tile_volume
            tiles = q.shape[1] // tile
            index = torch.arange(tiles, dtype=torch.int32, device=q.device).expand(
                q.shape[0], q.shape[2], tiles, tiles)
            count = torch.full(index.shape[:-1], tiles, dtype=torch.int32, device=q.device)
            return (q, k, v), block_sparse_reference(q, k, v, index, count, tile, inputs.scale)
        tiling = inputs.tiling
        scale = inputs.scale if inputs.scale is not None else q.shape[-1] ** -0.5
        tiles = tiling.num_tiles
        if kind == "dense-tokens":  # every key tile: dense attention over the video's tokens
            index = torch.arange(tiles, dtype=torch.int32, device=q.device).expand(
                q.shape[0], q.shape[2], tiles, tiles)
            count = torch.full(index.shape[:-1], tiles, dtype=torch.int32, device=q.device)
            return (q, k, v), _vsa_reference64(q, k, v, tiling, index, count, scale, False)
        # VSA: the selection vidattn made (a constant of the op), plus the coarse branch.
        index, count = (scope.take_bh(t) for t in _selection(inputs))
        return (q, k, v), _vsa_reference64(q, k, v, tiling, index, count, scale, True)

    def reference_forward(self, inputs: VsaInputs, scope: RefScope, kind: str = "vsa"):
        with torch.no_grad():
            return (self._reference(inputs, scope, kind, False)[1],)

    def reference_backward(self, inputs: VsaInputs, grad_out, scope: RefScope, kind: str = "vsa"):
        with torch.enable_grad():
            leaves, out = self._reference(inputs, scope, kind, True)
            grads = torch.autograd.grad(out, leaves, scope.take(grad_out).to(torch.float64))
        return self.common_grads(grads, inputs)


def vsa_case(device: torch.device) -> VsaCase:
    if device.type == "cuda":
        return VsaCase([VidattnVsa(), VidattnVsa(deterministic=False), VidattnDenseOverTokens(),
                        SdpaOnPadded("CUDNN_ATTENTION"), FastVideoVsa()],
                       peer_order=("sdpa-cudnn", "vidattn-dense"))
    # The ratio is to our dense attention (the measure); PyTorch's SDPA on the same
    # padded tensors is there for context.
    return VsaCase([VidattnVsa(), VidattnDenseOverTokens(), SdpaOnPadded()],
                   peer_order=("vidattn-dense", "sdpa"))


def draw_selection(shape: Shape, path, device: torch.device, seed: int = 0) -> None:
    """Runs VSA once on ``shape`` and draws which key tiles (columns) each query tile (rows)
    of batch 0, head 0 selected."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    inputs = VsaCase([], ()).make_inputs(shape, torch.float32, device, gen)
    index, count = _selection(inputs)
    tiles = inputs.tiling.num_tiles
    chosen = torch.zeros(tiles, tiles + 1, dtype=torch.bool)
    slots = torch.arange(index.shape[-1])
    idx, cnt = index[0, 0].cpu().long(), count[0, 0].cpu().long()
    chosen.scatter_(1, torch.where(slots < cnt[:, None], idx, tiles), True)
    fig, ax = plt.subplots(figsize=(7, 6.5))
    ax.imshow(chosen[:, :tiles].numpy(), cmap="Greys", interpolation="nearest", aspect="auto")
    ax.set_xlabel("key tile")
    ax.set_ylabel("query tile")
    ax.set_title(f"VSA selection, batch 0 head 0: {shape.label}\n"
                 f"{int(cnt.max())} of {tiles} key tiles per query tile")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
