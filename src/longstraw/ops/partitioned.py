"""The one interface through which a prompt state split over processes plugs into the ops.

A :class:`PartitionedSegment` stands for stored keys (attention K/V, MLA latents, DSA indexer keys) of which this
process holds only a share, the rest living on the other processes of a group (context parallelism,
:mod:`longstraw.distributed`). The ops that read stored keys hand the whole call to such a segment when one is
present, because only it knows how the shares are combined (which collectives, in which order):

=================================  ====================================  ================================
op                                 hands over to                         segment kinds that implement it
=================================  ====================================  ================================
``ops.attention.segment_attention``  :meth:`PartitionedSegment.attention`  K/V shares, MLA latent shares
``models.mla`` (decompressed form)  :meth:`~PartitionedSegment.decompressed_attention`  MLA latent shares
``ops.sparse_attention.sparse_latent_attention``  :meth:`~PartitionedSegment.sparse_attention`  MLA latent shares
``models.dsa.Indexer.select``      :meth:`~PartitionedSegment.index_select`  DSA indexer-key shares
=================================  ====================================  ================================

and every segment, partitioned or not, answers :attr:`key_count`: how many keys its queries see, the same number
on every process (DSA layers decide between dense and sparse attention from it, and all processes of a group must
take the same path), and a segment that MLA attends answers :meth:`~PartitionedSegment.group_shape`: the call as
the whole group makes it, from which every process picks the same MLA form. A layer of the Gated DeltaNet kind has
an O(1) recurrent state instead of stored keys; its prefix (``models.deltanet.RecurrentPrefix``) has the equivalent
typed hooks, ``enter`` and ``leave``.

Every method is a collective: all processes of the group call it in the same order with the same shapes. The
models and ops never import the distributed code; they only test ``isinstance(segment, PartitionedSegment)``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

__all__ = ["PartitionedSegment"]


class PartitionedSegment(ABC):
    """Stored keys partitioned over a group of processes (see the module docstring). Subclasses implement the
    methods of the ops that can meet them; the others raise ``TypeError``."""

    @property
    @abstractmethod
    def key_count(self) -> int:
        """Keys the queries of this call see in this segment, counted alike on every process of the group."""

    def attention(self, q, segments, scale: float, *, backend: str | None = None, return_lse: bool = False,
                  max_segment: int = 32768, window: int | None = None, sinks=None):
        """``segment_attention(q, segments, ...)`` where ``self`` is one of ``segments`` (same result; ``window``
        and ``sinks`` as there)."""
        raise TypeError(f"{type(self).__name__} does not take part in dense attention")

    def group_shape(self, tokens: int) -> tuple[int, int]:
        """``(query positions, stored keys)`` of the whole group's call that this process's call of ``tokens``
        query positions is part of, the same on every process (the MLA form is chosen from it)."""
        raise TypeError(f"{type(self).__name__} does not take part in dense attention")

    def decompressed_attention(self, q, w_uk, w_uv, k_own, v_own, lat, segments, scale: float, backend: str,
                               chunk: int):
        """MLA's decompressed attention (``models.mla.MLAttention.attend_decompressed``) where ``self`` holds the
        stored latents: ``q [B, H, T, dn + dr]``, the queries' own expanded ``k_own, v_own`` and latents ``lat``,
        the other (local) latent ``segments``; stored latents expanded ``chunk`` positions at a time."""
        raise TypeError(f"{type(self).__name__} holds no MLA latents")

    def sparse_attention(self, q, segments, sel, scale: float):
        """``sparse_latent_attention(q, segments, sel, scale)`` where ``self`` is ``segments[0]``."""
        raise TypeError(f"{type(self).__name__} does not take part in sparse latent attention")

    def index_select(self, indexer, x, q_resid, ctx, prefix_keys: list, own_keys):
        """``Indexer.select(x, q_resid, ctx, prefix_keys, own_keys)`` where ``self`` is ``prefix_keys[0]``."""
        raise TypeError(f"{type(self).__name__} holds no indexer keys")
