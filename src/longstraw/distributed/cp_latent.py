"""MLA latent states (DeepSeek-V3, DeepSeek-V3.2, GLM-5) under context parallelism.

An MLA layer's prompt state is ``lat [1, 1, P, r + dr]`` (``[c_kv | k_pe]`` per position, :class:`LatentState`);
a DSA layer with an indexer adds the indexer keys ``[1, P, Di]`` (:class:`IndexedLatentState`). Both are ``O(P)``
like full-attention K/V and shard the same way (:class:`~longstraw.distributed.cp_state.ShardLayout`): rank ``r``
keeps the latents (and keys) of its pieces, in position order, in a local single-process state, whose gradient
buffer is this rank's sink.

Dense MLA (every DeepSeek-V3 layer; DSA layers whose queries see at most ``index_topk`` keys) in either form, the
one ``MLAttention.choose_form`` picks by FLOPs for the whole group's call (:meth:`ShardedSegment.group_shape`: a
prefill step's ``R`` pieces share every expansion; the numbers are the same on every rank, so all take one path):

* absorbed: ``segment_attention`` with ``K = V = lat`` and one shared latent head, so the sharded latents take the
  :class:`ShardedSegment` path of :mod:`longstraw.distributed.cp_attention` unchanged (queries shipped to the
  owners, partials merged by LSE, ``d lat`` into the owner's sink);
* decompressed (:func:`cp_decompressed_attention`): each rank expands its own share chunk by chunk into per-head
  K/V (head sizes ``dn + dr`` and ``dv``: flash-sized) and attends the shipped queries to it, one piece's queries
  per kernel call (``models.mla.decompressed_partial``); partials merged by LSE as above; in backward ``d lat``
  into the owner's sink, ``dq`` back to the queries' owners, and the partial ``d W_UK, d W_UV`` all-reduced for
  replicated queries (a reverse-pass step keeps its partial: that pass sums the ranks' parameter gradients). The
  step's earlier pieces travel as latents and are expanded where they are attended.

DSA (DeepSeek Sparse Attention), the layers whose queries see more than ``index_topk`` keys:

* Indexer top-k (:func:`cp_index_select`, not differentiated): the selection is over the whole prompt. Every rank
  takes its stored keys' best ``k`` for a block of query rows, and the group's best is their reduction by
  :func:`_best` (the total order score descending, position ascending, so any grouping gives the same set): a ring
  reduce-scatter (:func:`_ring_top`, point-to-point shifts) in which block ``j``'s running best starts at rank
  ``j + 1`` and reaches rank ``j`` after ``R - 1`` hops, each rank merging its own share's best in. Prefill step:
  the blocks are the pieces, and a piece's index queries and head weights ride the ring with its candidates
  (``T Hi (Di + 1)`` and ``T k`` pairs per hop; a rank holds two pieces' worth, not ``R``); the step's indexer keys
  are all-gathered (``R T Di``) for the earlier pieces. Replicated queries (replay, score, decoding): small calls
  all-gather every rank's best (``R B T k`` pairs, one collective: decoding), larger ones split the ``B T`` rows
  into ``R`` blocks for the ring and all-gather the merged blocks (``B T k``). The rows' final selection, over
  these candidates and the keys every rank holds (the new tokens' own, generated tokens', the step's earlier
  pieces), is blocked over query rows as in one process. Ties are broken deterministically, by the lower
  position (the single-process ``topk`` breaks exact ties in an order of its own; with real scores ties do not
  occur).
* Sparse attention (:func:`cp_sparse_latent_attention`; the kernel is the single-process op's own partials,
  ``ops.sparse_attention.partial_forward`` / ``partial_backward`` / ``merge_partials``): the selected keys split by
  owner, so each rank attends the queries over the selected keys it owns (a partial ``(o, lse)``), merged by
  log-sum-exp: the dense CP attention's pattern with a selection mask. Replicated queries: partials merged by
  all-reduces (``B T H (D + 2)``; ``merge_all``), ``dq`` all-reduced, ``d lat`` of the selected stored keys into the
  owner's sink. Prefill step: one piece at a time (per rank memory of one piece, not of the ``R`` pieces: at GLM-5's
  size a whole step's exchange was 65 GiB per rank), its owner broadcasts its absorbed queries and selection, every
  rank attends them over the selected keys it stores, and the partials are merged to the owner (the group's maximum
  ``lse``, then the weighted partials and weights reduced to it); backward likewise: ``(q, dO, O, lse)`` broadcast,
  the partial ``dq`` reduced to the owner. The step's latent pieces are all-gathered and the earlier pieces' ``d lat``
  returns to their owners inside the same backward.

Every decision that skips a collective depends only on values that are the same on every rank (the step, the
global lengths): all ranks make the same calls in the same order.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw.distributed.context import Comm
from longstraw.distributed.cp_attention import (ShardedSegment, StepPieces, _pad_time,
                                                  dense_step_bytes, merge_all, merged_by_piece, reduced_by_piece)
from longstraw.distributed.cp_state import PositionShardedState, ShardLayout
from longstraw.models.context import CallContext
from longstraw.models.dsa import SCORE_ELEMS, IndexedLatentDecoder, IndexedPrefix
from longstraw.models.mla import (_QUERY_ELEMS, LatentDecoder, LatentState, decompressed_partial,
                                  decompressed_partial_backward, weight_grads)
from longstraw.ops.attention import KVSegment, kernels, segment_backward, segment_forward
from longstraw.ops.attention import merge_partials as merge_segments
from longstraw.ops.partitioned import PartitionedSegment
from longstraw.ops.sparse_attention import (Selection, acc_dtype, latent_grad_targets, merge_partials,
                                            partial_backward, partial_forward)
from longstraw.ops.topk import first_topk

__all__ = ["ShardedLatentState", "ShardedIndexedLatentState", "ShardedLatentSegment", "ShardedIndexKeys",
           "cp_decompressed_attention", "cp_sparse_latent_attention", "cp_index_select", "mla_step_bytes"]

_NEG = float("-inf")
_EMPTY_LAT = torch.empty(1, 1, 0, 0)
_GATHER_BYTES = 64 << 20  # replicated index queries whose every-rank candidates (R B T k pairs) fit: one all-gather


# ---------------------------------------------------------------------------------------------------- positions


class _Owner:
    """This rank's pieces as tensors: global ``[start, end)`` in position order and their local buffer offsets.
    ``O(K)`` numbers, whatever the prompt length (no position-sized map)."""

    def __init__(self, layout: ShardLayout, rank: int):
        pieces = layout.pieces(rank)
        self._lists = ([s for s, _ in pieces], [e for _, e in pieces],
                       [layout.local_offset(rank, k) for k in range(len(pieces))])
        self._dev: dict[torch.device, tuple[Tensor, Tensor, Tensor]] = {}

    def _t(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
        if device not in self._dev:
            self._dev[device] = tuple(torch.tensor(x, dtype=torch.long, device=device) for x in self._lists)
        return self._dev[device]

    def to_local(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        """Global positions ``pos [...]`` -> (local index, owned by this rank) of the same shape (index 0 where
        not owned)."""
        starts, ends, offs = self._t(pos.device)
        k = (torch.searchsorted(starts, pos.contiguous(), right=True) - 1).clamp_(min=0)
        st = starts[k]
        owned = (pos >= st) & (pos < ends[k])
        return torch.where(owned, offs[k] + pos - st, 0), owned

    def to_global(self, local: Tensor) -> Tensor:
        """Local buffer indices ``[...]`` -> their global positions."""
        starts, _, offs = self._t(local.device)
        k = (torch.searchsorted(offs, local.contiguous(), right=True) - 1).clamp_(min=0)
        return starts[k] + local - offs[k]


def _pad1(x: Tensor, length: int, value: float = 0) -> Tensor:
    """Pad axis 1 (time) of ``x [B, T, ...]`` to ``length`` with ``value``."""
    if x.shape[1] == length:
        return x.contiguous()
    pad = x.new_full((x.shape[0], length - x.shape[1], *x.shape[2:]), value)
    return torch.cat([x, pad], dim=1)


def _pad_last(x: Tensor, length: int, value: float) -> Tensor:
    return torch.cat([x, x.new_full((*x.shape[:-1], length - x.shape[-1]), value)], dim=-1)


# ---------------------------------------------------------------------------------------------------- segments


@dataclass
class ShardedLatentSegment(ShardedSegment):
    """This rank's share ``k = v = lat [1, 1, S_local, r + dr]`` of the stored latents (``k_grad = v_grad``: the
    sink). Dense attention goes through :class:`ShardedSegment`'s ``attention``; DSA's sparse attention through
    :meth:`sparse_attention`. ``owner`` maps global positions to this rank's buffer."""

    owner: _Owner | None = None

    def sparse_attention(self, q: Tensor, segments: list[KVSegment], sel: Selection, scale: float) -> Tensor:
        return cp_sparse_latent_attention(q, segments, sel, scale)

    def decompressed_attention(self, q: Tensor, w_uk: Tensor, w_uv: Tensor, k_own: Tensor, v_own: Tensor,
                               lat: Tensor, segments: list[KVSegment], scale: float, backend: str,
                               chunk: int) -> Tensor:
        return cp_decompressed_attention(self, q, w_uk, w_uv, k_own, v_own, lat, segments, scale, backend, chunk)


