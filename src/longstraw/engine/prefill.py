"""Phase 1: the prompt, chunk by chunk, under ``no_grad``, into a :class:`PromptState`.

Each chunk ``[s, e)`` is one ``model.run`` over the new tokens with the state of positions ``[0, s)`` as prefix;
each layer then stores its piece. Nothing is differentiated, nothing but the state survives a chunk: peak memory
is the state plus one chunk's activations. The last prompt token is NOT prefilled: every branch replays it, so that
the log-prob of the first response token is computed with autograd like the rest.
"""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw import distributed
from longstraw.models.transformer import CausalLM
from longstraw.state import PromptState


def chunk_bounds(length: int, chunk_size: int) -> list[tuple[int, int]]:
    return [(s, min(length, s + chunk_size)) for s in range(0, length, chunk_size)]


@torch.no_grad()
def prefill(model: CausalLM, ids: Tensor, chunk_size: int, exact: bool = False) -> PromptState:
    """ids ``[P]`` (the prompt without its last token) -> the state of those ``P`` positions."""
    assert ids.dim() == 1
    if (ctx := distributed.cp_active()) is not None and ids.device.type != "meta":  # each rank keeps its share
        return distributed.cp_prefill(model, ids, chunk_size, exact, ctx)
    n = int(ids.shape[0])
    states = model.new_prompt_states(n, exact)
    chunks = chunk_bounds(n, chunk_size)
    for s, e in chunks:
        prefix = [st.prefix(s, False) for st in states]
        _, pieces = model.run(ids[None, s:e], s, prefix, need_hidden=False)
        for st, piece in zip(states, pieces):
            st.write(piece, s, e)
        del pieces, prefix
    return PromptState(states, ids, chunks)
