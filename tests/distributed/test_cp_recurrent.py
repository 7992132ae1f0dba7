"""The DeltaNet state scan's in-process parts (``distributed/cp_recurrent.py``): the conv window composed from the
pieces' tails, the fold of the pieces' transfers, and the scan prefix run as a one-rank group, which must equal the
plain mixer exactly, forward and backward. The multi-rank scan is held against one process in test_cp.py."""

import pytest
import torch

from longstraw.distributed import cp_recurrent
from longstraw.models.deltanet import GatedDeltaNet, RecurrentPrefix
from longstraw.ops.deltanet import transfer_inputs

H = 24
D64 = torch.float64


def _mixer(seed=0):
    torch.manual_seed(seed)
    m = GatedDeltaNet(H, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
        m.A_log.copy_(torch.empty_like(m.A_log).uniform_(0.01, 0.2).log())  # slow decays: the state matters
    return m.to(D64)


@pytest.mark.parametrize("lengths", [(5, 7, 4), (1, 1, 1, 6), (2, 1, 9), (1, 2)])
@pytest.mark.parametrize("with_prev", [False, True])
def test_window_is_the_last_inputs_before_each_piece(lengths, with_prev):
    """``_window`` after the pieces ``< r`` equals the last ``K - 1`` rows of the whole sequence so far (the step's
    initial window, zeros without one, then every piece's rows), for pieces shorter than the window too."""
    w, c = 3, 5
    gen = torch.Generator().manual_seed(3)
    prev = torch.randn(1, c, w, generator=gen, dtype=D64) if with_prev else None
    pieces = [torch.randn(n, c, generator=gen, dtype=D64) for n in lengths]
    tails = torch.stack([torch.cat([p.new_zeros(max(0, w - len(p)), c), p[-w:]]) for p in pieces])
    for upto in range(len(lengths) + 1):
        seq = torch.cat([prev[0].T if prev is not None else torch.zeros(w, c, dtype=D64), *pieces[:upto]])
        got = cp_recurrent._window(prev, tails, lengths, upto, D64)
        torch.testing.assert_close(got, seq[-w:].T[None], rtol=0, atol=0)


def test_fold_composes_transfers_in_rank_order():
    """Folding the pieces' transfer states equals running the rule through the pieces one after the other."""
    from longstraw.ops.deltanet import chunk_gated_delta_rule

    gen = torch.Generator().manual_seed(5)
    hv, dk, dv, lengths = 2, 4, 3, (3, 6, 2)
    s0 = torch.randn(1, hv, dk, dv, generator=gen, dtype=D64)
    state, fulls = s0, []
    for n in lengths:
        q, k = (torch.randn(1, n, hv, dk, generator=gen, dtype=D64) for _ in range(2))
        v = torch.randn(1, n, hv, dv, generator=gen, dtype=D64)
        g = -torch.rand(1, n, hv, generator=gen, dtype=D64)
        beta = torch.rand(1, n, hv, generator=gen, dtype=D64)
        _, state = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=state, chunk_size=4)
        v2, init = transfer_inputs(v, dk)
        fulls.append(chunk_gated_delta_rule(q, k, v2, g, beta, initial_state=init, chunk_size=4)[1][0])
    gS = torch.stack(fulls)
    torch.testing.assert_close(cp_recurrent._fold(s0, gS, len(lengths))[None], state, rtol=1e-12, atol=1e-12)
    assert cp_recurrent._fold(None, gS, 0) is None


