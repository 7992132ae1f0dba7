"""Device names as users give them, checked against what this torch build and machine have.

``resolve_device("cuda:1", "model.device")`` returns ``torch.device("cuda", 1)`` or raises a ``ValueError`` that
names the setting, the value and the devices that are available here (instead of a traceback from deep inside
torch at the first tensor that goes there).
"""

from __future__ import annotations

import torch

__all__ = ["resolve_device", "available_devices", "device_memory"]


def available_devices() -> list[str]:
    """Device names usable in this process: ``cpu``, then ``cuda:0 ..`` and ``mps`` where present."""
    out = ["cpu"]
    if torch.cuda.is_available():
        out += [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    mps = getattr(torch.backends, "mps", None)
    if mps is not None and mps.is_available():
        out.append("mps")
    return out


def resolve_device(spec, name: str = "device") -> torch.device:
    """``spec`` (a ``torch.device`` or a name like ``cpu``, ``cuda``, ``cuda:1``, ``mps``) -> ``torch.device``;
    ValueError naming ``name`` if it is not a device name or not available here."""
    if isinstance(spec, torch.device):
        dev = spec
    else:
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError(f"{name}={spec!r} must be a device name like 'cpu', 'cuda' or 'cuda:1'")
        try:
            dev = torch.device(spec.strip())
        except (RuntimeError, ValueError):
            raise ValueError(f"{name}={spec!r} is not a device name; available here: "
                             f"{', '.join(available_devices())}") from None
    here = ", ".join(available_devices())
    if dev.type == "cpu":
        return dev
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            build = "this torch build has no CUDA" if torch.version.cuda is None else "no CUDA device is visible"
            raise ValueError(f"{name}={spec!r}: {build} (torch {torch.__version__}); available here: {here}")
        if dev.index is not None and dev.index >= torch.cuda.device_count():
            raise ValueError(f"{name}={spec!r}: there are {torch.cuda.device_count()} CUDA devices; available "
                             f"here: {here}")
        return dev
    if dev.type == "mps":
        mps = getattr(torch.backends, "mps", None)
        if mps is None or not mps.is_available():
            raise ValueError(f"{name}={spec!r}: MPS is not available here; available here: {here}")
        return dev
    if dev.type == "meta":
        raise ValueError(f"{name}={spec!r}: the meta device holds no data (the planner uses it); available here: "
                         f"{here}")
    raise ValueError(f"{name}={spec!r}: device type {dev.type!r} is not supported; available here: {here}")


def device_memory(device: torch.device) -> tuple[int | None, str]:
    """``(bytes, what that figure is)`` a run may use on ``device``: a GPU's total memory; on CPU what the OS
    reports as available now (``MemAvailable``); ``(None, "")`` where neither is known."""
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory), "total memory"
    if device.type == "cpu":
        try:
            with open("/proc/meminfo") as f:
                for line in f:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) * 1024, "available memory (MemAvailable)"
        except OSError:
            pass
    return None, ""
