"""vidattn inside diffusers' video transformers: ``enable(model, mode=...)`` and
``disable(model)``, for ``WanTransformer3DModel`` (dense and VSA) and
``HunyuanVideoTransformer3DModel`` (dense).

::

    import vidattn.integrations.diffusers as vd
    vd.enable(pipe.transformer, mode="vsa", sparsity=0.9)   # or mode="dense"
    ...
    vd.disable(pipe.transformer)                            # the original processors again

diffusers itself is imported only when ``enable`` runs (``vidattn`` imports without it);
the pinned version is in requirements/dev.txt (0.42.1).

What each mode computes
-----------------------
Both modes replace the attention processors of every ``WanTransformerBlock`` (``attn1``,
the video self-attention, and ``attn2``, the text cross-attention) through diffusers'
processor mechanism (``model.set_attn_processor``); the linear layers, the q / k RMS norms
and everything outside attention stay diffusers' own modules.

- ``dense``: the same function as diffusers' ``WanAttnProcessor``: q, k, v projections (fused
  or not), ``norm_q`` / ``norm_k`` over all heads, RoPE on q and k by ``vidattn.apply_rope``
  (Wan's tables pair lanes (2i, 2i+1): the interleaved layout), softmax attention by
  ``vidattn.attention`` at the default scale 1/sqrt(head_dim), output projection. A bool
  ``attention_mask`` (True = attend) of shape [B, Sk], [B, 1, Sk] or [B, 1, 1, Sk] becomes
  vidattn's ``key_padding_mask``; Wan's own forward passes none (its pipeline zero-pads the
  512 text tokens and attends all of them), so this serves callers that do. One difference
  from SDPA: a query row whose keys are all masked gives 0 here, NaN there. The I2V models'
  image branch (``add_k_proj``: the first ``len - 512`` context tokens attended separately,
  keys through ``norm_added_k``, the two results summed) is supported too.
- ``vsa``: ``attn1`` becomes Video Sparse Attention (docs/vsa.md) over the latent patch grid
  ``(F / p_t) x (H / p_h) x (W / p_w)`` (``T x H/2 x W/2`` for Wan's (1, 2, 2) patches), cut
  in ``tile`` tiles (default 4 x 4 x 4), keeping ``ceil((1 - sparsity) * tiles)`` key tiles per
  query tile. ``attn2`` (text) stays dense on vidattn: VSA is for the video's own tokens.

The gate
--------
VSA mixes its two branches as ``out = o_fine + g * o_coarse``, where ``g`` is a linear
projection of the attention's input (the normalised hidden states), one value per channel of
every head (``g`` has q's shape), with no nonlinearity. ``enable(..., mode="vsa")`` registers
it on each ``attn1`` as the submodule ``to_gate_compress`` (``nn.Linear(dim, heads *
head_dim)``, model dtype and device), so it is trained by the model's optimiser and saved and
loaded with the model's state dict (keys ``blocks.<i>.attn1.to_gate_compress.weight`` /
``.bias``). A gate that already exists (a second ``enable``, or one loaded earlier) is kept.

New gates start at **zero** (weight and bias), as the VSA paper's and FastVideo's fine-tuning
of a dense checkpoint do. So a freshly enabled model computes the fine branch only: each query
tile attends exactly, with the pretrained weights, the key tiles the coarse scores pick. At
``sparsity=0`` (every tile kept) that is the dense model itself (within rounding), and at 90%
it is the closest VSA can start to it; the coarse branch is switched in by training (the gate
gets a nonzero gradient from the first step, ``grad = grad_out * o_coarse``). Load a VSA-trained
checkpoint (``load_state_dict`` after ``enable``) to get its trained gates.

The tiling and tile order
-------------------------
The tiling depends only on the latent shape, so it is built once per forward (and cached per
shape and device: a denoising loop builds it once): a forward pre-hook on the transformer reads
the ``hidden_states`` latents [B, C, F, H, W] and puts the tiling in a context object that the
processors and hooks read.

Where the tokens are put into tile order is ``enable``'s ``retile``:

- ``"forward"``: once per forward. Everything between two of Wan's self-attentions is token-wise
  (norms, modulation, FFN) or independent per query (the text cross-attention), so the blocks
  can run on tile-ordered tokens. Hooks at the places diffusers' own context-parallel plan for
  Wan uses: the ``rope`` module's output is tiled once into per-pair tables ``[P, D/2]``, the
  first block's ``hidden_states`` are tiled, the last block's output untiled (before the output
  norm, whose per-token shift in Wan 2.2 TI2V is in raster order), and a per-token timestep
  embedding ``temb`` [B, S, 6, C] is tiled per block. The processors know the layout from the
  RoPE tables they get (2-D: tile order), not from a flag, so gradient checkpointing's
  recomputation and a block compiled on its own see the layout of their actual arguments. The
  tiled layout has the tiling's padding slots (zero when tiled); they pass through the linear
  layers with finite values that no real token reads (VSA's pooling and fine branch mask them
  through ``block_sizes``; padded query rows output 0), and the final untile drops them: real
  outputs equal the per-layer version's bit for bit, gradients up to the order in which a
  weight gradient sums its tokens.
- ``"layer"``: q, k, v and the gate are tiled and the output untiled in each self-attention
  (five gathers a layer), the rest of the block in raster order.
- ``"auto"`` (default): ``"forward"`` when the grid is whole tiles (tile order is then a pure
  permutation: strictly less work), ``"layer"`` otherwise. Wan's grids are not multiples of 4
  (21 x 30 x 52 at 480p, 21 x 45 x 80 at 720p): tile order would carry 22% more rows through
  every linear layer (39,936 slots for 32,760 tokens at 480p, 92,160 for 75,600 at 720p),
  more than the five gathers a layer it saves. Measured (one H100, 2026-12-06,
  ``bench/results/NVIDIA-H100/e2e.json``): a 1.3B 480p inference step takes 324.7 ms per
  layer and 365.9 ms in tile order; 14B 720p (8 blocks) 1090 ms and 1256 ms. ``python -m
  vidattn.bench --e2e --impls vidattn-vsa,vidattn-vsa-tiled`` measures both.

The last tiling stays current after the forward, so that gradient checkpointing's
recomputation in the backward finds it; a processor checks that its sequence has the tiling's
token (or slot) count and raises otherwise.

Sequence parallelism
--------------------
``enable(model, mode, process_group=group)`` shards a Wan model's sequence over a
``torch.distributed`` group: every rank calls the model with the same whole inputs; a pre-hook
on the first block keeps the rank's contiguous part of the tokens (the last ranks' parts padded
to equal length), the blocks run on it, the self-attention through
``vidattn.DistributedAttention`` (dense, or VSA with the tiling of the whole grid; RoPE with
the whole sequence's tables after its all-to-all; the VSA gate stays on its rank), the text
cross-attention on the rank's queries against the whole text, and a hook on ``proj_out``
gathers the output, so every rank returns the whole result. The gather's backward hands each
rank its own slice of the gradient: when every rank computes the same loss, each rank's
parameter gradients are those of its own tokens, and their sum over the group (all-reduce) is
the single-process gradient. The heads must divide by the group size. Refused: diffusers' own
context parallelism, a per-token timestep (Wan 2.2 TI2V), ``retile="forward"``
(DistributedAttention tiles the gathered sequence itself).

Limits
------
VSA mode takes no attention mask on ``attn1`` and no batched videos of different shapes.
diffusers' ``set_attention_backend`` choice is ignored while enabled (restored with the
original processors).

HunyuanVideo
------------
``HunyuanVideoTransformer3DModel`` (diffusers 0.42) runs joint attention: its dual-stream
blocks (``HunyuanVideoAttnProcessor2_0`` with ``add_q_proj`` / ``add_k_proj`` /
``add_v_proj``) and single-stream blocks put the video tokens and the (padded) text tokens in
one sequence, with RoPE (interleaved pairs, ``[S, D]`` tables) on the video part only and a
bool mask [B, 1, 1, N] for the text padding. ``enable(model, mode="dense")`` replaces every
such processor by ``VidattnHunyuanVideoAttnProcessor`` (the same function: projections and
norms as diffusers', ``vidattn.apply_rope`` on the video rows, ``vidattn.attention`` with the
mask as ``key_padding_mask``); the text token refiner's own attentions stay diffusers'.
VSA mode is not done: the video queries must attend the video keys sparsely *and* the text
keys densely in one softmax, and the text queries everything densely, i.e. VSA's output merged
with a dense attention over the text keys through their log-sum-exps, which needs
``video_sparse_attention`` to return its LSE (it does not today) or a VSA variant with extra
dense keys; then the gate and the tiling of the video rows of the joint sequence (grid
``T x H/2 x W/2``: 30 x 48 x 80 at 720p, 115,200 tokens). Sequence parallelism for it would
shard the video rows and replicate the text, which is what ``DistributedAttention``'s
``replicated_q/k/v`` do.
"""
from __future__ import annotations

