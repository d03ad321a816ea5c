"""vidattn.integrations.diffusers on a tiny diffusers WanTransformer3DModel (2 layers, small
dims, seeded random weights), on the CPU.

Accuracy follows the rule of docs/conventions.md, applied to the whole model: the reference is
diffusers' own model with its default processors in float64; the baseline is the same default
model in the tested dtype; vidattn's error against the reference must be at most 2x the
baseline's plus the rounding floor (float64: 1e-10)."""
from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("diffusers")

import vidattn  # noqa: E402
import vidattn.integrations.diffusers as vd  # noqa: E402
from diffusers.models.transformers.transformer_wan import (  # noqa: E402
    WanAttention, WanAttnProcessor, WanTransformer3DModel)

# Small but complete: 2 heads of 16 (Wan's RoPE splits a head as t 8, h 4, w 4), (1, 2, 2)
# patches, qk RMS norm across heads, cross-attention norm, as the published configs have.
TINY = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=16, in_channels=4,
            out_channels=4, text_dim=16, freq_dim=32, ffn_dim=48, num_layers=2,
            cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
            rope_max_seq_len=64)
# Latent frames 5, 10 x 14 -> a 5 x 5 x 7 patch grid (175 tokens): with 4 x 4 x 4 tiles, 8
# tiles, every one of them truncated on some axis.
LATENT = (1, 4, 5, 10, 14)
GRID = (5, 5, 7)
TEXT_TOKENS = 9
# Floor of the rule (relative to the output's magnitude), as in test_vsa.py.
FLOOR = {torch.float64: 1e-10, torch.float32: 2e-6, torch.bfloat16: 2e-3}


def gen(seed):
    return torch.Generator().manual_seed(seed)


def tiny_model(seed=0, dtype=torch.float32, **overrides):
    torch.manual_seed(seed)  # diffusers initialises its weights from the global generator
    return WanTransformer3DModel(**{**TINY, **overrides}).to(dtype).eval()


