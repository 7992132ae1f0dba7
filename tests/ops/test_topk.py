"""Top-k with exact ties broken by the lower index: against a stable sort, on every shape and tie pattern."""

import pytest
import torch

from longstraw.ops.topk import first_topk, first_topk_reference


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_first_topk_equals_a_stable_sort(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        c = int(torch.randint(1, 40, (1,), generator=g))
        k = int(torch.randint(1, c + 1, (1,), generator=g))
        v = torch.randint(-2, 3, (3, 5, c), generator=g).to(dtype)  # few distinct values: ties everywhere
        v[v == -2] = float("-inf")
        assert torch.equal(first_topk(v, k), first_topk_reference(v, k)), (v, k)


def test_ties_do_not_depend_on_blocking():
    """The same rows top-k'd whole or split into row blocks give the same indices (torch.topk's choice among
    equal values may not)."""
    v = torch.zeros(64, 300)
    v[:, 7] = 1.0
    whole = first_topk(v, 20)
    assert torch.equal(whole[0], torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19]))
    assert torch.equal(torch.cat([first_topk(v[i : i + 5], 20) for i in range(0, 64, 5)]), whole)


def test_meta_shapes():
    assert first_topk(torch.empty(2, 3, 50, device="meta"), 7).shape == (2, 3, 7)
