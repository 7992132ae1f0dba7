"""Sliding-window layers under context parallelism: a replicated tail state and a halo exchange.

A sliding layer of window ``W`` (Gemma 3, GPT-OSS, OLMo 3, Mistral, ...) reads at most the ``W - 1`` positions
before a query, so it needs none of the position-sharded machinery of full attention (``cp_attention.py``):

* **State, replicated.** After each layout step (``R`` pieces, positions ``[S, E)``) every rank keeps the step's
  *tail* ``[max(S, E - W + 1), E)``, gathered from the ranks whose pieces it overlaps (``W - 1`` positions, one
  ``all_gather`` per layer and step), in a :class:`~longstraw.state.SlidingKVState` in global positions: exactly
  what one process keeps for a prefill whose steps are the layout's. Detached mode keeps about ``W`` positions,
  exact mode every step's tail; both the same on every rank.
* **A prefill step** (rank ``r``'s piece ``[S_r, E_r)``, distinct queries): its window reaches back
  ``W - 1`` positions, into the earlier pieces of the same step (being computed on ranks ``< r`` right now) and,
  where those are short, into the stored tails. Every rank contributes its piece's last ``min(len, W - 1)``
  positions to one ``all_gather`` (the *halo*: ``R x (W - 1)`` positions, not the ``R x chunk`` of a full layer's
  step exchange); rank ``r`` attends the contiguous run of halo pieces that ends at ``S_r`` (and the stored tail
  before ``S`` where the run reaches it) plus its own keys, with the single-process windowed op
  (``ops/window.py``). Backward: each rank's gradient of the halo pieces goes back to their owners by
  ``all_to_all`` and joins their own K/V gradient.
* **Replay, decoding, score** (replicated queries): the tail is on every rank, so the attention is local and the
  same everywhere, like the rest of a replicated branch.

Exact gradients. The stored tails' gradient sinks are *partial* on each rank and summed when the reverse pass
reaches the step that wrote them (:meth:`ShardedSlidingState.backward_roots`: one ``all_reduce`` of ``W - 1``
positions per layer and step): a step's own queries add their share on their rank (distinct queries), and the
replay, which every rank runs alike, adds on CP rank 0 only. Every contribution to a tail comes from later steps or
the replay, which the reverse pass has finished before it reaches the step, so the sum is complete when it is read.
Each rank then seeds its own piece's part of the tail (or a zero seed, so that every rank walks its step's graph:
the halo's backward is a collective).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw.distributed.context import Comm
from longstraw.distributed.cp_attention import StepPieces, _pad_time
from longstraw.distributed.cp_state import PositionShardedState, ShardLayout
from longstraw.ops.attention import KVSegment, segment_attention
from longstraw.ops.partitioned import PartitionedSegment
from longstraw.ops.sinks import read_summed
from longstraw.state import KVDecoder, SlidingKVState

__all__ = ["ShardedSlidingState", "HaloSegment", "halo_tails"]


def halo_tails(lengths: tuple[int, ...], window: int) -> list[int]:
    """How many of each piece's last positions the later pieces of a step can see: ``min(len, W - 1)``."""
    return [min(n, window - 1) for n in lengths]


class _Halo(torch.autograd.Function):
    """Every rank's piece tail ``[1, Hkv, m_r, D]`` (padded to ``tm``) on every rank: ``[R, Hkv, tm, D]``. Backward:
    block ``j`` of the gradient goes to rank ``j`` (``all_to_all``), which sums what every rank sent it."""

    @staticmethod
    def forward(ctx, k, v, comm: Comm, tm: int):
        ctx.comm, ctx.m = comm, k.shape[2]
        return comm.all_gather(_pad_time(k, tm)[0]), comm.all_gather(_pad_time(v, tm)[0])

    @staticmethod
    def backward(ctx, gk, gv):
        m = ctx.m
        dk = ctx.comm.all_to_all(gk).sum(0)[None, :, :m]
        dv = ctx.comm.all_to_all(gv).sum(0)[None, :, :m]
        return dk, dv, None, None


