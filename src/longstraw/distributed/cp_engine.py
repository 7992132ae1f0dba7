"""The engine's phases under context parallelism; the engine delegates here when a CP group is active.

Prefill (:func:`cp_prefill`): step by step (:class:`~longstraw.distributed.cp_state.ShardLayout`), every rank runs
``model.run`` on its own piece with its layers' ``step_prefix`` and stores the piece's state; full-attention layers
exchange queries and partial outputs with the owners of the stored positions and the step's K/V pieces with each
other (:mod:`longstraw.distributed.cp_attention`). The same ``model.run`` as single-process prefill.

Replay / score / decoding need no code here: the sharded state's ``prefix()`` hands the model sharded segments and
every rank runs the same branches (their non-attention work is redundant, the attention over the prompt is split).

Exact reverse pass (:func:`cp_prompt_backward`): the steps in reverse; in step ``k`` every rank recomputes its piece
with autograd against ``step_prefix(k, grad=True)`` and back-propagates the gradient its sinks hold for the piece.
Inside the same backward, a piece's queries send ``dK, dV`` to the stored positions of earlier steps (added by
their owners into their sinks: the query-side tensors travel, not the K/V gradient) and to the earlier pieces of the
step (returned to their owners by all-to-all, joining their autograd graphs). A step's state gradient is complete
when the step is reached: branches, later steps and later pieces have all contributed.

Parameter gradients. Replay is redundant: every rank computes the same branch gradient ``B``. The reverse pass is
rank-local: rank ``r`` computes ``P_r`` from its pieces and ``.grad`` must become ``G0 + B + sum_r P_r`` (``G0``:
whatever ``.grad`` held before, e.g. earlier groups). Unsharded parameters: the reverse pass accumulates into fresh
``.grad`` tensors (the old ones set aside: one gradient-sized buffer more while it runs, only the embedding, norm
and head under FSDP2), which are all-reduced over the CP group and added to the old ones. (Pre-dividing the old
``.grad`` by ``R`` and all-reducing the sum would need no buffer, and is exact only for power-of-two ``R``.)
FSDP2-sharded parameters: FSDP reduce-scatters after every backward; replay keeps its default average over the CP
group (``avg(B) = B``), the reverse pass switches it to a sum.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from longstraw.distributed.context import Comm, ParallelContext
from longstraw.distributed.cp_state import ShardedPromptState, shard_layout, shard_states

if TYPE_CHECKING:
    from longstraw.models.transformer import CausalLM

__all__ = ["cp_prefill", "cp_prompt_backward", "cp_broadcast_tokens", "check_same_group"]


def _attach(model: "CausalLM", states: list) -> list:
    """Module hooks some state kinds need while a CP phase runs (DeltaNet: the state hand-off); their handles."""
    handles = []
    for layer, st in zip(model.layers, states):
        attach = getattr(st, "attach", None)
        if attach is not None:
            handles += attach(layer.mixer)
    return handles


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


@torch.no_grad()
def cp_prefill(model: "CausalLM", ids: Tensor, chunk_size: int, exact: bool, ctx: ParallelContext
               ) -> ShardedPromptState:
    """ids ``[n]`` (the same on every CP rank) -> this rank's share of the state of those positions.

    ValueError if ``n`` is smaller than the CP size or the ranks' prompts differ, before anything is computed.
    """
    comm = ctx.cp
    n = int(ids.shape[0])
    layout = shard_layout(n, comm.size, chunk_size)
    _check_same(comm, "prompt", _fingerprint(ids), ctx.device)
    states = shard_states(model.new_prompt_states(layout.local_size(comm.rank), exact), layout, comm)
    handles = _attach(model, states)
    try:
        for k in range(layout.num_steps):
            s, e = layout.piece(k, comm.rank)
            prefix = [st.step_prefix(k, False) for st in states]
            _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False)
            for st, piece in zip(states, pieces):
                st.write(piece, s, e)
            del pieces, prefix
    finally:
        for h in handles:
            h.remove()
    return ShardedPromptState(states, ids, layout.pieces(comm.rank), layout=layout, comm=comm)


def _is_sharded(p: Tensor) -> bool:
    return hasattr(p, "device_mesh") and hasattr(p, "full_tensor")  # a DTensor (FSDP2 parameter)


def _fsdp_modules(model: torch.nn.Module) -> list:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - torch without FSDP2
        return []
    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def cp_prompt_backward(model: "CausalLM", state: ShardedPromptState, *, checkpoint_layers: bool = False) -> None:
    """The exact reverse pass over a sharded prompt state (see module docstring); adds into ``.grad``."""
    from longstraw.engine.prompt_backward import _seeds

    comm, layout = state.comm, state.layout
    assert comm is not None and layout is not None
    params = [p for p in model.parameters() if p.requires_grad]
    plain = [p for p in params if not _is_sharded(p)]
    before = [p.grad for p in plain]
    for p in plain:
        p.grad = None  # the reverse pass accumulates P_r alone; summed over the group below
    fsdp = _fsdp_modules(model)
    for m in fsdp:
        m.set_gradient_divide_factor(1.0)  # rank-local gradients: reduce-scatter sums them
    handles = _attach(model, state.layers)
    try:
        ids = state.token_ids
        for k in reversed(range(layout.num_steps)):
            s, e = layout.piece(k, comm.rank)
            prefix = [ls.step_prefix(k, True) for ls in state.layers]
            with torch.enable_grad():
                _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False,
                                      checkpoint_layers=checkpoint_layers)
                roots, grads = _seeds(state, pieces, s, e)
                if roots:
                    torch.autograd.backward(roots, grads)
            del pieces, roots, grads, prefix
    finally:
        for h in handles:
            h.remove()
        for m in fsdp:
            m.set_gradient_divide_factor(float(comm.size))  # back to the average over the group (replay)
    # which parameters the prompt reached on any rank (LM head and final norm: on none); then sum those
    reached = torch.tensor([p.grad is not None for p in plain], dtype=torch.int32, device=_device_of(plain))
    comm.all_reduce(reached)
    for p, old, hit in zip(plain, before, reached.tolist()):
        if not hit:
            p.grad = old
            continue
        g = p.grad if p.grad is not None else torch.zeros_like(p)
        comm.all_reduce(g)
        p.grad = g if old is None else old.add_(g)


def _device_of(params: list[Tensor]) -> torch.device:
    return params[0].device if params else torch.device("cpu")


def cp_broadcast_tokens(ctx: ParallelContext, ids: Tensor, logprobs: Tensor) -> tuple[Tensor, Tensor]:
    """CP rank 0's sampled ``ids [n]`` and their ``logprobs [n]`` on every rank (all ranks then decode the same
    branches, whatever their generators did)."""
    ids, logprobs = ids.contiguous(), logprobs.contiguous()
    ctx.cp.broadcast(ids)
    ctx.cp.broadcast(logprobs)
    return ids, logprobs


def all_reduce_data_parallel(model: torch.nn.Module, ctx: ParallelContext) -> None:
    """Sum ``.grad`` over the data-parallel replicas (``dp > 1``): each replica's CP group holds the gradient of
    its own groups; after this every rank holds the step's total. FSDP2 shards are summed shard-wise (every
    replica shards alike)."""
    if ctx.dp_size == 1:
        return
    for p in model.parameters():
        if p.grad is None:
            continue
        g = p.grad.to_local() if _is_sharded(p.grad) else p.grad
        ctx.dp.all_reduce(g)
