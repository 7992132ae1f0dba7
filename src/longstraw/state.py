"""The prompt state: what later tokens need from the shared prompt, per layer, as plain data.

A :class:`PromptState` holds one ``LayerState`` per decoder layer. Each kind of token mixer defines its state type
(``Mixer.state_type``); the engine talks to every kind through the same few methods:

``write(piece, start, end)``
    store the state produced by prefill chunk ``[start, end)`` (under ``no_grad``);
``prefix(length, grad)``
    what the mixer consumes to process tokens that follow the first ``length`` prompt positions. With ``grad``,
    gradients that flow into this prefix are collected by the state (attention: added in place into a buffer the
    size of the K/V; recurrent: the ``.grad`` of leaf tensors), to be handed back by ``backward_roots``;
``backward_roots(piece, start, end)``
    for the exact reverse pass: pairs ``(tensor, grad)`` that back-propagate the gradient collected for chunk
    ``[start, end)`` through that chunk's recomputed state ``piece``;
``enable_grad(dtype, offload)`` / ``release_grad()``
    allocate (exact mode) and free the gradient buffers; ``offload``: the large ones (attention K/V, MLA latents)
    in host memory while the state is on an accelerator (``GRPOConfig.offload_state_grad``, ``ops/sinks.py``);
``nbytes()`` / ``grad_nbytes()`` / ``grad_host_nbytes()``
    memory of the stored state, of its gradient buffers, and of those among them held in host memory;
``offload()`` / ``offload_history()`` / ``host_nbytes()`` (optional: the kinds that can)
    move the stored state itself to host memory for the backward phases (``GRPOConfig.offload_state``: attention
    K/V, a DeltaNet layer's chunk-boundary states), move what only the reverse pass reads again there already
    during the prefill, and the bytes of it held there;
``decoder(batch, max_new)``
    per-branch state for decoding ``batch`` branches together over the shared prompt state (rollouts): its
    ``prefix(step)`` is what the mixer consumes at decode step ``step`` and ``append(piece, step)`` stores the new
    token's state. The prompt state itself is never copied per branch.

``KVState`` is the full-attention kind: post-RoPE keys and values of every prompt position; ``SlidingKVState`` a
sliding-window layer's: only the positions a later read can see (each prefill step's last ``window - 1``). Hybrid
(recurrent) and compressed-attention (latent) kinds live beside their mixers and follow the same protocol.

The :class:`PromptState` owns its schedule: which pieces of the prompt this process computes, in which order
(``steps``), what each piece's layers consume (``step_prefix``), where a piece's state goes (``write_step``), what the
exact reverse pass back-propagates from (``step_seeds``) and what must happen around that pass (``backward_scope``).
The engine's prefill and reverse pass are single loops over these; a prompt state split over processes
(``longstraw.distributed``) is a subclass with another schedule. Which kind a model gets is decided by its
:class:`Placement` (``CausalLM.placement``), which parallelism sets from outside the model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from longstraw.ops.attention import KVSegment
from longstraw.ops.host_memory import offloads as offloads_state
from longstraw.ops.host_memory import to_host
from longstraw.ops.sinks import new_sink, offloads, read


class LayerState(Protocol):
    def write(self, piece: Any, start: int, end: int) -> None: ...

    def prefix(self, length: int, grad: bool) -> Any: ...

    def backward_roots(self, piece: Any, start: int, end: int) -> list[tuple[Tensor, Tensor]]: ...

    def enable_grad(self, dtype: torch.dtype | None, offload: bool = False) -> None: ...

    def release_grad(self) -> None: ...

    def nbytes(self) -> int: ...

    def grad_nbytes(self) -> int: ...

    def grad_host_nbytes(self) -> int: ...

    def decoder(self, batch: int, max_new: int) -> Any: ...


def grad_dtype_for(dtype: torch.dtype) -> torch.dtype:
    """Gradient buffers accumulate in float32 for low-precision states (float64 stays float64)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class KVState:
    """Full attention: post-RoPE ``k [1, Hkv, P, Dk]`` and ``v [1, Hkv, P, Dv]`` of the prompt positions.

    Buffers are allocated at the first ``write`` for ``capacity`` positions. ``k_grad`` / ``v_grad`` (exact mode)
    have the same shapes and receive the gradient of every later token's attention in place (in host memory when
    offloaded: ``enable_grad(offload=True)``). :meth:`offload` moves ``k`` / ``v`` themselves to host memory
    (``GRPOConfig.offload_state``); ``home`` is then the device they are computed on, and every prefix is a
    ``host`` segment whose blocks the attention copies to that device one at a time.
    """

    capacity: int
    k: Tensor | None = None
    v: Tensor | None = None
    k_grad: Tensor | None = None
    v_grad: Tensor | None = None
    length: int = 0
    grad_offload: bool = False
    home: torch.device | None = None  # set while k / v are in host memory

    def write(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> None:
        k, v = piece
        assert k.shape[0] == 1 and k.shape[2] == end - start, "prefill writes one sequence, one chunk at a time"
        assert self.home is None, "the state was moved to host memory: its prefill is over"
        if self.k is None:  # zero-filled: the whole state is resident now, so a run that cannot hold it fails
            # at the first chunk rather than hours later on a page fault (and CPU RSS then matches the plan)
            self.k = k.new_zeros(1, k.shape[1], self.capacity, k.shape[3])
            self.v = v.new_zeros(1, v.shape[1], self.capacity, v.shape[3])
        self.k[:, :, start:end] = k
        self.v[:, :, start:end] = v
        self.length = max(self.length, end)

    def enable_grad(self, dtype: torch.dtype | None = None, offload: bool = False) -> None:
        if self.k is None:
            return
        dt = dtype or grad_dtype_for(self.k.dtype)
        self.grad_offload = offload
        self.k_grad = new_sink(self.k, dt, offload, self.home)
        self.v_grad = new_sink(self.v, dt, offload, self.home)

    def offload(self) -> None:
        """Move ``k`` / ``v`` to host memory (page-locked; ``ops/host_memory.py``) where they are on an accelerator
        (on meta, the planner's dry run: booked as host bytes); nothing where they already are in host memory."""
        if self.k is None or self.home is not None or not offloads_state(self.k):
            return
        self.home = self.k.device
        self.k, self.v = to_host(self.k), to_host(self.v)

    def release_grad(self) -> None:
        self.k_grad = self.v_grad = None

    def prefix(self, length: int, grad: bool) -> list[KVSegment]:
        if length == 0 or self.k is None:
            return []
        assert length <= self.length
        kg = self.k_grad[:, :, :length] if grad and self.k_grad is not None else None
        vg = self.v_grad[:, :, :length] if grad and self.v_grad is not None else None
        return [KVSegment(self.k[:, :, :length], self.v[:, :, :length], k_grad=kg, v_grad=vg,
                          host=self.home is not None)]

    def backward_roots(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        k, v = piece
        return [
            (k, read(self.k_grad[:, :, start:end], k)),
            (v, read(self.v_grad[:, :, start:end], v)),
        ]

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k, self.v) if t is not None)

    def grad_nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.k_grad, self.v_grad) if t is not None)

    def grad_host_nbytes(self) -> int:
        return self.grad_nbytes() if self.k is not None and offloads(self.home or self.k, self.grad_offload) else 0

    def host_nbytes(self) -> int:
        """Bytes of ``k`` / ``v`` held in host memory (:meth:`offload`; counted in ``nbytes`` too)."""
        return self.nbytes() if self.home is not None else 0

    def decoder(self, batch: int, max_new: int) -> "KVDecoder":
        return KVDecoder(self, batch, max_new)