class _Tie(torch.autograd.Function):
    """Identity on the attention output; its backward also sends zeros to the halo, so that the halo's backward (a
    collective) runs on every rank whose output gets a gradient, whether or not this rank attended any of it (rank
    0 never does)."""

    @staticmethod
    def forward(ctx, out, gk, gv):
        ctx.shapes = (gk.shape, gk.dtype, gv.shape, gv.dtype, gk.device)
        return out.view_as(out)

    @staticmethod
    def backward(ctx, dout):
        sk, dk, sv, dv, device = ctx.shapes
        return dout, torch.zeros(sk, dtype=dk, device=device), torch.zeros(sv, dtype=dv, device=device)


@dataclass
class HaloSegment(PartitionedSegment):
    """What a sliding layer's queries of rank ``step.rank``'s piece in a prefill (or reverse-pass) step attend
    besides their own keys: ``stored`` (the replicated tails before the step's start ``start``, views, with this
    rank's sinks in the reverse pass) and the earlier pieces of the step, exchanged in :meth:`attention` (a
    collective: every rank of the group calls it for the same layer, in the same order)."""

    stored: list[KVSegment]
    comm: Comm
    step: StepPieces
    window: int
    start: int

    @property
    def key_count(self) -> int:
        """Positions before the step plus the step's other pieces (as ``ShardedSegment`` counts a step)."""
        return self.start + sum(self.step.lengths) - self.step.lengths[self.step.rank]

    def attention(self, q: Tensor, segments: list[KVSegment], scale: float, *, backend: str | None = None,
                  return_lse: bool = False, max_segment: int = 32768, window: int | None = None,
                  sinks: Tensor | None = None):
        """Sliding-window attention of this rank's piece ``q [1, Hq, T, Dk]`` over the stored tails, the step's
        earlier pieces (the halo) and its own causal keys ``segments[-1]``."""
        own = segments[-1]
        if window != self.window or len(segments) != 2 or segments[0] is not self or not own.causal:
            raise ValueError(f"a sliding layer's prefill step attends its own keys after the stored tails with its "
                             f"window ({self.window}); got window={window} and {len(segments)} segments")
        lengths, r = self.step.lengths, self.step.rank
        tails = halo_tails(lengths, self.window)
        t, m = own.k.shape[2], tails[r]
        assert t == lengths[r], (t, lengths, r)
        gk, gv = _Halo.apply(own.k[:, :, t - m :], own.v[:, :, t - m :], self.comm, max(tails))  # [R, Hkv, tm, D]
        segs: list[KVSegment] = []
        for j in range(r - 1, -1, -1):  # the run of earlier pieces that ends at this piece, as far as W reaches
            segs.insert(0, KVSegment(gk[j : j + 1, :, : tails[j]], gv[j : j + 1, :, : tails[j]]))
            if tails[j] < lengths[j]:  # this piece alone holds the W - 1 positions before the next one
                break
        else:  # every earlier piece is whole: the window may reach into the stored tails
            segs = list(self.stored) + segs
        out, lse = segment_attention(q, segs + [own], scale, backend=backend, return_lse=True,
                                     max_segment=max_segment, window=window, sinks=sinks)
        if torch.is_grad_enabled() and gk.requires_grad:
            out = _Tie.apply(out, gk, gv)
        return (out, lse) if return_lse else out


