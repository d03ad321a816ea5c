"""vidattn.integrations.diffusers on CUDA (skipped without a GPU): a small Wan model (head dim
64, which the CUDA kernels take) in bfloat16, against a float64 CPU reference of the same
weights under the rule of docs/conventions.md (at most 2x the baseline's error plus the
floor): dense mode against diffusers' default processors (baseline: the default model in
bf16 on the GPU), and VSA with the blocks in tile order against VSA tiled per layer
(baseline: the per-layer version in bf16 on the GPU), forward and backward. VSA runs at
sparsity 0 with nonzero gates, so both branches count and no selection can flip between the
float64 reference and bfloat16 (at sparsity 0 every key tile is kept)."""
from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("diffusers")

import vidattn.integrations.diffusers as vd  # noqa: E402
from diffusers.models.transformers.transformer_wan import WanTransformer3DModel  # noqa: E402
from test_diffusers_integration import assert_rule  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEVICE = "cuda"
# 2 heads of 64 (Wan's RoPE: t 24, h 20, w 20), otherwise the CPU tests' tiny config.
CONFIG = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=64,
              in_channels=4, out_channels=4, text_dim=16, freq_dim=32, ffn_dim=192,
              num_layers=2, cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
              rope_max_seq_len=64)
LATENT = (1, 4, 5, 10, 14)  # a 5 x 5 x 7 grid: partial 4 x 4 x 4 tiles only
TEXT_TOKENS = 9


def model_and_inputs(seed):
    torch.manual_seed(seed)
    model = WanTransformer3DModel(**CONFIG).double().eval()
    g = torch.Generator().manual_seed(seed + 1)
    x = torch.randn(LATENT, generator=g, dtype=torch.float64)
    text = torch.randn(1, TEXT_TOKENS, CONFIG["text_dim"], generator=g, dtype=torch.float64)
    return model, (x, torch.tensor([500]), text)


def on(model, args, device, dtype):
    """A copy of the model and the inputs on the device in the dtype."""
    model = copy.deepcopy(model).to(device, dtype)
    x, t, text = args
    return model, (x.to(device, dtype), t.to(device), text.to(device, dtype))


def forward_backward(model, args, grad_seed):
    """The output and the latents' gradient of sum(out * g), g fixed."""
    x, t, text = args
    x = x.detach().clone().requires_grad_(True)
    out = model(x, t, text, return_dict=False)[0]
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(grad_seed),
                    dtype=torch.float64).to(out.device, out.dtype)
    (out * g).sum().backward()
    return out.detach().cpu(), x.grad.cpu()


def test_dense_bf16_on_cuda_matches_default():
    base, args = model_and_inputs(50)
    ref = forward_backward(base, args, 51)
    default = forward_backward(*on(base, args, DEVICE, torch.bfloat16), 51)
    model, dev_args = on(base, args, DEVICE, torch.bfloat16)
    vd.enable(model, mode="dense")
    got = forward_backward(model, dev_args, 51)
    for name, g, r, b in zip(("output", "latents' gradient"), got, ref, default):
        assert_rule(f"dense bf16 cuda {name}", g, r, b, torch.bfloat16)


def test_vsa_tile_order_bf16_on_cuda_matches_per_layer():
    base, args = model_and_inputs(52)
    vd.enable(base, mode="vsa", sparsity=0.0, retile="layer")
    with torch.no_grad():
        for i, block in enumerate(base.blocks):
            gate = getattr(block.attn1, vd.GATE_NAME)
            gate.weight.copy_(torch.randn(gate.weight.shape, dtype=torch.float64,
                                          generator=torch.Generator().manual_seed(60 + i)) * 0.1)
            gate.bias.fill_(0.3)
    ref = forward_backward(base, args, 53)  # float64, CPU, per layer
    per_layer, dev_args = on(base, args, DEVICE, torch.bfloat16)
    baseline = forward_backward(per_layer, dev_args, 53)
    tiled, dev_args = on(base, args, DEVICE, torch.bfloat16)
    vd.enable(tiled, mode="vsa", sparsity=0.0, retile="forward")  # keeps the copied gates
    got = forward_backward(tiled, dev_args, 53)
    for name, g, r, b in zip(("output", "latents' gradient"), got, ref, baseline):
        assert_rule(f"vsa tile order bf16 cuda {name}", g, r, b, torch.bfloat16)
