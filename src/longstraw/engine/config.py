"""The engine's settings: :class:`GRPOConfig` (one GRPO backward), :class:`SamplingConfig` (rollouts), and
:class:`GRPOStats` (what one backward did). Frozen dataclasses validated on construction: a bad value raises a
``ValueError`` naming it and what is allowed, before anything is computed. The trainer's run config embeds these
classes (``longstraw.rl.config``), so each setting is defined, defaulted and checked here only.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields
from enum import Enum

import torch
from torch import Tensor

from longstraw.losses import KLType, LossAggMode, PolicyLoss, parse_enum


class PromptGrad(str, Enum):
    EXACT = "exact"
    DETACHED = "detached"


COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GRPOConfig:
    """Settings of one GRPO backward (validated on construction; strings become enums).

    prompt_grad: ``"exact"`` (gradient through the prompt state) or ``"detached"``.
    loss_agg_mode, clip_ratio_low/high, clip_ratio_c (dual clip, None disables), kl_coef, kl_type, entropy_coef:
        the loss, as verl defines it (see :mod:`longstraw.losses`).
    loss_scale_factor: the divisor of ``seq-mean-token-sum-norm`` (default: the longest response of the group;
        set a constant, e.g. the max response length, to reproduce Dr. GRPO exactly).
    prefill_chunk: prompt tokens per prefill chunk (memory: one chunk's activations; exact mode: one chunk's graph).
    branch_batch: branches replayed together (right-padded); checkpoint_layers: recompute each layer in backward.
    logprob_chunk: tokens per chunk of the LM-head log-prob op; temperature: logits are divided by it.
    compute_dtype: None (the parameters' dtype) or ``"bfloat16"`` / ``"float16"`` autocast over float32
        parameters, which gives float32 gradient accumulation with low-precision compute.
    """

    prompt_grad: PromptGrad = PromptGrad.EXACT
    loss_agg_mode: LossAggMode = LossAggMode.TOKEN_MEAN
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    kl_coef: float = 0.0
    kl_type: KLType = KLType.LOW_VAR_KL
    entropy_coef: float = 0.0
    loss_scale_factor: float | None = None
    prefill_chunk: int = 4096
    branch_batch: int = 1
    checkpoint_layers: bool = False
    logprob_chunk: int = 1024
    temperature: float = 1.0
    compute_dtype: str | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("prompt_grad", parse_enum(PromptGrad, self.prompt_grad, "prompt_grad"))
        set_("loss_agg_mode", parse_enum(LossAggMode, self.loss_agg_mode, "loss_agg_mode"))
        set_("kl_type", parse_enum(KLType, self.kl_type, "kl_type"))
        for name in ("prefill_chunk", "branch_batch", "logprob_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r} must be a finite number >= 0")
        if self.clip_ratio_low >= 1:
            raise ValueError(f"clip_ratio_low={self.clip_ratio_low} must be < 1 (the ratio is clipped to 1 - it)")
        if self.clip_ratio_c is not None and not (self.clip_ratio_c > 1):
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c!r} must be > 1 (dual clip), or None to disable it")
        if not (self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be > 0")
        if self.loss_scale_factor is not None and not (self.loss_scale_factor > 0):
            raise ValueError(f"loss_scale_factor={self.loss_scale_factor!r} must be > 0 or None")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not supported; allowed: None, "
                             f"{', '.join(map(repr, COMPUTE_DTYPES))}")

    @property
    def exact(self) -> bool:
        return self.prompt_grad is PromptGrad.EXACT

    def policy_loss(self) -> PolicyLoss:
        return PolicyLoss(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c, self.kl_coef, self.kl_type,
                          self.entropy_coef)

    def to_dict(self) -> dict:
        return {f.name: (v.value if isinstance(v := getattr(self, f.name), Enum) else v) for f in fields(self)}


@dataclass
class GRPOStats:
    """What one ``grpo_backward`` did: the loss it back-propagated, per-branch log-probs, time and memory."""

    loss: float
    logprobs: list[Tensor]
    entropy: list[Tensor] | None
    metrics: dict[str, float]
    num_tokens: int
    prompt_len: int
    seconds: dict[str, float] = field(default_factory=dict)
    peak_memory: dict[str, int] = field(default_factory=dict)
    prompt_state_bytes: int = 0
    prompt_state_grad_bytes: int = 0


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), max_new_tokens, stops, seed."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    stop_strings: tuple[str, ...] = ()
    seed: int | None = None

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0 and math.isfinite(self.temperature)):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if not (0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")


def autocast_context(cfg: GRPOConfig, device: torch.device):
    """Autocast to ``cfg.compute_dtype`` on ``device`` (a no-op context when it is None)."""
    if cfg.compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[cfg.compute_dtype])
