"""``ops/host_memory.py``: the per-block copies of a prompt state in host memory, and the attention over such
segments (``KVSegment(host=True)``) against the same segments read in place, block by block."""

import pytest
import torch

from longstraw.ops import host_memory
from longstraw.ops.attention import KVSegment, segment_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


@pytest.mark.parametrize("hkv,n", [(3, 5), (1, 5), (3, 9), (2, 0)])
def test_stage_copies_a_view_into_one_contiguous_tensor(hkv, n):
    state = torch.randn(1, hkv, 9, 4, dtype=torch.float64)
    view = state[:, :, 2:2 + n] if n < 9 else state
    out = host_memory.stage(view, torch.device("cpu"))
    assert out.is_contiguous() and torch.equal(out, view) and (n == 0 or out.data_ptr() != view.data_ptr())
    assert host_memory._slabs(view) == (0 if hkv == 1 or n in (0, 9) else 2)


def test_stage_on_meta_allocates_what_the_planner_counts():
    view = torch.empty(1, 2, 16, 8, device="meta")[:, :, :5]
    out = host_memory.stage(view, torch.device("meta"))
    assert out.device.type == "meta" and out.shape == (1, 2, 5, 8) and out.is_contiguous()
    assert host_memory.to_host(view).device.type == "meta"
    assert host_memory.offloads(view) and not host_memory.offloads(torch.zeros(1))


def test_to_host_copies():
    t = torch.randn(2, 3)
    h = host_memory.to_host(t)
    assert torch.equal(h, t) and h.data_ptr() != t.data_ptr()


@pytest.mark.parametrize("sinks", [False, True])
def test_host_segments_attend_as_segments_in_place(sinks):
    """A long prefix in host memory, split in blocks of ``max_segment`` keys, each copied in: the outputs and the
    gradients of q, the own segment and the prefix sinks equal the in-place run (float64)."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 23, 6, generator=g, dtype=torch.float64) for _ in range(2))
    results = []
    for host in (False, True):
        q = torch.randn(2, 4, 3, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                        requires_grad=True)
        own_k, own_v = (torch.randn(2, 2, 3, 6, generator=torch.Generator().manual_seed(s), dtype=torch.float64,
                                    requires_grad=True) for s in (2, 3))
        kg, vg = (torch.zeros_like(k), torch.zeros_like(v)) if sinks else (None, None)
        prefix = KVSegment(k[:, :, :19], v[:, :, :19], k_grad=None if kg is None else kg[:, :, :19],
                           v_grad=None if vg is None else vg[:, :, :19], host=host)
        out = segment_attention(q, [prefix, KVSegment(own_k, own_v, causal=True)], 0.4, max_segment=5)
        out.pow(2).sum().backward()
        results.append([out.detach(), q.grad, own_k.grad, own_v.grad] + ([kg, vg] if sinks else []))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)
