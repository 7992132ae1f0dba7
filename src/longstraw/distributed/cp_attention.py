"""Segment attention over a prompt K/V split by position across a context-parallel group.

The prompt state of a full-attention layer is sharded: each of the ``R`` ranks holds the post-RoPE K/V of its own
positions (:mod:`longstraw.distributed.cp_state`). A :class:`ShardedSegment` is this rank's share of that segment, a
:class:`~longstraw.ops.partitioned.PartitionedSegment`: when ``segment_attention`` meets one it hands the whole
call to its ``attention`` (:func:`cp_segment_attention`). Two modes:

Replicated queries (branch replay, rollout decoding, score): every rank runs the same tokens, so ``q`` is the same
everywhere. Forward: each rank attends ``q`` over its share, giving a partial ``(o_r, lse_r)``; the partials are
merged by log-sum-exp over the group with all-reduces (:func:`merge_all`: the maximum ``lse``, then the weighted
partials and their weights summed, so a rank holds one partial's size, not ``R``), then merged with the local
segments (the new tokens' own causal K/V, already generated tokens). Backward (ring-attention pattern): each rank
recomputes its share's probabilities against the GLOBAL lse and merged output, adds ``dK, dV`` of its positions into
its own gradient sinks (never communicated) and all-reduces the partial ``dq``. Per call: ``B T Hq (Dv + 2)``
all-reduced forward, ``B T Hq Dk`` backward; independent of the prompt length.

Distinct queries (one prefill step, and its recomputation in the exact reverse pass): rank ``r`` processes piece
``r`` of the step (positions right after piece ``r - 1``'s). Its queries need

* the stored prompt before the step, spread over all ranks: the queries are shipped, not the K/V, one piece at a
  time (:func:`merged_by_piece`): piece ``j``'s owner broadcasts its queries, every rank attends them over its share
  and the partials merge to the owner by log-sum-exp (:func:`merge_to`). Backward (:func:`reduced_by_piece`):
  ``(q, dO, O, lse)`` broadcast by the owner, every rank adds ``dK, dV`` of its stored positions into its sinks and
  the partial ``dq`` is reduced to the owner. A rank holds one piece's buffers (``T Hq (Dk + Dv + 2)``), never the
  step's ``R``.
* the earlier pieces of the same step, just computed on other ranks: their K/V are all-gathered
  (``R x T Hkv (Dk + Dv)``) and attended unmasked; in backward their ``dK, dV`` go back to the owners by all-to-all
  and join the owner's own causal K/V gradient inside the same backward (so later pieces' gradient reaches
  earlier pieces' parameters and state).

All ranks must make the same sequence of calls (lockstep); every exchange is a collective on the CP group, and
every decision to skip one depends only on values that are the same on all ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw.distributed.context import Comm
from longstraw.ops.attention import (KVSegment, default_backend, kernels, kv_blocks, merge_partials,
                                     segment_backward, segment_forward, sink_grad)
from longstraw.ops.partitioned import PartitionedSegment
from longstraw.ops.sinks import add_into
from longstraw.ops.window import window_matters

__all__ = ["StepPieces", "ShardedSegment", "cp_segment_attention", "piece_from", "merge_to", "merge_all",
           "merged_by_piece", "reduced_by_piece", "dense_step_bytes"]


@dataclass(frozen=True)
class StepPieces:
    """Distinct-query mode: the current step's pieces have ``lengths[j]`` tokens on rank ``j`` (consecutive
    positions, rank order); this rank's queries are piece ``rank``."""

    lengths: tuple[int, ...]
    rank: int

    @property
    def max_len(self) -> int:
        return max(self.lengths)


