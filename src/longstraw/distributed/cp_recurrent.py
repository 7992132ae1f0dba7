"""Gated DeltaNet layers under context parallelism: the recurrent state is handed across rank boundaries.

A DeltaNet layer's state after a position is ``(conv [1, C, K-1], S [1, Hv, Dk, Dv])``: O(1), but sequential. In
prefill step ``k`` rank ``r``'s piece starts from the state after piece ``r - 1`` of the same step, so each
DeltaNet layer runs its pieces one rank after the other (rank ``r`` waits for rank ``r - 1``, sends to ``r + 1``):
a sequential hand-off, about ``R`` times the single-piece time per DeltaNet layer per step, while full-attention
layers run in parallel. (A state scan, each rank computing the affine map ``S -> M S + R`` of its piece and a
prefix scan over ranks, would parallelise it; the gated-delta-rule op does not expose ``M`` yet.) The state after
each step is broadcast from the last rank, so every rank holds the state after the whole prompt (what the branches
read: their DeltaNet work is redundant like the rest of the replay).

Mechanism: the prefixes this state hands the DeltaNet mixer override the two typed hooks every recurrent prefix has
(``RecurrentPrefix.enter`` / ``leave``, identities in one process), so the model is not changed. Prefill: rank
``r > 0``'s ``enter`` receives the initial state from rank ``r - 1``; ``leave`` sends the piece's final state to
``r + 1``.

Exact reverse pass, step ``k``: rank ``r`` recomputes its piece from its stored initial state. The gradient of rank
``r``'s final state is the gradient of rank ``r + 1``'s initial state, produced inside the same backward: on rank
``r + 1`` ``enter`` threads the initial state (with the mixer's input) through :class:`_GradToPrev`, whose backward
sends the gradient to ``r``; on rank ``r`` ``leave`` threads the mixer's outputs through :class:`_Handoff`, whose
backward (reached right before the mixer's own backward) receives it and adds it to the final state's gradient
(ranks ``< R - 1`` seed their final state with a zero root gradient, so that every rank runs the backward). Both are
ordered by data dependencies, not by the autograd engine's scheduling. The chain runs from rank ``R - 1`` down to 0
per DeltaNet layer. Rank 0's initial-state gradient is the gradient of the state after step ``k - 1``: it is
broadcast at the next step and seeds rank ``R - 1``'s backward there; for the last step the seed is the branches'
gradient of the final prompt state (identical on every rank).

Storage per rank: detached, the final state only; exact, also the state before each of its ``K`` pieces
(``~1/R`` of the single-process chunk boundaries).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from longstraw.distributed.context import Comm
from longstraw.distributed.cp_state import ShardLayout
from longstraw.models.deltanet import RecurrentDecoder, RecurrentPrefix, RecurrentState
from longstraw.ops.host_memory import offloads as offloads_state
from longstraw.ops.host_memory import stage, to_host
from longstraw.state import grad_dtype_for

__all__ = ["ShardedRecurrentState"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


def _send(ts: list[Tensor], dst: int, comm: Comm) -> None:
    """Point-to-point send of a few tensors: a fixed-size header (dtype, rank, shape) then the data."""
    head = []
    for t in ts:
        assert t.dim() <= 4
        head += [_DTYPES.index(t.dtype), t.dim(), *t.shape, *([0] * (4 - t.dim()))]
    dist.send(torch.tensor(head, dtype=torch.int64, device=ts[0].device), group=comm.group, group_dst=dst)
    for t in ts:
        dist.send(t.contiguous(), group=comm.group, group_dst=dst)


def _recv(n: int, src: int, comm: Comm, device: torch.device) -> list[Tensor]:
    head = torch.empty(6 * n, dtype=torch.int64, device=device)
    dist.recv(head, group=comm.group, group_src=src)
    out = []
    for i in range(n):
        code, ndim, *shape = head[6 * i : 6 * i + 6].tolist()
        t = torch.empty(shape[:ndim], dtype=_DTYPES[code], device=device)
        dist.recv(t, group=comm.group, group_src=src)
        out.append(t)
    return out


class _Handoff(torch.autograd.Function):
    """Identity on the mixer's outputs ``(y, conv, S)``; backward receives from rank ``r + 1`` the gradient of this
    piece's final ``(conv, S)`` (which rank ``r + 1`` consumed) and adds it to theirs.

    Threading ``y`` through it orders its backward after the layers above (``dy`` comes from them), so a rank never
    waits here while the others wait for it in an upper layer's collective; when ``y`` is unused (the last layer in
    prefill skips its output) the node runs first, which is then the right time too."""

    @staticmethod
    def forward(ctx, y, conv, S, owner):
        ctx.owner, ctx.dtypes = owner, (conv.dtype, S.dtype)
        ctx.set_materialize_grads(False)  # an unused y stays without gradient, as on the rank without this node
        return y.view_as(y), conv.view_as(conv), S.view_as(S)

    @staticmethod
    def backward(ctx, dy, dc, ds):
        o = ctx.owner
        gc, gs = _recv(2, o.rank + 1, o.comm, o.device)
        gc, gs = gc.to(ctx.dtypes[0]), gs.to(ctx.dtypes[1])
        return dy, gc if dc is None else dc + gc, gs if ds is None else ds + gs, None


class _GradToPrev(torch.autograd.Function):
    """Identity on the mixer's input ``x`` and this piece's initial ``(conv, S)``; backward sends the gradient of
    ``(conv, S)`` to rank ``r - 1``.

    Threading ``x`` through it makes the send a prerequisite of everything below this layer in the backward (the
    gradient of ``x`` passes here), so it happens before this rank enters a lower layer's collective."""

    @staticmethod
    def forward(ctx, x, conv, S, owner):
        ctx.owner = owner
        ctx.set_materialize_grads(False)
        ctx.meta = [(conv.shape, conv.dtype), (S.shape, S.dtype)]
        return x.view_as(x), conv.view_as(conv), S.view_as(S)

    @staticmethod
    def backward(ctx, dx, gc, gs):
        o = ctx.owner
        gc, gs = [g if g is not None else torch.zeros(shape, dtype=dt, device=o.device)
                  for g, (shape, dt) in zip((gc, gs), ctx.meta)]
        _send([gc, gs], o.rank - 1, o.comm)
        return dx, gc, gs, None


