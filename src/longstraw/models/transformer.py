"""The decoder-only language model every family builds: embeddings, decoder layers, final norm, LM head.

Module and parameter names mirror the HF checkpoints (``model.embed_tokens``, ``model.layers.N.self_attn.q_proj``,
``model.norm``, ``lm_head``), so that for most families the checkpoint-name map is the identity.

One forward path processes new tokens given a prefix state (DESIGN.md principle 4): ``run(ids, start, prefix)``
serves prefill chunks, branch replay and decoding alike; only the inputs differ. ``forward(ids)`` is the HF-like
full forward from position 0 that returns logits. The model knows nothing of RL, distribution or checkpoints; where
its prompt states live is set from outside (``placement``, see :class:`~longstraw.state.Placement`).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from longstraw.models.context import CallContext
from longstraw.models.lora import is_adapter_param
from longstraw.models.rope import RotaryEmbedding
from longstraw.ops.logprobs import token_logprobs
from longstraw.state import LOCAL, Placement


@dataclass(frozen=True)
class ModelSpec:
    """The facts about a model that code outside the model needs (engine, planner, trainer)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    max_position_embeddings: int
    tie_word_embeddings: bool
    eos_token_id: Any = None
    bos_token_id: Any = None
    pad_token_id: Any = None
    sliding_window: int | None = None  # the narrowest window of a sliding-window layer (None: no layer slides)

    def check_length(self, end: int, what: str = "the sequence") -> None:
        """ValueError if positions ``0 .. end-1`` do not fit the model's ``max_position_embeddings``."""
        if end > self.max_position_embeddings:
            raise ValueError(f"{what} needs {end} positions, more than the model's max_position_embeddings="
                             f"{self.max_position_embeddings}")


def _autocasting(device_type: str) -> bool:
    try:
        return torch.is_autocast_enabled(device_type)
    except (RuntimeError, TypeError):  # a device type autocast does not know (meta)
        return False


class LMHead(nn.Linear):
    """The LM head ``[vocab, hidden]`` (bias optional). ``head(hidden)``: logits. ``head(hidden, targets, ...)``:
    the float32 (float64 for float64 models) log-probs of ``targets`` by the chunked op
    (:func:`longstraw.ops.logprobs.token_logprobs`: no ``tokens x vocab`` float32 logits at once), and entropies with
    ``with_entropy``. Every use of the head's weight is a call of this module, so parallelism applied from outside
    (FSDP's hooks) sees it."""

    def forward(self, hidden: Tensor, targets: Tensor | None = None, *, temperature: float = 1.0,
                chunk_size: int = 1024, with_entropy: bool = False):
        if hidden.dtype != self.weight.dtype:  # a frozen bf16 head (LoRA) after float32 master-weight layers: the
            hidden = hidden.to(self.weight.dtype)  # head's dtype is its compute dtype (the op accumulates in fp32)
        if targets is None:
            return nn.functional.linear(hidden, self.weight, self.bias)
        return token_logprobs(hidden, self.weight, targets, bias=self.bias, temperature=temperature,
                              chunk_size=chunk_size, with_entropy=with_entropy)


class DecoderLayer(nn.Module):
    """Pre-norm residual block: ``x + mixer(norm(x))`` then ``x + ffn(norm(x))``.

    The mixer is registered under the name the checkpoint uses (``self_attn`` or ``linear_attn``).
    """

    def __init__(self, mixer: nn.Module, ffn: nn.Module, input_norm: nn.Module, post_norm: nn.Module,
                 mixer_name: str = "self_attn", ffn_name: str = "mlp"):
        super().__init__()
        self.mixer_name, self.ffn_name = mixer_name, ffn_name
        self.add_module(mixer_name, mixer)
        self.add_module(ffn_name, ffn)
        self.input_layernorm = input_norm
        self.post_attention_layernorm = post_norm

    @property
    def mixer(self) -> nn.Module:
        return getattr(self, self.mixer_name)

    @property
    def ffn(self) -> nn.Module:
        return getattr(self, self.ffn_name)

    def forward(self, x: Tensor, ctx: CallContext, prefix: Any, need_ffn: bool = True):
        y, piece = self.mixer(self.input_layernorm(x), ctx, prefix)
        x = x + y
        if need_ffn:
            x = x + self.ffn(self.post_attention_layernorm(x))
        return x, piece


