"""A check, on a CPU, that offloaded gradient sinks are only ever touched through ``longstraw.ops.sinks``.

With ``GRPOConfig.offload_state_grad`` on a GPU the state gradient lives in host memory while everything else runs
on the device: any op that reads or writes a sink directly (``sink += x``, a kernel fed a sink slice) fails there
or moves data behind the engine's back. On a CPU host and device are one, so such a call would pass unnoticed.
:func:`guarded_sinks` makes every sink that a state allocates with ``offload=True`` a :class:`GuardedSink`: views
of it (slices, ``view``, attribute reads) are free; any other op raises unless a frame of ``ops/sinks.py`` (the
helpers that move data to the sink's device) is on the stack.
"""

from __future__ import annotations

import contextlib
import sys

import torch

import longstraw.models.mla as mla
import longstraw.ops.sinks as sinks
import longstraw.state as state

# ops that only view or describe a tensor: free on a guarded one (tests/host_guard.py adds its own)
FREE = frozenset({"__get__", "__getitem__", "view", "numel", "element_size", "size", "dim", "is_contiguous",
                  "__len__", "data_ptr", "untyped_storage", "apply", "__repr__", "__format__", "_is_view",
                  "is_floating_point"})
_SINKS_FILE = sinks.__file__


def called_from(path: str) -> bool:
    """Whether a frame of the file ``path`` is on the stack of the op a ``__torch_function__`` intercepts (called
    from that ``__torch_function__``: its caller's caller and up)."""
    f = sys._getframe(2)
    while f is not None:
        if f.f_code.co_filename == path:
            return True
        f = f.f_back
    return False


class GuardedSink(torch.Tensor):
    touched: list[str] = []  # ops that went through the helpers (the check saw the sinks used at all)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in FREE:
            return super().__torch_function__(func, types, args, kwargs)
        if not called_from(_SINKS_FILE):
            raise AssertionError(f"{name} on an offloaded gradient sink outside longstraw/ops/sinks.py: on a GPU "
                                 "the sink is in host memory")
        cls.touched.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            out = func(*args, **kwargs)
        if name in ("to", "clone") and isinstance(out, torch.Tensor):
            out = out.as_subclass(torch.Tensor)  # what a read hands to the device: a plain tensor
        return out


def _guarded_new_sink(like, dtype, offload, home=None):
    t = torch.zeros(like.shape, dtype=dtype, device=sinks.sink_device(home or like.device, offload))
    return t.as_subclass(GuardedSink) if offload else t


@contextlib.contextmanager
def guarded_sinks():
    """Within: sinks allocated with ``offload=True`` are :class:`GuardedSink`. Yields the list of ops that went
    through the helpers."""
    GuardedSink.touched = []
    saved = state.new_sink, mla.new_sink
    state.new_sink = mla.new_sink = _guarded_new_sink
    try:
        yield GuardedSink.touched
    finally:
        state.new_sink, mla.new_sink = saved