@dataclass
class ShardedSegment(KVSegment, PartitionedSegment):
    """This rank's share ``k [1, Hkv, S_local, Dk]``, ``v [1, Hkv, S_local, Dv]`` of a prompt K/V segment of
    ``global_length`` positions split over ``comm``'s ranks (sinks, if given, receive this share's ``dK, dV``).

    ``step``: None for replicated queries; the step's piece lengths for distinct queries (see module docstring).
    ``global_length == 0``: nothing is stored anywhere yet (first prefill step); only the step exchange runs.
    """

    comm: Comm | None = None
    step: StepPieces | None = None
    global_length: int = 0

    @property
    def key_count(self) -> int:
        """Keys counted alike on every rank: the stored prefix, plus in a prefill step every other piece of the
        step (with the queries' own piece: the step's end, the longest view any rank's queries have)."""
        if self.step is None:
            return self.global_length
        return self.global_length + sum(self.step.lengths) - self.step.lengths[self.step.rank]

    def group_shape(self, tokens: int) -> tuple[int, int]:
        """Replicated queries: ``(tokens, global_length)``; a prefill step: ``(the step's tokens, global_length)``
        (every rank's piece queries every rank's share: the step is one call of ``sum(lengths)`` queries)."""
        return (tokens if self.step is None else sum(self.step.lengths)), self.global_length

    def attention(self, q: Tensor, segments: list[KVSegment], scale: float, *, backend: str | None = None,
                  return_lse: bool = False, max_segment: int = 32768, window: int | None = None,
                  sinks: Tensor | None = None):
        # a sliding layer's state is not a share of every position (distributed/cp_window.py): a window here would
        # be a model whose state kind was not registered as sliding
        seen = self.global_length + (q.shape[2] if self.step is None else sum(self.step.lengths))
        if window_matters(seen - q.shape[2], q.shape[2], window):
            raise ValueError(f"sliding window={window} over a full-attention state split over processes "
                             f"({self.global_length} stored positions): a sliding layer's prompt state must be a "
                             "SlidingKVState (distributed/cp_window.py)")
        return cp_segment_attention(q, segments, scale, backend=backend, return_lse=return_lse,
                                    max_segment=max_segment, sinks=sinks)


@dataclass(frozen=True)
class _Plan:
    comm: Comm
    step: StepPieces | None
    global_length: int
    k_sink: Tensor | None
    v_sink: Tensor | None
    block: int  # the local share is attended in blocks of at most this many keys (bounded temporaries)
    host: bool = False  # the local share is in host memory (GRPOConfig.offload_state): each block is copied in

    def blocks(self, k: Tensor, v: Tensor, q: Tensor):
        """``(k, v, k_sink, v_sink)`` of consecutive blocks of the local share: views, or a host share's blocks
        copied to ``q``'s device (the next one's copy overlapping this one's kernels: ``ops.attention.kv_blocks``;
        drop each block before asking for the next)."""
        starts = range(0, k.shape[2], self.block)
        kv = kv_blocks([(k[:, :, a:a + self.block], v[:, :, a:a + self.block]) for a in starts],
                       [self.host] * len(starts), q)
        for a in starts:
            b = a + self.block
            sk = self.k_sink[:, :, a:b] if self.k_sink is not None else None
            sv = self.v_sink[:, :, a:b] if self.v_sink is not None else None
            kb, vb = next(kv)
            yield kb, vb, sk, sv
            del kb, vb


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def _pad_time(x: Tensor, length: int) -> Tensor:
    """Zero-pad axis 2 (time) of ``x [B, H, T, ...]`` to ``length``."""
    if x.shape[2] == length:
        return x.contiguous()
    pad = x.new_zeros(*x.shape[:2], length - x.shape[2], *x.shape[3:])
    return torch.cat([x, pad], dim=2)


def _partial(fwd, q: Tensor, k: Tensor, v: Tensor, plan: _Plan, scale: float) -> tuple[Tensor, Tensor]:
    """Unmasked attention of ``q`` over the local share ``(k, v)`` (block by block, merged); an empty share gives
    ``(0, -inf)``."""
    if k.shape[2] == 0:
        o = q.new_zeros(*q.shape[:3], v.shape[-1])
        return o, torch.full(q.shape[:3], float("-inf"), dtype=_lse_dtype(q), device=q.device)
    outs, lses = [], []
    for kb, vb, _, _ in plan.blocks(k, v, q):
        o, lse = segment_forward(fwd, q, kb, vb, False, scale)
        outs.append(o)
        lses.append(lse)
        del kb, vb  # before the next block: at most two on the device
    return merge_partials(outs, lses, q.dtype) if len(outs) > 1 else (outs[0], lses[0])


