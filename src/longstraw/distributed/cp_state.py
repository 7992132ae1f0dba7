"""The prompt state split by position over a context-parallel group, and the per-state-kind registry.

Layout (:class:`ShardLayout`): the ``n`` prefilled positions are cut into ``K`` steps of consecutive positions
(about ``R x prefill_chunk`` each) and every step into ``R`` consecutive pieces, piece ``r`` for rank ``r``
(block-cyclic). In step ``k`` all ranks process their pieces at once, in lockstep: a piece's queries see the stored
positions of steps ``< k`` (spread evenly over all ranks, so attention work is balanced) and the earlier pieces of
step ``k`` (just computed on lower ranks). Rank ``r`` keeps the state of its ``K`` pieces, in position order, in
one local buffer: ``~n / R`` positions, differing by at most ``K`` between ranks.

A sharded layer state wraps the single-process state of its kind, sized for the local positions, and speaks the
same :class:`~longstraw.state.LayerState` protocol in GLOBAL positions, plus ``step_prefix(k, grad)`` (what the
mixer consumes for this rank's piece of step ``k``). Kinds plug in through :func:`register_cp_kind`
(docs/DISTRIBUTED.md lists the contract); ``KVState`` (full attention) is implemented here, ``SlidingKVState`` (a
sliding window: replicated tails, not sharded) in ``cp_window.py``, the others beside their ops (registered by
``longstraw.distributed``).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch import Tensor

from longstraw.distributed.context import Comm
from longstraw.distributed.cp_attention import ShardedSegment, StepPieces
from longstraw.distributed.expert_parallel import ep_param_ids, set_ep_divide_factor
from longstraw.distributed.fsdp import fsdp_modules, is_sharded
from longstraw.state import KVDecoder, KVState, LayerState, PromptState

__all__ = ["ShardLayout", "shard_layout", "PositionShardedState", "ShardedKVState", "ShardedPromptState", "ShardedLayerState",
           "register_cp_kind", "shard_states"]


def _split(start: int, end: int, parts: int) -> list[tuple[int, int]]:
    """``[start, end)`` cut into ``parts`` consecutive ranges whose lengths differ by at most one."""
    n = end - start
    bounds = [start + (n * i) // parts for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


@dataclass(frozen=True)
class ShardLayout:
    """``steps[k][r] = (start, end)``: the global positions rank ``r`` processes and stores in step ``k``."""

    length: int
    world: int
    steps: tuple[tuple[tuple[int, int], ...], ...]

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def piece(self, step: int, rank: int) -> tuple[int, int]:
        return self.steps[step][rank]

    def step_start(self, step: int) -> int:
        return self.steps[step][0][0]

    def step_bounds(self) -> list[tuple[int, int]]:
        """``(start, end)`` global positions of each step (all ranks' pieces together), in order."""
        return [(st[0][0], st[-1][1]) for st in self.steps]

    def step_lengths(self, step: int) -> tuple[int, ...]:
        return tuple(e - s for s, e in self.steps[step])

    def pieces(self, rank: int) -> list[tuple[int, int]]:
        return [st[rank] for st in self.steps]

    def step_of(self, rank: int, start: int, end: int | None = None) -> int:
        """The step whose piece of rank ``rank`` starts at global position ``start`` (and ends at ``end``, if
        given); ValueError if none does."""
        for k, (s, e) in enumerate(self.pieces(rank)):
            if s == start and end in (None, e):
                return k
        raise ValueError(f"[{start}, {end}) is not a piece of rank {rank}; its pieces: {self.pieces(rank)}")

    def local_size(self, rank: int) -> int:
        return sum(e - s for s, e in self.pieces(rank))

    def local_offset(self, rank: int, step: int) -> int:
        """Local buffer offset of rank ``rank``'s piece of step ``step`` (= its positions in earlier steps)."""
        return sum(e - s for s, e in self.pieces(rank)[:step])

    def local_len(self, rank: int, global_len: int) -> int:
        """How many of rank ``rank``'s positions lie in ``[0, global_len)`` (they are a prefix of its buffer)."""
        return sum(max(0, min(e, global_len) - s) for s, e in self.pieces(rank))

    def to_local(self, rank: int, start: int, end: int) -> tuple[int, int]:
        """Local range of the piece ``[start, end)`` of rank ``rank``; ValueError if it is not one of its pieces."""
        lo = self.local_offset(rank, self.step_of(rank, start, end))
        return lo, lo + end - start


def shard_layout(length: int, world: int, chunk: int) -> ShardLayout:
    """Split ``length`` prefilled positions over ``world`` ranks in steps of about ``world x chunk`` positions.

    ValueError if ``length < world`` (some rank would hold nothing). Steps are balanced and hold at least
    ``world`` positions each, so every piece holds at least one and at most ``chunk`` positions (two when
    ``chunk == 1`` and ``length`` is not a multiple of ``world``).
    """
    if length < world:
        raise ValueError(f"the prompt is too short to shard: {length} prefilled positions (the prompt without its "
                         f"last token) over cp={world} ranks; context parallelism needs at least {world} "
                         f"(a prompt of >= {world + 1} tokens), or run it on one rank")
    if chunk < 1:
        raise ValueError(f"prefill_chunk={chunk} must be >= 1")
    num = max(1, min(math.ceil(length / (world * chunk)), length // world))
    steps = tuple(tuple(_split(s, e, world)) for s, e in _split(0, length, num))
    return ShardLayout(length, world, steps)


class ShardedLayerState(LayerState, Protocol):
    """A layer state split over the CP group: the LayerState protocol in global positions, plus ``step_prefix``.

    ``step_prefix(k, grad)``: what the mixer consumes for this rank's piece of step ``k`` (prefill: ``grad=False``;
    exact reverse pass: ``grad=True``). ``write`` and ``step_prefix`` may run collectives: every rank calls them in
    layer order. ``backward_roots`` must be non-empty on every rank when it is on any (zero seeds are fine). What a
    kind's prefixes do inside the mixers goes through the typed interfaces the models already read: a
    :class:`~longstraw.ops.partitioned.PartitionedSegment` (stored keys), or a recurrent prefix's ``enter`` /
    ``window`` / ``recur`` / ``leave`` (the DeltaNet state scan).
    """

    length: int

    def step_prefix(self, step: int, grad: bool) -> Any: ...


_EMPTY = torch.empty(1, 0, 0, 0)


class PositionShardedState:
    """What every state kind sharded by position shares: ``local`` (the single-process state of the kind, sized
    for this rank's positions, in position order), the layout, and ``length`` (the global positions of the steps
    written so far: every rank writes its piece of each step). Storing, backward seeds, gradient buffers and byte
    counts delegate to ``local`` after mapping the piece's global range to its local one."""

    keeps_step_graphs = True  # prompt-step graphs can be kept (ContextParallel.check_kept_graphs)

    def __init__(self, local: Any, layout: ShardLayout, comm: Comm):
        self.local, self.layout, self.comm = local, layout, comm
        self.rank = comm.rank
        self.length = 0

    def write(self, piece: Any, start: int, end: int) -> None:
        lo, hi = self.layout.to_local(self.rank, start, end)
        self.local.write(piece, lo, hi)
        step = self.layout.step_of(self.rank, start)
        self.length = max(self.length, self.layout.steps[step][-1][1])  # every rank writes its piece of a step

    def backward_roots(self, piece: Any, start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        lo, hi = self.layout.to_local(self.rank, start, end)
        return self.local.backward_roots(piece, lo, hi)

    def enable_grad(self, dtype: torch.dtype | None = None, offload: bool = False) -> None:
        self.local.enable_grad(dtype, offload)

    def release_grad(self) -> None:
        self.local.release_grad()

    def nbytes(self) -> int:
        return self.local.nbytes()

    def grad_nbytes(self) -> int:
        return self.local.grad_nbytes()

    def grad_host_nbytes(self) -> int:
        return self.local.grad_host_nbytes()

    def offload(self) -> None:
        if hasattr(self.local, "offload"):
            self.local.offload()

    def host_nbytes(self) -> int:
        return self.local.host_nbytes() if hasattr(self.local, "host_nbytes") else 0


class ShardedKVState(PositionShardedState):
    """Full attention, sharded: ``local`` (a :class:`KVState` for this rank's positions, in position order) holds
    the post-RoPE ``k [1, Hkv, n_local, Dk]`` / ``v [1, Hkv, n_local, Dv]`` of rank ``rank``'s pieces; its
    gradient buffers (exact mode) are this rank's sinks. ``length``: the global positions of the steps written so
    far (every rank writes its piece of each step)."""

    def _segment(self, local_len: int, global_len: int, grad: bool, step: StepPieces | None) -> ShardedSegment:
        st = self.local
        if st.k is None:
            k = v = _EMPTY
            kg = vg = None
        else:
            k, v = st.k[:, :, :local_len], st.v[:, :, :local_len]
            kg = st.k_grad[:, :, :local_len] if grad and st.k_grad is not None else None
            vg = st.v_grad[:, :, :local_len] if grad and st.v_grad is not None else None
        return ShardedSegment(k, v, k_grad=kg, v_grad=vg, host=st.home is not None, comm=self.comm, step=step,
                              global_length=global_len)

    def step_prefix(self, step: int, grad: bool) -> list[ShardedSegment]:
        """For this rank's piece of step ``step``: the stored positions before the step (this rank's share) and
        the step's piece lengths (the earlier pieces are exchanged inside the attention call)."""
        g = self.layout.step_start(step)
        pieces = StepPieces(self.layout.step_lengths(step), self.rank)
        return [self._segment(self.layout.local_len(self.rank, g), g, grad, pieces)]

    def prefix(self, length: int, grad: bool) -> list[ShardedSegment]:
        """For tokens run on every rank after the first ``length`` positions (replay, decoding, score)."""
        if length == 0:
            return []
        assert length <= self.length
        return [self._segment(self.layout.local_len(self.rank, length), length, grad, None)]

    def decoder(self, batch: int, max_new: int) -> KVDecoder:
        return KVDecoder(self, batch, max_new)  # reads prefix(length): this rank's share, merged over the group


@dataclass
class ShardedPromptState(PromptState):
    """A :class:`PromptState` whose layers are sharded over ``comm``'s ranks by ``layout``; ``chunks`` are this
    rank's pieces (global positions, one per step) and ``token_ids`` the whole prefilled prompt (every rank has it).

    Its schedule: step ``k`` is this rank's piece of layout step ``k``; every rank walks all ``K`` steps in lockstep
    (prefill forwards, the reverse pass backwards), and the layers' ``step_prefix(k, grad)`` give the mixers the
    sharded prefixes whose calls exchange what the step needs.

    Parameter gradients of the reverse pass (:meth:`backward_scope`). The replay is redundant: every rank computes
    the same branch gradient ``B``. The reverse pass is rank-local: rank ``r`` computes ``P_r`` from its pieces, and
    ``.grad`` must become ``G0 + B + sum_r P_r`` (``G0``: whatever ``.grad`` held before, e.g. earlier groups).
    Unsharded parameters: the reverse pass accumulates into fresh ``.grad`` tensors (the old ones set aside: one
    gradient-sized buffer more while it runs; under FSDP2 only the parameters FSDP does not shard), which are
    all-reduced over the CP group and added to the old ones. (Pre-dividing the old ``.grad`` by ``R`` and
    all-reducing the sum would need no buffer, and is exact only for power-of-two ``R``.) FSDP2-sharded parameters
    (sharded over the whole job, ``replicas`` data-parallel replicas of ``R`` ranks): FSDP reduce-scatters after every
    backward; the replay keeps the mean over every rank (``B`` of each replica counted ``R`` times), the reverse pass
    divides by ``replicas`` only (each ``P_r`` counted once): both give the mean over replicas.
    """

    layout: ShardLayout | None = None
    comm: Comm | None = None
    replicas: int = 1  # data-parallel replicas that FSDP reduces over (the reverse pass divides by them)

    def step_prefix(self, step: int, grad: bool) -> list[Any]:
        return [ls.step_prefix(step, grad) for ls in self.layers]

    @contextlib.contextmanager
    def backward_scope(self, model: torch.nn.Module) -> Iterator[None]:
        comm = self.comm
        ep_ids = ep_param_ids(model)  # expert-parallel experts: reduced in their own backward (expert_parallel.py)
        params = [p for p in model.parameters() if p.requires_grad and id(p) not in ep_ids]
        plain = [p for p in params if not is_sharded(p)]
        before = [p.grad for p in plain]
        for p in plain:
            p.grad = None  # the reverse pass accumulates P_r alone; summed over the group below
        fsdp = fsdp_modules(model)
        for m in fsdp:  # rank-local gradients: summed over the CP group, averaged over the replicas
            m.set_gradient_divide_factor(float(self.replicas))
        set_ep_divide_factor(model, self.replicas)
        try:
            yield
        finally:
            for m in fsdp:  # back to the replay's: the mean over every rank of the job (distributed/fsdp.py)
                m.set_gradient_divide_factor(float(comm.size * self.replicas))
            set_ep_divide_factor(model, comm.size * self.replicas)
        # which parameters the prompt reached on any rank (LM head and final norm: on none); then sum those
        device = plain[0].device if plain else torch.device("cpu")
        reached = torch.tensor([p.grad is not None for p in plain], dtype=torch.int32, device=device)
        comm.all_reduce(reached)
        for p, old, hit in zip(plain, before, reached.tolist()):
            if not hit:
                p.grad = old
                continue
            g = p.grad if p.grad is not None else torch.zeros_like(p)
            comm.all_reduce(g)
            p.grad = g if old is None else old.add_(g)


_KINDS: dict[type, Callable[[Any, ShardLayout, Comm], Any]] = {KVState: ShardedKVState}


def register_cp_kind(state_type: type, factory: Callable[[Any, ShardLayout, Comm], Any]) -> None:
    """Make layers whose prompt state is ``state_type`` context-parallel: ``factory(local_state, layout, comm)``
    returns a :class:`ShardedLayerState` around a fresh single-process state sized for the local positions."""
    _KINDS[state_type] = factory


def kind_of(state: Any) -> Callable[[Any, ShardLayout, Comm], Any] | None:
    """The context-parallel factory registered for ``state``'s type (None if none is)."""
    return _KINDS.get(type(state))


def shard_states(states: list[Any], layout: ShardLayout, comm: Comm) -> list[Any]:
    """Wrap each layer's fresh local state in its kind's sharded state; ValueError for a kind not registered."""
    out = []
    for i, st in enumerate(states):
        factory = kind_of(st)
        if factory is None:
            raise ValueError(f"layer {i} keeps a {type(st).__name__} prompt state, which has no context-parallel "
                             f"twin; supported kinds: {', '.join(sorted(t.__name__ for t in _KINDS))} "
                             "(see docs/DISTRIBUTED.md, 'Prompt-state kinds: the interface')")
        out.append(factory(st, layout, comm))
    return out
