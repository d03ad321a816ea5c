"""What the bench runs: the registry of cases (dense_case.py, blocksparse_case.py,
vsa_case.py, each built from base.py's ``Case`` and ``Impl``). ``cases_for`` picks the cases
and the implementations that exist on a device. This module imports the case modules; none of
them imports it, so the package has no import cycle."""
from __future__ import annotations

from typing import Sequence

import torch

from .base import DTYPES, Case, dtype_of  # noqa: F401  (the names the CLI reads from here)
from .blocksparse_case import blocksparse_case
from .dense_case import dense_case
from .vsa_case import vsa_case

CASE_NAMES = ("dense", "blocksparse", "vsa")


def cases_for(device: torch.device, names: Sequence[str] = CASE_NAMES) -> list[Case]:
    """The cases named, with the implementations that exist on ``device``."""
    available = {"vsa": vsa_case(device), "blocksparse": blocksparse_case(device),
                 "dense": dense_case(device)}
    unknown = [n for n in names if n not in available]
    if unknown:
        raise ValueError(f"--cases: unknown case(s) {unknown}; expected some of "
                         f"{sorted(available)}")
    return [available[n] for n in names]
