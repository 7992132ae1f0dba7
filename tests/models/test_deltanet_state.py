"""The Gated DeltaNet mixer's prompt state: chunk boundaries, gradient leaves, the exact reverse pass through the
recurrent and conv state, decoding over an expanded prompt state, bytes."""

import pytest
import torch

from longstraw.models.deltanet import GatedDeltaNet, RecurrentPrefix, RecurrentState

H = 24


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def mixer(layout="qwen3_5", dtype=torch.float64, seed=0):
    torch.manual_seed(seed)
    m = GatedDeltaNet(H, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=6, conv_kernel=4, layout=layout)
    with torch.no_grad():
        for p in m.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    return m.to(dtype)


def prefill(m, x, chunk, exact):
    st = m.new_state(x.shape[1], exact)
    with torch.no_grad():
        for s in range(0, x.shape[1], chunk):
            e = min(x.shape[1], s + chunk)
            _, piece = m(x[:, s:e], None, st.prefix(s, False))
            st.write(piece, s, e)
    return st


def test_empty_prefix_means_zero_state():
    m = mixer()
    st = m.new_state(10, exact=True)
    assert st.prefix(0, False) is None and st.prefix(0, True) is None
    x = torch.randn(1, 9, H, dtype=torch.float64)
    zeros = RecurrentPrefix(torch.zeros(1, m.conv_dim, 3, dtype=torch.float64),
                            torch.zeros(1, 4, 8, 6, dtype=torch.float64))
    torch.testing.assert_close(m(x, None, None)[0], m(x, None, zeros)[0], rtol=0, atol=0)
    # a prefix without a state (one that exists for its enter/leave hooks) starts from zeros too
    torch.testing.assert_close(m(x, None, None)[0], m(x, None, RecurrentPrefix(None, None))[0], rtol=0, atol=0)


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("chunk", [1, 3, 7, 64])
def test_chunked_equals_full_and_boundaries_are_kept(layout, chunk):
    m = mixer(layout)
    x = torch.randn(1, 40, H, dtype=torch.float64)
    with torch.no_grad():
        full, (conv, S) = m(x, None, None)
    st = prefill(m, x, chunk, exact=True)
    torch.testing.assert_close(st.S, S, rtol=0, atol=1e-12)
    torch.testing.assert_close(st.conv, conv, rtol=0, atol=1e-13)
    ends = sorted(st.boundaries)
    assert ends == [min(40, e) for e in range(chunk, 40 + chunk, chunk)]
    for s in ends[:-1]:  # the state at a boundary continues exactly like the full sequence
        with torch.no_grad():
            y, _ = m(x[:, s:], None, st.prefix(s, False))
        torch.testing.assert_close(y, full[:, s:], rtol=0, atol=1e-12)
    assert st.nbytes() == len(ends) * m.state_bytes(torch.float64)
    detached = prefill(m, x, chunk, exact=False)
    assert detached.nbytes() == m.state_bytes(torch.float64) and not detached.boundaries
    if len(ends) > 1:
        with pytest.raises(ValueError, match="needs a prompt state built with exact=True"):
            detached.prefix(ends[0], False)


def test_bytes_formula_and_dtypes_bf16():
    m = mixer(dtype=torch.bfloat16)
    st = prefill(m, torch.randn(1, 20, H, dtype=torch.bfloat16), 8, exact=True)
    assert st.conv.dtype == torch.bfloat16 and st.S.dtype == torch.float32  # recurrent matrix in fp32
    per_state = m.conv_dim * 3 * 2 + 4 * 8 * 6 * 4
    assert m.state_bytes(torch.bfloat16) == per_state and st.nbytes() == 3 * per_state
    st.enable_grad()
    leaves = st.prefix(20, True)
    assert leaves.conv.dtype == torch.float32 and leaves.S.dtype == torch.float32  # gradients accumulate in fp32
    assert st.grad_nbytes() == 2 * m.conv_dim * 3 * 4 + 4 * 8 * 6 * 4  # conv leaf copy + its grad, S grad


