"""Rotary position embeddings: the frequency schedules HF checkpoints name, and their application.

Angles are formed as ``position (float32) * inv_freq (float32)`` and ``cos``/``sin`` cast to the activations' dtype,
exactly as transformers does (models were trained that way; at 1M positions float32 angles lose ~0.06 rad of
absolute precision, which every reference implementation shares). Supported ``rope_type`` values: ``default``,
``linear``, ``llama3``, ``yarn``. Dynamic NTK and LongRoPE change with the sequence length and are rejected.

``partial_rotary_factor`` < 1 rotates only the first ``int(head_dim * factor)`` channels (Qwen3-Next, GLM).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeParams:
    rope_type: str
    theta: float
    rotary_dim: int
    extra: dict = field(default_factory=dict)  # factor, low/high_freq_factor, original_max_position_embeddings, ...


def rope_params_from_hf(cfg: dict, head_dim: int) -> RopeParams:
    """Read RoPE settings from an HF config dict (v5 ``rope_parameters`` or v4 ``rope_theta`` + ``rope_scaling``)."""
    rp = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if not rp:
        rp = dict(legacy)
        rp.setdefault("rope_theta", cfg.get("rope_theta", 10000.0))
    rope_type = rp.get("rope_type", rp.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope_type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    theta = float(rp.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    factor = rp.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0))
    rotary_dim = int(head_dim * factor)
    extra = {k: v for k, v in rp.items() if k not in ("rope_type", "type", "rope_theta", "partial_rotary_factor")}
    extra.setdefault("max_position_embeddings", cfg.get("max_position_embeddings"))
    return RopeParams(rope_type, theta, rotary_dim, extra)


def layer_type_ropes(cfg: dict, head_dim: int, *, full_theta: float, local_theta: float
                     ) -> tuple[RopeParams, RopeParams]:
    """``(full layers' RopeParams, sliding layers' RopeParams)`` of a model whose RoPE depends on the layer type
    (Gemma 3, OLMo 3): transformers 5's ``rope_parameters = {"full_attention": {...}, "sliding_attention": {...}}``,
    or transformers 4's ``rope_theta`` + ``rope_scaling`` for the full layers and ``local_theta`` (the caller reads
    its family's key) with plain RoPE for the sliding ones. A theta a type does not give is ``full_theta`` /
    ``local_theta``."""
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and ("full_attention" in rp or "sliding_attention" in rp):
        full = {"rope_type": "default", "rope_theta": full_theta, **(rp.get("full_attention") or {})}
        local = {"rope_type": "default", "rope_theta": local_theta, **(rp.get("sliding_attention") or {})}
    else:
        full = {"rope_type": "default", "rope_theta": full_theta, **(cfg.get("rope_scaling") or {})}
        local = {"rope_type": "default", "rope_theta": local_theta}
    return (rope_params_from_hf({"rope_parameters": full}, head_dim),
            rope_params_from_hf({"rope_parameters": local}, head_dim))


def _base_inv_freq(theta: float, dim: int) -> Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim))


def _need(extra: dict, key: str, rope_type: str):
    if extra.get(key) is None:
        raise ValueError(f"rope_type {rope_type!r} needs {key!r} in rope_parameters")
    return extra[key]


def compute_inv_freq(p: RopeParams) -> tuple[Tensor, float]:
    """``(inv_freq [rotary_dim/2] float32, attention_scaling)`` for the given schedule."""
    dim, theta, ex = p.rotary_dim, p.theta, p.extra
    if p.rope_type == "default":
        return _base_inv_freq(theta, dim), 1.0
    if p.rope_type == "linear":
        return _base_inv_freq(theta, dim) / float(_need(ex, "factor", "linear")), 1.0
    if p.rope_type == "llama3":
        inv = _base_inv_freq(theta, dim)
        factor = _need(ex, "factor", "llama3")
        low, high = _need(ex, "low_freq_factor", "llama3"), _need(ex, "high_freq_factor", "llama3")
        old = _need(ex, "original_max_position_embeddings", "llama3")
        low_wl, high_wl = old / low, old / high
        wavelen = 2 * math.pi / inv
        inv_l = torch.where(wavelen > low_wl, inv / factor, inv)
        smooth = (old / wavelen - low) / (high - low)
        smoothed = (1 - smooth) * inv_l / factor + smooth * inv_l
        medium = ~(wavelen < high_wl) * ~(wavelen > low_wl)
        return torch.where(medium, smoothed, inv_l), 1.0
    if p.rope_type == "yarn":
        return _yarn(p)
    raise AssertionError(p.rope_type)


def _yarn(p: RopeParams) -> tuple[Tensor, float]:
    dim, theta, ex = p.rotary_dim, p.theta, p.extra
    orig = _need(ex, "original_max_position_embeddings", "yarn")
    factor = ex.get("factor")
    if factor is None:
        factor = _need(ex, "max_position_embeddings", "yarn") / orig

    def mscale_of(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    att = ex.get("attention_factor")
    if att is None:
        m, m_all = ex.get("mscale"), ex.get("mscale_all_dim")
        att = float(mscale_of(factor, m) / mscale_of(factor, m_all)) if m and m_all else mscale_of(factor)
    beta_fast, beta_slow = ex.get("beta_fast") or 32, ex.get("beta_slow") or 1

    def corr_dim(rot):
        return (dim * math.log(orig / (rot * 2 * math.pi))) / (2 * math.log(theta))

    lo, hi = corr_dim(beta_fast), corr_dim(beta_slow)
    if ex.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - lo) / (hi - lo), 0, 1)
    pos_freqs = theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extra_f = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra_f) + (1.0 / pos_freqs) * extra_f
    return inv, att


class RotaryEmbedding(nn.Module):
    """cos/sin tables for given positions.

    ``inv_freq`` is not a buffer: it is recomputed in float32 per device and cached, so ``model.to(bfloat16)`` or
    building on the meta device can never degrade it.
    """

    def __init__(self, params: RopeParams):
        super().__init__()
        self.params = params
        with torch.device("cpu"):  # also when the model is being built on the meta device
            self._inv_cpu, self.attention_scaling = compute_inv_freq(params)
        self._inv_by_device: dict[torch.device, Tensor] = {}

    def inv_freq(self, device: torch.device) -> Tensor:
        if device not in self._inv_by_device:
            self._inv_by_device[device] = self._inv_cpu.to(device)
        return self._inv_by_device[device]

    def forward(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """positions ``[T]`` (int) -> cos, sin ``[T, rotary_dim]`` in ``dtype``."""
        freqs = positions[:, None].float() * self.inv_freq(positions.device)[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos() * self.attention_scaling, emb.sin() * self.attention_scaling
        return cos.to(dtype), sin.to(dtype)

    def extra_repr(self) -> str:
        p = self.params
        return f"rope_type={p.rope_type}, theta={p.theta}, rotary_dim={p.rotary_dim}"


def rotate_half(x: Tensor) -> Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate the first ``cos.shape[-1]`` channels of ``x [B, H, T, D]`` (cos, sin ``[T, r]``); pass the rest."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    r = cos.shape[-1]
    if r == x.shape[-1]:
        return x * cos + rotate_half(x) * sin
    x_rot, x_pass = x[..., :r], x[..., r:]
    return torch.cat((x_rot * cos + rotate_half(x_rot) * sin, x_pass), dim=-1)


def apply_rope_interleaved(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """DeepSeek's layout: ``x [..., r]`` (exactly ``r = cos.shape[-1]`` channels) holds rotation pairs
    ``(x0, x1), (x2, x3), ...``. Returned DE-interleaved, ``[x_even * c - x_odd * s, x_odd * c + x_even * s]``, as
    the reference implementations return it (so stored keys and queries are in the half-split layout and a dot
    product between them is unchanged). Bit-identical to transformers' ``apply_rotary_pos_emb_interleave``."""
    assert x.shape[-1] == cos.shape[-1], "interleaved RoPE rotates the whole tensor it is given"
    return apply_rope(torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1), cos, sin)