@dataclass
class ShardedIndexKeys(PartitionedSegment):
    """This rank's share ``keys [1, S_local, Di]`` of a DSA layer's stored indexer keys (position order), as an
    entry of :class:`~longstraw.models.dsa.IndexedPrefix`; the indexer hands its ``select`` to :meth:`index_select`."""

    keys: Tensor
    comm: Comm
    step: StepPieces | None
    global_length: int
    owner: _Owner

    @property
    def key_count(self) -> int:
        return self.global_length

    def index_select(self, indexer, x: Tensor, q_resid: Tensor, ctx: CallContext, prefix_keys: list,
                     own_keys: Tensor) -> Selection:
        return cp_index_select(self, indexer, x, q_resid, ctx, prefix_keys, own_keys)


# ---------------------------------------------------------------------------------------------------- states


class ShardedLatentState(PositionShardedState):
    """An MLA layer's latents, sharded: ``local`` (a :class:`LatentState` for this rank's positions, in position
    order) holds ``lat [1, 1, n_local, r + dr]`` of rank ``rank``'s pieces; its gradient buffer (exact mode) is this
    rank's sink. Speaks the LayerState protocol in GLOBAL positions, like :class:`ShardedKVState`."""

    def __init__(self, local: LatentState, layout: ShardLayout, comm: Comm):
        super().__init__(local, layout, comm)
        self.owner = _Owner(layout, comm.rank)

    def _segment(self, local_len: int, global_len: int, grad: bool, step: StepPieces | None
                 ) -> ShardedLatentSegment:
        st = self.local
        if st.lat is None:
            lat, g = _EMPTY_LAT, None
        else:
            lat = st.lat[:, :, :local_len]
            g = st.grad[:, :, :local_len] if grad and st.grad is not None else None
        return ShardedLatentSegment(lat, lat, k_grad=g, v_grad=g, comm=self.comm, step=step,
                                    global_length=global_len, owner=self.owner)

    def _step(self, step: int) -> tuple[int, int, StepPieces]:
        g = self.layout.step_start(step)
        return self.layout.local_len(self.rank, g), g, StepPieces(self.layout.step_lengths(step), self.rank)

    def step_prefix(self, step: int, grad: bool) -> list[ShardedLatentSegment]:
        """For this rank's piece of step ``step``: the stored latents before the step (this rank's share) and the
        step's piece lengths (the earlier pieces are exchanged inside the attention call)."""
        local_len, g, pieces = self._step(step)
        return [self._segment(local_len, g, grad, pieces)]

    def segments(self, length: int, grad: bool) -> list[ShardedLatentSegment]:
        """For tokens run on every rank after the first ``length`` positions (replay, decoding, score)."""
        if length == 0:
            return []
        assert length <= self.length
        return [self._segment(self.layout.local_len(self.rank, length), length, grad, None)]

    def prefix(self, length: int, grad: bool):
        return self.segments(length, grad)

    def decoder(self, batch: int, max_new: int) -> LatentDecoder:
        return LatentDecoder(self, batch, max_new)  # reads segments(length): this rank's share, merged over the group