def inputs(seed, dtype=torch.float32, latent=LATENT, batch=None):
    shape = latent if batch is None else (batch, *latent[1:])
    g = gen(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    text = torch.randn(shape[0], TEXT_TOKENS, TINY["text_dim"], generator=g).to(dtype)
    timestep = torch.tensor([500] * shape[0])
    return x, timestep, text


def run(model, x, timestep, text):
    return model(x, timestep, text, return_dict=False)[0]


def assert_rule(name, got, ref64, baseline, dtype):
    assert torch.isfinite(got).all(), f"{name}: non-finite values"
    got, ref64 = got.double(), ref64.double()
    err = (got - ref64).abs().max().item()
    magnitude = ref64.abs().max().item()
    if dtype == torch.float64:
        assert err <= 1e-10 * max(1.0, magnitude), f"{name}: fp64 error {err:.3e}"
        return
    base_err = (baseline.double() - ref64).abs().max().item()
    bound = 2.0 * base_err + FLOOR[dtype] * max(1.0, magnitude)
    assert err <= bound, f"{name}: error {err:.3e} > bound {bound:.3e} (default {base_err:.3e})"


# ---------------------------------------------------------------------------------------
# Dense mode against diffusers' default processor


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_dense_matches_default_processor(dtype):
    model = tiny_model(1, dtype)
    reference = copy.deepcopy(model).double()
    x, t, text = inputs(11, dtype)
    with torch.no_grad():
        ref64 = run(reference, x.double(), t, text.double())
        baseline = run(model, x, t, text)
        vd.enable(model, mode="dense")
        got = run(model, x, t, text)
    assert got.dtype == dtype and got.shape == x.shape
    assert all(isinstance(p, vd.VidattnWanAttnProcessor) for p in model.attn_processors.values())
    assert_rule(f"dense {dtype}", got, ref64, baseline, dtype)


def test_dense_gradients_match_default_processor():
    """Training through the dense processors: the input and weight gradients equal the
    default model's (float64)."""
    model = tiny_model(2, torch.float64)
    x, t, text = inputs(12, torch.float64)
    x.requires_grad_()

    def grads(m):
        m.zero_grad()
        x.grad = None
        run(m, x, t, text).square().sum().backward()
        return x.grad.clone(), m.blocks[0].attn1.to_q.weight.grad.clone(), \
            m.blocks[1].attn2.to_k.weight.grad.clone()

    expected = grads(model)
    vd.enable(model)
    got = grads(model)
    for name, g, e in zip(("x", "attn1.to_q", "attn2.to_k"), got, expected):
        assert e.abs().max() > 0, name
        torch.testing.assert_close(g, e, atol=1e-10, rtol=1e-10, msg=name)


def _attention_module(seed, **kw):
    torch.manual_seed(seed)
    return WanAttention(dim=32, heads=2, dim_head=16, eps=1e-6, processor=WanAttnProcessor(),
                        **kw).double()


@pytest.mark.parametrize("fused", [False, True])
def test_cross_attention_with_padding_mask(fused):
    """A bool key padding mask on the cross-attention (True = attend), in diffusers' broadcast
    shape [B, 1, 1, Sk] and as [B, Sk], gives what the default processor gives (float64)."""
    attn = _attention_module(3, cross_attention_dim_head=16)
    if fused:
        attn.fuse_projections()
    g = gen(13)
    hidden = torch.randn(2, 20, 32, generator=g, dtype=torch.float64)
    context = torch.randn(2, 11, 32, generator=g, dtype=torch.float64)
    keep = torch.ones(2, 11, dtype=torch.bool)
    keep[0, 7:] = False  # 4 padded text tokens in the first prompt, none in the second
    with torch.no_grad():
        expected = attn(hidden, context, keep[:, None, None, :])
        unmasked = attn(hidden, context)
        attn.set_processor(vd.VidattnWanAttnProcessor())
        got4 = attn(hidden, context, keep[:, None, None, :])
        got2 = attn(hidden, context, keep)
    assert (expected - unmasked).abs().max() > 1e-3  # the mask matters
    torch.testing.assert_close(got4, expected, atol=1e-10, rtol=0)
    torch.testing.assert_close(got2, expected, atol=1e-10, rtol=0)


def test_attention_mask_bad_inputs():
    attn = _attention_module(4, cross_attention_dim_head=16)
    attn.set_processor(vd.VidattnWanAttnProcessor())
    hidden = torch.zeros(2, 5, 32, dtype=torch.float64)
    context = torch.zeros(2, 6, 32, dtype=torch.float64)
    with pytest.raises(ValueError, match="attention_mask"):
        attn(hidden, context, torch.zeros(2, 1, 1, 6, dtype=torch.float64))  # additive float
    with pytest.raises(ValueError, match="attention_mask"):
        attn(hidden, context, torch.ones(2, 1, 5, 6, dtype=torch.bool))  # per query
    with pytest.raises(ValueError, match="attention_mask"):
        attn(hidden, context, torch.ones(2, 7, dtype=torch.bool))  # wrong key count


@pytest.mark.parametrize("fused", [False, True])
def test_i2v_image_branch_matches_default(fused):
    """The I2V cross-attention (added image keys and values: the first len - 512 context
    tokens) on vidattn equals the default processor (float64)."""
    attn = _attention_module(5, cross_attention_dim_head=16, added_kv_proj_dim=32)
    if fused:
        attn.fuse_projections()
    g = gen(15)
    hidden = torch.randn(1, 12, 32, generator=g, dtype=torch.float64)
    # 5 image tokens (already projected to the model's width by the image embedder), 512 text.
    context = torch.randn(1, 5 + vd.WAN_TEXT_TOKENS, 32, generator=g, dtype=torch.float64)
    image_part = context.clone()
    image_part[:, 5:] = 0
    with torch.no_grad():
        expected = attn(hidden, context)
        attn.set_processor(vd.VidattnWanAttnProcessor())
        got = attn(hidden, context)
        # The image tokens take part: changing them changes the output.
        other = attn(hidden, torch.cat([context[:, :5] + 1, context[:, 5:]], dim=1))
    torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    assert (other - got).abs().max() > 1e-3
    with pytest.raises(ValueError, match="encoder_hidden_states"):
        attn(hidden, context[:, :100])


# ---------------------------------------------------------------------------------------
# VSA mode


def test_vsa_gates_are_zero_parameters_in_the_state_dict():
    model = tiny_model(6)
    keys_before = set(model.state_dict())
    vd.enable(model, mode="vsa", sparsity=0.5)
    new_keys = set(model.state_dict()) - keys_before
    assert new_keys == {f"blocks.{i}.attn1.{vd.GATE_NAME}.{p}"
                        for i in range(TINY["num_layers"]) for p in ("weight", "bias")}
    for block in model.blocks:
        gate = getattr(block.attn1, vd.GATE_NAME)
        assert gate.weight.shape == (32, 32) and gate.weight.requires_grad
        assert gate.weight.abs().max() == 0 and gate.bias.abs().max() == 0
        assert not hasattr(block.attn2, vd.GATE_NAME)  # the text cross-attention stays dense
    assert vd.enabled_mode(model) == "vsa"
    assert any(p is getattr(model.blocks[0].attn1, vd.GATE_NAME).weight
               for p in model.parameters())


def test_vsa_with_zero_gates_at_zero_sparsity_is_the_dense_model():
    """The documented start: zero gates leave the fine branch alone, and keeping every tile
    makes it dense attention (float64); at 90% sparsity the result differs."""
    model = tiny_model(7, torch.float64)
    x, t, text = inputs(17, torch.float64)
    with torch.no_grad():
        dense = run(model, x, t, text)
        vd.enable(model, mode="vsa", sparsity=0.0)
        full = run(model, x, t, text)
        vd.enable(model, mode="vsa", sparsity=0.9)  # 1 of 8 key tiles
        sparse = run(model, x, t, text)
    assert_rule("vsa sparsity 0", full, dense, None, torch.float64)
    assert (sparse - dense).abs().max() > 1e-4


def test_vsa_forward_backward_reaches_the_gates():
    model = tiny_model(8)
    vd.enable(model, mode="vsa", sparsity=0.75)
    model.train()
    x, t, text = inputs(18, batch=2)
    out = run(model, x, t, text)
    assert out.shape == x.shape and torch.isfinite(out).all()
    out.square().mean().backward()
    for i, block in enumerate(model.blocks):
        gate = getattr(block.attn1, vd.GATE_NAME)
        assert gate.weight.grad is not None and torch.isfinite(gate.weight.grad).all()
        assert gate.weight.grad.abs().max() > 0, f"block {i}: zero gate gradient"
        assert block.attn1.to_q.weight.grad.abs().max() > 0
        assert block.attn2.to_q.weight.grad.abs().max() > 0


def test_vsa_gate_changes_the_output():
    """A nonzero gate mixes the coarse branch in: the output moves."""
    model = tiny_model(9, torch.float64)
    x, t, text = inputs(19, torch.float64)
    vd.enable(model, mode="vsa", sparsity=0.5)
    with torch.no_grad():
        before = run(model, x, t, text)
        getattr(model.blocks[1].attn1, vd.GATE_NAME).bias.fill_(1.0)
        after = run(model, x, t, text)
    assert (after - before).abs().max() > 1e-4


def test_vsa_state_dict_round_trip():
    trained = tiny_model(10)
    vd.enable(trained, mode="vsa", sparsity=0.5)
    with torch.no_grad():  # "trained" gates: any nonzero values
        for i, block in enumerate(trained.blocks):
            gate = getattr(block.attn1, vd.GATE_NAME)
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen(100 + i)) * 0.1)
            gate.bias.copy_(torch.randn(gate.bias.shape, generator=gen(200 + i)) * 0.1)
    buffer = io.BytesIO()
    torch.save(trained.state_dict(), buffer)
    x, t, text = inputs(20)
    with torch.no_grad():
        expected = run(trained, x, t, text)

    fresh = tiny_model(99)  # other weights
    vd.enable(fresh, mode="vsa", sparsity=0.5)
    with torch.no_grad():
        before = run(fresh, x, t, text)
    buffer.seek(0)
    result = fresh.load_state_dict(torch.load(buffer), strict=True)
    assert not result.missing_keys and not result.unexpected_keys
    with torch.no_grad():
        got = run(fresh, x, t, text)
    assert (before - expected).abs().max() > 1e-3
    assert torch.equal(got, expected)


