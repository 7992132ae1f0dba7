"""OLMo 2 (``olmo2``: OLMo-2-1B / 7B / 13B / 32B) and OLMo 3 (``olmo3``: OLMo-3-7B / 32B, Think / Instruct / RL-Zero).

As transformers' ``modeling_olmo2`` / ``modeling_olmo3`` compute them:

* post-norm blocks with no input norm: ``x + post_attention_layernorm(attn(x))``, then
  ``x + post_feedforward_layernorm(mlp(x))`` (:class:`PostNormDecoderLayer`);
* one RMSNorm over all heads' queries and one over all keys, before RoPE (``Attention(qk_norm="all")``); every
  RMSNorm multiplies by its weight in float32 before casting back;
* OLMo 3: ``layer_types`` (default: every fourth layer full, the others ``sliding_attention`` with
  ``sliding_window``, 4,096 in the releases) and a RoPE per layer type (``rope_parameters["full_attention"]`` /
  ``["sliding_attention"]``; the long-context releases scale the full layers' with YaRN), theta 500,000 where none
  is given; OLMo 2: one RoPE, every layer full.
"""

from __future__ import annotations

from torch import Tensor, nn

from longstraw.models.attention import Attention
from longstraw.models.config import ConfigReader, interleaved_windows, narrowest_window
from longstraw.models.context import CallContext
from longstraw.models.family import Family
from longstraw.models.mlp import GatedMLP
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, layer_type_ropes, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec

MODEL_TYPES = ("olmo2", "olmo3")


class PostNormDecoderLayer(DecoderLayer):
    """OLMo 2/3's block: the norms normalise the mixer's and the MLP's outputs (``post_attention_layernorm``,
    ``post_feedforward_layernorm``); the input is not normalised (``input_layernorm`` is an identity with no
    weights, as the checkpoints have none)."""

    def __init__(self, mixer: nn.Module, ffn: nn.Module, hidden: int, eps: float):
        super().__init__(mixer, ffn, nn.Identity(), RMSNorm(hidden, eps, weight_in_float32=True))
        self.post_feedforward_layernorm = RMSNorm(hidden, eps, weight_in_float32=True)

    def forward(self, x: Tensor, ctx: CallContext, prefix, need_ffn: bool = True):
        y, piece = self.mixer(x, ctx, prefix)
        x = x + self.post_attention_layernorm(y)
        if need_ffn:
            x = x + self.post_feedforward_layernorm(self.ffn(x))
        return x, piece


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised model from an HF config dict."""
    r = ConfigReader(cfg)
    mt = cfg["model_type"]
    n = r.positive("num_hidden_layers")
    hidden = r.positive("hidden_size")
    heads = r.positive("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads, int)
    head_dim = r.opt("head_dim", hidden // heads, int)
    # OLMo 3: every fourth layer full by default (transformers); OLMo 2: every layer full
    windows = (interleaved_windows(cfg, r, n, full_every=4, default_window=4096) if mt == "olmo3" else [None] * n)
    spec = ModelSpec(
        model_type=mt, vocab_size=r.positive("vocab_size"), hidden_size=hidden, num_layers=n,
        max_position_embeddings=r.positive("max_position_embeddings", 2048),
        tie_word_embeddings=r.opt("tie_word_embeddings", False, bool),
        eos_token_id=cfg.get("eos_token_id"), bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"), sliding_window=narrowest_window(windows),
    )
    eps = r.opt("rms_norm_eps", 1e-5, float)
    bias = r.opt("attention_bias", False, bool)
    layers = [
        PostNormDecoderLayer(
            Attention(hidden, heads, kv_heads, head_dim, qkv_bias=bias, o_bias=bias, qk_norm="all", norm_eps=eps,
                      window=w, local_rope=w is not None, qk_norm_weight_in_float32=True),
            GatedMLP(hidden, r.positive("intermediate_size"), r.opt("hidden_act", "silu", str)),
            hidden, eps,
        )
        for w in windows
    ]
    if mt == "olmo3":
        theta = cfg.get("rope_theta") or 500000.0
        full, local = layer_type_ropes(cfg, head_dim, full_theta=theta, local_theta=500000.0)
        rotary, local_rotary = RotaryEmbedding(full), RotaryEmbedding(local)
    else:
        rotary, local_rotary = RotaryEmbedding(rope_params_from_hf(cfg, head_dim)), None
    norm = RMSNorm(hidden, eps, weight_in_float32=True)
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, hidden, layers, norm, rotary, local_rotary=local_rotary))


FAMILY = Family("olmo", MODEL_TYPES, build)