import copy
from typing import Optional, Tuple

import torch

import vidattn

__all__ = ["enable", "disable", "enabled_mode", "set_latent_grid", "GATE_NAME", "WAN_TEXT_TOKENS",
           "RETILE", "VidattnWanAttnProcessor", "VidattnWanVSAProcessor",
           "VidattnWanShardedSelfAttnProcessor", "VidattnHunyuanVideoAttnProcessor"]

MODES = ("dense", "vsa")
# The gate's submodule name on each attn1: "compression gate" is VSA's term for the weight of
# the coarse (compressed) branch.
GATE_NAME = "to_gate_compress"
# diffusers' WanAttnProcessor hard-codes the text encoder's context length when it splits an
# I2V model's context into image and text tokens; the split has to be the same here.
WAN_TEXT_TOKENS = 512
# Attribute of the model that holds what disable() needs (a plain attribute: not a submodule,
# so it never reaches the state dict).
_STATE_ATTR = "_vidattn_diffusers_state"
# Tilings kept per model (one per latent shape and device): a pipeline uses one or two shapes.
_TILING_CACHE_SIZE = 8


def _wan_classes():
    """diffusers' Wan classes, imported on first use (vidattn does not need diffusers)."""
    try:
        from diffusers.models.transformers.transformer_wan import (WanAttention,
                                                                   WanTransformer3DModel)
    except ImportError as e:
        raise ImportError(
            "vidattn.integrations.diffusers needs diffusers (requirements/dev.txt pins "
            "diffusers==0.42.1): pip install diffusers==0.42.1") from e
    return WanTransformer3DModel, WanAttention


# ---------------------------------------------------------------------------------------
# What both processors share


def _projections(attn, hidden_states, context):
    """q, k, v [B, S, heads * head_dim] as WanAttention's weights give them, fused or not."""
    if getattr(attn, "fused_projections", False):
        if not attn.is_cross_attention:
            return attn.to_qkv(hidden_states).chunk(3, dim=-1)
        key, value = attn.to_kv(context).chunk(2, dim=-1)
        return attn.to_q(hidden_states), key, value
    return attn.to_q(hidden_states), attn.to_k(context), attn.to_v(context)


