"""A check, on a CPU, that a prompt state moved to host memory is only ever read through ``ops/host_memory.py``.

With ``GRPOConfig.offload_state`` on a GPU the attention K/V live in host memory while the kernels run on the device:
any op that reads them directly (a kernel fed a host slice, a ``torch.cat`` with device tensors) fails there or
moves data behind the engine's back. On a CPU the engine does not offload at all (host and device memory are one),
so :func:`guarded_host` forces it (``offloads_state`` true for CPU tensors) and makes every moved tensor a
:class:`GuardedHost`: views of it (slices, ``detach``, attribute reads) are free; any other op raises unless a frame
of ``ops/host_memory.py`` (``stage``: the per-block copy to the device) is on the stack.
"""

from __future__ import annotations

import contextlib

import torch
from sink_guard import FREE, called_from

import longstraw.distributed.cp_recurrent as cp_recurrent
import longstraw.models.deltanet as deltanet
import longstraw.ops.host_memory as host_memory
import longstraw.state as state

_MOVERS = (state, deltanet, cp_recurrent)  # the modules that move a state to host memory

_FREE = FREE | {"detach", "stride"}  # the moved K/V are detached and sliced on the way to the attention op
_HOST_FILE = host_memory.__file__


class GuardedHost(torch.Tensor):
    touched: list[str] = []  # ops that went through ops/host_memory.py (the state was read at all)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        if name in _FREE:
            return super().__torch_function__(func, types, args, kwargs)
        if not called_from(_HOST_FILE):
            raise AssertionError(f"{name} on a prompt state in host memory outside longstraw/ops/host_memory.py: on "
                                 "a GPU the kernels cannot read it")
        cls.touched.append(name)
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


def _guarded_to_host(t):
    return host_memory.to_host(t).as_subclass(GuardedHost)


@contextlib.contextmanager
def guarded_host():
    """Within: ``offload_state`` moves a CPU state too, into :class:`GuardedHost` tensors. Yields the list of ops
    that went through ``ops/host_memory.py``."""
    GuardedHost.touched = []
    saved = [(m.offloads_state, m.to_host) for m in _MOVERS]
    for m in _MOVERS:
        m.offloads_state, m.to_host = (lambda t: True), _guarded_to_host
    try:
        yield GuardedHost.touched
    finally:
        for m, (o, t) in zip(_MOVERS, saved):
            m.offloads_state, m.to_host = o, t
