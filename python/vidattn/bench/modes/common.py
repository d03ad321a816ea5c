"""What the modes share: the shape syntax of the kernel benchmarks, the TFLOP/s count, and
the way a mode's result is written (JSON with the run's metadata, or report lines)."""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from .. import environment
from ..report import json_safe


def parse_shape(spec: str) -> tuple:
    """``B,S,H,D[,causal]`` with S one length or ``Sq:Sk`` -> (B, Sq, H, D, causal, Sk)."""
    parts = spec.split(",")
    if len(parts) not in (4, 5) or (len(parts) == 5 and parts[4] != "causal"):
        raise argparse.ArgumentTypeError(
            f"shape {spec!r}: expected B,S,H,D or B,S,H,D,causal (S: a length or Sq:Sk)")
    lengths = parts[1].split(":")
    if len(lengths) > 2:
        raise argparse.ArgumentTypeError(f"shape {spec!r}: S is a length or Sq:Sk")
    try:
        sq, sk = int(lengths[0]), int(lengths[-1])
        return (int(parts[0]), sq, int(parts[2]), int(parts[3]), len(parts) == 5, sk)
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {spec!r}: B, S, H, D are integers") from None


def tflops(flops: float, ms: float) -> float:
    return flops / (ms * 1e-3) / 1e12


def parser(mode: str, doc: str) -> argparse.ArgumentParser:
    """A mode's argument parser: its module docstring as the description."""
    return argparse.ArgumentParser(prog=f"python -m vidattn.bench {mode}", description=doc,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)


def result_doc(mode: str, argv: Sequence[str], device: Optional[torch.device] = None,
               **payload) -> dict:
    """A mode's JSON document: the mode, the run's metadata (date, commit, versions, device;
    environment.metadata) and the mode's own keys."""
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if torch.cuda.is_available() else torch.device("cpu")
    meta = environment.metadata(device, torch.get_num_threads(), list(argv))
    return {"schema": f"vidattn-bench-{mode}/1", "mode": mode, **meta, **payload}


def write_json(path, doc: dict) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(json_safe(doc), indent=1, allow_nan=False) + "\n")


def emit(lines: Sequence[str], out=None) -> None:
    """Prints a report's lines and, given a path, writes them there too."""
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")