def _rope_tables(rotary_emb, seqlen: int) -> Tuple[torch.Tensor, torch.Tensor]:
    """Wan's (cos, sin) [1, S, 1, D] -> vidattn's per-pair tables [S, D/2] (views, no copy).

    WanRotaryPosEmbed repeats each angle over its pair (2i, 2i+1); diffusers' processor reads
    the cosine from the even lanes and the sine from the odd ones, so the same lanes are read
    here, which keeps the two equal even for tables that were not built that way.

    Tables that are already per-pair ``[S, D/2]`` (2-D) pass through: those are the tile-order
    tables that the VSA mode's rope hook hands the blocks when the hidden states travel in tile
    order (see ``_is_tiled_rope``)."""
    if (not isinstance(rotary_emb, (tuple, list)) or len(rotary_emb) != 2
            or not all(isinstance(t, torch.Tensor) for t in rotary_emb)):
        raise ValueError("rotary_emb: expected a (cos, sin) pair of tensors as "
                         f"WanRotaryPosEmbed returns, got {type(rotary_emb).__name__}")
    cos, sin = rotary_emb
    if cos.dim() == 2 and cos.shape == sin.shape and cos.shape[0] == seqlen:
        return cos, sin
    if cos.dim() != 4 or cos.shape != sin.shape or cos.shape[0] != 1 or cos.shape[2] != 1 \
            or cos.shape[1] != seqlen or cos.shape[3] % 2:
        raise ValueError(f"rotary_emb: expected cos and sin of shape [1, {seqlen}, 1, D] with D "
                         f"even, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return cos[0, :, 0, 0::2], sin[0, :, 0, 1::2]


def _is_tiled_rope(rotary_emb) -> bool:
    """Whether a block received the tile-order per-pair tables [P, D/2] of the VSA mode's
    rope hook (Wan's own tables are 4-D). The shape, not a flag, says it, so that a block
    called again by gradient checkpointing's recomputation, or compiled on its own, sees the
    layout of the arguments it is actually given."""
    return (isinstance(rotary_emb, (tuple, list)) and len(rotary_emb) == 2
            and isinstance(rotary_emb[0], torch.Tensor) and rotary_emb[0].dim() == 2)


def _qkv(attn, hidden_states, context, rotary_emb):
    """Projections, q / k norms (across heads, before the split, as Wan does), the head split
    to vidattn's [B, S, H, D] and RoPE."""
    query, key, value = _projections(attn, hidden_states,
                                     hidden_states if context is None else context)
    query = attn.norm_q(query)
    key = attn.norm_k(key)
    query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
    if rotary_emb is not None:
        cos, sin = _rope_tables(rotary_emb, query.shape[1])
        if key.shape[1] != query.shape[1]:
            raise ValueError("rotary_emb: RoPE needs keys at the queries' positions, but k has "
                             f"{key.shape[1]} tokens and q {query.shape[1]}")
        query = vidattn.apply_rope(query, cos, sin, interleaved=True)
        key = vidattn.apply_rope(key, cos, sin, interleaved=True)
    return query, key, value


def _key_padding_mask(attention_mask, batch: int, seqlen_k: int) -> Optional[torch.Tensor]:
    """A bool mask (True = attend) [B, Sk], [B, 1, Sk] or [B, 1, 1, Sk] (B may be 1) ->
    vidattn's key_padding_mask [B, Sk]. Other masks (float, per-query) have no vidattn form."""
    if attention_mask is None:
        return None
    if not isinstance(attention_mask, torch.Tensor) or attention_mask.dtype != torch.bool:
        raise ValueError(
            "attention_mask: vidattn takes a bool key padding mask (True = attend) of shape "
            f"[B, Sk], [B, 1, Sk] or [B, 1, 1, Sk], got "
            f"{attention_mask.dtype if isinstance(attention_mask, torch.Tensor) else type(attention_mask).__name__}")
    mask = attention_mask
    while mask.dim() > 2 and mask.shape[1] == 1:
        mask = mask.squeeze(1)
    if mask.dim() != 2 or mask.shape[1] != seqlen_k or mask.shape[0] not in (1, batch):
        raise ValueError(
            f"attention_mask: expected a key padding mask [B, Sk], [B, 1, Sk] or [B, 1, 1, Sk] "
            f"with B = {batch} (or 1) and Sk = {seqlen_k}, got {tuple(attention_mask.shape)}")
    return mask.expand(batch, seqlen_k).contiguous()


def _split_image_context(attn, encoder_hidden_states):
    """(text context, image context or None), split as diffusers' Wan processor splits an I2V
    model's context: the image tokens first, then WAN_TEXT_TOKENS text tokens."""
    if attn.add_k_proj is None:
        return encoder_hidden_states, None
    if encoder_hidden_states is None or encoder_hidden_states.shape[1] < WAN_TEXT_TOKENS:
        raise ValueError(
            "encoder_hidden_states: an attention with an image branch (add_k_proj) needs the "
            f"image tokens followed by {WAN_TEXT_TOKENS} text tokens, got "
            f"{None if encoder_hidden_states is None else tuple(encoder_hidden_states.shape)}")
    n_image = encoder_hidden_states.shape[1] - WAN_TEXT_TOKENS
    return encoder_hidden_states[:, n_image:], encoder_hidden_states[:, :n_image]


def _image_branch(attn, query, image_context):
    """The I2V image attention: q over the image tokens' keys (through norm_added_k) and values,
    no mask, no RoPE."""
    if getattr(attn, "fused_projections", False):
        key, value = attn.to_added_kv(image_context).chunk(2, dim=-1)
    else:
        key, value = attn.add_k_proj(image_context), attn.add_v_proj(image_context)
    key = attn.norm_added_k(key).unflatten(2, (attn.heads, -1))
    value = value.unflatten(2, (attn.heads, -1))
    return vidattn.attention(query, key, value).flatten(2, 3).type_as(query)


def _output(attn, out):
    """to_out: the projection, then the dropout module diffusers keeps beside it."""
    return attn.to_out[1](attn.to_out[0](out))


class VidattnWanAttnProcessor:
    """Dense WanAttention on vidattn's ops: self-attention (with RoPE) and cross-attention
    (with an optional bool key padding mask and the I2V image branch). Stateless: one
    instance serves every layer."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        text_context, image_context = _split_image_context(attn, encoder_hidden_states)
        query, key, value = _qkv(attn, hidden_states, text_context, rotary_emb)
        mask = _key_padding_mask(attention_mask, query.shape[0], key.shape[1])
        out = vidattn.attention(query, key, value, key_padding_mask=mask)
        out = out.flatten(2, 3).type_as(query)
        if image_context is not None:
            out = out + _image_branch(attn, query, image_context)
        return _output(attn, out)


def _hunyuan_classes():
    """diffusers' HunyuanVideo transformer and its joint-attention processor class, or
    (None, None) where this diffusers has none."""
    try:
        from diffusers.models.transformers.transformer_hunyuan_video import (
            HunyuanVideoAttnProcessor2_0, HunyuanVideoTransformer3DModel)
    except ImportError:
        return None, None
    return HunyuanVideoTransformer3DModel, HunyuanVideoAttnProcessor2_0


def _hunyuan_rope_tables(image_rotary_emb, seqlen: int):
    """HunyuanVideo's (cos, sin) [S, D] (each angle repeated over its interleaved pair), used
    as vidattn's full-width tables."""
    if (not isinstance(image_rotary_emb, (tuple, list)) or len(image_rotary_emb) != 2
            or not all(isinstance(t, torch.Tensor) for t in image_rotary_emb)):
        raise ValueError("image_rotary_emb: expected a (cos, sin) pair of tensors as "
                         "HunyuanVideoRotaryPosEmbed returns, got "
                         f"{type(image_rotary_emb).__name__}")
    cos, sin = image_rotary_emb
    if cos.dim() != 2 or cos.shape != sin.shape or cos.shape[0] != seqlen or cos.shape[1] % 2:
        raise ValueError(f"image_rotary_emb: expected cos and sin of shape [{seqlen}, D] with D "
                         f"even, got {tuple(cos.shape)} and {tuple(sin.shape)}")
    return cos, sin


class VidattnHunyuanVideoAttnProcessor:
    """HunyuanVideo's joint attention on vidattn's ops, the same function as diffusers'
    ``HunyuanVideoAttnProcessor2_0``: the video tokens and the text tokens in one sequence
    (dual-stream blocks project the text with ``add_*_proj``; single-stream blocks receive it
    to concatenate), per-head q / k norms, RoPE (interleaved pairs, full-width tables) on the
    video rows only by ``vidattn.apply_rope``, the bool text padding mask [B, 1, 1, N] as
    ``key_padding_mask``, then the split back into video and text outputs. Stateless."""

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 image_rotary_emb=None):
        joined_here = attn.add_q_proj is None and encoder_hidden_states is not None
        if joined_here:
            hidden_states = torch.cat([hidden_states, encoder_hidden_states], dim=1)
        query, key, value = (proj(hidden_states).unflatten(2, (attn.heads, -1))
                             for proj in (attn.to_q, attn.to_k, attn.to_v))
        if attn.norm_q is not None:
            query = attn.norm_q(query)
        if attn.norm_k is not None:
            key = attn.norm_k(key)
        if image_rotary_emb is not None:
            n_video = query.shape[1] - (encoder_hidden_states.shape[1] if joined_here else 0)
            cos, sin = _hunyuan_rope_tables(image_rotary_emb, n_video)

            def rope(x):
                video = vidattn.apply_rope(x[:, :n_video], cos, sin, interleaved=True)
                return torch.cat([video, x[:, n_video:]], dim=1) if joined_here else video

            query, key = rope(query), rope(key)
        if attn.add_q_proj is not None and encoder_hidden_states is not None:
            text_q, text_k, text_v = (
                proj(encoder_hidden_states).unflatten(2, (attn.heads, -1))
                for proj in (attn.add_q_proj, attn.add_k_proj, attn.add_v_proj))
            if attn.norm_added_q is not None:
                text_q = attn.norm_added_q(text_q)
            if attn.norm_added_k is not None:
                text_k = attn.norm_added_k(text_k)
            query = torch.cat([query, text_q], dim=1)
            key = torch.cat([key, text_k], dim=1)
            value = torch.cat([value, text_v], dim=1)
        mask = _key_padding_mask(attention_mask, query.shape[0], key.shape[1])
        out = vidattn.attention(query, key, value, key_padding_mask=mask)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:
            return out, encoder_hidden_states
        n_text = encoder_hidden_states.shape[1]
        out, text_out = out[:, :-n_text], out[:, -n_text:]
        if getattr(attn, "to_out", None) is not None:
            out = attn.to_out[1](attn.to_out[0](out))
        if getattr(attn, "to_add_out", None) is not None:
            text_out = attn.to_add_out(text_out)
        return out, text_out


