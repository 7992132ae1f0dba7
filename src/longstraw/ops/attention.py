"""Attention of new queries over several key/value segments, merged by log-sum-exp.

This one op serves chunked prefill, branch replay and rollout decoding: the queries of the new tokens attend to

* stored prefix segments (the shared prompt state, earlier prefill chunks, already generated tokens): no mask;
* their own segment (the new tokens' keys/values): causal, query t sees keys 0..t of the segment.

Each segment is attended separately by a kernel that returns ``(out_i, lse_i)``; the results are merged with
log-sum-exp weights ``out = sum_i exp(lse_i - lse) out_i`` with ``lse = logsumexp_i lse_i``. The prompt K/V is never
concatenated with the new tokens' K/V (that would copy O(P) per layer per branch and keep the copy alive in the
autograd graph).

Backward (the ring-attention pattern): the gradient of a segment is computed by the kernel's flash-style backward
fed with the MERGED output and the GLOBAL lse, i.e. each segment recomputes its probabilities
``p = exp(s - lse)`` against the global normaliser, and ``D = rowsum(dO * O)`` uses the merged output. Summing the
per-segment ``dq`` gives the exact query gradient; ``dk, dv`` of each segment are exact for that segment.

Gradient sinks: a segment may carry ``k_grad`` / ``v_grad`` accumulators (tensors shaped like ``k`` / ``v``). Its
key/value gradient is then ADDED into them in place during backward instead of being returned through autograd.
The shared prompt state uses this: every branch's backward adds its ``dK, dV`` straight into one prompt-state
gradient buffer, so no O(P) temporary is allocated per branch and the stored K/V never enter an autograd graph.

Segments in host memory (``KVSegment(host=True)``, ``GRPOConfig.offload_state``): each block of such a segment is
copied to the queries' device just before its kernel and dropped after it, in the forward and again in the backward
(the graph saves the host views), so the device holds one block of the prefix at a time
(:mod:`longstraw.ops.host_memory`).

Sliding windows (``window=``): the queries are attended in tiles of at most ``window - 1``, each over the keys its
window reaches, with the masks the kernels have (none, causal, and the causal one on reversed queries and keys for
the window's lower edge; :mod:`longstraw.ops.window`). Keys no query of a tile sees are never read.

Grouped-query attention without copying the prefix: for an unmasked segment, the ``g = Hq / Hkv`` query heads that
share a key head are folded into the query-length axis (``[B, Hkv*g, T, D] -> [1, Hkv, B*g*T, D]`` when the segment
is shared over the batch), so the stored K/V is read in place. Only the small causal own segment is expanded to
``Hq`` heads.

Kernels (``backend``):

* ``"flash_cpu"``: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (any float dtype on CPU;
  its autograd would drop the gradient through lse, which is why we call forward and backward ourselves).
* ``"flash_cuda"``: ``aten._scaled_dot_product_flash_attention`` and its backward (fp16/bf16, head dim <= 256).
* ``"math"``: blockwise pure-torch online-softmax kernel, any device and dtype, memory bounded by a block.

``segment_attention_reference`` is the obviously-correct version: concatenate all segments, build the full mask,
softmax, with plain autograd. Tests hold the fast paths to it.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw.ops.host_memory import prefetched
from longstraw.ops.partitioned import PartitionedSegment
from longstraw.ops.sinks import add_into
from longstraw.ops.window import BAND, CAUSAL, Part, window_matters, window_tiles

__all__ = ["KVSegment", "segment_attention", "segment_attention_reference", "BACKENDS", "default_backend", "kernels",
           "segment_forward", "segment_backward", "merge_partials", "sink_grad", "kv_blocks"]

BACKENDS = ("flash_cpu", "flash_cuda", "math")


@dataclass
class KVSegment:
    """Keys and values that a block of queries attends to.

    k: ``[Bk, Hkv, S, Dk]``, v: ``[Bk, Hkv, S, Dv]``. ``Bk`` is 1 (shared by every sequence of the query batch, like
    the prompt state) or equal to the query batch. ``causal``: this is the queries' own segment (``S == T``); query
    ``t`` sees keys ``0..t``. ``band``: a square piece of a sliding window (``S == T``, query ``t`` sees keys
    ``t..S-1``; :mod:`longstraw.ops.window` makes them). ``k_grad`` / ``v_grad``: optional accumulators shaped
    like ``k`` / ``v`` that receive ``dK`` / ``dV`` in place during backward (see module docstring). ``host``:
    ``k`` / ``v`` are in host memory (``GRPOConfig.offload_state``): each block is copied to the queries' device
    just before its kernel, in the forward and again in the backward (:func:`kv_blocks`; the next block's copy
    overlaps this one's kernels).
    """

    k: Tensor
    v: Tensor
    causal: bool = False
    k_grad: Tensor | None = None
    v_grad: Tensor | None = None
    host: bool = False
    band: bool = False

    @property
    def length(self) -> int:
        return self.k.shape[2]

    @property
    def key_count(self) -> int:
        """Keys this segment contributes to its queries (a partitioned segment counts them alike on every
        process; see :mod:`longstraw.ops.partitioned`)."""
        return self.k.shape[2]


def default_backend(q: Tensor, head_dim: int) -> str:
    """The kernel the op picks for these queries when no backend is given."""
    if q.device.type in ("cpu", "meta"):  # meta: the memory planner's dry run (the kernel has meta shapes)
        return "flash_cpu"
    if q.device.type == "cuda" and q.dtype in (torch.float16, torch.bfloat16) and head_dim <= 256:
        return "flash_cuda"
    return "math"


# ----------------------------------------------------------------------------------------------------------------
# kernels: fwd(q, k, v, causal, scale) -> (o, lse) and bwd(do, q, k, v, o, lse, causal, scale) -> (dq, dk, dv)
# q [B, H, M, D], k [B, H, S, D], v [B, H, S, Dv]; lse [B, H, M] float32 (float64 for float64 inputs).


def _pad_last(x: Tensor, size: int) -> Tensor:
    if x.shape[-1] == size:
        return x
    return torch.nn.functional.pad(x, (0, size - x.shape[-1]))


def _flash_cpu_fwd(q, k, v, causal, scale):
    dk, dv = q.shape[-1], v.shape[-1]
    d = max(dk, dv)  # the aten kernel needs one head size: pad with zeros (scores and outputs unchanged)
    o, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        _pad_last(q, d), _pad_last(k, d), _pad_last(v, d), 0.0, causal, scale=scale
    )
    return o[..., :dv], lse


def _flash_cpu_bwd(do, q, k, v, o, lse, causal, scale):
    dk_, dv_ = q.shape[-1], v.shape[-1]
    d = max(dk_, dv_)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        _pad_last(do, d), _pad_last(q, d), _pad_last(k, d), _pad_last(v, d), _pad_last(o, d), lse, 0.0, causal,
        scale=scale,
    )
    return gq[..., :dk_], gk[..., :dk_], gv[..., :dv_]


def _flash_cuda_fwd(q, k, v, causal, scale):  # pragma: no cover - needs a GPU
    dk, dv = q.shape[-1], v.shape[-1]
    d = max(dk, dv)
    d = (d + 7) // 8 * 8
    out = torch.ops.aten._scaled_dot_product_flash_attention(
        _pad_last(q, d), _pad_last(k, d), _pad_last(v, d), 0.0, causal, False, scale=scale
    )
    o, lse = out[0], out[1]
    return o[..., :dv], lse[..., : q.shape[2]].float()


def _flash_cuda_bwd(do, q, k, v, o, lse, causal, scale):  # pragma: no cover - needs a GPU
    dk_, dv_ = q.shape[-1], v.shape[-1]
    d = max(dk_, dv_)
    d = (d + 7) // 8 * 8
    b, h, m = q.shape[:3]
    s = k.shape[2]
    # philox seed/offset: read only with dropout > 0 (flash_api.cpp mha_bwd: `if (is_dropout)`), so empty ones do.
    # cum_seq_q/k: None, as the dense forward returns them; a defined tensor, even an empty one, sends
    # _flash_attention_backward down the varlen path (`cumulative_sequence_length_q.defined()`).
    dummy = torch.empty(0, device=q.device, dtype=torch.int64)
    gq, gk, gv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
        _pad_last(do, d).contiguous(), _pad_last(q, d), _pad_last(k, d), _pad_last(v, d), _pad_last(o, d).contiguous(),
        lse.contiguous(), None, None, m, s, 0.0, causal, dummy, dummy, scale=scale,
    )
    return gq[..., :dk_], gk[..., :dk_], gv[..., :dv_]


_MATH_BLOCK_ELEMS = 1 << 24  # scores block: at most 16M elements (64 MB in fp32)


def _math_scores(q, k, causal, scale, q0, k0):
    s = torch.matmul(q, k.transpose(-1, -2)).float() if q.dtype != torch.float64 else torch.matmul(q, k.transpose(-1, -2))
    s = s * scale
    if causal:
        qi = torch.arange(q0, q0 + q.shape[2], device=q.device)[:, None]
        kj = torch.arange(k0, k0 + k.shape[2], device=q.device)[None, :]
        s = s.masked_fill(kj > qi, float("-inf"))
    return s


def _math_blocks(b, h, m, s):
    bk = max(64, min(s, _MATH_BLOCK_ELEMS // max(1, b * h * min(m, 4096))))
    bq = max(1, min(m, _MATH_BLOCK_ELEMS // max(1, b * h * bk)))
    return bq, bk


def _math_fwd(q, k, v, causal, scale):
    b, h, m, _ = q.shape
    s_len = k.shape[2]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    bq, bk = _math_blocks(b, h, m, s_len)
    out = torch.empty(b, h, m, v.shape[-1], dtype=q.dtype, device=q.device)
    lse = torch.empty(b, h, m, dtype=acc_dtype, device=q.device)
    for i in range(0, m, bq):
        qi = q[:, :, i : i + bq]
        mx = torch.full(qi.shape[:3], float("-inf"), dtype=acc_dtype, device=q.device)
        den = torch.zeros_like(mx)
        acc = torch.zeros(*qi.shape[:3], v.shape[-1], dtype=acc_dtype, device=q.device)
        k_end = min(s_len, i + bq) if causal else s_len
        for j in range(0, k_end, bk):
            sc = _math_scores(qi, k[:, :, j : j + bk], causal, scale, i, j)
            new_mx = torch.maximum(mx, sc.amax(-1))
            safe = torch.where(torch.isinf(new_mx), torch.zeros_like(new_mx), new_mx)
            p = torch.exp(sc - safe[..., None])
            corr = torch.exp(mx - safe)
            den = den * corr + p.sum(-1)
            acc = acc * corr[..., None] + torch.matmul(p, v[:, :, j : j + bk].to(acc_dtype))
            mx = new_mx
        out[:, :, i : i + bq] = (acc / den[..., None]).to(q.dtype)
        lse[:, :, i : i + bq] = mx + torch.log(den)
    return out, lse


def _math_bwd(do, q, k, v, o, lse, causal, scale):
    b, h, m, _ = q.shape
    s_len = k.shape[2]
    acc_dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    bq, bk = _math_blocks(b, h, m, s_len)
    dq = torch.zeros(q.shape, dtype=acc_dtype, device=q.device)
    dk = torch.zeros(k.shape, dtype=acc_dtype, device=q.device)
    dv = torch.zeros(v.shape, dtype=acc_dtype, device=q.device)
    delta = (do.to(acc_dtype) * o.to(acc_dtype)).sum(-1)  # [B, H, M]
    for i in range(0, m, bq):
        qi, doi = q[:, :, i : i + bq], do[:, :, i : i + bq].to(acc_dtype)
        li, di = lse[:, :, i : i + bq].to(acc_dtype), delta[:, :, i : i + bq]
        k_end = min(s_len, i + bq) if causal else s_len
        for j in range(0, k_end, bk):
            kj, vj = k[:, :, j : j + bk], v[:, :, j : j + bk]
            p = torch.exp(_math_scores(qi, kj, causal, scale, i, j) - li[..., None])
            dv[:, :, j : j + bk] += torch.matmul(p.transpose(-1, -2), doi)
            dp = torch.matmul(doi, vj.to(acc_dtype).transpose(-1, -2))
            ds = p * (dp - di[..., None]) * scale
            dq[:, :, i : i + bq] += torch.matmul(ds, kj.to(acc_dtype))
            dk[:, :, j : j + bk] += torch.matmul(ds.transpose(-1, -2), qi.to(acc_dtype))
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


_KERNELS = {
    "flash_cpu": (_flash_cpu_fwd, _flash_cpu_bwd),
    "flash_cuda": (_flash_cuda_fwd, _flash_cuda_bwd),
    "math": (_math_fwd, _math_bwd),
}


def kernels(backend: str):
    """``(forward, backward)`` of a kernel: ``forward(q, k, v, causal, scale) -> (out, lse)`` and
    ``backward(do, q, k, v, out, lse, causal, scale) -> (dq, dk, dv)`` (shapes in the section above);
    ValueError for an unknown backend."""
    if backend not in _KERNELS:
        raise ValueError(f"unknown attention backend {backend!r}; allowed: {', '.join(BACKENDS)}")
    return _KERNELS[backend]


# ----------------------------------------------------------------------------------------------------------------
# query folding for grouped-query attention


def _fold(x: Tensor, hkv: int, shared: bool) -> Tensor:
    """``[B, Hkv*g, T, ...] -> [1, Hkv, B*g*T, ...]`` (shared segment) or ``[B, Hkv, g*T, ...]``."""
    b, hq, t = x.shape[:3]
    rest = x.shape[3:]
    g = hq // hkv
    x = x.reshape(b, hkv, g, t, *rest)
    if shared and b > 1:
        return x.transpose(0, 1).reshape(1, hkv, b * g * t, *rest)
    return x.reshape(b, hkv, g * t, *rest)


def _unfold(x: Tensor, b: int, hq: int, t: int, shared: bool) -> Tensor:
    hkv = x.shape[1]
    rest = x.shape[3:]
    g = hq // hkv
    if shared and b > 1:
        return x.reshape(hkv, b, g, t, *rest).transpose(0, 1).reshape(b, hq, t, *rest)
    return x.reshape(b, hq, t, *rest)


def _repeat_heads(x: Tensor, g: int) -> Tensor:
    return x if g == 1 else x.repeat_interleave(g, dim=1)


def _band_kv(x: Tensor, b: int, g: int) -> Tensor:
    """A band segment's ``[Bk, Hkv, S, D]`` keys or values as the reversed ``[B, Hq, S, D]`` the causal kernel
    reads (a copy of ``S <= window`` positions)."""
    return _repeat_heads(x.expand(b, *x.shape[1:]), g).flip(2)


def _band_reduce(dx: Tensor, bk: int, hkv: int) -> Tensor:
    """``[B, Hq, S, D]`` reversed gradients of :func:`_band_kv`'s output back to the segment's ``[Bk, Hkv, S, D]``."""
    b, hq = dx.shape[:2]
    dx = dx.flip(2).reshape(b, hkv, hq // hkv, *dx.shape[2:]).sum(2)
    return dx.sum(0, keepdim=True) if bk == 1 and b > 1 else dx


def segment_forward(fwd, q, seg_k, seg_v, causal, scale, band=False):
    """One segment's partial ``(out [B, Hq, T, Dv], lse [B, Hq, T])`` for queries ``q [B, Hq, T, Dk]`` by the kernel
    forward ``fwd`` (see :func:`kernels`): a causal segment's K/V are repeated to the query heads; an unmasked one is
    read in place with the query heads folded onto its key heads; a ``band`` one (``S == T``, query ``t`` sees keys
    ``t..S-1``: :mod:`longstraw.ops.window`) runs the causal kernel on queries and keys both reversed."""
    b, hq, t, _ = q.shape
    hkv = seg_k.shape[1]
    if band:
        g = hq // hkv
        o, lse = fwd(q.flip(2), _band_kv(seg_k, b, g), _band_kv(seg_v, b, g), True, scale)
        return o.flip(2), lse.flip(2)
    if causal:
        g = hq // hkv
        return fwd(q, _repeat_heads(seg_k, g), _repeat_heads(seg_v, g), True, scale)
    shared = seg_k.shape[0] == 1
    o, lse = fwd(_fold(q, hkv, shared), seg_k, seg_v, False, scale)
    return _unfold(o, b, hq, t, shared), _unfold(lse, b, hq, t, shared)


def segment_backward(bwd, do, q, seg_k, seg_v, o, lse, causal, scale, band=False):
    """Backward of :func:`segment_forward` against the MERGED output ``o`` and GLOBAL ``lse`` of all segments:
    ``(dq, dk, dv)``, ``dk, dv`` shaped like the segment's K/V."""
    b, hq, t, _ = q.shape
    hkv = seg_k.shape[1]
    if band:
        g, bk = hq // hkv, seg_k.shape[0]
        r = lambda x: x.flip(2)  # noqa: E731
        dq, dk, dv = bwd(r(do), r(q), _band_kv(seg_k, b, g), _band_kv(seg_v, b, g), r(o), r(lse), True, scale)
        return dq.flip(2), _band_reduce(dk, bk, hkv), _band_reduce(dv, bk, hkv)
    if causal:
        g = hq // hkv
        dq, dk, dv = bwd(do, q, _repeat_heads(seg_k, g), _repeat_heads(seg_v, g), o, lse, True, scale)
        if g > 1:
            dk = dk.reshape(b, hkv, g, *dk.shape[2:]).sum(2)
            dv = dv.reshape(b, hkv, g, *dv.shape[2:]).sum(2)
        return dq, dk, dv
    shared = seg_k.shape[0] == 1
    f = lambda x: _fold(x, hkv, shared)  # noqa: E731
    dq, dk, dv = bwd(f(do), f(q), seg_k, seg_v, f(o), f(lse), False, scale)
    return _unfold(dq, b, hq, t, shared), dk, dv


class _OnlineMerge:
    """Running log-sum-exp merge of per-segment ``(out_i, lse_i)``: two accumulators, however many segments."""

    def __init__(self):
        self.acc: Tensor | None = None
        self.lse: Tensor | None = None
        self.n = 0

    def add(self, o: Tensor, l: Tensor) -> None:
        self.n += 1
        if self.acc is None:
            self.acc, self.lse = o, l
            return
        new = torch.logaddexp(self.lse, l)
        self.acc = self.acc.to(new.dtype) * torch.exp(self.lse - new)[..., None] + o.to(new.dtype) * torch.exp(l - new)[..., None]
        self.lse = new

    def add_sink(self, sink: Tensor) -> None:
        """An attention sink ``sink [Hq]``: one more logit per head in every query's softmax, with a zero value
        (a partial whose output is 0 and whose lse is the sink logit)."""
        s = sink.to(self.lse.dtype).view(1, -1, 1)
        new = torch.logaddexp(self.lse, s)
        self.acc = self.acc.to(new.dtype) * torch.exp(self.lse - new)[..., None]
        self.lse = new

    def result(self, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        return self.acc.to(dtype), self.lse


def merge_partials(outs: list[Tensor], lses: list[Tensor], dtype: torch.dtype, sink: Tensor | None = None
                   ) -> tuple[Tensor, Tensor]:
    """Merge per-segment ``(out_i, lse_i)`` into ``(out, lse)`` (``out`` in ``dtype``); ``sink [Hq]``: an attention
    sink's logits join the merge last (:meth:`_OnlineMerge.add_sink`)."""
    merge = _OnlineMerge()
    for o, l in zip(outs, lses):
        merge.add(o, l)
    if sink is not None:
        merge.add_sink(sink)
    return merge.result(dtype)


def sink_grad(dout: Tensor, out: Tensor, lse: Tensor, sink: Tensor) -> Tensor:
    """The gradient of attention sinks ``sink [Hq]`` from the merged ``out [B, Hq, T, Dv]``, ``lse [B, Hq, T]``
    (the sink included) and ``dout``: ``p_sink = exp(sink - lse)`` per query and ``d out / d sink = -out p_sink``,
    so ``d sink = -sum(dO . O p_sink)`` over the batch and the queries."""
    delta = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [B, Hq, T]
    return -(delta * torch.exp(sink.to(lse.dtype).view(1, -1, 1) - lse)).sum((0, 2)).to(sink.dtype)


class kv_blocks:  # noqa: N801 - used as a function: an iterator that keeps no block past the one it hands over
    """Each segment's ``(k, v)`` where the kernels read them, in order: a ``host`` segment's (one block: the caller
    splits long segments first) copied to ``q``'s device, the next host block's copy issued before this one is
    handed over (:func:`longstraw.ops.host_memory.prefetched`: on a GPU it overlaps this block's kernels); the
    others as they are; None (a segment the caller skips) passes through. Drop each pair before asking for the
    next: two host blocks are then on the device at a time, and none is kept once the last is handed over (an
    iterator object, not a generator, whose suspended frame would hold the block it yielded)."""

    def __init__(self, kv: Sequence[tuple[Tensor, Tensor] | None], host: Sequence[bool], q: Tensor):
        self._kv, self._i = kv, 0
        # every attention call walks its segments through here (each decode step too): nothing in host memory,
        # no prefetch generator
        self._staged = prefetched([p if h else None for p, h in zip(kv, host)], q.device) if any(host) else None

    def __iter__(self) -> Iterator[tuple[Tensor, Tensor] | None]:
        return self

    def __next__(self) -> tuple[Tensor, Tensor] | None:
        if self._i == len(self._kv):
            raise StopIteration
        p = self._kv[self._i]
        self._i += 1
        if self._staged is None:
            return p
        blk = next(self._staged)
        if self._i == len(self._kv):
            next(self._staged, None)  # let the prefetch finish: it holds nothing past the last block
        return blk if blk is not None else p


class _SegmentAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, sink, scale, backend, meta, *kv):
        fwd, _ = _KERNELS[backend]
        merge = _OnlineMerge()
        blocks = kv_blocks([(kv[2 * i], kv[2 * i + 1]) for i in range(len(meta))], [m[3] for m in meta], q)
        for causal, _, _, _, band in meta:
            k, v = next(blocks)
            merge.add(*segment_forward(fwd, q, k, v, causal, scale, band))
            del k, v  # a staged block: freed before the one after the next is copied
        if sink is not None:
            merge.add_sink(sink)
        out, lse = merge.result(q.dtype)
        ctx.save_for_backward(q, out, lse, sink, *kv)
        ctx.scale, ctx.backend, ctx.meta = scale, backend, meta
        ctx.mark_non_differentiable(lse)
        return out, lse

    @staticmethod
    def backward(ctx, dout, _dlse):
        q, out, lse, sink, *kv = ctx.saved_tensors
        _, bwd = _KERNELS[ctx.backend]
        dout = dout.contiguous()
        dq = None
        d_sink = None
        if sink is not None and ctx.needs_input_grad[1]:
            d_sink = sink_grad(dout, out, lse, sink)
        grads: list[Tensor | None] = []
        need = [k_sink is not None or ctx.needs_input_grad[5 + 2 * i] or ctx.needs_input_grad[6 + 2 * i]
                for i, (_, k_sink, _, _, _) in enumerate(ctx.meta)]
        run = [n or ctx.needs_input_grad[0] for n in need]  # a segment with nothing to compute is not copied in
        blocks = kv_blocks([(kv[2 * i], kv[2 * i + 1]) if r else None for i, r in enumerate(run)],
                           [m[3] for m in ctx.meta], q)
        for idx, (causal, k_sink, v_sink, _, band) in enumerate(ctx.meta):
            pair, need_kv = next(blocks), need[idx]
            if pair is None:
                grads += [None, None]
                continue
            k, v = pair
            del pair
            dq_i, dk, dv = segment_backward(bwd, dout, q, k, v, out, lse, causal, ctx.scale, band)
            del k, v
            # the query gradient sums over every segment (a 1M prompt: 32+ blocks): accumulated in float32 for
            # bf16/fp16 queries (float64 stays float64), rounded once at the end
            dq = dq_i.to(lse.dtype) if dq is None else dq.add_(dq_i)
            if k_sink is not None:
                add_into(k_sink, dk)
                add_into(v_sink, dv)
                grads += [None, None]
            elif need_kv:
                grads += [dk, dv]
            else:  # only dq was needed (a detached prefix): free this block's dK/dV now, so the
                grads += [None, None]  # backward's memory stays one block's however long the prefix
            del dk, dv
        return (dq.to(q.dtype) if dq is not None else None, d_sink, None, None, None, *grads)


def _split(seg: KVSegment, size: int) -> list[KVSegment]:
    if seg.causal or seg.band or seg.length <= size:
        return [seg]
    out = []
    for a in range(0, seg.length, size):
        b = min(seg.length, a + size)
        out.append(KVSegment(seg.k[:, :, a:b], seg.v[:, :, a:b], False,
                             seg.k_grad[:, :, a:b] if seg.k_grad is not None else None,
                             seg.v_grad[:, :, a:b] if seg.v_grad is not None else None, seg.host))
    return out


def segment_attention(
    q: Tensor,
    segments: list[KVSegment],
    scale: float,
    *,
    backend: str | None = None,
    return_lse: bool = False,
    max_segment: int = 32768,
    window: int | None = None,
    sinks: Tensor | None = None,
):
    """Attention of ``q`` over the concatenation of ``segments``, computed per segment and merged by LSE.

    q: ``[B, Hq, T, Dk]``; segments: see :class:`KVSegment` (``Hq`` a multiple of each segment's ``Hkv``), in
    position order. Returns ``out [B, Hq, T, Dv]`` in q's dtype (and ``lse [B, Hq, T]`` in float32/float64 if
    ``return_lse``). Differentiable w.r.t. q and each segment's k, v (or accumulated into its sinks).
    Unmasked segments longer than ``max_segment`` keys are attended in blocks (views, no copy), so that no
    temporary of the kernels (in particular the backward's ``dK, dV`` before they reach a sink) exceeds one block:
    memory stays bounded at any prompt length.

    ``window``: a sliding window (the query at position ``p`` sees keys ``p - window < k <= p``; the last segment
    is the queries' own, causal, and the others are contiguous before it). The queries are then attended in tiles
    of at most ``window - 1`` (:mod:`longstraw.ops.window`), each over the keys its window reaches: keys that no
    query of a tile sees are never read.

    ``sinks``: attention sinks ``[Hq]`` (GPT-OSS): one learned logit per head joins every query's softmax with a
    zero value, so the weights of the real keys sum to less than one; differentiable.
    """
    for s in segments:  # a segment partitioned over processes computes the whole call (ops/partitioned.py)
        if isinstance(s, PartitionedSegment):
            return s.attention(q, segments, scale, backend=backend, return_lse=return_lse, max_segment=max_segment,
                               window=window, sinks=sinks)
    nonempty = [s for s in segments if s.key_count > 0]
    if window is not None:
        if not nonempty or not nonempty[-1].causal or any(s.causal for s in nonempty[:-1]):
            raise ValueError("sliding-window attention needs the queries' own causal segment last, after the prefix")
        if window_matters(sum(s.key_count for s in nonempty[:-1]), q.shape[2], window):
            return _windowed(q, nonempty, scale, window, backend, return_lse, max_segment, sinks)
    out, lse = _attend(q, segments, scale, backend, max_segment, sinks)
    return (out, lse) if return_lse else out


def _part(seg: KVSegment, part: Part) -> KVSegment:
    """The keys of ``part`` as a segment: views of ``seg`` (and of its sinks) under the part's mask."""
    sl = slice(part.start, part.end)
    return KVSegment(seg.k[:, :, sl], seg.v[:, :, sl], part.kind == CAUSAL,
                     seg.k_grad[:, :, sl] if seg.k_grad is not None else None,
                     seg.v_grad[:, :, sl] if seg.v_grad is not None else None, seg.host, part.kind == BAND)


def _windowed(q, segments, scale, window, backend, return_lse, max_segment, sinks=None):
    """Sliding-window attention: each tile of :func:`~longstraw.ops.window.window_tiles` is one merged call over
    views of the segments; outputs (and LSEs) concatenated over the query axis."""
    outs, lses = [], []
    for tile in window_tiles([s.length for s in segments[:-1]], q.shape[2], window):
        parts = [_part(segments[p.segment], p) for p in tile.parts]
        o, l = _attend(q[:, :, tile.q_start : tile.q_end], parts, scale, backend, max_segment, sinks)
        outs.append(o)
        lses.append(l)
    out, lse = (outs[0], lses[0]) if len(outs) == 1 else (torch.cat(outs, 2), torch.cat(lses, 2))
    return (out, lse) if return_lse else out


def _attend(q, segments, scale, backend, max_segment, sinks=None):
    """``(out, lse)`` of one merged call over local segments (blocks of ``max_segment`` keys)."""
    segments = [piece for s in segments if s.length > 0 for piece in _split(s, max_segment)]
    if not segments:
        raise ValueError("segment_attention needs at least one non-empty key/value segment")
    b, hq, t, d = q.shape
    for s in segments:
        bk, hkv = s.k.shape[:2]
        assert bk in (1, b), f"segment batch {bk} must be 1 or the query batch {b}"
        assert hq % hkv == 0, f"query heads {hq} not a multiple of key heads {hkv}"
        assert s.k.shape[-1] == d and s.v.shape[:3] == s.k.shape[:3]
        if s.causal:
            assert s.length == t and bk == b, "a causal segment holds the queries' own tokens"
        if s.band:
            assert s.length == t and not s.causal, "a band segment is square"
        assert (s.k_grad is None) == (s.v_grad is None)
    if sinks is not None and tuple(sinks.shape) != (hq,):
        raise ValueError(f"sinks must be [Hq={hq}] (one logit per query head), got shape {tuple(sinks.shape)}")
    if backend is None:
        backend = default_backend(q, max(d, segments[0].v.shape[-1]))
    kernels(backend)  # ValueError for an unknown one
    meta = tuple((s.causal, s.k_grad, s.v_grad, s.host, s.band) for s in segments)
    kv = []
    for s in segments:
        if s.k_grad is not None:  # sink segments are read-only data for autograd
            kv += [s.k.detach(), s.v.detach()]
        else:
            kv += [s.k, s.v]
    return _SegmentAttention.apply(q.contiguous(), sinks, float(scale), backend, meta, *kv)


def segment_attention_reference(q: Tensor, segments: list[KVSegment], scale: float, return_lse: bool = False,
                                window: int | None = None, sinks: Tensor | None = None):
    """Slow reference: concatenate all segments, full mask, softmax in float64-or-float32, plain autograd.

    Sinks are ignored (gradients flow to ``k``/``v`` through autograd instead). ``window``: the queries' own causal
    segment is last; the query at position ``p`` (its own segment starts after every other key) sees keys
    ``p - window < k <= p``. ``sinks [Hq]``: one more logit per head in every softmax, with a zero value.
    """
    b, hq, t, _ = q.shape
    ks, vs, masks = [], [], []
    for s in segments:
        if s.length == 0:
            continue
        g = hq // s.k.shape[1]
        ks.append(s.k.repeat_interleave(g, dim=1).expand(b, -1, -1, -1))
        vs.append(s.v.repeat_interleave(g, dim=1).expand(b, -1, -1, -1))
        if s.causal:
            masks.append(torch.ones(t, s.length, dtype=torch.bool, device=q.device).tril())
        else:
            masks.append(torch.ones(t, s.length, dtype=torch.bool, device=q.device))
    k, v, mask = torch.cat(ks, 2), torch.cat(vs, 2), torch.cat(masks, 1)
    if window is not None:
        assert segments[-1].causal, "a windowed call's own causal segment is last"
        qpos = torch.arange(k.shape[2] - t, k.shape[2], device=q.device)[:, None]
        kpos = torch.arange(k.shape[2], device=q.device)[None, :]
        mask = mask & (kpos > qpos - window)
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    scores = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(acc).view(1, -1, 1, 1).expand(b, -1, t, 1)], -1)
        v = torch.cat([v, v.new_zeros(b, v.shape[1], 1, v.shape[3])], 2)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.matmul(torch.softmax(scores, dim=-1), v.to(acc)).to(q.dtype)
    return (out, lse) if return_lse else out


def attention_flops(q_len: int, k_len: int, heads: int, head_dim: int, causal: bool) -> float:
    """Forward FLOPs of one attention call (two matmuls), for throughput accounting."""
    pairs = q_len * k_len if not causal else q_len * (q_len + 1) / 2
    return 4.0 * heads * head_dim * pairs