def test_vsa_tiling_is_built_once_per_latent_shape(monkeypatch):
    built = []
    real = vidattn.VideoTiling

    def counting(*args, **kwargs):
        tiling = real(*args, **kwargs)
        built.append(tiling)
        return tiling

    monkeypatch.setattr(vidattn, "VideoTiling", counting)
    model = tiny_model(11)
    vd.enable(model, mode="vsa", sparsity=0.5)
    with torch.no_grad():
        for seed in (21, 22):  # two steps at one shape: one tiling, for both layers
            run(model, *inputs(seed))
        assert len(built) == 1 and built[0].grid == GRID and built[0].tile_shape == (4, 4, 4)
        run(model, *inputs(23, latent=(1, 4, 3, 8, 8)))  # another shape: one more
    assert len(built) == 2 and built[1].grid == (3, 4, 4)


def test_vsa_block_without_a_tiling_raises():
    model = tiny_model(12)
    vd.enable(model, mode="vsa", tile=(2, 8, 8))
    block = model.blocks[0]
    hidden = torch.zeros(1, 175, 32)
    temb = torch.zeros(1, 6, 32)
    rotary = model.rope(torch.zeros(LATENT))
    text = torch.zeros(1, TEXT_TOKENS, 32)
    with pytest.raises(RuntimeError, match="no tiling"):
        block(hidden, text, temb, rotary)
    vd.set_latent_grid(model, torch.zeros(LATENT))
    assert block(hidden, text, temb, rotary).shape == hidden.shape
    vd.set_latent_grid(model, torch.zeros(1, 4, 5, 10, 12))  # 150 tokens, not 175
    with pytest.raises(RuntimeError, match="175 tokens"):
        block(hidden, text, temb, rotary)


