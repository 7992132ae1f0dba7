"""The process's parallel context: which ranks share one prompt (context parallel), which shard the parameters
(FSDP2), and how they talk.

``init_distributed(cp=R)`` splits the ``W`` ranks of a ``torchrun`` job into ``W / R`` data-parallel replicas of
``R`` consecutive ranks each; the ``R`` ranks of a replica form its context-parallel (CP) group and share every
prompt: each holds ``~1/R`` of the prompt state. With ``fsdp=True`` every parameter is sharded over ALL ranks of the
job (the data-parallel shard dimension times CP: ``W / replicate`` ranks), or, with ``replicate=N > 1`` (HSDP, for
multi-node jobs), over each of ``N`` groups of ``W / N`` consecutive ranks and replicated across them. Rank layout
(row-major): ``rank = (replica_group * dp_shard + shard) * cp + cp_rank``.

The context is the package's one piece of global state. It is read where a model is made (``load_model``,
``longstraw.build_model``: ``distributed.parallelize``); the engine never reads it, it asks the model's placement.

:class:`Comm` wraps the few collectives the CP attention and engine use, on one process group, with the tensor
layouts they need (a leading rank axis).
"""

from __future__ import annotations

import atexit
import gc
import importlib
import os
import warnings
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
# torch >= 2.12 renamed all_gather_into_tensor (now deprecated) to all_gather_single
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_BACKENDS = ("gloo", "nccl")


@dataclass(frozen=True)
class Comm:
    """Collectives over one process group; ``rank`` / ``size`` are this process's place in it.

    Every method is a collective: all ranks of the group must call it in the same order with tensors of the same
    shape and dtype.
    """

    group: Any
    rank: int
    size: int

    def all_gather(self, t: Tensor) -> Tensor:
        """``t [...]`` from every rank -> ``[size, ...]`` in rank order."""
        t = t.contiguous()
        out = t.new_empty((self.size * t.shape[0], *t.shape[1:]) if t.dim() else (self.size,))
        dist.all_gather_into_tensor(out, t if t.dim() else t[None], group=self.group)
        return out.view(self.size, *t.shape)

    def all_to_all(self, t: Tensor) -> Tensor:
        """``t [size, ...]``: block ``j`` goes to rank ``j``; returns ``[size, ...]`` whose block ``i`` came from
        rank ``i``."""
        assert t.shape[0] == self.size
        t = t.contiguous()
        out = torch.empty_like(t)
        dist.all_to_all_single(out, t, group=self.group)
        return out

    def all_reduce(self, t: Tensor) -> Tensor:
        """Sum over the group, in place; returns ``t``."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_reduce_max(self, t: Tensor) -> Tensor:
        """Elementwise maximum over the group, in place when ``t`` is contiguous (else into a contiguous copy);
        returns the result."""
        t = t.contiguous()
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return t

    def reduce(self, t: Tensor, dst: int) -> Tensor:
        """Sum over the group on rank ``dst``: in place when ``t`` is contiguous (else into a contiguous copy);
        returns the result (undefined on the other ranks)."""
        t = t.contiguous()
        dist.reduce(t, op=dist.ReduceOp.SUM, group=self.group, group_dst=dst)
        return t

    def broadcast(self, t: Tensor, src: int = 0) -> Tensor:
        """Rank ``src``'s ``t`` on every rank, in place; returns ``t``."""
        dist.broadcast(t, group=self.group, group_src=src)
        return t

    def shift(self, ts: list[Tensor]) -> list[Tensor]:
        """One step around the ring: ``ts`` go to rank ``rank + 1``, and the same-shaped list of rank ``rank - 1``
        comes back (mod ``size``). One batch of point-to-point operations (``dist.batch_isend_irecv``: coalesced
        on NCCL, plain isend/irecv on gloo), so no ordering between the ranks can deadlock."""
        nxt, prv = (self.rank + 1) % self.size, (self.rank - 1) % self.size
        sends = [t.contiguous() for t in ts]
        recvs = [torch.empty_like(t) for t in sends]
        ops = [dist.P2POp(dist.isend, t, group=self.group, group_peer=nxt) for t in sends]
        ops += [dist.P2POp(dist.irecv, t, group=self.group, group_peer=prv) for t in recvs]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return recvs