def _partial_bwd(bwd, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, plan: _Plan,
                 scale: float) -> Tensor:
    """Backward of :func:`_partial` against the global ``(o, lse)``: returns ``dq``; ``dK, dV`` go to the sinks."""
    dq = torch.zeros_like(q)
    for kb, vb, sk, sv in plan.blocks(k, v, q):
        dq_b, dk, dv = segment_backward(bwd, do, q, kb, vb, o, lse, False, scale)
        del kb, vb  # before the next block: at most two on the device
        dq = dq + dq_b
        if sk is not None:
            add_into(sk, dk)
            add_into(sv, dv)
    return dq


def _sharded_fwd(fwd, q: Tensor, k: Tensor, v: Tensor, plan: _Plan, scale: float) -> tuple[Tensor, Tensor]:
    comm, step = plan.comm, plan.step
    if step is None:  # replicated queries: partial over the local share, merged over the group
        o, lse = merge_all(comm, *_partial(fwd, q, k, v, plan, scale))
        return o.to(q.dtype), lse
    t = q.shape[2]
    o, lse = merged_by_piece(comm, [_pad_time(q, step.max_len)],
                             lambda qj: _partial(fwd, qj, k, v, plan, scale))  # [1, Hq, Tm, Dv], [1, Hq, Tm]
    return o[:, :, :t].to(q.dtype), lse[:, :, :t]


def _sharded_bwd(bwd, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: _Plan,
                 scale: float) -> Tensor:
    """The query gradient of the sharded segment (summed over ranks); this rank's ``dK, dV`` go to its sinks."""
    comm, step = plan.comm, plan.step
    if step is None:
        return comm.all_reduce(_partial_bwd(bwd, dout, q, k, v, out, lse, plan, scale).contiguous())
    t, tm = q.shape[2], step.max_len
    own = [_pad_time(x, tm) for x in (q, dout, out)] + [_pad_time(lse[..., None], tm)[..., 0]]
    dq = []
    reduced_by_piece(comm, own, lambda qj, doj, oj, lj: _partial_bwd(bwd, doj, qj, k, v, oj, lj, plan, scale),
                     lambda d: dq.append(d[:, :, :t]))  # padded rows: dO = 0, they add nothing
    return dq[0]


def piece_from(comm: Comm, j: int, mine: Tensor) -> Tensor:
    """Rank ``j``'s ``mine`` on every rank (every rank's ``mine`` has the same shape and dtype): a step's piece,
    broadcast by its owner. A prefill or reverse step's ``R`` pieces attend the stored prefix one at a time (every
    rank loops over the owners ``j`` in order): the owner broadcasts what the piece's queries need, every rank
    computes its partial over its share, and the partials merge to the owner (:func:`merge_to`); a rank holds one
    piece's buffers, never the step's ``R``."""
    return comm.broadcast(mine.contiguous() if comm.rank == j else torch.empty_like(mine), src=j)