# ---------------------------------------------------------------------------------------
# VSA: tile order once per forward


def _fp32_norm_parameters(model):
    """Names of the parameters of diffusers' FP32LayerNorms: they compute in float32 whatever
    the model's dtype, so their gradients carry float32 rounding."""
    from diffusers.models.normalization import FP32LayerNorm

    return {f"{name}.{p}" for name, module in model.named_modules()
            if isinstance(module, FP32LayerNorm) for p, _ in module.named_parameters()}


def _vsa_step(retile, checkpointing=False, latent=LATENT, seed=30):
    """Forward and backward of a float64 VSA model with nonzero gates (both branches count):
    output, latents' gradient, parameter gradients."""
    model = tiny_model(seed, torch.float64)
    if checkpointing:
        model.enable_gradient_checkpointing()
    model.train()
    vd.enable(model, mode="vsa", sparsity=0.5, retile=retile)
    with torch.no_grad():
        for i, block in enumerate(model.blocks):
            gate = getattr(block.attn1, vd.GATE_NAME)
            gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen(300 + i),
                                          dtype=torch.float64) * 0.1)
            gate.bias.fill_(0.3)
    x, t, text = inputs(seed + 1, torch.float64, latent=latent, batch=2)
    x.requires_grad_()
    out = run(model, x, t, text)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}, model