class Backbone(nn.Module):
    """Embedding, decoder layers and final norm. Its ``forward`` is the one path over the layers
    (``CausalLM.run``): a module call, so that parallelism applied from outside wraps a whole pass (FSDP's root)."""

    def __init__(self, vocab: int, hidden: int, layers: list[DecoderLayer], norm: nn.Module,
                 rotary: RotaryEmbedding | None, *, local_rotary: RotaryEmbedding | None = None,
                 embedding: nn.Embedding | None = None):
        super().__init__()
        self.embed_tokens = embedding if embedding is not None else nn.Embedding(vocab, hidden)
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary
        self.local_rotary_emb = local_rotary  # a second RoPE for some layers (Gemma 3's sliding ones): ctx.local

    def forward(self, ids: Tensor, start: int, prefix: list[Any] | None, need_hidden: bool,
                checkpoint_layers: bool, grad_from_layer: int | None = None, stop_at_layer: int | None = None):
        """See :meth:`CausalLM.run`."""
        t = ids.shape[1]
        n = len(self.layers)
        lo = 0 if grad_from_layer is None else grad_from_layer
        stop = n if stop_at_layer is None else stop_at_layer
        with torch.no_grad() if lo > 0 else contextlib.nullcontext():
            x = self.embed_tokens(ids)
        ctx = CallContext(start, t)
        if self.rotary_emb is not None:
            pos = torch.arange(start, start + t, device=ids.device)
            ctx.cos, ctx.sin = self.rotary_emb(pos, x.dtype)
        if self.local_rotary_emb is not None:
            ctx.local = self.local_rotary_emb(torch.arange(start, start + t, device=ids.device), x.dtype)
        pieces = []
        boundary = None
        for i, layer in enumerate(self.layers[:stop]):
            if i == lo and lo > 0:  # the split: a leaf whose .grad collects dL/d(hidden entering layer lo)
                boundary = x = x.detach().requires_grad_()
            p = prefix[i] if prefix is not None else None
            need_ffn = need_hidden or i < n - 1
            with torch.no_grad() if i < lo else contextlib.nullcontext():
                if checkpoint_layers and torch.is_grad_enabled():
                    x, piece = checkpoint(layer, x, ctx, p, need_ffn, use_reentrant=False)
                else:
                    x, piece = layer(x, ctx, p, need_ffn)
            pieces.append(piece)
        if stop_at_layer is not None:
            return x, pieces
        hidden = self.norm(x) if need_hidden else None
        return (hidden, pieces) if grad_from_layer is None else (hidden, pieces, boundary)


