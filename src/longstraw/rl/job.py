"""The trainer's place in its job: one process, or one rank of a ``torchrun`` job; which prompts of a step it takes,
how its results meet the other ranks', and who writes.

:meth:`Job.start` reads ``[parallel]``:

* without a torch.distributed environment (no ``torchrun``: ``RANK`` / ``WORLD_SIZE`` unset), or in a job of one
  rank: one process. ``parallel.cp``, ``parallel.replicate`` and ``parallel.ep`` must be 1 (a one-line error says
  to launch with torchrun otherwise); ``parallel.fsdp`` is simply off with one process.
* under ``torchrun`` with ``W > 1`` ranks: ``init_distributed(cp, fsdp, replicate, ep)`` (NCCL for a CUDA
  ``model.device``, each rank on ``cuda:LOCAL_RANK``; gloo for ``cpu``), so that ``load_model`` shards the model
  with FSDP2. The ``W / cp`` data-parallel replicas split every step's prompts: replica ``d`` takes prompts
  ``[d L, (d + 1) L)`` of the step, ``L = prompts_per_step / (W / cp)`` (it must divide evenly).

Every rank runs the same program (SPMD). What only one rank does (write the run directory, the metrics, the
plots; hold the run directory's lock) is rank 0's; what it decides, every rank learns through :meth:`Job.together`,
which turns an error on any rank into the same ``JobError`` on every rank instead of leaving the others waiting in
the next collective (:mod:`longstraw.distributed.agree`). The CLI prints a ``JobError`` on rank 0 only, so a refused
run is one line.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch

from longstraw.distributed.agree import JobError, together

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")
LAUNCH = "torchrun --nproc_per_node N -m longstraw train --config run.toml"


def env_world_size() -> int:
    """``WORLD_SIZE`` of a torchrun job (1 without one)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _divisors(n: int, also=lambda d: True) -> str:
    """The divisors of ``n`` for which ``also(d)`` holds, as a comma-separated list."""
    return ", ".join(str(d) for d in range(1, n + 1) if n % d == 0 and also(d))


def check_parallel(cfg, world: int, have_env: bool) -> None:
    """``[parallel]`` and ``algorithm.prompts_per_step`` against a job of ``world`` ranks: one-line errors in the
    config's terms (raised alike on every rank, before any process group exists)."""
    p, pps = cfg.parallel, cfg.algorithm.prompts_per_step
    if world == 1:
        bad = [f"parallel.{k}={getattr(p, k)}" for k in ("cp", "replicate", "ep") if getattr(p, k) != 1]
        if bad:
            where = ("there is no torch.distributed environment (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not "
                     "set)" if not have_env else "this job has one process")
            raise JobError(f"{' and '.join(bad)} need a job of several ranks, but {where}; launch with `{LAUNCH}` "
                           "(N a multiple of parallel.cp), or set them to 1")
        return
    if world % p.cp:
        raise JobError(f"parallel.cp={p.cp} does not divide the job's {world} ranks; allowed: {_divisors(world)}")
    replicas = world // p.cp
    if replicas % p.replicate:
        raise JobError(f"parallel.replicate={p.replicate} does not divide the {replicas} data-parallel replicas "
                       f"(world {world} / parallel.cp={p.cp}); allowed: {_divisors(replicas)}")
    if p.replicate > 1 and world // p.replicate < 2:
        raise JobError(f"parallel.replicate={p.replicate} leaves {world // p.replicate} rank per shard group (world "
                       f"{world} / replicate); HSDP shards over at least 2: allowed "
                       f"{_divisors(replicas, lambda d: world // d >= 2)}")
    if world % p.ep:
        raise JobError(f"parallel.ep={p.ep} does not divide the job's {world} ranks; allowed: {_divisors(world)}")
    if pps % replicas:
        raise JobError(f"algorithm.prompts_per_step={pps} does not split evenly over the {replicas} data-parallel "
                       f"replicas (world {world} / parallel.cp={p.cp}); make it a multiple of {replicas} (or raise "
                       "parallel.cp)")


def _device_for_job(device: torch.device) -> tuple[torch.device, str]:
    if device.type == "cpu":
        return device, "gloo"
    if device.type == "cuda":
        if device.index is not None:
            raise JobError(f"model.device='{device}': under torchrun each rank uses cuda:LOCAL_RANK; write 'cuda'")
        return device, "nccl"
    raise JobError(f"model.device='{device}' cannot be used by a torchrun job; use 'cuda' (NCCL) or 'cpu' (gloo)")