def _enable_hunyuan(model, mode: str, process_group):
    """enable() for a HunyuanVideoTransformer3DModel: dense mode on every joint attention
    (the text token refiner's own attentions stay diffusers')."""
    _, processor_class = _hunyuan_classes()
    if mode != "dense":
        raise NotImplementedError(
            f"mode: HunyuanVideo supports mode='dense' only, got {mode!r} (VSA over its joint "
            "video + text sequence needs the sparse video keys and the dense text keys in one "
            "softmax; see the module's docstring)")
    if process_group is not None:
        raise NotImplementedError("process_group: sequence parallelism is wired for Wan only")
    if getattr(model, _STATE_ATTR, None) is not None:
        disable(model)
    originals = dict(model.attn_processors)
    for name, processor in originals.items():
        if getattr(processor, "_parallel_config", None) is not None:
            raise NotImplementedError(f"model: {name} runs diffusers' context parallelism; "
                                      "vidattn's processors see whole sequences only")
    dense = VidattnHunyuanVideoAttnProcessor()
    processors = {name: dense if isinstance(processor, processor_class) else processor
                  for name, processor in originals.items()}
    if not any(p is dense for p in processors.values()):
        raise TypeError("model: no HunyuanVideoAttnProcessor2_0 to replace")
    model.set_attn_processor(processors)
    setattr(model, _STATE_ATTR, _State(mode, None, None, None, originals, [], None, None))
    return model


RETILE = ("auto", "forward", "layer")