@pytest.mark.parametrize("checkpointing", [False, True])
def test_vsa_tile_order_once_per_forward_equals_per_layer(checkpointing):
    """Blocks run in tile order (padding slots included: the 5 x 5 x 7 grid has only partial
    4 x 4 x 4 tiles) give the per-layer version's output bit for bit, and its gradients: the
    latents' bit for bit, the parameters' up to the order in which a weight gradient sums
    its tokens (1e-10 relative in float64; float32's floor for the FP32LayerNorms)."""
    out_l, gx_l, gp_l, model = _vsa_step("layer")
    out_f, gx_f, gp_f, _ = _vsa_step("forward", checkpointing)
    assert torch.equal(out_f, out_l)
    assert torch.equal(gx_f, gx_l)
    fp32 = _fp32_norm_parameters(model)
    assert fp32  # norm2 (cross_attn_norm) is one
    assert set(gp_f) == set(gp_l)
    for name, expected in gp_l.items():
        got = gp_f[name]
        assert expected is not None and got is not None, name
        floor = FLOOR[torch.float32 if name in fp32 else torch.float64]
        bound = floor * max(1.0, expected.abs().max().item())
        err = (got - expected).abs().max().item()
        assert err <= bound, f"{name}: {err:.3e} > {bound:.3e}"
    assert gp_f[f"blocks.0.attn1.{vd.GATE_NAME}.weight"].abs().max() > 0


def test_vsa_tile_order_with_per_token_timesteps():
    """Wan 2.2 TI2V's per-token timestep [B, S] makes a per-token modulation [B, S, 6, C] in
    every block: in tile order it is tiled with the hidden states, and the output is the
    per-layer version's."""
    x, _, text = inputs(37, torch.float64)
    timestep = torch.linspace(0, 900, 175).round().long()[None]
    outs = []
    for retile in ("layer", "forward"):
        model = _vsa_model_with_gates(38, retile, layers=2)
        with torch.no_grad():
            outs.append(run(model, x, timestep, text))
    assert torch.equal(outs[0], outs[1])
    uniform = _vsa_model_with_gates(38, "forward", layers=2)
    with torch.no_grad():
        assert (run(uniform, x, torch.tensor([450]), text) - outs[1]).abs().max() > 1e-4


def test_vsa_deep_copy_runs_on_its_own_state():
    """A deep copy of an enabled model (an EMA copy, say) has hooks that act on the copy's own
    tiling (a grid the copy had not seen when it was made), computes what the original does,
    and disabling it removes its hooks, not the original's."""
    model = _vsa_model_with_gates(39, "forward", layers=2)
    x, t, text = inputs(40, torch.float64)
    other = inputs(41, torch.float64, latent=(1, 4, 4, 8, 8))
    hooks = [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]
    with torch.no_grad():
        expected = run(model, x, t, text)
        twin = copy.deepcopy(model)
        expected_other = run(model, *other)
        assert torch.equal(run(twin, *other), expected_other)
        assert torch.equal(run(twin, x, t, text), expected)
        vd.disable(twin)
        assert all(len(m._forward_pre_hooks) + len(m._forward_hooks) == 0
                   for m in twin.modules())
        assert [len(m._forward_pre_hooks) + len(m._forward_hooks)
                for m in model.modules()] == hooks
        assert torch.equal(run(model, *other), expected_other)
        assert not torch.equal(run(twin, x, t, text), expected)  # diffusers' own again


def _count_gathers(monkeypatch):
    calls = []
    real = torch.ops.vidattn.gather_tokens

    class Ops:  # vsa.py reaches the op through its module's _ops
        def __getattr__(self, name):
            return getattr(torch.ops.vidattn, name)

        def gather_tokens(self, x, *args):
            calls.append(tuple(x.shape))
            return real(x, *args)

    import vidattn.vsa

    monkeypatch.setattr(vidattn.vsa, "_ops", Ops())
    return calls


@pytest.mark.parametrize("latent,retile,per_forward", [
    (LATENT, "auto", False),            # partial tiles: the padding would cost more
    (LATENT, "forward", True),
    ((1, 4, 4, 8, 8), "auto", True),    # a 4 x 4 x 4 grid: one whole tile, a permutation
    ((1, 4, 4, 8, 8), "layer", False),
])
def test_vsa_retile_gathers(monkeypatch, latent, retile, per_forward):
    """Per forward: the two RoPE tables and the hidden states tiled, the output untiled,
    whatever the depth; per layer: q, k, v and the gate tiled and the output untiled in every
    self-attention."""
    model = tiny_model(31, num_layers=3)
    vd.enable(model, mode="vsa", sparsity=0.5, retile=retile)
    x, t, text = inputs(32, latent=latent)
    calls = _count_gathers(monkeypatch)
    with torch.no_grad():
        out = run(model, x, t, text)
    assert out.shape == x.shape and torch.isfinite(out).all()
    assert len(calls) == (4 if per_forward else 5 * 3), calls


