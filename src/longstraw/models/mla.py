"""Multi-head Latent Attention (DeepSeek-V3, GLM-5) as a token mixer over a compressed prompt state.

Per token ``t`` (``r = kv_lora_rank``, ``dr = qk_rope_head_dim``, ``dn = qk_nope_head_dim``, ``dv = v_head_dim``)::

    [c_t | kpe_t] = kv_a_proj_with_mqa(x_t);  c_t = RMSNorm(c_t) [r];  kpe_t = RoPE(kpe_t) [dr], shared by all heads
    q_t,h = [q_nope (dn) | RoPE(q_pe) (dr)]       (q_proj, or q_a_proj -> RMSNorm -> q_b_proj)
    k_s,h = [W_UK,h c_s | kpe_s],  v_s,h = W_UV,h c_s          (kv_b_proj.weight = [W_UK,h; W_UV,h] per head)
    y_t   = o_proj(concat_h softmax_s(scale q_t,h . k_s,h) v_s,h)

RoPE is interleaved (pairs ``(x0, x1), ...``) and returned de-interleaved (``rope_interleave``, always on for
DeepSeek-V3.2 / GLM-5); ``scale = qk_head_dim^-0.5 * mscale^2`` with ``mscale = 0.1 mscale_all_dim ln(factor) + 1``
when the RoPE type is not ``default`` and ``mscale_all_dim`` is set (yarn checkpoints). ``rope=False``
(Kimi-Linear's NoPE MLA) rotates nothing: ``kpe`` and ``q_pe`` are used as projected, and the layer reads no
positions. ``head_gate=True`` (Ling 3.0) scales each head's output by ``sigmoid(g_proj(x_t))_h`` before ``o_proj``
(one scalar per head and token, after the attention: every attention form and CP path is unchanged). The
projection norms (``q_a_layernorm``, ``kv_a_layernorm``) use eps 1e-6 whatever ``rms_norm_eps`` says, as
transformers does.

The prompt state (:class:`LatentState`) keeps ``lat_s = [c_s | kpe_s]`` per position: ``r + dr`` values, never the
decompressed ``H (dn + dr + dv)`` (DeepSeek-V3: 576 vs 40,960 values per position and layer). New tokens attend to
stored latents in one of two exact forms:

``absorbed``
    queries are projected into the latent space, ``q~_t,h = [q_nope W_UK,h | q_pe]`` (``r + dr``), scored against
    ``lat_s`` directly and the output ``o~ = sum_s p lat_s`` is mapped back per head, ``o = W_UV,h o~[:r]``. All
    heads share one latent "key head", so ``segment_attention`` reads the stored latents in place (query heads
    folded into the query axis, ``K = V = lat``: no padding copy, the output's last ``dr`` channels are dropped), and
    in exact mode their gradient is added into the state's buffer (gradient sink): nothing O(P) enters a graph.
    With autograd on CPU the latent head is spread over a few stride-0 views so that the flash backward uses every
    core (it parallelises over key heads only).
``decompressed``
    ``decompress_chunk`` stored positions at a time are expanded to per-head K/V, attended, merged online by
    log-sum-exp and freed; the backward expands each chunk again and maps ``dK, dV`` back to ``d lat`` (into the
    sink) and ``d kv_b_proj``. Peak extra memory: one chunk's K/V, forward and backward.

Multiply-adds per (query, key, head): absorbed ``2 (r + dr)``; decompressed ``dn + dr + dv``, plus ``H r (dn + dv)``
per stored key for the expansion. Absorbed wins when few queries share the prefix (decoding: 5-16x on CPU;
replays of up to a few hundred tokens), decompressed when many do (prefill chunks of >= 512 tokens, 1K-token
replays: up to 2.2x). ``mode``
``"auto"`` (the default) picks per call from this FLOP count, charging the decompressed form its measured lower
efficiency (:data:`DECOMPRESS_FLOP_PENALTY`, 2x; 2.5x with a backward); ``"absorbed"`` / ``"decompressed"`` force
one form (:func:`set_mla_mode`). docs/MLA.md has the measurements.

Left out: tensor-parallel head splits (applied from outside), FP8 latents, the fused FlashMLA kernels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longstraw.models.lora import linear_weight
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RopeParams, apply_rope, apply_rope_interleaved
from longstraw.models.context import CallContext
from longstraw.ops import meta
from longstraw.ops.attention import (KVSegment, default_backend, kernels, segment_attention, segment_backward,
                                     segment_forward)
from longstraw.ops.partitioned import PartitionedSegment
from longstraw.ops.sinks import add_into, new_sink, offloads, read
from longstraw.state import grad_dtype_for

MODES = ("auto", "absorbed", "decompressed")
DEFAULT_MODE = "auto"
_DECOMPRESS_ELEMS = 1 << 24  # one decompressed chunk holds at most ~16M K/V elements
_QUERY_ELEMS = 1 << 26  # one query block's partial output / gradient in the decompressed form: at most ~64M elements
# measured on CPU (docs/MLA.md): per FLOP the decompressed form runs about half as fast as the absorbed one (more,
# smaller kernel calls; the expansion einsums; V padded to the key size per chunk), and slower still with its
# backward (every chunk expanded again, four more einsums), so "auto" decompresses only when that divides the
# forward FLOPs by these factors
DECOMPRESS_FLOP_PENALTY = 2.0
DECOMPRESS_FLOP_PENALTY_GRAD = 2.5


def mla_softmax_scale(rope: RopeParams, qk_head_dim: int) -> float:
    """``qk_head_dim^-0.5``, times ``mscale^2`` for scaled RoPE with ``mscale_all_dim`` (DeepSeek's yarn configs):
    the attention temperature correction is applied to the scores once per side of the dot product."""
    scale = qk_head_dim**-0.5
    if rope.rope_type != "default":
        m_all = rope.extra.get("mscale_all_dim") or 0
        if m_all:
            factor = rope.extra.get("factor")
            if factor is None:
                raise ValueError(f"rope_type {rope.rope_type!r} with mscale_all_dim={m_all} needs 'factor'")
            if factor > 1:
                m = 0.1 * m_all * math.log(factor) + 1.0
                scale = scale * m * m
    return scale


# ---------------------------------------------------------------------------------------------------- state


@dataclass
class LatentState:
    """MLA prompt state: ``lat [1, 1, P, r + dr]`` = normalised latent ``c_kv`` and roped ``k_pe`` per position.

    Stored as one single-head tensor so that it is directly the key AND value of a :class:`KVSegment` in the
    absorbed form. ``grad`` (exact mode) has the same shape (float32 for low-precision states) and is the sink of
    both the key and the value gradient of every later token.
    """

    capacity: int
    lat: Tensor | None = None
    grad: Tensor | None = None
    length: int = 0
    grad_offload: bool = False

    def write(self, piece: Tensor, start: int, end: int) -> None:
        assert piece.shape[0] == 1 and piece.shape[2] == end - start, "prefill writes one sequence per chunk"
        if self.lat is None:
            self.lat = piece.new_empty(1, 1, self.capacity, piece.shape[3])
        self.lat[:, :, start:end] = piece
        self.length = max(self.length, end)

    def enable_grad(self, dtype: torch.dtype | None = None, offload: bool = False) -> None:
        if self.lat is not None:
            self.grad_offload = offload
            self.grad = new_sink(self.lat, dtype or grad_dtype_for(self.lat.dtype), offload)

    def release_grad(self) -> None:
        self.grad = None

    def prefix(self, length: int, grad: bool) -> list[KVSegment]:
        return self.segments(length, grad)

    def segments(self, length: int, grad: bool) -> list[KVSegment]:
        """``[KVSegment(k=v=lat[:length], sinks=grad[:length])]`` (empty for ``length == 0``)."""
        if length == 0 or self.lat is None:
            return []
        assert length <= self.length
        lat = self.lat[:, :, :length]
        g = self.grad[:, :, :length] if grad and self.grad is not None else None
        return [KVSegment(lat, lat, k_grad=g, v_grad=g)]

    def backward_roots(self, piece: Tensor, start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        return [(piece, read(self.grad[:, :, start:end], piece))]

    def nbytes(self) -> int:
        return 0 if self.lat is None else self.lat.numel() * self.lat.element_size()

    def grad_nbytes(self) -> int:
        return 0 if self.grad is None else self.grad.numel() * self.grad.element_size()

    def grad_host_nbytes(self) -> int:
        return self.grad_nbytes() if self.lat is not None and offloads(self.lat, self.grad_offload) else 0

    def decoder(self, batch: int, max_new: int) -> "LatentDecoder":
        return LatentDecoder(self, batch, max_new)


class LatentDecoder:
    """Decoding ``batch`` branches: the shared prompt latents (batch 1, read in place) plus per-branch latents of
    the generated tokens ``[batch, 1, max_new, r + dr]``."""

    def __init__(self, prompt: LatentState, batch: int, max_new: int):
        self.prompt, self.batch, self.max_new = prompt, batch, max_new
        self.lat: Tensor | None = None

    def prefix(self, step: int) -> list[KVSegment]:
        segs = self.prompt.segments(self.prompt.length, False)
        if step > 0:
            lat = self.lat[:, :, :step]
            segs.append(KVSegment(lat, lat))
        return segs

    def append(self, piece: Tensor, step: int) -> None:
        if self.lat is None:
            self.lat = piece.new_empty(self.batch, 1, self.max_new, piece.shape[3])
        self.lat[:, :, step : step + piece.shape[2]] = piece

    def select(self, rows: Tensor) -> None:
        self.batch = int(rows.numel())
        if self.lat is not None:
            self.lat = self.lat[rows]


# ---------------------------------------------------------------------------------------------------- decompressed


def _expand(lat: Tensor, w_uk: Tensor, w_uv: Tensor) -> tuple[Tensor, Tensor]:
    """latents ``[Bk, S, r + dr]`` -> ``k [Bk, H, S, dn + dr]``, ``v [Bk, H, S, dv]`` (``w_uk [H, dn, r]``,
    ``w_uv [H, dv, r]``)."""
    r = w_uk.shape[-1]
    c, kpe = lat[..., :r], lat[..., r:]
    k_nope = torch.einsum("bsr,hdr->bhsd", c, w_uk)
    k = torch.cat((k_nope, kpe[:, None].expand(-1, w_uk.shape[0], -1, -1)), dim=-1)
    return k, torch.einsum("bsr,hvr->bhsv", c, w_uv)


def _chunks(length: int, size: int):
    return [(s, min(length, s + size)) for s in range(0, length, size)]


def _query_blocks(q: Tensor, width: int, shared: bool) -> list[tuple[slice, slice]]:
    """``(batch, rows)`` slices of ``q [B, H, N, .]`` per kernel call: at most ~64M elements of ``rows x H x width``
    per block (its partial output / gradient), so that a call with many queries (a context-parallel step ships
    every rank's piece to every share) keeps its per-block transients bounded. Over a ``shared`` (batch-1) chunk
    each batch row is its own block, read in place (no fold of the batch into the query axis)."""
    per = q.shape[1] * width * (1 if shared else q.shape[0])
    rows = [(a, b) for a, b in _chunks(q.shape[2], max(1, _QUERY_ELEMS // max(1, per)))]
    if shared and q.shape[0] > 1:
        return [(slice(i, i + 1), slice(a, b)) for i in range(q.shape[0]) for a, b in rows]
    return [(slice(None), slice(a, b)) for a, b in rows]


def decompressed_partial(fwd, q: Tensor, lat: Tensor, w_uk: Tensor, w_uv: Tensor, scale: float, chunk: int,
                         acc: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
    """Unmasked attention of ``q [B, H, N, dn + dr]`` over stored latents ``lat [Bk, 1, S, r + dr]`` (``Bk`` 1 or
    ``B``), expanded ``chunk`` positions at a time into ``K [Bk, H, c, dn + dr]``, ``V [Bk, H, c, dv]`` (each chunk
    once) and merged online, in place, by log-sum-exp into ``acc = (out [B, H, N, dv], lse [B, H, N])`` (float32 /
    float64 accumulators, updated in place; None: start empty), one block of query rows at a time. Returns
    ``(out, lse)``; an empty ``lat`` and no ``acc`` give ``(0, -inf)``.

    Transient per (chunk, query block): one chunk's K/V (``chunk x H (dn + dr + dv)`` values) and the block's partial
    output and merge weights (``~64M`` elements at most: :func:`_query_blocks`). On the meta device (the planner's
    dry run) only the first and the last chunk run (``ops.meta.skip_repeated_block``): every chunk allocates alike
    and leaves nothing but what it merged into ``acc``."""
    if acc is None:
        ldt = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_zeros(*q.shape[:3], w_uv.shape[1], dtype=ldt)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=ldt, device=q.device)
    else:
        out, lse = acc
    blocks = _query_blocks(q, max(q.shape[-1], w_uv.shape[1]), lat.shape[0] == 1)
    chunks = _chunks(lat.shape[2], chunk)
    for i, (s, e) in enumerate(chunks):
        if meta.skip_repeated_block(q, i, (0, len(chunks) - 1)):
            continue
        k, v = _expand(lat[:, 0, s:e], w_uk, w_uv)
        for bi, rows in blocks:
            o, l = segment_forward(fwd, q[bi, :, rows], k, v, False, scale)
            lb, ob = lse[bi, :, rows], out[bi, :, rows]
            new = torch.logaddexp(lb, l)
            ob.mul_(torch.exp(lb - new)[..., None]).add_(o.to(ob.dtype) * torch.exp(l - new)[..., None])
            lb.copy_(new)
            del o, l, new
        del k, v
    return out, lse


def decompressed_partial_backward(bwd, dout: Tensor, q: Tensor, lat: Tensor, w_uk: Tensor, w_uv: Tensor, out: Tensor,
                                  lse: Tensor, scale: float, chunk: int, sink: Tensor | None,
                                  dw: tuple[Tensor, Tensor] | None) -> Tensor:
    """Backward of :func:`decompressed_partial` against the MERGED ``out [B, H, N, dv]`` and GLOBAL ``lse``
    (ring-attention pattern), each chunk expanded again (once) and its query blocks run in turn: returns
    ``dq [B, H, N, dn + dr]`` (``lse``'s dtype); adds ``d lat`` into ``sink [Bk, 1, S, r + dr]`` and
    ``(d W_UK, d W_UV)`` into ``dw`` (either may be None: skipped). Transient per (chunk, query block): the chunk's
    K/V and their gradient, the block's ``dq``."""
    r, dn = w_uk.shape[-1], w_uk.shape[1]
    dq = torch.zeros(q.shape, dtype=lse.dtype, device=q.device)
    wdt = dw[0].dtype if dw is not None else sink.dtype if sink is not None else lse.dtype
    blocks = _query_blocks(q, max(q.shape[-1], w_uv.shape[1]), lat.shape[0] == 1)
    chunks = _chunks(lat.shape[2], chunk)
    for i, (s, e) in enumerate(chunks):
        if meta.skip_repeated_block(q, i, (0, len(chunks) - 1)):
            continue
        c = lat[:, 0, s:e]
        k, v = _expand(c, w_uk, w_uv)
        dk = dv = None
        for bi, rows in blocks:
            dq_i, dk_i, dv_i = segment_backward(bwd, dout[bi, :, rows], q[bi, :, rows], k, v, out[bi, :, rows],
                                                lse[bi, :, rows], False, scale)
            dq[bi, :, rows] += dq_i
            dk = dk_i.to(wdt) if dk is None else dk.add_(dk_i)
            dv = dv_i.to(wdt) if dv is None else dv.add_(dv_i)
            del dq_i, dk_i, dv_i
        if dw is not None:
            cw = c[..., :r].to(wdt)
            dw[0].add_(torch.einsum("bhsd,bsr->hdr", dk[..., :dn], cw))
            dw[1].add_(torch.einsum("bhsv,bsr->hvr", dv, cw))
        if sink is not None:
            dc = (torch.einsum("bhsd,hdr->bsr", dk[..., :dn], w_uk.to(wdt))
                  + torch.einsum("bhsv,hvr->bsr", dv, w_uv.to(wdt)))
            add_into(sink[:, 0, s:e], torch.cat((dc, dk[..., dn:].sum(1)), dim=-1))
        del k, v, dk, dv
    return dq


def weight_grads(w_uk: Tensor, w_uv: Tensor, needs: tuple[bool, bool]) -> tuple[Tensor, Tensor] | None:
    """Zeroed ``(d W_UK, d W_UV)`` accumulators (float32 for low-precision weights), or None when neither weight
    needs a gradient."""
    if not any(needs):
        return None
    wdt = grad_dtype_for(w_uk.dtype)
    return (torch.zeros(w_uk.shape, dtype=wdt, device=w_uk.device),
            torch.zeros(w_uv.shape, dtype=wdt, device=w_uv.device))


class _DecompressedAttention(torch.autograd.Function):
    """Attention of ``q [B, H, T, dn+dr]`` over stored latent segments (expanded chunk by chunk, never all at once)
    and the queries' own causal ``k_own, v_own [B, H, T, .]``; merged online by log-sum-exp.

    Backward (ring-attention pattern): each chunk's kernel backward runs with the merged output and global LSE;
    ``dK, dV`` of a stored chunk become ``d lat`` (added into the segment's sink) and ``d w_uk, d w_uv``.
    """

    @staticmethod
    def forward(ctx, q, w_uk, w_uv, k_own, v_own, scale, backend, chunk, sinks, *lats):
        fwd, _ = kernels(backend)
        out, lse = segment_forward(fwd, q, k_own, v_own, True, scale)
        acc = (out.to(lse.dtype), lse)
        for lat in lats:
            acc = decompressed_partial(fwd, q, lat, w_uk, w_uv, scale, chunk, acc)
        out, lse = acc[0].to(q.dtype), acc[1]
        ctx.save_for_backward(q, w_uk, w_uv, k_own, v_own, out, lse, *lats)
        ctx.scale, ctx.backend, ctx.chunk, ctx.sinks = scale, backend, chunk, sinks
        return out

    @staticmethod
    def backward(ctx, dout):
        q, w_uk, w_uv, k_own, v_own, out, lse, *lats = ctx.saved_tensors
        _, bwd = kernels(ctx.backend)
        dout = dout.contiguous()
        dq, dk_own, dv_own = segment_backward(bwd, dout, q, k_own, v_own, out, lse, True, ctx.scale)
        dq = dq.to(lse.dtype)
        dw = weight_grads(w_uk, w_uv, tuple(ctx.needs_input_grad[1:3]))
        for lat, sink in zip(lats, ctx.sinks):
            dq += decompressed_partial_backward(bwd, dout, q, lat, w_uk, w_uv, out, lse, ctx.scale, ctx.chunk, sink,
                                                dw)
        return (dq.to(q.dtype), None if dw is None else dw[0].to(w_uk.dtype),
                None if dw is None else dw[1].to(w_uv.dtype), dk_own, dv_own, None, None, None, None,
                *([None] * len(lats)))


# ---------------------------------------------------------------------------------------------------- absorbed


class _IntoSink(torch.autograd.Function):
    """Identity on stored latents whose backward adds the incoming gradient into ``sink`` (the state's buffer)."""

    @staticmethod
    def forward(ctx, lat, sink):
        ctx.sink = sink
        return lat.view_as(lat)

    @staticmethod
    def backward(ctx, grad):
        add_into(ctx.sink, grad)
        return None, None


def _pseudo_heads(qa: Tensor, num_heads: int) -> int:
    """How many stride-0 copies of the single latent key head a prefix segment is spread over.

    CPU flash attention's backward splits its work over (batch, key head): with the one latent head all query
    heads fold onto and several threads it is ~7x slower than single-threaded or over two heads (docs/MLA.md).
    Spreading the head over ``g`` views (no copy; the query heads split into ``g`` groups) avoids that; the forward
    and the no-grad paths need none of it."""
    if not (torch.is_grad_enabled() and qa.requires_grad) or qa.device.type != "cpu":
        return 1
    threads = torch.get_num_threads()
    return max(d for d in range(1, min(threads, num_heads) + 1) if num_heads % d == 0)


def _spread(seg: KVSegment, g: int) -> KVSegment:
    """``seg`` (latents ``[Bk, 1, S, D]``, maybe with a sink) as ``g`` stride-0 key heads; the gradient reaches the
    sink through autograd (the expand sums the ``g`` copies back)."""
    # the input must require grad for autograd to call the backward; it is a detached alias, nothing accumulates in it
    lat = seg.k if seg.k_grad is None else _IntoSink.apply(seg.k.detach().requires_grad_(True), seg.k_grad)
    lat = lat.expand(lat.shape[0], g, lat.shape[2], lat.shape[3])
    return KVSegment(lat, lat)


def _partitioned(prefix: list[KVSegment]) -> bool:
    """Whether a prefix segment is partitioned over processes (it computes the attention call itself:
    :mod:`longstraw.ops.partitioned`)."""
    return any(isinstance(s, PartitionedSegment) for s in prefix)


# ---------------------------------------------------------------------------------------------------- mixer


class MLAttention(nn.Module):
    """The MLA token mixer (parameter names as in transformers' ``DeepseekV3Attention``).

    ``forward(x [B, T, hidden], ctx (CallContext: cos, sin [T, dr]), prefix list[KVSegment] of latents | None)`` returns
    ``(y [B, T, hidden], lat [B, 1, T, r + dr])``, the new tokens' latents being what prefill stores.
    """

    state_type = LatentState

    def __init__(self, hidden: int, num_heads: int, *, q_lora_rank: int | None, kv_lora_rank: int,
                 qk_nope_head_dim: int, qk_rope_head_dim: int, v_head_dim: int, scale: float,
                 bias: bool = False, rope_interleave: bool = True, mode: str = DEFAULT_MODE, rope: bool = True,
                 head_gate: bool = False):
        super().__init__()
        for name, v in (("num_attention_heads", num_heads), ("kv_lora_rank", kv_lora_rank),
                        ("qk_rope_head_dim", qk_rope_head_dim), ("v_head_dim", v_head_dim)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        if not isinstance(qk_nope_head_dim, int) or qk_nope_head_dim < 0:
            raise ValueError(f"qk_nope_head_dim={qk_nope_head_dim!r} must be an integer >= 0")
        if qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim={qk_rope_head_dim} must be even (RoPE rotates channel pairs)")
        if q_lora_rank is not None and (not isinstance(q_lora_rank, int) or q_lora_rank < 1):
            raise ValueError(f"q_lora_rank={q_lora_rank!r} must be an integer >= 1 or null")
        self.num_heads, self.kv_lora_rank = num_heads, kv_lora_rank
        self.dn, self.dr, self.dv = qk_nope_head_dim, qk_rope_head_dim, v_head_dim
        self.scale, self.rope_interleave, self.rope = scale, rope_interleave, rope
        self.set_mode(mode)
        self.decompress_chunk: int | None = None  # positions expanded at once (None: ~16M K/V elements)
        qk = qk_nope_head_dim + qk_rope_head_dim
        if q_lora_rank is None:
            self.q_proj = nn.Linear(hidden, num_heads * qk, bias=False)
            self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        else:
            self.q_proj = None
            self.q_a_proj = nn.Linear(hidden, q_lora_rank, bias=bias)
            self.q_a_layernorm = RMSNorm(q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(q_lora_rank, num_heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, kv_lora_rank + qk_rope_head_dim, bias=bias)
        self.kv_a_layernorm = RMSNorm(kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(kv_lora_rank, num_heads * (qk_nope_head_dim + v_head_dim), bias=False)
        self.o_proj = nn.Linear(num_heads * v_head_dim, hidden, bias=bias)
        # Ling 3.0 (bailing_hybrid): each head's output times sigmoid(g_proj(x)), one scalar per head and token
        self.g_proj = nn.Linear(hidden, num_heads, bias=False) if head_gate else None

    def set_mode(self, mode: str) -> None:
        if mode not in MODES:
            raise ValueError(f"MLA mode {mode!r} is not supported; allowed: {', '.join(MODES)}")
        self.mode = mode

    def new_state(self, capacity: int, exact: bool = False) -> LatentState:
        """Empty latent state for ``capacity`` positions (exact mode needs nothing more)."""
        return LatentState(capacity)

    def extra_repr(self) -> str:
        return (f"heads={self.num_heads}, kv_lora_rank={self.kv_lora_rank}, dn={self.dn}, dr={self.dr}, "
                f"dv={self.dv}, mode={self.mode}" + ("" if self.rope else ", rope=False"))

    # ------------------------------------------------------------------ pieces
    def _rope(self, x: Tensor, ctx: CallContext) -> Tensor:
        if not self.rope:  # NoPE (Kimi-Linear): the "rope" channels as projected
            return x
        cos, sin = ctx.rope
        return apply_rope_interleaved(x, cos, sin) if self.rope_interleave else apply_rope(x, cos, sin)

    def project(self, x: Tensor, ctx: CallContext) -> tuple[Tensor, Tensor, Tensor, Tensor | None]:
        """``x [B, T, hidden]`` -> ``q_nope [B, H, T, dn]``, roped ``q_pe [B, H, T, dr]``, latents
        ``lat [B, 1, T, r + dr]`` and the normalised low-rank query ``q_resid [B, T, q_lora_rank]`` (the DSA
        indexer's input; None without q_lora)."""
        b, t, _ = x.shape
        q_resid = None
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            q_resid = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_resid)
        q = q.view(b, t, self.num_heads, self.dn + self.dr).transpose(1, 2)
        q_nope, q_pe = q.split([self.dn, self.dr], dim=-1)
        ckv = self.kv_a_proj_with_mqa(x)
        c, kpe = ckv.split([self.kv_lora_rank, self.dr], dim=-1)
        c = self.kv_a_layernorm(c)
        kpe = self._rope(kpe[:, None], ctx)  # [B, 1, T, dr]
        q_pe = self._rope(q_pe, ctx)
        # the norm's float32 weight promotes c under autocast: the latents take the projections' (compute) dtype
        lat = torch.cat((c[:, None].to(kpe.dtype), kpe), dim=-1)
        return q_nope, q_pe, lat, q_resid

    def _weights(self) -> tuple[Tensor, Tensor]:
        """``W_UK [H, dn, r]`` and ``W_UV [H, dv, r]``: views of ``kv_b_proj``'s weight (with its LoRA adapter
        folded in, when it has one: ``models.lora.linear_weight``)."""
        w = linear_weight(self.kv_b_proj).view(self.num_heads, self.dn + self.dv, self.kv_lora_rank)
        return w[:, : self.dn], w[:, self.dn :]

    def absorbed_query(self, q_nope: Tensor, q_pe: Tensor) -> Tensor:
        """``[q_nope W_UK,h | q_pe]`` ``[B, H, T, r + dr]``: the query in the latent space."""
        w_uk, _ = self._weights()  # einsum: one bmm over heads (a broadcast matmul would copy W per batch row)
        return torch.cat((torch.einsum("bhtd,hdr->bhtr", q_nope, w_uk), q_pe), dim=-1)

    def absorbed_output(self, o_lat: Tensor) -> Tensor:
        """``o~ [B, H, T, r + dr]`` (latent-space attention output) -> ``W_UV,h o~[:r]`` ``[B, H, T, dv]``."""
        _, w_uv = self._weights()
        return torch.einsum("bhtr,hvr->bhtv", o_lat[..., : self.kv_lora_rank], w_uv)

    def attend_absorbed(self, q_nope: Tensor, q_pe: Tensor, lat: Tensor, prefix: list[KVSegment]) -> Tensor:
        qa = self.absorbed_query(q_nope, q_pe)
        g = 1 if _partitioned(prefix) else _pseudo_heads(qa, self.num_heads)  # a sharded segment stays whole
        segs = [s if g == 1 else _spread(s, g) for s in prefix] + [KVSegment(lat, lat, causal=True)]
        return self.absorbed_output(segment_attention(qa, segs, self.scale))

    def attend_decompressed(self, q_nope: Tensor, q_pe: Tensor, lat: Tensor, prefix: list[KVSegment]) -> Tensor:
        """The decompressed form: ``q [B, H, T, dn + dr]`` against the stored latents expanded chunk by chunk (head
        sizes ``dn + dr`` and ``dv``, within the flash kernels' 256) -> ``[B, H, T, dv]``. A prefix partitioned over
        processes hands the call to its segment's ``decompressed_attention`` (the same chunked expansion on each
        process's share, partials merged by LSE over the group)."""
        w_uk, w_uv = self._weights()
        q = torch.cat((q_nope, q_pe), dim=-1)
        w_uk, w_uv = w_uk.to(q.dtype), w_uv.to(q.dtype)  # autocast: the custom backward sees one dtype
        k_own, v_own = _expand(lat[:, 0], w_uk, w_uv)
        backend = default_backend(q, max(q.shape[-1], self.dv))
        chunk = self.chunk_positions()
        for s in prefix:
            assert s.k is s.v, "MLA prefix segments hold latents (k is v)"
        part = [s for s in prefix if isinstance(s, PartitionedSegment)]
        if part:
            rest = [s for s in prefix if s is not part[0] and s.length > 0]
            return part[0].decompressed_attention(q.contiguous(), w_uk, w_uv, k_own, v_own, lat, rest,
                                                  float(self.scale), backend, chunk)
        lats = [s.k for s in prefix if s.length > 0]
        sinks = tuple(s.k_grad for s in prefix if s.length > 0)
        return _DecompressedAttention.apply(q.contiguous(), w_uk, w_uv, k_own, v_own, float(self.scale), backend,
                                            int(chunk), sinks, *[x.detach() for x in lats])

    def chunk_positions(self) -> int:
        """Stored positions the decompressed form expands at once: ``decompress_chunk``, or as many as make
        ~16M K/V elements (``H (dn + dr + dv)`` per position; DeepSeek-V3: 409 positions, 32 MiB in bf16)."""
        return int(self.decompress_chunk or max(64, _DECOMPRESS_ELEMS // (self.num_heads * (self.dn + self.dr
                                                                                             + self.dv))))

    def attention_flops(self, batch: int, tokens: int, segments: list[tuple[int, int]]) -> dict[str, float]:
        """Forward FLOPs of each form for ``batch x tokens`` new queries over stored segments given as
        ``(segment batch, length)`` (own tokens: causal, half a square). The projections both forms share are left
        out; the absorbed form's per-query maps through ``W_UK`` / ``W_UV`` are counted.

        Per (query, key) pair: absorbed ``2 H 2 (r + dr)``, decompressed ``2 H (dn + dr + dv)``; per stored key
        expanded (once per call): ``2 H r (dn + dv)``; per query (absorbed): ``2 H r (dn + dv)``. DeepSeek-V3
        (H 128, r 512, dr 64, dn 128, dv 128): 294,912 against 81,920 per pair, 33.5M per expanded key."""
        h, r, dr, dn, dv = self.num_heads, self.kv_lora_rank, self.dr, self.dn, self.dv
        keys = sum(s for _, s in segments) + (tokens + 1) / 2  # keys seen per query
        stored = sum(bk * s for bk, s in segments) + batch * tokens  # latents the decompressed form expands
        q = batch * tokens
        return {"absorbed": 2.0 * q * h * (keys * 2 * (r + dr) + dn * r + r * dv),
                "decompressed": 2.0 * q * h * keys * (dn + dr + dv) + 2.0 * stored * h * r * (dn + dv)}

    def choose_form(self, batch: int, tokens: int, prefix: list[KVSegment], grad: bool = False) -> str:
        """The form a call runs: ``mode`` unless ``"auto"``, which decompresses only when that costs less than
        ``1 / DECOMPRESS_FLOP_PENALTY`` (``_GRAD`` when a backward follows) of the absorbed FLOPs: long prefill
        chunks, long or many branches over a long prompt; never decoding.

        A segment partitioned over processes (context parallelism) is counted as the whole group's call
        (:meth:`~longstraw.ops.partitioned.PartitionedSegment.group_shape`: in a prefill step every rank's piece
        queries every rank's stored share, so the step's tokens share each expansion), from numbers that are the
        same on every process: the group takes one form. Any segment with a ``group_shape`` counts so (the memory
        planner's dry run of a CP step hands a rank's sharded segment in, over a stand-in group:
        ``planner._CPRehearsal``)."""
        if self.mode != "auto":
            return self.mode
        segs = []
        for s in prefix:
            shape = getattr(s, "group_shape", None)
            if shape is not None:
                tokens, stored = shape(tokens)
                segs.append((1, stored))
            else:
                segs.append((s.k.shape[0], s.length))
        return self._pick(self.attention_flops(batch, tokens, segs), grad)

    def attend(self, q_nope: Tensor, q_pe: Tensor, lat: Tensor, prefix: list[KVSegment]) -> Tensor:
        """Dense causal attention of the new tokens over ``prefix`` + themselves -> ``[B, H, T, dv]``, in the form
        :meth:`choose_form` picks (both exact: only rounding differs). Under context parallelism the choice is the
        group's (every rank makes the same collectives), and both forms have their CP path."""
        grad = torch.is_grad_enabled() and q_nope.requires_grad
        if self.choose_form(q_nope.shape[0], q_nope.shape[2], prefix, grad) == "absorbed":
            return self.attend_absorbed(q_nope, q_pe, lat, prefix)
        return self.attend_decompressed(q_nope, q_pe, lat, prefix)

    def output(self, o: Tensor, x: Tensor | None = None) -> Tensor:
        """The heads' outputs ``o [B, H, T, dv]`` -> ``[B, T, hidden]``; with a head gate (``g_proj``), each head
        first times ``sigmoid(g_proj(x))`` (computed in float32, float64 in a float64 model, and cast back, as
        transformers does)."""
        b, _, t, _ = o.shape
        o = o.transpose(1, 2)  # [B, T, H, dv]
        if self.g_proj is not None:
            g = self.g_proj(x)
            g = torch.sigmoid(g if g.dtype == torch.float64 else g.float()).to(o.dtype)
            o = o * g[..., None]
        return self.o_proj(o.reshape(b, t, self.num_heads * self.dv))

    def forward(self, x: Tensor, ctx: CallContext, prefix: list[KVSegment] | None):
        q_nope, q_pe, lat, _ = self.project(x, ctx)
        return self.output(self.attend(q_nope, q_pe, lat, list(prefix or [])), x), lat

    # ------------------------------------------------------------------ accounting
    def state_bytes_per_position(self, dtype: torch.dtype) -> int:
        """Bytes the prompt state keeps per position: ``(kv_lora_rank + qk_rope_head_dim) x dtype bytes``."""
        return (self.kv_lora_rank + self.dr) * torch.empty(0, dtype=dtype).element_size()

    def flops_per_token(self, context: int, tokens: int | None = None) -> float:
        """Forward FLOPs per new token over ``context`` stored positions: the projections plus the attention, in
        the absorbed form (``tokens`` None: a token decoded alone) or, given the ``tokens`` of one call (a prefill
        chunk), in the form :meth:`choose_form`'s rule picks for such a call (forward penalty), its expansion
        shared by the call's tokens: the count the planner's FLOP shares use."""
        hidden = self.kv_a_proj_with_mqa.in_features
        h, r, qk = self.num_heads, self.kv_lora_rank, self.dn + self.dr
        if self.q_proj is not None:
            q = hidden * h * qk
        else:
            q = hidden * self.q_a_proj.out_features + self.q_a_proj.out_features * h * qk
        shared = q + hidden * (r + self.dr) + h * self.dv * hidden + (hidden * h if self.g_proj is not None else 0)
        if tokens is None:
            return 2.0 * (shared + h * self.dn * r + h * r * self.dv) + 2.0 * h * (2 * r + 2 * self.dr) * context
        f = self.attention_flops(1, tokens, [(1, context)])
        return 2.0 * shared + f[self._pick(f, False)] / tokens

    def _pick(self, f: dict[str, float], grad: bool) -> str:
        """The FLOP rule: ``mode`` unless ``"auto"``; then decompressed when its FLOPs times the penalty are below
        the absorbed form's."""
        if self.mode != "auto":
            return self.mode
        penalty = DECOMPRESS_FLOP_PENALTY_GRAD if grad else DECOMPRESS_FLOP_PENALTY
        return "decompressed" if f["decompressed"] * penalty < f["absorbed"] else "absorbed"


def set_mla_mode(model: nn.Module, mode: str, decompress_chunk: int | None = None) -> int:
    """Set the attention form of every MLA layer of ``model`` (``"auto"``, ``"absorbed"`` or ``"decompressed"``)
    and, optionally, the decompression chunk. Returns the number of layers changed."""
    if decompress_chunk is not None and (not isinstance(decompress_chunk, int) or decompress_chunk < 1):
        raise ValueError(f"decompress_chunk={decompress_chunk!r} must be an integer >= 1 or None")
    n = 0
    for m in model.modules():
        if isinstance(m, MLAttention):
            m.set_mode(mode)
            if decompress_chunk is not None:
                m.decompress_chunk = decompress_chunk
            n += 1
    if n == 0:
        raise ValueError(f"{type(model).__name__} has no MLA layers to set mode {mode!r} on")
    return n