@dataclass
class _PrefillPrefix(RecurrentPrefix):
    """Prefill, rank ``r``'s piece of a step: starts from ``(conv, S)`` (rank 0; None: zeros) or from the state rank
    ``r - 1`` sends (``receive``); hands its final state to rank ``r + 1``. (A dataclass whose fields are all it
    holds: FSDP2 rebuilds module inputs with ``dataclasses.replace``.)"""

    owner: Any = None
    receive: bool = False

    def enter(self, x: Tensor):
        if not self.receive:
            return x, self.conv, self.S
        o = self.owner
        conv, S = _recv(2, o.rank - 1, o.comm, x.device)
        o.device = x.device
        if o.exact:
            o.initial[o._step] = (conv, S)
        return x, conv, S

    def leave(self, y: Tensor, conv: Tensor, S: Tensor):
        o = self.owner
        if o.rank < o.comm.size - 1:
            _send([conv.detach(), S.detach()], o.rank + 1, o.comm)
        return y, conv, S


@dataclass
class _ReversePrefix(RecurrentPrefix):
    """Exact reverse pass, rank ``r``'s piece of a step: the initial-state leaves (None before position 0); rank
    ``r > 0`` sends their gradient to ``r - 1`` (:class:`_GradToPrev`), rank ``r < R - 1`` receives its final state's
    gradient from ``r + 1`` (:class:`_Handoff`)."""

    owner: Any = None

    def enter(self, x: Tensor):
        if self.S is not None and self.owner.rank > 0:
            return _GradToPrev.apply(x, self.conv, self.S, self.owner)
        return x, self.conv, self.S

    def leave(self, y: Tensor, conv: Tensor, S: Tensor):
        return _receive_final_grad(self.owner, y, conv, S)