@pytest.mark.parametrize("with_state", [False, True])
@pytest.mark.parametrize("t", [2, 9])
def test_one_rank_scan_equals_the_plain_mixer(with_state, t):
    """The scan prefix of a one-rank group (``rehearsal_prefix(ranks=1)``: its own piece is the whole step) gives
    the plain prefix's output, final state and every gradient, the initial state's included (float64)."""
    m = _mixer()
    gen = torch.Generator().manual_seed(7)
    x = torch.randn(1, t, H, generator=gen, dtype=D64, requires_grad=True)
    conv = torch.randn(1, m.conv_dim, 3, generator=gen, dtype=D64, requires_grad=True) if with_state else None
    S = torch.randn(1, 4, 8, 6, generator=gen, dtype=D64, requires_grad=True) if with_state else None
    plain = RecurrentPrefix(conv, S) if with_state else None
    dy, dc, ds = (torch.randn(shape, generator=gen, dtype=D64) for shape in ((1, t, H), (1, m.conv_dim, 3),
                                                                             (1, 4, 8, 6)))
    results = []
    for prefix in (plain, cp_recurrent.rehearsal_prefix(plain, 1, t)):
        y, (c1, s1) = m(x, None, prefix)
        inputs = [x, *m.parameters()] + ([conv, S] if with_state else [])
        grads = torch.autograd.grad((y * dy).sum() + (c1 * dc).sum() + (s1 * ds).sum(), inputs)
        results.append((y.detach(), c1.detach(), s1.detach(), grads))
    for a, b in zip(results[0][:3], results[1][:3]):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12)
    if with_state:  # (the initial state reaches the output: the check sees the scan's correction)
        y_zero = m(x, None, None)[0]
        assert (y_zero - results[0][0]).abs().max() > 1e-3 * results[0][0].abs().max()
    for i, (a, b) in enumerate(zip(results[0][3], results[1][3])):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12, msg=lambda s: f"gradient {i}: {s}")


def test_rehearsal_runs_the_last_ranks_shapes():
    """A rehearsal of 4 ranks runs forward and backward in one process with the real step's shapes (values are
    not the group's: every 'rank' is this piece)."""
    m = _mixer()
    x = torch.randn(1, 5, H, dtype=D64, requires_grad=True)
    y, (c1, s1) = m(x, None, cp_recurrent.rehearsal_prefix(None, 4, 5))
    assert y.shape == (1, 5, H) and c1.shape == (1, m.conv_dim, 3) and s1.shape == (1, 4, 8, 6)
    (y.sum() + s1.sum() + c1.sum()).backward()
    assert x.grad is not None and torch.isfinite(x.grad).all()


def test_seeded_states_do_not_recompute_checkpointed_layers_early():
    """Under ``checkpoint_layers`` the reverse pass seeds every DeltaNet layer's state after the step at once; the
    scan's fold must not run before the layer's output gradient has come down (``_Tie``), or the first saved tensor
    it unpacks recomputes its layer at the start of the backward, every layer at once (found by the planner: the
    27B hybrid's one-layer reverse-pass graph grew with the group size). Each layer is recomputed right before its
    own backward, from the top down."""
    from torch.utils.checkpoint import checkpoint

    ms = [_mixer(seed) for seed in range(3)]
    events = []
    for i, m in enumerate(ms):
        m.register_forward_pre_hook(lambda mod, args, i=i: events.append(("run", i)))
    x = torch.randn(1, 5, H, dtype=D64, requires_grad=True)
    h, pieces = x, []
    for i, m in enumerate(ms):
        h.register_hook(lambda g, i=i: events.append(("grad", i)))
        h, piece = checkpoint(m, h, None, cp_recurrent.rehearsal_prefix(None, 3, 5), use_reentrant=False)
        pieces.append(piece)
    events.clear()
    roots = [h] + [t for piece in pieces for t in piece]
    torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    assert events == [("run", 2), ("grad", 2), ("run", 1), ("grad", 1), ("run", 0), ("grad", 0)], events


def test_one_layer_and_step_costs_two_gathers_forward_and_two_exchanges_backward():
    """Per DeltaNet layer and step a rank joins two all-gathers (conv tails ``[R, K-1, C]``, transfers ``[R, Hv, Dk,
    Dv + Dk]``) and, in the backward, their two all-to-alls, in that order: the traffic docs/DISTRIBUTED.md states."""
    m = _mixer()
    calls = []

    from longstraw.distributed.rehearsal import RehearsalComm

    class Counting(RehearsalComm):
        def all_gather(self, t):
            calls.append(("all_gather", tuple(t.shape)))
            return super().all_gather(t)

        def all_to_all(self, t):
            calls.append(("all_to_all", tuple(t.shape)))
            return super().all_to_all(t)

    prefix = cp_recurrent.rehearsal_prefix(None, 3, 5)
    prefix.owner.comm = Counting(3, 2)
    x = torch.randn(1, 5, H, dtype=D64, requires_grad=True)
    y, (c, s) = m(x, None, prefix)
    torch.autograd.backward([y, c, s], [torch.ones_like(y), torch.ones_like(c), torch.ones_like(s)])
    C = m.conv_dim
    assert calls == [("all_gather", (3, C)), ("all_gather", (4, 8, 14)),
                     ("all_to_all", (3, 4, 8, 14)), ("all_to_all", (3, 3, C))], calls
