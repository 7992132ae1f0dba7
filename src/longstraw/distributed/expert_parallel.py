"""Expert parallelism (EP): the routed experts of every MoE layer split over ``ep`` ranks; tokens move to them.

``init_distributed(cp=R, fsdp=True, ep=E)`` groups the ``W`` ranks of the job into ``W / E`` EP groups of ``E``
consecutive ranks (``rank = edp_rank * E + ep_rank``). :func:`shard_experts` (called by ``parallelize``, before
FSDP) keeps, in every routed-experts module (:class:`~longstraw.models.moe_block.Experts`, GPT-OSS's
``GptOssExperts``: a module with ``ep_tensor_names`` and ``local_experts``), only the experts of this rank's EP
coordinate: rows ``[ep_rank * n / E, (ep_rank + 1) * n / E)`` of each tensor ``ep_tensor_names`` lists (the fused
``gate_up_proj [n, 2I, H]`` and ``down_proj [n, H, I]``; GPT-OSS's transposed ones and their biases ``[n, 2I]``,
``[n, H]``), and mixes :class:`ExpertParallel` into the module's class (:class:`ExpertParallelExperts` for
:class:`Experts`). With more ranks than ``E`` (``W / E`` expert-data-parallel groups, ``edp``) ``apply_fsdp`` then
makes each experts module an FSDP2 unit of its own over the ``edp`` ranks holding the same experts (torchtitan's
pattern): each rank keeps ``1 / (W / E)`` of its EP block (``1 / W`` of the experts; rows split as ``torch.chunk``
does), gathered while the module runs; with ``W == E``, or ``init_distributed(ep_shard=False)``, they stay whole
local tensors (``ignored_params``), replicated over ``edp``. The module's forward

1. sends each routed token slot (sorted by expert, hence by owning rank) to the rank that holds its expert
   (``all_to_all_single`` with uneven splits, after exchanging per-expert counts),
2. runs the local experts on what it received (the module's own ``local_experts`` with one slot per row),
3. sends the outputs back (the reverse all-to-all) and combines them with the routing weights, as one process does.

Both all-to-alls are autograd functions whose backward is the reverse all-to-all, so the gradient of the tokens
flows back to the ranks they came from and each expert's gradient collects every rank's tokens. The models never
see any of this (the module's class is swapped from outside, as FSDP does).

Every MoE layer call is thus a collective of the EP group: all its ranks must call every MoE layer the same number
of times in the same order, forward and backward. FSDP over the job already demands that (the engine's lockstep:
idle steps join with one dummy token; a rank that receives no tokens joins with zero rows; under autograd the
first layer's input needs a gradient on every rank, so a frozen model's MoE layers run their backward everywhere:
``fsdp.input_needs_grad``), so ``ep > 1`` requires
``fsdp=True``. Under that rule an EP group may span anything: ranks of one CP group, of different data-parallel
replicas, or both.

Gradients (the convention of ``init_distributed``: the mean over data-parallel replicas). The all-to-all backward
already sums every EP-group rank's contribution into the owner's expert gradient; the ``W / E`` ranks that hold the same
experts (the expert-data-parallel group ``edp``) sum theirs: FSDP's reduce-scatter over ``edp`` for the expert weights,
an all-reduce in the backward of each layer's call for what FSDP does not manage (the experts' whole blocks with
``ep_shard=False``, skipped with ``W == E``, and the experts' LoRA adapters, replicated over ``edp``), so each expert
gradient is the sum over all ``W`` ranks, divided by the same factor FSDP divides the rest of the model by (``W`` for
the replay, the number of replicas in the CP reverse pass: ``cp_state.ShardedPromptState.backward_scope`` sets both: its
FSDP units, the experts' among them, and :func:`set_ep_divide_factor`).

LoRA on the experts (``target_parameters``, ``models.lora.ExpertLoRA``): :func:`shard_experts` keeps each adapter's
part for this rank's experts (``ExpertLoRA.keep_experts``: ``lora_A``'s rows, ``lora_B``'s columns of PEFT's
interleaved layout); the parts are per-rank parameters like the expert weights (FSDP's ``ignored_params``,
:func:`ep_param_ids`, :func:`mark_params`), go through the same gradient identity (summed over ``edp``, divided by the
same factor) and reach ``experts_forward`` as the local experts' factors. :func:`gather_adapter` rebuilds a whole
adapter tensor (``save_adapter``, ``lora_grads``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor, nn

from longstraw.distributed.context import Comm, ParallelContext
from longstraw.models.moe_block import Experts
from longstraw.ops import meta
from longstraw.ops.moe import combine_slots

__all__ = ["ExpertParallel", "ExpertParallelExperts", "shard_experts", "expert_tensors", "ep_modules", "ep_param_ids",
           "ep_param_rows", "set_ep_divide_factor", "mark_params", "ep_state_to_dtensors", "ep_block",
           "ep_adapter_params", "gather_adapter", "expert_params", "ep_local_parts", "expert_adapter_tensors",
           "adapters_to_dcp", "restore_entries"]


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of ``x [S, ...]`` with uneven splits over ``group``; backward: the reverse exchange."""

    @staticmethod
    def forward(ctx, x: Tensor, group, out_splits: list[int], in_splits: list[int]) -> Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, g: Tensor):
        out = g.new_empty((sum(ctx.in_splits), *g.shape[1:]))
        dist.all_to_all_single(out, g.contiguous(), ctx.in_splits, ctx.out_splits, group=ctx.group)
        return out, None, None, None


