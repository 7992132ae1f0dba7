"""Depthwise causal conv1d with carried state: fast vs reference vs F.conv1d vs transformers, values and gradients."""

import pytest
import torch
import torch.nn.functional as F

from longstraw.ops.conv import causal_conv1d, causal_conv1d_reference

D64 = torch.float64
TOL = dict(rtol=1e-13, atol=1e-13)


def make(B=2, T=11, C=5, K=4, *, bias=True, state=True, seed=0, dtype=D64):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, T, C, generator=gen, dtype=D64)
    w = torch.randn(C, K, generator=gen, dtype=D64)
    b = torch.randn(C, generator=gen, dtype=D64) if bias else None
    s = torch.randn(B, C, K - 1, generator=gen, dtype=D64) if state else None
    return [None if t is None else t.to(dtype).requires_grad_() for t in (x, w, b, s)]


def conv1d_padded(x, w, b, s, activation):
    """Independent formula: F.conv1d over the state-prefixed sequence, no padding, channels first."""
    B, T, C = x.shape
    K = w.shape[-1]
    s = x.new_zeros(B, C, K - 1) if s is None else s
    xs = torch.cat([s, x.transpose(1, 2)], dim=2)
    y = F.conv1d(xs, w.reshape(C, 1, K), b, groups=C).transpose(1, 2)
    return F.silu(y) if activation == "silu" else y


def grads(y, fs, inputs, seed=1):
    gen = torch.Generator().manual_seed(seed)
    dy = torch.randn(y.shape, generator=gen, dtype=y.dtype)
    ds = torch.randn(fs.shape, generator=gen, dtype=fs.dtype)
    live = [t for t in inputs if t is not None]
    return torch.autograd.grad((y * dy).sum() + (fs * ds).sum(), live)


@pytest.mark.parametrize("K", [1, 2, 4])
@pytest.mark.parametrize("T", [1, 2, 5, 17])
@pytest.mark.parametrize("bias,state", [(False, False), (True, True), (False, True)])
@pytest.mark.parametrize("activation", ["silu", None])
def test_matches_reference_and_conv1d(K, T, bias, state, activation):
    x, w, b, s = make(T=T, K=K, bias=bias, state=state, seed=K * 100 + T)
    y, fs = causal_conv1d(x, w, b, initial_state=s, activation=activation)
    ry, rfs = causal_conv1d_reference(x, w, b, initial_state=s, activation=activation)
    assert y.shape == x.shape and fs.shape == (2, 5, K - 1) and y.is_contiguous() and fs.is_contiguous()
    torch.testing.assert_close(y, ry, **TOL)
    torch.testing.assert_close(fs, rfs, rtol=0, atol=0)
    torch.testing.assert_close(y, conv1d_padded(x, w, b, s, activation), **TOL)
    for a, c in zip(grads(y, fs, [x, w, b, s]), grads(ry, rfs, [x, w, b, s])):
        torch.testing.assert_close(a, c, **TOL)


def test_final_state_is_last_inputs_and_mixes_for_short_T():
    x, w, _, s = make(T=2, K=4)  # T < K-1: the state keeps the last old input and both new ones
    _, fs = causal_conv1d(x, w, initial_state=s)
    torch.testing.assert_close(fs, torch.cat([s[:, :, -1:], x.transpose(1, 2)], dim=2), rtol=0, atol=0)
    x, w, _, s = make(T=9, K=4)
    _, fs = causal_conv1d(x, w, initial_state=s)
    torch.testing.assert_close(fs, x[:, -3:].transpose(1, 2), rtol=0, atol=0)
    _, fs = causal_conv1d(x, w)  # zeros when None
    y0, _ = causal_conv1d(x, w, initial_state=torch.zeros(2, 5, 3, dtype=D64))
    torch.testing.assert_close(causal_conv1d(x, w)[0], y0, rtol=0, atol=0)


@pytest.mark.parametrize("pieces", [[20], [1, 19], [2, 1, 1, 16], [7, 13], [1] * 20])
def test_composition_across_pieces(pieces):
    x, w, b, s = make(T=20, K=4, seed=3)
    y, fs = causal_conv1d(x, w, b, initial_state=s)
    ys, state, t0 = [], s, 0
    for n in pieces:
        yi, state = causal_conv1d(x[:, t0 : t0 + n], w, b, initial_state=state)
        ys.append(yi)
        t0 += n
    py = torch.cat(ys, dim=1)
    torch.testing.assert_close(py, y, **TOL)
    torch.testing.assert_close(state, fs, rtol=0, atol=0)
    for a, c in zip(grads(py, state, [x, w, b, s]), grads(y, fs, [x, w, b, s])):
        torch.testing.assert_close(a, c, **TOL)


def test_hf_weight_layout_and_bad_arguments():
    x, w, b, s = make()
    y, fs = causal_conv1d(x, w, b, initial_state=s)
    y3, fs3 = causal_conv1d(x, w.unsqueeze(1), b, initial_state=s)  # nn.Conv1d weight [C, 1, K]
    torch.testing.assert_close(y, y3, rtol=0, atol=0)
    with pytest.raises(ValueError, match=r"'silu'.*'gelu'"):
        causal_conv1d(x, w, activation="gelu")
    with pytest.raises(ValueError, match=r"'relu'"):
        causal_conv1d_reference(x, w, activation="relu")
    with pytest.raises(ValueError, match="initial_state"):
        causal_conv1d(x, w, initial_state=s[:, :, :2])
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d(x, w[:3])


def test_bf16_runs():
    x, w, b, s = make(dtype=torch.bfloat16)
    y, fs = causal_conv1d(x, w, b, initial_state=s)
    assert y.dtype == fs.dtype == torch.bfloat16
    ry, _ = causal_conv1d(*[t.detach().double() for t in (x, w, b)], initial_state=s.detach().double())
    torch.testing.assert_close(y.double(), ry, rtol=2e-2, atol=2e-2)
    (y.float().sum() + fs.float().sum()).backward()


hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def test_matches_transformers_prefill_and_decode():
    """transformers: causal_conv1d_fn over [B, C, T] for prefill; causal_conv1d_update with a K-token state."""
    x, w, b, _ = make(T=9, K=4, bias=False)
    fn = getattr(hf.causal_conv1d_fn, "__wrapped__", hf.causal_conv1d_fn)
    upd = getattr(hf.causal_conv1d_update, "__wrapped__", hf.causal_conv1d_update)
    x, w = x.detach(), w.detach()
    y, fs = causal_conv1d(x, w)
    hy = fn(x.transpose(1, 2), w, None, activation="silu").transpose(1, 2)
    torch.testing.assert_close(y, hy, **TOL)
    # one decode step: HF keeps K tokens (the oldest column is never read); ours keeps K-1
    x1 = torch.randn(2, 1, 5, dtype=D64)
    hf_state = F.pad(fs, (1, 0))
    hy1 = upd(x1.transpose(1, 2), hf_state, w, None, "silu").transpose(1, 2)
    y1, fs1 = causal_conv1d(x1, w, initial_state=fs)
    torch.testing.assert_close(y1, hy1, **TOL)
    torch.testing.assert_close(fs1, hf_state[..., 1:], rtol=0, atol=0)  # HF updated its state in place
