"""A process group spawned by a test module (gloo on the CPU, or NCCL), shared by the
distributed tests: one start-up runs many checks, and each check's failure is reported by the
test of that check with every rank's traceback."""
from __future__ import annotations

import datetime
import importlib
import json
import os
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=60)  # a hung collective fails the workers
JOIN_TIMEOUT_S = 240  # and a hung process fails the test


def _worker(rank, world, tmp, module, tasks, backend):
    """Runs the tasks (names in the TASKS dict of the test module `module`, each called as
    task(rank, world)) in order and records, per task, None or the failure's traceback."""
    table = importlib.import_module(module).TASKS
    torch.set_num_threads(1)  # several processes share the machine's cores
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'store')}",
                            rank=rank, world_size=world, timeout=COLLECTIVE_TIMEOUT)
    results = {}
    try:
        for task in tasks:
            try:
                table[task](rank, world)
                results[task] = None
            except Exception:  # noqa: BLE001 - reported by the test of this task
                results[task] = traceback.format_exc()
            with open(os.path.join(tmp, f"rank{rank}.json"), "w") as f:
                json.dump(results, f)
    finally:
        dist.destroy_process_group()


def run_tasks(module, world, tasks, backend="gloo"):
    """One group of `world` processes runs the `tasks` of test module `module` (its name, e.g.
    __name__); returns {task: [traceback or None per rank]}."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_worker, args=(world, tmp, module, tasks, backend),
                                     nprocs=world, join=False, start_method="spawn")
        deadline = time.monotonic() + JOIN_TIMEOUT_S
        while not context.join(timeout=2):
            if time.monotonic() > deadline:
                for process in context.processes:
                    if process.is_alive():
                        process.terminate()
                pytest.fail(f"{world} processes did not finish {tasks} in {JOIN_TIMEOUT_S} s")
        results = {}
        for rank in range(world):
            with open(os.path.join(tmp, f"rank{rank}.json")) as f:
                for task, error in json.load(f).items():
                    results.setdefault(task, []).append(error)
        return results


def assert_task(results, task):
    """The task ran and passed on every rank."""
    errors = results.get(task)
    assert errors is not None, f"task {task} did not run"
    failed = [f"rank {rank}:\n{error}" for rank, error in enumerate(errors) if error]
    assert not failed, "\n".join(failed)
