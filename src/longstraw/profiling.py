"""Per-phase wall time and peak memory (CUDA: max allocated; CPU: the process's peak RSS, reset per phase).

On Linux, writing ``5`` to ``/proc/self/clear_refs`` resets the peak resident set size (``VmHWM``), which makes a
per-phase CPU peak measurable inside one process. Where that is not possible the peak is the process-lifetime
``ru_maxrss``.

Peak windows nest: a benchmark measures a whole step while the step measures its phases. Every reset first folds
the current high-water mark (CPU RSS or CUDA max allocated) into all open windows, so an inner reset never
hides an outer window's peak.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Protocol

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


def _hwm_bytes() -> int:
    kb = _read_status_kb("VmHWM")
    if kb is None:
        kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return kb * 1024


_open_windows: list[tuple[str, list[int]]] = []  # (device kind, [max folded in])


def _raw_peak(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    return _hwm_bytes()


def reset_peak(device: torch.device) -> bool:
    """Reset the device's peak counter (CUDA max allocated, or the process's peak RSS), folding the current peak
    into every open window of that device first. False if the CPU peak cannot be reset on this system."""
    hwm = _raw_peak(device)
    for kind, w in _open_windows:
        if kind == device.type:
            w[0] = max(w[0], hwm)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return True
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextmanager
def peak_window(device: torch.device):
    """``with peak_window(device) as peak:`` ... ``peak()`` is the peak bytes (CUDA allocated / process RSS) since
    the window opened, whatever inner windows reset meanwhile."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    reset_peak(device)
    w = [0]
    entry = (device.type, w)
    _open_windows.append(entry)
    try:
        yield lambda: max(w[0], _raw_peak(device))
    finally:
        _open_windows.remove(entry)


def cpu_current_bytes() -> int:
    kb = _read_status_kb("VmRSS")
    return (kb or 0) * 1024


def current_bytes(device: torch.device) -> int:
    """Bytes in use now: CUDA allocated memory, or this process's resident set on CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return cpu_current_bytes()


class ProgressSink(Protocol):
    """A progress display for one phase: ``update(done, total)`` after each unit of work, ``close()`` at the end."""

    def update(self, done: int, total: int) -> None: ...

    def close(self) -> None: ...


def _no_progress(done: int, total: int) -> None:
    return None


@dataclass
class PhaseMeter:
    """Collects ``seconds[phase]`` and ``peak_bytes[phase]`` for named phases on one device, and reports the
    progress of long phases.

    ``progress``: ``name -> ProgressSink`` (e.g. :func:`delayed_bar`), or None for no display. Inside
    ``with meter.phase(name) as report:`` the code calls ``report(done, total)`` after each unit of work (prefill
    steps, branch batches, reverse-pass steps, decoding steps). The engine's entry points take a meter, so that
    callers (the trainer, the CLI, the memory planner) decide what is measured and shown.
    """

    device: torch.device
    seconds: dict[str, float] = field(default_factory=dict)
    peak_bytes: dict[str, int] = field(default_factory=dict)
    progress: Callable[[str], ProgressSink] | None = None
    info: dict[str, int] = field(default_factory=dict)  # what a step reports beyond time and memory (kept graphs)

    @contextmanager
    def phase(self, name: str):
        cuda = self.device.type == "cuda"
        sink = self.progress(name) if self.progress is not None else None
        t0 = time.perf_counter()
        with peak_window(self.device) as peak_of:
            try:
                yield sink.update if sink is not None else _no_progress
            finally:
                if cuda:
                    torch.cuda.synchronize(self.device)
                self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0
                self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), peak_of())
                if sink is not None:
                    sink.close()


class _DelayedBar:
    """A tqdm bar that appears only once its phase has run ``delay_s`` seconds (short phases print nothing)."""

    def __init__(self, name: str, delay_s: float, stream):
        self.name, self.delay_s, self.stream = name, delay_s, stream
        self.bar = None

    def update(self, done: int, total: int) -> None:
        if self.bar is None:
            from tqdm import tqdm

            self.bar = tqdm(total=total, desc=f"  {self.name}", unit="step", delay=self.delay_s, leave=False,
                            file=self.stream, dynamic_ncols=True)
        self.bar.total = total
        self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def delayed_bar(delay_s: float = 3.0, stream=None) -> Callable[[str], ProgressSink]:
    """A ``PhaseMeter.progress`` factory: a progress bar per phase, shown once the phase takes ``delay_s`` s."""
    return lambda name: _DelayedBar(name, delay_s, stream if stream is not None else sys.stderr)


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 65536


def tune_allocator(threshold: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Make glibc serve allocations of ``threshold`` bytes and more with ``mmap`` (returned to the OS when freed),
    as ``MALLOC_MMAP_THRESHOLD_=65536`` in the environment does; True if it was set.

    Why: glibc raises its mmap threshold each time a freed mmapped block of up to 32 MiB is larger than the current
    threshold (its "dynamic threshold"); after that, tensors below the new threshold come from the heap, and freed
    heap memory stays resident as long as any small block above it lives. A run's resident set then drifts well
    above its live tensors (``longstraw demo --steps 6``: 56 MiB planned, 85 MiB above the baseline with glibc's
    defaults, 67 MiB with the fixed threshold; see docs/DESIGN.md, Numbers).
    Setting the threshold explicitly also switches the dynamic adjustment off. A no-op returning False where the C
    library is not glibc, or when ``MALLOC_MMAP_THRESHOLD_`` is already set (the user's value wins)."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    import ctypes

    try:
        libc = ctypes.CDLL(None)
        libc.gnu_get_libc_version  # noqa: B018 (present in glibc only)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, int(threshold)) == 1


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
    taken. For faithful CPU numbers call :func:`tune_allocator` first (or run the process with
    ``MALLOC_MMAP_THRESHOLD_=65536``): glibc then returns large freed blocks to the OS at once, and the resident set
    follows the live tensors.
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
    base = current_bytes(device)
    with peak_window(device) as peak_of:
        for p in params:
            p.grad = torch.zeros_like(p)
        t0 = time.perf_counter()
        step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        peak = peak_of()
    return peak - base, time.perf_counter() - t0
