"""Phase 3 (exact mode): carry the gradient collected on the prompt state back through the prompt.

After the branches, each layer's state holds ``dL/dstate`` for every prompt position (attention: the K/V gradient
buffers, filled in place by the branches' attention backward; recurrent layers: the gradient of the final state).
Walking the prefill steps from last to first, step ``[s, e)`` is recomputed WITH autograd from the stored state
of ``[0, s)`` (itself a prefix whose gradient is collected, not differentiated), and back-propagated with the
collected gradient of the step's own state. This adds the step's parameter gradients and the gradient that the
step's tokens send to the state of earlier positions, which is complete by the time the walk reaches them.

The schedule and what surrounds the walk belong to the state (``steps``, ``step_prefix``, ``step_seeds``,
``backward_scope``): in one process the steps are the prefill chunks and the scope does nothing; a state split over
processes brings its own (``longstraw.distributed``).

Cost: one more forward and one backward of the prompt (about three prefill-equivalents); memory: one step's graph
on top of the state and its gradient. Independent of G.

With a graph budget (``GRPOConfig.graph_budget_bytes``, :mod:`longstraw.engine.kept_graphs`) the prefill kept the
graphs of the latest steps (and of the top layers of one more): those steps are back-propagated without the
recomputation, each graph freed as soon as it has been, so the recomputed steps that follow meet the same memory
as without a budget.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from longstraw.engine.kept_graphs import KeptGraphs, KeptStep
from longstraw.engine.lockstep import idle_reverse_step
from longstraw.models.transformer import CausalLM
from longstraw.state import PromptState


def prompt_backward(model: CausalLM, state: PromptState, *, checkpoint_layers: bool = False,
                    report: Callable[[int, int], None] | None = None, kept: KeptGraphs | None = None) -> None:
    """Back-propagate the state's collected gradient through the prompt (see module docstring); adds into
    ``.grad``. ``report(done, total)`` is called after each step. ``kept``: the graphs the prefill kept
    (:func:`~longstraw.engine.prefill.prefill_keeping`); their steps are back-propagated without recomputation, and
    each graph is freed as soon as it has been."""
    ids = state.token_ids
    steps = state.steps()
    total = model.placement.lockstep(len(steps))  # processes sharing the layers' collectives run alike
    with state.backward_scope(model):
        for done in range(1, total + 1):
            if done <= total - len(steps):
                idle_reverse_step(model, checkpoint_layers)  # the idle steps first: the real walk stays as it is
            else:
                i = total - done
                step = kept.pop(i) if kept is not None else None
                if step is None:
                    _backward_step(model, state, i, ids, checkpoint_layers)
                else:
                    _backward_kept(model, state, step, ids, checkpoint_layers)
                    del step
            if report is not None:
                report(done, total)


def _backward_step(model: CausalLM, state: PromptState, i: int, ids, checkpoint_layers: bool) -> None:
    """One step of the walk, in a function of its own so that nothing of it (pieces, seeds, prefixes) outlives it:
    the next step's peak must not include this one's graph."""
    s, e = state.steps()[i]
    prefix = state.step_prefix(i, grad=True)
    with torch.enable_grad():
        _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False, checkpoint_layers=checkpoint_layers)
        roots, grads = state.step_seeds(i, pieces)
        if roots:
            torch.autograd.backward(roots, grads)


def _backward_kept(model: CausalLM, state: PromptState, kept: KeptStep, ids, checkpoint_layers: bool) -> None:
    """A step whose graph the prefill kept for layers ``>= kept.split``: back-propagate it with the state gradient
    of those layers; if layers below the split were not kept, recompute them with autograd (up to the split) and
    back-propagate their own state gradient together with the gradient the kept layers sent to the boundary
    hidden. The kept graph is released here (``kept.pieces`` cleared)."""
    n = len(model.layers)
    i, split = kept.step, kept.split
    roots, grads = state.step_seeds(i, kept.pieces, layers=range(split, n))
    if roots:
        torch.autograd.backward(roots, grads)
    boundary = kept.boundary
    kept.pieces.clear()
    kept.boundary = None
    del roots, grads
    if split == 0:
        return
    g_boundary = boundary.grad
    del boundary
    s, e = state.steps()[i]
    prefix = state.step_prefix(i, grad=True)
    with torch.enable_grad():
        hidden, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False, checkpoint_layers=checkpoint_layers,
                                   stop_at_layer=split)
        roots, grads = state.step_seeds(i, pieces, layers=range(split))
        if g_boundary is not None and hidden.requires_grad:
            roots.append(hidden)
            grads.append(g_boundary.to(hidden.dtype))
        if roots:
            torch.autograd.backward(roots, grads)
