"""Gated delta rule (Gated DeltaNet, the linear-attention layer of Qwen3-Next / Qwen3.5): pure functions, explicit state.

Recurrence (per batch row and value head; ``S`` is ``[Dk, Dv]``)::

    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T,    D_t = exp(g_t)
    o_t = S_t^T q_t

The gate ``g_t`` is either one log decay per head (Gated DeltaNet: ``D_t = exp(g_t) I``) or one per key channel
(Kimi Delta Attention, KDA, of Kimi-Linear: ``D_t = diag(exp(g_t))``, ``g: [B, T, H, Dk]``); every function here
takes either, told apart by ``g``'s rank.

equivalently: decay ``S <- exp(g_t) S``, read the old answer ``S^T k_t``, write the correction
``w_t = beta_t (v_t - S^T k_t)`` as ``S <- S + k_t w_t^T``, then read ``o_t = S^T q_t`` (the read sees the token's
own write). ``g`` is the LOG decay (``<= 0``; Qwen3-Next: ``g = -exp(A_log) * softplus(a + dt_bias)``), ``beta`` is
the write strength already in ``(0, 1)`` (Qwen3-Next: ``sigmoid(b)``). With ``use_qk_l2norm`` (what Qwen3-Next
uses) q and k are L2-normalised inside the op, ``x * rsqrt(sum(x^2) + 1e-6)`` as in fla / transformers; then q is
multiplied by ``scale`` (default ``Dk ** -0.5``). Normalisation and scale happen in the compute dtype.

Shapes: ``q, k: [B, T, Hk, Dk]``, ``v: [B, T, H, Dv]``, ``beta: [B, T, H]``, ``g: [B, T, H]`` or (per channel)
``[B, T, H, Dk]``, state ``[B, H, Dk, Dv]``
(key dim first: ``o_t = S^T q_t``, the layout of fla and transformers' cache), output ``[B, T, H, Dv]`` in q's
dtype. ``Hk`` may divide ``H`` (grouped value heads, Qwen3-Next's ``linear_num_key_heads <
linear_num_value_heads``): q/k head ``i`` serves value heads ``i*r .. i*r+r-1`` (``repeat_interleave``, as HF).
Compute dtype: float64 for float64 inputs (so tests can be exact), float32 for everything else (bf16/fp16/fp32);
the state is always returned in the compute dtype, i.e. fp32 for a bf16 model.

Chunked form (the WY / UT-transform representation of DeltaNet, Yang et al. 2024). Split time into chunks of
``C`` tokens; inside a chunk let ``G_t = cumsum(g)_t`` (log decay from the chunk start through token t), ``S0`` the
state entering the chunk, and ``W`` the ``[C, Dv]`` corrections. Unrolling the recurrence inside the chunk gives::

    w_t = beta_t v_t - beta_t e^{G_t} S0^T k_t - sum_{j<t} beta_t e^{G_t - G_j} (k_t . k_j) w_j

a unit lower-triangular system ``(I + A) W = beta*V - (beta*e^G*K) S0`` with ``A_tj = beta_t e^{G_t-G_j} k_t.k_j``
(j < t). One triangular solve per chunk gives ``U = (I+A)^-1 (beta*V)`` and ``Wk = (I+A)^-1 (beta*e^G*K)``, so
``W = U - Wk S0`` (the UT transform). Then, with ``P_tj = e^{G_t-G_j} q_t.k_j`` (j <= t) and ``Kd = e^{G_C-G}*K``::

    O      = e^G*Q S0 + P W            = (e^G*Q - P Wk) S0 + P U
    S_next = e^{G_C} S0 + Kd^T W       = (e^{G_C} I - Kd^T Wk) S0 + Kd^T U  =: M S0 + R

With per-channel gates ``G`` is ``[C, Dk]`` and every ``e^{G}`` factor acts per key channel: ``A_tj = beta_t
sum_d k_td k_jd e^{G_td - G_jd}``, ``P_tj = sum_d q_td k_jd e^{G_td - G_jd}``, ``e^G*K``, ``e^G*Q`` and ``Kd`` channel
by channel, and ``e^{G_C} I`` becomes ``diag(e^{G_C})``. The pairwise decays are explicit inside sub-chunks of 16
(a ``[16, 16, Dk]`` tensor each, exp of non-positive differences, as below: exact and overflow-free for any decay;
the blocks are sized for it), and across sub-chunks one matmul per sub-chunk splits each decay at the sub-chunk's
last token into two such factors (:func:`_channel_scores`).

Everything except the chunk-to-chunk product ``S <- M S + R`` is independent across chunks and computed batched
over a block of chunks; the only Python loop is over chunks (one ``baddbmm`` each), then the states at chunk starts
are stacked and ``O = Qp S0 + P U`` is one batched matmul. All decay factors are ``exp`` of non-positive
differences taken in log space (the upper triangle is masked to ``-inf`` before ``exp``), so nothing overflows for
strong decays. Time is padded to a multiple of ``C`` only inside the last block, with ``g = beta = k = v = 0``
(which leaves the state untouched). Memory per block is bounded (``block_tokens`` tokens at a time).

Gradients are autograd through all of this, with respect to q, k, v, g, beta and initial_state, so a long
sequence can be split into pieces carrying ``final_state -> initial_state`` and differentiated across them. A call
that records a graph keeps only its inputs and the state entering each block, and its backward re-runs one block at
a time with a graph (``_RecomputedBlocks``): what a call holds for its backward is then O(T) inputs plus
``T / block`` states instead of every block's intermediates (plain autograd: ``recompute=False``).

``recurrent_gated_delta_rule`` is the token-by-token reference (slow, obviously correct). ``gated_delta_rule``
dispatches: fla's Triton ``chunk_gated_delta_rule`` (per-channel gates: ``chunk_kda``) for CUDA bf16/fp16 inputs
when fla imports, else the torch chunked form. The fla import is attempted only for CUDA tensors (a CPU machine with
triton installed must never reach fla: it has no CPU path). Deliberately left out: variable-length packing
(``cu_seqlens``), in-kernel gate computation, fp32/fp64 on fla (older fla asserts against fp32).
"""