class _TilingContext:
    """The tiling of the current forward's latents, shared by every layer's VSA processor and
    by the hooks that move the hidden states into tile order and back.

    ``begin`` runs in a forward pre-hook of the transformer: one tiling per latent shape and
    device, built on first sight and cached, so the layers never build one. It also decides,
    per forward, whether the hidden states travel between the blocks in tile order
    (``carry``; see ``enable``'s ``retile``)."""

    def __init__(self, patch_size, tile, retile: str = "auto"):
        self.patch_size = tuple(int(p) for p in patch_size)
        self.tile = tuple(int(t) for t in tile)
        self.retile = retile
        self.current: Optional[vidattn.VideoTiling] = None
        self.carry = False
        self._cache: dict = {}

    def grid_of(self, latents: torch.Tensor) -> Tuple[int, int, int]:
        pt, ph, pw = self.patch_size
        _, _, frames, height, width = latents.shape
        return frames // pt, height // ph, width // pw

    def begin(self, latents) -> None:
        if not isinstance(latents, torch.Tensor) or latents.dim() != 5:
            raise ValueError("hidden_states: VSA mode needs the latents [B, C, F, H, W] as the "
                             "transformer's first argument, got "
                             f"{tuple(latents.shape) if isinstance(latents, torch.Tensor) else type(latents).__name__}")
        key = (self.grid_of(latents), latents.device)
        tiling = self._cache.get(key)
        if tiling is None:
            if len(self._cache) >= _TILING_CACHE_SIZE:
                self._cache.pop(next(iter(self._cache)))
            tiling = vidattn.VideoTiling(grid=key[0], tile=self.tile, device=latents.device)
            self._cache[key] = tiling
        self.current = tiling
        self.carry = self.retile == "forward" or (
            self.retile == "auto" and tiling.padded_len == tiling.num_tokens)

    def tiling_for(self, seqlen: int, device: torch.device,
                   tiled: bool = False) -> vidattn.VideoTiling:
        tiling = self.current
        if tiling is None:
            raise RuntimeError(
                "vidattn VSA: no tiling is set. The tiling comes from the latents the "
                "transformer's forward receives: call the WanTransformer3DModel, not a block "
                "alone (or set it with vidattn.integrations.diffusers.set_latent_grid)")
        expected = tiling.padded_len if tiled else tiling.num_tokens
        if expected != seqlen or tiling.device != device:
            raise RuntimeError(
                f"vidattn VSA: the sequence has {seqlen} tokens on {device} but the current "
                f"tiling {tiling!r} (from the last latents the transformer received) has "
                f"{expected} {'tiled slots' if tiled else 'tokens'} on {tiling.device}")
        return tiling


def _tile_rows(tiling: vidattn.VideoTiling, x: torch.Tensor) -> torch.Tensor:
    """[B, S, C] raster -> [B, P, C] tile order (zeros in the padding slots)."""
    return tiling.tile(x.unsqueeze(2)).squeeze(2)


def _untile_rows(tiling: vidattn.VideoTiling, x: torch.Tensor) -> torch.Tensor:
    """[B, P, C] tile order -> [B, S, C] raster (padding slots dropped)."""
    return tiling.untile(x.unsqueeze(2)).squeeze(2)


class VidattnWanVSAProcessor:
    """Video Sparse Attention for a Wan self-attention (attn1), with the layer's gate
    (``attn.to_gate_compress``) and the tiling of the current forward.

    Its input is in raster order (it tiles q, k, v and the gate and untiles the output), or,
    when the block was handed tile-order RoPE tables (``_is_tiled_rope``), already in tile
    order with the tiling's padding slots (it tiles and untiles nothing)."""

    def __init__(self, context: _TilingContext, sparsity: float):
        self.context = context
        self.sparsity = float(sparsity)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if encoder_hidden_states is not None:
            raise ValueError("encoder_hidden_states: the VSA processor is for Wan's video "
                             "self-attention (attn1), which takes no context")
        if attention_mask is not None:
            raise NotImplementedError("attention_mask: VSA mode takes no mask on the video "
                                      "self-attention (the tiles' block sizes are its padding)")
        gate_proj = getattr(attn, GATE_NAME, None)
        if gate_proj is None:
            raise RuntimeError(f"vidattn VSA: the attention has no {GATE_NAME} (enable(model, "
                               "mode='vsa') creates it)")
        tiled = _is_tiled_rope(rotary_emb)
        tiling = self.context.tiling_for(hidden_states.shape[1], hidden_states.device, tiled)
        query, key, value = _qkv(attn, hidden_states, None, rotary_emb)
        gate = gate_proj(hidden_states).unflatten(2, (attn.heads, -1)).to(query.dtype)
        if not tiled:
            query, key, value, gate = (tiling.tile(t) for t in (query, key, value, gate))
        out = vidattn.video_sparse_attention(query, key, value, tiling=tiling,
                                             sparsity=self.sparsity, gate=gate)
        if not tiled:
            out = tiling.untile(out)
        return _output(attn, out.flatten(2, 3).type_as(query))


# ---------------------------------------------------------------------------------------
# Sequence parallelism


