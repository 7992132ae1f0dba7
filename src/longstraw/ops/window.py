"""Sliding-window attention as tiles of the three masks the attention kernels have: none, causal, reversed causal.

A sliding window of ``W`` lets the query at position ``p`` see the keys ``p - W < k <= p`` (transformers'
``sliding_window_overlay``: ``kv_idx > q_idx - sliding_window`` on top of the causal mask). The attention op
(:func:`longstraw.ops.attention.segment_attention`) attends key *segments* in position order: the stored prefix
segments, then the queries' own keys (causal). This module only plans: which query rows meet which key ranges under
which mask, as index arithmetic with no tensors, so that the op can run each tile with the kernels it already has.

For ``m <= W - 1`` queries at positions ``p0 .. p0 + m - 1`` (``p0 >= W``), the keys before ``p0`` fall in three
ranges (``b0 = p0 - W + 1``, the first key the first query sees):

* ``[.., b0)``: seen by no query (skipped: the window's saving);
* ``[b0, b0 + m)``, the *band*: query ``t`` sees band key ``j`` iff ``j >= t``, a square mask that is the causal one
  with queries and keys both reversed (the op flips them, runs the causal kernel and flips back; band key ``m - 1``
  is seen by every query, so no row is empty);
* ``[b0 + m, p0)``: seen by every query (no mask);

and the tile's own keys ``p0 .. p0 + m - 1`` are causal. Queries whose window reaches position 0 (``p < W``) see
every earlier key: they form one leading tile of plain causal attention. A band never straddles two segments: a
tile is shortened so that its band ends at the next segment boundary (each range is then a view of one segment).

Cost: every query attends at most ``W`` keys, in ``ceil(T / (W - 1))`` tiles (plus one per segment boundary a band
would cross). ``W = 1`` (every token sees only itself) has no such tiling and is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["Part", "Tile", "window_tiles", "window_matters"]

FULL, CAUSAL, BAND = "full", "causal", "band"


@dataclass(frozen=True)
class Part:
    """Keys ``[start, end)`` of segment ``segment`` (an index into the prefix segments; ``len(prefix)`` is the
    queries' own keys), attended under mask ``kind``: ``"full"`` (none), ``"causal"`` (the tile's own keys, square)
    or ``"band"`` (square, query ``t`` sees key ``j`` iff ``j >= t``)."""

    kind: str
    segment: int
    start: int
    end: int


@dataclass(frozen=True)
class Tile:
    """Queries ``[q_start, q_end)`` of the call (indices into its own tokens) and the key parts they attend."""

    q_start: int
    q_end: int
    parts: tuple[Part, ...]


def window_matters(prefix_len: int, t: int, window: int | None) -> bool:
    """Whether some of ``t`` queries following ``prefix_len`` keys would miss a key under ``window`` (else the
    window changes nothing: plain causal attention over everything)."""
    return window is not None and prefix_len + t > window


def window_tiles(lengths: list[int], t: int, window: int) -> list[Tile]:
    """The tiles of ``t`` queries that follow prefix segments of ``lengths`` keys (in position order, contiguous)
    under a sliding ``window`` (see the module docstring). Every query belongs to exactly one tile; each tile's
    parts cover exactly the keys its queries may see."""
    if isinstance(window, bool) or not isinstance(window, int) or window < 2:
        raise ValueError(f"sliding window={window!r}: windows of at least 2 positions are supported")
    if t < 1 or any(n < 1 for n in lengths):
        raise ValueError(f"window_tiles needs t >= 1 queries and non-empty segments, got t={t}, lengths={lengths}")
    own = len(lengths)
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    lp = starts[-1]
    bounds = starts + [lp + t]  # segment s holds positions [bounds[s], bounds[s + 1]); the own keys are the last

    def parts(kind: str, x: int, y: int) -> list[Part]:
        out = []
        for s in range(own + 1):
            a, b = max(x, bounds[s]), min(y, bounds[s + 1])
            if a < b:
                out.append(Part(kind, s, a - bounds[s], b - bounds[s]))
        return out

    tiles = []
    n0 = min(t, max(0, window - lp))  # queries at positions < window see every earlier key
    if n0:
        tiles.append(Tile(0, n0, tuple(parts(FULL, 0, lp) + [Part(CAUSAL, own, 0, n0)])))
    a = n0
    while a < t:
        p0 = lp + a
        b0 = p0 - window + 1  # >= 1: p0 >= window here
        m = min(window - 1, t - a)
        nxt = min(x for x in bounds if x > b0)  # the band stays inside one segment
        m = min(m, nxt - b0)
        band = parts(BAND if m > 1 else FULL, b0, b0 + m)  # one key seen by one query needs no mask
        assert len(band) == 1
        tiles.append(Tile(a, a + m, tuple(band + parts(FULL, b0 + m, p0) + [Part(CAUSAL, own, a, a + m)])))
        a += m
    return tiles
