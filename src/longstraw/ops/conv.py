"""Depthwise causal conv1d with explicit state (the short conv of Gated DeltaNet): pure functions.

``y[b, t, c] = act(bias[c] + sum_{i=0}^{K-1} weight[c, i] * xs[b, t + i, c])`` where ``xs = cat(state, x)`` along
time and ``state`` holds the ``K-1`` inputs before ``x``; the LAST tap ``weight[:, K-1]`` multiplies the current
token (PyTorch's cross-correlation convention, the same as ``nn.Conv1d(..., groups=C, padding=K-1)`` cropped to the
first T outputs, which is what transformers' Qwen3-Next does over the concatenated q, k, v projections).

Shapes: ``x [B, T, C]`` (channels last, as the projections come out), ``weight [C, K]`` or HF's ``nn.Conv1d``
weight ``[C, 1, K]``, ``bias [C]`` or None, ``initial_state [B, C, K-1]`` (zeros when None) and
``final_state [B, C, K-1]`` = the last ``K-1`` inputs of ``cat(state, x)``: for ``T < K-1`` it mixes old state and
new inputs. The final state is a fresh tensor (not a view of ``x``), so keeping it keeps nothing else alive.

State convention: we keep ``K-1`` tokens, exactly what the next call needs. transformers' cache keeps ``K``
(``conv_kernel_size``) tokens per layer (its decode path concatenates state and the new token and drops the oldest);
to convert, HF state ``[B, C, K]`` -> ours is ``hf[..., 1:]``; ours -> HF is ``F.pad(ours, (1, 0))`` (the dropped
oldest column is never read).

``activation``: "silu" (Qwen3-Next's ``hidden_act``) or None. Output dtype is x's; compute happens in
``promote_types(x.dtype, weight.dtype)``. ``causal_conv1d_reference`` is the obviously-correct per-step version.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["causal_conv1d", "causal_conv1d_reference", "ACTIVATIONS"]

ACTIVATIONS = ("silu", None)


def _prepare(x: Tensor, weight: Tensor, bias: Tensor | None, initial_state: Tensor | None, activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}; got {activation!r}")
    if x.dim() != 3:
        raise ValueError(f"x must be [B, T, C]; got shape {tuple(x.shape)}")
    B, T, C = x.shape
    if weight.dim() == 3:
        if weight.shape[1] != 1:
            raise ValueError(f"a 3-d weight must be depthwise [C, 1, K]; got {tuple(weight.shape)}")
        weight = weight[:, 0]
    if weight.dim() != 2 or weight.shape[0] != C:
        raise ValueError(f"weight must be [C, K] or [C, 1, K] with C = {C}; got {tuple(weight.shape)}")
    K = weight.shape[1]
    if K < 1:
        raise ValueError(f"kernel size must be >= 1; got weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (C,):
        raise ValueError(f"bias must be [C] = [{C}]; got {tuple(bias.shape)}")
    if initial_state is None:
        initial_state = x.new_zeros(B, C, K - 1)
    elif initial_state.shape != (B, C, K - 1):
        raise ValueError(f"initial_state must be [B, C, K-1] = {(B, C, K - 1)}; got {tuple(initial_state.shape)}")
    cdt = torch.promote_types(x.dtype, weight.dtype)
    # xs: [B, K-1+T, C], the state followed by the new inputs
    xs = torch.cat([initial_state.to(x.dtype).transpose(1, 2), x], dim=1)
    return xs, weight, cdt, K


def _finish(y: Tensor, xs: Tensor, K: int, bias: Tensor | None, activation, out_dtype):
    if bias is not None:
        y = y + bias.to(y.dtype)
    if activation == "silu":
        y = F.silu(y)
    final_state = xs[:, xs.shape[1] - (K - 1) :].transpose(1, 2).contiguous()
    return y.to(out_dtype), final_state


def causal_conv1d(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """Depthwise causal conv over time with carried state. Returns ``(y [B, T, C], final_state [B, C, K-1])``."""
    xs, w, cdt, K = _prepare(x, weight, bias, initial_state, activation)
    T = x.shape[1]
    # the K taps as K shifted multiply-adds over channels-last data: memory bound, no layout change, any K
    xc, wc = xs.to(cdt), w.to(cdt)
    y = xc[:, 0:T] * wc[:, 0]
    for i in range(1, K):
        y = torch.addcmul(y, xc[:, i : i + T], wc[:, i])
    return _finish(y, xs, K, bias, activation, x.dtype)


def causal_conv1d_reference(
    x: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    initial_state: Tensor | None = None,
    activation: str | None = "silu",
) -> tuple[Tensor, Tensor]:
    """Slow, obviously correct: for every step, the window of the last K inputs dotted with the kernel."""
    xs, w, cdt, K = _prepare(x, weight, bias, initial_state, activation)
    T = x.shape[1]
    wc = w.to(cdt)
    ys = [(xs[:, t : t + K].to(cdt) * wc.t()).sum(dim=1) for t in range(T)]  # window [B, K, C] * [K, C]
    y = torch.stack(ys, dim=1) if ys else xs.new_zeros(x.shape[0], 0, x.shape[2], dtype=cdt)
    return _finish(y, xs, K, bias, activation, x.dtype)