class _ExpertGrad(torch.autograd.Function):
    """Identity on the local expert tensors that are trained and not FSDP-sharded (the fused weights when their
    blocks are whole: ``W == E`` or ``ep_shard=False``; their LoRA adapters' ``lora_A`` / ``lora_B`` always);
    backward: their gradients, in one flat buffer, summed over the expert-data-parallel group (the ranks holding the
    same experts) and divided by the module's current factor (module docstring)."""

    @staticmethod
    def forward(ctx, module: ExpertParallel, *tensors: Tensor):
        ctx.module = module
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads: Tensor):
        m = ctx.module
        flat = torch.cat([g.reshape(-1) for g in grads])  # unused outputs' gradients come as zeros
        if m.edp is not None and m.edp.size > 1:
            m.edp.all_reduce(flat)
        flat = flat / m.divide_factor
        out, at = [], 0
        for g in grads:
            out.append(flat[at:at + g.numel()].view_as(g))
            at += g.numel()
        return (None, *out)


def _trained_local(m: ExpertParallel, tensors: list[Tensor], skip: int = 0) -> list[Tensor]:
    """``tensors`` with those that require a gradient passed through :class:`_ExpertGrad` (one call, one
    reduction), but the first ``skip`` (FSDP's over ``edp``: it reduces them); frozen ones as they are (LoRA: the
    base experts get no gradient, and none is computed for them)."""
    idx = [i for i, t in enumerate(tensors) if t.requires_grad and i >= skip]
    if not idx:
        return tensors
    views = _ExpertGrad.apply(m, *(tensors[i] for i in idx))
    out = list(tensors)
    for i, v in zip(idx, views):
        out[i] = v
    return out


def _adapters(m: nn.Module) -> list:
    """``[(fused parameter name, ExpertLoRA)]`` of an experts module's active LoRA adapters (``models.lora``)."""
    return [(p, a) for p, a in (getattr(m, "lora_adapters", None) or {}).items() if not a.disabled]


def expert_tensors(m: nn.Module) -> list[nn.Parameter]:
    """An experts module's tensors split by expert (``ep_tensor_names``: the fused weights, and GPT-OSS's biases)."""
    return [getattr(m, n) for n in m.ep_tensor_names]


def expert_params(m: nn.Module) -> list[nn.Parameter]:
    """The parameters expert parallelism splits, of an experts module: its expert tensors (rows) and, with LoRA on
    them, its adapters (``lora_A`` / ``lora_B``); under expert parallelism this rank's parts (per-rank parameters)."""
    adapters = (getattr(m, "lora_adapters", None) or {}).values()
    return expert_tensors(m) + [w for a in adapters for w in (a.lora_A.weight, a.lora_B.weight)]


