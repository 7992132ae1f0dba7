"""HF ``model_type`` -> how to build our model and map its checkpoint names.

Each family module defines ``FAMILY`` (a :class:`~longstraw.models.family.Family`); adding a family is one import
and one entry in :data:`FAMILIES`.
"""

from __future__ import annotations

from longstraw.models import deepseek, dense, qwen_hybrid
from longstraw.models.family import Family
from longstraw.models.transformer import CausalLM

FAMILIES: tuple[Family, ...] = (dense.FAMILY, qwen_hybrid.FAMILY, deepseek.FAMILY)


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
