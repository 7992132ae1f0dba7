"""Gemma 3 (``gemma3_text``: Gemma-3-1B and the text models; ``gemma3``: the text weights of the multimodal 4B / 12B /
27B checkpoints).

As transformers' ``modeling_gemma3`` computes it:

* embeddings scaled by ``sqrt(hidden_size)`` (the scale rounded to float32, then to the weights' dtype, as
  transformers' buffer is);
* every RMSNorm zero-centred (``x * (1 + w)`` in float32, then cast), q/k norms per head included;
* sandwich norms: ``x + post_attention_layernorm(attn(input_layernorm(x)))``, then
  ``x + post_feedforward_layernorm(mlp(pre_feedforward_layernorm(x)))`` (:class:`GemmaDecoderLayer`);
* attention scores scaled by ``query_pre_attn_scalar ** -0.5`` (not ``head_dim``), GELU-tanh gated MLP;
* ``layer_types`` (default: every ``sliding_window_pattern``-th layer (6) full, the others sliding) with
  ``sliding_window`` (512 for 1B, 1024 for the larger releases) on the sliding ones, and two RoPEs: the full layers'
  (``rope_parameters["full_attention"]``: theta 1e6, linear scaling 8 in the 4B+ releases) and the sliding layers'
  (``rope_parameters["sliding_attention"]``: theta 1e4). transformers 4's ``config.json`` keys (``rope_theta``,
  ``rope_local_base_freq``, ``rope_scaling`` for the full layers) are read too.

The multimodal checkpoints' text weights sit under ``model.language_model.`` (transformers 5) or
``language_model.model.`` (the released files); the vision tower and projector are skipped with a warning and
``save_model`` writes the text model (``gemma3_text``).

Refused with a ValueError: Gemma 2's soft-capping (``attn_logit_softcapping``, ``final_logit_softcapping``) and
bidirectional attention (``use_bidirectional_attention``: an encoder use).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from longstraw.models.attention import Attention
from longstraw.models.config import (ConfigReader, interleaved_windows, multimodal_text_config, narrowest_window,
                                     text_reader)
from longstraw.models.context import CallContext
from longstraw.models.family import Family
from longstraw.models.mlp import GatedMLP
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, layer_type_ropes
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec
from longstraw.models.weights import WeightMap, skip_vision_tower

MODEL_TYPES = ("gemma3_text", "gemma3")
MULTIMODAL = {"gemma3": "gemma3_text"}
ARCHITECTURES = {"gemma3_text": "Gemma3ForCausalLM"}


class ScaledEmbedding(nn.Embedding):
    """``embed_tokens``: the rows times ``scale`` (rounded to float32, then to the weights' dtype)."""

    def __init__(self, vocab: int, hidden: int, scale: float):
        super().__init__(vocab, hidden)
        self.scale = scale

    def forward(self, ids: Tensor) -> Tensor:
        s = torch.tensor(self.scale, dtype=torch.float32, device=self.weight.device).to(self.weight.dtype)
        return super().forward(ids) * s


class GemmaDecoderLayer(DecoderLayer):
    """The sandwich-norm block (module docstring): ``post_attention_layernorm`` normalises the mixer's output;
    ``pre_feedforward_layernorm`` / ``post_feedforward_layernorm`` wrap the MLP."""

    def __init__(self, mixer: nn.Module, ffn: nn.Module, hidden: int, eps: float):
        super().__init__(mixer, ffn, RMSNorm(hidden, eps, zero_centered=True), RMSNorm(hidden, eps, zero_centered=True))
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps, zero_centered=True)
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, zero_centered=True)

    def forward(self, x: Tensor, ctx: CallContext, prefix, need_ffn: bool = True):
        y, piece = self.mixer(self.input_layernorm(x), ctx, prefix)
        x = x + self.post_attention_layernorm(y)
        if need_ffn:
            x = x + self.post_feedforward_layernorm(self.ffn(self.pre_feedforward_layernorm(x)))
        return x, piece


def _refuse(text: dict, r: ConfigReader) -> None:
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        if text.get(key) is not None:
            raise ValueError(f"{r.where}: {key}={text[key]!r} is not supported (Gemma 2's soft-capping); Gemma 3 "
                             "configs leave it null")
    if text.get("use_bidirectional_attention"):
        raise ValueError(f"{r.where}: use_bidirectional_attention=true is not supported (causal language models "
                         "only)")


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised model from an HF config dict (``gemma3_text`` or the multimodal ``gemma3``)."""
    text = multimodal_text_config(cfg, MULTIMODAL, ARCHITECTURES, tie_default=True)
    r = text_reader(text, cfg)
    _refuse(text, r)
    n = r.positive("num_hidden_layers")
    hidden = r.positive("hidden_size")
    heads = r.positive("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads, int)
    head_dim = r.opt("head_dim", hidden // heads, int)
    windows = interleaved_windows(text, r, n, full_every=r.positive("sliding_window_pattern", 6),
                                  default_window=4096)
    spec = ModelSpec(
        model_type="gemma3_text", vocab_size=r.positive("vocab_size"), hidden_size=hidden, num_layers=n,
        max_position_embeddings=r.positive("max_position_embeddings", 131072),
        tie_word_embeddings=r.opt("tie_word_embeddings", True, bool),
        eos_token_id=text.get("eos_token_id", cfg.get("eos_token_id")),
        bos_token_id=text.get("bos_token_id", cfg.get("bos_token_id")),
        pad_token_id=text.get("pad_token_id", cfg.get("pad_token_id", 0)),
        sliding_window=narrowest_window(windows),
    )
    eps = r.opt("rms_norm_eps", 1e-6, float)
    scalar = r.opt("query_pre_attn_scalar", 256, (int, float))
    if scalar <= 0:
        raise ValueError(f"{r.where}: query_pre_attn_scalar={scalar} must be > 0")
    act = r.opt("hidden_activation", None, str) or r.opt("hidden_act", "gelu_pytorch_tanh", str)
    bias = r.opt("attention_bias", False, bool)
    inter = r.positive("intermediate_size")
    layers = [
        GemmaDecoderLayer(
            Attention(hidden, heads, kv_heads, head_dim, qkv_bias=bias, o_bias=bias, qk_norm=True,
                      qk_norm_zero_centered=True, norm_eps=eps, window=w, scale=float(scalar) ** -0.5,
                      local_rope=w is not None),
            GatedMLP(hidden, inter, act),
            hidden, eps,
        )
        for w in windows
    ]
    full, local = layer_type_ropes(text, head_dim, full_theta=text.get("rope_theta") or 1e6,
                                   local_theta=text.get("rope_local_base_freq") or 1e4)
    backbone = Backbone(spec.vocab_size, hidden, layers, RMSNorm(hidden, eps, zero_centered=True),
                        RotaryEmbedding(full), local_rotary=RotaryEmbedding(local),
                        embedding=ScaledEmbedding(spec.vocab_size, hidden, hidden**0.5))
    return CausalLM(spec, text, backbone)


def weights(cfg: dict) -> WeightMap:
    """transformers' names; the multimodal checkpoints' text weights (``model.language_model.`` or the released
    ``language_model.model.``) renamed to ``model.``, the vision tower and projector skipped with one warning."""
    return skip_vision_tower(WeightMap())


FAMILY = Family("gemma3", MODEL_TYPES, build, weights)