class _ShardContext:
    """The process group a sequence-parallel model runs over, and the current forward's
    unsharded sequence length (set where the hidden states are sharded)."""

    def __init__(self, group):
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError("process_group: torch.distributed is not initialized "
                             "(dist.init_process_group first)")
        self.group = group
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("process_group: this process is not a member of the group")
        self.seq_len: Optional[int] = None

    def __deepcopy__(self, memo):
        # A deep copy of the model (an EMA copy, say) runs over the same process group.
        twin = copy.copy(self)
        memo[id(self)] = twin
        return twin

    def shard(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """[B, S, C] whole -> [B, ceil(S / world), C], this rank's contiguous part (the last
        ranks' parts padded with zero rows)."""
        seq_len = hidden_states.shape[1]
        s_local = -(-seq_len // self.world)
        self.seq_len = seq_len
        padded = torch.nn.functional.pad(hidden_states,
                                         (0, 0, 0, s_local * self.world - seq_len))
        return padded[:, self.rank * s_local:(self.rank + 1) * s_local]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        if self.seq_len is None:
            raise RuntimeError("vidattn: the output head ran before the blocks sharded the "
                               "sequence")
        return _GatherSequence.apply(x, self.seq_len, self.group, self.world, self.rank)


class _GatherSequence(torch.autograd.Function):
    """All ranks' parts [B, S_local, C] -> the whole [B, S, C] on every rank. Backward: this
    rank's slice of the gradient, so that when every rank computes the same loss from the
    whole output, each rank's gradients are those of the loss through its own tokens, and
    their sum over the group is the single-process gradient."""

    @staticmethod
    def forward(ctx, x, seq_len, group, world, rank):
        import torch.distributed as dist

        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(world)]
        dist.all_gather(parts, x, group=group)
        ctx.rank, ctx.s_local = rank, x.shape[1]
        return torch.cat(parts, dim=1)[:, :seq_len]

    @staticmethod
    def backward(ctx, grad):
        start = ctx.rank * ctx.s_local
        part = grad[:, start:start + ctx.s_local]
        if part.shape[1] < ctx.s_local:  # padding rows of the last ranks: no gradient
            part = torch.nn.functional.pad(part, (0, 0, 0, ctx.s_local - part.shape[1]))
        return part, None, None, None, None


class VidattnWanShardedSelfAttnProcessor:
    """A Wan self-attention (attn1) whose hidden states are this rank's part of the sequence:
    the projections, q / k norms and gate on the part, then ``vidattn.DistributedAttention``
    (dense, or VSA with the tiling of the whole grid), which gathers the sequence per head
    group, applies RoPE with the whole sequence's tables and returns this rank's part."""

    def __init__(self, shards: _ShardContext, tiling_context: Optional[_TilingContext],
                 sparsity: float):
        self.shards = shards
        self.tiling_context = tiling_context
        self.sparsity = float(sparsity)

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None,
                 rotary_emb=None):
        if encoder_hidden_states is not None or attention_mask is not None:
            raise ValueError("encoder_hidden_states, attention_mask: the sequence-parallel "
                             "processor is for Wan's video self-attention (attn1), which takes "
                             "neither")
        seq_len = self.shards.seq_len
        if seq_len is None:
            raise RuntimeError("vidattn: the sequence-parallel self-attention ran outside a "
                               "forward of the transformer (its first block shards the "
                               "sequence)")
        query, key, value = _projections(attn, hidden_states, hidden_states)
        query = attn.norm_q(query).unflatten(2, (attn.heads, -1))
        key = attn.norm_k(key).unflatten(2, (attn.heads, -1))
        value = value.unflatten(2, (attn.heads, -1))
        cos = sin = None
        if rotary_emb is not None:
            cos, sin = _rope_tables(rotary_emb, seq_len)
        gate = None
        if self.tiling_context is not None:
            gate_proj = getattr(attn, GATE_NAME, None)
            if gate_proj is None:
                raise RuntimeError(f"vidattn VSA: the attention has no {GATE_NAME} "
                                   "(enable(model, mode='vsa') creates it)")
            gate = gate_proj(hidden_states).unflatten(2, (attn.heads, -1)).to(query.dtype)
            tiling = self.tiling_context.tiling_for(seq_len, hidden_states.device)
            layer = vidattn.DistributedAttention("vsa", group=self.shards.group, tiling=tiling,
                                                 sparsity=self.sparsity)
        else:
            layer = vidattn.DistributedAttention("dense", group=self.shards.group)
        out = layer(query, key, value, seq_len=seq_len, cos=cos, sin=sin, gate=gate)
        return _output(attn, out.flatten(2, 3).type_as(query))


class _State:
    """What enable() changed, for disable(): the original processors by name, the hooks, and
    the contexts the processors read."""

    def __init__(self, mode, sparsity, tile, retile, originals, hooks, context, shards):
        self.mode, self.sparsity, self.tile, self.retile = mode, sparsity, tile, retile
        self.originals, self.hooks, self.context, self.shards = originals, hooks, context, shards


# ---------------------------------------------------------------------------------------
# enable / disable


def _check_model(model):
    WanTransformer3DModel, WanAttention = _wan_classes()
    if not isinstance(model, WanTransformer3DModel):
        raise TypeError("model: expected diffusers' WanTransformer3DModel or "
                        f"HunyuanVideoTransformer3DModel, got {type(model).__name__}")
    for i, block in enumerate(model.blocks):
        for name in ("attn1", "attn2"):
            attn = getattr(block, name, None)
            if not isinstance(attn, WanAttention):
                raise TypeError(f"model: blocks[{i}].{name} is {type(attn).__name__}, not "
                                "WanAttention")
            if getattr(attn.processor, "_parallel_config", None) is not None:
                raise NotImplementedError(
                    f"model: blocks[{i}].{name} runs diffusers' context parallelism; shard "
                    "the sequence with vidattn's own instead: enable(model, ..., "
                    "process_group=group) on a model without diffusers' parallel config")


def _check_tile(tile) -> Tuple[int, int, int]:
    try:
        t = tuple(int(x) for x in tile)
    except (TypeError, ValueError):
        raise ValueError(f"tile: expected three integers (t, h, w), got {tile!r}") from None
    if len(t) != 3 or min(t) < 1 or t[0] * t[1] * t[2] not in (64, 128, 256):
        raise ValueError(f"tile: expected three positive integers whose product is 64, 128 or "
                         f"256 (e.g. (4, 4, 4)), got {tile!r}")
    return t


def _add_gate(attn) -> None:
    """attn.to_gate_compress = Linear(dim, heads * head_dim), zero (see the module's note)."""
    if getattr(attn, GATE_NAME, None) is not None:
        return  # kept: trained or loaded weights
    out_proj = attn.to_out[0]
    gate = torch.nn.Linear(out_proj.out_features, attn.inner_dim, bias=True,
                           device=out_proj.weight.device, dtype=out_proj.weight.dtype)
    torch.nn.init.zeros_(gate.weight)
    torch.nn.init.zeros_(gate.bias)
    attn.add_module(GATE_NAME, gate)


# The blocks' arguments, as WanTransformer3DModel.forward passes them (positionally, also
# through gradient checkpointing); the hooks read them by position or by name.
_BLOCK_ARGS = ("hidden_states", "encoder_hidden_states", "temb", "rotary_emb")


def _block_arg(args, kwargs, name):
    i = _BLOCK_ARGS.index(name)
    return args[i] if len(args) > i else kwargs.get(name)


