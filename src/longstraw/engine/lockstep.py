"""Idle steps: what a process runs when its phase has fewer steps than another process's that shares its layers'
collectives.

With parameters sharded over processes that take different prompts (FSDP over data-parallel replicas), every call
of a layer all-gathers its parameters and every backward reduce-scatters its gradients, across all of them: they
must call the same layers the same number of times in the same order, whatever their prompts' lengths. Each phase
therefore asks the model's placement how many steps to run (``placement.lockstep(n)``: ``n`` in one process, the
largest count over the processes otherwise) and pads its own steps with idle ones. An idle step calls exactly the
modules a real step of the phase calls (the same FSDP collectives), on one dummy token at position 0 without a
prefix (so no context-parallel exchange), and contributes nothing: no state is stored, and what it back-propagates is
zero.

Cost: one token through the model per idle step (plus the collectives the real steps pay anyway).
"""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw.engine.config import GRPOConfig, autocast_context
from longstraw.models.transformer import CausalLM

__all__ = ["idle_prefill_step", "idle_reverse_step", "idle_replay_batch", "idle_decode_step", "idle_score_batch"]


def _dummy(model: CausalLM) -> Tensor:
    return torch.zeros(1, 1, dtype=torch.long, device=model.lm_head.weight.device)


def _tensors(x) -> list[Tensor]:
    if isinstance(x, Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for y in x for t in _tensors(y)]
    return []


@torch.no_grad()
def idle_prefill_step(model: CausalLM) -> None:
    """A prefill step (``need_hidden=False``: no final norm), nothing stored."""
    model.run(_dummy(model), 0, None, need_hidden=False)


def idle_reverse_step(model: CausalLM, checkpoint_layers: bool) -> None:
    """A reverse-pass step: the recomputation with autograd and a backward from its state pieces with zero seeds."""
    with torch.enable_grad():
        _, pieces = model.run(_dummy(model), 0, None, need_hidden=False, checkpoint_layers=checkpoint_layers)
        roots = [t for t in _tensors(pieces) if t.requires_grad]
        if roots:
            torch.autograd.backward(roots, [torch.zeros_like(t) for t in roots])


def idle_replay_batch(model: CausalLM, cfg: GRPOConfig, with_entropy: bool) -> None:
    """A replay batch: forward (under ``cfg``'s autocast, as the real one), the LM head's log-probs, a backward of
    zero."""
    ids = _dummy(model)
    with torch.enable_grad():
        with autocast_context(cfg, ids.device):
            hidden, _ = model.run(ids, 0, None, checkpoint_layers=cfg.checkpoint_layers)
        logp, ent = model.lm_head(hidden[0], ids[0], temperature=cfg.temperature, chunk_size=cfg.logprob_chunk,
                                  with_entropy=with_entropy)
        loss = logp.sum() * 0 + (ent.sum() * 0 if ent is not None else 0)
        loss.backward()


@torch.no_grad()
def idle_decode_step(model: CausalLM) -> None:
    """A decoding step: forward and the LM head's logits."""
    hidden, _ = model.run(_dummy(model), 0, None)
    model.lm_head(hidden[:, -1])


@torch.no_grad()
def idle_score_batch(model: CausalLM, cfg: GRPOConfig, with_entropy: bool) -> None:
    """A scoring batch: forward (under ``cfg``'s autocast) and the LM head's log-probs."""
    ids = _dummy(model)
    with autocast_context(cfg, ids.device):
        hidden, _ = model.run(ids, 0, None)
    model.lm_head(hidden[0], ids[0], temperature=cfg.temperature, chunk_size=cfg.logprob_chunk,
                  with_entropy=with_entropy)
