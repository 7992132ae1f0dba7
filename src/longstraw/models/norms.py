"""RMS norms in the exact operation order of the reference implementations (it matters in bf16).

* ``RMSNorm`` (Llama/Qwen2/Qwen3/DeepSeek): normalise in float32, cast back to the input dtype, then multiply by
  ``weight`` (initialised to ones).
* ``RMSNorm(weight_in_float32=True)`` (GPT-OSS): normalise in float32, multiply by ``weight`` in float32, then
  cast back (transformers keeps these weights in float32 in fp16 models, and so do we).
* ``RMSNorm(zero_centered=True)`` (Qwen3-Next / Qwen3.5): normalise in float32, multiply by ``1 + weight`` in
  float32 (weight initialised to zeros), then cast back.
* ``GatedRMSNorm`` (the Gated DeltaNet output norm): ``weight * norm(x)`` then ``* silu(gate)`` in float32; plain
  ``weight`` (init ones) even in the zero-centred families. ``GatedRMSNorm(activation="sigmoid",
  weight_in_float32=True)`` (Kimi Delta Attention's ``o_norm``): the weight applied in float32 too, then
  ``* sigmoid(gate)``.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longstraw.models.keep_fp32 import KeepsFloat32


class RMSNorm(KeepsFloat32, nn.Module):
    """A family may keep the weight in float32 in half-precision models (``models.keep_fp32``: GPT-OSS's, in fp16)."""

    def __init__(self, dim: int, eps: float = 1e-6, zero_centered: bool = False, weight_in_float32: bool = False):
        super().__init__()
        self.zero_centered, self.weight_in_float32 = zero_centered, weight_in_float32
        self.eps = eps
        self.weight = nn.Parameter(torch.zeros(dim) if zero_centered else torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.zero_centered or self.weight_in_float32:  # the weight applied in float32 (float64 stays)
            w = self.weight if self.weight.dtype == torch.float64 else self.weight.float()
            return (h * (1.0 + w) if self.zero_centered else w * h).to(dtype)
        return self.weight * h.to(dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.eps}, zero_centered={self.zero_centered}"


_GATES = {"silu": nn.functional.silu, "sigmoid": torch.sigmoid}


class GatedRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6, *, activation: str = "silu", weight_in_float32: bool = False):
        super().__init__()
        if activation not in _GATES:
            raise ValueError(f"gate activation {activation!r} is not supported; allowed: {', '.join(_GATES)}")
        self.eps, self.activation, self.weight_in_float32 = eps, activation, weight_in_float32
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor, gate: Tensor) -> Tensor:
        dtype = x.dtype
        h = x.to(torch.float32) if dtype != torch.float64 else x
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        if self.weight_in_float32:
            h = (self.weight if self.weight.dtype == torch.float64 else self.weight.float()) * h
        else:
            h = self.weight * h.to(dtype)
        g = gate.to(torch.float32) if gate.dtype != torch.float64 else gate
        return (h * _GATES[self.activation](g)).to(dtype)