@dataclass(frozen=True)
class ParallelContext:
    """Where this process stands: global rank/world, its CP group (``cp_rank`` of ``cp_size``) and data-parallel
    replica (``dp_rank`` of ``dp_size``: the ranks that take different prompts), the backend and device, and whether
    parameters are FSDP2-sharded (``fsdp``; over ``fsdp_mesh``: 1-D ``("fsdp",)`` of ``W / replicate`` ranks, or 2-D
    ``("replicate", "fsdp")`` for HSDP). ``mesh`` is the ``(dp, cp)`` device mesh."""

    rank: int
    world_size: int
    cp_size: int
    cp_rank: int
    dp_size: int
    dp_rank: int
    backend: str
    device: torch.device
    fsdp: bool
    mesh: Any
    cp: Comm
    dp: Comm
    owns_process_group: bool
    replicate: int = 1
    fsdp_mesh: Any = None
    ep_size: int = 1
    ep_rank: int = 0
    ep: Comm | None = None
    edp: Comm | None = None
    ep_mesh: Any = None  # the 2-D ("ep", "edp") mesh of expert parallelism: FSDP shards the experts over "edp",
    # checkpoints describe them on both dims
    ep_shard: bool = True  # with W > ep: each EP block FSDP-sharded over the edp ranks (False: replicated there)

    @property
    def cp_mesh(self):
        """The 1-D mesh of this process's CP group."""
        return self.mesh["cp"]

    @property
    def shard_size(self) -> int:
        """Ranks one parameter is sharded over with FSDP (``W / replicate``)."""
        return self.world_size // self.replicate



_CONTEXT: ParallelContext | None = None


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _env_int(name: str) -> int:
    raw = os.environ[name]
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name}={raw!r} must be an integer") from None