class ShardedIndexedLatentState(ShardedLatentState):
    """A DSA layer with an indexer: latents as :class:`ShardedLatentState` plus this rank's indexer keys
    (``local`` is an :class:`IndexedLatentState`); prefixes are :class:`IndexedPrefix` of sharded entries."""

    def _keys(self, local_len: int, global_len: int, step: StepPieces | None) -> ShardedIndexKeys:
        ik = self.local.index_k
        keys = ik[:, :local_len] if ik is not None else torch.empty(1, 0, 0)
        return ShardedIndexKeys(keys, self.comm, step, global_len, self.owner)

    def step_prefix(self, step: int, grad: bool) -> IndexedPrefix:
        local_len, g, pieces = self._step(step)
        return IndexedPrefix([self._segment(local_len, g, grad, pieces)], [self._keys(local_len, g, pieces)])

    def prefix(self, length: int, grad: bool) -> IndexedPrefix:
        if length == 0:
            return IndexedPrefix([], [])
        assert length <= self.length
        local_len = self.layout.local_len(self.rank, length)
        return IndexedPrefix([self._segment(local_len, length, grad, None)], [self._keys(local_len, length, None)])

    def decoder(self, batch: int, max_new: int) -> IndexedLatentDecoder:
        return IndexedLatentDecoder(self, batch, max_new)  # reads prefix(length)


# ---------------------------------------------------------------------------------------------------- decompressed


@dataclass(frozen=True)
class _DecPlan:
    comm: Comm
    step: StepPieces | None
    global_length: int  # stored prompt positions (replicated: the prompt; step: before the step)
    sink: Tensor | None  # this rank's share's gradient buffer ``[1, 1, S_local, r + dr]``
    scale: float
    backend: str
    chunk: int  # stored positions expanded at once


class _CPDecompressed(torch.autograd.Function):
    """MLA's decompressed form with the prompt latents split over the CP group (:func:`cp_decompressed_attention`).

    Inputs: ``q [B, H, T, dn + dr]``, ``w_uk [H, dn, r]``, ``w_uv [H, dv, r]``, the queries' own expanded
    ``k_own [B, H, T, dn + dr]``, ``v_own [B, H, T, dv]`` (causal) and latents ``lat_own [B, 1, T, r + dr]`` (a
    prefill step sends them to the later pieces and receives their ``d lat``), this rank's share
    ``sh_lat [1, 1, S_local, r + dr]`` (its gradient goes to ``plan.sink``) and replicated local latent segments
    ``lats`` (their gradients to ``sinks``)."""

    @staticmethod
    def forward(ctx, q, w_uk, w_uv, k_own, v_own, lat_own, plan: _DecPlan, sinks, sh_lat, *lats):
        fwd, _ = kernels(plan.backend)
        comm, step, scale, chunk = plan.comm, plan.step, plan.scale, plan.chunk
        t = q.shape[2]
        outs, lses = [], []
        if plan.global_length > 0:  # the stored prompt: each rank expands its own share, chunk by chunk
            if step is None:  # replicated queries: the partials merged over the group (all-reduces)
                o, l = merge_all(comm, *decompressed_partial(fwd, q, sh_lat, w_uk, w_uv, scale, chunk))
            else:  # one piece at a time: its queries from its owner, the shares' partials merged back to it
                o, l = merged_by_piece(comm, [_pad_time(q, step.max_len)],  # [1, H, Tm, dn + dr]
                                       lambda qj: decompressed_partial(fwd, qj, sh_lat, w_uk, w_uv, scale, chunk))
                o, l = o[:, :, :t], l[:, :, :t]  # [1, H, T, dv], [1, H, T]
            outs.append(o)
            lses.append(l)
        earlier = None
        if step is not None:  # the step's earlier pieces: their latents gathered, expanded here chunk by chunk
            tm, r = step.max_len, step.rank
            gl = comm.all_gather(_pad1(lat_own.detach().transpose(1, 2), tm)[0]).transpose(1, 2)  # [R, 1, Tm, D]
            if r > 0:
                earlier = torch.cat([gl[j : j + 1, :, : step.lengths[j]] for j in range(r)], dim=2)
                o, l = decompressed_partial(fwd, q, earlier, w_uk, w_uv, scale, chunk)
                outs.append(o)
                lses.append(l)
            del gl
        for lat in lats:  # replicated latents (generated tokens'), unmasked
            o, l = decompressed_partial(fwd, q, lat, w_uk, w_uv, scale, chunk)
            outs.append(o)
            lses.append(l)
        o, l = segment_forward(fwd, q, k_own, v_own, True, scale)  # the queries' own tokens, causal
        outs.append(o)
        lses.append(l)
        out, lse = merge_segments(outs, lses, q.dtype)
        ctx.save_for_backward(q, w_uk, w_uv, k_own, v_own, out, lse, sh_lat,
                              earlier if earlier is not None else torch.empty(0), *lats)
        ctx.plan, ctx.sinks, ctx.lat_dtype = plan, sinks, lat_own.dtype
        return out

    @staticmethod
    def backward(ctx, dout):
        q, w_uk, w_uv, k_own, v_own, out, lse, sh_lat, earlier, *lats = ctx.saved_tensors
        plan = ctx.plan
        comm, step, scale, chunk = plan.comm, plan.step, plan.scale, plan.chunk
        _, bwd = kernels(plan.backend)
        t = q.shape[2]
        dout = dout.contiguous()
        dq, dk_own, dv_own = segment_backward(bwd, dout, q, k_own, v_own, out, lse, True, scale)
        dq = dq.to(lse.dtype)
        needs = tuple(ctx.needs_input_grad[1:3])  # the same on every rank
        dw = weight_grads(w_uk, w_uv, needs)
        for lat, sink in zip(lats, ctx.sinks):
            dq += decompressed_partial_backward(bwd, dout, q, lat, w_uk, w_uv, out, lse, scale, chunk, sink, dw)
        d_lat_own = None
        if step is not None:  # the earlier pieces' d lat back to their owners (all ranks take part)
            tm, r = step.max_len, step.rank
            send = torch.zeros(comm.size, 1, tm, sh_lat.shape[-1], dtype=lse.dtype, device=q.device)
            if r > 0:
                de = torch.zeros(earlier.shape, dtype=lse.dtype, device=q.device)
                dq += decompressed_partial_backward(bwd, dout, q, earlier, w_uk, w_uv, out, lse, scale, chunk, de, dw)
                for j, piece in enumerate(de[0, 0].split(step.lengths[:r], dim=0)):
                    send[j, 0, : step.lengths[j]] = piece
            d_lat_own = comm.all_to_all(send).sum(0)[None, :, :t].to(ctx.lat_dtype)  # [1, 1, T, r + dr]
        if plan.global_length > 0:
            if step is None:  # partial dq and d W over this share, summed over the group (every rank: the same B)
                dws = weight_grads(w_uk, w_uv, needs)
                dq += comm.all_reduce(decompressed_partial_backward(bwd, dout, q, sh_lat, w_uk, w_uv, out, lse,
                                                                    scale, chunk, plan.sink, dws))
                if dws is not None:
                    dw[0].add_(comm.all_reduce(dws[0]))
                    dw[1].add_(comm.all_reduce(dws[1]))
            else:  # one piece at a time: its (q, dO, O, lse) from its owner, this share's dq partial reduced to it
                tm = step.max_len
                mine = [_pad_time(x, tm) for x in (q, dout, out)] + [_pad_time(lse[..., None], tm)[..., 0]]
                reduced_by_piece(comm, mine, lambda qj, doj, oj, lj: decompressed_partial_backward(
                    bwd, doj, qj, sh_lat, w_uk, w_uv, oj, lj, scale, chunk, plan.sink, dw),
                    lambda d: dq.add_(d[:, :, :t]))  # padded rows: dO = 0, they add nothing
        return (dq.to(q.dtype), None if dw is None else dw[0].to(w_uk.dtype),
                None if dw is None else dw[1].to(w_uv.dtype), dk_own, dv_own, d_lat_own, None, None, None,
                *([None] * len(lats)))


