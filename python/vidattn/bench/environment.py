"""Where the bench ran: device name (for file names), git commit, versions."""
from __future__ import annotations

import datetime
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Optional

import torch


def sanitize(text: str) -> str:
    """``Intel(R) Xeon(R) Gold 6338`` -> ``Intel-Xeon-Gold-6338``: safe in a file name."""
    text = re.sub(r"\((R|TM|C)\)", "", text, flags=re.IGNORECASE)
    text = re.sub(r"\s+(CPU\s*)?@.*$", "", text)  # drop "@ 2.00GHz"
    return re.sub(r"[^A-Za-z0-9.]+", "-", text).strip("-.") or "unknown"


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.lower().startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def device_description(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return cpu_model()


def device_name(device: torch.device, threads: int) -> str:
    """``cpu-AMD-EPYC-2t`` or ``NVIDIA-H200``."""
    if device.type == "cuda":
        return sanitize(device_description(device))
    return f"cpu-{sanitize(cpu_model())}-{threads}t"


def _git(*args: str) -> Optional[str]:
    try:
        out = subprocess.run(["git", *args], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def git_info() -> dict:
    """Commit of the checkout the bench code lives in (None when installed from a wheel) and
    whether its tracked files differ from it. ``VIDATTN_GIT_COMMIT`` wins when set: a copy of
    the tree (the GPU machine's) may have no .git, or sit inside another checkout whose commit
    git would report."""
    if os.environ.get("VIDATTN_GIT_COMMIT"):
        return {"git_commit": os.environ["VIDATTN_GIT_COMMIT"], "git_dirty": None}
    commit = _git("rev-parse", "HEAD")
    # Modified tracked files, not counting bench results (written by the bench itself).
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ":(top)",
                  ":(top,exclude)bench/results")
    dirty = None if commit is None or status is None else bool(status)
    return {"git_commit": commit, "git_dirty": dirty}


def repo_root() -> Path:
    """The git checkout of the current directory, else the current directory."""
    try:
        out = subprocess.run(["git", "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if out.returncode == 0 and out.stdout.strip():
            return Path(out.stdout.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return Path.cwd()


def metadata(device: torch.device, threads: int, argv: list[str]) -> dict:
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    try:
        import vidattn

        vidattn_version = vidattn.__version__
    except (ImportError, OSError):
        vidattn_version = None
    try:  # the machine may be shared: CPU timings mean little under load
        load = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        load = None
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "date": now.date().isoformat(),
        "datetime_utc": now.isoformat(timespec="seconds"),
        **git_info(),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "triton_version": triton_version,
        "vidattn_version": vidattn_version,
        "python_version": platform.python_version(),
        "platform": platform.platform(),
        "device": device_name(device, threads),
        "device_type": device.type,
        "device_description": device_description(device),
        "threads": threads,
        "cpu_count": os.cpu_count(),
        "load_average_at_start": load,
        "argv": list(argv),
    }
