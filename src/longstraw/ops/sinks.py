"""Gradient sinks: buffers that a backward adds into in place instead of returning a gradient through autograd.

The exact mode collects the gradient that later tokens send into the prompt state in sinks shaped like the stored
state (``ops/attention.py``: K/V; ``models/mla.py``: latents; ``ops/sparse_attention.py``: selected latent rows).
Every in-place addition goes through this module, so a sink may live on another device than the computation: with
``GRPOConfig.offload_state_grad`` the state gradient lives in host memory while the model runs on a GPU, and each
addition copies one block's gradient device -> host (a synchronous copy, then an add on the CPU) and each read
copies one prefill step's slice host -> device. Where the sink is on the computing device these are the plain
in-place additions (``Tensor.to`` returns its input when neither device nor dtype changes).

Why host memory: the exact state gradient is float32, twice the bf16 state it belongs to, and at long prompts it is
the largest term of a step's peak (docs/SCALE.md). The price is traffic: every branch batch's backward adds the
whole gradient once, and each reverse-pass step adds the gradient of the prefix before it (docs/DESIGN.md).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

__all__ = ["add_into", "index_add_into", "read", "read_summed", "offloads", "sink_device", "new_sink"]


def add_into(sink: Tensor, grad: Tensor) -> None:
    """``sink += grad`` in place, ``grad`` cast to the sink's dtype and moved to its device (shapes equal)."""
    sink.add_(grad.to(device=sink.device, dtype=sink.dtype))


def index_add_into(rows: Tensor, index: Tensor, src: Tensor) -> None:
    """``rows[index[i]] += src[i]`` in place (``rows [N, D]``, ``index [n]``, ``src [n, D]``; repeated indices
    add up), ``src`` cast to the rows' dtype and moved with ``index`` to their device."""
    rows.index_add_(0, index.to(rows.device), src.to(device=rows.device, dtype=rows.dtype))


def read(sink: Tensor, like: Tensor) -> Tensor:
    """A sink's (slice's) content as ``like``'s device and dtype (the gradient a recomputed step is seeded with)."""
    return sink.to(device=like.device, dtype=like.dtype)


def read_summed(sinks: list[Tensor], likes: list[Tensor], all_reduce: Callable[[Tensor], Tensor]) -> list[Tensor]:
    """:func:`read` of sinks that several processes each hold a part of (a replicated state's partial gradients):
    the sinks copied, flat and together, to the first ``like``'s device in the first sink's dtype (one buffer), summed
    by one ``all_reduce`` (in place, a collective), then each cast to its ``like``'s dtype, so that the sums are taken
    in the sinks' precision. ``sinks[i]`` and ``likes[i]`` pair up (shapes: the sink's)."""
    flat = torch.cat([s.reshape(-1).to(device=likes[0].device, dtype=sinks[0].dtype) for s in sinks])
    flat = all_reduce(flat)
    out, at = [], 0
    for s, like in zip(sinks, likes):
        out.append(flat[at:at + s.numel()].view(s.shape).to(like.dtype))
        at += s.numel()
    return out


def offloads(state: Tensor | torch.device, offload: bool) -> bool:
    """Whether the sinks of a state held like ``state`` (a tensor of it, or the device it is computed on) count as
    host memory apart from it: ``offload`` and the state is not computed in host memory. A meta state (the
    planner's dry run) stands for an accelerator's: its sinks stay on meta, where the dry run tracks them, and are
    booked as host bytes (``grad_host_nbytes``)."""
    device = state if isinstance(state, torch.device) else state.device
    return offload and device.type != "cpu"


def sink_device(state: Tensor | torch.device, offload: bool) -> torch.device:
    """Where the sinks of a state held like ``state`` go: host memory when :func:`offloads` (but a meta state's
    stay on meta), the state's own device otherwise."""
    device = state if isinstance(state, torch.device) else state.device
    if offloads(device, offload) and device.type != "meta":
        return torch.device("cpu")
    return device


def new_sink(like: Tensor, dtype: torch.dtype, offload: bool, home: torch.device | None = None) -> Tensor:
    """A zeroed sink shaped like ``like`` in ``dtype``, on :func:`sink_device` (pageable host memory when
    offloaded: the pinned allocator rounds sizes up to powers of two, up to twice the bytes). ``home``: the device
    the state is computed on, where ``like`` itself is in host memory (``GRPOConfig.offload_state``)."""
    return torch.zeros(like.shape, dtype=dtype, device=sink_device(home or like.device, offload))

