"""The prompt state in host memory: page-locked buffers and the per-block copies that bring it to the device.

``GRPOConfig.offload_state`` moves the attention K/V of the prompt state to host memory once the forward phases
(prefill, rollouts) are done, so that the backward phases (branch replay, exact reverse pass) hold on the device
only the block of keys an attention call is working on. The attention op (:mod:`longstraw.ops.attention`) and its
context-parallel form (:mod:`longstraw.distributed.cp_attention`) attend a prefix in blocks of ``max_segment`` keys
already; for a segment marked ``host`` they copy each block to the queries' device just before its kernel, in the
forward and again in the backward (the autograd graph saves the host views, not device copies), and drop it after.

Why page-locked memory, and why registered rather than ``Tensor.pin_memory()``: a host-to-device copy from
page-locked memory is a DMA that runs asynchronously on the current stream (ordered before the kernels that read
the block, no host synchronisation); from pageable memory the driver stages it through a bounce buffer at a
fraction of the bandwidth. PyTorch's pinned-memory allocator rounds every allocation up to a power of two (up to
twice the bytes: a 1.04 GiB layer state would take 2 GiB); :func:`host_empty` instead allocates ordinary host
memory and page-locks exactly its bytes with ``cudaHostRegister`` (``torch.cuda.cudart()``, as PyTorch's own
``test_cudart_register`` calls it), unregistered when the tensor is collected, after a device synchronisation so
that no copy is in flight. Only buffers of at least :data:`REGISTER_MIN_BYTES` are locked: page-locking costs
about as much as copying the pages once, per call, and a DeltaNet layer's state at a chunk boundary (a few MiB,
thousands of them at a million tokens, each read back once) moves as fast from pageable memory as it would
cost to lock it; the K/V (a GiB per layer and GPU at long prompts, read per branch) are what the locking is for.
Without CUDA the buffers are ordinary host memory.

:func:`stage` copies a host view ``[B, H, S, D]`` whose ``[S, D]`` slabs are contiguous (a block of the
``[1, Hkv, P, D]`` state: every head's rows are contiguous, the heads are not adjacent) slab by slab, each a plain
DMA, into one contiguous device tensor (``Tensor.to`` would first gather a non-contiguous view into a pageable host
temporary). On a CPU run host and device memory are one, so the engine does not offload (:func:`offloads`); the
tests force it there, so that every copy below runs and the gradients are held equal to a run without offload. On
the meta device (the memory planner's dry run) a staged block is a fresh meta tensor, so the dry run counts it.

:func:`prefetched` overlaps the copies with the kernels: an attention call walks its blocks through it, and the
copy of block ``i + 1`` is issued before block ``i`` is handed over, so on a GPU it runs on a side stream (one per
device) while the kernels read block ``i``. Two blocks are on the device at a time, on every device alike, so the
planner's dry run counts both. The stream protocol is deterministic (no ``record_stream``, whose reuse of memory
depends on how far the GPU has got): each block is allocated and copied on the side stream after
``copy.wait_stream(main)`` (every block handed over before was last read by main-stream work enqueued by then, so
its memory, back in the side stream's pool, is reused only after that work), with an event recorded after its
copy; the main stream waits for that event when the block is handed over (not for the side stream as a whole: the
next block's copy stays in flight).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator

import torch
from torch import Tensor

__all__ = ["offloads", "host_empty", "to_host", "stage", "prefetched", "REGISTER_MIN_BYTES"]

REGISTER_MIN_BYTES = 16 << 20  # host buffers at least this large are page-locked (module docstring)


def offloads(t: Tensor) -> bool:
    """Whether a prompt state held like ``t`` moves to host memory under ``offload_state``: on an accelerator
    (and on meta, where the planner's dry run books it as host bytes); not when it already is in host memory."""
    return t.device.type != "cpu"


def _unregister(ptr: int) -> None:  # pragma: no cover - needs a GPU
    try:
        torch.cuda.synchronize()  # no copy from these pages may be in flight when they are unlocked
        torch.cuda.cudart().cudaHostUnregister(ptr)
    except Exception:  # noqa: BLE001 - interpreter shutdown, driver gone: the process's pages go with it
        pass


def host_empty(shape: tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised host tensor, page-locked at exactly its size where CUDA is available and it holds at least
    :data:`REGISTER_MIN_BYTES` (module docstring); unlocked when it is collected. Keep the returned tensor itself
    alive while views of it are in use."""
    t = torch.empty(shape, dtype=dtype, device="cpu")
    nbytes = t.numel() * t.element_size()
    if nbytes >= REGISTER_MIN_BYTES and torch.cuda.is_available():  # pragma: no cover - needs a GPU
        rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
        if int(getattr(rc, "value", rc)) != 0:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes of host memory for the prompt state failed "
                               f"(error {rc}): is the process's locked-memory limit (ulimit -l) too low?")
        weakref.finalize(t, _unregister, t.data_ptr())
    return t


def to_host(t: Tensor) -> Tensor:
    """A copy of ``t`` in host memory (:func:`host_empty`); a meta tensor stays on meta (a fresh one: the dry run's
    bookkeeping moves it, the planner books it as host bytes). Synchronous: once, when the state moves."""
    if t.device.type == "meta":
        return torch.empty_like(t)
    out = host_empty(tuple(t.shape), t.dtype)
    out.copy_(t)
    return out


def _slabs(t: Tensor) -> int:
    """How many leading dims to loop over so that each remaining slab of ``t`` is contiguous."""
    for lead in range(t.dim() + 1):
        if t[(0,) * lead].is_contiguous() if t.numel() else True:
            return lead
    return t.dim()  # pragma: no cover - a 0-d slab is always contiguous


def stage(t: Tensor, device: torch.device) -> Tensor:
    """A contiguous copy of the host view ``t`` on ``device`` (module docstring): one asynchronous copy per
    contiguous slab (from page-locked memory a DMA on the current stream, ordered before the kernels that read
    it). On meta a fresh tensor of the same shape (the dry run counts it); on a CPU run (tests) a real copy."""
    if t.device.type == "meta" or device.type == "meta":
        return torch.empty(t.shape, dtype=t.dtype, device=device)
    out = torch.empty(t.shape, dtype=t.dtype, device=device)
    lead = _slabs(t)
    if lead == 0:
        out.copy_(t, non_blocking=True)
        return out
    for idx in torch.cartesian_prod(*[torch.arange(n) for n in t.shape[:lead]]).reshape(-1, lead).tolist():
        out[tuple(idx)].copy_(t[tuple(idx)], non_blocking=True)
    return out


class _Inline:
    """:func:`prefetched`'s copies where there is no side stream (CPU, meta): issued in order, synchronously."""

    @staticmethod
    def issue(copy: Callable[[], tuple[Tensor, ...]]):
        return copy(), None

    @staticmethod
    def ready(handle) -> tuple[Tensor, ...]:
        return handle[0]


_COPY_STREAMS: dict = {}


class _SideStream:
    """:func:`prefetched`'s copies on a side stream of a CUDA device (module docstring: the protocol). ``cuda``:
    ``torch.cuda`` (a stand-in in the protocol's test)."""

    def __init__(self, device: torch.device, cuda=torch.cuda):
        self.cuda = cuda
        self.main = cuda.current_stream(device)
        key = (id(cuda), device.index if device.index is not None else cuda.current_device())
        if key not in _COPY_STREAMS:
            _COPY_STREAMS[key] = cuda.Stream(device=device)
        self.copy = _COPY_STREAMS[key]

    def issue(self, copy: Callable[[], tuple[Tensor, ...]]):
        self.copy.wait_stream(self.main)  # blocks freed so far: main's reads of them precede this copy
        with self.cuda.stream(self.copy):
            out = copy()  # allocated from, and copied on, the side stream
            done = self.cuda.Event()
            done.record(self.copy)
        return out, done

    def ready(self, handle) -> tuple[Tensor, ...]:
        out, done = handle
        self.main.wait_event(done)  # this block's copy only: the next one's stays in flight
        return out


_END = object()


def prefetched(blocks: Iterable[tuple[Tensor, ...] | None], device: torch.device, *,
               streams=None) -> Iterator[tuple[Tensor, ...] | None]:
    """Each block of ``blocks`` (a tuple of host views, e.g. ``(k, v)`` of ``max_segment`` keys; None: nothing to
    copy, passed through) :func:`stage`-d on ``device``, the next block's copy issued before this one is yielded
    (module docstring). Drop a yielded block before asking for the next one: at most two are then on the device.
    ``streams``: the copy protocol (default: a side stream on CUDA, in order elsewhere; made at the first block
    to copy, so that a call with nothing in host memory touches no stream)."""
    def issue(blk):
        nonlocal streams
        if blk is _END or blk is None:
            return blk
        if streams is None:
            streams = _SideStream(device) if device.type == "cuda" else _Inline()
        return streams.issue(lambda: tuple(stage(t, device) for t in blk))

    it = iter(blocks)
    pending = issue(next(it, _END))
    while pending is not _END:
        following = issue(next(it, _END))
        yield None if pending is None else streams.ready(pending)
        pending = following