from __future__ import annotations

import functools
import logging
import os
import threading
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor

from longstraw.ops import meta

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule", "gated_delta_rule", "fla_available", "l2norm",
           "choose_kernel", "delta_rule_kernel", "default_backend", "BACKEND_ENV", "fla_backward_check",
           "fla_backward_errors",
           "needs_grad", "per_channel", "torch_chunk_size", "sub_chunk", "SUB_CHUNK", "transfer_inputs",
           "apply_initial", "compose_transfer", "transfer_output"]

_L2NORM_EPS = 1e-6
_BACKENDS = ("auto", "torch", "fla")
BACKEND_ENV = "LONGSTRAW_DELTA_RULE"  # the chunked rule's backend when a call names none (the models' calls)
_log = logging.getLogger(__name__)


def default_backend() -> str:
    """The backend :func:`gated_delta_rule` and :func:`delta_rule_kernel` take when none is given: the environment
    variable ``LONGSTRAW_DELTA_RULE`` ("auto", "torch" or "fla"; e.g. "torch" to rule fla out where it misbehaves),
    else "auto". ValueError naming the variable for any other value."""
    value = os.environ.get(BACKEND_ENV, "").strip().lower() or "auto"
    if value not in _BACKENDS:
        raise ValueError(f"{BACKEND_ENV}={os.environ[BACKEND_ENV]!r} is not a delta-rule backend; allowed: "
                         f"{', '.join(_BACKENDS)}")
    return value


def l2norm(x: Tensor, eps: float = _L2NORM_EPS) -> Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim (the fla / transformers convention, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _check(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, initial_state: Tensor | None) -> None:
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be [B, T, Hk, Dk]; got q {tuple(q.shape)}, k {tuple(k.shape)}")
    B, T, Hk, Dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (B, T):
        raise ValueError(f"v must be [B, T, H, Dv] with B, T = {B}, {T} from q; got {tuple(v.shape)}")
    H, Dv = v.shape[2], v.shape[3]
    if H % Hk != 0:
        raise ValueError(f"value heads ({H}) must be a multiple of query/key heads ({Hk})")
    if beta.shape != (B, T, H):
        raise ValueError(f"beta must be [B, T, H] = {(B, T, H)}; got {tuple(beta.shape)}")
    if g.shape not in ((B, T, H), (B, T, H, Dk)):
        raise ValueError(f"g must be [B, T, H] = {(B, T, H)} (a decay per head) or [B, T, H, Dk] = {(B, T, H, Dk)} "
                         f"(a decay per key channel); got {tuple(g.shape)}")
    if initial_state is not None and initial_state.shape != (B, H, Dk, Dv):
        raise ValueError(f"initial_state must be [B, H, Dk, Dv] = {(B, H, Dk, Dv)}; got {tuple(initial_state.shape)}")


def torch_chunk_size() -> int:
    """The torch chunked form's default chunk: 64 (fla's), for a decay per head or per key channel alike. Per key
    channel the pairwise decays are explicit only inside sub-chunks of 16 (:func:`sub_chunk`), as fla's
    ``chunk_kda`` does; before 2026-12-07 the whole chunk's ``[C, C, Dk]`` decays were, and the rule ran in chunks
    of 16, its ``Dk x Dk`` state scan four times as often (docs/BENCHMARKS.md)."""
    return 64


def per_channel(g: Tensor, q: Tensor) -> bool:
    """Whether ``g`` holds a decay per key channel (``[B, T, H, Dk]``, KDA) rather than per head (``[B, T, H]``)."""
    return g.dim() == q.dim()


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm, cdt):
    """Cast to the compute dtype, repeat q/k heads to value heads, l2norm, scale, move heads before time.

    Returns q, k ``[B, H, T, Dk]``, v ``[B, H, T, Dv]``, beta ``[B, H, T]``, g ``[B, H, T]`` or ``[B, H, T, Dk]``.
    """
    rep = v.shape[2] // q.shape[2]
    if rep != 1:
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    q, k, v = (x.to(cdt).transpose(1, 2) for x in (q, k, v))
    g, beta = (x.to(cdt).transpose(1, 2) for x in (g, beta))
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    q = q * scale
    return q, k, v, g, beta


def recurrent_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm: bool = True,
) -> tuple[Tensor, Tensor | None]:
    """Token-by-token reference of the gated delta rule (see module docstring for shapes and conventions)."""
    _check(q, k, v, g, beta, initial_state)
    B, T, _, Dk = q.shape
    H, Dv = v.shape[2], v.shape[3]
    out_dtype = q.dtype
    cdt = _compute_dtype(q.dtype)
    scale = Dk**-0.5 if scale is None else scale
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm, cdt)
    if initial_state is None:
        S = torch.zeros(B, H, Dk, Dv, dtype=cdt, device=q.device)
    else:
        S = initial_state.to(cdt)
    outs = []
    for t in range(T):
        decay = g[:, :, t].exp()  # [B, H] or per key channel [B, H, Dk]
        S = S * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        k_t = k[:, :, t]
        old = torch.einsum("bhkv,bhk->bhv", S, k_t)  # what the state answers for k_t
        w = beta[:, :, t, None] * (v[:, :, t] - old)  # the correction to write
        S = S + k_t[..., :, None] * w[..., None, :]
        outs.append(torch.einsum("bhkv,bhk->bhv", S, q[:, :, t]))
    o = torch.stack(outs, dim=1) if outs else torch.zeros(B, 0, H, Dv, dtype=cdt, device=q.device)
    return o.to(out_dtype), (S if output_final_state else None)


SUB_CHUNK = 16  # the per-channel rule's sub-chunk (fla's chunk_kda: 16 within chunks of 64)


def sub_chunk(C: int) -> int:
    """The sub-chunk of a per-channel chunk of ``C`` tokens: :data:`SUB_CHUNK` where it divides ``C``, else ``C``
    itself (pairwise decays over the whole chunk)."""
    return SUB_CHUNK if C > SUB_CHUNK and C % SUB_CHUNK == 0 else C


