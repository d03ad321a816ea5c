"""vidattn.integrations.diffusers with the Wan model's sequence sharded over 2 CPU processes
(gloo): ``enable(model, mode, process_group=...)`` gives every rank the single-process output,
and the ranks' gradients, summed over the group, the single-process gradients, in dense and
VSA mode, on a grid whose 175 tokens do not split evenly (the last rank's part is padded)."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("diffusers")

from spawned_group import assert_task, run_tasks  # noqa: E402

WORLD = 2


def _step(model, seed, gates):
    """Forward and backward of the tiny float64 model (batch 2): output, latents' gradient and
    parameter gradients of sum(out^2)."""
    from test_diffusers_integration import inputs, run

    import vidattn.integrations.diffusers as vd

    if gates:
        with torch.no_grad():
            for i, block in enumerate(model.blocks):
                gate = getattr(block.attn1, vd.GATE_NAME)
                gen = torch.Generator().manual_seed(400 + i)
                gate.weight.copy_(torch.randn(gate.weight.shape, generator=gen,
                                              dtype=torch.float64) * 0.1)
                gate.bias.fill_(0.3)
    x, t, text = inputs(seed, torch.float64, batch=2)
    x.requires_grad_()
    out = run(model, x, t, text)
    out.square().sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in model.named_parameters()}


def _parity(mode, rank, world):
    from test_diffusers_integration import FLOOR, tiny_model

    import vidattn.integrations.diffusers as vd

    kwargs = dict(mode=mode, sparsity=0.5) if mode == "vsa" else dict(mode=mode)
    reference = tiny_model(40, torch.float64).train()
    vd.enable(reference, **kwargs)
    ref_out, ref_dx, ref_dp = _step(reference, 41, mode == "vsa")

    model = tiny_model(40, torch.float64).train()
    vd.enable(model, **kwargs, process_group=dist.group.WORLD)
    out, dx, dp = _step(model, 41, mode == "vsa")
    # Every rank computed the whole output; its gradients are those through its own tokens.
    for g in [dx] + list(dp.values()):
        dist.all_reduce(g)

    def close(name, got, expected, floor):
        bound = floor * max(1.0, expected.abs().max().item())
        err = (got - expected).abs().max().item()
        assert err <= bound, f"{mode} rank {rank}: {name}: {err:.3e} > {bound:.3e}"

    # The output and the latents' gradient to float64's floor. The parameters' gradients to
    # float32's: diffusers' Wan block computes its norms and its timestep modulation in
    # float32 (FP32LayerNorm, temb.float()) whatever the model's dtype, and the ranks sum
    # their tokens' contributions in another order than one process does.
    close("output", out, ref_out, FLOOR[torch.float64])
    close("latents' gradient", dx, ref_dx, FLOOR[torch.float64])
    assert set(dp) == set(ref_dp)
    for name, expected in ref_dp.items():
        assert expected is not None and dp[name] is not None, name
        assert expected.abs().max() > 0, name
        close(name, dp[name], expected, FLOOR[torch.float32])
    print(f"{mode} rank {rank}: max output diff {(out - ref_out).abs().max().item():.3e}")


def _bad_inputs(rank, world):
    from test_diffusers_integration import inputs, run, tiny_model

    import vidattn.integrations.diffusers as vd

    model = tiny_model(42, num_attention_heads=3, attention_head_dim=16)
    try:
        vd.enable(model, process_group=dist.group.WORLD)
    except ValueError as e:
        assert "process_group" in str(e) and "3 attention heads" in str(e), e
    else:
        raise AssertionError("3 heads over 2 ranks was accepted")
    model = tiny_model(42)
    vd.enable(model, process_group=dist.group.WORLD)
    x, _, text = inputs(43)
    try:
        run(model, x, torch.zeros(1, 175, dtype=torch.long), text)
    except NotImplementedError as e:
        assert "per-token timestep" in str(e), e
    else:
        raise AssertionError("a per-token timestep was accepted with a process group")
    vd.disable(model)
    try:
        vd.enable(model, mode="vsa", retile="forward", process_group=dist.group.WORLD)
    except ValueError as e:
        assert "retile" in str(e), e
    else:
        raise AssertionError("retile='forward' with a process group was accepted")


TASKS = {
    "dense": lambda rank, world: _parity("dense", rank, world),
    "vsa": lambda rank, world: _parity("vsa", rank, world),
    "bad_inputs": _bad_inputs,
}


@pytest.fixture(scope="module")
def two_processes():
    """One group of 2 processes runs every task; {task: [traceback or None per rank]}."""
    return run_tasks(__name__, WORLD, list(TASKS))


def test_sharded_dense_model_matches_one_process(two_processes):
    assert_task(two_processes, "dense")


def test_sharded_vsa_model_matches_one_process(two_processes):
    assert_task(two_processes, "vsa")


def test_sharded_model_bad_inputs(two_processes):
    assert_task(two_processes, "bad_inputs")