def _receive_final_grad(o, y: Tensor, conv: Tensor, S: Tensor):
    """The mixer's outputs, on ranks ``r < R - 1`` under autograd through :class:`_Handoff` (its backward receives
    the final state's gradient from ``r + 1``)."""
    if o.rank < o.comm.size - 1 and torch.is_grad_enabled():
        if not (y.requires_grad or conv.requires_grad or S.requires_grad):
            # nothing of this piece needs a gradient here (a frozen model's first DeltaNet layers on the rank whose
            # piece starts at position 0), but rank r + 1 sends its initial state's gradient all the same: the
            # node must exist, and its zero-seeded state roots (backward_roots) run its receive
            conv, S = conv.detach().requires_grad_(), S.detach().requires_grad_()
        return _Handoff.apply(y, conv, S, o)
    return y, conv, S


@dataclass
class _KeptPrefix(RecurrentPrefix):
    """Prefill with the step's graph kept for the reverse pass (``GRPOConfig.graph_budget_bytes``), rank ``r``'s
    piece: the prefill's hand-off (rank ``r > 0`` receives its initial state from ``r - 1``, rank 0 starts from the
    state after the previous step; the final state goes to ``r + 1``) with the reverse pass's gradient links already
    in the graph: the initial state is a leaf that collects its gradient (sent to ``r - 1`` by :class:`_GradToPrev`
    on ranks ``r > 0``; rank 0's goes to rank ``R - 1`` at the previous step, as a recomputed step's does), and the
    final state receives its gradient from ``r + 1`` (:class:`_Handoff`)."""

    owner: Any = None

    def enter(self, x: Tensor):
        o = self.owner
        o.device = x.device
        if o.rank > 0:
            conv, S = _recv(2, o.rank - 1, o.comm, x.device)
        else:
            init = o.final if o._step > 0 else None
            if init is None:  # (step 0's graph is never kept: first_step_keepable)
                return x, None, None
            conv, S = init
        if o.exact:
            o.initial[o._step] = (conv, S)
        leaves = tuple(t.detach().to(o.grad_dtype).requires_grad_() for t in (conv, S))
        o._track(("init", o._step), leaves)
        if o.rank > 0:
            return _GradToPrev.apply(x, *leaves, o)
        return x, *leaves

    def leave(self, y: Tensor, conv: Tensor, S: Tensor):
        o = self.owner
        if o.rank < o.comm.size - 1:
            _send([conv.detach(), S.detach()], o.rank + 1, o.comm)
        return _receive_final_grad(o, y, conv, S)


