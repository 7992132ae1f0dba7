"""Top-k with a deterministic answer for exact ties.

``torch.topk`` returns the ``k`` largest values exactly, but which of several EQUAL values it returns depends on the
kernel and on the shape it was given (how a caller blocked its rows). DeepSeek Sparse Attention's indexer meets such
ties often: with few index heads every head's ReLU can be 0 for many keys, which then all score exactly 0. A
selection that depended on the blocking would make results depend on ``prefill_chunk``; :func:`first_topk` breaks
exact ties by the lower index (the earlier position, when the last axis is in position order), whatever the shapes.

Cost: two ``topk`` passes and a cumulative sum over the last axis (``O(C)`` per row, no sort, no host sync; it runs
on the meta device, so the memory planner can trace it).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["first_topk", "first_topk_reference"]


def first_topk(vals: Tensor, k: int) -> Tensor:
    """Indices ``[..., k]`` (ascending) of the ``k`` largest of ``vals [..., C]``, exact ties taken lowest index
    first. ``k <= C``. ``-inf`` entries are ties like any other (a caller masks them afterwards)."""
    c = vals.shape[-1]
    assert 0 < k <= c, (k, c)
    kth = vals.topk(k, dim=-1).values[..., -1:]  # the k-th largest value is exact
    above = vals > kth
    tie = vals == kth
    keep = above | (tie & (tie.cumsum(-1) <= k - above.sum(-1, keepdim=True)))  # exactly k per row
    rank = torch.arange(c, 0, -1, device=vals.device)  # C .. 1: unique, larger for a lower index
    return torch.where(keep, rank, 0).topk(k, dim=-1).indices  # the kept ones, by ascending index


def first_topk_reference(vals: Tensor, k: int) -> Tensor:
    """Slow reference: a stable descending sort (equal values keep their index order), the first ``k``, sorted."""
    order = torch.sort(vals, dim=-1, descending=True, stable=True).indices[..., :k]
    return order.sort(dim=-1).values
