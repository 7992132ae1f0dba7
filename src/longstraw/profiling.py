"""Per-phase wall time and peak memory (CUDA: max allocated; CPU: the process's peak RSS, reset per phase).

On Linux, writing ``5`` to ``/proc/self/clear_refs`` resets the peak resident set size (``VmHWM``), which makes a
per-phase CPU peak measurable inside one process. Where that is not possible the peak is the process-lifetime
``ru_maxrss`` and ``PhaseMeter.cpu_peak_resettable`` is False.
"""

from __future__ import annotations

import resource
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch


def _read_status_kb(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


def reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def cpu_peak_bytes() -> int:
    kb = _read_status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


def cpu_current_bytes() -> int:
    kb = _read_status_kb("VmRSS")
    return (kb or 0) * 1024


def current_bytes(device: torch.device) -> int:
    """Bytes in use now: CUDA allocated memory, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return cpu_current_bytes()


@dataclass
class PhaseMeter:
    """Collects ``seconds[phase]`` and ``peak_bytes[phase]`` for named phases on one device."""

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    cpu_peak_resettable: bool = True

    @contextmanager
    def phase(self, name: str):
        cuda = self.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self.cpu_peak_resettable = reset_cpu_peak() and self.cpu_peak_resettable
        t0 = time.perf_counter()
        try:
            yield
        finally:
            if cuda:
                torch.cuda.synchronize(self.device)
                peak = torch.cuda.max_memory_allocated(self.device)
            else:
                peak = cpu_peak_bytes()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
            self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak)


def trim_heap() -> None:
    """Return freed heap memory to the OS (glibc), so the next phase's peak RSS is its own."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def measure_step(step, params, device: torch.device, warmup=None) -> tuple[int, float]:
    """``(peak bytes above the baseline, seconds)`` of one call of ``step``.

    ``warmup`` (a small step) runs first to initialise thread pools and lazy state; gradients are then allocated as
    zeros (as in a step that accumulates several groups) and count in the peak, the heap is trimmed, the baseline
    taken. For faithful CPU numbers run the process with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc then returns large
    freed blocks to the OS at once, and the resident set follows the live tensors).
    """
    params = list(params)
    if warmup is not None:
        warmup()
    for p in params:
        p.grad = None
    trim_heap()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
    else:
        base = cpu_current_bytes()
        reset_cpu_peak()
    for p in params:
        p.grad = torch.zeros_like(p)
    t0 = time.perf_counter()
    step()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak = torch.cuda.max_memory_allocated(device)
    else:
        peak = cpu_peak_bytes()
    return peak - base, time.perf_counter() - t0
