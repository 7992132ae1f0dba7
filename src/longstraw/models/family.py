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
    quantizations: tuple[str, ...] = ()  # quantization_config quant_methods its weight map dequantises on load

    def check_quantization(self, cfg: dict) -> None:
        """ValueError for a quantised checkpoint (``quantization_config``, top level or ``text_config``) whose
        method this family does not dequantise on load (FP8 DeepSeek-V3 / MiniMax-M2, INT4 Kimi-K2, ...)."""
        for where, c in (("config.json", cfg), ("config.json text_config", cfg.get("text_config"))):
            q = c.get("quantization_config") if isinstance(c, dict) else None
            if not q:
                continue
            method = q.get("quant_method") if isinstance(q, dict) else q
            if method not in self.quantizations:
                allowed = f"; {self.name} dequantises {', '.join(self.quantizations)} on load" if self.quantizations \
                    else ""
                raise ValueError(f"{where}: quantization_config (quant_method={method!r}) is not supported{allowed}: "
                                 "dequantise the checkpoint to bf16 first and load that")
