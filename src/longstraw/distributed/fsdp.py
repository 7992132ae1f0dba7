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


def local_rows(param: torch.Tensor) -> tuple[int, int] | None:
    """Rows ``[a, b)`` of dim 0 of the full tensor that this rank's local shard of ``param`` holds; None for a
    tensor that is not sharded (this rank holds all of it).

    Read from the DTensor's placements and mesh: ``Replicate()`` mesh dims are skipped and each ``Shard(0)`` mesh
    dim splits the current range as ``torch.chunk`` does (FSDP2's split, ``_fsdp_param.py``
    ``_chunk_with_empty``; DTensor's too): chunks of ``ceil(n / size)`` rows, so the last ranks get fewer or none
    (an empty range ``(n, n)``). Several ``Shard(0)`` dims nest left to right, as DTensor applies them. So it covers
    FSDP (1-D mesh, ``(Shard(0),)``) and HSDP (2-D mesh, ``(Replicate(), Shard(0))``) over any ranks. FSDP2 pads
    the storage of an uneven shard to the largest chunk, but ``param.to_local()`` is the unpadded ``b - a`` rows.
    Any other placement (a shard of another dim, ``_StridedShard``, ``Partial``) is a ValueError naming it."""
    if not is_sharded(param):
        return None
    mesh = param.device_mesh
    coordinate = mesh.get_coordinate()
    if coordinate is None:
        raise ValueError(f"this rank is not part of the parameter's device mesh {mesh}")
    return shard_rows(param.shape[0] if param.dim() else 0, tuple(mesh.shape), tuple(coordinate),
                      tuple(param.placements))


def shard_rows(n: int, mesh_shape: tuple[int, ...], coordinate: tuple[int, ...], placements: tuple) -> tuple[int, int]:
    """The rows ``[a, b)`` of an ``n``-row dim 0 that the rank at ``coordinate`` of a mesh of ``mesh_shape`` holds
    under ``placements`` (one per mesh dim; see :func:`local_rows`, which reads them from a DTensor)."""
    from torch.distributed.tensor import Replicate, Shard

    if not len(mesh_shape) == len(coordinate) == len(placements):
        raise ValueError(f"mesh shape {mesh_shape}, coordinate {coordinate} and placements {placements} must have "
                         "one entry per mesh dim")
    a, b = 0, n
    for size, rank, pl in zip(mesh_shape, coordinate, placements):
        if isinstance(pl, Replicate):
            continue
        if type(pl) is not Shard or pl.dim != 0:
            raise ValueError(f"placements {placements}: only Replicate() and Shard(0) split a tensor by rows; "
                             f"{pl} does not")
        chunk = -(-(b - a) // size)  # torch.chunk: ceil(rows / size) per rank, the last ones short or empty
        a, b = min(a + rank * chunk, b), min(a + (rank + 1) * chunk, b)
    return a, b