def cp_decompressed_attention(sh: ShardedLatentSegment, q: Tensor, w_uk: Tensor, w_uv: Tensor, k_own: Tensor,
                              v_own: Tensor, lat: Tensor, segments: list[KVSegment], scale: float, backend: str,
                              chunk: int) -> Tensor:
    """MLA's decompressed form when the stored latents are split over the CP group (module docstring):
    ``q [B, H, T, dn + dr]`` -> ``[B, H, T, dv]``, the same result as ``MLAttention.attend_decompressed`` in one
    process. ``k_own, v_own`` are the queries' own expanded K/V (causal), ``lat [B, 1, T, r + dr]`` their latents,
    ``segments`` other replicated latent segments (generated tokens'). In a prefill step ``B == 1`` and there are
    none."""
    for s in segments:
        assert not isinstance(s, PartitionedSegment) and s.k is s.v and s.k.shape[1] == 1, \
            "one sharded latent segment; the others are replicated single-head latents"
    if sh.step is not None:
        assert q.shape[0] == 1 and not segments and sh.step.lengths[sh.step.rank] == q.shape[2], \
            "a prefill step attends its stored prefix, the step's earlier pieces and itself"
    local = sh.k.shape[2] > 0  # this rank stores positions of the prefix (the share may still be empty)
    if local:
        assert sh.k.shape[:2] == (1, 1) and sh.k.shape[-1] == lat.shape[-1]
    plan = _DecPlan(sh.comm, sh.step, sh.global_length, sh.k_grad if local else None, float(scale), backend,
                    int(chunk))
    lats = [s.k.detach() if s.k_grad is not None else s.k for s in segments]
    sh_lat = sh.k.detach() if local else lat.new_empty(1, 1, 0, lat.shape[-1])  # [1, 1, S_local, r + dr]
    return _CPDecompressed.apply(q, w_uk, w_uv, k_own, v_own, lat, plan, tuple(s.k_grad for s in segments), sh_lat,
                                 *lats)


