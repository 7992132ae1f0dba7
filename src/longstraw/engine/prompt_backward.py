"""Phase 3 (exact mode): carry the gradient collected on the prompt state back through the prompt.

After the branches, each layer's state holds ``dL/dstate`` for every prompt position (attention: the K/V gradient
buffers, filled in place by the branches' attention backward; recurrent layers: the gradient of the final state).
Walking the prefill chunks from last to first, chunk ``[s, e)`` is recomputed WITH autograd from the stored state
of ``[0, s)`` (itself a prefix whose gradient is collected, not differentiated), and back-propagated with the
collected gradient of the chunk's own state. This adds the chunk's parameter gradients and the gradient that the
chunk's tokens send to the state of earlier positions, which is complete by the time the walk reaches them.

Cost: one more forward and one backward of the prompt (about three prefill-equivalents); memory: one chunk's graph
on top of the state and its gradient. Independent of G.
"""

from __future__ import annotations

import torch

from longstraw import distributed
from longstraw.models.transformer import CausalLM
from longstraw.state import PromptState


def prompt_backward(model: CausalLM, state: PromptState, *, checkpoint_layers: bool = False,
                    peak_chunks_only: bool = False) -> None:
    """Back-propagate the state's collected gradient through the prompt (see module docstring).

    ``peak_chunks_only``: for the memory planner's dry run, walk only the chunks whose memory can differ from the
    rest: the last two (the longest prefixes; the last chunk may be short) and the first (no prefix: fresh zero
    states); every other chunk repeats the second-to-last with a shorter prefix. The first chunk may then run
    beside a recurrent boundary's gradient that the skipped chunks would have consumed (a slight over-estimate,
    never under). Gradients are incomplete: never for training.
    """
    if isinstance(state, distributed.ShardedPromptState):  # split over a context-parallel group
        return distributed.cp_prompt_backward(model, state, checkpoint_layers=checkpoint_layers)
    ids = state.token_ids
    chunks = state.chunks
    if peak_chunks_only and len(chunks) > 3:
        chunks = [chunks[0]] + chunks[-2:]
    for s, e in reversed(chunks):
        prefix = state.prefix(s, grad=True)
        with torch.enable_grad():
            _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False, checkpoint_layers=checkpoint_layers)
            roots, grads = _seeds(state, pieces, s, e)
            if roots:
                torch.autograd.backward(roots, grads)
        del pieces, roots, grads, prefix  # nothing of this chunk may outlive its step (the next chunk's peak)


def _seeds(state: PromptState, pieces: list, s: int, e: int) -> tuple[list, list]:
    """The tensors to back-propagate from for chunk ``[s, e)`` and their collected gradients (in a function of its
    own, so that no loop variable keeps a layer's piece alive into the next chunk)."""
    roots, grads = [], []
    for ls, piece in zip(state.layers, pieces):
        for root, grad in ls.backward_roots(piece, s, e):
            if root.requires_grad and grad is not None:
                roots.append(root)
                grads.append(grad)
    return roots, grads
