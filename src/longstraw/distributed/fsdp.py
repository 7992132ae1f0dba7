"""FSDP2 (``torch.distributed.fsdp.fully_shard``) of a LongStraw model over every rank of the job.

Applied from outside the model (torchtitan's ``parallelize`` pattern). Units: every decoder layer, the embedding,
the LM head (with tied embeddings, which share one tensor between the two, one group of both: :func:`end_units`),
and the backbone, the root, whose forward every pass enters (``CausalLM.run`` calls ``model.model``) and which holds
what is left: the final norm; under expert parallelism with more ranks than ``ep``, also each routed-experts module,
over the ranks that hold the same experts (``distributed/expert_parallel.py``). The LM head is called after the
root's forward, as FSDP2 supports (the chunked-loss pattern). Each is sharded over ``ctx.fsdp_mesh`` (all ranks of
the job, or with HSDP each replicate group) with ``reshard_after_forward=True``: a unit's full parameters exist only
while it runs. The engine calls every unit as a module (``model.run`` calls the layers, the embedding and the norm;
the log-probs and decoding call ``model.lm_head(...)``), so FSDP's hooks all-gather before and reduce-scatter after
each use, in lockstep on every rank.

Gradients. Each backward reduce-scatters into the sharded ``.grad`` (a DTensor, accumulating across calls) divided
by a factor. The convention is the MEAN over data-parallel replicas (``init_distributed``'s docstring). The replay is
computed alike on the ``R`` ranks of a CP group, so its sum over the job's ``W`` ranks divided by ``W`` is the mean
over replicas: the default factor is ``W``. The exact reverse pass is split over a CP group's ranks (each computes its
own pieces), so while it runs the sharded prompt state sets the factor to ``W / R``, the number of replicas
(``cp_state.ShardedPromptState.backward_scope``). On gloo, which has no pre-multiplied or averaging reductions,
reductions are plain sums divided afterwards (``set_force_sum_reduction_for_comms``).

Ranks that take different prompts (data-parallel replicas) run every FSDP collective together: the engine pads
each phase to the same number of steps on every rank (the placement's ``lockstep``). ``longstraw.hf_grads`` gathers full
tensors (``DTensor.full_tensor()``, a collective: call it on every rank).
"""

from __future__ import annotations

import warnings

import torch

from longstraw.distributed.context import ParallelContext


LOW_PRECISION = (torch.bfloat16, torch.float16)


def compute_dtype_of(model: torch.nn.Module) -> torch.dtype:
    """The dtype the model's floating parameters are in (its compute dtype before any master-weight policy)."""
    for p in model.parameters():
        if p.is_floating_point():
            return p.dtype
    return torch.float32


def _quiet_view_warning() -> None:
    """Silence FSDP2's "returned a view tensor" warning (torch 2.12+, ``_fsdp_state._register_pre_backward_hook``) for
    our units only. A decoder layer and the backbone return the layer's state pieces (K/V, latents: views of their
    projections) beside the hidden state, and the LM head's log-prob op (its own unit, or one with the embedding when
    they are tied) returns the per-branch log-probs and entropies as views of one buffer; FSDP2 warns because an
    in-place op on a returned view would drop the pre-backward hook it registers there. The engine never modifies a
    returned piece in place (the state copies or concatenates them, the losses read the log-probs out of place; the
    hidden state carries the same hook), and FSDP2's gradients are tested equal to one process's (tied and untied);
    without the filter every rank printed the warning for each unit class."""
    unit = r"(FSDP)?(DecoderLayer|Backbone|Embedding|LMHead)"
    warnings.filterwarnings("ignore", message=rf"FSDP2-wrapped module \({unit}(, {unit})?\) returned a view tensor",
                            category=UserWarning)


