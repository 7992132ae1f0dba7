"""Segment attention over a prompt K/V split by position across a context-parallel group.

The prompt state of a full-attention layer is sharded: each of the ``R`` ranks holds the post-RoPE K/V of its own
positions (:mod:`longstraw.distributed.cp_state`). A :class:`ShardedSegment` is this rank's share of that segment, a
:class:`~longstraw.ops.partitioned.PartitionedSegment`: when ``segment_attention`` meets one it hands the whole
call to its ``attention`` (:func:`cp_segment_attention`). Two modes:

Replicated queries (branch replay, rollout decoding, score): every rank runs the same tokens, so ``q`` is the same
everywhere. Forward: each rank attends ``q`` over its share, giving a partial ``(o_r, lse_r)``; the partials are
all-gathered and merged by log-sum-exp (in rank order, identically on every rank), then merged with the local
segments (the new tokens' own causal K/V, already generated tokens). Backward (ring-attention pattern): each rank
recomputes its share's probabilities against the GLOBAL lse and merged output, adds ``dK, dV`` of its positions into
its own gradient sinks (never communicated) and all-reduces the partial ``dq``. Per call:
``R x (B T Hq (Dv + 1))`` gathered, ``B T Hq Dk`` all-reduced; independent of the prompt length.

Distinct queries (one prefill step, and its recomputation in the exact reverse pass): rank ``r`` processes piece
``r`` of the step (positions right after piece ``r - 1``'s). Its queries need

* the stored prompt before the step, spread over all ranks: the queries are shipped, not the K/V. The pieces'
  queries are all-gathered (``R x T Hq Dk``), every rank attends all of them over its share (one kernel call, the
  ``R`` pieces folded into the query axis), and an all-to-all returns each piece's partials to its owner
  (``R x T Hq (Dv + 1)``), which merges them. Backward: ``(q, dO, O, lse)`` are all-gathered, every rank adds
  ``dK, dV`` of its stored positions into its sinks and all-to-alls the partial ``dq`` back.
* the earlier pieces of the same step, just computed on other ranks: their K/V are all-gathered
  (``R x T Hkv (Dk + Dv)``) and attended unmasked; in backward their ``dK, dV`` go back to the owners by all-to-all
  and join the owner's own causal K/V gradient inside the same backward (so later pieces' gradient reaches
  earlier pieces' parameters and state).

All ranks must make the same sequence of calls (lockstep); every exchange is a collective on the CP group, and
every decision to skip one depends only on values that are the same on all ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw.distributed.context import Comm
from longstraw.ops.attention import (KVSegment, default_backend, kernels, merge_partials, segment_backward,
                                     segment_forward)
from longstraw.ops.partitioned import PartitionedSegment

__all__ = ["StepPieces", "ShardedSegment", "cp_segment_attention"]


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
                  return_lse: bool = False, max_segment: int = 32768):
        return cp_segment_attention(q, segments, scale, backend=backend, return_lse=return_lse,
                                    max_segment=max_segment)


@dataclass(frozen=True)
class _Plan:
    comm: Comm
    step: StepPieces | None
    global_length: int
    k_sink: Tensor | None
    v_sink: Tensor | None
    block: int  # the local share is attended in blocks of at most this many keys (bounded temporaries)

    def blocks(self, k: Tensor, v: Tensor):
        """``(k, v, k_sink, v_sink)`` views of consecutive blocks of the local share."""
        for a in range(0, k.shape[2], self.block):
            b = a + self.block
            sk = self.k_sink[:, :, a:b] if self.k_sink is not None else None
            sv = self.v_sink[:, :, a:b] if self.v_sink is not None else None
            yield k[:, :, a:b], v[:, :, a:b], sk, sv


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
    for kb, vb, _, _ in plan.blocks(k, v):
        o, lse = segment_forward(fwd, q, kb, vb, False, scale)
        outs.append(o)
        lses.append(lse)
    return merge_partials(outs, lses, q.dtype) if len(outs) > 1 else (outs[0], lses[0])


def _partial_bwd(bwd, do: Tensor, q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, plan: _Plan,
                 scale: float) -> Tensor:
    """Backward of :func:`_partial` against the global ``(o, lse)``: returns ``dq``; ``dK, dV`` go to the sinks."""
    dq = torch.zeros_like(q)
    for kb, vb, sk, sv in plan.blocks(k, v):
        dq_b, dk, dv = segment_backward(bwd, do, q, kb, vb, o, lse, False, scale)
        dq = dq + dq_b
        if sk is not None:
            sk.add_(dk.to(sk.dtype))
            sv.add_(dv.to(sv.dtype))
    return dq


def _merge_blocks(o: Tensor, lse: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Merge partials stacked on axis 0 (``o [R, B, H, T, Dv]``, ``lse [R, B, H, T]``; an empty share has
    ``lse = -inf``): ``lse = logsumexp_r lse_r``, ``o = sum_r exp(lse_r - lse) o_r``, the same on every rank."""
    total = torch.logsumexp(lse, dim=0)
    w = torch.exp(lse - total)[..., None]
    return (o.to(w.dtype) * w).sum(0).to(dtype), total


