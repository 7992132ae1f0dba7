"""The gated feed-forward block ``down(act(gate(x)) * up(x))`` and the activation table read from HF configs."""

from __future__ import annotations


import torch
from torch import Tensor, nn


def _gelu_tanh(x: Tensor) -> Tensor:
    return nn.functional.gelu(x, approximate="tanh")


ACTIVATIONS = {
    "silu": nn.functional.silu,
    "swish": nn.functional.silu,
    "gelu": nn.functional.gelu,
    "gelu_pytorch_tanh": _gelu_tanh,
    "gelu_new": _gelu_tanh,
    "relu": torch.relu,
}


def activation(name: str):
    """The activation function HF configs call ``name`` (``hidden_act``)."""
    if name not in ACTIVATIONS:
        raise ValueError(f"unsupported hidden_act {name!r}; supported: {', '.join(sorted(ACTIVATIONS))}")
    return ACTIVATIONS[name]


class GatedMLP(nn.Module):
    """``gate_proj``/``up_proj``/``down_proj`` as in Llama (HF parameter names)."""

    def __init__(self, hidden: int, intermediate: int, act: str = "silu", bias: bool = False):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.up_proj = nn.Linear(hidden, intermediate, bias=bias)
        self.down_proj = nn.Linear(intermediate, hidden, bias=bias)
        self.act_name = act
        self.act = activation(act)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))

    def flops_per_token(self) -> float:
        h, i = self.gate_proj.in_features, self.gate_proj.out_features
        return 2.0 * 3 * h * i


