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


def prompt_backward(model: CausalLM, state: PromptState, *, checkpoint_layers: bool = False) -> None:
    if isinstance(state, distributed.ShardedPromptState):  # split over a context-parallel group
        return distributed.cp_prompt_backward(model, state, checkpoint_layers=checkpoint_layers)
    ids = state.token_ids
    for s, e in reversed(state.chunks):
        prefix = state.prefix(s, grad=True)
        with torch.enable_grad():
            _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False, checkpoint_layers=checkpoint_layers)
            roots, grads = [], []
            for ls, piece in zip(state.layers, pieces):
                for root, grad in ls.backward_roots(piece, s, e):
                    if root.requires_grad and grad is not None:
                        roots.append(root)
                        grads.append(grad)
            if roots:
                torch.autograd.backward(roots, grads)
        del pieces, roots, grads, prefix
