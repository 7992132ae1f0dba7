"""Mixture-of-experts ops: token routing and the routed experts, as pure functions.

Two routers cover the supported families:

* ``softmax_topk_route`` (Qwen3-Next, Qwen3.5-MoE): ``p = softmax(logits)``, keep the ``top_k`` largest,
  optionally renormalise them to sum to 1.
* ``sigmoid_grouped_route`` (DeepSeek-V3/V3.2, GLM-4.5 (glm4_moe), GLM-5 (glm_moe_dsa)): ``s = sigmoid(logits)``;
  the *choice* uses ``s + correction_bias``: experts are split into ``n_group`` equal groups, a group scores the sum
  of its two best biased scores, only the best ``topk_group`` groups stay eligible, and the ``top_k`` best eligible
  experts are chosen. The *weights* are the unbiased ``s`` of the chosen experts, optionally divided by their sum
  (``+ 1e-20``), then always multiplied by ``routed_scaling_factor``.

Selection (which experts) is never differentiated, as upstream; the weights are, so the router logits receive
gradient through the gathered weights only.

``experts_forward`` runs the routed SwiGLU experts on the transformers-5 fused layout
``gate_up_proj [E, 2*I, H]`` (rows ``0:I`` are gate, ``I:2I`` are up; the HF checkpoint converter concatenates
``experts.{e}.gate_proj.weight`` then ``experts.{e}.up_proj.weight``) and ``down_proj [E, H, I]``::

    y[n] = sum_j  w[n, j] * down[e] @ (act(gate[e] @ x[n]) * (up[e] @ x[n])),   e = ids[n, j]

It sorts the ``N * k`` token slots by expert (a stable argsort of the flattened ids), gathers their inputs into one
contiguous buffer, runs each expert on its slice (``torch.nn.functional.grouped_mm`` where the kernel supports the
dtype and alignment, otherwise a Python loop over the experts that received tokens), multiplies by the routing
weights and scatter-adds back with ``index_add`` (:func:`combine_slots`, block by block: the one op with its own
backward). The rest is plain autograd.

Dtypes (as HF, so bf16 models match HF bit-for-bit in spirit and float64 tests can be exact):

* routers compute in float32, or float64 for float64 logits. HF computes routers in float32 even inside a
  float64 model (``softmax(dtype=torch.float)``, ``hidden.type(torch.float32)``); we keep float64 float64 so that
  float64 references are genuine (pass ``compute_dtype=torch.float32`` to reproduce HF's float32 router exactly).
  ``softmax_topk_route`` returns weights cast back to the logits' dtype (HF: ``.to(router_logits.dtype)``);
  ``sigmoid_grouped_route`` returns them in the compute dtype (HF keeps them float32).
* ``experts_forward`` multiplies each expert output (x's dtype) by its weight with ordinary type promotion (so a
  float32 weight times a bf16 output is formed in float32), casts to x's dtype and accumulates in x's dtype.
  On CPU the accumulation order per token is ascending expert id, the same as HF's eager loop.

LoRA on the experts (``lora``, from ``models.lora.expert_lora``): per fused parameter ``W [E, out, in]`` the factors
``A [E, r, in]``, ``B [E, out, r]`` and a scaling ``s``; expert ``e`` computes ``W[e] x + s B[e] (A[e] x)`` on its
routed rows, which equals PEFT's ``(W[e] + s B[e] A[e]) x`` without forming the ``[E, out, in]`` delta: per step
it adds ``[S, r]`` intermediates (``S = N * k`` slots), and autograd gives ``A`` / ``B`` their gradients from the
same rows. ``gate_up_proj``'s adapter acts on the fused ``[S, 2I]`` output before the gate/up split, as PEFT's.

GPT-OSS's experts (:class:`ExpertForm`): stored as transformers keeps them, ``gate_up_proj [E, H, 2I]`` with gate
and up interleaved, ``down_proj [E, I, H]``, a bias after each product and the clamped SwiGLU
(:func:`clamped_swiglu`); its router (:func:`topk_softmax_route`) takes the top k logits, then their softmax.

Left out on purpose: expert parallelism (``longstraw.distributed.expert_parallel`` moves the tokens and calls
``experts_forward`` on each rank's experts), capacity limits / token dropping, auxiliary balance losses.
``experts_forward_reference`` is the obviously-correct per-token loop the tests hold the fast path to.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from longstraw.ops import meta

__all__ = [
    "softmax_topk_route",
    "topk_softmax_route",
    "clamped_swiglu",
    "ExpertForm",
    "sigmoid_grouped_route",
    "experts_forward",
    "experts_forward_reference",
    "combine_slots",
    "combine_slots_reference",
    "router_logits",
    "shared_expert_forward",
    "EXPERT_IMPLS",
]

EXPERT_IMPLS = ("auto", "grouped_mm", "loop")


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check_top_k(top_k: int, num_experts: int) -> None:
    if not 1 <= top_k <= num_experts:
        raise ValueError(f"top_k={top_k} must be between 1 and the number of experts ({num_experts})")


def router_logits(x: Tensor, weight: Tensor, *, upcast: bool) -> Tensor:
    """Router logits ``x @ weight.T`` for ``x [N, H]`` and ``weight [E, H]``.

    ``upcast=False``: in x's dtype (Qwen3-Next / Qwen3.5 ``F.linear(hidden, gate.weight)``).
    ``upcast=True``: x and weight cast to float32 (float64 stays float64) first (DeepSeek-V3/V3.2, GLM-4.5, GLM-5
    ``F.linear(hidden.type(torch.float32), weight.type(torch.float32))``).
    """
    if upcast:
        cdt = _compute_dtype(x.dtype)
        return F.linear(x.to(cdt), weight.to(cdt))
    return F.linear(x, weight)


def softmax_topk_route(
    router_logits: Tensor,
    top_k: int,
    norm_topk_prob: bool,
    *,
    compute_dtype: torch.dtype | None = None,
    keep_compute_dtype: bool = False,
) -> tuple[Tensor, Tensor]:
    """Softmax top-k routing. ``router_logits [N, E]`` -> ``(weights [N, k], expert_ids [N, k] int64)``.

    ``softmax`` in ``compute_dtype`` (default float32, float64 for float64 logits), ``topk`` (sorted, largest first),
    optional renormalisation of the k kept probabilities, then cast to the logits' dtype (Qwen) or, with
    ``keep_compute_dtype``, left in ``compute_dtype`` (Mixtral: each expert's output is weighted in float32 and
    rounded once).
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got shape {tuple(router_logits.shape)}")
    _check_top_k(top_k, router_logits.shape[-1])
    cdt = compute_dtype or _compute_dtype(router_logits.dtype)
    probs = torch.softmax(router_logits, dim=-1, dtype=cdt)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return (weights if keep_compute_dtype else weights.to(router_logits.dtype)), ids