def _channel_scores(q, k, kb, G, sub):
    """Per-channel gates: ``A_tj = sum_d kb_td k_jd e^{G_td - G_jd}`` (strictly lower) and ``P_tj = sum_d q_td k_jd
    e^{G_td - G_jd}`` (inclusive lower), ``[B,H,N,C,C]`` each, for q, k, kb ``[B,H,N,C,Dk]`` and the in-chunk
    cumulative log decays ``G [B,H,N,C,Dk]``.

    Inside each sub-chunk of ``sub`` tokens the pairwise decays are explicit (``[sub, sub, Dk]``, exp of
    non-positive differences masked in log space). Across sub-chunks (``j`` in sub-chunk ``a``, ``t`` after it) the
    decay splits at ``r``, the last token of ``a``: ``e^{G_t - G_j} = e^{G_t - G_r} e^{G_r - G_j}``, both factors
    exps of non-positive differences (``G`` falls monotonically), so one matmul per sub-chunk ``a`` gives the whole
    block column below it, overflow-free for any decay (an underflowing factor bounds a product smaller still). The
    pairwise work per token (memory-bound, the rule's main cost on a CPU) is then ``sub * Dk`` at any chunk size,
    and the chunk-to-chunk state scan (a chain of dependent ``Dk x Dk`` products) takes a step per ``C`` tokens."""
    B, H, N, C, Dk = q.shape
    n = C // sub
    causal = torch.ones(sub, sub, dtype=torch.bool, device=q.device).tril()
    Gs = G.reshape(B, H, N, n, sub, Dk)
    ks = k.reshape(B, H, N, n, sub, Dk)
    decay = torch.where(causal[..., None], Gs[..., :, None, :] - Gs[..., None, :, :], float("-inf")).exp()
    kd = ks[..., None, :, :] * decay  # [B,H,N,n,sub(t),sub(j),Dk]: k_j e^{G_t - G_j} within a sub-chunk
    A_in = (kb.reshape(B, H, N, n, sub, 1, Dk) * kd).sum(-1).tril(-1)  # [B,H,N,n,sub,sub]
    P_in = (q.reshape(B, H, N, n, sub, 1, Dk) * kd).sum(-1)
    del kd, decay
    if n == 1:
        return A_in[..., 0, :, :], P_in[..., 0, :, :]
    a_cols, p_cols = [], []  # per sub-chunk a: its column strip [B,H,N,C,sub] (zeros above, its block, the rest)
    for a in range(n):
        above = q.new_zeros(B, H, N, a * sub, sub)
        a_parts, p_parts = [above, A_in[..., a, :, :]], [above, P_in[..., a, :, :]]
        if a < n - 1:
            Gr = Gs[..., a, -1:, :]  # [B,H,N,1,Dk]: G at the sub-chunk's last token
            right = (ks[..., a, :, :] * (Gr - Gs[..., a, :, :]).exp()).transpose(-1, -2)  # [B,H,N,Dk,sub]
            rows = slice((a + 1) * sub, C)
            left = (G[..., rows, :] - Gr).exp()  # [B,H,N,C-(a+1)sub,Dk]
            a_parts.append((kb[..., rows, :] * left) @ right)
            p_parts.append((q[..., rows, :] * left) @ right)
        a_cols.append(torch.cat(a_parts, dim=-2))
        p_cols.append(torch.cat(p_parts, dim=-2))
    return torch.cat(a_cols, dim=-1), torch.cat(p_cols, dim=-1)


def _chunk_block(q, k, v, g, beta, S, C):
    """One block of whole chunks. q, k ``[B,H,N,C,Dk]``, v ``[B,H,N,C,Dv]``, beta ``[B,H,N,C]``, g ``[B,H,N,C]``
    (per head) or ``[B,H,N,C,Dk]`` (per key channel), S ``[B,H,Dk,Dv]``.

    Returns the block output ``[B,H,N,C,Dv]`` and the state after the block.
    """
    B, H, N, _, Dk = q.shape
    Dv = v.shape[-1]
    kb = k * beta[..., None]
    if per_channel(g, q):
        G = g.cumsum(dim=-2)  # [B,H,N,C,Dk] log decay per key channel from the chunk start through t (inclusive)
        A, P = _channel_scores(q, k, kb, G, sub_chunk(C))
        eG = G.exp()  # [B,H,N,C,Dk]
        G_last = G[..., -1:, :]  # [B,H,N,1,Dk]
        Kd = k * (G_last - G).exp()  # [B,H,N,C,Dk]
        last = torch.diag_embed(G_last[..., 0, :].exp())  # [B,H,N,Dk,Dk]
    else:
        G = g.cumsum(dim=-1)  # [B,H,N,C] log decay from the chunk start through t (inclusive)
        causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
        # e^{G_t - G_j} for j <= t, 0 above the diagonal (masked in log space: the raw difference may be large > 0)
        decay = torch.where(causal, G[..., :, None] - G[..., None, :], float("-inf")).exp()  # [B,H,N,C,C]
        # strictly lower part of A; the solve treats the diagonal as ones (unitriangular)
        A = (kb @ k.transpose(-1, -2)) * decay.tril(-1)
        P = (q @ k.transpose(-1, -2)) * decay  # [B,H,N,C,C], inclusive lower
        eG = G.exp()[..., None]  # [B,H,N,C,1]
        G_last = G[..., -1:]  # [B,H,N,1]
        Kd = k * (G_last - G).exp()[..., None]  # [B,H,N,C,Dk]
        last = G_last.exp()[..., None] * torch.eye(Dk, dtype=q.dtype, device=q.device)  # [B,H,N,Dk,Dk]
    rhs = torch.cat([v * beta[..., None], kb * eG], dim=-1)  # [B,H,N,C,Dv+Dk]
    X = torch.linalg.solve_triangular(A, rhs, upper=False, unitriangular=True)
    U, Wk = X[..., :Dv], X[..., Dv:]
    Qp = q * eG - P @ Wk  # [B,H,N,C,Dk]
    Oi = P @ U  # [B,H,N,C,Dv]
    KdT = Kd.transpose(-1, -2)
    M = last - KdT @ Wk  # [B,H,N,Dk,Dk]
    R = KdT @ U  # [B,H,N,Dk,Dv]
    # sequential scan over chunks: S_{n+1} = M_n S_n + R_n, keeping S_n (the state entering chunk n)
    M = M.reshape(B * H, N, Dk, Dk)
    R = R.reshape(B * H, N, Dk, Dv)
    s = S.reshape(B * H, Dk, Dv)
    starts = []
    for n in range(N):
        starts.append(s)
        s = torch.baddbmm(R[:, n], M[:, n], s)
    S0 = torch.stack(starts, dim=1).reshape(B, H, N, Dk, Dv)
    O = torch.baddbmm(Oi.reshape(-1, C, Dv), Qp.reshape(-1, C, Dk), S0.reshape(-1, Dk, Dv))
    return O.reshape(B, H, N, C, Dv), s.reshape(B, H, Dk, Dv)