def apply_fsdp(model: torch.nn.Module, ctx: ParallelContext, *, master_dtype: torch.dtype | None = None
               ) -> torch.nn.Module:
    """Shard every parameter of ``model`` over ``ctx.fsdp_mesh`` with FSDP2, in place (see the module docstring);
    returns ``model``. Works on a model on the meta device too (its shards are then meta until allocated: build and
    shard on meta, then load, so that no rank ever holds the whole model).

    Mixed precision, as the large trainers run it: for a model whose parameters are bf16/fp16 (the compute dtype),
    the shards are kept in ``master_dtype`` (default float32: fp32 master weights, and so fp32 AdamW moments and
    fp32 sharded gradients) and FSDP all-gathers them in the compute dtype for the forward and backward
    (``MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=float32)``: gradients are reduced in float32). Pass
    ``master_dtype`` equal to the compute dtype to keep the shards, gradients and optimiser state in it (half the
    memory; updates below its resolution are then lost). A float32/float64 model is sharded as it is."""
    from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

    from longstraw.models.keep_fp32 import float32_owners

    layers = getattr(model, "layers", None)
    backbone = getattr(model, "model", None)
    if layers is None or backbone is None or not hasattr(model, "lm_head"):
        raise ValueError(f"apply_fsdp needs a LongStraw model (.layers, .model, .lm_head), got {type(model).__name__}")
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("the model is already FSDP-sharded; apply_fsdp once per model")
    if ctx.fsdp_mesh is None:
        raise ValueError(f"apply_fsdp needs more than one rank per shard group (world {ctx.world_size}, replicate="
                         f"{ctx.replicate})")
    mesh = ctx.fsdp_mesh
    compute = compute_dtype_of(model)
    mp = MixedPrecisionPolicy()
    if compute in LOW_PRECISION:
        master = master_dtype or torch.float32
        if master not in (compute, torch.float32):
            raise ValueError(f"master_dtype={master} must be float32 or the compute dtype {compute}")
        if master != compute:
            model.cast_trained(master)  # on meta: free (the checkpoint's values are cast when loaded); frozen
            # parameters (a LoRA model's base) keep the compute dtype: no master copy, gradient or optimiser state
        # cast_forward_inputs=False: a layer's inputs include the prompt state (float32 recurrent states, float32
        # gradient sinks filled in place), which must reach it as they are
        mp = MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=torch.float32, cast_forward_inputs=False)
    # expert-parallel experts (distributed/expert_parallel.py): this rank's EP block. With W > E each experts module
    # is first a unit of its own over the edp ranks holding the same block (each keeps 1/(W/E) of it; the layer's
    # unit then skips it); with W == E FSDP leaves them whole. The experts' LoRA adapters stay whole either way
    # (replicated over edp; their gradients reduced by the module itself)
    from longstraw.distributed.expert_parallel import ep_modules, expert_tensors, mark_params

    ignored = set()
    _quiet_view_warning()
    for _, m in ep_modules(model):
        adapters = set(m.parameters()) - set(expert_tensors(m))
        if m.shard_edp:
            fully_shard(m, mesh=m.mesh["edp"], reshard_after_forward=True, mp_policy=mp,
                        **({"ignored_params": adapters} if adapters else {}))
        ignored |= adapters if m.shard_edp else set(m.parameters())
    kw = {"ignored_params": ignored} if ignored else {}
    # what transformers keeps in float32 (models/keep_fp32.py: Ling's short conv and forget-gate rates, GLM-5's
    # indexer head weights in fp16 models): each owning module a unit of its own, gathered as held (float32), its
    # children with parameters units in the compute dtype; a unit takes one dtype
    if compute in LOW_PRECISION:
        kept = MixedPrecisionPolicy(param_dtype=None, reduce_dtype=torch.float32, cast_forward_inputs=False)
        for owner in float32_owners(model, compute):
            for child in owner.children():
                if any(p not in ignored for p in child.parameters()) and not isinstance(child, FSDPModule):
                    fully_shard(child, mesh=mesh, reshard_after_forward=True, mp_policy=mp, **kw)
            fully_shard(owner, mesh=mesh, reshard_after_forward=True, mp_policy=kept, **kw)
    for layer in layers:
        fully_shard(layer, mesh=mesh, reshard_after_forward=True, mp_policy=mp, **kw)
    for unit in end_units(model):
        fully_shard(unit if len(unit) > 1 else unit[0], mesh=mesh, reshard_after_forward=True, mp_policy=mp, **kw)
    fully_shard(backbone, mesh=mesh, reshard_after_forward=True, mp_policy=mp, **kw)  # the root: every pass enters
    layers[0].register_forward_pre_hook(input_needs_grad)
    for m in fsdp_modules(model):
        m.set_gradient_divide_factor(float(ctx.world_size))  # the mean over replicas (module docstring)
        if ctx.backend == "gloo":
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM / AVG reductions
    mark_params(model)  # FSDP replaced the experts' parameters by DTensors: tag those
    return model


def input_needs_grad(module: torch.nn.Module, args: tuple):
    """Forward pre-hook of the first decoder layer under FSDP: with autograd on, its hidden input ``[B, T, H]``
    requires a gradient (a leaf where the embedding is frozen). Every layer's backward gathers its unit and may
    reduce-scatter: every rank must run it whenever one does. Whether a layer's output needs a gradient otherwise
    depends on the rank's data with a frozen model (LoRA on the attention alone of a DeltaNet hybrid: a step's
    initial recurrent state is a leaf that collects a gradient, the first step's is not; an idle step has none), so
    ranks would differ; from this input on, every layer's output needs one on every rank, and the backward from a
    step's state pieces (every rank has some) or the loss reaches every layer in the same order. Costs the input
    gradients of the frozen layers below the first trained one (docs/DISTRIBUTED.md, "Lockstep")."""
    x = args[0]
    if torch.is_grad_enabled() and isinstance(x, torch.Tensor) and x.is_floating_point() and not x.requires_grad:
        return (x.detach().requires_grad_(), *args[1:])
    return None


def end_units(model: torch.nn.Module) -> list[list[torch.nn.Module]]:
    """The FSDP2 units of the embedding and the LM head: with untied embeddings one each (``[[embed_tokens],
    [lm_head]]``), so that each full weight is gathered only while its module runs forward or backward and its
    gradient is reduced when that backward is done; with tied embeddings (one tensor in both) one unit of the two,
    gathered from the embedding's call until the head has run, and in a backward from the head's backward to the
    embedding's. The final norm (one vector) is left to the root unit, the backbone: grouped with the head, its own
    backward hook gathered the group again after the head's gradient was reduced, and it stayed gathered to the end of
    the backward. The planner's ``gathered`` term counts these units."""
    b = model.model
    if model.spec.tie_word_embeddings:
        return [[b.embed_tokens, model.lm_head]]
    return [[b.embed_tokens], [model.lm_head]]


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


def reshard(model: torch.nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters and register its shards again (not a collective; a no-op for a
    unit already sharded and for a model without FSDP).

    Needed because a unit can stay gathered after a call: the tied embedding + LM head group reshards only when
    both have run in one pass (or at the root's next post-forward), so after a call that ends with
    ``lm_head(...)`` outside the backbone (decoding, the log-prob op) it can stay gathered, and
    ``model.parameters()`` would then give the gathered tensors, not the shards the optimiser holds. The engine's
    public calls end with it (``ContextParallel.finish``)."""
    for m in fsdp_modules(model):
        m.reshard()


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
