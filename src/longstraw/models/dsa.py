"""DeepSeek Sparse Attention (DeepSeek-V3.2, GLM-5): a lightning indexer picks ``index_topk`` keys per query,
MLA attends over those only.

Indexer (parameter names as transformers' ``DeepseekV32Indexer``; ``Hi = index_n_heads``, ``Di = index_head_dim``)::

    kI_s     = RoPE(LayerNorm(wk x_s))                      [Di]      one key per position, stored in the state
    qI_t,h   = RoPE(wq_b q_resid_t)                         [Hi, Di]  (q_resid: the MLA's normalised low-rank query)
    w_t,h    = weights_proj(x_t) * Hi^-0.5
    I(t, s)  = sum_h w_t,h relu(qI_t,h . kI_s * Di^-0.5)    for the causal keys s <= t, -inf otherwise
    selected(t) = top-index_topk of I(t, .)

RoPE covers the first ``qk_rope_head_dim`` channels of ``Di``: half-split (DeepSeek-V3.2) or interleaved (GLM-5).
Scores are float32 (float64 for float64 models) as upstream. Where they are computed: on CPU (and the planner's meta
dry run) the head scores ``qI . kI`` are float32 matmuls, as transformers computes them; on CUDA with bf16/fp16 models
that GEMM (``Hi x Di`` multiply-adds per (query, key) pair, the indexer's whole cost) takes the model dtype with
float32 accumulation and a float32 result (``torch.bmm(..., out_dtype=torch.float32)``, CUDA only; its kernel checks
``out_dtype == fp32`` for fp16/bf16 inputs, aten/src/ATen/native/cuda/Blas.cpp); the queries and keys are bf16/fp16
values already (projections in the model dtype), so only the accumulation order differs from the float32 matmul.
ReLU, the head weights and the sum over heads stay float32 on every device. The whole indexer runs without autograd:
the selection is not differentiable and upstream trains the indexer with a separate loss, so its parameters get
no gradient from the language-model loss (as in transformers).

The attention is exact over the selected set: softmax over the selected keys only, the same numbers as
transformers' masked dense attention. When a call's queries can see at most ``index_topk`` keys (prefix + own
tokens), every key is selected and the MLA's dense path runs; otherwise :func:`sparse_latent_attention` gathers the
selected latents per query (absorbed form: one latent key per position, ``K = V = [c_kv | k_pe]``), blocked over
queries, and scatters their gradient back into the prompt state's sink. The sparse path is always absorbed: a
gathered key is used by one query, so expanding it per head would cost ``H r (dn + dv)`` for a single use.

GLM-5 shares indexers: ``indexer_types[i] == "shared"`` layers have no indexer and reuse the selection of the most
recent ``"full"`` layer below them in the same forward (handed over through the call's
:class:`~longstraw.models.context.CallContext`, ``ctx.shared``); their prompt state is the plain
:class:`~longstraw.models.mla.LatentState`.

Prompt state of a full layer (:class:`IndexedLatentState`): the MLA latents plus the indexer keys, ``(r + dr + Di)``
values per position. A prompt state partitioned over processes (context parallelism) plugs in through the typed
interface of :mod:`longstraw.ops.partitioned`: ``Indexer.select`` hands keys that are a ``PartitionedSegment`` to
their ``index_select``, ``sparse_latent_attention`` a partitioned latent segment to its ``sparse_attention``, and every
segment's ``key_count`` (the same on every process) decides dense vs sparse.

Ties: with few index heads many keys score exactly 0 (every head's ReLU at 0). The selection breaks exact ties by
the lower position (:func:`longstraw.ops.topk.first_topk`), so it does not depend on how the scores were blocked or
on ``prefill_chunk``. transformers takes ``torch.topk`` of the full score matrix, which picks among tied keys in an
order of its own: where ties straddle the ``index_topk`` boundary the two can select different (equally scored)
keys, and their outputs then differ; with distinct scores (real checkpoints, or >= 32 index heads in the tests)
they select the same keys.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longstraw.models.context import CallContext
from longstraw.models.keep_fp32 import KeepsFloat32
from longstraw.models.lora import linear_weight
from longstraw.models.mla import LatentDecoder, LatentState, MLAttention
from longstraw.models.rope import apply_rope, apply_rope_interleaved
from longstraw.ops import meta
from longstraw.ops.attention import KVSegment
from longstraw.ops.partitioned import PartitionedSegment
from longstraw.ops.sparse_attention import Selection, acc_dtype, sparse_latent_attention
from longstraw.ops.topk import first_topk

SCORE_ELEMS = 1 << 24  # indexer scores: ~16M float32 elements per query block and per (query, key) block


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


def low_precision_scores(keys: Tensor) -> bool:
    """Whether the indexer's head-score GEMM runs in the model dtype with float32 accumulation (module docstring):
    bf16/fp16 keys on CUDA. CPU, meta (the planner) and float32/float64 models compute it in float32/float64."""
    return keys.is_cuda and keys.dtype in (torch.bfloat16, torch.float16)


def _head_scores_low_precision(qb: Tensor, k: Tensor) -> Tensor:
    """``qb [B, bt, Hi, Di]`` and keys ``k [Bk, kc, Di]`` (one dtype, bf16/fp16) -> head scores
    ``[B, bt, Hi, kc]`` in float32: one ``torch.bmm(..., out_dtype=torch.float32)`` (fp32 accumulate and result;
    the ``bmm.dtype`` overload has CUDA and meta kernels only)."""
    b, bt, hi, di = qb.shape
    kt = k.transpose(-1, -2).expand(b, -1, -1)  # [B, Di, kc]: a view for Bk == 1
    hs = torch.bmm(qb.reshape(b, bt * hi, di), kt, out_dtype=torch.float32)
    return hs.view(b, bt, hi, k.shape[1])


class HeadWeights(KeepsFloat32, nn.Linear):
    """The indexer's ``weights_proj`` (``[Hi, hidden]``, no bias): a ``Linear`` kept in float32 when the model is cast
    to float16, and computed in float32 for float16 inputs, as transformers does (``_keep_in_fp32_modules =
    ["indexer.weights_proj"]``: fp16 only, so that the bf16 values a checkpoint holds are not rounded to fp16's
    range; its forward casts the hidden states to the weight's dtype). bf16, float32 and float64 models keep and
    compute it in their own dtype; the output is taken in the score dtype either way. Under FSDP2 with an fp16
    compute dtype it is a unit of its own whose weight is all-gathered in float32 (``models.keep_fp32``)."""

    keep_float32, keep_float32_strict = ("weight", "bias"), False  # float16 models only (models.keep_fp32)
    plain_linear = True  # a linear layer as PEFT sees it (``models.lora.linear_modules``: LoRA may target it)

    def forward(self, x: Tensor) -> Tensor:
        """``x [..., hidden] -> [..., Hi]`` in ``x``'s dtype: the weight is taken in it (float32 for the float16
        path of :func:`head_weights`)."""
        return nn.functional.linear(x, self.weight.to(x.dtype), None if self.bias is None else self.bias.to(x.dtype))


def head_weights(layer: nn.Linear, x: Tensor) -> Tensor:
    """The indexer's head weights before the ``Hi^-0.5`` scale: ``weights_proj(x)`` for ``x [B, T, hidden]`` ->
    ``[B, T, Hi]`` in the score dtype (:func:`acc_dtype`). Float16 models (float16 inputs, or float16 autocast):
    computed in float32 with autocast off, as transformers does (:class:`HeadWeights`); a LoRA-adapted projection
    (``models.lora``) whose parameters are not float32 through its merged weight. Others: the layer's own call."""
    dev = x.device.type
    amp = torch.amp.is_autocast_available(dev)  # (not on the meta device: the planner's dry run)
    if x.dtype != torch.float16 and not (amp and torch.is_autocast_enabled(dev)
                                         and torch.get_autocast_dtype(dev) == torch.float16):
        return layer(x).to(acc_dtype(x.dtype))
    with torch.autocast(dev, enabled=False) if amp else contextlib.nullcontext():
        x = x.float()
        if isinstance(layer, HeadWeights):  # called as a module: under FSDP2 it may be a unit of its own
            return layer(x)
        return nn.functional.linear(x, linear_weight(layer).float())


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
        self.weights_proj = HeadWeights(hidden, num_heads, bias=False)

    def _rope(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        if not self.interleaved:
            return apply_rope(x, cos, sin)
        r = self.rope_dim
        return torch.cat((apply_rope_interleaved(x[..., :r], cos, sin), x[..., r:]), dim=-1)

    @torch.no_grad()
    def keys(self, x: Tensor, ctx: CallContext) -> Tensor:
        """``x [B, T, hidden]`` -> indexer keys ``[B, T, Di]`` (what the state stores)."""
        cos, sin = ctx.rope
        return self._rope(self.k_norm(self.wk(x)), cos, sin)

    @torch.no_grad()
    def queries(self, x: Tensor, q_resid: Tensor, ctx: CallContext) -> tuple[Tensor, Tensor]:
        """``x [B, T, hidden]``, ``q_resid [B, T, q_lora_rank]`` -> roped index queries ``q [B, T, Hi, Di]`` and
        head weights ``w [B, T, Hi]`` (score dtype, ``Hi^-0.5`` included)."""
        b, t, _ = x.shape
        cos, sin = ctx.rope
        q = self.wq_b(q_resid).view(b, t, self.num_heads, self.head_dim)
        q = self._rope(q, cos[:, None], sin[:, None])  # cos [T, 1, dr]: broadcast over the index heads
        return q, head_weights(self.weights_proj, x) * self.num_heads**-0.5

    def scores(self, qb: Tensor, wb: Tensor, keys: list[Tensor]) -> Tensor:
        """Index scores ``I [B, bt, sum S_i]`` (unmasked, float32/float64) of a block of queries ``qb [B, bt, Hi, Di]``
        with weights ``wb [B, bt, Hi]`` (score dtype) over ``keys`` (``[Bk, S_i, Di]`` each, read in place one key
        chunk of ``[B, bt, Hi, kc]`` head scores at a time). The head-score GEMM runs in the keys' dtype with float32
        accumulation where :func:`low_precision_scores` says so (CUDA bf16/fp16), else in the score dtype; ``qb``
        may come in either (a bf16 query cast to float32 casts back exactly)."""
        b, bt = qb.shape[:2]
        kc = max(1, SCORE_ELEMS // (b * bt * self.num_heads))
        wb = wb[:, :, None, :]  # [B, bt, 1, Hi]
        chunks = [(k, c0, min(k.shape[1], c0 + kc)) for k in keys for c0 in range(0, k.shape[1], kc)]
        n = len(chunks)
        last_full = max((i for i, (_, c0, c1) in enumerate(chunks) if c1 - c0 == kc), default=0)
        parts = []
        for i, (k, c0, c1) in enumerate(chunks):
            if meta.skip_repeated_block(qb, i, (0, last_full, n - 2, n - 1)):  # the planner's dry run (ops/meta.py)
                parts.append(wb.new_empty(b, bt, c1 - c0))
                continue
            if low_precision_scores(k):
                hs = _head_scores_low_precision(qb.to(k.dtype), k[:, c0:c1])
                sc = torch.relu(hs * self.softmax_scale)
            else:
                kt = k[:, c0:c1].to(qb.dtype).transpose(-1, -2)[:, None]  # [Bk, 1, Di, kc]
                sc = torch.relu(torch.matmul(qb, kt) * self.softmax_scale)  # [B, bt, Hi, kc]
            parts.append(torch.matmul(wb, sc.to(wb.dtype)).squeeze(-2))  # [B, bt, kc]
        return torch.cat(parts, dim=-1)

    @torch.no_grad()
    def select(self, x: Tensor, q_resid: Tensor, ctx: CallContext, prefix_keys: list, own_keys: Tensor
               ) -> Selection:
        """Top-``topk`` causal keys for each query ``x [B, T, hidden]`` over ``prefix_keys`` (``[Bk, S_i, Di]``) and
        ``own_keys [B, T, Di]``; exact ties go to the lower position (module docstring).

        Blocked over queries (``bt`` rows of ``[B, bt, S]`` index scores at a time) and, within a block, over keys
        (:meth:`scores`): the stored keys are read in place, never copied whole. Keys partitioned over processes
        (a :class:`~longstraw.ops.partitioned.PartitionedSegment`, first) compute the whole call.
        """
        if prefix_keys and isinstance(prefix_keys[0], PartitionedSegment):
            return prefix_keys[0].index_select(self, x, q_resid, ctx, prefix_keys, own_keys)
        b, t, _ = x.shape
        acc = acc_dtype(x.dtype)
        q, w = self.queries(x, q_resid, ctx)
        segs = list(prefix_keys) + [own_keys]
        s_pre = sum(k.shape[1] for k in prefix_keys)
        s_all = s_pre + t
        k_eff = min(self.topk, s_all)
        idx = torch.empty(b, t, k_eff, dtype=torch.long, device=x.device)
        valid = torch.empty(b, t, k_eff, dtype=torch.bool, device=x.device)
        bt = max(1, min(t, SCORE_ELEMS // max(1, b * s_all)))
        key_pos = torch.arange(s_all, device=x.device) - s_pre  # own-token index of each key (< 0: prefix)
        starts = range(0, t, bt)
        for i, t0 in enumerate(starts):
            if meta.skip_repeated_block(x, i, (0, len(starts) - 1)):  # the planner's dry run: as block 0 (ops/meta.py)
                continue
            t1 = min(t, t0 + bt)
            qb = q[:, t0:t1] if low_precision_scores(own_keys) else q[:, t0:t1].to(acc)
            sc = self.scores(qb, w[:, t0:t1], segs)
            future = key_pos[None, :] > torch.arange(t0, t1, device=x.device)[:, None]  # [bt, S]
            sc = sc.masked_fill_(future, float("-inf"))
            ids = first_topk(sc, k_eff)  # exact ties: the lower position (module docstring)
            idx[:, t0:t1] = ids
            valid[:, t0:t1] = sc.gather(-1, ids) > float("-inf")
        return Selection(idx, valid)


# ---------------------------------------------------------------------------------------------------- mixer


class SparseMLAttention(MLAttention):
    """MLA with DeepSeek Sparse Attention. ``indexer`` given: a full layer (its state keeps indexer keys);
    ``indexer=None``: a shared layer reusing the selection of layer ``source_index`` (GLM-5).

    ``forward(x, ctx, prefix)`` returns ``(y, piece)``: ``piece = (lat, index_keys)`` for a full
    layer, ``lat`` for a shared one; ``prefix`` is an :class:`IndexedPrefix` (full) or a latent segment list.

    ``keeps_selection``: a later shared layer reads this full layer's selection, so the forward leaves it in
    ``ctx.shared`` (until the call ends: a layer recomputed under checkpointing reads it again); the model's builder
    sets it. A full layer that no layer shares (every layer of DeepSeek-V3.2 and of GLM-5's published config) keeps
    nothing: a selection is ``T x index_topk`` positions and flags (72 MiB for a 4,096-token chunk), and keeping
    every layer's through a call held 5.5 GiB at GLM-5's 78 layers."""

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
        self.keeps_selection = False

    def new_state(self, capacity: int, exact: bool = False) -> LatentState:
        return IndexedLatentState(capacity) if self.indexer is not None else LatentState(capacity)

    def forward(self, x: Tensor, ctx: CallContext, prefix):
        q_nope, q_pe, lat, q_resid = self.project(x, ctx)
        if self.indexer is not None:
            pre = prefix if prefix is not None else IndexedPrefix([], [])
            segs, own_keys = list(pre.latents), self.indexer.keys(x, ctx)
            piece = (lat, own_keys)
        else:
            segs, piece = list(prefix or []), lat
        t = x.shape[1]
        # key_count: the same on every process for a segment partitioned over several (they must agree on the path)
        if sum(s.key_count for s in segs) + t <= self.index_topk:  # every key selected: dense attention
            o = self.attend(q_nope, q_pe, lat, segs)
            return self.output(o), piece
        if self.indexer is not None:
            sel = self.indexer.select(x, q_resid, ctx, pre.index_keys, own_keys)
            if self.keeps_selection:
                ctx.shared[self.layer_index] = sel
        else:
            if self.source_index not in ctx.shared:
                raise ValueError(f"shared DSA layer {self.layer_index} needs the selection of layer "
                                 f"{self.source_index} from the same forward (run the whole model)")
            sel = ctx.shared[self.source_index]
        qa = self.absorbed_query(q_nope, q_pe)
        o = sparse_latent_attention(qa, segs + [KVSegment(lat, lat)], sel, self.scale)
        return self.output(self.absorbed_output(o)), piece

    def state_bytes_per_position(self, dtype: torch.dtype) -> int:
        """MLA latents plus, for a full layer, the indexer key: ``(r + dr [+ Di]) x dtype bytes``."""
        extra = self.indexer.head_dim if self.indexer is not None else 0
        return super().state_bytes_per_position(dtype) + extra * torch.empty(0, dtype=dtype).element_size()
