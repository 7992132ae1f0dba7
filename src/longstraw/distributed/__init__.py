"""Context parallelism (the prompt state split by position over ranks) and FSDP2 parameter sharding.

``init_distributed(cp=R, fsdp=...)`` under ``torchrun`` before ``load_model``: from then on ``grpo_backward``,
``score`` and ``generate`` shard the prompt state over each group of ``R`` ranks, with no other change to user code.
The engine asks :func:`cp_active` and delegates here; the models know nothing of it (the attention op hands a call
that meets a :class:`ShardedSegment` to :func:`cp_segment_attention`; MLA and DSA layers have the same kind of
one-line hooks, served by :mod:`longstraw.distributed.cp_latent`). See docs/DISTRIBUTED.md.
"""

from __future__ import annotations

import torch

from longstraw.distributed.context import (Comm, ParallelContext, cp_active, get_context, init_distributed,
                                           shutdown_distributed)
from longstraw.distributed.cp_attention import ShardedSegment, StepPieces, cp_segment_attention
from longstraw.distributed.cp_engine import (all_reduce_data_parallel, check_same_group, cp_broadcast_tokens,
                                             cp_prefill, cp_prompt_backward)
from longstraw.distributed.cp_state import (ShardedKVState, ShardedPromptState, ShardLayout, register_cp_kind,
                                            shard_layout, shard_states)
from longstraw.distributed.fsdp import apply_fsdp
from longstraw.distributed.cp_latent import ShardedIndexedLatentState, ShardedLatentState
from longstraw.distributed.cp_recurrent import ShardedRecurrentState
from longstraw.models.deltanet import RecurrentState
from longstraw.models.dsa import IndexedLatentState
from longstraw.models.mla import LatentState

register_cp_kind(RecurrentState, ShardedRecurrentState)
register_cp_kind(LatentState, ShardedLatentState)
register_cp_kind(IndexedLatentState, ShardedIndexedLatentState)  # exact type match: the subclass needs its own


def parallelize(model: torch.nn.Module) -> torch.nn.Module:
    """What ``load_model`` applies to a freshly loaded model: FSDP2 over the CP group when
    ``init_distributed(fsdp=True)`` was called, otherwise nothing. Returns ``model``."""
    ctx = get_context()
    if ctx is not None and ctx.fsdp:
        apply_fsdp(model, ctx)
    return model


__all__ = [
    "init_distributed", "shutdown_distributed", "get_context", "cp_active", "ParallelContext", "Comm",
    "ShardedSegment", "StepPieces", "cp_segment_attention", "ShardedKVState", "ShardedRecurrentState",
    "ShardedLatentState", "ShardedIndexedLatentState",
    "ShardedPromptState", "ShardLayout", "shard_layout", "shard_states", "register_cp_kind", "cp_prefill",
    "cp_prompt_backward", "cp_broadcast_tokens", "check_same_group", "all_reduce_data_parallel", "apply_fsdp",
    "parallelize",
]