class ShardedSlidingState(PositionShardedState):
    """A sliding layer's prompt state under CP (see the module docstring): ``local``, a
    :class:`~longstraw.state.SlidingKVState` in global positions holding each layout step's tail, the same on every
    rank (not a share of the positions: its ``write`` and ``backward_roots`` are its own, the gradient buffers and
    byte counts :class:`~longstraw.distributed.cp_state.PositionShardedState`'s). Speaks the
    :class:`~longstraw.distributed.cp_state.ShardedLayerState` protocol: ``write`` (a collective), ``step_prefix``,
    ``prefix``, ``backward_roots`` (a collective in exact mode)."""

    def __init__(self, local: SlidingKVState, layout: ShardLayout, comm: Comm):
        super().__init__(local, layout, comm)
        self.window = local.window

    def _tail(self, step: int) -> tuple[int, int]:
        """Global range ``[max(S, E - W + 1), E)`` of step ``step``'s tail."""
        pieces = self.layout.steps[step]
        s, e = pieces[0][0], pieces[-1][1]
        return max(s, e - self.window + 1), e

    def write(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> None:
        """Store step ``k``'s tail on every rank: each rank sends its piece's overlap with it (one all-gather)."""
        step = self.layout.step_of(self.rank, start, end)
        lo, e = self._tail(step)
        spans = [(max(a, lo), b) for a, b in self.layout.steps[step]]
        n = [max(0, b - a) for a, b in spans]
        k, v = (x.detach() for x in piece)  # [1, Hkv, T, D]
        mine = slice(spans[self.rank][0] - start, None) if n[self.rank] else slice(0, 0)
        tm = max(n)
        gk = self.comm.all_gather(_pad_time(k[:, :, mine], tm)[0])  # [R, Hkv, tm, D]
        gv = self.comm.all_gather(_pad_time(v[:, :, mine], tm)[0])
        parts = [j for j in range(len(n)) if n[j]]
        tail_k = torch.cat([gk[j : j + 1, :, : n[j]] for j in parts], dim=2)
        tail_v = torch.cat([gv[j : j + 1, :, : n[j]] for j in parts], dim=2)
        self.local.write((tail_k, tail_v), lo, e)
        self.length = max(self.length, e)

    def step_prefix(self, step: int, grad: bool) -> list[HaloSegment]:
        """For this rank's piece of step ``step``: the stored tails before the step (this rank's partial sinks in
        the reverse pass) and the step's piece lengths (the halo is exchanged inside the attention call)."""
        s = self.layout.step_start(step)
        stored = self.local.prefix(s, grad) if s > 0 else []
        return [HaloSegment(stored, self.comm, StepPieces(self.layout.step_lengths(step), self.rank), self.window,
                            s)]

    def prefix(self, length: int, grad: bool) -> list[KVSegment]:
        """For tokens every rank runs alike after the first ``length`` positions: the local tails. Their gradient
        (exact mode) is collected on CP rank 0 only: the ranks' partial sinks are summed in the reverse pass."""
        return self.local.prefix(length, grad and self.rank == 0) if length > 0 else []

    def backward_roots(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        """Sum the ranks' partial gradients of step ``k``'s tail (every rank, in layer order), then seed this rank's
        piece with its part of it; a piece outside the tail gets a zero seed."""
        k, v = piece
        step = self.layout.step_of(self.rank, start, end)
        lo, e = self._tail(step)
        tail = next((t for t in self.local.tails if t.start == lo and t.end == e), None)
        if tail is None or tail.k_grad is None:
            raise RuntimeError(f"the tail [{lo}, {e}) of a sliding layer has no gradient sink: the exact reverse "
                               "pass needs a state built with exact=True and enable_grad() called")
        gk, gv = read_summed([tail.k_grad, tail.v_grad], [k, v], self.comm.all_reduce)  # one all-reduce
        a = max(start, lo)
        if a >= end:
            return [(k, torch.zeros_like(k)), (v, torch.zeros_like(v))]
        mine = slice(a - lo, end - lo)
        return [(k[:, :, a - start :], gk[:, :, mine]), (v[:, :, a - start :], gv[:, :, mine])]

    def decoder(self, batch: int, max_new: int) -> KVDecoder:
        return KVDecoder(self, batch, max_new)  # reads prefix(length): the local tails
