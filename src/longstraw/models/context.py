"""What every layer of one ``CausalLM.run`` call receives besides its input and its prefix state.

``CallContext`` is made once per call: the positions of the new tokens (``start .. start + length - 1``), their RoPE
tables, and ``shared``, a scratch dictionary through which a layer hands data to a later layer of the same call
(GLM-5's shared DSA layers read the top-k selection of their full indexer layer: ``shared[layer_index]``). Made
per call, nothing leaks between calls; activation checkpointing recomputes a layer with the same object, in which
what the layer needs from earlier layers is still present.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import Tensor


@dataclass
class CallContext:
    """Per-call data of one ``model.run``: ``cos, sin [T, rotary_dim]`` (None for a model without RoPE), the first
    position ``start`` and the number of new tokens ``length``, and ``shared`` (layer-to-layer data).
    ``local``: a second ``(cos, sin)`` pair for the layers that rotate with other RoPE settings (Gemma 3's sliding
    layers: ``Backbone(local_rotary=)``)."""

    start: int
    length: int
    cos: Tensor | None = None
    sin: Tensor | None = None
    shared: dict[int, Any] = field(default_factory=dict)
    local: tuple[Tensor, Tensor] | None = None

    @property
    def rope(self) -> tuple[Tensor, Tensor]:
        """``(cos, sin)``; a layer that rotates positions needs them (AssertionError if the model has none)."""
        assert self.cos is not None, "this model has no rotary embedding"
        return self.cos, self.sin

    @property
    def local_rope(self) -> tuple[Tensor, Tensor]:
        """The local layers' ``(cos, sin)`` (AssertionError if the model has no second rotary embedding)."""
        assert self.local is not None, "this model has no local rotary embedding"
        return self.local
