"""vidattn.integrations.diffusers on a tiny diffusers HunyuanVideoTransformer3DModel (one
dual-stream and one single-stream block, small dims, seeded random weights), on the CPU:
dense mode equals diffusers' default joint attention under the rule of docs/conventions.md,
with a text padding mask that differs per batch item; disable restores the processors; VSA
and sequence parallelism are refused clearly."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

import vidattn.integrations.diffusers as vd  # noqa: E402
from diffusers.models import embeddings  # noqa: E402
from diffusers.models.transformers.transformer_hunyuan_video import (  # noqa: E402
    HunyuanVideoAttnProcessor2_0, HunyuanVideoTransformer3DModel)
from test_diffusers_integration import assert_rule  # noqa: E402

# Every joint-attention path of the published config at a toy size: 2 heads of 16 (RoPE axes
# t 4, h 6, w 6), (1, 2, 2) patches, per-head RMS q / k norms, guidance embedding, a text
# token refiner.
TINY = dict(in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16,
            num_layers=1, num_single_layers=1, num_refiner_layers=1, mlp_ratio=2.0,
            patch_size=2, patch_size_t=1, qk_norm="rms_norm", guidance_embeds=True,
            text_embed_dim=16, pooled_projection_dim=8, rope_axes_dim=(4, 6, 6))
LATENT = (2, 4, 3, 6, 10)  # a 3 x 3 x 5 patch grid
TEXT_TOKENS = 7


def tiny_model(seed, dtype):
    torch.manual_seed(seed)
    return HunyuanVideoTransformer3DModel(**TINY).to(dtype).eval()


def inputs(seed, dtype):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(LATENT, generator=g).to(dtype)
    text = torch.randn(LATENT[0], TEXT_TOKENS, TINY["text_embed_dim"], generator=g).to(dtype)
    mask = torch.ones(LATENT[0], TEXT_TOKENS, dtype=torch.long)
    mask[1, 4:] = 0  # the second prompt is 4 tokens long
    pooled = torch.randn(LATENT[0], TINY["pooled_projection_dim"], generator=g).to(dtype)
    timestep = torch.tensor([500, 300])
    guidance = torch.full((LATENT[0],), 6000.0).to(dtype)
    return x, timestep, text, mask, pooled, guidance


def run(model, args):
    return model(*args, return_dict=False)[0]


def _rope_float64(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' apply_rotary_emb for HunyuanVideo (interleaved pairs, full-width tables),
    in float64: its own rounds through float32 whatever x's dtype, which a float64
    reference must not."""
    assert use_real and use_real_unbind_dim == -1 and sequence_dim == 1
    cos, sin = (t.to(torch.float64)[None, :, None, :] for t in freqs_cis)
    real, imag = x.to(torch.float64).reshape(*x.shape[:-1], -1, 2).unbind(-1)
    rotated = torch.stack([-imag, real], dim=-1).flatten(3)
    return (x.to(torch.float64) * cos + rotated * sin).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_hunyuan_dense_matches_default_processor(dtype, monkeypatch):
    model = tiny_model(1, dtype)
    reference = copy.deepcopy(model).double()
    args = inputs(2, dtype)
    args64 = tuple(a.double() if a.is_floating_point() else a for a in args)
    with torch.no_grad():
        baseline = run(model, args)
        with monkeypatch.context() as patch:
            patch.setattr(embeddings, "apply_rotary_emb", _rope_float64)
            ref64 = run(reference, args64)
        vd.enable(model, mode="dense")
        got = run(model, args)
    assert got.dtype == dtype and got.shape == LATENT
    joint = {name: p for name, p in model.attn_processors.items()
             if isinstance(p, vd.VidattnHunyuanVideoAttnProcessor)}
    assert set(joint) == {"transformer_blocks.0.attn.processor",
                          "single_transformer_blocks.0.attn.processor"}
    assert_rule(f"hunyuan dense {dtype}", got, ref64, baseline, dtype)


def test_hunyuan_text_mask_is_applied():
    """The padded text tokens of the second prompt change its output when unmasked: the
    mask reaches vidattn's attention."""
    model = tiny_model(3, torch.float64)
    vd.enable(model)
    args = inputs(4, torch.float64)
    unmasked = args[:3] + (torch.ones_like(args[3]),) + args[4:]
    with torch.no_grad():
        masked_out, unmasked_out = run(model, args), run(model, unmasked)
    assert torch.equal(masked_out[0], unmasked_out[0])
    assert (masked_out[1] - unmasked_out[1]).abs().max() > 1e-6


def test_hunyuan_disable_restores_and_refusals():
    model = tiny_model(5, torch.float32)
    originals = dict(model.attn_processors)
    args = inputs(6, torch.float32)
    with torch.no_grad():
        expected = run(model, args)
        vd.enable(model, mode="dense")
        assert vd.enabled_mode(model) == "dense"
        vd.disable(model)
        restored = run(model, args)
    assert torch.equal(restored, expected)
    now = model.attn_processors
    assert all(now[name] is originals[name] for name in originals)
    assert any(isinstance(p, HunyuanVideoAttnProcessor2_0) for p in now.values())
    with pytest.raises(NotImplementedError, match="mode"):
        vd.enable(model, mode="vsa")
    with pytest.raises(NotImplementedError, match="process_group"):
        vd.enable(model, mode="dense", process_group=object())
    assert vd.enabled_mode(model) is None