def topk_softmax_route(router_logits: Tensor, top_k: int) -> tuple[Tensor, Tensor]:
    """GPT-OSS routing: the ``top_k`` largest logits (sorted), then a softmax over those k alone, in the logits'
    dtype. ``router_logits [N, E]`` -> ``(weights [N, k], expert_ids [N, k] int64)``. (Equal to a softmax over all
    experts renormalised over the top k, but rounded as transformers' ``GptOssTopKRouter`` rounds.)"""
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got shape {tuple(router_logits.shape)}")
    _check_top_k(top_k, router_logits.shape[-1])
    values, ids = torch.topk(router_logits, top_k, dim=-1)
    return torch.softmax(values, dim=-1, dtype=values.dtype), ids


def clamped_swiglu(alpha: float, limit: float) -> Callable[[Tensor, Tensor], Tensor]:
    """GPT-OSS's gated unit ``glu(gate, up) = (clamp(up, -limit, limit) + 1) * g * sigmoid(alpha * g)`` with
    ``g = clamp(gate, max=limit)``."""

    def glu(gate: Tensor, up: Tensor) -> Tensor:
        g = gate.clamp(max=limit)
        return (up.clamp(-limit, limit) + 1) * (g * torch.sigmoid(g * alpha))

    return glu


def sigmoid_grouped_route(
    router_logits: Tensor,
    correction_bias: Tensor | None,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    *,
    compute_dtype: torch.dtype | None = None,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 style sigmoid, group-limited top-k routing (``noaux_tc``).

    ``router_logits [N, E]`` (compute them with ``router_logits(x, W, upcast=True)``), ``correction_bias [E]``
    (``e_score_correction_bias``; ``None`` means zeros). Returns ``(weights [N, k], expert_ids [N, k] int64)``,
    weights in ``compute_dtype`` (default float32, float64 for float64 logits). The order of the k slots is
    whatever ``torch.topk(sorted=False)`` gives, as in HF; consumers must not depend on it.
    """
    if router_logits.dim() != 2:
        raise ValueError(f"router_logits must be [N, E], got shape {tuple(router_logits.shape)}")
    num_experts = router_logits.shape[-1]
    _check_top_k(top_k, num_experts)
    if n_group < 1 or num_experts % n_group != 0:
        raise ValueError(f"n_group={n_group} must be >= 1 and divide the number of experts ({num_experts})")
    if not 1 <= topk_group <= n_group:
        raise ValueError(f"topk_group={topk_group} must be between 1 and n_group={n_group}")
    group_size = num_experts // n_group
    if top_k > topk_group * group_size:
        raise ValueError(
            f"top_k={top_k} exceeds the {topk_group * group_size} experts in topk_group={topk_group} groups of "
            f"{group_size}"
        )
    if topk_group < n_group and group_size < 2:
        raise ValueError(f"group-limited routing scores a group by its best 2 experts; groups have {group_size}")
    cdt = compute_dtype or _compute_dtype(router_logits.dtype)
    scores = router_logits.to(cdt).sigmoid()
    with torch.no_grad():  # selection only; the weights below are gathered from the differentiable scores
        choice = scores if correction_bias is None else scores + correction_bias.to(cdt)
        if topk_group < n_group:  # every group kept -> the mask is all ones, skip it (same result)
            grouped = choice.view(-1, n_group, group_size)
            group_scores = grouped.topk(2, dim=-1).values.sum(dim=-1)  # [N, n_group]
            group_idx = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
            choice = grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view(-1, num_experts)
        ids = torch.topk(choice, k=top_k, dim=-1, sorted=False).indices
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


@dataclass(frozen=True)
class ExpertForm:
    """How a family's experts are laid out and gated beyond the default (transformers 5's fused SwiGLU):
    ``transposed``: ``gate_up_proj [E, H, 2I]`` and ``down_proj [E, I, H]`` (x @ W, GPT-OSS); ``interleaved``: gate
    and up alternate along ``2I`` (gate at even indices) instead of gate first; ``gate_up_bias [E, 2I]`` /
    ``down_bias [E, H]``: added after each product; ``glu(gate, up)``: the gated unit (default ``act(gate) * up``)."""

    transposed: bool = False
    interleaved: bool = False
    gate_up_bias: Tensor | None = None
    down_bias: Tensor | None = None
    glu: Callable[[Tensor, Tensor], Tensor] | None = None

    def gated(self, h: Tensor, act_fn: Callable[[Tensor], Tensor]) -> Tensor:
        """``[.., 2I]`` (the gate/up product, biases added) -> the gated unit's ``[.., I]``."""
        gate, up = (h[..., 0::2], h[..., 1::2]) if self.interleaved else h.chunk(2, dim=-1)
        return self.glu(gate, up) if self.glu is not None else act_fn(gate) * up


