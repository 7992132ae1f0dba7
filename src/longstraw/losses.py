"""GRPO policy losses as verl defines them, split per branch so branches can be back-propagated one at a time.

verl aggregates a ``[G, T]`` loss matrix with a mask (``agg_loss``). Every mode is linear in the token losses, so
the batch loss is a sum over branches of ``weight_i * sum_t loss_{i,t}`` with a per-branch weight fixed before the
first branch runs (the classic gradient-accumulation bug is dividing each micro-batch by its own count):

===========================  =========================================  ==================================
mode                         verl                                       weight of branch i (D = normaliser)
===========================  =========================================  ==================================
``token-mean``               sum(l * m) / sum(m)                        1 / D,           D = #tokens
``seq-mean-token-mean``      mean_i(sum_t l / n_i)                      1 / (D * n_i),   D = #sequences
``seq-mean-token-sum``       mean_i(sum_t l)                            1 / D,           D = #sequences
``seq-mean-token-sum-norm``  sum(l * m) / T_max  (Dr. GRPO)             1 / D,           D = loss_scale_factor
===========================  =========================================  ==================================

``D`` covers the group by default; a trainer that accumulates several groups before one optimiser step passes
the step-global ``D`` (:func:`loss_denominator` over all groups) as ``loss_scale``.

Per token (``r = exp(clamp(logp - old_logp, -20, 20))``, advantage ``A`` of the branch)::

    pg   = max(-A r, -A clamp(r, 1 - clip_low, 1 + clip_high))
    pg   = min(pg, -A c)  where A < 0, if the dual clip c is set
    loss = pg + kl_coef * kl(logp, ref_logp) - entropy_coef * entropy

with ``kl`` one of ``k1 = logp - ref``, ``k2 = (logp - ref)^2 / 2``, ``low_var_kl = clamp(e^(ref-logp) - (ref-logp)
- 1, -10, 10)`` (``ref - logp`` clamped to [-20, 20] first), as verl's ``kl_penalty``, or ``k3`` (the same
unclamped, as TRL computes it).

``ratio_level="sequence"`` (GSPO, TRL's ``importance_sampling_level="sequence"``) uses one ratio per branch,
``r = exp(clamp(mean_t(logp - old_logp), -20, 20))``, for every token of it (the gradient flows through the mean).
``kl_ratio_weight`` multiplies the KL term by ``r`` (TRL's ``use_bias_correction_kl``: the unbiased reverse-KL
gradient of DeepSeek-V3.2).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from enum import Enum

import torch
from torch import Tensor


class LossAggMode(str, Enum):
    TOKEN_MEAN = "token-mean"
    SEQ_MEAN_TOKEN_MEAN = "seq-mean-token-mean"
    SEQ_MEAN_TOKEN_SUM = "seq-mean-token-sum"
    SEQ_MEAN_TOKEN_SUM_NORM = "seq-mean-token-sum-norm"


class RatioLevel(str, Enum):
    TOKEN = "token"
    SEQUENCE = "sequence"


class KLType(str, Enum):
    K1 = "k1"
    K2 = "k2"
    K3 = "k3"
    LOW_VAR_KL = "low_var_kl"


def parse_enum(enum_cls, value, field: str):
    if isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ValueError(f"{field}={value!r} is not supported; allowed: {allowed}") from None


@dataclass(frozen=True)
class PolicyLoss:
    """The clipped policy objective with KL and entropy terms (see module docstring)."""

    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    kl_coef: float = 0.0
    kl_type: KLType = KLType.LOW_VAR_KL
    entropy_coef: float = 0.0
    ratio_level: RatioLevel = RatioLevel.TOKEN
    kl_ratio_weight: bool = False

    def token_losses(self, logp: Tensor, old_logp: Tensor, adv: Tensor | float, ref_logp: Tensor | None,
                     entropy: Tensor | None) -> tuple[Tensor, dict[str, Tensor]]:
        """Per-token loss ``[T]`` and per-token statistics (sums are taken by the caller)."""
        if self.ratio_level is RatioLevel.SEQUENCE:  # one ratio for the branch: exp of the mean log-ratio
            neg_kl = torch.clamp((logp - old_logp).mean(), -20.0, 20.0).expand_as(logp)
        else:
            neg_kl = torch.clamp(logp - old_logp, -20.0, 20.0)
        ratio = torch.exp(neg_kl)
        adv = torch.as_tensor(adv, dtype=logp.dtype, device=logp.device)
        pg1 = -adv * ratio
        pg2 = -adv * torch.clamp(ratio, 1 - self.clip_ratio_low, 1 + self.clip_ratio_high)
        clip1 = torch.maximum(pg1, pg2)
        stats = {"pg_clipfrac": (pg2 > pg1).to(logp.dtype), "ppo_kl": -neg_kl.detach()}
        if self.clip_ratio_c is not None:
            pg3 = -adv * self.clip_ratio_c
            clip2 = torch.minimum(pg3, clip1)
            loss = torch.where(adv < 0, clip2, clip1)
            stats["pg_clipfrac_lower"] = ((clip1 > pg3) & (adv < 0)).to(logp.dtype)
        else:
            loss = clip1
        stats["pg_loss"] = loss.detach()
        if self.kl_coef != 0.0:
            if ref_logp is None:
                raise ValueError(f"kl_coef={self.kl_coef} needs ref_logprobs")
            kl = kl_penalty(logp, ref_logp, self.kl_type)
            stats["kl"] = kl.detach()
            if self.kl_ratio_weight:
                kl = kl * ratio
            loss = loss + self.kl_coef * kl
        if self.entropy_coef != 0.0:
            assert entropy is not None
            loss = loss - self.entropy_coef * entropy
        if entropy is not None:
            stats["entropy"] = entropy.detach()
        return loss, stats


def kl_penalty(logp: Tensor, ref_logp: Tensor, kl_type: KLType) -> Tensor:
    if kl_type is KLType.K1:
        return logp - ref_logp
    if kl_type is KLType.K2:
        return 0.5 * (logp - ref_logp).square()
    if kl_type is KLType.K3:  # unclamped, as TRL's GRPOTrainer computes it
        d = ref_logp - logp
        return torch.exp(d) - d - 1
    kl = torch.clamp(ref_logp - logp, -20.0, 20.0)
    return torch.clamp(torch.exp(kl) - kl - 1, -10.0, 10.0)


def loss_denominator(response_lengths: Sequence[int], mode: LossAggMode, loss_scale_factor: float | None = None) -> float:
    """The normaliser ``D`` of a set of responses (one group or all groups of a step)."""
    mode = parse_enum(LossAggMode, mode, "loss_agg_mode")
    if mode is LossAggMode.TOKEN_MEAN:
        return float(sum(response_lengths))
    if mode is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM:
        return float(loss_scale_factor if loss_scale_factor is not None else max(response_lengths))
    return float(len(response_lengths))


def branch_weight(length: int, mode: LossAggMode, denominator: float) -> float:
    """Weight of one branch's token-loss sum in the batch loss."""
    if mode is LossAggMode.SEQ_MEAN_TOKEN_MEAN:
        return 1.0 / (denominator * length)
    return 1.0 / denominator


def group_advantages(rewards, norm_by_std: bool = True, eps: float = 1e-6) -> Tensor:
    """GRPO advantages of one group: ``(r - mean) / (std + eps)`` (unbiased std), or ``r - mean``.

    A group whose rewards are all equal gets advantage 0 (not NaN). A group of one response has advantage 0.
    """
    r = torch.as_tensor(rewards, dtype=torch.float64).flatten()
    if r.numel() == 0:
        raise ValueError("rewards is empty: a group needs at least one response")
    bad = [float(x) for x in r if not math.isfinite(float(x))]
    if bad:
        raise ValueError(f"rewards must be finite, got {bad[0]}")
    if r.numel() == 1:
        return torch.zeros(1, dtype=torch.float32)
    centred = r - r.mean()
    if norm_by_std:
        centred = centred / (r.std(unbiased=True) + eps)
    return centred.to(torch.float32)
