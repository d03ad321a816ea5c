"""The bench's focused modes: ``python -m vidattn.bench MODE [options]``, one module each.

The default run (no mode) is the side-by-side case runner of cli.py: every implementation of
a case on the same inputs, checked against float64, as a table, JSON and PNG. A mode measures
one thing the case runner does not (one kernel family at fixed shapes, the forward sweep
against cuDNN, clocks and power, the sequence-parallel layer on several GPUs, ...) and writes
its own JSON or text, with the run's metadata (``common.result_doc``). Each module has
``main(argv) -> int``; it imports CUDA-only pieces inside ``main`` so that ``--help`` works on
any machine.
"""
from __future__ import annotations

import importlib
import textwrap
from typing import Sequence

# name -> (module, one line for the CLI's help)
MODES = {
    "dense": ("dense", "dense forward / backward TFLOP/s against SDPA cuDNN and flash at a few "
                       "shapes (--sweep: the forward sweep across shapes against cuDNN), then "
                       "the sm_90a block-sparse rows"),
    "block-sparse": ("block_sparse", "the block-sparse op against our dense forward at Wan "
                                     "480p: forward, backward, CUDA graph, sm_margin"),
    "key-mask": ("key_mask", "dense forward with padding masks against unmasked and cuDNN"),
    "rope": ("rope", "vidattn.apply_rope at the sequence-parallel layer's shapes (GB/s)"),
    "vsa-coarse": ("vsa_coarse", "the VSA coarse stage ops (tile, pool, top-k) one by one"),
    "vsa-overhead": ("vsa_overhead", "where the whole VSA forward's time goes besides its "
                                     "kernels (host, gaps, L2 flush, CUDA graph)"),
    "power": ("power", "SM clock and board power while a workload runs back to back"),
    "distributed": ("distributed", "DistributedAttention on 2 GPUs against 1 (run under "
                                   "torch.distributed.run)"),
    "alltoall": ("alltoall", "NCCL all-to-all bandwidth alone and beside a matmul (run under "
                             "torch.distributed.run)"),
    "targets": ("targets", "the Hopper forward targets read from a gpu-suite JSON"),
}


def describe(columns: int = 92) -> str:
    """The modes and what each does, for the CLI's help."""
    width = max(len(name) for name in MODES)
    return "\n".join(textwrap.fill(about, columns, initial_indent=f"  {name:{width}s}  ",
                                   subsequent_indent=" " * (width + 4))
                     for name, (_, about) in MODES.items())


def run(name: str, argv: Sequence[str]) -> int:
    module = importlib.import_module(f"{__name__}.{MODES[name][0]}")
    return module.main(list(argv))