class ExpertParallel:
    """The expert-parallel form of a routed-experts module (:class:`Experts`, GPT-OSS's biased experts: any module
    with ``ep_tensor_names`` and ``local_experts``), holding experts ``[first, first + local)`` of ``num_experts``
    (module docstring): mixed in before the module's class by :func:`shard_experts`; never constructed directly."""

    ep: Comm
    edp: Comm | None
    first: int
    divide_factor: float
    mesh: object  # the ("ep", "edp") DeviceMesh: rows split over ep, then FSDP's shards over edp (state dicts)
    shard_edp: bool  # the expert tensors are FSDP-sharded over edp (W > E; apply_fsdp), else whole local tensors

    def forward(self, x: Tensor, expert_ids: Tensor, weights: Tensor) -> Tensor:
        tensors = expert_tensors(self)
        adapters = _adapters(self)
        if meta.is_meta(x):  # the planner's dry run: shapes only (as one process with all experts)
            full = [t.new_empty((self.num_experts, *t.shape[1:]), device="meta") for t in tensors]
            lora = {p: (a.lora_A.weight.new_empty((self.num_experts, a.r, a.in_features), device="meta"),
                        a.lora_B.weight.new_empty((self.num_experts, a.out_features, a.r), device="meta"),
                        a.scaling) for p, a in adapters}
            return self.local_experts(x, expert_ids, weights, full, lora or None)
        n, k = expert_ids.shape
        local, size = tensors[0].shape[0], self.ep.size
        flat = expert_ids.reshape(-1)
        with torch.no_grad():
            order = torch.argsort(flat, stable=True)  # slots by expert, so by owning rank (token order within)
            counts = torch.bincount(flat, minlength=self.num_experts)
            if counts.numel() != self.num_experts:
                raise ValueError(f"expert_ids contains ids >= the number of experts ({self.num_experts})")
            recv = self.ep.all_to_all(counts.view(size, local))  # [source rank, local expert]
            in_splits = counts.view(size, local).sum(1).tolist()
            out_splits = recv.sum(1).tolist()
            local_ids = torch.repeat_interleave(torch.arange(local, device=x.device).repeat(size),
                                                recv.reshape(-1)).unsqueeze(1)
        token_idx = order // k
        xr = _AllToAll.apply(x[token_idx], self.ep.group, out_splits, in_splits)  # [received, H]
        # the trained local tensors (the experts, or with LoRA their adapters' parts A [local*r, in], B [out,
        # r*local]) through the identity whose backward reduces their gradients over edp
        nt = len(tensors)
        trained = _trained_local(self, tensors + [w for _, a in adapters for w in (a.lora_A.weight,
                                                                                   a.lora_B.weight)],
                                 skip=nt if self.shard_edp else 0)
        tensors, ab = trained[:nt], trained[nt:]
        lora = {p: (*a.factors(ab[2 * i], ab[2 * i + 1]), a.scaling) for i, (p, a) in enumerate(adapters)}
        # fp32 master experts under a low-precision compute dtype: compute in x's (experts_forward casts the
        # adapters' factors itself)
        tensors = [t.to(x.dtype) if t.dtype != x.dtype else t for t in tensors]
        yr = self.local_experts(xr, local_ids, xr.new_ones(local_ids.shape), tensors, lora or None)
        if yr.shape[0] == 0:  # nothing received: keep the received rows and the trained tensors in the graph, so
            # this rank's backward runs the same collectives as the others
            yr = yr + 0 * (xr.sum() + sum(t.sum() for t in [*tensors, *ab]))
        ys = _AllToAll.apply(yr, self.ep.group, in_splits, out_splits)  # back in the order of x[token_idx]
        return combine_slots(ys, weights.reshape(-1)[order], token_idx, n, x.dtype)

    def extra_repr(self) -> str:
        return (f"experts {self.first}..{self.first + self.gate_up_proj.shape[0] - 1} of {self.num_experts} "
                f"(ep rank {self.ep.rank} of {self.ep.size})")


class ExpertParallelExperts(ExpertParallel, Experts):
    """An :class:`Experts` module holding experts ``[first, first + local)`` of ``num_experts``."""


_EP_CLASSES: dict[type, type] = {Experts: ExpertParallelExperts}


def _ep_class(base: type) -> type:
    """The expert-parallel class of an experts module's class (one per class, made on first use)."""
    if base not in _EP_CLASSES:
        _EP_CLASSES[base] = type(f"ExpertParallel{base.__name__}", (ExpertParallel, base),
                                 {"__doc__": f"A {base.__name__} module holding some of its experts (ExpertParallel)."})
    return _EP_CLASSES[base]


