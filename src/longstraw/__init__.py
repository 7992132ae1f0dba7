"""LongStraw: GRPO post-training on million-token prompts.

The shared prompt is evaluated once, in chunks, without autograd, into a prompt state; the G response branches are
replayed one at a time with autograd against it; in exact mode a reverse pass carries the gradient back through the
prompt. See docs/DESIGN.md.
"""

from longstraw.checkpoint.adapter import add_lora, load_adapter, lora_grads, save_adapter
from longstraw.checkpoint.hf import build_model, hf_grads, load_model, save_model
from longstraw.distributed import init_distributed, shutdown_distributed
from longstraw.engine.config import GRPOConfig, GRPOStats, PromptGrad, SamplingConfig
from longstraw.engine.rollout import Rollout, generate
from longstraw.engine.grpo import grpo_backward, score
from longstraw.losses import KLType, LossAggMode, group_advantages, loss_denominator
from longstraw.models.registry import supported_model_types
from longstraw.state import PromptState

__version__ = "0.1.0"

__all__ = [
    "init_distributed",
    "shutdown_distributed",
    "load_model",
    "save_model",
    "hf_grads",
    "add_lora",
    "load_adapter",
    "save_adapter",
    "lora_grads",
    "build_model",
    "supported_model_types",
    "PromptState",
    "GRPOConfig",
    "GRPOStats",
    "PromptGrad",
    "LossAggMode",
    "KLType",
    "grpo_backward",
    "score",
    "generate",
    "SamplingConfig",
    "Rollout",
    "group_advantages",
    "loss_denominator",
]