_PLAIN = ExpertForm()


def _check_experts_args(x: Tensor, expert_ids: Tensor, weights: Tensor, gate_up_proj: Tensor, down_proj: Tensor,
                        form: ExpertForm = _PLAIN):
    if x.dim() != 2:
        raise ValueError(f"x must be [N, H], got shape {tuple(x.shape)}")
    n, h = x.shape
    in_dim, out_dim = (1, 2) if form.transposed else (2, 1)
    if gate_up_proj.dim() != 3 or gate_up_proj.shape[in_dim] != h or gate_up_proj.shape[out_dim] % 2:
        want = "[E, H, 2*I]" if form.transposed else "[E, 2*I, H]"
        raise ValueError(f"gate_up_proj must be {want} with H={h}, got shape {tuple(gate_up_proj.shape)}")
    e, two_i = gate_up_proj.shape[0], gate_up_proj.shape[out_dim]
    want_down = (e, two_i // 2, h) if form.transposed else (e, h, two_i // 2)
    if tuple(down_proj.shape) != want_down:
        raise ValueError(f"down_proj must be {list(want_down)}, got shape {tuple(down_proj.shape)}")
    for name, b, size in (("gate_up_bias", form.gate_up_bias, two_i), ("down_bias", form.down_bias, h)):
        if b is not None and tuple(b.shape) != (e, size):
            raise ValueError(f"{name} must be [E={e}, {size}], got shape {tuple(b.shape)}")
    if expert_ids.dim() != 2 or expert_ids.shape[0] != n or tuple(weights.shape) != tuple(expert_ids.shape):
        raise ValueError(
            f"expert_ids and weights must both be [N={n}, k], got {tuple(expert_ids.shape)} and {tuple(weights.shape)}"
        )
    if expert_ids.dtype.is_floating_point or expert_ids.dtype == torch.bool:
        raise ValueError(f"expert_ids must be an integer tensor, got {expert_ids.dtype}")
    if gate_up_proj.dtype != x.dtype or down_proj.dtype != x.dtype:
        raise ValueError(
            f"expert weights must have x's dtype {x.dtype}, got gate_up_proj {gate_up_proj.dtype} and down_proj "
            f"{down_proj.dtype}"
        )


ExpertLora = dict[str, tuple[Tensor, Tensor, float]]
"""``{"gate_up_proj" | "down_proj": (A [E, r, in], B [E, out, r], scaling)}``: LoRA factors of the fused weights."""


def _check_lora(lora: ExpertLora | None, gate_up_proj: Tensor, down_proj: Tensor, transposed: bool = False) -> None:
    for name, (a, b, _) in (lora or {}).items():
        w = {"gate_up_proj": gate_up_proj, "down_proj": down_proj}.get(name)
        if w is None:
            raise ValueError(f"expert LoRA on {name!r}: only 'gate_up_proj' and 'down_proj' are fused expert weights")
        e, out_f, in_f = (w.shape[0], w.shape[2], w.shape[1]) if transposed else w.shape
        if a.dim() != 3 or b.dim() != 3 or a.shape[0] != e or a.shape[2] != in_f or tuple(b.shape[:2]) != (e, out_f) \
                or b.shape[2] != a.shape[1]:
            raise ValueError(f"expert LoRA on {name} {tuple(w.shape)}: A must be [E, r, {in_f}] and B [E, {out_f}, r], "
                             f"got {tuple(a.shape)} and {tuple(b.shape)}")


def _lora_factors(lora: ExpertLora | None, name: str, dtype: torch.dtype):
    """``(A, B, s)`` of ``name`` in the compute dtype (PEFT casts the adapter to the weight's dtype), or None."""
    if not lora or name not in lora:
        return None
    a, b, s = lora[name]
    return a.to(dtype), b.to(dtype), s


def _expert_rows(xs: Tensor, e: int, gate_up_proj: Tensor, down_proj: Tensor, act_fn, gu_lora, dn_lora,
                 form: ExpertForm = _PLAIN) -> Tensor:
    """Expert ``e`` on its rows ``xs [c, H]`` -> ``[c, H]``, with the LoRA updates of its weights if any."""
    h = xs @ gate_up_proj[e] if form.transposed else F.linear(xs, gate_up_proj[e])  # [c, 2I]
    if form.gate_up_bias is not None:
        h = h + form.gate_up_bias[e]
    if gu_lora is not None:
        a, b, s = gu_lora
        h = h + F.linear(F.linear(xs, a[e]), b[e]) * s  # [c, r] -> [c, 2I]
    mid = form.gated(h, act_fn)  # [c, I]
    y = mid @ down_proj[e] if form.transposed else F.linear(mid, down_proj[e])  # [c, H]
    if form.down_bias is not None:
        y = y + form.down_bias[e]
    if dn_lora is not None:
        a, b, s = dn_lora
        y = y + F.linear(F.linear(mid, a[e]), b[e]) * s
    return y


def _aligned16(t: Tensor) -> bool:
    es = t.element_size()
    return t.data_ptr() % 16 == 0 and all((s * es) % 16 == 0 for s, d in zip(t.stride(), t.shape) if s != 1 and d != 1)


_GROUPED_DTYPES = {"cpu": (torch.float32, torch.bfloat16, torch.float16), "cuda": (torch.bfloat16,)}


def _grouped_mm_ok(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, form: ExpertForm = _PLAIN) -> bool:
    """Whether ``F.grouped_mm`` has a kernel here: CPU float32/bf16/fp16, CUDA bf16; 16-byte aligned strides."""
    return x.dtype in _GROUPED_DTYPES.get(x.device.type, ()) and _grouped_mm_shapes_ok(x, gate_up_proj, down_proj,
                                                                                      form)


def _grouped_mm_shapes_ok(x: Tensor, gate_up_proj: Tensor, down_proj: Tensor, form: ExpertForm = _PLAIN) -> bool:
    """:func:`_grouped_mm_ok` on any device that has a kernel for ``x``'s dtype (the dry run's question on meta:
    whether a CPU or CUDA run of these shapes may take the grouped dispatch)."""
    if not hasattr(F, "grouped_mm") or not any(x.dtype in d for d in _GROUPED_DTYPES.values()):
        return False
    es = x.element_size()
    e_h_2i = gate_up_proj.shape if form.transposed else gate_up_proj.transpose(1, 2).shape
    h, two_i = e_h_2i[1], e_h_2i[2]
    # the kernel's operands: gathered x [S, H], act output [S, I], gate_up^T [E, H, 2I], down^T [E, I, H]
    return (h * es) % 16 == 0 and (two_i // 2 * es) % 16 == 0 and _aligned16(gate_up_proj) and _aligned16(down_proj)


def _grouped_lora_ok(factors, x: Tensor) -> bool:
    """Whether ``F.grouped_mm`` takes the adapter's operands: ``[S, r]`` rows 16-byte aligned (the factors are made
    contiguous: an adapter's size, not the weight's)."""
    return (factors[0].shape[1] * x.element_size()) % 16 == 0


def _grouped_lowrank(xs: Tensor, factors, offs: Tensor) -> Tensor:
    """``s B[e] (A[e] x)`` for every slot row of ``xs [S, in]`` (grouped by expert, ``offs``) -> ``[S, out]``."""
    a, b, s = factors
    t = F.grouped_mm(xs, a.transpose(1, 2).contiguous(), offs=offs)  # [S, r]
    return F.grouped_mm(t, b.transpose(1, 2).contiguous(), offs=offs) * s  # [S, out]


def experts_forward(
    x: Tensor,
    expert_ids: Tensor,
    weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor] = F.silu,
    *,
    impl: str = "auto",
    lora: ExpertLora | None = None,
    form: ExpertForm | None = None,
) -> Tensor:
    """Routed SwiGLU experts. ``x [N, H]``, ``expert_ids [N, k]`` (int), ``weights [N, k]``,
    ``gate_up_proj [E, 2*I, H]`` (gate rows first), ``down_proj [E, H, I]`` -> ``[N, H]`` in x's dtype.
    ``lora``: LoRA factors of the fused weights (:data:`ExpertLora`, module docstring), applied on the routed rows.
    ``form``: another layout, biases or gated unit (:class:`ExpertForm`; GPT-OSS); the LoRA factors are the same
    ``A [E, r, in]``, ``B [E, out, r]`` whichever way ``W`` is stored.

    ``impl``: ``"loop"`` (per-expert ``F.linear`` over the experts that received tokens; one host sync for the
    counts), ``"grouped_mm"`` (``F.grouped_mm`` over all experts, no host sync; CPU float32/bf16/fp16 and CUDA bf16
    with 16-byte-aligned sizes), ``"auto"`` (``grouped_mm`` where it applies, else ``loop``).
    """
    if impl not in EXPERT_IMPLS:
        raise ValueError(f"impl={impl!r} is not one of {EXPERT_IMPLS}")
    form = form or _PLAIN
    _check_experts_args(x, expert_ids, weights, gate_up_proj, down_proj, form)
    _check_lora(lora, gate_up_proj, down_proj, form.transposed)
    num_experts = gate_up_proj.shape[0]
    gu_lora, dn_lora = _lora_factors(lora, "gate_up_proj", x.dtype), _lora_factors(lora, "down_proj", x.dtype)
    use_grouped = _grouped_mm_ok(x, gate_up_proj, down_proj, form) and all(
        _grouped_lora_ok(f, x) for f in (gu_lora, dn_lora) if f is not None)
    if impl == "grouped_mm" and not use_grouped:
        raise ValueError(f"impl='grouped_mm' has no kernel for {x.dtype} on {x.device.type} with these shapes")
    use_grouped = use_grouped and impl != "loop" and expert_ids.numel() > 0

    n, k = expert_ids.shape
    if meta.is_meta(x):  # the memory planner's dry run: routing is data (ops/meta.py)
        # the grouped dispatch's factor copies, wherever a CPU or CUDA run of these shapes may take it (a CUDA
        # float32/fp16 run takes the loop, which copies nothing: then an adapter's bytes per MoE layer over)
        if _grouped_mm_shapes_ok(x, gate_up_proj, down_proj, form):
            gu_lora, dn_lora = (meta.grouped_lora_copies(f) if f is not None and _grouped_lora_ok(f, x) else f
                                for f in (gu_lora, dn_lora))
        ys, token_idx = meta.expert_slot_outputs(
            x, weights, lambda xs, e: _expert_rows(xs, e, gate_up_proj, down_proj, act_fn, gu_lora, dn_lora, form))
        return combine_slots(ys, weights.reshape(-1), token_idx, n, x.dtype)
    flat_ids = expert_ids.reshape(-1)
    with torch.no_grad():
        order = torch.argsort(flat_ids, stable=True)  # slots grouped by expert, token order within an expert
        token_idx = order // k
        counts = torch.bincount(flat_ids, minlength=num_experts)
        if counts.numel() != num_experts:
            raise ValueError(f"expert_ids contains ids >= the number of experts ({num_experts})")
    xs = x[token_idx]  # [S, H], S = N * k

    if use_grouped:
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        t = (lambda w: w) if form.transposed else (lambda w: w.transpose(1, 2))  # noqa: E731
        h = F.grouped_mm(xs, t(gate_up_proj), offs=offs)  # [S, 2I]
        slot_expert = flat_ids[order] if form.gate_up_bias is not None or form.down_bias is not None else None
        if form.gate_up_bias is not None:
            h = h + form.gate_up_bias[slot_expert]
        if gu_lora is not None:
            h = h + _grouped_lowrank(xs, gu_lora, offs)
        mid = form.gated(h, act_fn)  # [S, I]
        ys = F.grouped_mm(mid, t(down_proj), offs=offs)  # [S, H]
        if form.down_bias is not None:
            ys = ys + form.down_bias[slot_expert]
        if dn_lora is not None:
            ys = ys + _grouped_lowrank(mid, dn_lora, offs)
    else:
        pieces = []
        start = 0
        for e, c in enumerate(counts.tolist()):
            if c == 0:
                continue
            pieces.append(_expert_rows(xs[start : start + c], e, gate_up_proj, down_proj, act_fn, gu_lora, dn_lora,
                                       form))
            start += c
        ys = torch.cat(pieces) if pieces else xs.new_zeros(0, x.shape[1])

    return combine_slots(ys, weights.reshape(-1)[order], token_idx, n, x.dtype)


COMBINE_ELEMS = 1 << 22  # slot rows x hidden of one block of the weighted combine (its float32 products: 16 MiB)


class _CombineSlots(torch.autograd.Function):
    """:func:`combine_slots` with its products formed block by block, forward and backward."""

    @staticmethod
    def forward(ctx, ys: Tensor, w: Tensor, token_idx: Tensor, n: int, dtype: torch.dtype) -> Tensor:
        s, h = ys.shape
        rows = max(1, COMBINE_ELEMS // max(1, h))
        cast = ys.new_empty((s, h), dtype=dtype)  # the products in ``dtype``, filled a block at a time
        starts = range(0, s, rows)
        for i, a in enumerate(starts):
            if meta.skip_repeated_block(ys, i, (0, len(starts) - 1)):  # the planner's dry run (ops/meta.py)
                continue
            b = a + rows
            cast[a:b] = ys[a:b] * w[a:b, None]  # formed in the promoted dtype, rounded to ``dtype`` on the copy
        ctx.save_for_backward(ys, w, token_idx)
        return ys.new_zeros((n, h), dtype=dtype).index_add_(0, token_idx, cast)  # one scatter-add, as before

    @staticmethod
    def backward(ctx, g: Tensor):
        ys, w, token_idx = ctx.saved_tensors
        s, h = ys.shape
        prod = torch.promote_types(ys.dtype, w.dtype)  # the dtype the products were formed in
        rows = max(1, COMBINE_ELEMS // max(1, h))
        dys = torch.empty_like(ys) if ctx.needs_input_grad[0] else None
        dw = torch.empty_like(w) if ctx.needs_input_grad[1] else None
        starts = range(0, s, rows)
        for i, a in enumerate(starts):
            if meta.skip_repeated_block(ys, i, (0, len(starts) - 1)):
                continue
            b = a + rows
            gb = g.index_select(0, token_idx[a:b]).to(prod)  # [rows, H]: each slot's token's output gradient
            if dys is not None:
                dys[a:b] = (gb * w[a:b, None]).to(ys.dtype)
            if dw is not None:
                dw[a:b] = (gb * ys[a:b]).sum(-1).to(w.dtype)
        return dys, dw, None, None, None


def combine_slots(ys: Tensor, w: Tensor, token_idx: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """The routed slots' outputs weighted and summed per token: ``ys [S, H]`` (slot outputs), ``w [S]`` (their
    routing weights), ``token_idx [S]`` (each slot's token) -> ``[n, H]`` in ``dtype``, equal to
    :func:`combine_slots_reference` (each product formed in the promoted dtype, cast to ``dtype``, scatter-added
    in slot order).

    Why its own op: written as that one expression, the products ``[S, H]`` exist whole in the promoted dtype (float32
    for a bf16 model with float32 router weights), and autograd's backward makes three such tensors (the gradient
    cast to float32 and both products' gradients): at GLM-5's size, 4,096 tokens x 8 slots x 6,144 hidden, 768 MiB
    each, 2.3 GiB per MoE layer. Here the products go ``COMBINE_ELEMS`` at a time, forward and backward: the forward
    holds them whole only in ``dtype`` (one scatter-add of them all, as the expression does: blocks of scatter-adds
    would round bf16 sums in another order), the backward only the gradient of ``ys`` (``[S, H]`` in its dtype)."""
    return _CombineSlots.apply(ys, w, token_idx, n, dtype)


def combine_slots_reference(ys: Tensor, w: Tensor, token_idx: Tensor, n: int, dtype: torch.dtype) -> Tensor:
    """:func:`combine_slots` as the plain expression (plain autograd)."""
    return ys.new_zeros((n, ys.shape[1]), dtype=dtype).index_add(0, token_idx, (ys * w[:, None]).to(dtype))


def experts_forward_reference(
    x: Tensor,
    expert_ids: Tensor,
    weights: Tensor,
    gate_up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor] = F.silu,
    form: ExpertForm | None = None,
) -> Tensor:
    """Obviously-correct slow version: a Python loop over tokens and their k slots, the formula as written."""
    form = form or _PLAIN
    _check_experts_args(x, expert_ids, weights, gate_up_proj, down_proj, form)
    rows = []
    for t in range(x.shape[0]):
        acc = torch.zeros_like(x[t])
        for j in range(expert_ids.shape[1]):
            e = int(expert_ids[t, j])
            w_gu, w_dn = (gate_up_proj[e].T, down_proj[e].T) if form.transposed else (gate_up_proj[e], down_proj[e])
            h = w_gu @ x[t] + (form.gate_up_bias[e] if form.gate_up_bias is not None else 0)  # [2I]
            hidden = form.gated(h, act_fn)
            y = w_dn @ hidden + (form.down_bias[e] if form.down_bias is not None else 0)
            acc = acc + (y * weights[t, j]).to(x.dtype)
        rows.append(acc)
    return torch.stack(rows) if rows else x.new_zeros(0, x.shape[1])


def shared_expert_forward(
    x: Tensor,
    gate_proj: Tensor,
    up_proj: Tensor,
    down_proj: Tensor,
    act_fn: Callable[[Tensor], Tensor] = F.silu,
    gate_weight: Tensor | None = None,
) -> Tensor:
    """The always-on shared expert: ``down(act(gate(x)) * up(x))`` with ``nn.Linear``-layout weights
    (``gate_proj, up_proj [I, H]``, ``down_proj [H, I]``), times ``sigmoid(x @ gate_weight.T)`` when a
    ``gate_weight [1, H]`` is given (Qwen3-Next / Qwen3.5 ``shared_expert_gate``; DeepSeek/GLM have no gate)."""
    out = F.linear(act_fn(F.linear(x, gate_proj)) * F.linear(x, up_proj), down_proj)
    if gate_weight is not None:
        out = torch.sigmoid(F.linear(x, gate_weight)) * out
    return out