@dataclass
class Job:
    """This process's place: ``rank`` of ``world``; its data-parallel replica ``dp_rank`` of ``dp_size``; its CP rank
    ``cp_rank`` of ``cp_size``; ``sharded``: the models are FSDP2-sharded (checkpoints are then sharded too);
    ``device``: where this rank computes. ``ctx`` is the :class:`~longstraw.distributed.ParallelContext` (None for
    one process); ``owns``: this trainer started it (and ends it in :meth:`close`)."""

    rank: int = 0
    world: int = 1
    dp_rank: int = 0
    dp_size: int = 1
    cp_rank: int = 0
    cp_size: int = 1
    sharded: bool = False
    device: torch.device = torch.device("cpu")
    ctx: Any = None
    owns: bool = False

    @classmethod
    def start(cls, cfg, device: torch.device) -> Job:
        """The job of this process for run config ``cfg`` (see the module doc); under torchrun, joins the process
        group with ``cfg.parallel``'s layout, or takes the context this process already has if it has that layout."""
        from longstraw.distributed import get_context, init_distributed

        p = cfg.parallel
        ctx = get_context()
        have_env = all(v in os.environ for v in _TORCHRUN_ENV)
        world = ctx.world_size if ctx is not None else env_world_size() if have_env else 1
        check_parallel(cfg, world, have_env)
        if ctx is None and not have_env:
            return cls(device=device)
        owns = ctx is None
        if ctx is None:  # torchrun (a job of one rank too: --nproc_per_node 1, where FSDP is simply off)
            device, backend = _device_for_job(device)
            ctx = init_distributed(cp=p.cp, fsdp=p.fsdp and world // p.replicate > 1, replicate=p.replicate,
                                   ep=p.ep, ep_shard=p.ep_shard, backend=backend)
        elif ((ctx.cp_size, ctx.replicate, ctx.ep_size) != (p.cp, p.replicate, p.ep)
              or ctx.fsdp != (p.fsdp and ctx.shard_size > 1) or (p.ep > 1 and ctx.ep_shard != p.ep_shard)):
            raise JobError(f"this process already runs with cp={ctx.cp_size}, fsdp={ctx.fsdp}, replicate="
                           f"{ctx.replicate}, ep={ctx.ep_size}, ep_shard={ctx.ep_shard} (init_distributed), but "
                           f"[parallel] says cp={p.cp}, fsdp={p.fsdp}, replicate={p.replicate}, ep={p.ep}, "
                           f"ep_shard={p.ep_shard}")
        return cls(rank=ctx.rank, world=ctx.world_size, dp_rank=ctx.dp_rank, dp_size=ctx.dp_size,
                   cp_rank=ctx.cp_rank, cp_size=ctx.cp_size, sharded=ctx.fsdp, device=ctx.device, ctx=ctx, owns=owns)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world > 1

    def local_prompts(self, prompts_per_step: int) -> range:
        """The indices (within a step) of the prompts this replica takes."""
        n = prompts_per_step // self.dp_size
        return range(self.dp_rank * n, (self.dp_rank + 1) * n)

    # ---------------------------------------------------------------------------------------- collectives
    def gather(self, obj) -> list:
        """Every rank's ``obj``, in rank order, on every rank (a collective)."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: list = [None] * self.world
        dist.all_gather_object(out, obj)
        return out

    def replicas(self, obj) -> list:
        """Each data-parallel replica's ``obj`` (its CP rank 0's), in replica order (a collective)."""
        return self.gather(obj)[:: self.cp_size]

    def from_cp_rank0(self, obj):
        """CP rank 0's ``obj`` on every rank of this CP group (a collective of the group)."""
        if self.cp_size == 1:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, group=self.ctx.cp.group, group_src=0)
        return box[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier()

    def together(self, main_only: bool = False):
        """Run a block, then agree on its errors over the job (:func:`longstraw.distributed.agree.together`)."""
        return together(main_only)

    def close(self, ok: bool) -> None:
        """End the process group if this trainer started it (after a clean run: a barrier first; after a failure
        the group is left to the process's exit, since other ranks may not reach a barrier)."""
        if self.owns and ok:
            from longstraw.distributed import shutdown_distributed

            shutdown_distributed()
            self.owns = False
