"""Gated DeltaNet (the linear-attention token mixer of Qwen3-Next / Qwen3.5) and its prompt state.

:class:`DeltaRuleMixer` holds what every delta-rule mixer shares (the forward below, the state, the kernel choice);
:class:`GatedDeltaNet` and Kimi Delta Attention (:mod:`longstraw.models.kda`, a decay per key channel) derive from it.

Per token (HF names; ``Hk`` key heads of dim ``Dk``, ``Hv`` value heads of dim ``Dv``, ``r = Hv / Hk``)::

    q, k, v  = in_proj(x)                     q, k: [Hk, Dk], v: [Hv, Dv]   (also z: [Hv, Dv], b, a: [Hv])
    q, k, v  = silu(causal_conv1d([q|k|v]))   depthwise, kernel K, over the concatenated channels
    beta     = sigmoid(b)                     write strength
    g        = -exp(A_log) * softplus(a + dt_bias)    log decay (<= 0), in float32 (float64 models: float64)
    o, S     = gated_delta_rule(q, k, v, g, beta, S)  q/k L2-normalised inside the op, q scaled by Dk^-0.5
    y        = out_proj(GatedRMSNorm(o, z))   per value head: w * rmsnorm(o) * silu(z)

Two projection layouts, as the checkpoints store them:

* ``"qwen3_next"``: ``in_proj_qkvz`` ``[2*Hk*Dk + 2*Hv*Dv, hidden]`` and ``in_proj_ba`` ``[2*Hv, hidden]``, both grouped
  by key head: for each key head ``i`` its ``[q_i (Dk), k_i (Dk), v_i (r*Dv), z_i (r*Dv)]`` and ``[b_i (r), a_i (r)]``;
* ``"qwen3_5"``: separate ``in_proj_qkv`` (channels ``[q | k | v]``, head-major), ``in_proj_z``, ``in_proj_b``,
  ``in_proj_a``.

Either way the conv runs over channels ``[q (Hk*Dk) | k (Hk*Dk) | v (Hv*Dv)]`` (``conv1d.weight [C, 1, K]``, no bias).

The mixer follows the :class:`~longstraw.models.attention.Attention` interface: ``forward(x, ctx, prefix)`` with
``prefix`` a :class:`RecurrentPrefix` (or None: zeros, i.e. the sequence starts here) returns ``(y, (conv, S))``:
the conv window ``[B, C, K-1]`` (the last ``K-1`` conv inputs, in the activations' dtype) and the recurrent matrix
``S [B, Hv, Dk, Dv]`` (float32, float64 for float64 models) after the new tokens. ``ctx`` is not read (DeltaNet
has no positions). A prefix of batch 1 is broadcast over a batch of branches (expanded, never copied).

The prefix's four hooks are identities here (one call of the rule from the prefix's state):
:meth:`RecurrentPrefix.enter` (the layer's input and initial state), :meth:`RecurrentPrefix.window` (the conv's
initial window, given the conv input), :meth:`RecurrentPrefix.recur` (the delta rule, given the layer's rule) and
:meth:`RecurrentPrefix.leave` (its output and final state). A prefix whose state lives across processes (context
parallelism, ``longstraw.distributed``) overrides them, so each process runs its piece from an unknown state and the
pieces are composed across processes inside the layer's call, forward and backward, without the model knowing.

:class:`RecurrentState` is the prompt state of one DeltaNet layer (see :mod:`longstraw.state` for the protocol).
Detached mode keeps only the latest ``(conv, S)``: O(1) in the prompt length. Exact mode also keeps the state at
every prefill-chunk boundary, because the reverse pass recomputes chunk ``[s, e)`` from the state at ``s``:
O(P / chunk) states (docs/HYBRID.md gives the bytes and the alternative of recomputing from sparser checkpoints).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from longstraw.models.norms import GatedRMSNorm
from longstraw.ops.conv import causal_conv1d
from longstraw.ops.deltanet import (SUB_CHUNK, delta_rule_kernel, gated_delta_rule, needs_grad,
                                    recurrent_gated_delta_rule, torch_chunk_size)
from longstraw.ops.host_memory import offloads as offloads_state
from longstraw.ops.host_memory import stage, to_host
from longstraw.state import grad_dtype_for

LAYOUTS = ("qwen3_next", "qwen3_5")


@dataclass
class RecurrentPrefix:
    """What a DeltaNet layer consumes from the positions before the new tokens.

    conv ``[Bp, C, K-1]``: the last K-1 conv inputs; S ``[Bp, Hv, Dk, Dv]``: the recurrent matrix. ``Bp`` is 1 (shared
    by a batch of branches) or the batch size. Both None: zeros (the sequence starts here) for a prefix that exists
    only for its hooks.
    """

    conv: Tensor | None
    S: Tensor | None

    def enter(self, x: Tensor) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """``(x, conv, S)``: the layer's input and the initial state it starts from (identity here)."""
        return x, self.conv, self.S

    def window(self, mixed: Tensor, conv: Tensor | None, width: int) -> Tensor | None:
        """The conv's initial window ``[B, C, width]`` (``width = K - 1``) for the layer's conv input ``mixed [B, T,
        C]``, given the one :meth:`enter` returned (identity here)."""
        return conv

    def recur(self, rule, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              S: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """``(o, S_final)``: the delta rule over the new tokens; ``rule(q, k, v, g, beta, S)`` is the layer's
        (kernel choice included), ``S`` the initial state :meth:`enter` returned (here: one call of the rule)."""
        return rule(q, k, v, g, beta, S)

    def leave(self, y: Tensor, conv: Tensor, S: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """``(y, conv, S)``: the layer's output and the final state it hands on (identity here)."""
        return y, conv, S


def _autocast_off(device_type: str):
    try:
        enabled = torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta)
        enabled = False
    return torch.autocast(device_type, enabled=False) if enabled else contextlib.nullcontext()


def _nbytes(*ts: Tensor | None) -> int:
    return sum(t.numel() * t.element_size() for t in ts if t is not None)


@dataclass
class RecurrentState:
    """Prompt state of one Gated DeltaNet layer.

    ``conv [1, C, K-1]`` and ``S [1, Hv, Dk, Dv]`` after the first ``length`` prompt positions. With ``exact`` the
    state after every written chunk is kept in ``boundaries`` (keyed by the chunk's end; the state at 0 is zeros and
    never stored), so that ``prefix(s)`` exists for every chunk start ``s`` of the reverse pass.

    Host memory (``GRPOConfig.offload_state``): a boundary is read once more, by the reverse pass, so after
    :meth:`offload_history` every boundary moves to host memory as soon as the next chunk's state supersedes it
    (the prefill reads only the latest), and :meth:`offload` moves what is left but the latest (every branch reads
    it); the reverse pass copies a boundary back to ``home`` when it starts from it.

    Gradients (exact mode, after ``enable_grad``): ``prefix(n, grad=True)`` hands out leaf tensors (created once
    per ``n``, in the gradient dtype) whose ``.grad`` collects dL/d(state at n) from everything that consumed them:
    the branches for ``n = P``, the recomputed chunk ``[n, e)`` otherwise. ``backward_roots(piece, s, e)`` pairs
    the recomputed chunk's output state with the ``.grad`` of the leaves at ``e`` and then drops those leaves, so at
    most two sets of leaves live at once.
    """

    capacity: int
    exact: bool = False
    conv: Tensor | None = None
    S: Tensor | None = None
    length: int = 0
    boundaries: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    grad_dtype: torch.dtype | None = None
    _leaves: dict[int, tuple[Tensor, Tensor]] = field(default_factory=dict)
    _grad_peak: int = 0
    host_history: bool = False  # superseded boundaries move to host memory as they are superseded
    home: torch.device | None = None  # the device the state is computed on, once a boundary is in host memory
    _on_host: set[int] = field(default_factory=set)  # the boundaries in host memory

    # ------------------------------------------------------------------ prefill
    def write(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> None:
        conv, S = piece
        assert conv.shape[0] == 1 and S.shape[0] == 1, "prefill writes one sequence, one chunk at a time"
        assert start == self.length, f"recurrent state holds {self.length} positions, chunk starts at {start}"
        assert end <= self.capacity
        conv, S = conv.detach(), S.detach()
        if conv.device.type != "meta" and conv.untyped_storage().nbytes() > _nbytes(conv):
            conv = conv.clone()  # a view (kernel 2) would keep the whole chunk's conv input alive
        if self.exact and self.host_history and self.length in self.boundaries:
            self._to_host(self.length)  # superseded: the prefill reads only the latest
        self.conv, self.S, self.length = conv, S, end
        if self.exact:
            self.boundaries[end] = (self.conv, self.S)

    def _to_host(self, key: int) -> None:
        conv, S = self.boundaries[key]
        if key in self._on_host or not offloads_state(conv):
            return
        self.home = conv.device
        self.boundaries[key] = (to_host(conv), to_host(S))
        self._on_host.add(key)

    def offload_history(self) -> None:
        """From now on, move each boundary to host memory once the next chunk's state supersedes it."""
        self.host_history = True

    def offload(self) -> None:
        """Move every boundary but the latest to host memory (where the state is on an accelerator)."""
        for key in self.boundaries:
            if key != self.length:
                self._to_host(key)

    def host_nbytes(self) -> int:
        """Bytes of the boundaries in host memory (counted in ``nbytes`` too)."""
        return sum(_nbytes(*self.boundaries[k]) for k in self._on_host)

    def _state_at(self, length: int) -> tuple[Tensor, Tensor]:
        if length == self.length:
            return self.conv, self.S
        if length in self._on_host:  # back to the device for the reverse-pass step that starts here
            return tuple(stage(t, self.home) for t in self.boundaries[length])  # type: ignore[return-value]
        if length in self.boundaries:
            return self.boundaries[length]
        if not self.exact:
            raise ValueError(f"this recurrent prompt state keeps only its latest state (position {self.length}); "
                             f"the state at position {length} needs a prompt state built with exact=True")
        raise ValueError(f"no recurrent state stored at position {length}; stored chunk boundaries: "
                         f"{sorted(self.boundaries)}")

    # ------------------------------------------------------------------ consumption
    def prefix(self, length: int, grad: bool) -> RecurrentPrefix | None:
        """The state after ``length`` positions (None for 0: the sequence starts with a zero state)."""
        if length == 0 or self.conv is None:
            return None
        assert length <= self.length
        if not (grad and self.grad_dtype is not None):
            return RecurrentPrefix(*self._state_at(length))
        if length not in self._leaves:
            conv, S = self._state_at(length)
            leaves = tuple(t.detach().to(self.grad_dtype).requires_grad_() for t in (conv, S))
            self._leaves[length] = leaves  # type: ignore[assignment]
            self._grad_peak = max(self._grad_peak, self._live_grad_bytes())
        return RecurrentPrefix(*self._leaves[length])

    def backward_roots(self, piece: tuple[Tensor, Tensor], start: int, end: int) -> list[tuple[Tensor, Tensor]]:
        leaves = self._leaves.pop(end, None)
        if leaves is None:
            return []
        return [(root, leaf.grad.to(root.dtype)) for root, leaf in zip(piece, leaves) if leaf.grad is not None]

    def enable_grad(self, dtype: torch.dtype | None = None, offload: bool = False) -> None:
        """``offload`` is ignored: the gradient leaves are one or two states (small), on the state's device."""
        if self.S is None:
            return
        if not self.exact:  # raise now, before any branch has added to .grad, not in the reverse pass
            raise ValueError("the exact reverse pass needs the recurrent state at every chunk boundary: it needs a "
                             "prompt state built with exact=True (prefill(..., exact=True) / "
                             "generate(..., exact_state=True))")
        self.grad_dtype = dtype or grad_dtype_for(self.S.dtype)
        self._leaves.clear()
        self._grad_peak = 0

    def release_grad(self) -> None:
        self._leaves.clear()
        self.grad_dtype = None
        self._grad_peak = 0

    # ------------------------------------------------------------------ accounting
    def _live_grad_bytes(self) -> int:
        """Bytes a live leaf set costs: its ``.grad`` and, where the dtype differs from the stored state, its copy."""
        n = 0
        for leaves in self._leaves.values():
            for leaf, stored in zip(leaves, (self.conv, self.S)):
                n += 2 * _nbytes(leaf) if leaf.dtype != stored.dtype else _nbytes(leaf)
        return n

    def nbytes(self) -> int:
        """Stored state: the latest ``(conv, S)``, and in exact mode every chunk boundary's (the latest included)."""
        if self.exact and self.boundaries:
            return sum(_nbytes(c, s) for c, s in self.boundaries.values())
        return _nbytes(self.conv, self.S)

    def grad_nbytes(self) -> int:
        """Peak bytes of the gradient leaves held at once since ``enable_grad`` (one state in the branches, two in
        the reverse pass)."""
        return self._grad_peak

    def grad_host_nbytes(self) -> int:
        return 0  # the gradient leaves stay on the state's device (enable_grad)

    def decoder(self, batch: int, max_new: int) -> "RecurrentDecoder":
        return RecurrentDecoder(self, batch)


class RecurrentDecoder:
    """Decoding ``batch`` branches: step 0 reads the prompt's final state expanded over the batch (no copy); each
    step's new per-branch state ``[batch, ...]`` replaces the previous one (O(1) in the number of new tokens)."""

    def __init__(self, prompt: RecurrentState, batch: int):
        self.prompt, self.batch = prompt, batch
        self.conv: Tensor | None = None
        self.S: Tensor | None = None

    def prefix(self, step: int) -> RecurrentPrefix | None:
        if self.S is not None:
            return RecurrentPrefix(self.conv, self.S)
        p = self.prompt.prefix(self.prompt.length, False)
        if p is None:
            return None
        return RecurrentPrefix(p.conv.expand(self.batch, -1, -1), p.S.expand(self.batch, -1, -1, -1))

    def append(self, piece: tuple[Tensor, Tensor], step: int) -> None:
        self.conv, self.S = piece

    def select(self, rows: Tensor) -> None:
        """Keep only the branches ``rows``."""
        self.batch = int(rows.numel())
        if self.S is not None:
            self.conv, self.S = self.conv[rows], self.S[rows]


def delta_rule_calls(model: nn.Module) -> dict[str, int]:
    """Forwards per delta-rule kernel ("fla", "torch") that ``model``'s Gated DeltaNet layers have run so far: a
    running count, read before and after a stretch of work (:func:`kernels_since`)."""
    calls: dict[str, int] = {}
    for m in model.modules():
        if isinstance(m, DeltaRuleMixer):
            for k, n in m.kernel_calls.items():
                calls[k] = calls.get(k, 0) + n
    return calls


def kernels_since(model: nn.Module, before: dict[str, int]) -> str:
    """The delta-rule kernels ``model``'s Gated DeltaNet layers took since ``before`` (a :func:`delta_rule_calls`
    reading), "+"-joined in name order: "fla", "torch", or "fla+torch" (e.g. fla in the forward-only prefill and the
    torch rule in passes that need a gradient, where fla's backward refuses the GPU); "" when none ran."""
    now = delta_rule_calls(model)
    return "+".join(sorted(k for k, n in now.items() if n > before.get(k, 0)))


class ShortConv(nn.Conv1d):
    """The depthwise causal short conv over ``[q | k | v]`` (``weight [C, 1, K]``, no bias, SiLU), called as a module
    so that a model keeping it in float32 (Ling 3.0: ``models.keep_fp32``) can make it an FSDP2 unit of its own.
    ``forward(x [B, T, C], initial_state [B, C, K-1] | None) -> (y [B, T, C] in x's dtype, final_state)``, computed
    in ``promote_types(x, weight)`` (``ops.conv.causal_conv1d``)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__(channels, channels, kernel, groups=channels, bias=False)

    def forward(self, x: Tensor, initial_state: Tensor | None = None) -> tuple[Tensor, Tensor]:
        return causal_conv1d(x, self.weight, self.bias, initial_state=initial_state, activation="silu")


class DeltaRuleMixer(nn.Module):
    """What every delta-rule token mixer shares (Gated DeltaNet here, Kimi Delta Attention in
    :mod:`longstraw.models.kda`): project, short conv over ``[q | k | v]`` with its window carried in the state, the
    delta rule from the prefix's recurrent state (the prefix's hooks around both), gated output norm and projection.
    A subclass defines the projections and the gate: :meth:`_project`, :meth:`_decay`, :meth:`_output`, and sets
    ``num_k_heads, num_v_heads, head_k_dim, head_v_dim, key_dim, value_dim, conv_dim, conv_kernel``, ``conv1d``
    (a :class:`ShortConv`) and ``per_channel`` (the decay per key channel, KDA, or per head)."""

    state_type = RecurrentState
    per_channel = False

    def __init__(self):
        super().__init__()
        # forwards per delta-rule kernel ("fla" / "torch"), a running count: a diagnostic the engine and the trainer
        # read before and after their work (delta_rule_calls / kernels_since) and report, not state
        self.kernel_calls: dict[str, int] = {}

    def new_state(self, capacity: int, exact: bool = False) -> RecurrentState:
        return RecurrentState(capacity, exact)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x ``[B, T, hidden]`` -> conv input ``[B, T, C]`` (channels q|k|v), the output gate ``[B, T, Hv, Dv]``,
        beta's logits ``[B, T, Hv]`` and the decay's input (what :meth:`_decay` takes)."""
        raise NotImplementedError

    def _decay(self, gate_in: Tensor, cdt: torch.dtype) -> Tensor:
        """The log decay ``g`` (``<= 0``, in ``cdt``): ``[B, T, Hv]``, or ``[B, T, Hv, Dk]`` when ``per_channel``."""
        raise NotImplementedError

    def _output(self, o: Tensor, z: Tensor) -> Tensor:
        """The rule's output ``o [B, T, Hv, Dv]`` and the gate ``z`` -> the layer's output ``[B, T, hidden]``."""
        raise NotImplementedError

    def forward(self, x: Tensor, ctx, prefix: RecurrentPrefix | None):
        conv0 = s0 = None
        if prefix is not None:
            x, conv0, s0 = prefix.enter(x)
        b, t, _ = x.shape
        mixed, z, beta_logit, gate_in = self._project(x)
        if s0 is not None:
            if conv0.shape[0] != b:
                assert conv0.shape[0] == 1, f"prefix batch {conv0.shape[0]} must be 1 or the batch {b}"
                conv0, s0 = conv0.expand(b, -1, -1), s0.expand(b, -1, -1, -1)
            s0 = s0.contiguous()  # one [B, Hv, Dk, Dv] copy if expanded (kernels want a dense initial state)
        if prefix is not None:
            conv0 = prefix.window(mixed, conv0, self.conv_kernel - 1)
        mixed, conv1 = self.conv1d(mixed, conv0)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(b, t, self.num_k_heads, self.head_k_dim)
        k = k.reshape(b, t, self.num_k_heads, self.head_k_dim)
        v = v.reshape(b, t, self.num_v_heads, self.head_v_dim)
        beta = beta_logit.sigmoid()
        g = self._decay(gate_in, torch.float64 if x.dtype == torch.float64 else torch.float32)
        # Autocast off for the rule and whatever a prefix's recur adds (composing states): the op computes in
        # float32 itself, and the recurrent state must stay float32 (autocast would run its matmuls, and so the
        # state, in bf16)
        with _autocast_off(x.device.type):
            if prefix is None:
                o, s1 = self._rule(q, k, v, g, beta, s0)
            else:
                o, s1 = prefix.recur(self._rule, q, k, v, g, beta, s0)
        y = self._output(o, z)
        if prefix is not None:
            y, conv1, s1 = prefix.leave(y, conv1, s1)
        return y, (conv1, s1)

    def _rule(self, q: Tensor, k: Tensor, v: Tensor, g: Tensor, beta: Tensor,
              s0: Tensor | None) -> tuple[Tensor, Tensor]:
        """The delta rule on ``q, k [B, T, Hk, Dk]``, ``v [B, T, Hv, Dv]`` (any ``Dv``: a context-parallel prefix
        widens it), ``g [B, T, Hv]`` (or ``[B, T, Hv, Dk]``), ``beta [B, T, Hv]`` from ``s0`` (None: zeros): the
        kernel chosen and counted here. Called inside :meth:`forward`'s autocast-off block."""
        t = q.shape[1]
        grad = needs_grad(q, k, v, g, beta, s0)
        # one token without a graph (decoding): the recurrence's single step, a few small ops; else the chunked
        # rule gated_delta_rule's "auto" picks (fla or torch)
        kernel = ("recurrent" if t == 1 and not grad
                  else delta_rule_kernel(q.device, q.dtype, grad, channels=self.per_channel,
                                         shape=(v.shape[2], q.shape[3], v.shape[3])))
        self.kernel_calls[kernel] = self.kernel_calls.get(kernel, 0) + 1
        if kernel == "recurrent":
            return recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                              use_qk_l2norm=True)
        # fla: its chunks of 64; the torch form: its default chunk (64), on CPU one smaller chunk for fewer new
        # tokens (short branches): per key channel a whole number of sub-chunks, so that the pairwise decays stay
        # within sub-chunks
        base = 64 if kernel == "fla" else torch_chunk_size()
        short = -(-t // SUB_CHUNK) * SUB_CHUNK if self.per_channel and t > SUB_CHUNK else t
        chunk = base if q.is_cuda or kernel == "fla" else max(1, min(base, short))
        return gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, use_qk_l2norm=True,
                                chunk_size=chunk)

    def state_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one stored state for activations in ``dtype``: conv window + fp32 (fp64) recurrent matrix."""
        sdt = torch.float64 if dtype == torch.float64 else torch.float32
        conv = self.conv_dim * (self.conv_kernel - 1) * torch.empty(0, dtype=dtype).element_size()
        return conv + self.num_v_heads * self.head_k_dim * self.head_v_dim * torch.empty(0, dtype=sdt).element_size()

    def _rule_flops_per_token(self) -> float:
        """Forward FLOPs per token of the chunked rule (chunk 64) and the conv."""
        dk, dv, c = self.head_k_dim, self.head_v_dim, 64
        # q.k and k.k per pair of a chunk; per-channel gates also form each pair's decay per channel (3x)
        pairs = 2 * c * dk * (3 if self.per_channel else 1)
        return 2.0 * self.conv_dim * self.conv_kernel + self.num_v_heads * 2.0 * (
            pairs + c * dv + 3 * dk * dv + dk * dk)


def check_conv_activation(activation: str) -> None:
    """The short conv's activation is SiLU in every supported family: ValueError naming ``hidden_act`` otherwise."""
    if activation not in ("silu", "swish"):
        raise ValueError(f"hidden_act={activation!r} is not supported for the DeltaNet conv; supported: 'silu'")