def ep_modules(model: nn.Module) -> list[tuple[str, ExpertParallel]]:
    """The expert-parallel modules of ``model`` with their names."""
    return [(n, m) for n, m in model.named_modules() if isinstance(m, ExpertParallel)]


def ep_param_ids(model: nn.Module) -> set[int]:
    """``id`` of every expert-parallel parameter (local slices: whole tensors that differ between EP ranks; the
    experts' LoRA adapters' parts too)."""
    return {id(p) for _, m in ep_modules(model) for p in expert_params(m)}


def ep_param_rows(model: nn.Module) -> dict[str, tuple[int, int, int]]:
    """``{parameter name: (rows of the full tensor, first row held, end row held)}`` of the expert-parallel
    parameters (dim 0: experts)."""
    out = {}
    for name, m in ep_modules(model):
        b = m.first + m.gate_up_proj.shape[0]
        for p in m.ep_tensor_names:
            out[f"{name}.{p}" if name else p] = (m.num_experts, m.first, b)
    return out


def ep_local_parts(model: nn.Module) -> dict[str, tuple[tuple[int, ...], object]]:
    """``{parameter name: (the whole tensor's shape, full -> this rank's part)}`` of every expert-parallel parameter:
    the experts' fused weights (their rows) and their LoRA adapters' parts (``ExpertLoRA.take``). What cuts a
    one-process state (an optimiser's moments) into this rank's."""
    out = {n: ((rows, *model.get_parameter(n).shape[1:]), lambda full, a=a, b=b: full[a:b])
           for n, (rows, a, b) in ep_param_rows(model).items()}
    for n, (_, adapter, which) in ep_adapter_params(model).items():
        out[n] = (adapter.full_shape(which), lambda full, ad=adapter, w=which: ad.take(w, full))
    return out


def mark_params(model: nn.Module) -> None:
    """Tag the expert-parallel parameters (``p._longstraw_ep``: the EP group's :class:`Comm`), so that code holding
    only parameters (``rl.optim.clip_grad_norm``) can sum their norms over the EP group. ``shard_experts`` tags them;
    call again after the parameters are replaced (``load_model`` does, after allocating them)."""
    for _, m in ep_modules(model):
        for p in expert_params(m):
            p._longstraw_ep = m.ep


def set_ep_divide_factor(model: nn.Module, factor: float) -> None:
    """The factor the expert gradients are divided by (kept equal to FSDP's; module docstring)."""
    for _, m in ep_modules(model):
        m.divide_factor = float(factor)