def _block(q, k, v, g, beta, S, t0, t1, scale, use_qk_l2norm, C, out_dtype, cdt):
    """Tokens ``[t0, t1)`` of the inputs (``[B, T, ...]`` as given to :func:`chunk_gated_delta_rule`) from the state
    ``S`` ``[B, H, Dk, Dv]`` (compute dtype ``cdt``) entering them: cast, repeat, normalise (:func:`_prepare`), pad
    to whole chunks, solve.
    Returns ``(o [B, t1 - t0, H, Dv] in out_dtype, S after t1 in the compute dtype)``."""
    B, _, _, Dk = q.shape
    H, Dv = v.shape[2], v.shape[3]
    n = t1 - t0
    qb, kb, vb, gb, bb = _prepare(
        q[:, t0:t1], k[:, t0:t1], v[:, t0:t1], g[:, t0:t1], beta[:, t0:t1], scale, use_qk_l2norm, cdt
    )
    pad = (-n) % C
    if pad:  # zero k, v, g, beta: the padded tokens leave the state untouched
        qb, kb, vb = (F.pad(x, (0, 0, 0, pad)) for x in (qb, kb, vb))
        gb = F.pad(gb, (0, 0, 0, pad) if gb.dim() == 4 else (0, pad))
        bb = F.pad(bb, (0, pad))
    N = (n + pad) // C
    ob, S = _chunk_block(
        qb.reshape(B, H, N, C, Dk),
        kb.reshape(B, H, N, C, Dk),
        vb.reshape(B, H, N, C, Dv),
        gb.reshape(B, H, N, C, *gb.shape[3:]),
        bb.reshape(B, H, N, C),
        S,
        C,
    )
    return ob.reshape(B, H, N * C, Dv)[:, :, :n].transpose(1, 2).to(out_dtype), S


def _blocks(T: int, blk: int) -> list[tuple[int, int]]:
    return [(t0, min(T, t0 + blk)) for t0 in range(0, T, blk)]


