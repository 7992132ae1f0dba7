"""HF ``model_type`` -> how to build our model and map its checkpoint names.

Each family module defines ``FAMILY``; adding a family is one line in ``_family_modules``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

from longstraw.models.transformer import CausalLM
from longstraw.models.weights import WeightMap


@dataclass(frozen=True)
class Family:
    name: str
    model_types: tuple[str, ...]
    build: Callable[[dict], CausalLM]
    weights: Callable[[dict], WeightMap] = field(default=lambda cfg: WeightMap())


_family_modules = ("longstraw.models.dense", "longstraw.models.qwen_hybrid", "longstraw.models.deepseek")


def families() -> list[Family]:
    return [importlib.import_module(m).FAMILY for m in _family_modules]


def supported_model_types() -> list[str]:
    return sorted(t for f in families() for t in f.model_types)


def family_for(model_type: object) -> Family:
    for f in families():
        if model_type in f.model_types:
            return f
    raise ValueError(f"unsupported model_type {model_type!r}; supported: {', '.join(supported_model_types())}")


def build_model(cfg: dict) -> CausalLM:
    """Build a randomly initialised model from an HF config dict."""
    return family_for(cfg.get("model_type")).build(cfg)
