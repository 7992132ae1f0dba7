"""HF ``model_type`` -> how to build our model and map its checkpoint names.

Each family module defines ``FAMILY`` (a :class:`~longstraw.models.family.Family`); adding a family is one import
and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

import torch

from longstraw.models import bailing, deepseek, dense, gemma3, gpt_oss, gqa_moe, kimi, olmo, qwen_hybrid
from longstraw.models.family import Family
from longstraw.models.transformer import CausalLM

FAMILIES: tuple[Family, ...] = (dense.FAMILY, gqa_moe.FAMILY, qwen_hybrid.FAMILY, deepseek.FAMILY, gpt_oss.FAMILY,
                                gemma3.FAMILY, olmo.FAMILY, kimi.FAMILY, bailing.FAMILY)


def families() -> list[Family]:
    return list(FAMILIES)


def supported_model_types() -> list[str]:
    return sorted(t for f in FAMILIES for t in f.model_types)


def family_for(model_type: object) -> Family:
    for f in FAMILIES:
        if model_type in f.model_types:
            return f
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}")


def build_model(cfg: dict) -> CausalLM:
    """Build a randomly initialised model from an HF config dict."""
    return family_for(cfg.get("model_type")).build(cfg)


_RANDOM_INITS = frozenset({"normal_", "trunc_normal_", "uniform_", "kaiming_normal_", "kaiming_uniform_",
                           "xavier_normal_", "xavier_uniform_", "orthogonal_", "log_normal_", "cauchy_",
                           "exponential_", "geometric_", "random_", "bernoulli_"})


class _NoRandomInitOnMeta(torch.overrides.TorchFunctionMode):
    """Random initialisation of a meta tensor (``nn.init.normal_``, ``Tensor.normal_``, ...) returns it as it is:
    there is nothing to draw on meta, and ``normal_``'s meta kernel imports ``torch._dynamo`` (~70 MiB of every
    rank's resident memory, for nothing)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_INITS:  # nn.init passes its tensor by keyword
            t = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(t, torch.Tensor) and t.is_meta:
                return t
        return func(*args, **kwargs)


def build_on_meta(cfg: dict) -> CausalLM:
    """The model of an HF config dict on the meta device (no memory, no random init): what loading and the planner
    start from."""
    with torch.device("meta"), _NoRandomInitOnMeta():
        return build_model(cfg)