def ep_block(t: Tensor) -> Tensor:
    """This rank's EP block of an expert tensor or its gradient: ``t`` itself, or gathered over ``edp`` when FSDP
    shards it there (a DTensor: a collective of the edp group)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t  # (fsdp.is_sharded's test: fsdp imports this module)


def gather_experts(module: ExpertParallel, t: Tensor) -> Tensor:
    """The full ``[num_experts, ...]`` tensor from every EP rank's local ``t`` (this rank's block, or its FSDP
    shard over ``edp``): a collective of the EP group (and of the edp group first for a shard)."""
    t = ep_block(t.detach())
    return module.ep.all_gather(t).reshape(module.num_experts, *t.shape[1:])


def ep_adapter_params(model: nn.Module) -> dict[str, tuple[ExpertParallel, object, str]]:
    """``{parameter name: (its expert-parallel module, its ExpertLoRA, "lora_A" | "lora_B")}`` of the LoRA adapters
    on expert-parallel experts (each rank holds its experts' part: ``models.lora.ExpertLoRA.take``)."""
    out = {}
    for name, m in ep_modules(model):
        for pname, a in (getattr(m, "lora_adapters", None) or {}).items():
            for which in ("lora_A", "lora_B"):
                out[f"{name}.lora_adapters.{pname}.{which}.weight"] = (m, a, which)
    return out


def gather_adapter(module: ExpertParallel, adapter, which: str, t: Tensor) -> Tensor:
    """The whole adapter tensor of ``which`` (``[total*r, in]`` / ``[out, r*total]``, PEFT's layout) from every EP
    rank's part ``t`` (this rank's ``lora_A`` / ``lora_B`` or its gradient): a collective of the EP group."""
    from longstraw.models.lora import join_expert_pieces

    return join_expert_pieces(which, module.ep.all_gather(t.detach()), adapter.r)


def shard_experts(model: nn.Module, ctx: ParallelContext) -> nn.Module:
    """Keep only this rank's experts in every routed-experts module of ``model`` (those with ``ep_tensor_names``:
    :class:`Experts`, GPT-OSS's; module docstring); in place, on meta or real tensors. ValueError if
    ``ctx.ep_size`` does not divide a layer's number of experts."""
    size = ctx.ep_size
    if size == 1:
        return model
    for name, m in model.named_modules():
        if not hasattr(m, "ep_tensor_names") or isinstance(m, ExpertParallel):
            continue
        n = m.num_experts
        if n % size:
            raise ValueError(f"ep={size} does not divide the {n} routed experts of {name}; allowed: "
                             f"{', '.join(str(d) for d in range(1, n + 1) if n % d == 0 and ctx.world_size % d == 0)}")
        local = n // size
        a = ctx.ep_rank * local
        with torch.no_grad():
            for pname in m.ep_tensor_names:
                p = getattr(m, pname)
                setattr(m, pname, nn.Parameter(p[a:a + local].clone(), requires_grad=p.requires_grad))
        for adapter in (getattr(m, "lora_adapters", None) or {}).values():  # LoRA on the experts: their parts
            adapter.keep_experts(a, local)
        m.__class__ = _ep_class(type(m))
        m.ep, m.edp, m.first, m.mesh = ctx.ep, ctx.edp, a, ctx.ep_mesh
        m.shard_edp = ctx.ep_shard and ctx.edp is not None and ctx.edp.size > 1  # apply_fsdp shards them over edp
        m.divide_factor = float(ctx.world_size)
    mark_params(model)
    return model


def _ep_tensors(model: nn.Module) -> dict[str, ExpertParallel]:
    return {f"{n}.{p}" if n else p: m for n, m in ep_modules(model) for p in m.ep_tensor_names}


def _state_entries(owners: dict, model_sd: dict | None, optim_sd: dict | None, shaped_like):
    """``(container, key, owner)`` of every tensor of ``owners`` (``{parameter FQN: owner}``) in a model and an
    optimiser state dict (DCP's ``get_model_state_dict`` / ``get_optimizer_state_dict``: keyed by FQN; optimiser
    entries that ``shaped_like(owner, tensor)`` says are shaped like the parameter, e.g. AdamW's moments, not its
    ``step`` scalar). An optimiser entry's dict is replaced by a copy first: DCP's dict may be the optimiser's own
    state, which must keep plain tensors."""
    states = (optim_sd or {}).get("state", {})
    for fqn, owner in owners.items():
        if model_sd is not None and fqn in model_sd:
            yield model_sd, fqn, owner
        if states.get(fqn) is None:
            continue
        st = states[fqn] = dict(states[fqn])
        for k, v in list(st.items()):
            if isinstance(v, Tensor) and shaped_like(owner, v):
                yield st, k, owner


def _entries(model: nn.Module, model_sd: dict | None, optim_sd: dict | None):
    """``(container, key, module)`` of every expert-parallel tensor in the state dicts (:func:`_state_entries`; a
    DTensor's shape is the global one)."""
    return _state_entries(_ep_tensors(model), model_sd, optim_sd, lambda m, v: v.dim() > 0 and v.shape[0] in (
        m.num_experts // m.ep.size, m.num_experts))


def ep_state_to_dtensors(model: nn.Module, model_sd: dict | None, optim_sd: dict | None = None
                         ) -> list[tuple[dict, str, Tensor]]:
    """In place: each expert-parallel tensor of the state dicts (this rank's rows: a plain tensor that FSDP leaves
    alone, or with ``W > E`` FSDP's DTensor of this rank's shard of its EP block) becomes a DTensor of the whole
    ``[num_experts, ...]`` tensor on the ``("ep", "edp")`` mesh: rows sharded over ``ep``, then over ``edp``
    (``Shard(0)`` twice, as FSDP splits a block) or replicated there, so that DCP writes each expert once and reads
    it back into any layout (another ``ep``, another world size, one process). The new entry shares the old one's
    storage, so what DCP reads lands in it: returns ``(container, key, old entry)`` to put back
    (:func:`restore_entries`)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    undo = []
    for d, k, m in list(_entries(model, model_sd, optim_sd)):
        old = d[k]
        t = old.to_local() if isinstance(old, DTensor) else old
        full = (m.num_experts, *old.shape[1:])
        d[k] = DTensor.from_local(t, m.mesh, [Shard(0), Shard(0) if isinstance(old, DTensor) else Replicate()],
                                  run_check=False, shape=torch.Size(full),
                                  stride=torch.empty(full, device="meta").stride())
        undo.append((d, k, old))
    return undo


# ----------------------------------------------------------------------- expert adapters in a DCP checkpoint
def expert_adapter_tensors(model: nn.Module) -> dict[str, tuple[object, str, ExpertParallel | None]]:
    """``{parameter name: (its ExpertLoRA, "lora_A" | "lora_B", its expert-parallel module or None)}`` of every
    LoRA adapter on routed experts (``target_parameters``), expert-parallel or not."""
    from longstraw.models.lora import ExpertLoRA

    parents = {id(a): m for m, a, _ in ep_adapter_params(model).values()}
    return {f"{name}.{which}.weight": (a, which, parents.get(id(a)))
            for name, a in model.named_modules() if isinstance(a, ExpertLoRA) for which in ("lora_A", "lora_B")}


def _adapter_entries(model: nn.Module, model_sd: dict | None, optim_sd: dict | None):
    """``(container, key, (ExpertLoRA, which, EP module or None))`` of every expert-adapter tensor in the state dicts
    (:func:`_state_entries`; shaped like this process's parameter, whose shape an FSDP DTensor gives globally)."""
    return _state_entries(expert_adapter_tensors(model), model_sd, optim_sd,
                          lambda o, v: v.shape == getattr(o[0], o[1]).weight.shape)


def adapters_to_dcp(model: nn.Module, model_sd: dict | None, optim_sd: dict | None = None, *,
                    split_b: bool = True) -> list[tuple[dict, str, Tensor]]:
    """In place: the expert adapters' tensors of DCP state dicts in the checkpoint's layout, the same whatever the
    run's: ``lora_A [total*r, in]`` as it is, ``lora_B [out, r*total]`` as its view ``[out, r, total]`` (PEFT's
    columns are interleaved, ``j*total + e``: an expert-parallel rank's experts are a block of the last dimension
    only there). Under expert parallelism each rank's part becomes a DTensor on the ``("ep", "edp")`` mesh, sharded
    over ``ep`` and replicated over ``edp`` (``lora_A`` by rows, ``lora_B`` by its last dimension), so that DCP writes
    every expert's adapter once and reads it into any layout (another ``ep``, FSDP without EP, one process).
    ``split_b=False``: ``lora_B`` stays ``[out, r*total]`` (checkpoints written before this layout; ValueError under
    expert parallelism). Every new entry is a view of the old one, so what DCP reads into it lands in the old one:
    returns ``(container, key, old entry)`` for :func:`restore_entries` to put back."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    undo = []
    for d, k, (a, which, m) in list(_adapter_entries(model, model_sd, optim_sd)):
        t = old = d[k]
        if which == "lora_B" and split_b:
            t = t.view(a.out_features, a.r, -1)  # a DTensor (FSDP shards dim 0) views alike
        if m is not None:
            if not split_b:
                raise ValueError(f"{k}: a checkpoint that holds the expert adapters' lora_B as [out, r * experts] "
                                 "cannot be read into an expert-parallel run (a rank's experts are not a block of "
                                 "it); resume it with parallel.ep = 1")
            full = (a.total * a.r, a.in_features) if which == "lora_A" else (a.out_features, a.r, a.total)
            t = DTensor.from_local(t, m.mesh, [Shard(0 if which == "lora_A" else 2), Replicate()], run_check=False,
                                   shape=torch.Size(full), stride=torch.empty(full, device="meta").stride())
        if t is not old:
            d[k] = t
            undo.append((d, k, old))
    return undo


def restore_entries(undo: list[tuple[dict, str, Tensor]]) -> None:
    """In place, the inverse of :func:`adapters_to_dcp` and :func:`ep_state_to_dtensors` (after DCP has read into
    the entries they made): the old entries back, in the model's shapes (an expert-parallel rank's part as a plain
    tensor, or FSDP's DTensor of its shard), as ``set_model_state_dict`` / ``set_optimizer_state_dict`` expect."""
    for d, k, old in undo:
        d[k] = old
