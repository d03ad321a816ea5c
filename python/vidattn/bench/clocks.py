"""The GPU's SM clock, board power and clock-limit reasons while rows are timed.

Long runs of attention kernels on an H200 sit at the board's power limit, some 15% below the
top clock (docs/perf-notes.md, "the power limit"), so a row's speed depends on the clock it
ran at. A background thread reads NVML (the driver's management library, through ctypes: no
extra package) every ``period_s``; each GPU row records the median SM clock and power and the
limit reasons seen while it was timed. Without NVML (no driver, a CPU run) nothing is
recorded and the bench runs as before.
"""
from __future__ import annotations

import ctypes
import statistics
import threading
import time
from typing import Callable, Optional, Sequence, Tuple

# NVML's clock-limit ("throttle" / "event") reason bits.
REASONS = {0x1: "idle", 0x2: "application clocks", 0x4: "power cap", 0x8: "hw slowdown",
           0x10: "sync boost", 0x20: "sw thermal", 0x40: "hw thermal", 0x80: "power brake",
           0x100: "display clocks"}

# One sample: (time.monotonic(), SM clock MHz, board power W, reason bits).
Sample = Tuple[float, float, float, int]


def reason_names(bits: int) -> list[str]:
    names = [name for bit, name in REASONS.items() if bits & bit]
    rest = bits & ~sum(REASONS)
    return names + ([f"0x{rest:x}"] if rest else [])


def summarise(samples: Sequence[Sample], t0: float, t1: float) -> Optional[dict]:
    """What the samples taken in [t0, t1] say: medians of clock and power, the union of the
    reasons, the count; None when there are none."""
    window = [s for s in samples if t0 <= s[0] <= t1]
    if not window:
        return None
    bits = 0
    for s in window:
        bits |= s[3]
    return {"sm_mhz_median": statistics.median(s[1] for s in window),
            "sm_mhz_min": min(s[1] for s in window),
            "power_w_median": round(statistics.median(s[2] for s in window), 1),
            "reasons": reason_names(bits), "samples": len(window)}


class NvmlReader:
    """SM clock, power and reason bits of one GPU through libnvidia-ml (ctypes)."""

    def __init__(self, device_index: int):
        import torch

        lib = ctypes.CDLL("libnvidia-ml.so.1")
        if lib.nvmlInit_v2() != 0:
            raise OSError("nvmlInit failed")
        self._lib, self._handle = lib, ctypes.c_void_p()
        props = torch.cuda.get_device_properties(device_index)
        bus = getattr(props, "pci_bus_id", None)
        found = 1
        if bus is not None:  # NVML's order need not be CUDA's: find the GPU by its PCI address
            address = (f"{getattr(props, 'pci_domain_id', 0):08x}:{bus:02x}:"
                       f"{getattr(props, 'pci_device_id', 0):02x}.0").encode()
            found = lib.nvmlDeviceGetHandleByPciBusId_v2(address, ctypes.byref(self._handle))
        if found != 0:
            if lib.nvmlDeviceGetHandleByIndex_v2(device_index, ctypes.byref(self._handle)) != 0:
                raise OSError("nvmlDeviceGetHandle failed")
        # The reasons query was renamed in newer drivers; the old name remains an alias.
        self._reasons = getattr(lib, "nvmlDeviceGetCurrentClocksEventReasons", None) or \
            lib.nvmlDeviceGetCurrentClocksThrottleReasons
        self.read()  # fail here, not in the sampling thread

    def read(self) -> Tuple[float, float, int]:
        clock, milliwatts, bits = ctypes.c_uint(), ctypes.c_uint(), ctypes.c_ulonglong()
        lib, h = self._lib, self._handle
        if (lib.nvmlDeviceGetClockInfo(h, 1, ctypes.byref(clock)) != 0  # NVML_CLOCK_SM
                or lib.nvmlDeviceGetPowerUsage(h, ctypes.byref(milliwatts)) != 0
                or self._reasons(h, ctypes.byref(bits)) != 0):
            raise OSError("an NVML query failed")
        return float(clock.value), milliwatts.value / 1000.0, int(bits.value)


class ClockSampler:
    """Samples ``read()`` every ``period_s`` on a daemon thread between ``start`` and
    ``stop``; ``window(t0, t1)`` (time.monotonic() values) summarises a stretch."""

    def __init__(self, read: Callable[[], Tuple[float, float, int]], period_s: float = 0.05,
                 description: str = ""):
        self._read, self.period_s, self.description = read, period_s, description
        self._samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @classmethod
    def for_device(cls, device) -> Optional["ClockSampler"]:
        """A sampler of this CUDA device through NVML, or None (CPU, or no NVML)."""
        if getattr(device, "type", None) != "cuda":
            return None
        try:
            reader = NvmlReader(device.index or 0)
        except (OSError, AttributeError):
            return None
        return cls(reader.read, description="NVML every 50 ms")

    def start(self) -> "ClockSampler":
        self._thread = threading.Thread(target=self._run, name="vidattn-clocks", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                clock, power, bits = self._read()
            except OSError:
                return  # the GPU went away: keep what was sampled
            self._samples.append((time.monotonic(), clock, power, bits))
            self._stop.wait(self.period_s)

    def window(self, t0: float, t1: float) -> Optional[dict]:
        return summarise(list(self._samples), t0, t1)
