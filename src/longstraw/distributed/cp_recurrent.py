"""Gated DeltaNet layers under context parallelism: every rank runs its piece at once, the state is composed by a scan.

A DeltaNet layer's state after a position is ``(conv [1, C, K-1], S [1, Hv, Dk, Dv])``: O(1), but sequential:
rank ``r``'s piece of a prefill step starts from the state after the pieces of ranks ``< r``. The delta rule is
affine in its initial state (``ops/deltanet.py``, "transfer"), so no rank waits for another: each runs its piece
ONCE from an unknown state, as one call of the layer's rule with ``Dk`` extra value columns (zero values, identity
initial state), which returns the piece's output and state from a zero state ``(o1, S1)`` and the maps from the
initial state ``S0`` (``b_t``: ``o_t = o1_t + S0^T b_t``; ``M``: ``S_end = M S0 + S1``). One all-gather per layer
and step (``[R, Hv, Dk, Dv + Dk]``) gives every rank every piece's ``(S1, M)``; rank ``r`` folds ranks ``< r`` onto
the step's initial state (the state after the previous step, held by every rank) for its own ``S0`` and corrects
its output, and every rank folds all ``R`` for the state after the step, identical everywhere (what the next step
and the branches read: no broadcast). The conv window (the last ``K - 1`` conv inputs before the piece) comes the
same way: every rank's last ``K - 1`` conv inputs, all-gathered before the conv, composed with the step's initial
window (pieces shorter than ``K - 1`` take from the ones before them). Cost per DeltaNet layer and step: the rule
on ``Dv + Dk`` value columns instead of ``Dv`` (the UT transform, ``Dk``-sized, is shared; about 1.5x the rule's
FLOPs at ``Dk = Dv``) and ``R`` small ``Dk x Dk x Dv`` products, on every rank; the hand-off it replaced (before
2026-12-05's sixth session) cost a lag instead: rank ``r`` started a mixer when rank ``r - 1`` had finished it, so
each run of consecutive DeltaNet layers ended ``R - 1`` mixer times after the first rank
(``benchmarks/deltanet_cp_scan.py`` weighs the two).

Mechanism: the prefixes this state hands the DeltaNet mixer override the hooks every recurrent prefix has
(``RecurrentPrefix.window`` / ``recur`` / ``leave``, identities in one process), so the model is not changed.

Gradients: autograd through the composition. The all-gathers' backward sends block ``j`` of every rank's gradient to
rank ``j`` (all-to-all, summed there), so the gradients of every piece's ``(S1, M)`` and conv inputs reach their
owners inside the step's backward; the step's initial state is a leaf on every rank whose gradients are summed
(all-reduce) when the reverse pass moves to the step before, where they seed the state after that step (on the last
rank; zero seeds elsewhere). Collective order in the backward is fixed by data dependencies on every rank: ``leave``
threads the layer's output and the state after the step through :class:`_Tie`, so the state gather's backward waits
for the layers above (``dy``; also where the state's seed arrives first); the conv gather's output passes through
the state gather (:class:`_Gather`'s ``after``), so its backward comes after it. Where nothing of a piece needs a
gradient (a frozen model's first DeltaNet layer on rank 0), the gathered tensors are made leaves, so that every rank
runs the same collectives.

Storage per rank: detached, the final state only; exact, also the state before each step (``K`` states, as one
rank held before: ``~1/R`` of the single-process chunk boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from longstraw.distributed.context import Comm
from longstraw.distributed.cp_state import ShardLayout
from longstraw.distributed.rehearsal import RehearsalComm
from longstraw.models.deltanet import RecurrentDecoder, RecurrentPrefix, RecurrentState
from longstraw.ops.deltanet import compose_transfer, transfer_inputs, transfer_output
from longstraw.ops.host_memory import offloads as offloads_state
from longstraw.ops.host_memory import stage, to_host
from longstraw.state import grad_dtype_for

__all__ = ["ShardedRecurrentState", "rehearsal_prefix"]


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


class _Gather(torch.autograd.Function):
    """``t [...]`` from every rank -> ``[R, ...]`` in rank order; backward: block ``j`` of the gradient goes to rank
    ``j`` (all-to-all), which sums what every rank sent it. ``after`` (or None) passes through unchanged, so that
    whatever consumes it waits in the backward for this gather's collective (an order fixed on every rank)."""

    @staticmethod
    def forward(ctx, t, comm: Comm, after):
        ctx.comm = comm
        return comm.all_gather(t), (after.view_as(after) if after is not None else None)

    @staticmethod
    def backward(ctx, g, d_after):
        return ctx.comm.all_to_all(g).sum(0), None, d_after


