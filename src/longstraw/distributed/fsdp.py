"""FSDP2 (``torch.distributed.fsdp.fully_shard``) of a LongStraw model over its context-parallel group.

Applied from outside the model (torchtitan's ``parallelize`` pattern): every decoder layer becomes one FSDP unit
sharded over the CP group's ranks (``reshard_after_forward=True``: a layer's full parameters exist only while it
runs). The engine calls layers through ``model.run``, i.e. through their ``__call__``, so FSDP's hooks all-gather
before and reduce-scatter after each layer, in lockstep on every rank like the CP attention itself.

Left whole on every rank: the embedding, the final norm and the LM head. ``CausalLM.run`` calls the embedding and
norm directly and the log-prob op reads ``model.head()`` (the LM-head weight) outside any module call, so a root
FSDP unit's hooks would never fire for them; tied embeddings share one tensor between the embedding and the head.
Their gradients are combined by the engine like those of an unsharded model (replay: identical on every rank;
exact reverse pass: summed over the group).

Gradients: each backward reduce-scatters into the sharded ``.grad`` (a DTensor, accumulating across calls); the
default average over the group is right for the replay (every rank computes the same branch gradient), and the
reverse pass switches it to a sum (rank-local gradients). ``longstraw.hf_grads`` gathers full tensors
(``DTensor.full_tensor()``, a collective: call it on every rank).
"""

from __future__ import annotations

import torch

from longstraw.distributed.context import ParallelContext


def apply_fsdp(model: torch.nn.Module, ctx: ParallelContext) -> torch.nn.Module:
    """Shard ``model``'s decoder layers over ``ctx``'s CP group with FSDP2, in place; returns ``model``."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    layers = getattr(model, "layers", None)
    if layers is None:
        raise ValueError(f"apply_fsdp needs a LongStraw model with .layers, got {type(model).__name__}")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("the model is already FSDP-sharded; apply_fsdp once per model")
    mesh = ctx.cp_mesh
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True)
    return model


def is_sharded(t: torch.Tensor) -> bool:
    """Whether ``t`` is a DTensor (an FSDP2-sharded parameter or its gradient)."""
    return hasattr(t, "device_mesh") and hasattr(t, "full_tensor")


def fsdp_modules(model: torch.nn.Module) -> list:
    """The FSDP2 units of ``model`` (modules ``fully_shard`` was applied to)."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]
