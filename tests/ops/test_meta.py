"""The dry-run seam's replicated step pieces (``ops/meta.py``: ``layout`` and ``replicate``)."""

import gc

import torch

from longstraw.ops import meta
from longstraw.planner import LiveBytes


def test_replicated_pieces_keep_storages_views_and_aliasing_and_free_at_once():
    """A replica has the recorded dtypes, shapes, strides and offsets, one fresh storage of the recorded bytes per
    storage (two views of one storage stay two views of one), the same nest (tuples, lists, None); its storages are
    freed as soon as the replica is dropped, without the garbage collector (no reference cycle keeps them)."""
    base = torch.empty(4, 6, 8, device="meta")
    k, v = base[:, :3].transpose(0, 1), base[:, 3:]  # two views of one storage, one at an offset
    conv = torch.empty(2, 5, dtype=torch.bfloat16, device="meta")
    pieces = [(k, v), None, [conv.t()]]
    spec = meta.layout(pieces)
    gc.disable()
    try:
        with LiveBytes() as lb:
            rep = meta.replicate(spec)
            assert lb.live == base.untyped_storage().nbytes() + conv.untyped_storage().nbytes()
            (rk, rv), none, [rc] = rep
            assert none is None and type(rep) is list and type(rep[2]) is list
            for a, b in ((rk, k), (rv, v), (rc, conv.t())):
                assert (a.dtype, a.shape, a.stride(), a.storage_offset()) == \
                       (b.dtype, b.shape, b.stride(), b.storage_offset())
                assert a.untyped_storage().nbytes() == b.untyped_storage().nbytes()
            assert rk.untyped_storage()._cdata == rv.untyped_storage()._cdata
            assert rk.untyped_storage()._cdata != rc.untyped_storage()._cdata
            del rep, rk, rv, rc, a, b
            assert lb.live == 0
    finally:
        gc.enable()


def test_layout_declines_what_it_cannot_replicate():
    """Nothing to replicate (the step then runs): a tensor off meta, one that requires grad, anything but tuples,
    lists, None and tensors."""
    m = torch.empty(3, device="meta")
    assert meta.layout((m, None)) is not None
    assert meta.layout((m, torch.zeros(3))) is None
    assert meta.layout((m, torch.empty(3, device="meta", requires_grad=True))) is None
    assert meta.layout({"k": m}) is None
    assert meta.layout((m, 3)) is None