# ---------------------------------------------------------------------------------------
# enable / disable


def test_disable_restores_the_original_processors():
    model = tiny_model(13)
    originals = dict(model.attn_processors)
    keys = list(model.state_dict())
    hooks = len(model._forward_pre_hooks)
    x, t, text = inputs(24)
    with torch.no_grad():
        expected = run(model, x, t, text)
        vd.enable(model, mode="dense")
        vd.enable(model, mode="vsa", sparsity=0.9)  # a switch keeps the first originals
        changed = run(model, x, t, text)
        vd.disable(model)
        restored = run(model, x, t, text)
    assert (changed - expected).abs().max() > 1e-4
    now = model.attn_processors
    assert list(now) == list(originals)
    assert all(now[name] is originals[name] for name in originals)
    assert all(isinstance(p, WanAttnProcessor) for p in now.values())
    assert list(model.state_dict()) == keys  # gates gone
    assert len(model._forward_pre_hooks) == hooks
    assert vd.enabled_mode(model) is None
    assert torch.equal(restored, expected)
    with pytest.raises(ValueError, match="model"):
        vd.disable(model)


def test_disable_can_keep_the_gates():
    model = tiny_model(14)
    vd.enable(model, mode="vsa")
    vd.disable(model, keep_gates=True)
    assert all(isinstance(getattr(b.attn1, vd.GATE_NAME), torch.nn.Linear) for b in model.blocks)
    assert all(isinstance(p, WanAttnProcessor) for p in model.attn_processors.values())


def test_enable_bad_inputs():
    model = tiny_model(15)
    with pytest.raises(ValueError, match="mode"):
        vd.enable(model, mode="sparse")
    for sparsity in (1.0, -0.1, "a lot"):
        with pytest.raises(ValueError, match="sparsity"):
            vd.enable(model, mode="vsa", sparsity=sparsity)
    for tile in ((3, 3, 3), (4, 4), (4, 4, "x"), 4):
        with pytest.raises(ValueError, match="tile"):
            vd.enable(model, mode="vsa", tile=tile)
    with pytest.raises(TypeError, match="model"):
        vd.enable(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="retile"):
        vd.enable(model, mode="vsa", retile="once")
    with pytest.raises(ValueError, match="process_group"):  # torch.distributed not initialized
        vd.enable(model, mode="vsa", process_group=object())
    # Nothing was changed by the refused calls.
    assert vd.enabled_mode(model) is None
    assert all(isinstance(p, WanAttnProcessor) for p in model.attn_processors.values())


# ---------------------------------------------------------------------------------------
# torch.compile


def test_compiled_block_with_dense_processors_matches_eager():
    """One transformer block with vidattn's dense processors under torch.compile(fullgraph=
    True) (no graph break: it raises on one). The block's FP32LayerNorms compute in float32
    even for a float64 model, and inductor fuses their rounding differently from eager
    (~3e-7 here), so: compiled vidattn equals diffusers' compiled default block, and moves
    away from eager no further than the default block does under compile."""
    model = tiny_model(16, torch.float64)
    block = model.blocks[0]
    g = gen(26)
    x = torch.randn(LATENT, generator=g, dtype=torch.float64)
    hidden = torch.randn(1, 175, 32, generator=g, dtype=torch.float64)
    text = torch.randn(1, TEXT_TOKENS, 32, generator=g, dtype=torch.float64)
    temb = torch.randn(1, 6, 32, generator=g, dtype=torch.float64)
    rotary = model.rope(x)
    torch._dynamo.reset()
    with torch.no_grad():
        default_eager = block(hidden, text, temb, rotary)
        default_compiled = torch.compile(block, fullgraph=True)(hidden, text, temb, rotary)
        vd.enable(model, mode="dense")
        torch._dynamo.reset()
        eager = block(hidden, text, temb, rotary)
        got = torch.compile(block, fullgraph=True)(hidden, text, temb, rotary)
    torch.testing.assert_close(eager, default_eager, atol=1e-10, rtol=0)
    torch.testing.assert_close(got, default_compiled, atol=1e-10, rtol=0)
    compile_noise = (default_compiled - default_eager).abs().max().item()
    assert (got - eager).abs().max().item() <= 2 * compile_noise + 1e-12


