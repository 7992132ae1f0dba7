"""Chunked float32 log-probabilities (and entropies) of target tokens under the LM head.

``logp[n] = z[n, y[n]] - logsumexp(z[n])`` with ``z = (h @ W^T + b) / temperature`` in float32, computed ``chunk``
tokens at a time so that the ``N x vocab`` float32 logits never exist at once (at a 150K vocabulary, 4K response
tokens would be 2.4 GB). Backward recomputes each chunk's logits from the saved hidden states and the saved
log-normaliser, so the autograd graph holds only ``h``, ``y`` and ``lse`` (``O(N)``), never ``N x vocab``.

Gradients, per chunk (``p = softmax(z)``)::

    d logp / d z = onehot(y) - p
    d entropy / d z = p * (E_p[z] - z)          (entropy = lse - sum p z)

Logits are formed in the weights' dtype (as HF computes ``lm_head(h)``) and cast to float32 before the softmax;
bf16 log-probs drift by nats, float32 ones do not. Float64 inputs stay float64.

``token_logprobs_reference`` materialises all logits: the obviously-correct version the tests compare against.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["token_logprobs", "token_logprobs_reference"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _chunk_logits(h, weight, bias, temperature):
    z = torch.nn.functional.linear(h, weight, bias).to(_acc_dtype(h.dtype))
    return z / temperature if temperature != 1.0 else z


class _TokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, chunk, with_entropy):
        n = hidden.shape[0]
        acc = _acc_dtype(hidden.dtype)
        logp = torch.empty(n, dtype=acc, device=hidden.device)
        lse = torch.empty(n, dtype=acc, device=hidden.device)
        ent = torch.empty(n, dtype=acc, device=hidden.device) if with_entropy else None
        for i in range(0, n, chunk):
            z = _chunk_logits(hidden[i : i + chunk], weight, bias, temperature)
            l = torch.logsumexp(z, dim=-1)
            lse[i : i + chunk] = l
            logp[i : i + chunk] = z.gather(1, targets[i : i + chunk, None])[:, 0] - l
            if with_entropy:
                p = torch.exp(z - l[:, None])
                ent[i : i + chunk] = l - (p * z).sum(-1)
        ctx.save_for_backward(hidden, weight, bias if bias is not None else torch.empty(0), targets, lse)
        ctx.has_bias, ctx.temperature, ctx.chunk = bias is not None, temperature, chunk
        if with_entropy:
            return logp, ent
        return logp, torch.empty(0, dtype=acc, device=hidden.device)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse = ctx.saved_tensors
        bias = bias if ctx.has_bias else None
        with_ent = g_ent is not None and g_ent.numel() > 0
        dh = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # the LM head's gradient sums over every token: accumulated in float32 for low-precision weights (each
        # chunk's product in the weights' dtype, the running sum in float32), cast once at the end
        gdt = _acc_dtype(weight.dtype)
        dw = torch.zeros(weight.shape, dtype=gdt, device=weight.device) if ctx.needs_input_grad[1] else None
        db = (torch.zeros(bias.shape, dtype=gdt, device=bias.device)
              if bias is not None and ctx.needs_input_grad[2] else None)
        for i in range(0, hidden.shape[0], ctx.chunk):
            h = hidden[i : i + ctx.chunk]
            z = _chunk_logits(h, weight, bias, ctx.temperature)
            p = torch.exp(z - lse[i : i + ctx.chunk, None])
            dz = -p * g_logp[i : i + ctx.chunk, None]
            dz.scatter_add_(1, targets[i : i + ctx.chunk, None], g_logp[i : i + ctx.chunk, None])
            if with_ent:
                ez = (p * z).sum(-1, keepdim=True)
                dz += g_ent[i : i + ctx.chunk, None] * p * (ez - z)
            if ctx.temperature != 1.0:
                dz = dz / ctx.temperature
            dz = dz.to(weight.dtype)
            if dh is not None:
                dh[i : i + ctx.chunk] = dz @ weight
            if dw is not None:
                if dw.dtype == dz.dtype:
                    dw.addmm_(dz.t(), h)
                else:
                    dw += dz.t() @ h
            if db is not None:
                db += dz.sum(0, dtype=gdt)
        if dw is not None:
            dw = dw.to(weight.dtype)
        if db is not None:
            db = db.to(bias.dtype)
        return dh, dw, db, None, None, None, None


def token_logprobs(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    bias: Tensor | None = None,
    temperature: float = 1.0,
    chunk_size: int = 1024,
    with_entropy: bool = False,
) -> tuple[Tensor, Tensor | None]:
    """Log-probabilities of ``targets`` (and optionally the entropy of each predictive distribution).

    hidden: ``[N, H]`` final hidden states (after the final norm); weight: ``[V, H]`` LM head; targets: ``[N]``.
    Returns ``(logp [N], entropy [N] or None)`` in float32 (float64 for float64 inputs), differentiable w.r.t.
    hidden, weight and bias.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    logp, ent = _TokenLogprobs.apply(hidden, weight, bias, targets, float(temperature), int(chunk_size), with_entropy)
    return logp, (ent if with_entropy else None)


def token_logprobs_reference(hidden, weight, targets, *, bias=None, temperature=1.0, with_entropy=False):
    """All logits at once, then ``log_softmax``: the slow, obviously-correct version."""
    z = torch.nn.functional.linear(hidden, weight, bias).to(_acc_dtype(hidden.dtype)) / temperature
    logsm = torch.log_softmax(z, dim=-1)
    logp = logsm.gather(1, targets[:, None])[:, 0]
    ent = -(logsm.exp() * logsm).sum(-1) if with_entropy else None
    return logp, ent
