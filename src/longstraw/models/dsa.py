"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks ``index_topk`` keys per query,
MLA attends over those only.

Indexer (parameter names as transformers' ``DeepseekV32Indexer``; ``Hi = index_n_heads``, ``Di = index_head_dim``)::

    kI_s     = RoPE(LayerNorm(wk x_s))                      [Di]      one key per position, stored in the state
    qI_t,h   = RoPE(wq_b q_resid_t)                         [Hi, Di]  (q_resid: the MLA's normalised low-rank query)
    w_t,h    = weights_proj(x_t) * Hi^-0.5
    I(t, s)  = sum_h w_t,h relu(qI_t,h . kI_s * Di^-0.5)    for the causal keys s <= t, -inf otherwise
    selected(t) = top-index_topk of I(t, .)

RoPE covers the first ``qk_rope_head_dim`` channels of ``Di``: half-split (DeepSeek-V3.2) or interleaved (GLM-5).
Scores are computed in float32 (float64 for float64 models) as upstream. The whole indexer runs without autograd:
the selection is not differentiable and upstream trains the indexer with a separate loss, so its parameters get
no gradient from the language-model loss (as in transformers).

The attention is exact over the selected set: softmax over the selected keys only, the same numbers as
transformers' masked dense attention. When a call's queries can see at most ``index_topk`` keys (prefix + own
tokens), every key is selected and the MLA's dense path runs; otherwise :func:`sparse_latent_attention` gathers the
selected latents per query (absorbed form: one latent key per position, ``K = V = [c_kv | k_pe]``), blocked over
queries, and scatters their gradient back into the prompt state's sink. The sparse path is always absorbed: a
gathered key is used by one query, so expanding it per head would cost ``H r (dn + dv)`` for a single use.

GLM-5 shares indexers: ``indexer_types[i] == "shared"`` layers have no indexer and reuse the selection of the most
recent ``"full"`` layer below them in the same forward (handed over through :class:`RopeTables`, the per-call
position data every layer receives); their prompt state is the plain :class:`~longstraw.models.mla.LatentState`.

Prompt state of a full layer (:class:`IndexedLatentState`): the MLA latents plus the indexer keys, ``(r + dr + Di)``
values per position. Context parallelism (longstraw.distributed.cp_latent) plugs in through three one-line hooks:
``Indexer.select`` hands keys with ``cp_select`` to it, ``sparse_latent_attention`` a segment with
``cp_sparse_dispatch``, and a segment's ``cp_key_count`` (the same on every rank) replaces its length when a layer
decides dense vs sparse. Ties: with few index heads many keys score exactly 0 (every head's relu at 0), and top-k then
breaks ties by position in an order that depends on how the scores were blocked; tests use >= 32 index heads (or
``index_topk`` >= the length).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longstraw.models.mla import LatentDecoder, LatentState, MLAttention
from longstraw.models.rope import RotaryEmbedding, apply_rope, apply_rope_interleaved
from longstraw.ops.attention import KVSegment

_SCORE_ELEMS = 1 << 24  # indexer scores: ~16M float32 elements per query block and per (query, key) block
_GATHER_ELEMS = 1 << 24  # sparse attention per query block: gathered keys + probabilities, ~16M elements


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------------- rope tables


class RopeTables(tuple):
    """``(cos, sin)`` of one ``model.run`` call plus ``shared``: data a later layer of the same call reads from an
    earlier one (GLM-5's shared layers read the selection of their full indexer layer: ``shared[layer_index]``).
    Made per call, so nothing leaks between calls; activation checkpointing recomputes a layer with the same
    object, in which the selection it needs is still present."""

    def __new__(cls, cos: Tensor, sin: Tensor):
        self = super().__new__(cls, (cos, sin))
        self.shared = {}
        return self


class TablesRotaryEmbedding(RotaryEmbedding):
    """:class:`RotaryEmbedding` returning :class:`RopeTables`."""

    def forward(self, positions: Tensor, dtype: torch.dtype) -> RopeTables:
        return RopeTables(*super().forward(positions, dtype))


# ---------------------------------------------------------------------------------------------------- state


@dataclass
class IndexedPrefix:
    """What a full DSA layer consumes: latent segments (as :class:`LatentState` gives them) and the indexer keys
    of the same positions, ``[Bk, S_i, Di]`` per segment."""

    latents: list[KVSegment]
    index_keys: list[Tensor]


@dataclass
class IndexedLatentState(LatentState):
    """MLA latents ``lat [1, 1, P, r + dr]`` plus indexer keys ``index_k [1, P, Di]``. Only the latents carry a
    gradient (the indexer is not differentiated)."""

    index_k: Tensor | None = None

    def write(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> None:
        lat, ik = piece
        super().write(lat, start, end)
        if self.index_k is None:
            self.index_k = ik.new_empty(1, self.capacity, ik.shape[-1])
        self.index_k[:, start:end] = ik

    def prefix(self, length: int, grad: bool) -> IndexedPrefix:
        lat = self.segments(length, grad)
        return IndexedPrefix(lat, [self.index_k[:, :length]] if lat else [])

    def backward_roots(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        return super().backward_roots(piece[0], start, end)

    def nbytes(self) -> int:
        extra = 0 if self.index_k is None else self.index_k.numel() * self.index_k.element_size()
        return super().nbytes() + extra

    def decoder(self, batch: int, max_new: int) -> "IndexedLatentDecoder":
        return IndexedLatentDecoder(self, batch, max_new)


class IndexedLatentDecoder(LatentDecoder):
    """Decoding over an :class:`IndexedLatentState`: per-branch latents and indexer keys of generated tokens."""

    def __init__(self, prompt: IndexedLatentState, batch: int, max_new: int):
        super().__init__(prompt, batch, max_new)
        self.index_k: Tensor | None = None

    def prefix(self, step: int) -> IndexedPrefix:
        pre = self.prompt.prefix(self.prompt.length, False)  # the prompt's latents and keys (a sharded state's too)
        lat, keys = list(pre.latents), list(pre.index_keys)
        if step > 0:
            own = self.lat[:, :, :step]
            lat.append(KVSegment(own, own))
            keys.append(self.index_k[:, :step])
        return IndexedPrefix(lat, keys)

    def append(self, piece: tuple[Tensor, Tensor], step: int) -> None:
        lat, ik = piece
        super().append(lat, step)
        if self.index_k is None:
            self.index_k = ik.new_empty(self.batch, self.max_new, ik.shape[-1])
        self.index_k[:, step : step + ik.shape[1]] = ik

    def select(self, rows: Tensor) -> None:
        super().select(rows)
        if self.index_k is not None:
            self.index_k = self.index_k[rows]


# ---------------------------------------------------------------------------------------------------- indexer


@dataclass
class Selection:
    """Top-k keys of each query: ``idx [B, T, K]`` into the concatenated key axis (prefix segments in order, then
    the queries' own tokens) and ``valid [B, T, K]`` (False where a query sees fewer than ``K`` keys)."""

    idx: Tensor
    valid: Tensor


class Indexer(nn.Module):
    """The lightning indexer (see module docstring); ``interleaved`` selects GLM-5's RoPE layout."""

    def __init__(self, hidden: int, q_lora_rank: int, num_heads: int, head_dim: int, rope_dim: int, topk: int,
                 interleaved: bool):
        super().__init__()
        if head_dim < rope_dim:
            raise ValueError(f"index_head_dim={head_dim} must be >= qk_rope_head_dim={rope_dim}")
        self.num_heads, self.head_dim, self.rope_dim, self.topk = num_heads, head_dim, rope_dim, topk
        self.interleaved = interleaved
        self.softmax_scale = head_dim**-0.5
        self.wq_b = nn.Linear(q_lora_rank, num_heads * head_dim, bias=False)
        self.wk = nn.Linear(hidden, head_dim, bias=False)
        self.k_norm = nn.LayerNorm(head_dim, eps=1e-6)
        self.weights_proj = nn.Linear(hidden, num_heads, bias=False)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if not self.interleaved:
            return apply_rope(x, cos, sin)
        r = self.rope_dim
        return torch.cat((apply_rope_interleaved(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    @torch.no_grad()
    def keys(self, x: Tensor, rope) -> Tensor:
        """``x [B, T, hidden]`` -> indexer keys ``[B, T, Di]`` (what the state stores)."""
        return self._rope(self.k_norm(self.wk(x)), rope[0], rope[1])

    @torch.no_grad()
    def queries(self, x: Tensor, q_resid: Tensor, rope) -> tuple[Tensor, Tensor]:
        """``x [B, T, hidden]``, ``q_resid [B, T, q_lora_rank]`` -> roped index queries ``q [B, T, Hi, Di]`` and
        head weights ``w [B, T, Hi]`` (score dtype, ``Hi^-0.5`` included)."""
        b, t, _ = x.shape
        cos, sin = rope[0], rope[1]
        q = self.wq_b(q_resid).view(b, t, self.num_heads, self.head_dim)
        q = self._rope(q, cos[:, None], sin[:, None])  # cos [T, 1, dr]: broadcast over the index heads
        return q, self.weights_proj(x).to(_acc_dtype(x.dtype)) * self.num_heads**-0.5

    def scores(self, qb: Tensor, wb: Tensor, keys: list[Tensor]) -> Tensor:
        """Index scores ``I [B, bt, sum S_i]`` (unmasked) of a block of queries ``qb [B, bt, Hi, Di]`` with weights
        ``wb [B, bt, Hi]`` (both in the score dtype) over ``keys`` (``[Bk, S_i, Di]`` each, read in place and cast
        one key chunk of ``[B, bt, Hi, kc]`` head scores at a time)."""
        b, bt = qb.shape[:2]
        kc = max(1, _SCORE_ELEMS // (b * bt * self.num_heads))
        wb = wb[:, :, None, :]  # [B, bt, 1, Hi]
        parts = []
        for k in keys:
            for c0 in range(0, k.shape[1], kc):
                kt = k[:, c0 : c0 + kc].to(qb.dtype).transpose(-1, -2)[:, None]  # [Bk, 1, Di, kc]
                sc = torch.relu(torch.matmul(qb, kt) * self.softmax_scale)  # [B, bt, Hi, kc]
                parts.append(torch.matmul(wb, sc).squeeze(-2))  # [B, bt, kc]
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def select(self, x: Tensor, q_resid: Tensor, rope, prefix_keys: list, own_keys: Tensor) -> Selection:
        """Top-``topk`` causal keys for each query ``x [B, T, hidden]`` over ``prefix_keys`` (``[Bk, S_i, Di]``) and
        ``own_keys [B, T, Di]``.

        Blocked over queries (``bt`` rows of ``[B, bt, S]`` index scores at a time) and, within a block, over keys
        (:meth:`scores`): the stored keys are read in place, never copied whole. Keys split over a context-parallel
        group (an entry with ``cp_select``) hand the whole call to it (longstraw.distributed).
        """
        for k in prefix_keys:
            cp_select = getattr(k, "cp_select", None)
            if cp_select is not None:
                return cp_select(self, x, q_resid, rope, prefix_keys, own_keys)
        b, t, _ = x.shape
        acc = _acc_dtype(x.dtype)
        q, w = self.queries(x, q_resid, rope)
        segs = list(prefix_keys) + [own_keys]
        s_pre = sum(k.shape[1] for k in prefix_keys)
        s_all = s_pre + t
        k_eff = min(self.topk, s_all)
        idx = torch.empty(b, t, k_eff, dtype=torch.long, device=x.device)
        valid = torch.empty(b, t, k_eff, dtype=torch.bool, device=x.device)
        bt = max(1, min(t, _SCORE_ELEMS // max(1, b * s_all)))
        key_pos = torch.arange(s_all, device=x.device) - s_pre  # own-token index of each key (< 0: prefix)
        for t0 in range(0, t, bt):
            t1 = min(t, t0 + bt)
            sc = self.scores(q[:, t0:t1].to(acc), w[:, t0:t1], segs)
            future = key_pos[None, :] > torch.arange(t0, t1, device=x.device)[:, None]  # [bt, S]
            vals, ids = sc.masked_fill_(future, float("-inf")).topk(k_eff, dim=-1)
            idx[:, t0:t1] = ids
            valid[:, t0:t1] = vals > float("-inf")
        return Selection(idx, valid)


# ---------------------------------------------------------------------------------------------------- sparse op


def _locate(idx: Tensor, valid: Tensor, offset: int, length: int) -> tuple[Tensor, Tensor]:
    m = valid & (idx >= offset) & (idx < offset + length)
    return m, (idx - offset).clamp_(0, length - 1)


def _gather(lats: tuple[Tensor, ...], offsets: tuple[int, ...], idx: Tensor, valid: Tensor, dtype) -> Tensor:
    """Keys ``[B, bt, K, D]`` of the selected positions ``idx [B, bt, K]`` (zeros where not valid)."""
    b = idx.shape[0]
    keys = None
    for lat, off in zip(lats, offsets):
        flat = lat[:, 0]  # [Bk, S_i, D]
        m, local = _locate(idx, valid, off, flat.shape[1])
        g = flat[0][local] if flat.shape[0] == 1 else flat[torch.arange(b, device=idx.device)[:, None, None], local]
        g = g.to(dtype)
        keys = torch.where(m[..., None], g, 0.0 if keys is None else keys)
    return keys


def _scatter(dkeys: Tensor, targets, lats, offsets, idx: Tensor, valid: Tensor) -> None:
    """Add ``dkeys [B, bt, K, D]`` into each segment's gradient target ``[Bk * S_i, D]`` at the selected rows."""
    b = idx.shape[0]
    for target, lat, off in zip(targets, lats, offsets):
        if target is None:
            continue
        bk, s_i = lat.shape[0], lat.shape[2]
        m, local = _locate(idx, valid, off, s_i)
        if bk > 1:
            local = local + (torch.arange(b, device=idx.device) * s_i)[:, None, None]
        # every slot is added (zeros where it belongs to another segment or is invalid): no data-dependent shapes,
        # so no host sync and the meta-device planner can trace it
        src = torch.where(m[..., None], dkeys, 0.0).to(target.dtype)
        target.index_add_(0, local.reshape(-1), src.reshape(-1, src.shape[-1]))


def _latent_grad_targets(lats, sinks, needs, acc: torch.dtype) -> tuple[list, list]:
    """Where the backward of a sparse latent attention puts each segment's ``d lat``: its sink (the prompt
    state's gradient buffer, filled in place; no returned gradient), a fresh ``acc`` buffer it returns (the
    segment needs a gradient: ``needs[i]``), or nowhere. Returns ``(grads, targets)``, targets as ``[S, D]`` views."""
    grads, targets = [], []
    for lat, sink, need in zip(lats, sinks, needs):
        if sink is not None:
            grads.append(None)
            targets.append(sink.view(-1, sink.shape[-1]))
        elif need:
            g = torch.zeros(lat.shape, dtype=acc, device=lat.device)
            grads.append(g)
            targets.append(g.view(-1, lat.shape[-1]))
        else:
            grads.append(None)
            targets.append(None)
    return grads, targets


class _SparseLatentAttention(torch.autograd.Function):
    """Softmax attention of ``q [B, H, T, D]`` over the selected single-head latents (``K = V``); see
    :func:`sparse_latent_attention`."""

    @staticmethod
    def forward(ctx, q, idx, valid, scale, offsets, sinks, *lats):
        b, h, t, d = q.shape
        acc = _acc_dtype(q.dtype)
        k = idx.shape[-1]
        qt = q.transpose(1, 2)  # [B, T, H, D]
        out = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device)
        lse = torch.empty(b, t, h, dtype=acc, device=q.device)
        bt = max(1, _GATHER_ELEMS // max(1, b * k * (d + h)))
        for t0 in range(0, t, bt):
            sl = slice(t0, min(t, t0 + bt))
            keys = _gather(lats, offsets, idx[:, sl], valid[:, sl], acc)
            s = torch.matmul(qt[:, sl].to(acc), keys.transpose(-1, -2)) * scale  # [B, bt, H, K]
            s = s.masked_fill(~valid[:, sl, None, :], float("-inf"))
            l = torch.logsumexp(s, dim=-1)
            out[:, sl] = torch.matmul(torch.exp(s - l[..., None]), keys).to(q.dtype)
            lse[:, sl] = l
        ctx.save_for_backward(q, idx, valid, out, lse, *lats)
        ctx.scale, ctx.offsets, ctx.sinks, ctx.bt = scale, offsets, sinks, bt
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, idx, valid, out, lse, *lats = ctx.saved_tensors
        acc = lse.dtype
        b, h, t, d = q.shape
        qt, dt = q.transpose(1, 2), dout.transpose(1, 2)
        dq = torch.empty(b, t, h, d, dtype=q.dtype, device=q.device) if ctx.needs_input_grad[0] else None
        grads, targets = _latent_grad_targets(lats, ctx.sinks, ctx.needs_input_grad[6:], acc)
        for t0 in range(0, t, ctx.bt):
            sl = slice(t0, min(t, t0 + ctx.bt))
            keys = _gather(lats, ctx.offsets, idx[:, sl], valid[:, sl], acc)
            qb, do, ob = qt[:, sl].to(acc), dt[:, sl].to(acc), out[:, sl].to(acc)
            s = torch.matmul(qb, keys.transpose(-1, -2)) * ctx.scale
            s = s.masked_fill(~valid[:, sl, None, :], float("-inf"))
            p = torch.exp(s - lse[:, sl, :, None])  # [B, bt, H, K]
            dp = torch.matmul(do, keys.transpose(-1, -2))
            ds = p * (dp - (do * ob).sum(-1, keepdim=True))
            if dq is not None:
                dq[:, sl] = (torch.matmul(ds, keys) * ctx.scale).to(q.dtype)
            if any(x is not None for x in targets):
                dkeys = torch.matmul(ds.transpose(-1, -2), qb) * ctx.scale + torch.matmul(p.transpose(-1, -2), do)
                _scatter(dkeys, targets, lats, ctx.offsets, idx[:, sl], valid[:, sl])
        grads = [None if g is None else g.to(lat.dtype) for g, lat in zip(grads, lats)]
        return (None if dq is None else dq.transpose(1, 2), None, None, None, None, None, *grads)


def sparse_latent_attention(q: Tensor, segments: list[KVSegment], sel: Selection, scale: float) -> Tensor:
    """Attention of ``q [B, H, T, D]`` over the keys ``sel`` picks from the concatenation of ``segments`` (single-
    head latents ``k [Bk, 1, S_i, D]`` with ``v is k``; ``Bk`` 1 or ``B``). Returns ``[B, H, T, D]`` in q's dtype.

    Differentiable w.r.t. ``q`` and the segments' latents; a segment with ``k_grad`` receives its gradient in
    place (gradient sink, the prompt state). Memory: one block of queries' gathered keys and probabilities.
    """
    for s in segments:  # latents split over a context-parallel group compute the call (longstraw.distributed)
        cp_sparse = getattr(s, "cp_sparse_dispatch", None)
        if cp_sparse is not None:
            return cp_sparse(q, segments, sel, scale)
    offsets, lats, sinks = [], [], []
    off = 0
    for s in segments:
        assert s.k is s.v and s.k.shape[1] == 1, "sparse latent attention reads single-head latents (k is v)"
        if s.length == 0:
            continue
        offsets.append(off)
        lats.append(s.k.detach() if s.k_grad is not None else s.k)
        sinks.append(s.k_grad)
        off += s.length
    assert tuple(sel.idx.shape[:2]) == (q.shape[0], q.shape[2]), "one selection row per query"
    return _SparseLatentAttention.apply(q, sel.idx, sel.valid, float(scale), tuple(offsets), tuple(sinks), *lats)


def sparse_latent_attention_reference(q: Tensor, segments: list[KVSegment], sel: Selection, scale: float) -> Tensor:
    """Obviously-correct version: concatenate the latents, mask every key not selected, dense softmax, autograd
    (sinks ignored: gradients flow to the segments' tensors)."""
    b, h, t, _ = q.shape
    k = torch.cat([s.k[:, 0].expand(b, -1, -1) for s in segments if s.length > 0], dim=1)  # [B, S, D]
    hits = torch.zeros(b, t, k.shape[1], dtype=torch.long, device=q.device)
    keep = hits.scatter_add_(-1, sel.idx, sel.valid.long()) > 0  # invalid slots may repeat a valid index
    acc = _acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc)[:, None].transpose(-1, -2)) * scale  # [B, H, T, S]
    s = s.masked_fill(~keep[:, None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), k.to(acc)[:, None]).to(q.dtype)


# ---------------------------------------------------------------------------------------------------- mixer


class SparseMLAttention(MLAttention):
    """MLA with DeepSeek Sparse Attention. ``indexer`` given: a full layer (its state keeps indexer keys);
    ``indexer=None``: a shared layer reusing the selection of layer ``source_index`` (GLM-5).

    ``forward(x, rope: RopeTables, prefix)`` returns ``(y, piece)``: ``piece = (lat, index_keys)`` for a full
    layer, ``lat`` for a shared one; ``prefix`` is an :class:`IndexedPrefix` (full) or a latent segment list."""

    state_type = IndexedLatentState

    def __init__(self, hidden: int, num_heads: int, *, indexer: Indexer | None, index_topk: int, layer_index: int,
                 source_index: int | None = None, **mla):
        super().__init__(hidden, num_heads, **mla)
        if not isinstance(index_topk, int) or index_topk < 1:
            raise ValueError(f"index_topk={index_topk!r} must be an integer >= 1")
        if indexer is None and source_index is None:
            raise ValueError(f"DSA layer {layer_index} shares a selection but has no full indexer layer before it")
        self.indexer = indexer
        self.index_topk, self.layer_index, self.source_index = index_topk, layer_index, source_index

    def new_state(self, capacity: int, exact: bool = False) -> LatentState:
        return IndexedLatentState(capacity) if self.indexer is not None else LatentState(capacity)

    def forward(self, x: Tensor, rope, prefix):
        q_nope, q_pe, lat, q_resid = self.project(x, rope)
        if self.indexer is not None:
            pre = prefix if prefix is not None else IndexedPrefix([], [])
            segs, own_keys = list(pre.latents), self.indexer.keys(x, rope)
            piece = (lat, own_keys)
        else:
            segs, piece = list(prefix or []), lat
        t = x.shape[1]
        # a segment split over a context-parallel group counts its keys alike on every rank (cp_key_count)
        if sum(getattr(s, "cp_key_count", s.length) for s in segs) + t <= self.index_topk:  # all selected: dense
            o = self.attend(q_nope, q_pe, lat, segs)
            return self.output(o), piece
        if self.indexer is not None:
            sel = self.indexer.select(x, q_resid, rope, pre.index_keys, own_keys)
            if isinstance(getattr(rope, "shared", None), dict):
                rope.shared[self.layer_index] = sel
        else:
            shared = getattr(rope, "shared", None)
            if not isinstance(shared, dict) or self.source_index not in shared:
                raise ValueError(f"shared DSA layer {self.layer_index} needs the selection of layer "
                                 f"{self.source_index} from the same forward (rope must be RopeTables)")
            sel = shared[self.source_index]
        qa = self.absorbed_query(q_nope, q_pe)
        o = sparse_latent_attention(qa, segs + [KVSegment(lat, lat)], sel, self.scale)
        return self.output(self.absorbed_output(o)), piece

    def state_bytes_per_position(self, dtype: torch.dtype) -> int:
        """MLA latents plus, for a full layer, the indexer key: ``(r + dr [+ Di]) x dtype bytes``."""
        extra = self.indexer.head_dim if self.indexer is not None else 0
        return super().state_bytes_per_position(dtype) + extra * torch.empty(0, dtype=dtype).element_size()