def _sharded_fwd(fwd, q: Tensor, k: Tensor, v: Tensor, plan: _Plan, scale: float) -> tuple[Tensor, Tensor]:
    comm, step = plan.comm, plan.step
    if step is None:  # replicated queries: partial over the local share, gathered and merged
        o, lse = _partial(fwd, q, k, v, plan, scale)
        return _merge_blocks(comm.all_gather(o), comm.all_gather(lse), q.dtype)
    t, tm = q.shape[2], step.max_len
    qs = comm.all_gather(_pad_time(q, tm)[0])  # [R, Hq, Tm, Dk]: every piece's queries
    o, lse = _partial(fwd, qs, k, v, plan, scale)  # the R pieces over this rank's stored positions
    o, lse = comm.all_to_all(o), comm.all_to_all(lse)  # block i: rank i's partial for this rank's piece
    return _merge_blocks(o[:, None, :, :t], lse[:, None, :, :t], q.dtype)


def _sharded_bwd(bwd, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, plan: _Plan,
                 scale: float) -> Tensor:
    """The query gradient of the sharded segment (summed over ranks); this rank's ``dK, dV`` go to its sinks."""
    comm, step = plan.comm, plan.step
    if step is None:
        return comm.all_reduce(_partial_bwd(bwd, dout, q, k, v, out, lse, plan, scale).contiguous())
    t, tm = q.shape[2], step.max_len
    gather = lambda x: comm.all_gather(_pad_time(x, tm)[0])  # noqa: E731  [R, ...] every piece's tensor
    qs, dos, os_ = gather(q), gather(dout), gather(out)
    ls = comm.all_gather(_pad_time(lse[..., None], tm)[0, ..., 0])  # padded rows: dO = 0, so they add nothing
    dqs = _partial_bwd(bwd, dos, qs, k, v, os_, ls, plan, scale)
    return comm.all_to_all(dqs).sum(0)[None, :, :t]


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
    def forward(ctx, q, scale, backend, plan: _Plan, meta, causal_idx, ks, vs, *kv):
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
        for idx, (causal, _, _) in enumerate(meta):
            o, lse = segment_forward(fwd, q, kv[2 * idx], kv[2 * idx + 1], causal, scale)
            outs.append(o)
            lses.append(lse)
        out, lse = merge_partials(outs, lses, q.dtype)
        extra = [ek, ev] if ek is not None else []
        ctx.save_for_backward(q, out, lse, ks, vs, *extra, *kv)
        ctx.scale, ctx.backend, ctx.plan, ctx.meta, ctx.causal_idx = scale, backend, plan, meta, causal_idx
        ctx.has_earlier = ek is not None
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, ks, vs, *rest = ctx.saved_tensors
        if ctx.has_earlier:
            ek, ev, *kv = rest
        else:
            ek = ev = None
            kv = rest
        plan, scale = ctx.plan, ctx.scale
        _, bwd = kernels(ctx.backend)
        dout = dout.contiguous()
        dq = torch.zeros_like(q)
        grads: list[Tensor | None] = []
        for idx, (causal, k_sink, v_sink) in enumerate(ctx.meta):
            dq_i, dk, dv = segment_backward(bwd, dout, q, kv[2 * idx], kv[2 * idx + 1], out, lse, causal, scale)
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
        for idx, (_, k_sink, v_sink) in enumerate(ctx.meta):
            if k_sink is not None:
                k_sink.add_(grads[2 * idx].to(k_sink.dtype))
                v_sink.add_(grads[2 * idx + 1].to(v_sink.dtype))
                grads[2 * idx] = grads[2 * idx + 1] = None
        return (dq, None, None, None, None, None, None, None, *grads)


def cp_segment_attention(q: Tensor, segments: list[KVSegment], scale: float, *, backend: str | None = None,
                         return_lse: bool = False, max_segment: int = 32768):
    """``segment_attention`` when one of ``segments`` is a :class:`ShardedSegment` (same signature and result;
    the local share is attended in blocks of ``max_segment`` keys, as ``segment_attention`` does).

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
    plan = _Plan(sh.comm, sh.step, sh.global_length, sh.k_grad, sh.v_grad, max_segment)
    meta = tuple((s.causal, s.k_grad, s.v_grad) for s in local)
    kv = []
    for s in local:
        kv += [s.k.detach(), s.v.detach()] if s.k_grad is not None else [s.k, s.v]
    out, lse = _CPAttention.apply(q.contiguous(), float(scale), backend, plan, meta, causal_idx, sh.k.detach(),
                                  sh.v.detach(), *kv)
    return (out, lse) if return_lse else out