class CausalLM(nn.Module):
    """A LongStraw language model. ``spec`` holds its shape facts, ``hf_config`` the checkpoint's config dict,
    ``placement`` where its prompt states live (this process unless parallelism was applied from outside:
    ``longstraw.distributed.parallelize``)."""

    def __init__(self, spec: ModelSpec, hf_config: dict, backbone: Backbone):
        super().__init__()
        self.spec = spec
        self.hf_config = dict(hf_config)
        self.model = backbone
        self.lm_head = LMHead(spec.hidden_size, spec.vocab_size, bias=False)
        self.placement: Placement = LOCAL
        self.compute_dtype: torch.dtype | None = None  # autocast dtype of every pass (master weights): see run()
        pad = spec.pad_token_id
        if isinstance(pad, int) and not isinstance(pad, bool) and 0 <= pad < spec.vocab_size:
            # as transformers' embeddings (nn.Embedding(..., padding_idx=pad_token_id) in every family): the pad
            # token's row gets no gradient (its forward is the row as it is)
            backbone.embed_tokens.padding_idx = pad
        self.tie_weights()

    # ------------------------------------------------------------------ structure
    def tie_weights(self) -> None:
        if self.spec.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def named_weights(self) -> list[tuple[str, Tensor]]:
        """Every tensor a checkpoint holds, by in-memory name: the parameters (a tied LM head once, as its
        embedding; LoRA adapters are not the checkpoint's: ``models.lora``), then the persistent buffers (DeepSeek/GLM's router ``e_score_correction_bias``)."""
        out = [(n, p) for n, p in self.named_parameters() if not is_adapter_param(n)]  # adapters: not the model's
        for mname, module in self.named_modules():
            for bname, buf in module.named_buffers(recurse=False):
                if buf is not None and bname not in module._non_persistent_buffers_set:
                    out.append((f"{mname}.{bname}" if mname else bname, buf))
        return out

    @property
    def layers(self) -> nn.ModuleList:
        return self.model.layers

    def new_prompt_states(self, capacity: int, exact: bool = False) -> list[Any]:
        """One empty state per layer, sized for ``capacity`` prompt positions; ``exact`` keeps what the exact
        reverse pass needs (e.g. recurrent states at chunk boundaries)."""
        return [layer.mixer.new_state(capacity, exact) for layer in self.model.layers]

    def head(self) -> tuple[Tensor, Tensor | None]:
        """(weight [V, H], bias) of the LM head, to read their shapes and dtypes; computing with them goes through
        ``lm_head(...)`` (a module call)."""
        return self.lm_head.weight, self.lm_head.bias

    # ------------------------------------------------------------------ forward
    def check_ids(self, ids: Tensor) -> None:
        """ValueError unless ``ids`` is an integer tensor of token ids inside the vocabulary."""
        if not isinstance(ids, Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"token ids must be an int64 tensor, got {type(ids).__name__} "
                             f"{getattr(ids, 'dtype', '')}".rstrip())
        if ids.numel() == 0:
            return
        lo, hi = int(ids.min()), int(ids.max())
        if lo < 0 or hi >= self.spec.vocab_size:
            bad = lo if lo < 0 else hi
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {self.spec.vocab_size})")

    def run(self, ids: Tensor, start: int = 0, prefix: list[Any] | None = None, *, need_hidden: bool = True,
            checkpoint_layers: bool = False, grad_from_layer: int | None = None,
            stop_at_layer: int | None = None):
        """Process new tokens ``ids [B, T]`` at positions ``start .. start+T-1`` after a prefix state.

        prefix: one entry per layer (what that layer's ``state.prefix()`` returned) or None for none.
        Returns ``(hidden [B, T, hidden] after the final norm, or None if not need_hidden; pieces)`` where
        ``pieces[l]`` is the state layer ``l`` produced for the new tokens. With ``need_hidden=False`` (prefill)
        the last layer's feed-forward block and the final norm are skipped: nothing reads them.

        Running part of the layers (the model offers the split, the caller decides where):

        * ``grad_from_layer=j`` (``0 <= j < L``): the embedding and layers ``< j`` run under ``no_grad``; the hidden
          entering layer ``j`` becomes a fresh leaf ``[B, T, hidden]`` that requires grad and layers ``>= j`` run
          as the caller's grad mode says. Returns ``(hidden, pieces, boundary)``: ``boundary`` is that leaf (None
          for ``j = 0``), whose ``.grad`` collects dL/d(hidden entering layer j) when the graph is back-propagated.
        * ``stop_at_layer=j`` (``0 <= j <= L``): only the embedding and layers ``< j`` run. Returns
          ``(x [B, T, hidden] entering layer j, pieces of layers < j)`` (no final norm).

        Both splits are one call (one :class:`CallContext`), so layers that read an earlier layer's per-call
        results (GLM-5's shared DSA layers) find them.
        """
        t = ids.shape[1]
        self.spec.check_length(start + t, f"tokens at positions {start}..{start + t - 1}")
        n = len(self.model.layers)
        if grad_from_layer is not None and not 0 <= grad_from_layer < n:
            raise ValueError(f"grad_from_layer={grad_from_layer} must be in [0, {n})")
        if stop_at_layer is not None and not 0 <= stop_at_layer <= n:
            raise ValueError(f"stop_at_layer={stop_at_layer} must be in [0, {n}]")
        if grad_from_layer is not None and stop_at_layer is not None:
            raise ValueError("grad_from_layer and stop_at_layer are exclusive")
        args = (ids, start, prefix, need_hidden, checkpoint_layers, grad_from_layer, stop_at_layer)
        if self.compute_dtype is None or _autocasting(ids.device.type):
            return self.model(*args)
        with torch.autocast(ids.device.type, dtype=self.compute_dtype):
            return self.model(*args)

    def use_master_weights(self, compute_dtype: torch.dtype, master_dtype: torch.dtype = torch.float32) -> None:
        """Keep the trained parameters in ``master_dtype`` (what the optimiser updates: float32 master weights,
        gradients and moments; frozen ones stay as they are: :meth:`cast_trained`) and compute every pass in
        ``compute_dtype`` under autocast: mixed precision in one process. (Under FSDP2 the same split comes from its
        MixedPrecisionPolicy instead: ``distributed.apply_fsdp``.)"""
        self.cast_trained(master_dtype)
        self.compute_dtype = compute_dtype if compute_dtype != master_dtype else None

    def cast_trained(self, dtype: torch.dtype) -> None:
        """Hold the trained parameters in ``dtype`` (master weights): the whole model when every parameter is
        trained (``self.to(dtype)``, buffers' own rules kept), else only those with ``requires_grad`` (LoRA: the
        frozen base keeps the compute dtype, the adapters become ``dtype``). Works on the meta device."""
        params = list(self.parameters())
        if all(p.requires_grad for p in params):
            self.to(dtype)
            return
        for p in params:
            if p.requires_grad and p.is_floating_point():
                p.data = p.data.to(dtype)

    def forward(self, input_ids: Tensor) -> Tensor:
        """HF-like full forward: ``input_ids [B, T]`` -> logits ``[B, T, vocab]``."""
        self.check_ids(input_ids)
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must be [batch, tokens], got shape {tuple(input_ids.shape)}")
        hidden, _ = self.run(input_ids)
        return self.lm_head(hidden)
