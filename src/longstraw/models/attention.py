"""Full (softmax) attention with grouped K/V heads, as a token mixer over a prefix state.

Covers Llama (optional q/k/v/o bias), Qwen2 (q/k/v bias), Qwen3 (per-head q/k RMSNorm before RoPE, ``head_dim``
independent of ``hidden / heads``), MiniMax-M2 and OLMoE (one RMSNorm over all heads' queries, one over all keys:
``qk_norm="all"``; OLMoE's optional ``clip_qkv`` clamps q, k, v after them) and the gated attention of Qwen3-Next /
Qwen3.5 (``q_proj`` emits a per-head ``[query, gate]`` pair, output multiplied by ``sigmoid(gate)``, zero-centred q/k
norms, partial RoPE). ``window``: a sliding window (Gemma 3, GPT-OSS, OLMo 3, Mistral, Qwen with
``use_sliding_window``): the query at position ``p`` sees keys ``p - window < k <= p``, and the prompt state keeps
only what later tokens can see (:class:`~longstraw.state.SlidingKVState`). ``sinks``: GPT-OSS's attention sinks, a
learned logit per head (``self_attn.sinks [H]``) that joins every softmax with a zero value.

``forward(x, ctx, prefix)`` processes new tokens ``x [B, T, hidden]`` that follow the positions summarised by
``prefix`` (a list of :class:`KVSegment`: the stored prompt K/V, earlier chunks, generated tokens). The new tokens'
own K/V form a causal segment. Returns ``(y [B, T, hidden], (k, v))`` where ``k``/``v`` ``[B, Hkv, T, D]`` are the
post-RoPE keys/values of the new tokens, which prefill stores and the exact reverse pass back-propagates through.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longstraw.models.context import CallContext
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import apply_rope
from longstraw.ops.attention import KVSegment, segment_attention
from longstraw.state import KVState, SlidingKVState


class Attention(nn.Module):
    state_type = KVState

    def __init__(
        self,
        hidden: int,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        qkv_bias: bool = False,
        o_bias: bool = False,
        qk_norm: bool | str = False,
        qk_norm_zero_centered: bool = False,
        norm_eps: float = 1e-6,
        output_gate: bool = False,
        clip_qkv: float | None = None,
        window: int | None = None,
        sinks: bool = False,
        scale: float | None = None,
        local_rope: bool = False,
        qk_norm_weight_in_float32: bool = False,
        position_q_scale: tuple[float, int] | None = None,
    ):
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_attention_heads={num_heads} must be a multiple of num_key_value_heads={num_kv_heads}")
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.output_gate, self.clip_qkv = output_gate, clip_qkv
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
            raise ValueError(f"sliding window={window!r} must be an integer >= 2 (or None: full attention)")
        self.window = window  # sliding window: the query at position p sees keys p - window < k <= p
        # GPT-OSS: one learned logit per head in every softmax (with a zero value)
        self.sinks = nn.Parameter(torch.zeros(num_heads)) if sinks else None
        self.scale = head_dim**-0.5 if scale is None else scale  # Gemma 3: query_pre_attn_scalar ** -0.5
        self.local_rope = local_rope  # rotate with the call's local RoPE (ctx.local: Gemma 3's sliding layers)
        # Ministral 3 (Llama 4's long-context scaling): queries times 1 + beta log(1 + floor(position / L))
        self.position_q_scale = position_q_scale
        self.q_proj = nn.Linear(hidden, num_heads * head_dim * (2 if output_gate else 1), bias=qkv_bias)
        self.k_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.v_proj = nn.Linear(hidden, num_kv_heads * head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(num_heads * head_dim, hidden, bias=o_bias)
        if qk_norm not in (False, True, "head", "all"):
            raise ValueError(f"qk_norm={qk_norm!r}: one of False, True / 'head' (per head), 'all' (over all heads)")
        self.qk_norm_all = qk_norm == "all"  # the norms' width: every head's dims (else one head's)
        if qk_norm:
            q_dim, k_dim = (num_heads * head_dim, num_kv_heads * head_dim) if self.qk_norm_all else (head_dim,) * 2
            kw = dict(zero_centered=qk_norm_zero_centered, weight_in_float32=qk_norm_weight_in_float32)
            self.q_norm = RMSNorm(q_dim, norm_eps, **kw)
            self.k_norm = RMSNorm(k_dim, norm_eps, **kw)
        else:
            self.q_norm = self.k_norm = None

    def new_state(self, capacity: int, exact: bool = False) -> KVState | SlidingKVState:
        """Empty prompt state for ``capacity`` positions: every position's K/V, or for a sliding layer only the
        positions a later read can see (:class:`~longstraw.state.SlidingKVState`)."""
        if self.window is not None:
            return SlidingKVState(capacity, self.window, exact)
        return KVState(capacity)

    def forward(self, x: Tensor, ctx: CallContext, prefix: list[KVSegment] | None):
        b, t, _ = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if self.qk_norm_all:  # [B, T, H * D]: one norm over every head's dims
            q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (z.clamp(-self.clip_qkv, self.clip_qkv) for z in (q, k, v))
        q = q.view(b, t, self.num_heads, -1)
        gate = None
        if self.output_gate:
            q, gate = q.chunk(2, dim=-1)
            gate = gate.reshape(b, t, -1)
        k = k.view(b, t, self.num_kv_heads, self.head_dim)
        v = v.view(b, t, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if self.q_norm is not None and not self.qk_norm_all:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = q.transpose(1, 2), k.transpose(1, 2)
        cos, sin = ctx.local_rope if self.local_rope else ctx.rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.position_q_scale is not None:
            beta, span = self.position_q_scale
            pos = torch.arange(ctx.start, ctx.start + t, device=q.device, dtype=torch.float32)
            q = q * (1 + beta * torch.log(1 + torch.floor(pos / span)))[:, None].to(q.dtype)  # [T, 1]
        segments = list(prefix or []) + [KVSegment(k, v, causal=True)]
        o = segment_attention(q, segments, self.scale, window=self.window, sinks=self.sinks)  # [B, H, T, D]
        o = o.transpose(1, 2).reshape(b, t, -1)
        if gate is not None:
            o = o * torch.sigmoid(gate)
        return self.o_proj(o), (k, v)

    def flops_per_token(self, context: int) -> float:
        """Forward FLOPs per new token: projections plus attention over ``context`` keys (at most the window)."""
        if self.window is not None:
            context = min(context, self.window)
        hidden = self.k_proj.in_features
        proj = 2.0 * hidden * (self.q_proj.out_features + 2 * self.num_kv_heads * self.head_dim + self.num_heads * self.head_dim)
        return proj + 4.0 * self.num_heads * self.head_dim * context