def mla_step_bytes(layer, cp: int, piece: int, stored: int, dtype: torch.dtype, grad: bool) -> tuple[str, int, int]:
    """What one dense MLA layer (``models.mla.MLAttention``) allocates per rank in a CP prefill step (``grad``:
    a reverse-pass step, recomputation and backward) beyond one process's chunk of ``piece`` tokens: the shipped
    queries of the ``cp`` pieces and their partials, by formula. The planner adds it for DSA layers on their dense
    path; a plain MLA layer's step it runs in its dry run instead (``distributed.rehearsal``), and takes only the
    form and the per-block figure from here.
    Returns ``(form, step bytes, per-block transient bytes)``, the form being what :meth:`choose_form` picks for
    the step over ``stored`` prompt positions (``group_shape``).

    Decompressed (``n = piece`` query rows, ``N = cp x piece``, ``H`` heads, ``D = r + dr``, ``b`` bytes of
    ``dtype``, ``a`` of the float32 accumulators), one piece at a time (``_CPDecompressed``): forward, this rank's
    merged partial ``n H (dv + 1) a`` (from its own round on) and a round's broadcast queries ``n H (dn + dr) b``
    and partial, or, while it merges, the partial, its weights and the weighted sum reduced to the owner
    (``2 n H dv a`` and ``3 n H a``); the step's latents all-gathered, ``N D b``. Backward: a round's broadcast
    ``(q, dO, O, lse)``, ``n H ((dn + dr + 2 dv) b + a)``, and partial ``dq`` ``n H (dn + dr) a``, and the earlier
    pieces' ``d lat`` with the exchange's result, ``2 N D a`` (this rank's own ``(q, dO, O, lse)`` are the ones a
    process holds anyway; they are copied only when the step's pieces differ in length). Per block (each
    expanded chunk against one piece's queries): the chunk's K/V ``c H (dn + dr + dv)`` (and their float32 gradient
    in backward) plus the block's partial output and merge weights. Absorbed: the dense CP path's step with one
    latent head of ``D = r + dr`` as both K and V (``cp_attention.dense_step_bytes``)."""
    h, dk, dv, dl = layer.num_heads, layer.dn + layer.dr, layer.dv, layer.kv_lora_rank + layer.dr
    b = torch.empty(0, dtype=dtype).element_size()
    a = 8 if dtype == torch.float64 else 4
    n = cp * piece
    form = layer.choose_form(1, piece, [_ShapeOnly(n, stored)], grad)
    c = layer.chunk_positions()
    if form == "absorbed":  # the dense CP path with one latent head: K = V = lat
        return form, dense_step_bytes(h, 1, dl, dl, cp, piece, dtype, grad)[0], 0
    q1, o1 = piece * h * dk * b, piece * h * (dv + 1) * a
    fwd = n * dl * b + o1 + max(q1 + o1, 2 * o1 + piece * h * dv * a + 3 * piece * h * a)
    rows = min(piece, max(1, _QUERY_ELEMS // (h * max(dk, dv))))  # query rows per kernel call
    block = c * h * (dk + dv) * b + rows * h * dv * (b + 2 * a) + 3 * rows * h * a
    if not grad:
        return form, fwd, block
    bwd = piece * h * ((dk + 2 * dv) * b + a) + piece * h * dk * a + 2 * n * dl * a
    return form, max(fwd, bwd), c * h * (dk + dv) * (b + 2 * a) + rows * h * dk * (b + a)


def dsa_step_bytes(layer, cp: int, piece: int, dtype: torch.dtype, grad: bool, stored: int) -> tuple[int, int]:
    """What one DSA layer on its sparse path (``models.dsa``, a full layer with its indexer or a shared one)
    allocates per rank in a CP prefill step beyond one process's chunk of ``piece`` tokens, by formula (the planner's
    dry run runs one process): ``(peak, saved)``, ``saved`` being what the layer's graph keeps for its backward
    (``grad``: a reverse-pass step) and ``peak`` its largest moment, ``saved`` included.

    ``_CPSparse`` (``n = piece`` rows of ``H`` heads, ``D = r + dr``, ``K = index_topk``, ``b`` bytes of ``dtype``,
    ``a`` of the float32 accumulators) takes the step's pieces one at a time: this rank's padded queries and
    selection (``n H D b``, ``n K`` int64) and its merged partial (``n H (D + 1) a``) live through the loop, and a
    round adds the piece's broadcast queries and selection with their localised copy (``n K 17``) and this rank's
    partial, or, while it is merged, the partial, its weights and the weighted sum reduced to the piece's owner
    (``n H D a`` and ``2 n H a``); the step's latent pieces are all-gathered (``R n D b``) and the earlier ones kept
    for the backward (``(R - 1) n D b``). Backward: this rank's padded ``(q, dO, O)`` and ``lse`` and a round's
    broadcast copies, the localised selection and the piece's partial ``dq`` (``n H D a``), and the earlier pieces'
    ``d lat`` on their way back to their owners with the exchange's result (``2 R n D a``). A full layer's
    ``cp_index_select`` first runs the ring (:func:`_ring_top`): a piece's index queries and head weights
    (``qw = n Hi (Di b + a)``, three at a time while they move, two while merging) and two pieces' candidates
    (``c = n K (a + 8)``: scores and positions) moving, and a merge that holds four and the order, the masks and the
    indices of ``first_topk`` (``n K (a + 56)``); then the step's indexer keys all-gathered (``R n Di b``) and the
    rows' selection blocked as in one process: a block's candidates (the step's keys and the ring's ``K`` per row,
    at most ``SCORE_ELEMS``) scored, concatenated with their positions, position-ordered and ranked, about 36 bytes
    each, where one process's block at the same step (its ``n`` rows over the ``stored`` prompt, at most
    ``SCORE_ELEMS`` too) holds about 24 (scores, mask and ``first_topk``'s): only the difference is counted.
    Nothing of the indexer grows with ``R x n`` but the gathered keys. The per-block transients of the kernels are
    one process's (the same blocking)."""
    h, d, k = layer.num_heads, layer.kv_lora_rank + layer.dr, layer.index_topk
    b = torch.empty(0, dtype=dtype).element_size()
    a = 8 if dtype == torch.float64 else 4
    n = cp * piece
    q1, sel1, o1 = piece * h * d * b, piece * k * 8, piece * h * (d + 1) * a
    saved = (cp - 1) * piece * d * b
    fwd = saved + n * d * b + q1 + sel1 + o1 + max(q1 + sel1 + piece * k * 17 + o1,
                                                   2 * o1 + piece * h * d * a + 2 * piece * h * a)
    ix = layer.indexer
    if ix is not None:
        qw, c = piece * ix.num_heads * (ix.head_dim * b + a), piece * k * (a + 8)
        ring = max(3 * qw + 2 * c, 2 * qw + 4 * c + piece * k * (a + 56))
        cand, one = min(SCORE_ELEMS, piece * (k + n)), min(SCORE_ELEMS, piece * max(stored, piece))
        fwd = max(fwd, ring, c + n * ix.head_dim * b + max(0, 36 * cand - 24 * one))
    if not grad:
        return fwd, 0
    bwd = saved + 2 * n * d * a + 2 * (3 * q1 + sel1 + piece * h * a) + piece * k * 17 + piece * h * d * a
    return max(fwd, bwd), saved


class _ShapeOnly(PartitionedSegment):
    """A stand-in segment for :func:`mla_step_bytes`: the group's call shape only (``n`` step rows over ``stored``
    positions), to ask an MLA layer which form it picks."""

    def __init__(self, n: int, stored: int):
        self.n, self.stored = n, stored

    @property
    def key_count(self) -> int:
        return self.stored

    def group_shape(self, tokens: int) -> tuple[int, int]:
        return self.n, self.stored


# ---------------------------------------------------------------------------------------------------- indexer


def _local_top(indexer, q: Tensor, w: Tensor, keys: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """Best ``k`` of this rank's stored keys ``keys [1, S, Di]`` (position order) for queries ``q [B, T, Hi, Di]``
    with weights ``w [B, T, Hi]``: ``(scores, local indices)`` ``[B, T, k]``, padded with ``(-inf, 0)`` when
    ``S < k``. Blocked over queries as the single-process indexer is (``[B, bt, S]`` scores at a time)."""
    b, t = q.shape[:2]
    acc, s = w.dtype, keys.shape[1]
    vals = torch.full((b, t, k), _NEG, dtype=acc, device=q.device)
    ids = torch.zeros(b, t, k, dtype=torch.long, device=q.device)
    kk = min(k, s)
    if kk == 0:
        return vals, ids
    bt = max(1, min(t, SCORE_ELEMS // max(1, b * s)))
    for t0 in range(0, t, bt):
        t1 = min(t, t0 + bt)
        sc = indexer.scores(q[:, t0:t1].to(acc), w[:, t0:t1], [keys])  # [B, bt, S]
        i = first_topk(sc, kk)
        vals[:, t0:t1, :kk] = sc.gather(-1, i)
        ids[:, t0:t1, :kk] = i
    return vals, ids


def _best(vals: list[Tensor], pos: list[Tensor], k: int) -> tuple[Tensor, Tensor]:
    """The top ``k`` of the candidates ``(score, global position)`` ``[..., C_i]`` as ``(scores, positions)``
    ``[..., k]`` (position order): ordered by position first so that exact ties go to the lower position. This is
    the total order (score descending, position ascending), so the best ``k`` of a union equals the best ``k`` of
    the best ``k`` of its parts: merging in any grouping gives the same result. Fewer candidates than ``k`` (a low
    rank's piece early in a step) are padded with ``(-inf, 0)``."""
    v, p = torch.cat(vals, dim=-1), torch.cat(pos, dim=-1)
    if v.shape[-1] < k:
        v, p = _pad_last(v, k, _NEG), _pad_last(p, k, 0)
    order = p.argsort(dim=-1, stable=True)
    v, p = v.gather(-1, order), p.gather(-1, order)
    order = None
    i = first_topk(v, k)
    return v.gather(-1, i), p.gather(-1, i)


def _ring_top(comm: Comm, top: Callable[..., tuple[Tensor, Tensor]], k: int, *,
              travelling: list[Tensor] | None = None, block: Callable[[int], list[Tensor]] | None = None
              ) -> tuple[Tensor, Tensor]:
    """The group's best ``k`` stored keys for this rank's block of query rows: a ring reduce-scatter whose operator
    is :func:`_best`. ``top(*inputs) -> (scores, global positions) [1, rows, k]`` is the best of this rank's share
    for one block's inputs. Block ``j``'s running best starts at rank ``j + 1`` and travels the ring to rank ``j``,
    each rank merging in its own share's best: ``R - 1`` shifts (:meth:`Comm.shift`), a rank holding two blocks'
    candidates at a time, ``O(rows k)`` rather than the ``O(R rows k)`` of gathering every rank's candidates.

    Exactly one of: ``travelling``, this rank's block's inputs when only their owner has them (a prefill step's
    pieces: they are sent one hop ahead first and then ride along with the candidates, the last hop without them);
    ``block(j)``, block ``j``'s inputs, when every rank can make any block's (replicated queries split by rows)."""
    r, n = comm.rank, comm.size
    if travelling is not None:
        cur = comm.shift(travelling)  # block r - 1's inputs
        v, p = top(*cur)
    else:
        v, p = top(*block((r - 1) % n))
    for s in range(n - 1):
        last = s == n - 2  # the block coming in is this rank's own
        got = comm.shift([v, p] + (cur if travelling is not None and not last else []))
        v = p = None
        if travelling is not None:
            cur = travelling if last else got[2:]
            lv, lp = top(*cur)
        else:
            lv, lp = top(*block((r - 2 - s) % n))
        v, p = _best([got[0], lv], [got[1], lp], k)
        got = lv = lp = None
    return v, p


def _share_top(sh: ShardedIndexKeys, indexer, q: Tensor, w: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """This rank's best ``k`` stored keys for ``q [B, T, Hi, Di]``, ``w [B, T, Hi]``: ``(scores, global positions)``
    ``[B, T, k]``."""
    v, i = _local_top(indexer, q, w, sh.keys, k)
    return v, sh.owner.to_global(i)


def _replicated_top(sh: ShardedIndexKeys, indexer, q: Tensor, w: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """The group's best ``k`` stored keys for replicated queries ``q [B, T, Hi, Di]`` (the same on every rank):
    ``(scores, global positions) [B, T, k]``. Small calls (decoding) all-gather every rank's best (``R B T k``
    pairs, one collective); larger ones (replay, score) split the ``B T`` rows into ``R`` blocks that travel the
    ring (:func:`_ring_top`), then all-gather the merged blocks (``B T k`` pairs). The choice depends on shapes
    only, the same on every rank."""
    comm = sh.comm
    b, t = q.shape[:2]
    if comm.size * b * t * k * 12 <= _GATHER_BYTES:
        v, p = _share_top(sh, indexer, q, w, k)
        gv, gp = comm.all_gather(v), comm.all_gather(p)  # [R, B, T, k]
        return gv.permute(1, 2, 0, 3).reshape(b, t, -1), gp.permute(1, 2, 0, 3).reshape(b, t, -1)
    rows = -(-(b * t) // comm.size)  # rows per block; the last blocks padded
    qf = _pad1(q.reshape(1, b * t, *q.shape[2:]), rows * comm.size)  # [1, R rows, Hi, Di]
    wf = _pad1(w.reshape(1, b * t, w.shape[-1]), rows * comm.size)

    def block(j: int) -> list[Tensor]:
        return [qf[:, j * rows : (j + 1) * rows], wf[:, j * rows : (j + 1) * rows]]

    v, p = _ring_top(comm, lambda qb, wb: _share_top(sh, indexer, qb, wb, k), k, block=block)  # [1, rows, k]
    v, p = comm.all_gather(v[0]), comm.all_gather(p[0])  # [R, rows, k]
    return v.reshape(-1, k)[: b * t].reshape(b, t, k), p.reshape(-1, k)[: b * t].reshape(b, t, k)


def _select_rows(indexer, q: Tensor, w: Tensor, sharded: tuple[Tensor, Tensor] | None, keys: list[Tensor],
                 base: int, own_start: int, k: int) -> Selection:
    """The selection for queries ``q [B, T, Hi, Di]`` (weights ``w [B, T, Hi]``) from the stored prompt's
    candidates ``sharded`` (``(scores, global positions) [B, T, C]``, the group's best: :func:`_ring_top` or
    :func:`_replicated_top`) and the keys every rank holds, ``keys`` (concatenated from position ``base``; the last
    ``T`` of them, from ``own_start`` on, are the queries' own: causally masked). Blocked over query rows as the
    single-process ``Indexer.select`` is (``[B, bt, S]`` scores and their candidates at a time)."""
    b, t = q.shape[:2]
    acc = w.dtype
    s = sum(x.shape[1] for x in keys)
    c = 0 if sharded is None else sharded[0].shape[-1]
    pos = torch.arange(base, base + s, device=q.device)
    qpos = torch.arange(own_start, own_start + t, device=q.device)
    idx = torch.empty(b, t, k, dtype=torch.long, device=q.device)
    valid = torch.empty(b, t, k, dtype=torch.bool, device=q.device)
    bt = max(1, min(t, SCORE_ELEMS // max(1, b * (s + c))))
    for t0 in range(0, t, bt):
        t1 = min(t, t0 + bt)
        sc = indexer.scores(q[:, t0:t1].to(acc), w[:, t0:t1], keys)  # [B, bt, S]
        sc = sc.masked_fill_(pos[None, :] > qpos[t0:t1, None], _NEG)
        vals, poss = [sc], [pos.expand(b, t1 - t0, s)]
        if sharded is not None:
            vals.insert(0, sharded[0][:, t0:t1])
            poss.insert(0, sharded[1][:, t0:t1])
        v, p = _best(vals, poss, k)
        idx[:, t0:t1] = p
        valid[:, t0:t1] = v > _NEG
    return Selection(idx, valid)


@torch.no_grad()
def cp_index_select(sh: ShardedIndexKeys, indexer, x: Tensor, q_resid: Tensor, ctx: CallContext, prefix_keys: list,
                    own_keys: Tensor) -> Selection:
    """``Indexer.select`` over indexer keys split over the CP group (module docstring): ``Selection.idx`` holds
    positions in the same concatenated key axis as in one process (global prompt positions, then the replicated
    segments and the queries' own tokens), and the same keys (up to exact ties). ``x [B, T, hidden]``."""
    if not prefix_keys or prefix_keys[0] is not sh:
        raise ValueError("context-parallel DSA selection expects the sharded prompt keys as the first prefix entry")
    comm, topk = sh.comm, indexer.topk
    q, w = indexer.queries(x, q_resid, ctx)  # [B, T, Hi, Di], [B, T, Hi]
    b, t = x.shape[:2]
    g = sh.global_length
    if sh.step is None:  # replicated queries: identical on every rank
        rest = list(prefix_keys[1:]) + [own_keys]
        n_rest = sum(k.shape[1] for k in rest)
        sharded = _replicated_top(sh, indexer, q, w, min(topk, g)) if g > 0 else None
        return _select_rows(indexer, q, w, sharded, rest, g, g + n_rest - t, min(topk, g + n_rest))
    step = sh.step
    assert b == 1 and len(prefix_keys) == 1, "a prefill step selects over the stored prefix and the step"
    tm, r = step.max_len, step.rank
    sharded = None
    if g > 0:  # each piece's index queries travel the ring, collecting every share's best for it
        kl = min(topk, g)
        v, p = _ring_top(comm, lambda qb, wb: _share_top(sh, indexer, qb, wb, kl), kl,
                         travelling=[_pad1(q, tm), _pad1(w, tm)])  # [1, Tm, kl]
        sharded = v[:, :t], p[:, :t]
    gk = comm.all_gather(_pad1(own_keys, tm)[0])  # [R, Tm, Di]: the step's keys, for the later pieces
    keys = [gk[j : j + 1, : step.lengths[j]] for j in range(r)] + [own_keys]
    own_start = g + sum(step.lengths[:r])
    return _select_rows(indexer, q, w, sharded, keys, g, own_start, min(topk, g + sum(step.lengths)))  # one width


# ---------------------------------------------------------------------------------------------------- sparse op


@dataclass(frozen=True)
class _SparsePlan:
    comm: Comm
    step: StepPieces | None
    global_length: int  # stored prompt positions (replicated: the prompt; step: before the step)
    owner: _Owner | None
    sink: Tensor | None  # this rank's share's gradient buffer ``[1, 1, S_local, D]``
    local_start: int  # concatenated position of the first local segment (replicated: global_length)


def _localize(idx: Tensor, plan: _SparsePlan) -> tuple[Tensor, Tensor]:
    """Packed selection ``idx [.., K]`` (``-1``: invalid) -> (index into this rank's share, selected and stored
    here)."""
    g = plan.global_length
    local, owned = plan.owner.to_local(idx.clamp(0, g - 1))
    m = (idx >= 0) & (idx < g) & owned
    return torch.where(m, local, 0), m


class _CPSparse(torch.autograd.Function):
    """Sparse latent attention with the prompt latents split over the CP group (module docstring). Inputs:
    ``q [B, H, T, D]``, the selection (concatenated positions), this rank's share ``sh_lat [1, 1, S_local, D]``
    (its gradient goes to ``plan.sink``) and the local segments ``lats`` (replicated ones, or the step piece's own
    latents) at ``offsets``."""

    @staticmethod
    def forward(ctx, q, idx, valid, scale, plan: _SparsePlan, offsets, sinks, sh_lat, *lats):
        acc = acc_dtype(q.dtype)
        comm, step = plan.comm, plan.step
        b, h, t, d = q.shape
        qt = q.transpose(1, 2)  # [B, T, H, D]
        packed = torch.where(valid, idx, -1)
        os_, ls = [], []
        saved: dict[str, Tensor] = {}
        if plan.global_length > 0:  # the selected stored keys, attended by their owners
            if step is None:
                li, lv = _localize(packed, plan)
                o, l = merge_all(comm, *partial_forward(qt, (sh_lat,), (0,), li, lv, scale, acc))
                saved["li"], saved["lv"] = li, lv
            else:  # one piece at a time: its queries and selection from its owner, the partials merged back to it
                tm = step.max_len
                o, l = merged_by_piece(comm, [_pad1(qt, tm), _pad1(packed, tm, -1)],  # [1, Tm, H, D], [1, Tm, K]
                                       lambda qj, pj: partial_forward(qj, (sh_lat,), (0,), *_localize(pj, plan),
                                                                      scale, acc))
                o, l = o[:, :t], l[:, :t]  # [1, T, H, D], [1, T, H]
            os_.append(o)
            ls.append(l)
        earlier = None
        if step is not None:  # the earlier pieces of the step, from the lower ranks
            tm, r = step.max_len, step.rank
            own = lats[0]
            gl = comm.all_gather(_pad1(own.transpose(1, 2), tm)[0]).transpose(1, 2)  # [R, 1, Tm, D]
            if r > 0:
                earlier = torch.cat([gl[j : j + 1, :, : step.lengths[j]] for j in range(r)], dim=2)
                ev = (packed >= plan.global_length) & (packed < plan.local_start)
                o, l = partial_forward(qt, (earlier,), (plan.global_length,), packed, ev, scale, acc)
                os_.append(o)
                ls.append(l)
                saved["ev"] = ev
        cv = packed >= plan.local_start  # the local segments
        if lats:
            o, l = partial_forward(qt, tuple(lats), offsets, packed, cv, scale, acc)
            os_.append(o)
            ls.append(l)
        out, lse = merge_partials(os_, ls)
        out = out.to(q.dtype)
        ctx.keys = list(saved)
        ctx.save_for_backward(q, packed, out, lse, sh_lat, cv,
                              earlier if earlier is not None else torch.empty(0), *saved.values(), *lats)
        ctx.scale, ctx.plan, ctx.offsets, ctx.sinks, ctx.n_lats = scale, plan, offsets, sinks, len(lats)
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, packed, out, lse, sh_lat, cv, earlier, *rest = ctx.saved_tensors
        saved = dict(zip(ctx.keys, rest[: len(ctx.keys)]))
        lats = tuple(rest[len(ctx.keys) :])
        plan, scale, comm, step = ctx.plan, ctx.scale, ctx.plan.comm, ctx.plan.step
        acc = lse.dtype
        b, h, t, d = q.shape
        qt, dt = q.transpose(1, 2), dout.transpose(1, 2)
        needs = [need or (step is not None and i == 0) for i, need in enumerate(ctx.needs_input_grad[8:])]
        grads, targets = latent_grad_targets(lats, ctx.sinks, needs, acc)
        dq = torch.zeros(b, t, h, d, dtype=acc, device=q.device)
        if lats:
            dq += partial_backward(qt, dt, out, lse, lats, ctx.offsets, packed, cv, scale, targets)
        if step is not None:  # the earlier pieces' d lat back to their owners (all ranks take part)
            tm, r = step.max_len, step.rank
            send = torch.zeros(comm.size, 1, tm, d, dtype=acc, device=q.device)
            if r > 0:
                de = torch.zeros(earlier.shape, dtype=acc, device=q.device)
                dq += partial_backward(qt, dt, out, lse, (earlier,), (plan.global_length,), packed, saved["ev"], scale,
                                [de.view(-1, d)])
                for j, piece in enumerate(de[0, 0].split(step.lengths[:r], dim=0)):
                    send[j, 0, : step.lengths[j]] = piece
            got = comm.all_to_all(send).sum(0)[None, :, :t]  # [1, 1, t, D]: my piece's d lat from later pieces
            grads[0] = got if grads[0] is None else grads[0] + got
        if plan.global_length > 0:
            sink = [plan.sink.view(-1, plan.sink.shape[-1])] if plan.sink is not None else [None]
            if step is None:
                li, lv = saved["li"], saved["lv"]
                dq += comm.all_reduce(partial_backward(qt, dt, out, lse, (sh_lat,), (0,), li, lv, scale, sink))
            else:  # one piece at a time, as in forward: its (q, dO, O, lse) from its owner, its dq summed back to it
                tm = step.max_len
                mine = [_pad1(x, tm, v) for x, v in ((qt, 0), (packed, -1), (dt, 0), (out, 0), (lse, 0))]
                reduced_by_piece(comm, mine, lambda qj, pj, dtj, otj, lsej: partial_backward(
                    qj, dtj, otj, lsej, (sh_lat,), (0,), *_localize(pj, plan), scale, sink),
                    lambda d: dq.add_(d[:, :t]))  # padded rows: no key selected, they add nothing
        grads = [None if g is None else g.to(lat.dtype) for g, lat in zip(grads, lats)]
        return (dq.to(q.dtype).transpose(1, 2), None, None, None, None, None, None, None, *grads)


def cp_sparse_latent_attention(q: Tensor, segments: list[KVSegment], sel: Selection, scale: float) -> Tensor:
    """``sparse_latent_attention`` when the first segment is a :class:`ShardedLatentSegment` (same signature and
    result): ``q [B, H, T, D]``, ``sel`` over the concatenated key axis (global prompt positions first). In a
    prefill step ``B == 1`` and the only other segment is the piece's own latents."""
    sh = segments[0] if segments else None
    if not isinstance(sh, ShardedLatentSegment) or any(isinstance(s, ShardedSegment) for s in segments[1:]):
        raise ValueError("context-parallel sparse attention takes exactly one sharded latent segment, first")
    local = [s for s in segments[1:] if s.length > 0]
    for s in local:
        assert s.k is s.v and s.k.shape[1] == 1, "sparse latent attention reads single-head latents (k is v)"
    assert tuple(sel.idx.shape[:2]) == (q.shape[0], q.shape[2]), "one selection row per query"
    if sh.step is not None:
        assert q.shape[0] == 1 and len(local) == 1 and local[0].length == sh.step.lengths[sh.step.rank], \
            "a prefill step attends its stored prefix, the step's earlier pieces and itself"
        start = sh.global_length + sum(sh.step.lengths[: sh.step.rank])
    else:
        start = sh.global_length
    offsets, off = [], start
    for s in local:
        offsets.append(off)
        off += s.length
    plan = _SparsePlan(sh.comm, sh.step, sh.global_length, sh.owner, sh.k_grad, start)
    lats = [s.k.detach() if s.k_grad is not None else s.k for s in local]
    return _CPSparse.apply(q, sel.idx, sel.valid, float(scale), plan, tuple(offsets),
                           tuple(s.k_grad for s in local), sh.k.detach(), *lats)
