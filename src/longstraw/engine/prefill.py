"""Phase 1: the prompt, piece by piece, under ``no_grad``, into a :class:`~longstraw.state.PromptState`.

The state comes from the model's placement (``model.placement.prompt_state``): in one process the prompt is cut into
chunks of ``chunk_size``; split over a context-parallel group it is this process's share (its own schedule). Each
step is one ``model.run`` over the step's tokens with the state of the positions before them as prefix; each layer
then stores its piece. Nothing is differentiated, nothing but the state survives a step: peak memory is the state
plus one step's activations. The last prompt token is NOT prefilled: every branch replays it, so that the log-prob
of the first response token is computed with autograd like the rest.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from longstraw.engine.lockstep import idle_prefill_step
from longstraw.models.transformer import CausalLM
from longstraw.state import PromptState


@torch.no_grad()
def prefill(model: CausalLM, ids: Tensor, chunk_size: int, exact: bool = False, *,
            report: Callable[[int, int], None] | None = None) -> PromptState:
    """ids ``[n]`` (the prompt without its last token) -> the state of those ``n`` positions.

    ``exact``: keep what the exact reverse pass needs. ``report(done, total)`` is called after each step.
    """
    assert ids.dim() == 1
    state = model.placement.prompt_state(model, ids, chunk_size, exact)
    steps = state.steps()
    total = model.placement.lockstep(len(steps))  # processes sharing the layers' collectives run alike
    for i in range(total):
        if i < len(steps):
            s, e = steps[i]
            prefix = state.step_prefix(i, grad=False)
            _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False)
            state.write_step(i, pieces)
            del pieces, prefix
        else:
            idle_prefill_step(model)
        if report is not None:
            report(i + 1, total)
    return state