def test_gradient_leaves_collect_from_every_consumer():
    m = mixer()
    x = torch.randn(1, 12, H, dtype=torch.float64)
    st = prefill(m, x, 5, exact=True)
    st.enable_grad()
    a = st.prefix(12, True)
    assert a.S.requires_grad and a.S.is_leaf and st.prefix(12, True).S is a.S  # one set of leaves per position
    y1 = torch.randn(2, 3, H, dtype=torch.float64)
    (m(y1, None, a)[0].sum() + m(y1[:1], None, a)[0].sum()).backward()  # batch 2 (expanded) and batch 1
    g = a.S.grad.clone()
    conv_root, s_root = torch.randn_like(st.conv, requires_grad=True), torch.randn_like(st.S, requires_grad=True)
    roots = st.backward_roots((conv_root, s_root), 10, 12)
    assert [r for r, _ in roots] == [conv_root, s_root] and torch.equal(roots[1][1], g)
    assert st.backward_roots((conv_root, s_root), 10, 12) == []  # consumed: the leaves were dropped
    st.release_grad()
    assert st.prefix(12, True).S.requires_grad is False


@pytest.mark.parametrize("layout", ["qwen3_5", "qwen3_next"])
@pytest.mark.parametrize("p,chunk", [(37, 8), (16, 8), (5, 8), (3, 1)])
def test_exact_reverse_pass_equals_full_backward(layout, p, chunk):
    """Prefill chunks without autograd, a branch with autograd on the final state, then the reverse pass over the
    chunks (as engine.prompt_backward does): gradients equal one backward through the whole sequence."""
    m = mixer(layout, seed=1)
    x = torch.randn(1, p + 6, H, dtype=torch.float64)
    w = torch.randn(1, 6, H, dtype=torch.float64)
    xg = x.clone().requires_grad_()
    (m(xg, None, None)[0][:, p:] * w).sum().backward()
    want = {n: q.grad.clone() for n, q in m.named_parameters()}
    want_x = xg.grad
    m.zero_grad()

    st = prefill(m, x[:, :p], chunk, exact=True)
    st.enable_grad()
    (m(x[:, p:], None, st.prefix(p, True))[0] * w).sum().backward()
    x_grad = torch.zeros_like(x)
    for s in reversed(range(0, p, chunk)):
        e = min(p, s + chunk)
        xs = x[:, s:e].clone().requires_grad_()
        _, piece = m(xs, None, st.prefix(s, True))
        roots = st.backward_roots(piece, s, e)
        torch.autograd.backward([r for r, _ in roots], [g for _, g in roots])
        x_grad[:, s:e] = xs.grad
    for n, q in m.named_parameters():
        torch.testing.assert_close(q.grad, want[n], rtol=1e-10, atol=1e-12, msg=n)
    torch.testing.assert_close(x_grad[:, :p], want_x[:, :p], rtol=1e-10, atol=1e-12)
    assert st.grad_nbytes() == (2 if p > chunk else 1) * m.state_bytes(torch.float64)


def test_decoder_reads_the_prompt_state_in_place_and_steps_like_the_full_forward():
    m = mixer(seed=2)
    x = torch.randn(1, 30, H, dtype=torch.float64)
    st = prefill(m, x[:, :20], 8, exact=False)
    dec = st.decoder(3, 10)
    p0 = dec.prefix(0)
    assert p0.S.shape[0] == 3 and p0.S.stride(0) == 0 and p0.S.data_ptr() == st.S.data_ptr()  # expanded, no copy
    rows = torch.cat([x[:, 20:], torch.randn(2, 10, H, dtype=torch.float64)])  # branch 0 continues x
    outs = []
    with torch.no_grad():
        for step in range(10):
            y, piece = m(rows[:, step : step + 1], None, dec.prefix(step))
            dec.append(piece, step)
            outs.append(y)
            if step == 4:
                dec.select(torch.tensor([0, 2]))
                rows = rows[[0, 2]]
                outs = [o[[0, 2]] for o in outs]
        full = m(x, None, None)[0][:, 20:]
    torch.testing.assert_close(torch.cat(outs, 1)[:1], full, rtol=0, atol=1e-12)
    empty = m.new_state(0).decoder(2, 4)
    assert empty.prefix(0) is None


def test_bad_mixer_arguments():
    with pytest.raises(ValueError, match="linear_num_value_heads=5 must be a multiple of linear_num_key_heads=2"):
        GatedDeltaNet(H, num_k_heads=2, num_v_heads=5, head_k_dim=8, head_v_dim=8)
    with pytest.raises(ValueError, match=r"hidden_act='gelu' is not supported for the DeltaNet conv"):
        GatedDeltaNet(H, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, activation="gelu")
    with pytest.raises(ValueError, match="unknown DeltaNet projection layout 'mamba'"):
        GatedDeltaNet(H, num_k_heads=2, num_v_heads=4, head_k_dim=8, head_v_dim=8, layout="mamba")


def test_state_type_is_declared():
    assert GatedDeltaNet.state_type is RecurrentState