class _Tie(torch.autograd.Function):
    """Identity on the layer's output ``y`` and the state after the step ``(conv, S)``; its backward, which passes
    the state's gradient on to the fold and the gathers, runs only once ``dy`` has come from the layers above (or
    is known to be None: an unused output). So the gathers' collectives run at the same point of every rank's
    backward, and the fold's nodes never run at the start of a backward that seeds the state (which, under
    ``checkpoint_layers``, would recompute every layer at once: the first saved tensor a checkpointed region unpacks
    recomputes the region)."""

    @staticmethod
    def forward(ctx, y, conv, S):
        ctx.set_materialize_grads(False)  # an unused y stays without gradient
        ctx.meta = [(t.shape, t.dtype, t.device) for t in (conv, S)]
        return y.view_as(y), conv.view_as(conv), S.view_as(S)

    @staticmethod
    def backward(ctx, dy, dc, dS):
        dc, dS = [d if d is not None else torch.zeros(m[0], dtype=m[1], device=m[2])
                  for d, m in zip((dc, dS), ctx.meta)]
        return dy, dc, dS


def _leaf_if_needed(t: Tensor) -> Tensor:
    """``t`` itself, or under autograd a leaf copy that needs a gradient where ``t`` does not (nothing of this piece
    is differentiated here, but another rank's is: the gather's collective backward must run on every rank)."""
    if torch.is_grad_enabled() and not t.requires_grad:
        return t.detach().requires_grad_()
    return t


def _window(prev: Tensor | None, tails: Tensor, lengths: tuple[int, ...], upto: int, dtype: torch.dtype) -> Tensor:
    """The conv window ``[1, C, w]`` after the pieces ``< upto`` of a step: the last ``w`` rows of the step's initial
    window ``prev [1, C, w]`` (None: zeros) followed by each piece's conv inputs, of which ``tails [R, w, C]`` holds
    the last ``min(length, w)`` (right-aligned)."""
    w, c = tails.shape[1], tails.shape[2]
    rows, need = [], w
    for j in range(upto - 1, -1, -1):
        if need == 0:
            break
        take = min(lengths[j], w, need)
        rows.append(tails[j, w - take:])
        need -= take
    if need:
        rows.append(prev[0, :, w - need:].T.to(dtype) if prev is not None else tails.new_zeros(need, c))
    return torch.cat(rows[::-1]).T[None].contiguous()


def _fold(S: Tensor | None, gS: Tensor, upto: int) -> Tensor | None:
    """The state ``[Hv, Dk, Dv]`` after the pieces ``< upto`` of a step from its initial state ``S [1, Hv, Dk, Dv]``
    (None: zeros), given every piece's transfer state ``gS [R, Hv, Dk, Dv + Dk]``; None for a zero state."""
    dv = gS.shape[-1] - gS.shape[-2]
    s = S[0] if S is not None else None
    for j in range(upto):
        s = compose_transfer(gS[j], s, dv)
    return s


@dataclass
class _ScanPrefix(RecurrentPrefix):
    """Rank ``r``'s piece of step ``step`` (prefill, a kept prefill step or the exact reverse pass): ``(conv, S)``
    is the step's initial state (None before position 0; leaves that collect its gradient when differentiated).
    The piece runs from an unknown state and is composed with the other ranks' pieces (module docstring). (A
    dataclass whose fields are all it holds: FSDP2 rebuilds module inputs with ``dataclasses.replace``; what the
    hooks pass each other during one call lives in plain attributes.)"""

    owner: Any = None
    step: int = -1

    def enter(self, x: Tensor):
        return x, None, None  # the piece's own initial state is composed by window / recur

    def window(self, mixed: Tensor, conv: Tensor | None, width: int):
        o = self.owner
        o.device = mixed.device
        self._gC, self._dtype = None, mixed.dtype
        if width == 0:
            return None
        n = min(mixed.shape[1], width)
        tail = torch.cat([mixed.new_zeros(width - n, mixed.shape[2]), mixed[0, mixed.shape[1] - n:]])
        self._gC = _Gather.apply(_leaf_if_needed(tail), o.comm, None)[0]  # [R, w, C]
        return _window(self.conv, self._gC, o.layout.step_lengths(self.step), o.rank, mixed.dtype)

    def recur(self, rule, q, k, v, g, beta, S):
        o = self.owner
        dv = v.shape[-1]
        v2, init = transfer_inputs(v, q.shape[-1])
        o_full, S_full = rule(q, k, v2, g, beta, init)  # [1, T, Hv, Dv + Dk], [1, Hv, Dk, Dv + Dk]
        self._gS, self._gC = _Gather.apply(_leaf_if_needed(S_full[0]), o.comm, self._gC)
        return transfer_output(o_full, _fold(self.S, self._gS, o.rank), dv), None

    def leave(self, y: Tensor, conv: Tensor, S):
        o = self.owner
        gS, gC = self._gS, self._gC
        self._gS = self._gC = None
        S_end = _fold(self.S, gS, o.comm.size)[None]
        if gC is not None:
            conv = _window(self.conv, gC, o.layout.step_lengths(self.step), o.comm.size, self._dtype)
        if torch.is_grad_enabled():
            return _Tie.apply(y, conv, S_end)
        return y, conv, S_end


