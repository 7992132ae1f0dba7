"""The job's parallelism as a model's placement: prompt states split over the ranks of a CP group, and the
data-parallel replicas kept in step when they share FSDP's collectives.

``parallelize`` (``longstraw.distributed``) sets a :class:`ContextParallel` placement on a model (``load_model``
does it after ``init_distributed``). The engine then asks the placement, as it asks the default one, for a
prompt state (:meth:`ContextParallel.prompt_state`: with ``cp > 1`` a
:class:`~longstraw.distributed.cp_state.ShardedPromptState`, this rank's share with its own schedule), to check a
group's inputs (every rank of a CP group must pass the same: they run in lockstep), to agree on sampled tokens
(every rank decodes CP rank 0's samples), and how many steps each phase runs (:meth:`ContextParallel.lockstep`: with
parameters sharded over replicas that take different prompts, the largest count over the job). Everything else —
the step exchanges of prefill and of the reverse pass, the replay's attention over the sharded state, the gradient
sums — happens inside the sharded state and its segments, behind the interfaces the engine and the models use.

Replay, score and decoding need nothing here: the sharded state's ``prefix()`` hands the model sharded segments and
every rank runs the same branches (their non-attention work is redundant, the attention over the prompt is split).
"""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw.distributed.context import Comm, ParallelContext, max_over_job
from longstraw.distributed.cp_state import ShardedPromptState, shard_layout, shard_states
from longstraw.distributed.fsdp import reshard
from longstraw.state import Placement

__all__ = ["ContextParallel", "check_same_group", "all_reduce_data_parallel"]


def _fingerprint(ids: Tensor) -> Tensor:
    """``[3]`` int64 summary of a token sequence (length, sum, position-weighted sum), cheap to all-gather."""
    x = ids.detach().to("cpu", torch.int64).flatten()
    w = torch.arange(x.numel(), dtype=torch.int64) % 65521 + 1
    return torch.stack([torch.tensor(x.numel()), x.sum(), (x * w).sum()])


def _check_same(comm: Comm, what: str, fp: Tensor, device: torch.device) -> None:
    got = comm.all_gather(fp.to(device)).cpu()
    bad = [r for r in range(comm.size) if not torch.equal(got[r], got[0])]
    if bad:
        raise ValueError(f"the ranks of a context-parallel group must pass the same {what}, but CP rank(s) "
                         f"{bad} pass different ones than CP rank 0 (the ranks of a group run it in lockstep)")


def check_same_group(ctx: ParallelContext, prompt_ids: Tensor, responses: list[Tensor]) -> None:
    """ValueError (on every rank alike) unless all CP ranks pass the same prompt and responses."""
    fp = torch.cat([_fingerprint(prompt_ids), torch.tensor([len(responses)])] +
                   [_fingerprint(r) for r in responses])
    n = ctx.cp.all_gather(torch.tensor([fp.numel()], device=ctx.device)).cpu()
    if not bool((n == n[0]).all()):
        raise ValueError(f"the ranks of a context-parallel group must pass the same group, but they pass "
                         f"{[(int(x) - 4) // 3 for x in n.flatten()]} responses (CP ranks 0..{ctx.cp.size - 1})")
    _check_same(ctx.cp, "prompt and responses", fp, ctx.device)