def _weighted(comm: Comm, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """``(m, w o, w)``: the group's maximum ``m`` of ``lse`` (0 where no rank has a key) and this rank's weights
    ``w = exp(lse - m)``; the merge is ``(sum w o / sum w, m + log sum w)``."""
    m = comm.all_reduce_max(lse.clone())
    m = torch.where(torch.isinf(m), 0.0, m)
    w = torch.exp(lse - m)
    return m, o * w[..., None], w


def _merged(m: Tensor, ow: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    return ow / torch.where(s > 0, s, 1.0)[..., None], m + torch.log(s)  # no key: (0, -inf)


def merge_to(comm: Comm, j: int, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor] | None:
    """The log-sum-exp merge over the group of every rank's partial ``o [..., D]``, ``lse [...]`` (``-inf``: no
    key), as a list of partials merges in one process, delivered to rank ``j`` (None on the others; every rank calls
    it, in the same order): the group's maximum ``m`` of ``lse``, then the sums of ``w = exp(lse - m)`` and
    ``w o`` reduced to ``j``, where the merge is ``(sum w o / sum w, m + log sum w)`` in ``lse``'s dtype; a row that
    no rank covers stays ``(0, -inf)``."""
    m, ow, w = _weighted(comm, o, lse)
    ow = comm.reduce(ow, dst=j)
    s = comm.reduce(w, dst=j)
    return _merged(m, ow, s) if comm.rank == j else None


def merge_all(comm: Comm, o: Tensor, lse: Tensor) -> tuple[Tensor, Tensor]:
    """:func:`merge_to` delivered to every rank (all-reduces): replicated queries' partials over the shares, merged
    with one process's memory, ``o``'s size, where gathering every rank's partial would hold ``R`` of them (a DSA
    replay's sparse partials, ``R B T H (r + dr)`` float32, were 4.5 GiB per layer for GLM-5 on 32 ranks at 1,024
    tokens)."""
    m, ow, w = _weighted(comm, o, lse)
    return _merged(m, comm.all_reduce(ow), comm.all_reduce(w))


def merged_by_piece(comm: Comm, mine: Sequence[Tensor], partial: Callable[..., tuple[Tensor, Tensor]]
                    ) -> tuple[Tensor, Tensor]:
    """A step's pieces attend the shares one at a time: for each owner ``j`` in order (every rank loops), rank
    ``j``'s ``mine`` (its piece's queries and whatever else they need, padded to the step's common shape) is
    broadcast (:func:`piece_from`), ``partial(*pieces) -> (o, lse)`` attends them over this rank's share, and the
    partials merge to ``j`` (:func:`merge_to`). Returns this rank's own piece's merged ``(o, lse)``, padded like
    ``mine``. Between rounds nothing of a piece is kept."""
    mine_merged = None
    for j in range(comm.size):
        o, lse = partial(*(piece_from(comm, j, x) for x in mine))  # the broadcast copies die with the call
        merged = merge_to(comm, j, o, lse)
        o = lse = None
        if merged is not None:
            mine_merged = merged
        merged = None
    return mine_merged


def reduced_by_piece(comm: Comm, mine: Sequence[Tensor], partial_bwd: Callable[..., Tensor],
                     take: Callable[[Tensor], None]) -> None:
    """The backward of :func:`merged_by_piece`: for each owner ``j`` in order, rank ``j``'s ``mine`` (its piece's
    ``(q, dO, O, lse)``, ...) is broadcast, ``partial_bwd(*pieces) -> dq`` differentiates this rank's share's partial
    (its key/value gradients go to this rank's sinks) and the ``dq`` partials are summed on ``j``, which passes its
    own piece's sum (padded like ``mine``) to ``take`` at once: a caller that adds it into its ``dq`` holds no second
    one through the later rounds."""
    for j in range(comm.size):
        dqj = comm.reduce(partial_bwd(*(piece_from(comm, j, x) for x in mine)), dst=j)
        if j == comm.rank:
            take(dqj)
        dqj = None


def _gather_step(k: Tensor, v: Tensor, step: StepPieces, comm: Comm) -> tuple[Tensor, Tensor]:
    """The current step's pieces of K/V from every rank: ``[R, Hkv, Tm, D]`` each (padded)."""
    tm = step.max_len
    return comm.all_gather(_pad_time(k, tm)[0]), comm.all_gather(_pad_time(v, tm)[0])


def _earlier(ks: Tensor, step: StepPieces) -> Tensor | None:
    """Concatenate the pieces of ranks before this one: ``[1, H, sum_{j<rank} T_j, D]`` or None."""
    parts = [ks[j : j + 1, :, : step.lengths[j]] for j in range(step.rank)]
    return torch.cat(parts, dim=2) if parts else None


class _CPAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, sink, scale, backend, plan: _Plan, meta, causal_idx, ks, vs, *kv):
        fwd, _ = kernels(backend)
        outs, lses = [], []
        if plan.global_length > 0:
            o, lse = _sharded_fwd(fwd, q, ks, vs, plan, scale)
            outs.append(o)
            lses.append(lse)
        ek = ev = None
        if plan.step is not None:
            gk, gv = _gather_step(kv[2 * causal_idx], kv[2 * causal_idx + 1], plan.step, plan.comm)
            ek, ev = _earlier(gk, plan.step), _earlier(gv, plan.step)
            if ek is not None:
                o, lse = segment_forward(fwd, q, ek, ev, False, scale)
                outs.append(o)
                lses.append(lse)
        blocks = kv_blocks([(kv[2 * i], kv[2 * i + 1]) for i in range(len(meta))], [m[3] for m in meta], q)
        for causal, _, _, _ in meta:
            k, v = next(blocks)
            o, lse = segment_forward(fwd, q, k, v, causal, scale)
            del k, v
            outs.append(o)
            lses.append(lse)
        out, lse = merge_partials(outs, lses, q.dtype, sink)  # the sinks join once, after every share's partial
        extra = [ek, ev] if ek is not None else []
        ctx.save_for_backward(q, out, lse, sink, ks, vs, *extra, *kv)
        ctx.scale, ctx.backend, ctx.plan, ctx.meta, ctx.causal_idx = scale, backend, plan, meta, causal_idx
        ctx.has_earlier = ek is not None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, sink, ks, vs, *rest = ctx.saved_tensors
        if ctx.has_earlier:
            ek, ev, *kv = rest
        else:
            ek = ev = None
            kv = rest
        plan, scale = ctx.plan, ctx.scale
        _, bwd = kernels(ctx.backend)
        dout = dout.contiguous()
        # the sinks' gradient from this rank's queries (replicated queries: the same on every rank, as every
        # parameter's replay gradient; a step's pieces: this rank's share, summed by the reverse pass's scope)
        d_sink = sink_grad(dout, out, lse, sink) if sink is not None and ctx.needs_input_grad[1] else None
        dq = torch.zeros_like(q)
        grads: list[Tensor | None] = []
        blocks = kv_blocks([(kv[2 * i], kv[2 * i + 1]) for i in range(len(ctx.meta))], [m[3] for m in ctx.meta], q)
        for causal, k_sink, v_sink, _ in ctx.meta:
            k, v = next(blocks)
            dq_i, dk, dv = segment_backward(bwd, dout, q, k, v, out, lse, causal, scale)
            del k, v
            dq = dq + dq_i
            grads += [dk, dv]
        if plan.step is not None:  # earlier pieces of this step: their dK, dV go back to their owners
            step, tm = plan.step, plan.step.max_len
            k_own, v_own = kv[2 * ctx.causal_idx], kv[2 * ctx.causal_idx + 1]
            send_k = k_own.new_zeros(plan.comm.size, k_own.shape[1], tm, k_own.shape[3])
            send_v = v_own.new_zeros(plan.comm.size, v_own.shape[1], tm, v_own.shape[3])
            if ek is not None:
                dq_e, dk_e, dv_e = segment_backward(bwd, dout, q, ek, ev, out, lse, False, scale)
                dq = dq + dq_e
                for j, (a, b) in enumerate(zip(dk_e[0].split(step.lengths[: step.rank], 1),
                                               dv_e[0].split(step.lengths[: step.rank], 1))):
                    send_k[j, :, : step.lengths[j]] = a
                    send_v[j, :, : step.lengths[j]] = b
            t = k_own.shape[2]
            rk = plan.comm.all_to_all(send_k).sum(0)[None, :, :t]
            rv = plan.comm.all_to_all(send_v).sum(0)[None, :, :t]
            i = 2 * ctx.causal_idx
            grads[i] = rk if grads[i] is None else grads[i] + rk
            grads[i + 1] = rv if grads[i + 1] is None else grads[i + 1] + rv
        if plan.global_length > 0:
            dq = dq + _sharded_bwd(bwd, dout, q, ks, vs, out, lse, plan, scale)
        for idx, (_, k_sink, v_sink, _) in enumerate(ctx.meta):
            if k_sink is not None:
                add_into(k_sink, grads[2 * idx])
                add_into(v_sink, grads[2 * idx + 1])
                grads[2 * idx] = grads[2 * idx + 1] = None
        return (dq, d_sink, None, None, None, None, None, None, None, *grads)


def cp_segment_attention(q: Tensor, segments: list[KVSegment], scale: float, *, backend: str | None = None,
                         return_lse: bool = False, max_segment: int = 32768, sinks: Tensor | None = None):
    """``segment_attention`` when one of ``segments`` is a :class:`ShardedSegment` (same signature and result;
    the local share is attended in blocks of ``max_segment`` keys, as ``segment_attention`` does). ``sinks [Hq]``
    (GPT-OSS) join the softmax once, after the group's partials are merged: every rank's merged output and LSE
    then include them, so each share's backward against them is the single process's.

    q ``[B, Hq, T, Dk]``; exactly one sharded segment; the others are local (replicated on every rank). In
    distinct-query mode ``B == 1`` and the only local segment is the queries' own causal piece.
    """
    sharded = [s for s in segments if isinstance(s, ShardedSegment)]
    if len(sharded) != 1:
        raise ValueError(f"context-parallel attention takes exactly one sharded segment, got {len(sharded)}")
    sh = sharded[0]
    local = [s for s in segments if not isinstance(s, ShardedSegment) and s.length > 0]
    b, hq, t, d = q.shape
    if sh.global_length > 0:
        assert sh.k.shape[0] == 1 and hq % sh.k.shape[1] == 0 and sh.k.shape[-1] == d
    for s in local:
        assert s.k.shape[0] in (1, b) and hq % s.k.shape[1] == 0 and s.k.shape[-1] == d
        assert (s.k_grad is None) == (s.v_grad is None)
        if s.causal:
            assert s.length == t and s.k.shape[0] == b, "a causal segment holds the queries' own tokens"
    causal_idx = -1
    if sh.step is not None:
        assert b == 1 and len(local) == 1 and local[0].causal, "a prefill step attends its stored prefix and itself"
        assert sh.step.lengths[sh.step.rank] == t, (sh.step, t)
        causal_idx = 0
    if not local and sh.global_length == 0:
        raise ValueError("segment_attention needs at least one non-empty key/value segment")
    if backend is None:
        dv = sh.v.shape[-1] if sh.global_length > 0 else local[0].v.shape[-1]
        backend = default_backend(q, max(d, dv))
    kernels(backend)  # ValueError for an unknown one
    if not (isinstance(max_segment, int) and max_segment >= 1):
        raise ValueError(f"max_segment={max_segment!r} must be an integer >= 1")
    plan = _Plan(sh.comm, sh.step, sh.global_length, sh.k_grad, sh.v_grad, max_segment, sh.host)
    meta = tuple((s.causal, s.k_grad, s.v_grad, s.host) for s in local)
    kv = []
    for s in local:
        kv += [s.k.detach(), s.v.detach()] if s.k_grad is not None else [s.k, s.v]
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be [Hq={hq}] (one logit per query head), got shape {tuple(sinks.shape)}")
    out, lse = _CPAttention.apply(q.contiguous(), sinks, float(scale), backend, plan, meta, causal_idx,
                                  sh.k.detach(), sh.v.detach(), *kv)
    return (out, lse) if return_lse else out


def dense_step_bytes(heads: int, kv_heads: int, dk: int, dv: int, cp: int, piece: int, dtype: torch.dtype,
                     grad: bool) -> tuple[int, int]:
    """What a CP prefill step of :class:`_CPAttention` allocates per rank beyond one process's chunk of ``piece``
    tokens (``grad``: a reverse-pass step), by formula (the planner's dry run runs one process): ``(peak, saved)``,
    ``saved`` being what the layer's graph keeps for its backward. ``n = piece`` rows of ``H = heads`` query heads,
    ``N = cp x piece``, ``b`` bytes of ``dtype``, ``a`` of the float32 accumulators.

    Forward, one piece at a time: a round's broadcast queries ``n H dk b`` and this rank's partial ``n H (dv b +
    a)``, or, while it merges, the partial, its weights and the weighted sum reduced to the owner (``2 n H dv a``,
    ``3 n H a``), beside this rank's merged result (``n H (dv b + a)``); the step's K/V all-gathered, ``N Hkv (dk +
    dv) b``, of which the earlier pieces' are kept for the backward (``(R - 1) n Hkv (dk + dv) b``). Backward: a
    round's broadcast ``(q, dO, O, lse)``, ``n H ((dk + 2 dv) b + a)``, and partial ``dq`` ``n H dk b``; the earlier
    pieces' ``dK, dV`` on their way back to their owners with the exchange's result, ``2 N Hkv (dk + dv) b``.
    Per block of the local share the kernels' transients are one process's (the same blocking)."""
    b = torch.empty(0, dtype=dtype).element_size()
    a = 8 if dtype == torch.float64 else 4
    n, h = cp * piece, heads
    kv = n * kv_heads * (dk + dv) * b
    saved = (cp - 1) * piece * kv_heads * (dk + dv) * b
    own = piece * h * (dv * b + a)
    fwd = kv + own + max(piece * h * dk * b + own, own + 2 * piece * h * dv * a + 3 * piece * h * a)
    if not grad:
        return fwd, 0
    bwd = saved + 2 * kv + piece * h * ((dk + 2 * dv) * b + a) + piece * h * dk * b
    return max(fwd, bwd), saved