@dataclass
class _Tail:
    """Positions ``[start, start + k.shape[2])`` of a sliding layer's K/V (and their gradient sinks)."""

    start: int
    k: Tensor
    v: Tensor
    k_grad: Tensor | None = None
    v_grad: Tensor | None = None

    @property
    def end(self) -> int:
        return self.start + self.k.shape[2]


@dataclass
class SlidingKVState:
    """Sliding-window attention (window ``W``): post-RoPE K/V of only the positions a later read can see.

    Reads come at the boundaries the prefill writes end on (the next step's prefix, the exact reverse pass's
    recomputation of that step, and ``prefix(P)`` for the replay and the rollouts), and a read at ``b`` sees
    positions ``>= b - W + 1``: a write of ``[start, end)`` keeps ``[max(start, end - W + 1), end)`` (its *tail*,
    copied: ``W - 1`` positions per step, not the step's whole K/V). Exact mode keeps every tail (the reverse pass
    reads each boundary again); detached mode drops the tails that no later read reaches, so the state is about
    ``W`` positions whatever the prompt's length. A prefix is the last ``min(length, W - 1)`` positions as one
    segment per tail it overlaps: the attention op's window is relative, so the positions before it need not be
    there. Gradient sinks (exact mode) cover the tails only: the rest of a step's keys are seen by that step's own
    queries alone, inside its recomputed graph. Under context parallelism every rank holds the same tails, one per
    layout step (``distributed.cp_window``).
    """

    capacity: int
    window: int
    exact: bool = False
    tails: list[_Tail] = field(default_factory=list)
    length: int = 0
    grad_offload: bool = False
    home: torch.device | None = None  # set while the tails are in host memory
    _grad: tuple[torch.dtype | None, bool] | None = None  # enable_grad's arguments: later tails get sinks too

    def write(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> None:
        k, v = piece
        assert k.shape[0] == 1 and k.shape[2] == end - start, "prefill writes one sequence, one chunk at a time"
        assert self.home is None, "the state was moved to host memory: its prefill is over"
        first = end - self.window + 1  # the first position a read at ``end`` or later sees
        keep = max(start, first)
        if not self.exact:  # nothing reads before ``first`` again
            self.tails = [t for t in self.tails if t.end > first]
        tail = _Tail(keep, k[:, :, keep - start:].clone(), v[:, :, keep - start:].clone())  # (sliding_kept: the rule)
        self.tails.append(tail)
        if self._grad is not None:
            self._sinks(tail)
        self.length = max(self.length, end)

    def _sinks(self, t: _Tail) -> None:
        dtype, offload = self._grad
        dt = dtype or grad_dtype_for(t.k.dtype)
        t.k_grad, t.v_grad = new_sink(t.k, dt, offload, self.home), new_sink(t.v, dt, offload, self.home)

    def enable_grad(self, dtype: torch.dtype | None = None, offload: bool = False) -> None:
        if not self.exact and self.tails:  # raise now, before any branch has added to .grad, not in the reverse pass
            raise ValueError("the exact reverse pass needs every prefill step's last window - 1 positions of a "
                             "sliding-window layer: it needs a prompt state built with exact=True "
                             "(prefill(..., exact=True) / generate(..., exact_state=True))")
        self._grad, self.grad_offload = (dtype, offload), offload
        for t in self.tails:
            self._sinks(t)

    def offload(self) -> None:
        """Move the tails to host memory (as :meth:`KVState.offload`)."""
        if not self.tails or self.home is not None or not offloads_state(self.tails[0].k):
            return
        self.home = self.tails[0].k.device
        for t in self.tails:
            t.k, t.v = to_host(t.k), to_host(t.v)

    def release_grad(self) -> None:
        self._grad = None
        for t in self.tails:
            t.k_grad = t.v_grad = None

    def prefix(self, length: int, grad: bool) -> list[KVSegment]:
        lo = max(0, length - self.window + 1)
        segs, covered = [], 0
        for t in self.tails:
            a, b = max(lo, t.start), min(length, t.end)
            if a >= b:
                continue
            sl = slice(a - t.start, b - t.start)
            g = grad and t.k_grad is not None
            segs.append(KVSegment(t.k[:, :, sl], t.v[:, :, sl], k_grad=t.k_grad[:, :, sl] if g else None,
                                  v_grad=t.v_grad[:, :, sl] if g else None, host=self.home is not None))
            covered += b - a
        assert covered == length - lo, f"positions [{lo}, {length}) of a sliding layer were not kept"
        return segs

    def backward_roots(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        k, v = piece
        for t in self.tails:
            if t.end == end and t.start >= start and t.k_grad is not None:
                off = t.start - start
                return [(k[:, :, off:], read(t.k_grad, k)), (v[:, :, off:], read(t.v_grad, v))]
        return []

    def nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for t in self.tails for x in (t.k, t.v))

    def grad_nbytes(self) -> int:
        return sum(x.numel() * x.element_size() for t in self.tails for x in (t.k_grad, t.v_grad) if x is not None)

    def grad_host_nbytes(self) -> int:
        return self.grad_nbytes() if self.tails and offloads(self.home or self.tails[0].k, self.grad_offload) else 0

    def host_nbytes(self) -> int:
        return self.nbytes() if self.home is not None else 0

    def decoder(self, batch: int, max_new: int) -> "KVDecoder":
        return KVDecoder(self, batch, max_new)


def sliding_kept(writes: list[tuple[int, int]], window: int, exact: bool) -> int:
    """How many positions a :class:`SlidingKVState` keeps after prefill writes of ``writes`` (``(start, end)`` in
    order), by the rule of its ``write``: each write's tail ``[max(start, end - W + 1), end)``, and in detached mode
    only the tails a read at the latest boundary still reaches (the planner counts the state by it)."""
    tails: list[tuple[int, int]] = []
    for start, end in writes:
        first = end - window + 1
        if not exact:
            tails = [t for t in tails if t[1] > first]
        tails.append((max(start, first), end))
    return sum(e - s for s, e in tails)


class KVDecoder:
    """Decoding ``batch`` branches: the shared prompt K/V (batch 1, read in place) plus per-branch buffers of the
    generated tokens' K/V ``[batch, Hkv, max_new, D]``."""

    def __init__(self, prompt: KVState, batch: int, max_new: int):
        self.prompt, self.batch, self.max_new = prompt, batch, max_new
        self.k: Tensor | None = None
        self.v: Tensor | None = None

    def prefix(self, step: int) -> list[KVSegment]:
        segs = self.prompt.prefix(self.prompt.length, False)
        if step > 0:
            segs.append(KVSegment(self.k[:, :, :step], self.v[:, :, :step]))
        return segs

    def append(self, piece: tuple[Tensor, Tensor], step: int) -> None:
        k, v = piece
        if self.k is None:
            self.k = k.new_empty(self.batch, k.shape[1], self.max_new, k.shape[3])
            self.v = v.new_empty(self.batch, v.shape[1], self.max_new, v.shape[3])
        self.k[:, :, step : step + k.shape[2]] = k
        self.v[:, :, step : step + v.shape[2]] = v

    def select(self, rows: Tensor) -> None:
        """Keep only the branches ``rows`` (finished ones are dropped from the batch)."""
        self.batch = int(rows.numel())
        if self.k is not None:
            self.k, self.v = self.k[rows], self.v[rows]


def chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    """``[0, length)`` cut into consecutive ``(start, end)`` chunks of ``chunk_size`` (the last may be shorter)."""
    return [(s, min(length, s + chunk_size)) for s in range(0, length, chunk_size)]


@dataclass
class PromptState:
    """The shared prompt state of one GRPO group: per-layer states for ``length`` prompt positions.

    ``token_ids`` are the prefilled ids (the prompt without its last token, which every branch replays);
    ``chunks`` the ``(start, end)`` of each prefill chunk in order: the schedule of this (single-process) kind.
    """

    layers: list[Any]
    token_ids: Tensor
    chunks: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return int(self.token_ids.shape[0])

    # ------------------------------------------------------------------ schedule (prefill and the reverse pass)
    def steps(self) -> list[tuple[int, int]]:
        """The pieces of the prompt this process computes, in prefill order: global ``(start, end)`` positions.
        The reverse pass walks them backwards. Every process of a group has the same number of steps."""
        return self.chunks

    def step_prefix(self, step: int, grad: bool) -> list[Any]:
        """Per-layer prefixes for the tokens of step ``step`` (prefill: ``grad=False``; reverse pass: ``True``)."""
        return self.prefix(self.chunks[step][0], grad)

    def write_step(self, step: int, pieces: list[Any]) -> None:
        """Store the per-layer state pieces that step ``step``'s tokens produced (prefill)."""
        s, e = self.chunks[step]
        for ls, piece in zip(self.layers, pieces):
            ls.write(piece, s, e)

    def step_seeds(self, step: int, pieces: list[Any], layers: range | None = None
                   ) -> tuple[list[Tensor], list[Tensor]]:
        """The recomputed pieces of step ``step`` to back-propagate from, and the state gradient collected for
        them: ``(roots, grads)`` for ``torch.autograd.backward``. ``layers``: the layers ``pieces`` belong to
        (default: all; a kept graph of the top layers and the recomputed bottom ones are seeded separately)."""
        s, e = self.chunks[step]
        roots, grads = [], []
        states = self.layers if layers is None else [self.layers[i] for i in layers]
        for ls, piece in zip(states, pieces, strict=True):
            for root, grad in ls.backward_roots(piece, s, e):
                if root.requires_grad and grad is not None:
                    roots.append(root)
                    grads.append(grad)
        return roots, grads

    @contextlib.contextmanager
    def backward_scope(self, model: Any) -> Iterator[None]:
        """What must surround the exact reverse pass over this state: nothing in one process (a state split over
        processes combines the processes' parameter gradients here)."""
        yield

    # ------------------------------------------------------------------ consumption and accounting
    def prefix(self, length: int | None = None, grad: bool = False) -> list[Any]:
        """Per-layer prefixes for tokens following the first ``length`` positions (default: all of them)."""
        n = self.length if length is None else length
        return [ls.prefix(n, grad) for ls in self.layers]

    def enable_grad(self, dtype: torch.dtype | None = None, offload: bool = False) -> None:
        """Allocate every layer's gradient buffers (exact mode); ``offload``: the large ones in host memory while
        the state is on an accelerator (``ops/sinks.py``; a recurrent layer's state gradient stays where it is)."""
        for ls in self.layers:
            ls.enable_grad(dtype, offload)

    def release_grad(self) -> None:
        for ls in self.layers:
            ls.release_grad()

    def offload(self) -> None:
        """Move every layer's state that its kind can hold in host memory there (``GRPOConfig.offload_state``:
        the attention K/V, and a DeltaNet layer's chunk-boundary states but the latest; MLA latents stay where they
        are). Once the forward phases are over: later prefix reads stream the moved state through the device."""
        for ls in self.layers:
            if hasattr(ls, "offload"):
                ls.offload()

    def offload_history(self) -> None:
        """Before the prefill (``GRPOConfig.offload_state``): let the layers whose kind keeps state that only the
        reverse pass reads again (a DeltaNet layer's state at every chunk boundary) move it to host memory as the
        prefill supersedes it."""
        for ls in self.layers:
            if hasattr(ls, "offload_history"):
                ls.offload_history()

    def host_nbytes(self) -> int:
        """Bytes of the stored state held in host memory (:meth:`offload`; counted in ``nbytes`` too)."""
        return sum(ls.host_nbytes() for ls in self.layers if hasattr(ls, "host_nbytes"))

    def nbytes(self) -> int:
        return sum(ls.nbytes() for ls in self.layers)

    def grad_nbytes(self) -> int:
        return sum(ls.grad_nbytes() for ls in self.layers)

    def grad_host_nbytes(self) -> int:
        """Bytes of the gradient buffers held in host memory (offloaded; counted in ``grad_nbytes`` too)."""
        return sum(ls.grad_host_nbytes() for ls in self.layers)

    def bytes_per_position(self) -> list[float]:
        """Stored bytes per prompt position for each layer (O(1) layers report their total / length)."""
        n = max(1, self.length)
        return [ls.nbytes() / n for ls in self.layers]


class Placement:
    """Where a model's prompt states live and how the processes that share them stay in step: the seam through
    which parallelism plugs into the engine (``CausalLM.placement``). This default keeps everything in this
    process; ``longstraw.distributed`` sets a context-parallel placement on a model from outside."""

    def prompt_state(self, model: Any, ids: Tensor, chunk_size: int, exact: bool) -> PromptState:
        """An empty prompt state for the prefilled ids ``[n]`` of ``model`` (``model.new_prompt_states``), with
        its schedule: chunks of ``chunk_size``. ``exact``: keep what the exact reverse pass needs."""
        n = int(ids.shape[0])
        return PromptState(model.new_prompt_states(n, exact), ids, chunk_bounds(n, chunk_size))

    def check_group(self, prompt_ids: Tensor, responses: list[Tensor]) -> None:
        """ValueError unless every process that shares the prompt state passes this group (nothing to check in
        one process)."""

    def agree(self, ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
        """Sampled token ids ``[n]`` and their log-probs ``[n]`` that every process sharing the state decodes (in
        one process: these)."""
        return ids, logprobs

    def lockstep(self, steps: int) -> int:
        """How many steps to run in a phase whose own work is ``steps`` steps: processes whose layers run
        collectives together (parameters sharded over processes that take different prompts) must all run the
        largest count, the extra ones idle (``engine/lockstep.py``). In one process: ``steps``."""
        return steps

    def finish(self, model: Any) -> None:
        """Called when a public engine call (``generate``, ``score``, ``grpo_backward``) returns or fails: leave the
        model's parameters as the optimiser holds them (under FSDP: every unit resharded). Nothing in one process."""

    def check_kept_graphs(self, model: Any, budget: int) -> None:
        """ValueError if prompt-step graphs (``GRPOConfig.graph_budget_bytes``) cannot be kept under this placement
        (``engine/kept_graphs.py``); in one process they always can."""

    def agree_max(self, values: list[float]) -> list[float]:
        """The elementwise maximum of ``values`` over the processes that share the prompt state, so that they make
        the same plan (the kept graphs' splits) from their own measurements; in one process: ``values``."""
        return values


LOCAL = Placement()


def finishes_placement(fn):
    """Decorator of a public engine call whose first argument is the model: ``model.placement.finish(model)`` when
    it returns or raises."""

    @functools.wraps(fn)
    def call(model, *args, **kwargs):
        try:
            return fn(model, *args, **kwargs)
        finally:
            model.placement.finish(model)

    return call
