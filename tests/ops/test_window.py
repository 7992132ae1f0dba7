"""Sliding-window attention: the tiling plan covers exactly the window's mask, and the op equals the masked
reference (outputs, LSE, gradients, sinks, shared prefixes, blocks, host segments) for both CPU kernels."""

import pytest
import torch

from longstraw.ops.attention import KVSegment, segment_attention, segment_attention_reference
from longstraw.ops.window import window_matters, window_tiles


def _plan_mask(lengths, t, window):
    """The ``[t, lp + t]`` visibility the tiles imply, with every query in exactly one tile."""
    starts = [0]
    for n in lengths:
        starts.append(starts[-1] + n)
    total = starts[-1] + t
    seen = torch.zeros(t, total, dtype=torch.int64)
    owner = torch.zeros(t, dtype=torch.int64)
    for tile in window_tiles(lengths, t, window):
        owner[tile.q_start : tile.q_end] += 1
        m = tile.q_end - tile.q_start
        for p in tile.parts:
            lo = starts[p.segment] + p.start if p.segment < len(lengths) else starts[-1] + p.start
            n = p.end - p.start
            for r in range(m):
                for j in range(n):
                    ok = {"full": True, "causal": j <= r, "band": j >= r}[p.kind]
                    if p.kind != "full":
                        assert n == m, "masked parts are square"
                    seen[tile.q_start + r, lo + j] += int(ok)
    assert torch.equal(owner, torch.ones(t, dtype=torch.int64))
    return seen


@pytest.mark.parametrize("lengths,t,window", [
    ([], 1, 2), ([], 9, 2), ([], 20, 7), ([5], 20, 7), ([30], 3, 8), ([30], 1, 8), ([3, 4, 5], 17, 6),
    ([2], 40, 40), ([2], 40, 41), ([100], 50, 50), ([1, 1, 1, 1], 5, 3), ([13, 7], 1, 9), ([64], 64, 17),
])
def test_tiles_cover_exactly_the_window(lengths, t, window):
    seen = _plan_mask(lengths, t, window)
    lp = sum(lengths)
    q = torch.arange(lp, lp + t)[:, None]
    k = torch.arange(lp + t)[None, :]
    want = ((k <= q) & (k > q - window)).long()
    assert torch.equal(seen, want), "every visible key counted once, no other"


def test_tiles_refuse_a_window_of_one_and_say_when_the_window_matters():
    with pytest.raises(ValueError, match=r"sliding window=1: windows of at least 2"):
        window_tiles([4], 3, 1)
    assert not window_matters(10, 6, 16) and window_matters(10, 7, 16) and not window_matters(10, 7, None)


def _rand(*shape, dtype=torch.float64, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


CASES = [
    # B, Hq, Hkv, T, prefix lengths, prefix batch (1 = shared), window
    (1, 4, 2, 23, [], 1, 5),  # own segment only, T > window
    (2, 4, 2, 13, [37], 1, 9),  # shared prefix longer than the window
    (3, 6, 2, 19, [11, 6], 1, 8),  # bands at segment boundaries
    (2, 4, 4, 1, [30, 4], 2, 12),  # decoding: one query, per-sequence segments
    (2, 2, 1, 40, [3], 1, 31),  # a leading tile of queries that see position 0
    (1, 4, 1, 16, [50], 1, 2),  # the smallest window
]


@pytest.mark.parametrize("backend", ["flash_cpu", "math"])
@pytest.mark.parametrize("case", CASES)
def test_windowed_matches_masked_reference(backend, case):
    torch.manual_seed(0)
    b, hq, hkv, t, prefixes, pb, window = case
    d = 8
    q = _rand(b, hq, t, d)
    segs = [KVSegment(_rand(pb, hkv, p, d), _rand(pb, hkv, p, d)) for p in prefixes]
    segs.append(KVSegment(_rand(b, hkv, t, d), _rand(b, hkv, t, d), causal=True))
    out, lse = segment_attention(q, segs, 0.3, backend=backend, return_lse=True, max_segment=4, window=window)
    ref, ref_lse = segment_attention_reference(q, segs, 0.3, return_lse=True, window=window)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    do = torch.randn_like(out)
    inputs = [q] + [x for s in segs for x in (s.k, s.v)]
    for g, w in zip(torch.autograd.grad(out, inputs, do), torch.autograd.grad(ref, inputs, do)):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def test_window_wider_than_every_sequence_is_plain_attention():
    torch.manual_seed(2)
    q = _rand(1, 2, 6, 8)
    segs = [KVSegment(_rand(1, 2, 10, 8), _rand(1, 2, 10, 8)), KVSegment(_rand(1, 2, 6, 8), _rand(1, 2, 6, 8), True)]
    torch.testing.assert_close(segment_attention(q, segs, 0.5, window=16), segment_attention(q, segs, 0.5),
                               rtol=0, atol=0)


@pytest.mark.parametrize("host", [False, True])
def test_windowed_sinks_receive_only_the_keys_in_the_window(host):
    """A shared prefix with gradient sinks (the exact mode's prompt state; ``host``: offloaded, blocks staged):
    keys before every query's window get no gradient; the others get the reference's."""
    torch.manual_seed(1)
    b, hq, hkv, t, p, d, window = 3, 4, 2, 6, 25, 8, 7
    k, v = torch.randn(1, hkv, p, d, dtype=torch.float64), torch.randn(1, hkv, p, d, dtype=torch.float64)
    kg, vg = torch.ones_like(k), torch.ones_like(v)
    q = _rand(b, hq, t, d)
    own = KVSegment(_rand(b, hkv, t, d), _rand(b, hkv, t, d), causal=True)
    out = segment_attention(q, [KVSegment(k, v, k_grad=kg, v_grad=vg, host=host), own], d**-0.5, window=window,
                            max_segment=3)
    do = torch.randn_like(out)
    out.backward(do)
    kr, vr = k.clone().requires_grad_(), v.clone().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    ref = segment_attention_reference(q2, [KVSegment(kr, vr), own], d**-0.5, window=window)
    ref.backward(do)
    torch.testing.assert_close(kg, 1 + kr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(vg, 1 + vr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(q.grad, q2.grad, rtol=0, atol=1e-12)
    first = p + 0 - window + 1  # the first key any query sees
    assert torch.equal(kg[:, :, :first], torch.ones_like(kg[:, :, :first]))


def test_windowed_float32_close_to_reference():
    torch.manual_seed(3)
    q = torch.randn(2, 4, 33, 16)
    segs = [KVSegment(torch.randn(1, 2, 70, 16), torch.randn(1, 2, 70, 16)),
            KVSegment(torch.randn(2, 2, 33, 16), torch.randn(2, 2, 33, 16), causal=True)]
    out = segment_attention(q, segs, 0.25, window=20)
    ref = segment_attention_reference(q, segs, 0.25, window=20)
    torch.testing.assert_close(out, ref, rtol=0, atol=2e-6)


def test_windowed_call_needs_its_own_causal_segment_last():
    q = torch.randn(1, 2, 4, 8)
    prefix = KVSegment(torch.randn(1, 2, 30, 8), torch.randn(1, 2, 30, 8))
    with pytest.raises(ValueError, match="own causal segment last"):
        segment_attention(q, [prefix], 0.5, window=8)