class GatedDeltaNet(DeltaRuleMixer):
    """The Gated DeltaNet token mixer (see module docstring). Parameter names follow the HF checkpoints."""

    def __init__(self, hidden: int, num_k_heads: int, num_v_heads: int, head_k_dim: int, head_v_dim: int, *,
                 conv_kernel: int = 4, norm_eps: float = 1e-6, activation: str = "silu", layout: str = "qwen3_5"):
        super().__init__()
        if layout not in LAYOUTS:
            raise ValueError(f"unknown DeltaNet projection layout {layout!r}; allowed: {', '.join(LAYOUTS)}")
        if num_v_heads % num_k_heads:
            raise ValueError(f"linear_num_value_heads={num_v_heads} must be a multiple of "
                             f"linear_num_key_heads={num_k_heads}")
        check_conv_activation(activation)
        self.layout = layout
        self.num_k_heads, self.num_v_heads = num_k_heads, num_v_heads
        self.head_k_dim, self.head_v_dim = head_k_dim, head_v_dim
        self.key_dim, self.value_dim = num_k_heads * head_k_dim, num_v_heads * head_v_dim
        self.conv_dim = 2 * self.key_dim + self.value_dim
        self.conv_kernel = conv_kernel
        if layout == "qwen3_next":
            self.in_proj_qkvz = nn.Linear(hidden, 2 * self.key_dim + 2 * self.value_dim, bias=False)
            self.in_proj_ba = nn.Linear(hidden, 2 * num_v_heads, bias=False)
        else:
            self.in_proj_qkv = nn.Linear(hidden, self.conv_dim, bias=False)
            self.in_proj_z = nn.Linear(hidden, self.value_dim, bias=False)
            self.in_proj_b = nn.Linear(hidden, num_v_heads, bias=False)
            self.in_proj_a = nn.Linear(hidden, num_v_heads, bias=False)
        self.conv1d = ShortConv(self.conv_dim, conv_kernel)
        self.dt_bias = nn.Parameter(torch.ones(num_v_heads))
        a = torch.empty(num_v_heads)  # HF's init: A in [0.01, 16]; nothing on meta (where log's kernel would
        self.A_log = nn.Parameter(a if a.is_meta else a.uniform_(0.01, 16).log())  # import torch._dynamo)
        self.norm = GatedRMSNorm(head_v_dim, norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hidden, bias=False)

    def _project(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """x ``[B, T, hidden]`` -> conv input ``[B, T, C]`` (channels q|k|v), z ``[B, T, Hv, Dv]``,
        b, a ``[B, T, Hv]``."""
        b, t, _ = x.shape
        if self.layout == "qwen3_5":
            return (self.in_proj_qkv(x), self.in_proj_z(x).view(b, t, self.num_v_heads, self.head_v_dim),
                    self.in_proj_b(x), self.in_proj_a(x))
        hk, dk, dv, r = self.num_k_heads, self.head_k_dim, self.head_v_dim, self.num_v_heads // self.num_k_heads
        qkvz = self.in_proj_qkvz(x).view(b, t, hk, 2 * dk + 2 * r * dv)
        q, k, v, z = torch.split(qkvz, [dk, dk, r * dv, r * dv], dim=-1)
        ba = self.in_proj_ba(x).view(b, t, hk, 2 * r)
        bb, a = torch.split(ba, [r, r], dim=-1)
        mixed = torch.cat([q.reshape(b, t, -1), k.reshape(b, t, -1), v.reshape(b, t, -1)], dim=-1)
        return (mixed, z.reshape(b, t, self.num_v_heads, dv), bb.reshape(b, t, self.num_v_heads),
                a.reshape(b, t, self.num_v_heads))

    def _decay(self, a: Tensor, cdt: torch.dtype) -> Tensor:
        """``g = -exp(A_log) * softplus(a + dt_bias)`` ``[B, T, Hv]`` in ``cdt``."""
        return -self.A_log.to(cdt).exp() * F.softplus(a.to(cdt) + self.dt_bias)

    def _output(self, o: Tensor, z: Tensor) -> Tensor:
        b, t = o.shape[:2]
        return self.out_proj(self.norm(o, z).reshape(b, t, self.value_dim))

    def flops_per_token(self, context: int = 0) -> float:
        """Forward FLOPs per token: projections, conv, and the chunked delta rule (chunk 64); independent of context."""
        hidden = self.out_proj.out_features
        proj = 2.0 * hidden * (self.conv_dim + 2 * self.value_dim + 2 * self.num_v_heads)
        return proj + self._rule_flops_per_token()
