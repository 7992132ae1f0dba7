"""Sparse attention over selected latents (DSA's attention step): the op against its dense-mask reference, and
its partials (the kernel the context-parallel op shares) merging to the same result."""

import pytest
import torch

import longstraw.ops.sparse_attention as sa
from longstraw.ops.attention import KVSegment
from longstraw.ops.sparse_attention import (Selection, latent_grad_targets, merge_partials, partial_backward,
                                            partial_forward, sparse_latent_attention,
                                            sparse_latent_attention_reference)

F64 = torch.float64


def _selection(b, t, s_pre, k, g):
    """Random top-k-shaped selection: for each query up to k distinct causal keys, the rest invalid."""
    idx = torch.zeros(b, t, k, dtype=torch.long)
    valid = torch.zeros(b, t, k, dtype=torch.bool)
    for i in range(b):
        for j in range(t):
            n = s_pre + j + 1
            pick = torch.randperm(n, generator=g)[:k]
            idx[i, j, : pick.numel()] = pick
            valid[i, j, : pick.numel()] = True
    return Selection(idx, valid)


@pytest.mark.parametrize("block_elems", [1 << 24, 300])  # all queries in one block / one query per block
def test_sparse_attention_matches_the_gather_reference(block_elems, monkeypatch):
    monkeypatch.setattr(sa, "GATHER_ELEMS", block_elems)
    g = torch.Generator().manual_seed(3)
    b, h, t, d, k = 2, 3, 5, 7, 9
    prompt = torch.randn(1, 1, 4, d, generator=g, dtype=F64)  # shared prompt latents, gradient into a sink
    gen = torch.randn(b, 1, 3, d, generator=g, dtype=F64, requires_grad=True)  # per-branch latents, autograd
    own = torch.randn(b, 1, t, d, generator=g, dtype=F64, requires_grad=True)
    q = torch.randn(b, h, t, d, generator=g, dtype=F64, requires_grad=True)
    sel = _selection(b, t, 7, k, g)  # query 0 sees 8 keys < k = 9: one invalid slot
    sink = torch.zeros_like(prompt)
    w = torch.randn(b, h, t, d, generator=g, dtype=F64)
    segs = [KVSegment(prompt, prompt, k_grad=sink, v_grad=sink), KVSegment(gen, gen), KVSegment(own, own)]
    out = sparse_latent_attention(q, segs, sel, 0.37)
    (out * w).sum().backward()
    got = (q.grad.clone(), gen.grad.clone(), own.grad.clone(), sink.clone())
    q.grad = gen.grad = own.grad = None

    leaf = prompt.clone().requires_grad_(True)
    ref = sparse_latent_attention_reference(q, [KVSegment(leaf, leaf), KVSegment(gen, gen), KVSegment(own, own)],
                                            sel, 0.37)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-13)
    (ref * w).sum().backward()
    for a, want in zip(got, (q.grad, gen.grad, own.grad, leaf.grad)):
        torch.testing.assert_close(a, want, rtol=0, atol=1e-12)
    assert (~sel.valid).any() and sel.valid.any()


def test_partials_over_disjoint_keys_merge_to_the_whole():
    """Split the selected keys between two partials (as two processes owning halves of the prompt would): their
    log-sum-exp merge is the one-partial result, and their backward against the merged output and LSE adds up to
    the whole backward (dq, and d lat into each half's target)."""
    g = torch.Generator().manual_seed(5)
    b, h, t, d, k = 1, 2, 6, 5, 7
    lat = torch.randn(1, 1, 16, d, generator=g, dtype=F64)
    qt = torch.randn(b, t, h, d, generator=g, dtype=F64)
    dt = torch.randn(b, t, h, d, generator=g, dtype=F64)
    sel = _selection(b, t, 10, k, g)
    o, lse = partial_forward(qt, (lat,), (0,), sel.idx, sel.valid, 0.5, F64)
    lo = sel.valid & (sel.idx < 8)
    hi = sel.valid & (sel.idx >= 8)
    o1, l1 = partial_forward(qt, (lat,), (0,), sel.idx, lo, 0.5, F64)
    o2, l2 = partial_forward(qt, (lat,), (0,), sel.idx, hi, 0.5, F64)
    om, lm = merge_partials([o1, o2], [l1, l2])
    torch.testing.assert_close(om, o, rtol=0, atol=1e-13)
    torch.testing.assert_close(lm, lse, rtol=0, atol=1e-13)
    whole = torch.zeros_like(lat)
    dq = partial_backward(qt, dt, o, lse, (lat,), (0,), sel.idx, sel.valid, 0.5, [whole.view(-1, d)])
    parts = torch.zeros_like(lat)
    dq1 = partial_backward(qt, dt, o, lse, (lat,), (0,), sel.idx, lo, 0.5, [parts.view(-1, d)])
    dq2 = partial_backward(qt, dt, o, lse, (lat,), (0,), sel.idx, hi, 0.5, [parts.view(-1, d)])
    torch.testing.assert_close(dq1 + dq2, dq, rtol=0, atol=1e-12)
    torch.testing.assert_close(parts, whole, rtol=0, atol=1e-12)
    grads, targets = latent_grad_targets((lat, lat), (None, whole), (True, False), F64)
    assert grads[0] is not None and targets[1].data_ptr() == whole.data_ptr() and grads[1] is None