class ShardedRecurrentState:
    """A DeltaNet layer's prompt state under CP (see module docstring).

    ``final``: ``(conv, S)`` after the ``length`` positions written so far, the same on every rank. ``initial[k]``
    (exact mode): the state before this rank's piece of step ``k`` (None before position 0). Kept prompt-step
    graphs (``keeps_step_graphs``): a step asked for with ``grad`` before it is written is a prefill step whose
    graph is kept (:class:`_KeptPrefix`); the reverse pass then seeds it without recomputing it (``backward_roots``
    hands the state gradient over as a recomputed step's ``step_prefix`` does). Step 0's graph is never kept
    (``first_step_keepable``: the prefill measures step 0 with the plain prefix, which has no gradient links).
    Host memory (``GRPOConfig.offload_state``), as a single process's :class:`RecurrentState`: after
    :meth:`offload_history` each step moves the earlier steps' initial states to host memory, :meth:`offload` moves
    them all; the reverse pass copies a step's back when it starts from it.
    """

    keeps_step_graphs = True
    first_step_keepable = False

    def __init__(self, local: RecurrentState, layout: ShardLayout, comm: Comm):
        self.exact, self.layout, self.comm, self.rank = local.exact, layout, comm, comm.rank
        self.length = 0
        self._seeded: int | None = None  # the step whose state gradient _seed_last_rank handed over last
        self.final: tuple[Tensor, Tensor] | None = None
        self.initial: dict[int, tuple[Tensor, Tensor] | None] = {}
        self.grad_dtype: torch.dtype | None = None
        self._leaves: dict[Any, tuple[Tensor, Tensor]] = {}
        self._step = -1
        self._root_grad: tuple[Tensor, Tensor] | None = None
        self._grad_peak = 0
        self.device = torch.device("cpu")
        self.host_history = False
        self._on_host: set[int] = set()  # steps whose initial state is in host memory

    # ------------------------------------------------------------------ CP steps
    def step_prefix(self, step: int, grad: bool) -> RecurrentPrefix:
        self._step = step
        if not grad:  # prefill
            if self.host_history:  # the earlier steps' initial states are read again only by the reverse pass
                self._to_host(range(step))
            if self.rank > 0:
                return _PrefillPrefix(None, None, owner=self, receive=True)
            init = self.final if step > 0 else None
            if self.exact:
                self.initial[step] = init
            return _PrefillPrefix(*(init if init is not None else (None, None)), owner=self)
        if self.layout.steps[step][-1][1] > self.length:  # not written yet: a prefill step whose graph is kept
            if self.host_history:
                self._to_host(range(step))
            return _KeptPrefix(None, None, owner=self)
        self._seed(step)
        if ("init", step) in self._leaves:  # its graph was kept from the prefill (and back-propagated already):
            return _ReversePrefix(*self._leaves[("init", step)], owner=self)  # the recomputed layers below it
        init = self.initial.get(step)
        if init is None:
            return _ReversePrefix(None, None, owner=self)
        if step in self._on_host:  # back to the device for this step
            init = tuple(stage(t, self.device) for t in init)
        leaves = tuple(t.detach().to(self.grad_dtype).requires_grad_() for t in init)
        self._track(("init", step), leaves)
        return _ReversePrefix(*leaves, owner=self)  # rank 0's .grad goes to rank R-1 at the next (earlier) step

    def _seed(self, step: int) -> None:
        """:meth:`_seed_last_rank` once per step of the reverse pass (a kept step's seeds ask for it, and the
        recomputation of its layers below the kept ones asks again)."""
        if self._seeded != step:
            self._seeded = step
            self._seed_last_rank(step)

    def _seed_last_rank(self, step: int) -> None:
        """Give rank R-1 the gradient of the state after step ``step`` (its piece's final state)."""
        last = self.comm.size - 1
        if step == self.layout.num_steps - 1:
            leaves = self._leaves.get("final")
            g = [lf.grad for lf in leaves] if leaves is not None else [None, None]
            self._root_grad = None if g[0] is None else (g[0], g[1])
            return
        leaves = self._leaves.pop(("init", step + 1), None)  # rank 0's, from the step just back-propagated
        conv, S = self.final
        bufs = [torch.zeros(t.shape, dtype=self.grad_dtype, device=t.device) for t in (conv, S)]
        if self.rank == 0 and leaves is not None:
            for b, lf in zip(bufs, leaves):
                if lf.grad is not None:
                    b.copy_(lf.grad)
        for b in bufs:
            self.comm.broadcast(b, src=0)
        self._root_grad = (bufs[0], bufs[1]) if self.rank == last else None

    def write(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> None:
        """Store the state after the step: rank R-1's piece end, broadcast to every rank."""
        conv, S = (t.detach().clone().contiguous() for t in piece)
        self.comm.broadcast(conv, src=self.comm.size - 1)
        self.comm.broadcast(S, src=self.comm.size - 1)
        self.final, self.device = (conv, S), conv.device
        self.length = self.layout.steps[self.layout.step_of(self.rank, start)][-1][1]

    def backward_roots(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        self._seed(self.layout.step_of(self.rank, start))  # (a kept step's: its step_prefix was the prefill's)
        conv, S = piece
        if self.rank < self.comm.size - 1:  # zero seeds: the real gradient arrives through the hand-off
            return [(conv, torch.zeros_like(conv)), (S, torch.zeros_like(S))]
        if self._root_grad is None:
            return []
        g = self._root_grad
        self._root_grad = None
        return [(conv, g[0].to(conv.dtype)), (S, g[1].to(S.dtype))]

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