def _replace_block_arg(args, kwargs, name, value):
    i = _BLOCK_ARGS.index(name)
    if len(args) > i:
        args = args[:i] + (value,) + args[i + 1:]
    else:
        kwargs = dict(kwargs, **{name: value})
    return args, kwargs


def _latents_of(args, kwargs):
    return args[0] if args else kwargs.get("hidden_states")


def _timestep_of(args, kwargs):
    return args[1] if len(args) > 1 else kwargs.get("timestep")


# The hooks read what they need from an attribute of the module they run on, not from a
# closure: a deep copy of an enabled model (an EMA copy, say) then carries hooks that act on the
# copy's own state, and disable() removes them by id from the modules of the model it is given.
_HOOK_ATTR = "_vidattn_hook_state"


def _set_tiling(model, args, kwargs):
    getattr(model, _STATE_ATTR).context.begin(_latents_of(args, kwargs))


def _tile_rope(module, args, output):
    context = getattr(module, _HOOK_ATTR)
    if not context.carry:
        return output
    tiling = context.current
    cos, sin = _rope_tables(output, tiling.num_tokens)
    # The per-pair tables are strided views of the full-width ones; the gather wants unit
    # stride.
    return tuple(tiling.tile(t.contiguous()[None, :, None, :])[0, :, 0] for t in (cos, sin))


def _enter_block(module, args, kwargs):
    if not _is_tiled_rope(_block_arg(args, kwargs, "rotary_emb")):
        return None
    context, first, _ = getattr(module, _HOOK_ATTR)
    tiling = context.current
    if first:
        hidden = _block_arg(args, kwargs, "hidden_states")
        args, kwargs = _replace_block_arg(args, kwargs, "hidden_states",
                                          _tile_rows(tiling, hidden))
    temb = _block_arg(args, kwargs, "temb")
    if isinstance(temb, torch.Tensor) and temb.dim() == 4:  # [B, S, 6, C]
        args, kwargs = _replace_block_arg(args, kwargs, "temb", tiling.tile(temb))
    return args, kwargs


def _leave_block(module, args, kwargs, output):
    context, _, last = getattr(module, _HOOK_ATTR)
    if not last or not _is_tiled_rope(_block_arg(args, kwargs, "rotary_emb")):
        return output
    return _untile_rows(context.current, output)


def _check_timestep(model, args, kwargs):
    timestep = _timestep_of(args, kwargs)
    if isinstance(timestep, torch.Tensor) and timestep.dim() == 2:
        raise NotImplementedError(
            "timestep: a per-token timestep [B, S] (Wan 2.2 TI2V) is not supported with "
            "process_group= (the output norm's per-token shift would need sharding too)")


def _shard_input(module, args, kwargs):
    hidden = _block_arg(args, kwargs, "hidden_states")
    shards = getattr(module, _HOOK_ATTR)
    return _replace_block_arg(args, kwargs, "hidden_states", shards.shard(hidden))


def _gather_output(module, args, output):
    return getattr(module, _HOOK_ATTR).gather(output)


def _register(model, module, kind: str, hook, state=None) -> tuple:
    """Registers ``hook`` (kind "pre" or "post", with kwargs where the hook takes them) on
    ``module`` of ``model``, with ``state`` in the module's hook attribute; returns the record
    disable() needs: (the module's name in the model, the hook's id)."""
    names = {id(m): name for name, m in model.named_modules()}
    with_kwargs = hook in (_set_tiling, _enter_block, _leave_block, _check_timestep,
                           _shard_input)
    if kind == "pre":
        handle = module.register_forward_pre_hook(hook, with_kwargs=with_kwargs)
    else:
        handle = module.register_forward_hook(hook, with_kwargs=with_kwargs)
    if state is not None:
        setattr(module, _HOOK_ATTR, state)
    return names[id(module)], handle.id


def _unregister(model, records) -> None:
    for name, hook_id in records:
        module = model.get_submodule(name) if name else model
        for table in ("_forward_pre_hooks", "_forward_pre_hooks_with_kwargs", "_forward_hooks",
                      "_forward_hooks_with_kwargs", "_forward_hooks_always_called"):
            getattr(module, table, {}).pop(hook_id, None)
        if module is not model and _HOOK_ATTR in module.__dict__:
            delattr(module, _HOOK_ATTR)


def _tile_order_hooks(model, context: _TilingContext) -> list:
    """The hooks that run the blocks in tile order when ``context.carry``: the RoPE tables
    tiled once (as per-pair tables, which is also what tells the blocks their layout), the
    hidden states tiled before the first block and untiled after the last, and a per-token
    timestep embedding (Wan 2.2 TI2V) tiled for each block. Everything else in a block is
    token-wise or, for the text cross-attention, independent per query, so tile order (with
    padding slots that nothing reads into a real token) gives every real token the same
    values."""
    records = [_register(model, model.rope, "post", _tile_rope, context)]
    last = len(model.blocks) - 1
    for i, block in enumerate(model.blocks):
        records.append(_register(model, block, "pre", _enter_block, (context, i == 0, i == last)))
        if i == last:
            records.append(_register(model, block, "post", _leave_block))
    return records


def _shard_hooks(model, shards: _ShardContext) -> list:
    """The hooks that shard the sequence over the group: the hidden states split before the
    first block (the RoPE tables stay whole: DistributedAttention applies them to the whole
    sequence it gathers), the output projection's result gathered back. The same places as
    diffusers' own context-parallel plan for Wan."""
    return [_register(model, model, "pre", _check_timestep),
            _register(model, model.blocks[0], "pre", _shard_input, shards),
            _register(model, model.proj_out, "post", _gather_output, shards)]


def enabled_mode(model) -> Optional[str]:
    """``"dense"`` or ``"vsa"`` while vidattn's processors are installed on ``model``, else
    None."""
    state = getattr(model, _STATE_ATTR, None)
    return None if state is None else state.mode