def _forward_blocks(q, k, v, g, beta, S, scale, use_qk_l2norm, C, blk, out_dtype, cdt, starts=None):
    """Every block in order from the state ``S``; ``starts`` (a list) collects the state entering each block.
    Returns ``(o [B, T, H, Dv], final state)``."""
    B, T = q.shape[:2]
    H, Dv = v.shape[2], v.shape[3]
    outs = []
    # on the meta device (the planner's dry run) the middle blocks only add their output: ops/meta.py
    last_start = ((T - 1) // blk) * blk
    for t0, t1 in _blocks(T, blk):
        if starts is not None:
            starts.append(S)
        if meta.skip_delta_rule_block((q, k, v, g, beta, S), t0, last_start):
            outs.append(torch.empty(B, t1 - t0, H, Dv, dtype=out_dtype, device=q.device))
            S = torch.empty_like(S)
            continue
        ob, S = _block(q, k, v, g, beta, S, t0, t1, scale, use_qk_l2norm, C, out_dtype, cdt)
        outs.append(ob)
    return (torch.cat(outs, dim=1) if len(outs) > 1 else outs[0].contiguous()), S


class _RecomputedBlocks(torch.autograd.Function):
    """The chunked rule whose backward recomputes one block at a time instead of keeping every block's graph.

    Forward runs the blocks without a graph and saves only the inputs and the state entering each block
    (``ceil(T / blk)`` states of ``[B, H, Dk, Dv]`` in the compute dtype). Backward walks the blocks last to first:
    it re-runs one block's forward with a graph from its saved entering state, backpropagates that block's output
    gradient and the gradient arriving at its final state, writes the inputs' gradient slices, and hands the
    gradient of the entering state to the previous block. The ops are those of the plain path, so the gradients are
    the same numbers; what is held is one block's graph instead of all of them (on a 1.2B hybrid's exact step, bf16,
    8,192-token chunks: about 4.6 GiB per DeltaNet layer with the plain path on an H200). The price is the forward
    arithmetic once more. First derivatives only (``once_differentiable``)."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, init, scale, use_qk_l2norm, C, blk, out_dtype, cdt):
        starts: list[Tensor] = []
        o, S_final = _forward_blocks(q, k, v, g, beta, init.to(cdt), scale, use_qk_l2norm, C, blk, out_dtype, cdt,
                                     starts)
        ctx.save_for_backward(q, k, v, g, beta, *starts)
        ctx.args = (scale, use_qk_l2norm, C, blk, out_dtype, cdt, init.dtype)
        return o, S_final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dS):  # do [B, T, H, Dv], dS [B, H, Dk, Dv] (unused outputs arrive as zeros)
        q, k, v, g, beta, *starts = ctx.saved_tensors
        scale, use_qk_l2norm, C, blk, out_dtype, cdt, init_dtype = ctx.args
        want = ctx.needs_input_grad[:6]
        xs = (q, k, v, g, beta)
        bufs = [torch.empty_like(x) if w else None for x, w in zip(xs, want[:5])]
        T = q.shape[1]
        last_start = ((T - 1) // blk) * blk
        blocks = _blocks(T, blk)
        for i in range(len(blocks) - 1, -1, -1):
            t0, t1 = blocks[i]
            need_state = i > 0 or want[5]  # the gradient of the state entering block i
            # on meta the middle blocks repeat the second-to-last one (full size, the entering state's gradient)
            if meta.skip_delta_rule_block(xs + (starts[i],), t0, last_start - blk):
                dS = torch.empty_like(starts[i])
                continue
            with torch.enable_grad():
                xb = [x[:, t0:t1].detach().requires_grad_(w) for x, w in zip(xs, want[:5])]
                Sb = starts[i].detach().requires_grad_(need_state)
                ob, Sn = _block(*xb, Sb, 0, t1 - t0, scale, use_qk_l2norm, C, out_dtype, cdt)
            ins = [x for x in xb if x.requires_grad] + ([Sb] if need_state else [])
            got = torch.autograd.grad((ob, Sn), ins, (do[:, t0:t1], dS), allow_unused=True)
            it = iter(torch.zeros_like(x) if gx is None else gx for x, gx in zip(ins, got))  # None: not reached
            for x, buf in zip(xb, bufs):
                if x.requires_grad:
                    buf[:, t0:t1] = next(it)
            dS = next(it) if need_state else None
            del xb, Sb, ob, Sn, ins, got, it  # the block's tensors go before the next block's recompute
        return (*bufs, dS.to(init_dtype) if want[5] else None) + (None,) * 6


def chunk_gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm: bool = True,
    chunk_size: int | None = None,
    block_tokens: int | None = None,
    recompute: bool | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Chunked (WY / UT-transform) gated delta rule in pure torch; any device, autograd.

    See the module docstring for the math, shapes and dtypes. ``chunk_size`` None: :func:`torch_chunk_size` (64;
    per-channel decays in sub-chunks of 16 where 16 divides it). ``block_tokens`` bounds how many tokens are
    processed at once (rounded to whole chunks; default: about 2^21 elements per block-sized intermediate, at least
    4 chunks, or for per-channel decays at least 64 tokens). ``recompute`` (default: whenever the call records a
    graph) keeps, for the backward, only the inputs and the state entering each block, and re-runs one block at a
    time there (:class:`_RecomputedBlocks`: one block's graph instead of every block's, for the forward's arithmetic
    once more, first derivatives only); False keeps plain autograd's whole graph.
    Returns ``(o [B, T, H, Dv] in q.dtype, final_state [B, H, Dk, Dv] in the compute dtype or None)``.
    """
    _check(q, k, v, g, beta, initial_state)
    if chunk_size is None:
        chunk_size = torch_chunk_size()
    if not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int; got {chunk_size!r}")
    B, T, _, Dk = q.shape
    H, Dv = v.shape[2], v.shape[3]
    out_dtype = q.dtype
    cdt = _compute_dtype(q.dtype)
    scale = Dk**-0.5 if scale is None else scale
    C = chunk_size
    if block_tokens is None:  # per-channel gates hold [C, sub, Dk] pairwise decays per chunk
        channels = per_channel(g, q)
        per_chunk = B * H * C * ((sub_chunk(C) * Dk + C if channels else C) + Dk + Dv)
        # at least 4 chunks; per-channel gates' memory-bound pairwise work runs fastest in blocks of about 64 tokens
        # whose intermediates stay in cache (CPU, Kimi-Linear's layer shape: docs/BENCHMARKS.md)
        chunks_per_block = max(-(-64 // C) if channels else 4, (1 << 21) // per_chunk)
    else:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be positive; got {block_tokens}")
        chunks_per_block = max(1, block_tokens // C)
    blk = chunks_per_block * C

    if initial_state is None:
        S = torch.zeros(B, H, Dk, Dv, dtype=cdt, device=q.device)
    else:
        S = initial_state.to(cdt)
    if T == 0:
        return torch.zeros(B, 0, H, Dv, dtype=out_dtype, device=q.device), (S if output_final_state else None)
    if needs_grad(q, k, v, g, beta, initial_state) and recompute is not False:  # None: recompute when recording
        init = initial_state if initial_state is not None else S  # a fresh zero state takes no gradient
        o, S = _RecomputedBlocks.apply(q, k, v, g, beta, init, scale, use_qk_l2norm, C, blk, out_dtype, cdt)
    else:
        o, S = _forward_blocks(q, k, v, g, beta, S, scale, use_qk_l2norm, C, blk, out_dtype, cdt)
    return o, (S if output_final_state else None)


@functools.lru_cache(maxsize=2)
def _load_fla(channels: bool = False):
    """fla's ``chunk_gated_delta_rule`` (``channels``: its per-channel-gate ``chunk_kda``), or None. Only ever
    called for CUDA inputs (and by the tests under Triton's interpreter)."""
    try:
        if channels:
            from fla.ops.kda import chunk_kda as fla_chunk
        else:
            from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk
    except ImportError:
        return None
    return fla_chunk


def fla_available(channels: bool = False) -> bool:
    """Whether fla's kernel (``channels``: the per-channel-gate one) can be imported. Imports fla: call it only where
    CUDA is meant to be used."""
    return _load_fla(channels) is not None


def choose_kernel(backend: str, device_type: str, dtype: torch.dtype, fla_importable: bool) -> str:
    """The delta-rule kernel a call takes: ``"fla"`` or ``"torch"`` (pure: the dispatcher's rule, for the planner
    and the step's report). "auto" takes fla for CUDA bf16/fp16 inputs when it imports, torch otherwise."""
    if backend not in _BACKENDS:
        raise ValueError(f"backend must be one of {_BACKENDS}; got {backend!r}")
    if backend == "torch":
        return "torch"
    if device_type == "cuda" and dtype in (torch.bfloat16, torch.float16) and fla_importable:
        return "fla"
    if backend == "fla":
        raise ValueError(f"backend='fla' needs CUDA bf16/fp16 inputs and an importable fla; got device "
                         f"{device_type}, dtype {dtype}")
    return "torch"


@functools.lru_cache(maxsize=1)
def fla_backward_refusal() -> str | None:
    """Why fla's gated delta-rule BACKWARD refuses to run on this machine, or None when it runs.

    fla-core 0.6 raises in ``chunk_bwd_dqkwg`` (the gated backward) on Hopper GPUs with Triton >= 3.4.0 and < 3.7.1
    (wrong results there, fla issue #640) unless its TileLang backend takes the call (``tilelang`` installed, an
    ``nvcc``). This mirrors fla's own guard (``fla/ops/common/chunk_o.py``), reading fla's flags, so the dispatcher
    can route passes that need a gradient to the torch rule before fla raises in the middle of a backward (seen on
    an H200 with torch 2.11 / Triton 3.6, 2026-12-04). An fla without those flags (older or newer) has no guard.
    Call it only where fla imports and CUDA is meant (it imports fla)."""
    try:
        from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    except ImportError:
        return None
    if not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1):
        return None
    try:
        from fla.ops.common.backends.tilelang import CommonTileLangBackend

        if CommonTileLangBackend.can_use():
            return None
    except ImportError:
        pass
    import triton

    return (f"fla's gated delta-rule backward refuses Triton {triton.__version__} on Hopper GPUs (fla issue #640: "
            "Triton >= 3.7.1, or tilelang, needed)")


# fla's backward, checked once per device, dtype, gate kind and shape before a pass that needs a gradient trusts it
# (fla_backward_check): relative error bounds per output and gradient against the torch rule in float32. fla's own
# error from its half-precision intermediates is far below them (under Triton's interpreter, float16 against float64:
# <= 1.5e-3, tests/ops/test_fla_rule.py; bfloat16 carries 3 fewer mantissa bits); the miscompiles fla has found on
# Hopper gave relative errors of 0.5 and more (fla issues #640, #984)
FLA_CHECK_TOL = {torch.bfloat16: 5e-2, torch.float16: 1e-2}
# 15 full chunks of 64 and a partial one: fla autotunes a kernel at its first call per shape, and the check's calls
# are the first that need the backward kernels, so it runs them at a length like the real calls' (a reverse-pass or
# replay chunk of a few thousand tokens), not at a toy one whose best configuration could be slower there
FLA_CHECK_TOKENS = 1000


def fla_backward_errors(device: torch.device, dtype: torch.dtype, channels: bool, heads: int, head_k_dim: int,
                        head_v_dim: int, tokens: int | None = None) -> dict[str, float]:
    """fla's kernel (``channels``: ``chunk_kda``), forward and backward, at one shape on ``device`` in ``dtype``,
    against the torch chunked rule in float32 on the same device and the same (rounded) inputs: the relative errors
    ``||x - ref|| / ||ref||`` of the output, the final state and the gradients of q, k, v, g, beta and the initial
    state, for one random functional of (output, final state). Inputs: one row of ``tokens`` (default
    FLA_CHECK_TOKENS) tokens, ``heads`` heads (fla's, after any repetition of q/k heads) of ``head_k_dim`` /
    ``head_v_dim``, mild random decays (about 0.92 per token), random initial state."""
    gen = torch.Generator().manual_seed(0)
    t, h, dk, dv = FLA_CHECK_TOKENS if tokens is None else tokens, heads, head_k_dim, head_v_dim

    def draw(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    gate = (1, t, h, dk) if channels else (1, t, h)
    inputs = [draw(1, t, h, dk).to(dtype), draw(1, t, h, dk).to(dtype), draw(1, t, h, dv).to(dtype),
              -0.1 * F.softplus(draw(*gate)), torch.sigmoid(draw(1, t, h)).to(dtype), draw(1, h, dk, dv, scale=0.1)]
    d_out, d_state = draw(1, t, h, dv), draw(1, h, dk, dv, scale=0.1)

    def run(fn, xs):
        xs = [x.to(device).detach().requires_grad_() for x in xs]
        o, s = fn(*xs[:5], initial_state=xs[5])
        loss = (o.float() * d_out.to(device)).sum() + (s.float() * d_state.to(device)).sum()
        return [o.detach(), s.detach(), *torch.autograd.grad(loss, xs)]

    def fla_fn(q, k, v, g, beta, initial_state):
        return _fla_call(q, k, v, g, beta, scale=None, initial_state=initial_state, output_final_state=True,
                         use_qk_l2norm=True)

    with torch.enable_grad(), torch.autocast(device.type, enabled=False):
        got = run(fla_fn, inputs)
        ref = run(chunk_gated_delta_rule, [x.float() for x in inputs])
    names = ("out", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate")
    return {n: float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))
            for n, a, b in zip(names, got, ref)}


def _on_own_thread(device: torch.device, fn):
    """``fn()`` on a fresh thread (``device`` its current CUDA device), its exception re-raised here: the check runs
    inside whatever model call first needs it, and none of that call's thread-local state reaches it (autocast,
    grad mode, the saved-tensor hooks of activation checkpointing or of the kept-graph accounting, dispatch modes)."""
    result: dict = {}

    def target():
        try:
            if device.type == "cuda" and device.index is not None:  # a tensor's device always has its index
                torch.cuda.set_device(device.index)
            result["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            result["error"] = e

    thread = threading.Thread(target=target, name="longstraw-fla-check")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return result["value"]


@functools.lru_cache(maxsize=None)
def fla_backward_check(device: torch.device, dtype: torch.dtype, channels: bool, heads: int, head_k_dim: int,
                       head_v_dim: int) -> str | None:
    """Why fla's backward is not trusted at this shape on ``device``, or None when it is: once per (device, dtype,
    gate kind, heads, Dk, Dv), :func:`fla_backward_errors` within FLA_CHECK_TOL (the autotuner picks fla's kernel
    configurations by these shapes, and a Triton miscompile is a property of a configuration on a GPU: fla found
    such on Hopper, issues #640 and #984; its guard covers the first only, for the per-head rule). A failed
    check or an exception in fla's kernels returns the reason, naming the worst tensor."""
    what = (f"fla's {'chunk_kda' if channels else 'chunk_gated_delta_rule'} at {heads} heads, Dk={head_k_dim}, "
            f"Dv={head_v_dim} in {str(dtype).removeprefix('torch.')} on {device}")
    try:
        errors = _on_own_thread(device, lambda: fla_backward_errors(device, dtype, channels, heads, head_k_dim,
                                                                    head_v_dim))
    except Exception as e:  # a kernel that fails to compile or launch here: the torch rule takes the call
        return f"{what} raised {type(e).__name__} in its check: {str(e)[:300]}"
    tol = FLA_CHECK_TOL.get(dtype, 1e-4)
    bad = {n: e for n, e in errors.items() if not e <= tol}
    if not bad:
        _log.info("%s: forward and backward agree with the torch rule (worst %.1e, bound %g)", what,
                  max(errors.values()), tol)
        return None
    return (f"{what} disagrees with the torch rule in its check ({', '.join(f'{n} {e:.2g}' for n, e in bad.items())}"
            f" off, relative; bound {tol:g}): a miscompiled kernel (fla issues #640, #984 found such on Hopper)")


def _dispatch(backend: str, device_type: str, dtype: torch.dtype, needs_grad: bool, channels: bool = False,
              where: tuple[torch.device, int, int, int] | None = None) -> tuple[str, str | None]:
    """``(kernel, refusal)``: the kernel ``backend`` takes (:func:`choose_kernel`, imports fla only for CUDA half
    inputs; ``channels``: per-channel gates, fla's ``chunk_kda``), and for a call that records a graph the reason
    fla's backward is not taken: fla's own refusal (:func:`fla_backward_refusal`, the per-head rule's guard;
    ``chunk_kda``'s backward has no such guard in fla-core 0.6) or, given ``where`` (the call's device and its
    (heads, Dk, Dv)), a failed :func:`fla_backward_check`; "auto" then takes "torch", "fla" raises RuntimeError."""
    fla_ok = (backend in ("auto", "fla") and device_type == "cuda" and dtype in (torch.bfloat16, torch.float16)
              and fla_available(channels))
    kernel = choose_kernel(backend, device_type, dtype, fla_ok)
    refusal = None
    if kernel == "fla" and needs_grad:
        refusal = None if channels else fla_backward_refusal()
        if refusal is None and where is not None:
            refusal = fla_backward_check(where[0], dtype, channels, *where[1:])
    if refusal is not None and backend == "fla":
        raise RuntimeError(f"backend='fla' cannot take a pass that needs a gradient here: {refusal}")
    return ("torch" if refusal is not None else kernel), refusal


def delta_rule_kernel(device: torch.device | str, dtype: torch.dtype, needs_grad: bool = False,
                      backend: str | None = None, channels: bool = False,
                      shape: tuple[int, int, int] | None = None) -> str:
    """The kernel ``backend`` (default :func:`default_backend`) takes for inputs on ``device`` in ``dtype``
    (imports fla only for a CUDA device; ``channels``: per-channel gates); "auto" with ``needs_grad`` (the call's
    output takes part in a backward): "torch" where fla's backward refuses (:func:`fla_backward_refusal`) or, given
    the call's ``shape`` (value heads, Dk, Dv), fails its check there (:func:`fla_backward_check`); "fla" raises in
    both cases."""
    backend = default_backend() if backend is None else backend
    device = torch.device(device)
    where = (device, *shape) if shape is not None else None
    return _dispatch(backend, device.type, dtype, needs_grad, channels, where)[0]


@functools.lru_cache(maxsize=None)
def _log_kernel(kernel: str, device_type: str, dtype: torch.dtype) -> None:
    """Name the kernel once per (kernel, device type, dtype) in the log (logger ``longstraw.ops.deltanet``)."""
    _log.info("Gated DeltaNet: the %s delta-rule kernel runs for %s %s inputs", kernel, device_type, dtype)


@functools.lru_cache(maxsize=None)
def _warn_torch_on_cuda(dtype: torch.dtype, why: str, fix: str) -> None:
    warnings.warn(f"Gated DeltaNet on CUDA ({dtype}) runs the torch chunked delta rule, not fla's kernel: {why}; "
                  f"expect a slower step and a branch graph several times fla's ({fix})", stacklevel=3)


def needs_grad(*tensors: Tensor | None) -> bool:
    """Whether a call on these inputs records a graph (its backward will run the kernel's backward)."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)


def gated_delta_rule(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    g: Tensor,
    beta: Tensor,
    *,
    scale: float | None = None,
    initial_state: Tensor | None = None,
    output_final_state: bool = True,
    use_qk_l2norm: bool = True,
    chunk_size: int | None = None,
    backend: str | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Dispatcher. ``backend``: "auto" (fla for CUDA bf16/fp16 when it imports, else torch chunked), "torch", "fla";
    None: :func:`default_backend` (``LONGSTRAW_DELTA_RULE``, else "auto").
    A call that records a graph takes the torch rule where fla's backward refuses (:func:`fla_backward_refusal`;
    "auto" warns once, "fla" raises): forward-only calls (prefill, decoding) still run fla.

    ``chunk_size``: the torch form's (None: :func:`torch_chunk_size`); fla always uses chunks of 64, and another
    explicit ``chunk_size`` is ignored there (with a warning).
    """
    backend = default_backend() if backend is None else backend
    _check(q, k, v, g, beta, initial_state)
    kernel, refusal = _dispatch(backend, q.device.type, q.dtype, needs_grad(q, k, v, g, beta, initial_state),
                                per_channel(g, q), (q.device, v.shape[2], q.shape[3], v.shape[3]))
    if q.device.type != "meta":
        _log_kernel(kernel, q.device.type, q.dtype)
    if kernel == "torch" and q.is_cuda and backend == "auto":  # never silently: the torch path on a GPU is slow
        if refusal is not None:  # forward-only calls still take fla
            _warn_torch_on_cuda(q.dtype, f"in passes that need a gradient: {refusal}",
                                "pip install 'triton>=3.7.1' or tilelang; until then GRPOConfig(checkpoint_layers="
                                "True) holds one layer's graph at a time, or a smaller prefill_chunk; "
                                f"{BACKEND_ENV}=torch takes the torch rule without this warning")
        else:
            _warn_torch_on_cuda(q.dtype, "fla does not import" if q.dtype in (torch.bfloat16, torch.float16)
                                else "fla takes bf16/fp16 inputs only", "pip install 'longstraw[gpu]' for fla; "
                                "bf16/fp16 inputs")
    if kernel == "torch":
        return chunk_gated_delta_rule(
            q,
            k,
            v,
            g,
            beta,
            scale=scale,
            initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm=use_qk_l2norm,
            chunk_size=chunk_size,
        )
    if chunk_size not in (None, 64):
        warnings.warn(f"fla uses chunks of 64; chunk_size={chunk_size} is ignored", stacklevel=2)
    return _fla_call(q, k, v, g, beta, scale=scale, initial_state=initial_state,
                     output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)


def _fla_call(q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor, *, scale: float | None,
              initial_state: Tensor | None, output_final_state: bool,
              use_qk_l2norm: bool) -> tuple[Tensor, Tensor | None]:
    """fla's ``chunk_gated_delta_rule`` (per-channel ``g [B, T, Hv, Dk]``: ``chunk_kda``, the same arguments) on our
    layout (the dispatcher's fla branch, after its checks): q/k heads repeated to the value heads, k/v/beta in q's
    dtype, g and the ``[B, Hv, Dk, Dv]`` state in float32 (fla's ``state_v_first=False`` layout is ours; its gates in
    log space, computed outside the kernel). Device-agnostic: the dispatcher sends CUDA tensors only; the fla tests
    send CPU tensors under Triton's interpreter (tests/fla_interpret.py)."""
    rep = v.shape[2] // q.shape[2]
    if rep != 1:  # older fla versions need equal heads; repeating is cheap next to the kernel
        q = q.repeat_interleave(rep, dim=2)
        k = k.repeat_interleave(rep, dim=2)
    k = k.to(q.dtype)
    v = v.to(q.dtype)
    if initial_state is not None:
        initial_state = initial_state.to(torch.float32)
    o, final = _load_fla(per_channel(g, q))(
        q,
        k,
        v,
        g.to(torch.float32),
        beta.to(q.dtype),
        scale=q.shape[-1] ** -0.5 if scale is None else scale,
        initial_state=initial_state,
        output_final_state=output_final_state,
        use_qk_l2norm_in_kernel=use_qk_l2norm,
    )
    return o.to(q.dtype), final


# ---------------------------------------------------------------------------------------------------------- transfer
# The rule is affine in its initial state: over a piece of tokens, S_end = M S0 + S1 and o_t = o1_t + S0^T b_t with
# M = prod_t (I - beta_t k_t k_t^T) D_t ([Dk, Dk] per head; D_t the decay, per head or per key channel: the same
# holds for both), S1 / o1 the piece from a zero state and b_t =
# M_{<=t}^T q_t ([Dk] per token and head). Value columns never mix, so ONE call of any rule (the torch form or
# fla's kernel) with Dk extra value columns, their values zero and their initial state the identity, returns all
# four: the first Dv columns of its output and final state are (o1, S1), the last Dk are (b, M). Context
# parallelism runs its pieces that way from an unknown state and composes them across ranks afterwards
# (distributed/cp_recurrent.py); the reference test holds it against the rule run from S0 directly.


def transfer_inputs(v: Tensor, head_k_dim: int) -> tuple[Tensor, Tensor]:
    """``(v2, S_init)`` for a transfer call: ``v [B, T, H, Dv]`` with ``Dk`` zero columns appended
    (``[B, T, H, Dv + Dk]``) and the initial state ``[B, H, Dk, Dv + Dk]``: zeros, then the identity, in the
    rule's compute dtype (float64 for float64 values, else float32)."""
    B, T, H, _ = v.shape
    v2 = torch.cat([v, v.new_zeros(B, T, H, head_k_dim)], dim=-1)
    eye = torch.eye(head_k_dim, dtype=_compute_dtype(v.dtype), device=v.device)
    init = torch.cat([eye.new_zeros(head_k_dim, v.shape[-1]), eye], dim=-1).expand(B, H, -1, -1).contiguous()
    return v2, init


def compose_transfer(S_full: Tensor, S0: Tensor | None, dv: int) -> Tensor:
    """The state after a piece from the state ``S0 [..., Dk, Dv]`` before it (None: zeros), given the piece's
    transfer-call final state ``S_full [..., Dk, Dv + Dk]``: ``M S0 + S1``."""
    S1 = S_full[..., :dv]
    return S1 if S0 is None else S1 + S_full[..., dv:] @ S0.to(S1.dtype)


def apply_initial(o_full: Tensor, S_full: Tensor, S0: Tensor | None, dv: int) -> tuple[Tensor, Tensor]:
    """``(o, S_end)`` of the piece from the initial state ``S0 [B, H, Dk, Dv]`` (None: zeros; batch 1 broadcasts),
    given its transfer call's output ``o_full [B, T, H, Dv + Dk]`` and final state ``S_full [B, H, Dk, Dv + Dk]``:
    ``o = o1 + b S0`` (computed in ``S0``'s dtype, returned in ``o_full``'s) and ``S_end = M S0 + S1``."""
    return transfer_output(o_full, S0, dv), compose_transfer(S_full, S0, dv)


def transfer_output(o_full: Tensor, S0: Tensor | None, dv: int) -> Tensor:
    """The piece's output ``[B, T, H, Dv]`` from the initial state ``S0 [B, H, Dk, Dv]`` (or ``[H, Dk, Dv]``;
    None: zeros), given its transfer call's output ``o_full [B, T, H, Dv + Dk]``: ``o1 + b S0``, computed in
    ``S0``'s dtype and returned in ``o_full``'s."""
    o1 = o_full[..., :dv]
    if S0 is None:
        return o1
    S0 = S0.expand(o_full.shape[0], *S0.shape[-3:])
    corr = torch.einsum("bthk,bhkv->bthv", o_full[..., dv:].to(S0.dtype), S0)
    return (o1.to(S0.dtype) + corr).to(o_full.dtype)