class _RehearsalLayout:
    def __init__(self, piece: int, ranks: int):
        self.lengths = (piece,) * ranks

    def step_lengths(self, step: int) -> tuple[int, ...]:
        return self.lengths


@dataclass
class _RehearsalOwner:
    comm: RehearsalComm
    layout: _RehearsalLayout
    rank: int
    device: torch.device = torch.device("cpu")


def rehearsal_prefix(prefix: RecurrentPrefix | None, ranks: int, piece: int) -> RecurrentPrefix:
    """What the last rank of a CP group of ``ranks`` runs for a DeltaNet layer's prompt piece of ``piece`` tokens
    (the rank that folds the most), in this process, from ``prefix``'s state (None: zeros): the widened rule, the
    gathered transfers (repeats of this piece's), the fold and the output correction; forward and backward, with
    the allocations of the real step and none of its communication. The memory planner's dry run takes it for the
    prompt steps of a ``cp > 1`` plan; ``benchmarks/deltanet_cp_scan.py`` times it against the plain prefix."""
    comm = RehearsalComm(ranks, ranks - 1)
    owner = _RehearsalOwner(comm, _RehearsalLayout(piece, ranks), ranks - 1)
    conv, S = (prefix.conv, prefix.S) if prefix is not None else (None, None)
    return _ScanPrefix(conv, S, owner=owner, step=0)