def enable(model, mode: str = "dense", *, sparsity: float = 0.9, tile=(4, 4, 4),
           retile: str = "auto", process_group=None):
    """Switches a diffusers ``WanTransformer3DModel``'s attention to vidattn; returns the model.

    ``mode="dense"``: every block's self- and cross-attention on ``vidattn.attention``, RoPE on
    ``vidattn.apply_rope`` (the same function as diffusers' default processor).
    ``mode="vsa"``: the self-attention as Video Sparse Attention over the latent patch grid in
    ``tile`` tiles (volume 64, 128 or 256) keeping ``1 - sparsity`` of the key tiles, with a
    zero-initialised gate ``attn1.to_gate_compress`` per block (a parameter of the model);
    the cross-attention dense on vidattn. See the module's docstring for the details.

    ``retile`` (VSA mode): where the hidden states are put into tile order and back.
    ``"forward"``: once per forward (before the first block, after the last), the blocks run
    on the tiled layout, padding slots included; ``"layer"``: in every self-attention, around
    VSA; ``"auto"`` (default): once per forward when the grid is whole tiles (tile order is
    then a pure permutation), in every layer otherwise (the padding slots would cost the
    linear layers more than the gathers they save; see the module's note). The outputs are the
    same either way.

    ``process_group``: a ``torch.distributed`` group over which the model's sequence is
    sharded. Every rank calls the model with the same whole inputs; the first block takes the
    rank's contiguous part of the tokens, the blocks run on it (the self-attention through
    ``vidattn.DistributedAttention``, whose heads must divide by the group size), and the
    output projection's result is gathered, so every rank returns the whole output. Under
    autograd each rank's parameter gradients are those of its own tokens: all-reduce (sum)
    them over the group to get the single-process gradient. The tiles of VSA mode are then
    handled inside DistributedAttention (``retile`` must stay ``"auto"``).

    Enabling an enabled model switches it to the new mode (gates are kept). ``disable`` puts
    the original processors back.
    """
    if mode not in MODES:
        raise ValueError(f"mode: expected one of {MODES}, got {mode!r}")
    hunyuan_class, _ = _hunyuan_classes()
    if hunyuan_class is not None and isinstance(model, hunyuan_class):
        return _enable_hunyuan(model, mode, process_group)
    _check_model(model)
    try:
        sparsity = float(sparsity)
    except (TypeError, ValueError):
        raise ValueError(f"sparsity: expected a number in [0, 1), got {sparsity!r}") from None
    if not 0.0 <= sparsity < 1.0:
        # 1.0 would keep no tile; topk_from_sparsity would clamp it to one, which is not what
        # the caller asked for.
        raise ValueError(f"sparsity: expected a number in [0, 1), got {sparsity}")
    tile = _check_tile(tile)
    if retile not in RETILE:
        raise ValueError(f"retile: expected one of {RETILE}, got {retile!r}")
    if process_group is not None and retile != "auto":
        raise ValueError("retile: with process_group= the tiles are DistributedAttention's "
                         f"business; leave retile='auto', got {retile!r}")
    shards = _ShardContext(process_group) if process_group is not None else None
    if shards is not None:
        heads = model.config.num_attention_heads
        if heads % shards.world:
            raise ValueError(f"process_group: its {shards.world} ranks must divide the model's "
                             f"{heads} attention heads (DistributedAttention gives each rank "
                             "heads / world of them)")
    if getattr(model, _STATE_ATTR, None) is not None:
        disable(model, keep_gates=True)

    originals = dict(model.attn_processors)  # name -> processor object, restored as is
    dense = VidattnWanAttnProcessor()
    context = None
    hooks = []
    if mode == "vsa":
        context = _TilingContext(model.config.patch_size, tile,
                                 "layer" if shards is not None else retile)
        hooks.append(_register(model, model, "pre", _set_tiling))
        if shards is None and len(model.blocks):
            hooks += _tile_order_hooks(model, context)
        for block in model.blocks:
            _add_gate(block.attn1)
    if shards is not None:
        hooks += _shard_hooks(model, shards)
        self_attention = VidattnWanShardedSelfAttnProcessor(shards, context, sparsity)
    else:
        self_attention = VidattnWanVSAProcessor(context, sparsity) if mode == "vsa" else dense
    processors = dict(originals)
    for i, block in enumerate(model.blocks):
        processors[f"blocks.{i}.attn1.processor"] = self_attention
        processors[f"blocks.{i}.attn2.processor"] = dense
    if set(processors) != set(originals):
        _unregister(model, hooks)
        raise TypeError("model: its attention modules are not named blocks.<i>.attn1 / attn2 "
                        "as in diffusers' WanTransformer3DModel")
    model.set_attn_processor(processors)
    setattr(model, _STATE_ATTR,
            _State(mode, sparsity, tile, retile, originals, hooks, context, shards))
    return model


def disable(model, *, keep_gates: bool = False):
    """Puts back the processor objects ``enable`` replaced (the very same objects) and removes
    its hooks. The VSA gates are removed too, so that the model and its state dict are
    diffusers' own again, unless ``keep_gates=True`` (save them first to keep trained gates).
    Returns the model."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None:
        raise ValueError("model: vidattn is not enabled on it (nothing to disable)")
    _unregister(model, state.hooks)
    # set_attn_processor pops from the dict it gets: hand it a copy.
    model.set_attn_processor(dict(state.originals))
    if not keep_gates:
        for block in getattr(model, "blocks", ()):
            if getattr(block.attn1, GATE_NAME, None) is not None:
                delattr(block.attn1, GATE_NAME)
    delattr(model, _STATE_ATTR)
    return model


def set_latent_grid(model, latents: torch.Tensor) -> None:
    """Sets the VSA tiling from ``latents`` [B, C, F, H, W] without a forward of the
    transformer, for code that calls its blocks directly (tests, custom loops). Blocks called
    directly take raster-order hidden states and Wan's own RoPE tables."""
    state = getattr(model, _STATE_ATTR, None)
    if state is None or state.mode != "vsa":
        raise ValueError("model: vidattn is not enabled in VSA mode on it")
    state.context.begin(latents)
