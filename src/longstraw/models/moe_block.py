"""Sparse mixture-of-experts feed-forward block: router + routed experts + optional shared expert.

``y = experts(x; router(x)) + [sigmoid(shared_expert_gate(x)) *] shared_expert(x)`` per token (``x [B, T, H]``
is flattened to ``[N, H]``). The math lives in :mod:`longstraw.ops.moe`; this file holds the parameters under
the names of transformers' in-memory models:

* ``gate.weight [E, H]``: the router (any module ``router(x [N, H]) -> (weights [N, k], expert_ids [N, k])``; the
  router is pluggable so that DeepSeek/GLM's grouped sigmoid router with its ``e_score_correction_bias`` drops in
  beside :class:`SoftmaxTopKRouter` of Qwen and Mixtral);
* ``experts.gate_up_proj [E, 2I, H]`` (gate rows first) and ``experts.down_proj [E, H, I]``: the fused expert
  layout transformers 5 keeps in memory (checkpoints store ``experts.{e}.{gate,up,down}_proj.weight``; the family's
  weight map converts);
* ``<shared_name>.{gate,up,down}_proj.weight``: the always-on shared expert (``shared_expert`` in Qwen,
  ``shared_experts`` in DeepSeek/GLM), and ``shared_expert_gate.weight [1, H]`` when it is gated (Qwen).

Left out: auxiliary load-balancing losses (GRPO fine-tuning does not use them; ``output_router_logits`` is
ignored), capacity limits. Expert parallelism is applied from outside (``longstraw.distributed.expert_parallel``
swaps an :class:`Experts` module for one holding this rank's experts); nothing here knows about it.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longstraw.models.lora import expert_lora
from longstraw.models.mlp import GatedMLP, activation
from longstraw.ops.moe import experts_forward, softmax_topk_route


class SoftmaxTopKRouter(nn.Module):
    """Qwen2-MoE / Qwen3-MoE / Qwen3-Next / Qwen3.5 / Mixtral router: logits ``x @ weight.T`` in x's dtype, softmax
    in float32 (float64 for float64 models), top-k, optional renormalisation of the kept probabilities
    (``norm_topk_prob``). The weights are cast to x's dtype (Qwen), or stay float32 (``float_weights``: Mixtral,
    whose experts' outputs are weighted in float32)."""

    def __init__(self, hidden: int, num_experts: int, top_k: int, norm_topk_prob: bool, float_weights: bool = False):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be between 1 and num_experts={num_experts}")
        self.top_k, self.norm_topk_prob, self.float_weights = top_k, norm_topk_prob, float_weights
        self.weight = nn.Parameter(torch.zeros(num_experts, hidden))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x ``[N, H]`` -> (weights ``[N, k]`` in x's dtype or float32, expert ids ``[N, k]``)."""
        return softmax_topk_route(nn.functional.linear(x, self.weight), self.top_k, self.norm_topk_prob,
                                  keep_compute_dtype=self.float_weights)


class Experts(nn.Module):
    """``E`` routed SwiGLU experts in the fused layout (see module docstring).

    ``ep_tensor_names``: the parameters whose dim 0 is the expert (what expert parallelism splits, and
    :meth:`local_experts` takes, in this order)."""

    ep_tensor_names = ("gate_up_proj", "down_proj")

    def __init__(self, hidden: int, num_experts: int, intermediate: int, act: str = "silu"):
        super().__init__()
        self.num_experts, self.intermediate, self.hidden = num_experts, intermediate, hidden
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate, hidden).normal_(0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden, intermediate).normal_(0, 0.02))
        self.act = activation(act)

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        """x ``[N, H]``, expert_ids / weights ``[N, k]`` -> ``[N, H]`` (with the LoRA adapters of the fused weights,
        ``lora_adapters``, when ``models.lora`` added some)."""
        return self.local_experts(x, expert_ids, weights, [self.gate_up_proj, self.down_proj], expert_lora(self))

    def local_experts(self, x: Tensor, expert_ids: Tensor, weights: Tensor, tensors: list[Tensor],
                      lora: dict | None) -> Tensor:
        """The experts' computation with the given ``tensors`` (``ep_tensor_names``' order; an expert-parallel
        rank's rows, ``expert_ids`` indexing them) and LoRA factors."""
        gate_up, down = tensors
        return experts_forward(x, expert_ids, weights, gate_up, down, self.act, lora=lora)


class SparseMoeBlock(nn.Module):
    """Router + routed experts + optional (gated) shared expert; ``forward(x [B, T, H]) -> [B, T, H]``."""

    def __init__(self, router: nn.Module, experts: Experts, shared_expert: nn.Module | None = None, *,
                 shared_gate: bool = False, shared_name: str = "shared_expert"):
        super().__init__()
        self.gate = router
        self.experts = experts
        self.shared_name = shared_name if shared_expert is not None else None
        if shared_expert is not None:
            self.add_module(shared_name, shared_expert)
        hidden = experts.gate_up_proj.shape[2]
        gated = shared_gate and shared_expert is not None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if gated else None

    def forward(self, x: Tensor) -> Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        weights, ids = self.gate(flat)
        y = self.experts(flat, ids, weights)
        if self.shared_name is not None:
            s = getattr(self, self.shared_name)(flat)
            if self.shared_expert_gate is not None:
                s = torch.sigmoid(self.shared_expert_gate(flat)) * s
            y = y + s
        return y.reshape(shape)


def qwen_moe_block(hidden: int, num_experts: int, top_k: int, moe_intermediate: int, shared_intermediate: int,
                   norm_topk_prob: bool, act: str = "silu") -> SparseMoeBlock:
    """The Qwen3-Next / Qwen3.5-MoE block: softmax top-k router, sigmoid-gated shared expert (always present, as in
    HF, even when ``shared_expert_intermediate_size`` is 0)."""
    return SparseMoeBlock(SoftmaxTopKRouter(hidden, num_experts, top_k, norm_topk_prob),
                          Experts(hidden, num_experts, moe_intermediate, act),
                          GatedMLP(hidden, shared_intermediate, act), shared_gate=True)
