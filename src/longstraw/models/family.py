"""What a model family module declares: the HF ``model_type`` values it builds, its builder and its checkpoint-name
map. The registry (:mod:`longstraw.models.registry`) collects one :class:`Family` per family module."""

from __future__ import annotations

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
