"""vidattn.integrations.diffusers with the Wan model's sequence sharded over 2 CPU processes
(gloo): ``enable(model, mode, process_group=...)`` gives every rank the single-process output,
and the ranks' gradients, summed over the group, the single-process gradients, in dense and
VSA mode, on a grid whose 175 tokens do not split evenly (the last rank's part is padded)."""
from __future__ import annotations

import datetime
import os
import tempfile
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytest.importorskip("diffusers")

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a hung collective fails the workers
JOIN_TIMEOUT_S = 240  # and a hung process fails the test
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


def _worker(rank, world, tmp, tasks):
    """Runs the tasks in order and records, per task, None or the failure's traceback."""
    import json
    import traceback

    torch.set_num_threads(1)  # the processes share the machine's cores
    dist.init_process_group("gloo", init_method=f"file://{os.path.join(tmp, 'store')}",
                            rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    results = {}
    try:
        for task in tasks:
            try:
                TASKS[task](rank, world)
                results[task] = None
            except Exception:  # noqa: BLE001 - reported by the test of this task
                results[task] = traceback.format_exc()
            with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_processes():
    """One group of 2 processes runs every task (one start-up for all checks); returns
    {task: [traceback or None per rank]}."""
    import json

    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_worker, args=(WORLD, tmp, list(TASKS)), nprocs=WORLD,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                pytest.fail(f"{WORLD} processes did not finish in {JOIN_TIMEOUT_S} s")
        results = {}
        for rank in range(WORLD):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                for task, error in json.load(f).items():
                    results.setdefault(task, []).append(error)
        return results


def _assert_task(results, task):
    errors = results.get(task)
    assert errors is not None, f"task {task} did not run"
    failed = [f"rank {rank}:\n{error}" for rank, error in enumerate(errors) if error]
    assert not failed, "\n".join(failed)


def test_sharded_dense_model_matches_one_process(two_processes):
    _assert_task(two_processes, "dense")


def test_sharded_vsa_model_matches_one_process(two_processes):
    _assert_task(two_processes, "vsa")


def test_sharded_model_bad_inputs(two_processes):
    _assert_task(two_processes, "bad_inputs")
