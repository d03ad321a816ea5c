"""Stress run of the CPU sequence-parallel checks of tests/python/test_distributed.py: spawns
groups of 4 gloo processes that run the test's tasks (default: the four-process group's list)
over and over, with PYTHONFAULTHANDLER set, and counts the groups that die. For hunting a
rare crash of that group ("malloc(): unaligned tcache chunk detected" in one rank, seen in
about 1 of 10 pytest runs on 2026-11-30). Not a test: it asserts nothing and takes minutes.

    python3 tools/stress_distributed.py [iterations per group] [groups]
    TASKS=vsa python3 tools/stress_distributed.py 10 5
"""
import os
import sys
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
import test_distributed as td  # noqa: E402

DEFAULT_TASKS = "parity,heads_not_divisible,subgroup,vsa"


def worker(rank, world, tmp, iters):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank,
                            world_size=world)
    tasks = os.environ.get("TASKS", DEFAULT_TASKS).split(",")
    for _ in range(iters):
        for task in tasks:
            try:
                td.TASKS[task](rank, world)
            except Exception:  # noqa: BLE001 - a failed check is not what this hunts
                pass
    dist.destroy_process_group()


def main():
    os.environ.setdefault("PYTHONFAULTHANDLER", "1")
    iters = int(sys.argv[1]) if len(sys.argv) > 1 else 3
    groups = int(sys.argv[2]) if len(sys.argv) > 2 else 4
    dead = 0
    for g in range(groups):
        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.start_processes(worker, args=(4, tmp, iters), nprocs=4, start_method="spawn")
            except Exception as e:  # noqa: BLE001 - counted and printed
                dead += 1
                print(f"group {g}: {str(e)[:160]}", flush=True)
    print(f"{dead} of {groups} groups died", flush=True)
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