class ShardedRecurrentState:
    """A DeltaNet layer's prompt state under CP (see module docstring).

    ``final``: ``(conv, S)`` after the ``length`` positions written so far, the same on every rank. ``initial[k]``
    (exact mode): the state before step ``k`` (None for step 0), the same on every rank. Kept prompt-step graphs
    (``keeps_step_graphs``): a step asked for with ``grad`` before it is written is a prefill step whose graph is
    kept, its initial state a leaf; the reverse pass seeds it without recomputing it (``backward_roots`` hands the
    state gradient over as a recomputed step's ``step_prefix`` does). Host memory (``GRPOConfig.offload_state``), as
    a single process's :class:`RecurrentState`: after :meth:`offload_history` each step moves the earlier steps'
    initial states to host memory, :meth:`offload` moves them all; the reverse pass copies a step's back when it
    starts from it.
    """

    keeps_step_graphs = True

    def __init__(self, local: RecurrentState, layout: ShardLayout, comm: Comm):
        self.exact, self.layout, self.comm, self.rank = local.exact, layout, comm, comm.rank
        self.length = 0
        self._seeded: int | None = None  # the step whose state gradient _seed_last_rank handed over last
        self.final: tuple[Tensor, Tensor] | None = None
        self.initial: dict[int, tuple[Tensor, Tensor] | None] = {}
        self.grad_dtype: torch.dtype | None = None
        self._leaves: dict[Any, tuple[Tensor, Tensor]] = {}
        self._root_grad: tuple[Tensor, Tensor] | None = None
        self._grad_peak = 0
        self.device = torch.device("cpu")
        self.host_history = False
        self._on_host: set[int] = set()  # steps whose initial state is in host memory

    # ------------------------------------------------------------------ CP steps
    def step_prefix(self, step: int, grad: bool) -> RecurrentPrefix:
        if not grad or self.layout.steps[step][-1][1] > self.length:  # prefill (a kept step's if grad)
            if self.host_history:  # the earlier steps' initial states are read again only by the reverse pass
                self._to_host(range(step))
            init = self.final if step > 0 else None
            if self.exact:
                self.initial[step] = init
            if grad and init is not None:  # its graph is kept: the initial state collects its gradient
                init = self._leaves_for(step, init)
            return _ScanPrefix(*(init if init is not None else (None, None)), owner=self, step=step)
        self._seed(step)
        if ("init", step) in self._leaves:  # its graph was kept from the prefill (and back-propagated already):
            return _ScanPrefix(*self._leaves[("init", step)], owner=self, step=step)  # the layers below it
        init = self.initial.get(step)
        if init is None:
            return _ScanPrefix(None, None, owner=self, step=step)
        if step in self._on_host:  # back to the device for this step
            init = tuple(stage(t, self.device) for t in init)
        return _ScanPrefix(*self._leaves_for(step, init), owner=self, step=step)

    def _leaves_for(self, step: int, init: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        leaves = tuple(t.detach().to(self.grad_dtype).requires_grad_() for t in init)
        self._track(("init", step), leaves)
        return leaves  # type: ignore[return-value]

    def _seed(self, step: int) -> None:
        """:meth:`_seed_last_rank` once per step of the reverse pass (a kept step's seeds ask for it, and the
        recomputation of its layers below the kept ones asks again)."""
        if self._seeded != step:
            self._seeded = step
            self._seed_last_rank(step)

    def _seed_last_rank(self, step: int) -> None:
        """Give rank R-1 the gradient of the state after step ``step``: for the last step the branches' (the same on
        every rank), else the sum over ranks of what the step after it sent its initial-state leaves."""
        last = self.comm.size - 1
        if step == self.layout.num_steps - 1:
            leaves = self._leaves.get("final")
            g = [lf.grad for lf in leaves] if leaves is not None else [None, None]
            self._root_grad = None if g[0] is None or self.rank != last else (g[0], g[1])
            return
        leaves = self._leaves.pop(("init", step + 1), None)
        conv, S = self.final
        flat = torch.zeros(conv.numel() + S.numel(), dtype=self.grad_dtype, device=S.device)
        if leaves is not None:
            for part, lf in zip(flat.split([conv.numel(), S.numel()]), leaves):
                if lf.grad is not None:
                    part.copy_(lf.grad.flatten())
        self.comm.all_reduce(flat)
        gc, gs = flat.split([conv.numel(), S.numel()])
        self._root_grad = (gc.view(conv.shape), gs.view(S.shape)) if self.rank == last else None

    def write(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> None:
        """Store the state after the step (every rank composed the same)."""
        conv, S = (t.detach().clone().contiguous() for t in piece)
        self.final, self.device = (conv, S), conv.device
        self.length = self.layout.steps[self.layout.step_of(self.rank, start)][-1][1]

    def backward_roots(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        """The state after the step, seeded on rank R-1 with its gradient, with zeros on the others (so that every
        rank runs the step's gathers' backward, also where the layer's output is unused)."""
        self._seed(self.layout.step_of(self.rank, start))  # (a kept step's: its step_prefix was the prefill's)
        g, self._root_grad = self._root_grad, None
        roots = []
        for i, t in enumerate(piece):
            if t.requires_grad:
                roots.append((t, g[i].to(t.dtype) if g is not None else torch.zeros_like(t)))
        return roots

    # ------------------------------------------------------------------ replay / decoding / accounting
    def prefix(self, length: int, grad: bool) -> RecurrentPrefix | None:
        if length == 0 or self.final is None:
            return None
        if length != self.length:
            raise ValueError(f"a context-parallel recurrent state holds the state after {self.length} positions "
                             f"only, not after {length}")
        if not (grad and self.grad_dtype is not None):
            return RecurrentPrefix(*self.final)
        if "final" not in self._leaves:
            self._track("final", tuple(t.detach().to(self.grad_dtype).requires_grad_() for t in self.final))
        return RecurrentPrefix(*self._leaves["final"])

    def _track(self, key, leaves) -> None:
        self._leaves[key] = leaves
        self._grad_peak = max(self._grad_peak, sum(2 * _nbytes(*lv) for lv in self._leaves.values()))

    def enable_grad(self, dtype: torch.dtype | None = None, offload: bool = False) -> None:
        """``offload`` is ignored: the gradient leaves are a few states (small), on the state's device."""
        if self.final is None:
            return
        self.grad_dtype = dtype or grad_dtype_for(self.final[1].dtype)
        self._leaves.clear()
        self._seeded = None
        self._grad_peak = 0

    def release_grad(self) -> None:
        self._leaves.clear()
        self.grad_dtype = None
        self._root_grad = None
        self._seeded = None
        self._grad_peak = 0

    def _to_host(self, steps) -> None:
        for k in steps:
            init = self.initial.get(k)
            if init is None or k in self._on_host or not offloads_state(init[0]):
                continue
            self.initial[k] = (to_host(init[0]), to_host(init[1]))
            self._on_host.add(k)

    def offload_history(self) -> None:
        """From now on, each prefill step moves the earlier steps' initial states to host memory."""
        self.host_history = True

    def offload(self) -> None:
        """Move every step's initial state to host memory (where the state is on an accelerator)."""
        self._to_host(list(self.initial))

    def host_nbytes(self) -> int:
        return sum(_nbytes(*self.initial[k]) for k in self._on_host)

    def nbytes(self) -> int:
        inits = sum(_nbytes(*s) for s in self.initial.values() if s is not None) if self.exact else 0
        return inits + (_nbytes(*self.final) if self.final is not None else 0)

    def grad_nbytes(self) -> int:
        return self._grad_peak

    def grad_host_nbytes(self) -> int:
        return 0  # the gradient leaves stay on the state's device (enable_grad)

    def decoder(self, batch: int, max_new: int) -> RecurrentDecoder:
        return RecurrentDecoder(self, batch)  # reads prefix(length): the final state, the same on every rank
