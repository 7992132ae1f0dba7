"""Exact mode's graph budget: keep the prompt-step graphs that fit, so the reverse pass recomputes only the rest.

Without a budget the prefill runs every step under ``no_grad`` and the exact reverse pass recomputes every step
with autograd (one more forward of the prompt). With ``GRPOConfig(graph_budget_bytes=N)`` the prefill runs the
steps whose graphs fit in ``N`` bytes with autograd and keeps those graphs; the reverse pass back-propagates
through them directly and recomputes only the others.

The unit of keeping is (step, top layers): for step ``i`` a split ``j_i`` in ``[0, L]``; layers ``>= j_i`` run with
autograd in the prefill and their graph is kept, layers ``< j_i`` run under ``no_grad`` (``j_i = L``: nothing kept,
the default; ``j_i = 0``: the whole step, embedding included). The budget is spent on the latest steps first (the
reverse pass meets them first, and frees each graph as soon as it has back-propagated it), whole steps, then the
top layers of one more step. For a split step the hidden entering layer ``j`` is a leaf
(``CausalLM.run(grad_from_layer=j)``); the reverse pass back-propagates the kept top layers, reads that leaf's
``.grad``, recomputes layers ``< j`` with autograd (``stop_at_layer=j``) and back-propagates them with their own
state gradient plus the leaf's.

Cost of a graph: measured, not modelled. The first step runs with autograd under
``torch.autograd.graph.saved_tensors_hooks`` that attribute every saved tensor's storage (unique storages, once)
to the layer running (forward pre-hooks on the decoder layers; the embedding counts with layer 0); parameters and
the prefix's tensors (the stored state, the gradient sinks) are excluded, the step's output pieces (the kept graph's
roots) included. Per-layer bytes per token times a step's tokens is that step's cost; a split step adds its
boundary leaf ``[1, T, hidden]``. Activations of a step are linear in its tokens (attention over the stored prefix
saves views of the state, which is counted already), so the first step's measurement prices every step. The first
step is kept whole or not at all (its graph is the measurement). The graphs that the plan keeps cost what was
measured; what autograd holds beyond saved tensors (nodes, a few hundred bytes each) is not counted.

The kept graphs save views of the state's buffers that later prefill steps write into (other positions): every
kept step runs under an identity ``saved_tensors_hooks``, which stores the tensors as they are and skips autograd's
version check (the values the graph reads are never overwritten; the writes go to later positions).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

__all__ = ["KeptStep", "KeptGraphs", "plan_splits", "graph_meter", "add_pieces", "keep_saved", "check_budget_placement"]


@dataclass
class KeptStep:
    """The kept graph of prefill step ``step``: ``pieces`` are the state pieces of layers ``split..L-1`` (the roots
    the reverse pass seeds), ``boundary`` the leaf hidden ``[1, T, hidden]`` entering layer ``split`` (None for
    ``split = 0``), ``nbytes`` its planned cost."""

    step: int
    split: int
    pieces: list[Any]
    boundary: Tensor | None
    nbytes: int


@dataclass
class KeptGraphs:
    """What the prefill kept for the reverse pass, and what it measured.

    ``layer_bytes_per_token[l]``: measured graph bytes per token of layer ``l`` (0 when nothing was measured);
    ``boundary_bytes_per_token``: the split leaf's bytes per token; ``planned``: ``{step: (split, bytes)}``;
    ``grad_enabled``: the prefill already called ``state.enable_grad()`` (kept steps need the gradient sinks while
    they run), so the caller must not call it again (it would replace the sinks the kept graphs write into);
    ``offload_grad``: those sinks in host memory (``GRPOConfig.offload_state_grad``).
    """

    budget: int
    steps: dict[int, KeptStep] = field(default_factory=dict)
    planned: dict[int, tuple[int, int]] = field(default_factory=dict)
    layer_bytes_per_token: list[float] = field(default_factory=list)
    boundary_bytes_per_token: float = 0.0
    measured_tokens: int = 0
    grad_enabled: bool = False
    offload_grad: bool = False

    @property
    def kept_bytes(self) -> int:
        """Planned bytes of every graph kept (whole steps and the split one)."""
        return sum(b for _, b in self.planned.values())

    def step_bytes(self, tokens: int) -> int:
        """Measured bytes of one whole step of ``tokens`` tokens."""
        return math.ceil(sum(self.layer_bytes_per_token) * tokens)

    def summary(self, num_layers: int) -> dict[str, int]:
        """``kept_graph_bytes``, ``kept_steps`` (whole), ``kept_layers`` (of the split step, 0 if none),
        ``step_graph_bytes`` (one measured step)."""
        split = [sp for sp, _ in self.planned.values() if sp > 0]
        return {"kept_graph_bytes": self.kept_bytes,
                "kept_steps": sum(1 for sp, _ in self.planned.values() if sp == 0),
                "kept_layers": num_layers - split[0] if split else 0,
                "step_graph_bytes": self.step_bytes(self.measured_tokens)}

    def pop(self, step: int) -> KeptStep | None:
        return self.steps.pop(step, None)


def plan_splits(lengths: list[int], layer_bytes_per_token: list[float], boundary_bytes_per_token: float,
                budget: int) -> dict[int, tuple[int, int]]:
    """``{step: (split, bytes)}`` for the steps of ``lengths`` tokens each: the latest steps whole while they fit
    in ``budget``, then the most top layers of the next one that fit (with its boundary leaf); earlier steps none."""
    num_layers = len(layer_bytes_per_token)
    suffix = [sum(layer_bytes_per_token[j:]) for j in range(num_layers + 1)]
    left, out = budget, {}
    for i in reversed(range(len(lengths))):
        t = lengths[i]
        whole = math.ceil(suffix[0] * t)
        if whole <= left:
            out[i] = (0, whole)
            left -= whole
            continue
        for j in range(1, num_layers):
            cost = math.ceil((suffix[j] + boundary_bytes_per_token) * t)
            if cost <= left:
                out[i] = (j, cost)
                break
        break
    return out


def _storage_key(t: Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s._cdata, s.nbytes()


def _tensors(x: Any) -> Iterator[Tensor]:
    """Every tensor in a (nested) prefix or piece: tensors, lists/tuples, dataclasses."""
    if isinstance(x, Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif dataclasses.is_dataclass(x) and not isinstance(x, type):
        for f in dataclasses.fields(x):
            yield from _tensors(getattr(x, f.name))


def _identity(t: Tensor) -> Tensor:
    return t


def keep_saved():
    """The context every kept step's forward runs in: saved tensors stored as they are (no version check: later
    prefill steps write other positions of the state buffers these graphs read)."""
    return torch.autograd.graph.saved_tensors_hooks(_identity, _identity)


@contextmanager
def graph_meter(model: Any, prefix: Any, per_layer: list[int]):
    """Measure the graph of one ``model.run`` inside: ``per_layer[l]`` receives the bytes of the unique storages
    saved for backward while layer ``l`` runs (the embedding counts with layer 0), parameters and ``prefix``'s
    tensors excluded. The caller adds the output pieces with :func:`add_pieces`. Also keeps saved tensors as
    :func:`keep_saved` does."""
    seen = {s for s, _ in map(_storage_key, model.parameters())}
    seen |= {s for s, _ in map(_storage_key, _tensors(prefix))}
    current = [0]

    def pack(t: Tensor) -> Tensor:
        key, nbytes = _storage_key(t)
        if key not in seen:
            seen.add(key)
            per_layer[current[0]] += nbytes
        return t

    def at(idx: int):
        def hook(module, args):
            current[0] = idx
        return hook

    handles = [layer.register_forward_pre_hook(at(i)) for i, layer in enumerate(model.layers)]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, _identity):
            yield seen
    finally:
        for h in handles:
            h.remove()


def add_pieces(pieces: list[Any], seen: set[int], per_layer: list[int]) -> None:
    """Count the output pieces' storages not already counted (the kept graph holds its roots)."""
    for i, piece in enumerate(pieces):
        for t in _tensors(piece):
            key, nbytes = _storage_key(t)
            if key not in seen:
                seen.add(key)
                per_layer[i] += nbytes


def check_budget_placement(model: Any, budget: int | None) -> None:
    """ValueError when a nonzero budget meets a placement that cannot keep prompt-step graphs
    (``Placement.check_kept_graphs``: under context parallelism, every layer's state kind must support it, and
    under FSDP every rank must be on one prompt)."""
    if budget:
        model.placement.check_kept_graphs(model, budget)
