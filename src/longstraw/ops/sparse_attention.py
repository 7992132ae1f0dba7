"""Sparse attention over selected single-head latents (DeepSeek Sparse Attention's attention step), as an op.

Each query ``t`` attends only the keys a selection picked for it (``Selection``: ``idx [B, T, K]`` positions in
the concatenation of the key segments, ``valid [B, T, K]``). The keys are MLA latents in the absorbed form: one
latent head, ``K = V = lat = [c_kv | k_pe]`` (``D = r + dr``), shared by the ``H`` query heads::

    s[t, h, j] = scale * q[t, h] . lat[idx[t, j]]          for valid j, -inf otherwise
    o[t, h]    = sum_j softmax_j(s[t, h, :]) lat[idx[t, j]]

The kernel works on PARTIALS, like ``ops.attention``'s segments: :func:`partial_forward` attends the queries over
the selected keys that lie in some of the segments (``valid`` restricted to them) and returns ``(o, lse)``; partials
over disjoint key sets merge by log-sum-exp (:func:`merge_partials`), and :func:`partial_backward` back-propagates one
partial against the MERGED output and GLOBAL ``lse`` (the ring-attention pattern). The single-process op below is
one partial over all segments; the context-parallel op (``longstraw.distributed``) merges one partial per process
that owns some of the selected keys. Memory: one block of queries' gathered keys and probabilities.

Gradients of the latents go into a gradient *sink* when the segment has one (the prompt state's buffer, filled in
place: no O(P) tensor enters the autograd graph), else into a returned tensor. ``sparse_latent_attention_reference``
is the obviously-correct version (dense softmax with a mask, plain autograd); tests hold the op to it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw.ops import meta
from longstraw.ops.attention import KVSegment
from longstraw.ops.partitioned import PartitionedSegment
from longstraw.ops.sinks import index_add_into

__all__ = ["Selection", "sparse_latent_attention", "sparse_latent_attention_reference", "partial_forward",
           "partial_backward", "merge_partials", "gather_keys", "scatter_keys", "latent_grad_targets"]

GATHER_ELEMS = 1 << 24  # per query block: gathered keys + probabilities, ~16M elements
_NEG = float("-inf")


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Accumulation dtype of scores and softmax: float64 for float64, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass
class Selection:
    """Top-k keys of each query: ``idx [B, T, K]`` into the concatenated key axis (prefix segments in order, then
    the queries' own tokens) and ``valid [B, T, K]`` (False where a query sees fewer than ``K`` keys)."""

    idx: Tensor
    valid: Tensor


def _locate(idx: Tensor, valid: Tensor, offset: int, length: int) -> tuple[Tensor, Tensor]:
    m = valid & (idx >= offset) & (idx < offset + length)
    return m, (idx - offset).clamp_(0, length - 1)


def gather_keys(lats: tuple[Tensor, ...], offsets: tuple[int, ...], idx: Tensor, valid: Tensor, dtype) -> Tensor:
    """Keys ``[B, bt, K, D]`` of the selected positions ``idx [B, bt, K]`` from segments ``lats`` (``[Bk, 1, S_i,
    D]`` at concatenated ``offsets``; zeros where not valid)."""
    b = idx.shape[0]
    keys = None
    for lat, off in zip(lats, offsets):
        flat = lat[:, 0]  # [Bk, S_i, D]
        m, local = _locate(idx, valid, off, flat.shape[1])
        g = flat[0][local] if flat.shape[0] == 1 else flat[torch.arange(b, device=idx.device)[:, None, None], local]
        g = g.to(dtype)
        keys = torch.where(m[..., None], g, 0.0 if keys is None else keys)
    return keys


def scatter_keys(dkeys: Tensor, targets, lats, offsets, idx: Tensor, valid: Tensor) -> None:
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
        src = torch.where(m[..., None], dkeys, 0.0)
        index_add_into(target, local.reshape(-1), src.reshape(-1, src.shape[-1]))


def latent_grad_targets(lats, sinks, needs, acc: torch.dtype) -> tuple[list, list]:
    """Where a backward puts each segment's ``d lat``: its sink (the prompt state's gradient buffer, filled in
    place; no returned gradient), a fresh ``acc`` buffer it returns (the segment needs a gradient: ``needs[i]``), or
    nowhere. Returns ``(grads, targets)``, targets as flat ``[Bk * S, D]`` views."""
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


def _block(b: int, k: int, d: int, h: int) -> int:
    return max(1, GATHER_ELEMS // max(1, b * k * (d + h)))


def partial_forward(qt: Tensor, lats: tuple[Tensor, ...], offsets: tuple[int, ...], idx: Tensor, valid: Tensor,
                    scale: float, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """Attention of ``qt [B, T, H, D]`` (query-major) over the selected keys ``idx/valid [B, T, K]`` that lie in
    ``lats`` (``valid`` restricted to them): ``o [B, T, H, D]`` and ``lse [B, T, H]`` in ``acc``; a row with no
    such key gives ``(0, -inf)``."""
    b, t, h, d = qt.shape
    o = torch.empty(b, t, h, d, dtype=acc, device=qt.device)
    lse = torch.empty(b, t, h, dtype=acc, device=qt.device)
    bt = _block(b, idx.shape[-1], d, h)
    starts = range(0, t, bt)
    for i, t0 in enumerate(starts):
        if meta.skip_repeated_block(qt, i, (0, len(starts) - 1)):  # the planner's dry run (ops/meta.py)
            continue
        sl = slice(t0, min(t, t0 + bt))
        keys = gather_keys(lats, offsets, idx[:, sl], valid[:, sl], acc)  # [B, bt, K, D]
        s = torch.matmul(qt[:, sl].to(acc), keys.transpose(-1, -2)) * scale  # [B, bt, H, K]
        s = s.masked_fill(~valid[:, sl, None, :], _NEG)
        ls = torch.logsumexp(s, dim=-1)
        safe = torch.where(torch.isinf(ls), 0.0, ls)
        o[:, sl] = torch.matmul(torch.exp(s - safe[..., None]), keys)
        lse[:, sl] = ls
    return o, lse


def partial_backward(qt: Tensor, dt: Tensor, ot: Tensor, lse: Tensor, lats: tuple[Tensor, ...],
                     offsets: tuple[int, ...], idx: Tensor, valid: Tensor, scale: float,
                     targets: list[Tensor | None]) -> Tensor:
    """Backward of :func:`partial_forward` against the MERGED ``ot [B, T, H, D]`` and global ``lse [B, T, H]``
    (``dt``: the output gradient; rows padded with ``dO = 0`` add nothing): returns ``dq [B, T, H, D]`` in
    ``lse``'s dtype and adds the keys' gradient into ``targets`` (flat ``[Bk * S_i, D]`` per lat, or None)."""
    acc = lse.dtype
    b, t, h, d = qt.shape
    dq = torch.empty(b, t, h, d, dtype=acc, device=qt.device)
    bt = _block(b, idx.shape[-1], d, h)
    starts = range(0, t, bt)
    for i, t0 in enumerate(starts):
        if meta.skip_repeated_block(qt, i, (0, len(starts) - 1)):  # the planner's dry run (ops/meta.py)
            continue
        sl = slice(t0, min(t, t0 + bt))
        keys = gather_keys(lats, offsets, idx[:, sl], valid[:, sl], acc)
        qb, do, ob = qt[:, sl].to(acc), dt[:, sl].to(acc), ot[:, sl].to(acc)
        s = torch.matmul(qb, keys.transpose(-1, -2)) * scale
        s = s.masked_fill(~valid[:, sl, None, :], _NEG)
        p = torch.exp(s - lse[:, sl, :, None])  # [B, bt, H, K]
        dp = torch.matmul(do, keys.transpose(-1, -2))
        ds = p * (dp - (do * ob).sum(-1, keepdim=True))
        dq[:, sl] = torch.matmul(ds, keys) * scale
        if any(x is not None for x in targets):
            dkeys = torch.matmul(ds.transpose(-1, -2), qb) * scale + torch.matmul(p.transpose(-1, -2), do)
            scatter_keys(dkeys, targets, lats, offsets, idx[:, sl], valid[:, sl])
    return dq


def merge_partials(os_: list[Tensor], ls: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Log-sum-exp merge of partials ``o [.., H, D]``, ``lse [.., H]`` (``-inf``: no key), in list order; a row
    that no partial covers stays ``(0, -inf)``."""
    if len(os_) == 1:
        return os_[0], ls[0]
    lse = torch.stack(ls)
    total = torch.logsumexp(lse, dim=0)
    wts = torch.exp(lse - torch.where(torch.isinf(total), 0.0, total))[..., None]
    return (torch.stack(os_) * wts).sum(0), total


class _SparseLatentAttention(torch.autograd.Function):
    """One partial over every segment (see the module docstring): ``q [B, H, T, D]`` -> ``[B, H, T, D]``."""

    @staticmethod
    def forward(ctx, q, idx, valid, scale, offsets, sinks, *lats):
        acc = acc_dtype(q.dtype)
        qt = q.transpose(1, 2)  # [B, T, H, D]
        o, lse = partial_forward(qt, lats, offsets, idx, valid, scale, acc)
        out = o.to(q.dtype)
        ctx.save_for_backward(q, idx, valid, out, lse, *lats)
        ctx.scale, ctx.offsets, ctx.sinks = scale, offsets, sinks
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, dout):
        q, idx, valid, out, lse, *lats = ctx.saved_tensors
        grads, targets = latent_grad_targets(lats, ctx.sinks, ctx.needs_input_grad[6:], lse.dtype)
        dq = partial_backward(q.transpose(1, 2), dout.transpose(1, 2), out, lse, tuple(lats), ctx.offsets, idx, valid,
                              ctx.scale, targets)
        dq = dq.to(q.dtype).transpose(1, 2) if ctx.needs_input_grad[0] else None
        grads = [None if g is None else g.to(lat.dtype) for g, lat in zip(grads, lats)]
        return (dq, None, None, None, None, None, *grads)


def sparse_latent_attention(q: Tensor, segments: list[KVSegment], sel: Selection, scale: float) -> Tensor:
    """Attention of ``q [B, H, T, D]`` over the keys ``sel`` picks from the concatenation of ``segments`` (single-
    head latents ``k [Bk, 1, S_i, D]`` with ``v is k``; ``Bk`` 1 or ``B``). Returns ``[B, H, T, D]`` in q's dtype.

    Differentiable w.r.t. ``q`` and the segments' latents; a segment with ``k_grad`` receives its gradient in
    place (gradient sink, the prompt state). A :class:`~longstraw.ops.partitioned.PartitionedSegment` first
    segment (latents split over processes) computes the whole call.
    """
    if segments and isinstance(segments[0], PartitionedSegment):
        return segments[0].sparse_attention(q, segments, sel, scale)
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
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc)[:, None].transpose(-1, -2)) * scale  # [B, H, T, S]
    s = s.masked_fill(~keep[:, None], float("-inf"))
    return torch.matmul(torch.softmax(s, dim=-1), k.to(acc)[:, None]).to(q.dtype)
