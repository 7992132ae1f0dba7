"""Phase 1: the prompt, piece by piece, under ``no_grad``, into a :class:`~longstraw.state.PromptState`.

The state comes from the model's placement (``model.placement.prompt_state``): in one process the prompt is cut into
chunks of ``chunk_size``; split over a context-parallel group it is this process's share (its own schedule). Each
step is one ``model.run`` over the step's tokens with the state of the positions before them as prefix; each layer
then stores its piece. Nothing is differentiated, nothing but the state survives a step: peak memory is the state
plus one step's activations. The last prompt token is NOT prefilled: every branch replays it, so that the log-prob
of the first response token is computed with autograd like the rest.

Exact mode with a graph budget (:func:`prefill_keeping`): the steps whose graphs fit run with autograd (whole, or
their top layers) and their graphs are kept for the reverse pass (:mod:`longstraw.engine.kept_graphs`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from longstraw.engine.kept_graphs import (
    KeptGraphs,
    KeptStep,
    add_pieces,
    check_budget_placement,
    graph_meter,
    keep_saved,
    plan_splits,
)
from longstraw.engine.lockstep import idle_prefill_step
from longstraw.models.transformer import CausalLM
from longstraw.ops import meta
from longstraw.state import PromptState


@torch.no_grad()
def prefill(model: CausalLM, ids: Tensor, chunk_size: int, exact: bool = False, *,
            report: Callable[[int, int], None] | None = None, offload_history: bool = False) -> PromptState:
    """ids ``[n]`` (the prompt without its last token) -> the state of those ``n`` positions.

    ``exact``: keep what the exact reverse pass needs. ``report(done, total)`` is called after each step.
    ``offload_history``: what only the reverse pass reads again goes to host memory as soon as the prefill has
    superseded it (``GRPOConfig.offload_state``: a DeltaNet layer's chunk-boundary states;
    ``PromptState.offload_history``).
    """
    return prefill_keeping(model, ids, chunk_size, exact, report=report, offload_history=offload_history)[0]


@torch.no_grad()
def prefill_keeping(model: CausalLM, ids: Tensor, chunk_size: int, exact: bool = False, *,
                    graph_budget: int | None = None, offload_grad: bool = False,
                    report: Callable[[int, int], None] | None = None, offload_history: bool = False
                    ) -> tuple[PromptState, KeptGraphs | None]:
    """:func:`prefill`, and with ``graph_budget`` (bytes, exact mode) the graphs of the latest steps that fit kept
    for the reverse pass (:mod:`longstraw.engine.kept_graphs`): returns ``(state, kept)``; ``kept`` is None
    without a budget. With kept graphs the state's gradient sinks are enabled during the prefill (in host memory
    with ``offload_grad``)."""
    assert ids.dim() == 1
    state = model.placement.prompt_state(model, ids, chunk_size, exact)
    if offload_history:
        state.offload_history()
    steps = state.steps()
    total = model.placement.lockstep(len(steps))  # processes sharing the layers' collectives run alike
    kept = None
    if graph_budget and steps:
        assert exact, "kept graphs are exact mode's"
        check_budget_placement(model, graph_budget)
        kept = KeptGraphs(graph_budget, offload_grad=offload_grad)
    template = None  # the memory planner's dry run: (length, layout of the pieces) of the last step run
    run_steps = (0, 1, len(steps) - 2, len(steps) - 1)  # ... and the steps it runs (ops/meta.py)
    for i in range(total):
        if i < len(steps):
            s, e = steps[i]
            if kept is None:
                if (template is not None and template[0] == e - s and template[1] is not None
                        and meta.skip_repeated_block(ids, i, run_steps)):
                    pieces = meta.replicate(template[1])  # the state stores them as a run step's
                else:
                    prefix = state.step_prefix(i, grad=False)
                    _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False)
                    if meta.is_meta(ids):
                        template = (e - s, meta.layout(pieces))
                state.write_step(i, pieces)
            elif i == 0:
                _measure_first_step(model, state, ids, kept)
            else:
                _kept_step(model, state, ids, i, kept)
            pieces = prefix = None
        else:
            idle_prefill_step(model)
        if report is not None:
            report(i + 1, total)
    return state, kept


def _measure_first_step(model: CausalLM, state: PromptState, ids: Tensor, kept: KeptGraphs) -> None:
    """Step 0 with autograd under the graph meter: its per-layer bytes price every step's graph; plan the splits;
    keep step 0's graph if the plan keeps it whole; enable the state's gradient sinks if anything is kept."""
    s, e = state.steps()[0]
    n = len(model.layers)
    per_layer = [0] * n
    prefix = state.step_prefix(0, grad=False)  # no positions before step 0: nothing to collect a gradient into
    with torch.enable_grad(), graph_meter(model, prefix, per_layer) as seen:
        _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False)
    add_pieces(pieces, seen, per_layer)
    state.write_step(0, pieces)
    t0 = e - s
    kept.measured_tokens = t0
    kept.layer_bytes_per_token = [b / t0 for b in per_layer]
    # the hidden between layers has the embedding's dtype (autocast leaves the residual stream in it)
    kept.boundary_bytes_per_token = float(model.spec.hidden_size * model.model.embed_tokens.weight.element_size())
    lengths = [b - a for a, b in state.steps()]
    # processes sharing the state (context parallelism) plan alike: from the largest measurement and piece of each
    # step over them (a rank's graph is then at most what the plan counts) and the smallest budget
    agreed = model.placement.agree_max(kept.layer_bytes_per_token + [float(x) for x in lengths] + [-kept.budget])
    kept.layer_bytes_per_token, lengths = agreed[:n], [int(x) for x in agreed[n:-1]]
    kept.budget = int(-agreed[-1])
    plan = plan_splits(lengths, kept.layer_bytes_per_token, kept.boundary_bytes_per_token, kept.budget)
    if 0 in plan and plan[0][0] != 0:
        del plan[0]  # step 0 is kept whole or not at all (its graph is the measurement run's)
    kept.planned = plan
    if 0 in plan:
        kept.steps[0] = KeptStep(0, 0, list(pieces), None, plan[0][1])
    if plan:
        state.enable_grad(offload=kept.offload_grad)
        kept.grad_enabled = True


def _kept_step(model: CausalLM, state: PromptState, ids: Tensor, i: int, kept: KeptGraphs) -> None:
    """Step ``i`` of a prefill with kept graphs: under ``no_grad`` if the plan keeps none of it, else its layers
    ``>= split`` with autograd (prefixes that collect their gradient), the graph kept."""
    s, e = state.steps()[i]
    split = kept.planned[i][0] if i in kept.planned else None
    if split is None:
        prefix = state.step_prefix(i, grad=False)
        _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False)
        state.write_step(i, pieces)
        return
    grad_prefix = state.step_prefix(i, grad=True)
    if split > 0:
        plain = state.step_prefix(i, grad=False)
        grad_prefix = plain[:split] + grad_prefix[split:]
    with torch.enable_grad(), keep_saved():
        if split == 0:
            _, pieces = model.run(ids[None, s:e], s, grad_prefix, need_hidden=False)
            boundary = None
        else:
            _, pieces, boundary = model.run(ids[None, s:e], s, grad_prefix, need_hidden=False,
                                            grad_from_layer=split)
    state.write_step(i, pieces)  # under no_grad: the state stores detached values
    kept.steps[i] = KeptStep(i, split, list(pieces[split:]), boundary, kept.planned[i][1])