class ContextParallel(Placement):
    """The placement of a model under ``ctx``: prompt states split by position over its CP group (block-cyclic steps:
    docs/DISTRIBUTED.md) when ``cp > 1``, and phases run in lockstep over the job when FSDP shards over replicas
    that take different prompts."""

    def __init__(self, ctx: ParallelContext, fsdp: bool = False):
        self.ctx, self.fsdp = ctx, fsdp

    def prompt_state(self, model, ids: Tensor, chunk_size: int, exact: bool):
        """This rank's share of the state of ``ids [n]`` (the same on every CP rank). ValueError if ``n`` is smaller
        than the CP size or the ranks' prompts differ, before anything is computed."""
        if self.ctx.cp_size == 1:
            return super().prompt_state(model, ids, chunk_size, exact)
        comm = self.ctx.cp
        layout = shard_layout(int(ids.shape[0]), comm.size, chunk_size)
        _check_same(comm, "prompt", _fingerprint(ids), self.ctx.device)
        states = shard_states(model.new_prompt_states(layout.local_size(comm.rank), exact), layout, comm)
        return ShardedPromptState(states, ids, layout.pieces(comm.rank), layout=layout, comm=comm,
                                  replicas=self.ctx.dp_size if self.fsdp else 1)

    def check_group(self, prompt_ids: Tensor, responses: list[Tensor]) -> None:
        if self.ctx.cp_size > 1:
            check_same_group(self.ctx, prompt_ids, responses)

    def agree(self, ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
        """CP rank 0's sampled ``ids [n]`` and their ``logprobs [n]`` on every rank (all ranks then decode the same
        branches, whatever their generators did)."""
        if self.ctx.cp_size == 1:
            return ids, logprobs
        ids, logprobs = ids.contiguous(), logprobs.contiguous()
        self.ctx.cp.broadcast(ids)
        self.ctx.cp.broadcast(logprobs)
        return ids, logprobs

    def lockstep(self, steps: int) -> int:
        """The most steps any rank runs in this phase when FSDP's collectives span data-parallel replicas (which take
        different prompts); the others pad with idle steps. Otherwise ``steps``."""
        return max_over_job(steps, self.ctx) if self.fsdp and self.ctx.dp_size > 1 else steps

    def check_kept_graphs(self, model, budget: int) -> None:
        """Kept prompt-step graphs need, under FSDP, every rank of the job on one prompt (``cp`` = the world size):
        a kept step's backward runs FSDP's collectives without its forward, so ranks that keep different steps (data-
        parallel replicas with prompts of other lengths) would call different collectives; the ranks of one CP group
        plan alike (:meth:`agree_max`), and FSDP2 gathers a unit again for a kept graph's backward as for any.
        Under CP every layer's state kind must say it can (``keeps_step_graphs``: the kinds sharded by position or
        replicated, whose grad-mode prefixes are the same in the prefill and the reverse pass, and the DeltaNet
        scan, whose kept prefill prefix takes the step's initial state as a gradient leaf); a kind registered without it
        is refused."""
        if self.fsdp and self.ctx.dp_size > 1:
            raise ValueError(f"graph_budget_bytes={budget}: kept prompt-step graphs under FSDP need every rank on one "
                             f"prompt (cp = the world size), but this job has {self.ctx.dp_size} data-parallel "
                             f"replicas (cp={self.ctx.cp_size} of {self.ctx.world_size} ranks), which would keep "
                             "different steps; use graph_budget_bytes=None there")
        if self.ctx.cp_size == 1:
            return
        from longstraw.distributed.cp_state import kind_of

        for i, st in enumerate(model.new_prompt_states(1, True)):
            if not getattr(kind_of(st), "keeps_step_graphs", False):
                raise ValueError(f"graph_budget_bytes={budget}: layer {i} keeps a {type(st).__name__} prompt state, "
                                 f"whose context-parallel form cannot keep prompt-step graphs (cp={self.ctx.cp_size}); "
                                 "use graph_budget_bytes=None or cp=1")

    def agree_max(self, values: list[float]) -> list[float]:
        if self.ctx.cp_size == 1:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.ctx.device)
        return self.ctx.cp.all_reduce_max(t).tolist()

    def finish(self, model) -> None:
        """Reshard every FSDP unit (:func:`longstraw.distributed.fsdp.reshard`): the embedding / norm / LM head
        group stays gathered after a call that ends with the LM head."""
        if self.fsdp:
            reshard(model)

    def __repr__(self) -> str:
        return (f"ContextParallel(cp={self.ctx.cp.size}, cp_rank={self.ctx.cp.rank}, dp={self.ctx.dp_size}, "
                f"fsdp={self.fsdp})")


def all_reduce_data_parallel(model: torch.nn.Module, ctx: ParallelContext) -> None:
    """Average ``.grad`` over the data-parallel replicas (``dp > 1``; the convention of ``init_distributed``): each
    replica's CP group holds the gradient of its own groups; after this every rank holds their mean. Gradients FSDP
    shards over the job (DTensors) are averaged already by its reductions and are left alone."""
    if ctx.dp_size == 1:
        return
    from longstraw.distributed.expert_parallel import ep_param_ids

    ep_ids = ep_param_ids(model)  # expert-parallel experts: reduced over the whole job in their backward
    for p in model.parameters():
        if p.grad is None or hasattr(p.grad, "to_local") or id(p) in ep_ids:
            continue
        ctx.dp.all_reduce(p.grad)
        p.grad.div_(ctx.dp_size)
