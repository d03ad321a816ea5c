"""vidattn's benchmark and accuracy check: ``python -m vidattn.bench --help``.

Times each implementation of a case (vidattn and its peers, e.g. PyTorch SDPA) on the same
seeded random inputs, checks each against a float64 reference, prints a table and writes
JSON plus a PNG plot. Modules: ``shapes`` (problem sizes, presets), ``base`` (what a case and
an implementation are), ``dense_case``, ``blocksparse_case``, ``vsa_case`` (the cases: ours and
its peers), ``cases`` (their registry), ``reference`` (float64 math), ``timing``, ``runner``
(the loop), ``environment`` (device name, git, versions), ``report`` (table, JSON), ``plot``,
``cli``; ``modes/`` holds the focused benchmarks (``python -m vidattn.bench MODE``).

Not imported by ``vidattn`` itself: it needs matplotlib and tqdm (the ``bench`` extra).
"""
from __future__ import annotations

from .cli import main

__all__ = ["main"]
