"""A CP rank's prompt step rehearsed in one process: what the memory planner's dry run runs for ``cp > 1``.

The planner (``longstraw.planner``) predicts a rank's peak by running the engine's step once, in one process, on
the meta device. Where a layer's CP step allocates differently from one process's chunk (the DeltaNet state scan's
widened rule and gathered transfers, MLA's exchange of the step's pieces and their partials), the dry run runs the
layer's real CP code against :class:`RehearsalComm`, a stand-in group of ``size`` ranks inside one process seen
from rank ``rank``: each collective returns a tensor of the shape, dtype and storage that the real one
(``distributed.context.Comm``) returns (an all-gather's ``[size, ...]`` buffer, an all-to-all's result, a
reduction in place), with none of its values: this rank's data stands in for every other rank's. So the dry run
tracks the buffers a rank allocates in the step without a process group.

Rehearsed today: Gated DeltaNet prompt steps (``cp_recurrent.rehearsal_prefix``) and plain MLA's
(:func:`latent_share`, both forms: ``cp_latent``'s decompressed exchange, ``cp_attention``'s dense one for the
absorbed form). DSA's sparse path is still counted by formula (``cp_latent.dsa_step_bytes``).
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["RehearsalComm", "latent_share"]


class RehearsalComm:
    """A stand-in for a CP group of ``size`` ranks inside one process, as rank ``rank`` (module docstring): the
    methods of ``distributed.context.Comm`` with the allocations of the real collectives and not their values."""

    group = None

    def __init__(self, size: int, rank: int):
        if not 0 <= rank < size:
            raise ValueError(f"rank={rank} is not within a group of size={size}")
        self.size, self.rank = size, rank

    def all_gather(self, t: Tensor) -> Tensor:
        """``[size, ...]``: this rank's ``t`` repeated (one new buffer, as the gather's output)."""
        return t.contiguous()[None].repeat(self.size, *([1] * t.dim()))

    def all_to_all(self, t: Tensor) -> Tensor:
        """A new buffer of ``t``'s shape (its contents: this rank's blocks)."""
        return t.contiguous().clone()

    def all_reduce(self, t: Tensor) -> Tensor:
        return t  # in place

    def all_reduce_max(self, t: Tensor) -> Tensor:
        return t.contiguous()  # in place when contiguous, else into a contiguous copy

    def reduce(self, t: Tensor, dst: int) -> Tensor:
        return t.contiguous()

    def broadcast(self, t: Tensor, src: int = 0) -> Tensor:
        return t  # in place

    def shift(self, ts: list[Tensor]) -> list[Tensor]:
        """New buffers shaped as ``ts`` (the neighbour's pieces)."""
        return [t.contiguous().clone() for t in ts]


def latent_share(state, layout, ranks: int, stored: int, piece: int, grad: bool):
    """The prefix an MLA layer (``models.mla``, not DSA's) sees on the last rank of a CP group of ``ranks`` in a
    prompt step of ``piece``-token pieces over ``stored`` prompt positions: that rank's share (under ``layout``, a
    ``cp_state.ShardLayout``) of one process's ``state`` (a ``models.mla.LatentState``: views of its latents and,
    with ``grad``, its gradient sink), made by ``cp_latent.ShardedLatentState`` as a run's rank makes it, over a
    :class:`RehearsalComm`. Runs the layer's CP attention in the form the group picks, its step exchange included
    (also with nothing stored yet)."""
    from longstraw.distributed.cp_attention import StepPieces
    from longstraw.distributed.cp_latent import ShardedLatentState

    last = ranks - 1  # the rank with the most earlier pieces in a step
    sharded = ShardedLatentState(state, layout, RehearsalComm(ranks, last))
    return [sharded._segment(layout.local_len(last, stored), stored, grad, StepPieces((piece,) * ranks, last))]