def init_distributed(cp: int, fsdp: bool = False, *, replicate: int = 1, ep: int = 1, ep_shard: bool = True,
                     backend: str | None = None, timeout_s: float | None = None) -> ParallelContext:
    """Start (or join) the process group and set up context parallelism over groups of ``cp`` ranks.

    Call once per process, before :func:`longstraw.load_model`, in a job launched by ``torchrun`` (which sets
    ``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``, ``LOCAL_RANK``) or after initialising the default
    process group yourself. ``cp`` must divide the world size; consecutive ranks form a CP group.
    ``fsdp=True`` makes ``load_model`` shard every parameter (embedding and LM head included) over all ranks of the
    job with FSDP2; ``replicate=N`` shards over each of ``N`` groups of ``W / N`` ranks instead and replicates across
    them (HSDP: all-gathers stay inside a node; ``N`` must divide ``W / cp``).
    ``ep=E > 1``: expert parallelism (:mod:`longstraw.distributed.expert_parallel`): the routed experts of every MoE
    layer are split over groups of ``E`` consecutive ranks (which may span CP groups and replicas) and tokens are
    sent to them; needs ``fsdp=True`` (HSDP too), and ``E`` must divide the world size (and, checked when the model
    is loaded, every layer's number of experts). With more ranks than ``E``, ``ep_shard=True`` (default) FSDP-shards
    each rank's block of experts again over the ``W / E`` ranks holding it (``1 / W`` of the experts per rank, each
    block all-gathered over them while its layer runs, across the replicate groups under HSDP); ``ep_shard=False``
    replicates the block there instead (``1 / E`` per rank, no gathers, gradients all-reduced: where the memory
    allows, e.g. frozen LoRA experts, or HSDP with ``E`` the ranks of a node keeping expert traffic inside it).

    Data-parallel gradient convention: MEAN over the replicas. The ranks of a CP group share one prompt (each group's
    gradient is computed once, split over them); replicas take different groups, and ``.grad`` ends up as the mean of
    their gradients (FSDP reduces it so; without FSDP ``all_reduce_data_parallel`` does). Ranks that all pass the same
    group therefore get the single-process gradient; a trainer that spreads a step's groups over ``D`` replicas passes
    ``loss_scale = D_step / D`` (the step-global normaliser over the replicas) to sum them.
    ``backend``: ``"gloo"`` (CPU) or ``"nccl"`` (GPU); default: nccl when CUDA is available, else gloo.
    Every rank of a CP group must then make the same calls with the same inputs (``grpo_backward``, ``score``,
    ``generate``), as in any SPMD program.
    """
    global _CONTEXT
    if _CONTEXT is not None:
        raise ValueError(f"init_distributed was already called in this process (cp={_CONTEXT.cp_size}, "
                         f"fsdp={_CONTEXT.fsdp}); call it once, before load_model (shutdown_distributed() ends it)")
    if not isinstance(cp, int) or isinstance(cp, bool) or cp < 1:
        raise ValueError(f"cp={cp!r} must be an integer >= 1 (the number of ranks that share one prompt)")
    if not isinstance(fsdp, bool):
        raise ValueError(f"fsdp={fsdp!r} must be True or False")
    if not isinstance(replicate, int) or isinstance(replicate, bool) or replicate < 1:
        raise ValueError(f"replicate={replicate!r} must be an integer >= 1 (HSDP replica groups; 1: plain FSDP)")
    if replicate > 1 and not fsdp:
        raise ValueError(f"replicate={replicate} needs fsdp=True (it replicates FSDP's shards over node groups)")
    if not isinstance(ep, int) or isinstance(ep, bool) or ep < 1:
        raise ValueError(f"ep={ep!r} must be an integer >= 1 (ranks the routed experts are split over; 1: off)")
    if not isinstance(ep_shard, bool):
        raise ValueError(f"ep_shard={ep_shard!r} must be True or False")
    if ep > 1 and not fsdp:
        raise ValueError(f"ep={ep} needs fsdp=True (expert parallelism runs with the rest of the model FSDP-sharded "
                         "and every rank in lockstep)")
    if backend is not None and backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is not supported; allowed: None, {', '.join(map(repr, _BACKENDS))}")
    if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a number of seconds > 0 or None")

    owns = not dist.is_initialized()
    if owns:
        missing = [v for v in _ENV if v not in os.environ]
        if missing:
            raise ValueError(f"init_distributed needs a torch.distributed environment, but {', '.join(missing)} "
                             f"{'is' if len(missing) == 1 else 'are'} not set; launch with `torchrun "
                             f"--nproc_per_node {cp} your_script.py` (or call torch.distributed.init_process_group "
                             "first)")
        world, rank = _env_int("WORLD_SIZE"), _env_int("RANK")
        if world < 1 or not 0 <= rank < world:
            raise ValueError(f"RANK={rank} and WORLD_SIZE={world} are inconsistent: need 0 <= RANK < WORLD_SIZE")
    else:
        world, rank = dist.get_world_size(), dist.get_rank()
    if world % cp:
        raise ValueError(f"cp={cp} does not divide the world size {world}; allowed: "
                         f"{', '.join(map(str, _divisors(world)))}")
    if (world // cp) % replicate:
        raise ValueError(f"replicate={replicate} does not divide the {world // cp} data-parallel replicas (world "
                         f"{world} / cp={cp}); allowed: {', '.join(map(str, _divisors(world // cp)))}")

    if world % ep:
        raise ValueError(f"ep={ep} does not divide the world size {world}; allowed: "
                         f"{', '.join(map(str, _divisors(world)))}")

    if owns:
        backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
    else:
        backend = dist.get_backend()
    if backend == "nccl":
        local = _env_int("LOCAL_RANK") if "LOCAL_RANK" in os.environ else rank % max(1, torch.cuda.device_count())
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
    else:
        device = torch.device("cpu")
    if owns:
        kw = {"timeout": timedelta(seconds=timeout_s)} if timeout_s is not None else {}
        dist.init_process_group(backend, **kw)
        atexit.register(_collect_garbage)  # (once per process: init_distributed runs once)

    from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

    dp_size = world // cp
    mesh = init_device_mesh(device.type, (dp_size, cp), mesh_dim_names=("dp", "cp"))
    cp_comm = Comm(mesh.get_group("cp"), rank % cp, cp)
    dp_comm = Comm(mesh.get_group("dp"), rank // cp, dp_size)
    fsdp_mesh = None
    if fsdp:  # FSDP2 and DTensor (~40 MiB of modules) imported here, not inside the first load_model
        importlib.import_module("torch.distributed.fsdp")
        importlib.import_module("torch.distributed.tensor")
    if fsdp and world // replicate == 1:
        warnings.warn(f"fsdp=True with {world} rank(s) and replicate={replicate}: each shard group has one rank; "
                      "parameters stay whole", stacklevel=2)
        fsdp = False
    if world // replicate > 1:  # every rank of a replicate group holds 1/(W/N) of each parameter (also for an
        ranks = torch.arange(world)  # apply_fsdp called later on a model of a job initialised without fsdp)
        fsdp_mesh = (DeviceMesh(device.type, ranks, mesh_dim_names=("fsdp",)) if replicate == 1 else
                     DeviceMesh(device.type, ranks.view(replicate, world // replicate),
                                mesh_dim_names=("replicate", "fsdp")))
    ep_comm = edp_comm = ep_mesh = None
    if ep > 1:  # EP groups of ep consecutive ranks; edp: the ranks holding the same experts. Mesh dims in the
        # order the experts' rows split: by ep (blocks of experts), then each block by edp (FSDP's shards of it)
        ep_mesh = DeviceMesh(device.type, torch.arange(world).view(world // ep, ep).t(), mesh_dim_names=("ep", "edp"))
        ep_comm = Comm(ep_mesh.get_group("ep"), rank % ep, ep)
        edp_comm = Comm(ep_mesh.get_group("edp"), rank // ep, world // ep)
    _CONTEXT = ParallelContext(rank=rank, world_size=world, cp_size=cp, cp_rank=rank % cp, dp_size=dp_size,
                               dp_rank=rank // cp, backend=backend, device=device, fsdp=fsdp, mesh=mesh,
                               cp=cp_comm, dp=dp_comm, owns_process_group=owns, replicate=replicate,
                               fsdp_mesh=fsdp_mesh, ep_size=ep, ep_rank=rank % ep, ep=ep_comm, edp=edp_comm,
                               ep_mesh=ep_mesh, ep_shard=ep_shard)
    return _CONTEXT


def shutdown_distributed() -> None:
    """Forget the context; destroy the process group if :func:`init_distributed` created it (after collecting the
    garbage that may still reference its work: :func:`_collect_garbage`)."""
    global _CONTEXT
    ctx, _CONTEXT = _CONTEXT, None
    if ctx is not None and ctx.owns_process_group and dist.is_initialized():
        _collect_garbage()
        dist.barrier()
        dist.destroy_process_group()


def _collect_garbage() -> None:
    """Collect reference cycles (DTensors, device meshes, autograd graphs whose nodes ran collectives) while the
    interpreter is whole: at shutdown and, registered by :func:`init_distributed`, at exit, after the script's own
    frames are gone. Left to the interpreter's finalisation, their C++ destructors can run against a half torn-down
    interpreter and abort a finished process ("terminate called without an active exception", SIGABRT: seen twice in
    this suite's gloo workers, not reproducible on demand; pytorch/pytorch#179291 describes the mechanism for gloo's
    pending work objects). A mitigation: whether it removes every such abort is not known."""
    gc.collect()


def get_context() -> ParallelContext | None:
    """The context set by :func:`init_distributed`, or None."""
    return _CONTEXT


def cp_active() -> ParallelContext | None:
    """The context if a context-parallel group of more than one rank is active, else None (single process)."""
    return _CONTEXT if _CONTEXT is not None and _CONTEXT.cp_size > 1 else None


def max_over_job(n: int, ctx: ParallelContext) -> int:
    """The largest ``n`` any rank of the job passes (a collective: every rank calls it)."""
    t = torch.tensor([n], dtype=torch.int64, device=ctx.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())
