"""Context parallelism (the prompt state split by position over ranks) and FSDP2 parameter sharding.

``init_distributed(cp=R, fsdp=...)`` under ``torchrun`` before ``load_model``: ``load_model`` then applies
:func:`parallelize` to the model it loads, and ``grpo_backward``, ``score`` and ``generate`` shard the prompt state
over each group of ``R`` ranks, with no other change to user code. Parallelism is applied from outside: the model's
placement (``CausalLM.placement``, :class:`~longstraw.distributed.placement.ContextParallel`) makes its prompt states
sharded ones, whose prefixes plug into the models through the typed interfaces of ``longstraw.ops.partitioned``
(stored keys) and ``RecurrentPrefix.enter`` / ``leave`` (DeltaNet states); the engine and the models never import
this package. See docs/DISTRIBUTED.md.
"""

from __future__ import annotations

import torch

from longstraw.distributed.context import (Comm, ParallelContext, cp_active, get_context, init_distributed,
                                           shutdown_distributed)
from longstraw.distributed.cp_attention import ShardedSegment, StepPieces, cp_segment_attention
from longstraw.distributed.cp_latent import ShardedIndexedLatentState, ShardedLatentState
from longstraw.distributed.cp_recurrent import ShardedRecurrentState
from longstraw.distributed.cp_state import (ShardedKVState, ShardedPromptState, ShardLayout, register_cp_kind,
                                            shard_layout, shard_states)
from longstraw.distributed.cp_window import ShardedSlidingState
from longstraw.distributed.expert_parallel import ExpertParallelExperts, ep_modules, shard_experts
from longstraw.distributed.fsdp import apply_fsdp, fsdp_modules
from longstraw.distributed.placement import ContextParallel, all_reduce_data_parallel, check_same_group
from longstraw.models.deltanet import RecurrentState
from longstraw.models.dsa import IndexedLatentState
from longstraw.models.mla import LatentState
from longstraw.state import SlidingKVState

register_cp_kind(RecurrentState, ShardedRecurrentState)
register_cp_kind(LatentState, ShardedLatentState)
register_cp_kind(IndexedLatentState, ShardedIndexedLatentState)  # exact type match: the subclass needs its own
register_cp_kind(SlidingKVState, ShardedSlidingState)


def parallelize(model: torch.nn.Module, ctx: ParallelContext | None = None, *, fsdp: bool | None = None,
                master_dtype: torch.dtype | None = None) -> torch.nn.Module:
    """Apply the parallelism of ``ctx`` (default: the one :func:`init_distributed` set up; none: nothing) to a
    LongStraw model, in place: FSDP2 over every rank of the job when ``fsdp`` (default: ``ctx.fsdp``; with fp32
    master weights for a bf16/fp16 model unless ``master_dtype`` says otherwise: :func:`apply_fsdp`; with ``ep > 1``
    the routed experts split over the EP group first: :func:`shard_experts`), and the
    placement of its prompt states (context-parallel when ``cp > 1``; phases in lockstep when FSDP spans replicas).
    ``load_model`` and ``longstraw.build_model`` call it; call it yourself on a model you made. Returns ``model``."""
    ctx = ctx if ctx is not None else get_context()
    if ctx is None:
        return model
    fsdp = ctx.fsdp if fsdp is None else fsdp
    if ctx.ep_size > 1 and not ep_modules(model):
        if not fsdp:
            raise ValueError(f"ep={ctx.ep_size} needs fsdp=True (expert parallelism runs under FSDP)")
        shard_experts(model, ctx)  # before FSDP, which leaves the local experts whole
    if fsdp and not fsdp_modules(model):
        apply_fsdp(model, ctx, master_dtype=master_dtype)
    if fsdp or ctx.cp_size > 1:
        model.placement = ContextParallel(ctx, fsdp=fsdp)
    return model


__all__ = [
    "init_distributed", "shutdown_distributed", "get_context", "cp_active", "ParallelContext", "Comm",
    "ContextParallel", "ShardedSegment", "StepPieces", "cp_segment_attention", "ShardedKVState",
    "ShardedRecurrentState", "ShardedLatentState", "ShardedIndexedLatentState", "ShardedSlidingState",
    "ShardedPromptState", "ShardLayout", "shard_layout", "shard_states", "register_cp_kind", "check_same_group",
    "all_reduce_data_parallel", "apply_fsdp", "parallelize", "ExpertParallelExperts", "shard_experts", "ep_modules",
]
