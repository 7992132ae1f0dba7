"""Kimi Delta Attention (KDA): the linear-attention token mixer of Kimi-Linear.

Gated DeltaNet with a decay per key channel instead of per head (Kimi-Linear tech report, 2025; transformers'
``KimiLinearDeltaAttention``). Per token (HF names; ``H`` heads, ``D`` = ``linear_attn_config.head_dim`` for keys
and values alike, ``HD = H * D``)::

    q, k, v  = q_proj(x), k_proj(x), v_proj(x)          [HD] each
    q, k, v  = silu(causal_conv1d([q|k|v]))             depthwise, kernel K, over the concatenated channels
    beta     = sigmoid(b_proj(x))                        [H]
    g        = -exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)    [H, D]: log decay per key channel
    o, S     = gated_delta_rule(q, k, v, g, beta, S)     per-channel gates, q/k L2-normalised in the op
    y        = o_proj(o_norm(o, g_b_proj(g_a_proj(x))))  per head: w * rmsnorm(o) * sigmoid(gate), in float32

``f_a_proj`` / ``g_a_proj`` are rank-``D`` bottlenecks (``hidden -> D -> HD``). The forget gate's four tensors sit
under ``forget_gate.`` as in transformers' in-memory model (``forget_gate.f_a_proj``, ``forget_gate.f_b_proj``,
``forget_gate.dt_bias [HD]``, ``forget_gate.A_log [1, 1, H, 1]``); released checkpoints keep them directly under
``self_attn.`` and store the conv as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d`` (``[HD, 1, K]`` each): the weight
map (:mod:`longstraw.models.kimi`) renames and concatenates them.

Everything else (the prompt state, the conv window, the prefix hooks context parallelism overrides, the kernel
choice) is :class:`~longstraw.models.deltanet.DeltaRuleMixer`'s, shared with Gated DeltaNet; the rule is
``ops.deltanet``'s with ``g [B, T, H, D]`` (fla's ``chunk_kda`` on a GPU).

Ling 3.0 (``bailing_hybrid``, :mod:`longstraw.models.bailing`) runs the same mixer with full-rank gates and,
by default, the bounded "safe" forget gate (``full_rank_gates=True``, ``gate_lower_bound=-5``)::

    g        = lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))    [H, D], in (lower_bound, 0)
    y        = o_proj(o_norm(o, g_proj(x)))

(``forget_gate.f_proj [HD, hidden]``, ``forget_gate.A_log [H]``, ``g_proj [HD, hidden]``; without the safe gate,
``g = -exp(A_log) * softplus(f_proj(x) + dt_bias)`` as in Kimi-Linear.)
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longstraw.models.deltanet import DeltaRuleMixer, ShortConv, check_conv_activation
from longstraw.models.keep_fp32 import KeepsFloat32
from longstraw.models.norms import GatedRMSNorm


# what transformers' BailingHybridPreTrainedModel keeps in float32 (``_keep_in_fp32_modules_strict``: conv1d, dt_bias,
# A_log; its e_score_correction_bias is the router's, kept everywhere) as this mixer names them
KEPT_BY_LING = ("conv1d.weight", "forget_gate.dt_bias", "forget_gate.A_log")


class ForgetGate(nn.Module):
    """KDA's per-channel log decay: ``-exp(A_log) * softplus(f_b_proj(f_a_proj(x)) + dt_bias)`` (Kimi-Linear), or
    from one full-rank ``f_proj`` (``full_rank``), optionally bounded (``lower_bound``, Ling 3.0's "safe gate"):
    ``lower_bound * sigmoid(exp(A_log) * (f + dt_bias))``. ``A_log`` is ``[1, 1, H, 1]`` (Kimi-Linear's) or ``[H]``
    (``full_rank``: Ling's), as transformers holds each."""

    def __init__(self, hidden: int, num_heads: int, head_dim: int, *, full_rank: bool = False,
                 lower_bound: float | None = None):
        super().__init__()
        if lower_bound is not None and not (isinstance(lower_bound, (int, float)) and lower_bound < 0):
            raise ValueError(f"kda_lower_bound={lower_bound!r} must be a number < 0 (the log decay's floor)")
        self.num_heads, self.head_dim = num_heads, head_dim
        self.lower_bound = None if lower_bound is None else float(lower_bound)
        if full_rank:
            self.f_proj = nn.Linear(hidden, num_heads * head_dim, bias=False)
            self.f_a_proj = self.f_b_proj = None
        else:
            self.f_proj = None
            self.f_a_proj = nn.Linear(hidden, head_dim, bias=False)
            self.f_b_proj = nn.Linear(head_dim, num_heads * head_dim, bias=False)
        # transformers' init (fla's): A in [1, 16]; dt_bias the inverse softplus of dt in [1e-3, 0.1] (log-uniform),
        # so a fresh layer decays by exp(-A dt) per token, within [0.2, 1); nothing to draw on meta
        dt = torch.empty(num_heads * head_dim)
        if not dt.is_meta:
            dt = dt.uniform_(math.log(1e-3), math.log(1e-1)).exp().clamp_min(1e-4)
            dt = dt + torch.log(-torch.expm1(-dt))
        self.dt_bias = nn.Parameter(dt)
        a = torch.empty(num_heads) if full_rank else torch.empty(1, 1, num_heads, 1)
        self.A_log = nn.Parameter(a if a.is_meta else a.uniform_(1.0, 16.0).log())

    def pre(self, x: Tensor) -> Tensor:
        """``x [B, T, hidden]`` -> the gate's projection ``[B, T, HD]``."""
        return self.f_proj(x) if self.f_proj is not None else self.f_b_proj(self.f_a_proj(x))

    def forward(self, pre: Tensor, cdt: torch.dtype) -> Tensor:
        """``pre`` (:meth:`pre`) ``[B, T, HD]`` -> ``g [B, T, H, D]`` in ``cdt``."""
        b, t, _ = pre.shape
        u = (pre.to(cdt) + self.dt_bias.to(cdt)).view(b, t, self.num_heads, self.head_dim)
        rate = self.A_log.to(cdt).exp().view(1, 1, self.num_heads, 1)
        if self.lower_bound is not None:
            return self.lower_bound * torch.sigmoid(rate * u)
        return -rate * F.softplus(u)


class KimiDeltaAttention(KeepsFloat32, DeltaRuleMixer):
    """The KDA token mixer (module docstring); parameter names are transformers' in-memory ones. ``keep_float32``
    (:mod:`longstraw.models.keep_fp32`): Ling 3.0 keeps the short conv and the forget gate's ``dt_bias`` / ``A_log``
    in float32 in bf16/fp16 models, as transformers does (``KEPT_BY_LING``); Kimi-Linear keeps nothing."""

    per_channel = True

    def __init__(self, hidden: int, num_heads: int, head_dim: int, *, conv_kernel: int = 4, norm_eps: float = 1e-6,
                 activation: str = "silu", full_rank_gates: bool = False, gate_lower_bound: float | None = None):
        super().__init__()
        for name, v in (("linear_attn_config.num_heads", num_heads), ("linear_attn_config.head_dim", head_dim),
                        ("linear_attn_config.short_conv_kernel_size", conv_kernel)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        check_conv_activation(activation)
        self.num_k_heads = self.num_v_heads = num_heads
        self.head_k_dim = self.head_v_dim = head_dim
        self.key_dim = self.value_dim = num_heads * head_dim
        self.conv_dim = 3 * self.key_dim
        self.conv_kernel = conv_kernel
        self.q_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.k_proj = nn.Linear(hidden, self.key_dim, bias=False)
        self.v_proj = nn.Linear(hidden, self.value_dim, bias=False)
        self.conv1d = ShortConv(self.conv_dim, conv_kernel)
        self.forget_gate = ForgetGate(hidden, num_heads, head_dim, full_rank=full_rank_gates,
                                      lower_bound=gate_lower_bound)
        self.b_proj = nn.Linear(hidden, num_heads, bias=False)
        if full_rank_gates:
            self.g_proj = nn.Linear(hidden, self.value_dim, bias=False)
            self.g_a_proj = self.g_b_proj = None
        else:
            self.g_proj = None
            self.g_a_proj = nn.Linear(hidden, head_dim, bias=False)
            self.g_b_proj = nn.Linear(head_dim, self.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(head_dim, norm_eps, activation="sigmoid", weight_in_float32=True)
        self.o_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x ``[B, T, hidden]`` -> conv input ``[B, T, 3 HD]``, output gate ``[B, T, H, D]``, beta's logits
        ``[B, T, H]``, the forget gate's pre-activation ``[B, T, HD]``."""
        b, t, _ = x.shape
        mixed = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        z = self.g_proj(x) if self.g_proj is not None else self.g_b_proj(self.g_a_proj(x))
        return mixed, z.view(b, t, self.num_v_heads, self.head_v_dim), self.b_proj(x), self.forget_gate.pre(x)

    def _decay(self, pre: Tensor, cdt: torch.dtype) -> Tensor:
        return self.forget_gate(pre, cdt)

    def _output(self, o: Tensor, z: Tensor) -> Tensor:
        b, t = o.shape[:2]
        return self.o_proj(self.o_norm(o, z).reshape(b, t, self.value_dim))

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs per token: projections (q, k, v, the forget and output gates: two rank-D bottlenecks or
        two full-rank projections, beta, output), conv, and the chunked rule with per-channel gates (chunk 64);
        independent of context."""
        hidden, hd, d = self.o_proj.out_features, self.value_dim, self.head_v_dim
        if self.g_proj is not None:
            proj = 2.0 * hidden * (6 * hd + self.num_v_heads)
        else:
            proj = 2.0 * hidden * (4 * hd + 2 * d + self.num_v_heads) + 2.0 * 2 * d * hd
        return proj + self._rule_flops_per_token()
