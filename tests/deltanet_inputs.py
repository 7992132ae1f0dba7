"""Random delta-rule inputs and gradient helpers shared by the torch rule's tests (tests/ops/test_deltanet.py) and
fla's under Triton's interpreter (tests/ops/test_fla_rule.py)."""

import torch
import torch.nn.functional as F

D64 = torch.float64


def make_inputs(B=2, T=37, Hk=2, H=2, Dk=8, Dv=6, *, dtype=D64, l2norm=True, h0=True, decay=2.0, seed=0,
                channels=False):
    """Random inputs in the regime of the real model; with l2norm off, k is pre-normalised (|k| < 1 keeps the
    delta rule contractive, as the in-kernel l2norm does). ``channels``: a log decay per key channel (KDA's
    ``g [B, T, H, Dk]``) instead of one per head."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, T, Hk, Dk, generator=gen, dtype=D64)
    k = torch.randn(B, T, Hk, Dk, generator=gen, dtype=D64)
    if not l2norm:
        q = q / Dk**0.5
        k = 0.9 * F.normalize(k, dim=-1)
    v = torch.randn(B, T, H, Dv, generator=gen, dtype=D64)
    g = -decay * torch.rand(B, T, H, *((Dk,) if channels else ()), generator=gen, dtype=D64)
    beta = torch.rand(B, T, H, generator=gen, dtype=D64)
    s0 = torch.randn(B, H, Dk, Dv, generator=gen, dtype=D64) if h0 else None
    xs = [q, k, v, g, beta] + ([s0] if h0 else [])
    return [x.to(dtype).requires_grad_() for x in xs]


def run(fn, inputs, **kw):
    q, k, v, g, beta, *s0 = inputs
    return fn(q, k, v, g, beta, initial_state=s0[0] if s0 else None, **kw)


def grads(o, s, inputs, seed=1, draw_dtype=None):
    """Gradients of a random linear functional of (output, final state) with respect to every input; the
    functional's weights are drawn in ``draw_dtype`` (default: o's and s's own), then cast (the same functional for
    calls in different dtypes: draw in float64)."""
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=draw_dtype or o.dtype).to(o.dtype)
    ds = torch.randn(s.shape, generator=gen, dtype=draw_dtype or s.dtype).to(s.dtype)
    return torch.autograd.grad((o * do).sum() + (s * ds).sum(), inputs)


def assert_all_close(got, want, **tol):
    for i, (a, b) in enumerate(zip(got, want)):
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"tensor {i}: {m}")


class HalfGradient(torch.autograd.Function):
    """Identity forward, half the gradient backward: a miscompiled kernel's wrong gradient, for fla's check to see."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * 0.5