# VSA under compile uses the aot_eager backend: dynamo traces the block whole (fullgraph
# raises on a graph break) and AOT autograd traces vidattn's ops through their Meta kernels
# and autograd formulas, which is what the integration can break; inductor would add only its
# code generation for the surrounding torch ops (vidattn's ops stay opaque calls to it), at
# ~90 s per block on CI's two cores and with the float32 LayerNorm rounding moved (see above).
COMPILE_BACKEND = "aot_eager"


def _vsa_model_with_gates(seed, retile, layers=3):
    model = tiny_model(seed, torch.float64, num_layers=layers)
    vd.enable(model, mode="vsa", sparsity=0.5, retile=retile)
    with torch.no_grad():
        for block in model.blocks:
            getattr(block.attn1, vd.GATE_NAME).bias.fill_(0.3)
    return model


@pytest.mark.parametrize("retile", ["layer", "forward"])
def test_compiled_vsa_block_matches_eager(retile):
    """A middle block in VSA mode under torch.compile(fullgraph=True): the same output and
    input gradient as eager, bit for bit, in raster order (per-layer tiling) and in tile order
    (the tables the rope hook tiled, hidden states with the padding slots)."""
    model = _vsa_model_with_gates(33, retile)
    g = gen(34)
    x = torch.randn(LATENT, generator=g, dtype=torch.float64)
    vd.set_latent_grid(model, x)
    rotary = model.rope(x)  # through the hook: tile-order tables when retile="forward"
    tiling = getattr(model, vd._STATE_ATTR).context.current
    tokens = tiling.padded_len if retile == "forward" else tiling.num_tokens
    assert vd._is_tiled_rope(rotary) == (retile == "forward")
    hidden = torch.randn(1, tokens, 32, generator=g, dtype=torch.float64, requires_grad=True)
    text = torch.randn(1, TEXT_TOKENS, 32, generator=g, dtype=torch.float64)
    temb = torch.randn(1, 6, 32, generator=g, dtype=torch.float64)
    block = model.blocks[1]
    torch._dynamo.reset()
    eager = block(hidden, text, temb, rotary)
    (eager_grad,) = torch.autograd.grad(eager.square().sum(), hidden)
    compiled = torch.compile(block, fullgraph=True, backend=COMPILE_BACKEND)
    got = compiled(hidden, text, temb, rotary)
    (got_grad,) = torch.autograd.grad(got.square().sum(), hidden)
    assert torch.equal(got, eager) and torch.equal(got_grad, eager_grad)
    assert eager_grad.abs().max() > 0


def test_compiled_repeated_blocks_in_tile_order_match_eager():
    """The whole model with diffusers' compile_repeated_blocks(fullgraph=True) (each block
    compiled, with the hooks that tile before the first and untile after the last): the same
    output and latents' gradient as eager."""
    model = _vsa_model_with_gates(35, "forward")
    x, t, text = inputs(36, torch.float64)
    x.requires_grad_()
    torch._dynamo.reset()
    eager = run(model, x, t, text)
    (eager_grad,) = torch.autograd.grad(eager.square().sum(), x)
    model.compile_repeated_blocks(fullgraph=True, backend=COMPILE_BACKEND)
    got = run(model, x, t, text)
    (got_grad,) = torch.autograd.grad(got.square().sum(), x)
    torch._dynamo.reset()
    assert torch.equal(got, eager) and torch.equal(got_grad, eager_grad)
