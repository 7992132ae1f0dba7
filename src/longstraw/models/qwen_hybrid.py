"""Hybrid linear-attention Qwen models: ``qwen3_next``, ``qwen3_5_text`` / ``qwen3_5``, ``qwen3_5_moe_text`` /
``qwen3_5_moe``.

Each decoder layer is either a Gated DeltaNet layer (``linear_attn``, :mod:`longstraw.models.deltanet`) or a gated
full-attention layer (``self_attn``: ``q_proj`` emits a per-head ``[query, gate]`` pair, zero-centred q/k RMSNorm,
partial RoPE, output times ``sigmoid(gate)``), as ``layer_types`` says (or, without it, every
``full_attention_interval``-th layer is full attention, the others linear). Every RMSNorm is zero-centred
(``1 + w``) except the DeltaNet output norm. Feed-forward blocks:

* ``qwen3_5_text``: dense SwiGLU everywhere;
* ``qwen3_5_moe_text``: sparse MoE everywhere (softmax top-k, always renormalised, sigmoid-gated shared expert);
* ``qwen3_next``: sparse MoE on layer ``i`` iff ``i not in mlp_only_layers`` and ``num_experts > 0`` and
  ``(i + 1) % decoder_sparse_step == 0`` (``norm_topk_prob`` as configured), dense SwiGLU otherwise.

Multimodal checkpoints (``qwen3_5`` / ``qwen3_5_moe``): the text model is read from ``text_config`` and the
weights under ``model.language_model.`` (``lm_head.weight`` at the top). The vision tower (``model.visual.*``) is
skipped with one warning; positions are the text positions, for which Qwen3.5's interleaved M-RoPE is exactly
ordinary RoPE. The model LongStraw builds IS the text model: ``model.hf_config`` is the text config with
``model_type`` ``qwen3_5_text`` / ``qwen3_5_moe_text``, so ``save_model`` writes a text-only checkpoint that
``AutoModelForCausalLM`` loads as ``Qwen3_5ForCausalLM`` / ``Qwen3_5MoeForCausalLM`` (see docs/HYBRID.md).

Checkpoints store routed experts one by one (``mlp.experts.{e}.{gate,up,down}_proj.weight``); in memory they are
fused as transformers 5 keeps them (``experts.gate_up_proj [E, 2I, H]``, ``experts.down_proj [E, H, I]``), so
our parameter names are those of the in-memory HF model and ``hf_grads`` needs no renaming. Multi-token-prediction
weights (``mtp.*``) are skipped with one warning.
"""

from __future__ import annotations

import re

from longstraw.models.attention import Attention
from longstraw.models.config import ConfigReader, multimodal_text_config, text_reader
from longstraw.models.deltanet import GatedDeltaNet
from longstraw.models.family import Family
from longstraw.models.mlp import GatedMLP
from longstraw.models.moe_block import qwen_moe_block
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec
from longstraw.models.weights import CheckpointReader, ExpertWeightMap, WeightSource, skip_qwen_visual

MODEL_TYPES = ("qwen3_next", "qwen3_5_text", "qwen3_5", "qwen3_5_moe_text", "qwen3_5_moe")
MULTIMODAL = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text"}
ARCHITECTURES = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5_text": "Qwen3_5ForCausalLM",
                 "qwen3_5_moe_text": "Qwen3_5MoeForCausalLM"}
LAYER_TYPES = ("linear_attention", "full_attention")


# ---------------------------------------------------------------------------------------------------- config


def text_config(cfg: dict) -> dict:
    """The config of the text model: ``cfg`` itself for the text types; for ``qwen3_5`` / ``qwen3_5_moe`` its
    ``text_config`` with ``model_type`` and ``architectures`` of the matching text-only causal LM."""
    return multimodal_text_config(cfg, MULTIMODAL, ARCHITECTURES)


def layer_types(cfg: dict, r: ConfigReader, n: int) -> list[str]:
    """``layer_types`` of the config, or derived from ``full_attention_interval`` (default 4) as HF does."""
    types = cfg.get("layer_types")
    if types is None:
        interval = r.positive("full_attention_interval", 4)
        return ["full_attention" if (i + 1) % interval == 0 else "linear_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n:
        raise ValueError(f"{r.where}: layer_types must list one entry per layer (num_hidden_layers={n}), got "
                         f"{types!r}")
    bad = sorted({t for t in types if t not in LAYER_TYPES})
    if bad:
        raise ValueError(f"{r.where}: layer_types {bad} are not supported for {cfg['model_type']}; supported: "
                         f"{list(LAYER_TYPES)}")
    return list(types)


def _rope_config(cfg: dict) -> dict:
    """HF defaults ``partial_rotary_factor`` to 0.25 for these families when the config does not say."""
    rp = cfg.get("rope_parameters")
    if "partial_rotary_factor" in cfg or (isinstance(rp, dict) and "partial_rotary_factor" in rp):
        return cfg
    return {**cfg, "partial_rotary_factor": 0.25}


def tiny_config(**overrides) -> dict:
    """HF config dict of a tiny dense Qwen3.5 hybrid (``qwen3_5_text``) for demos, tests and benchmarks.

    Defaults: hidden 64, 4 layers of which the last is full attention (``full_attention_interval`` 4; 2 query heads,
    1 K/V head of dim 16, RoPE on 4 of the 16 dims) and three Gated DeltaNet layers (2 key heads, 4 value heads,
    dims 16, conv kernel 4), SwiGLU 128, tied embeddings, vocabulary 259 (bytes + 3 specials). Any key can be
    overridden; ``layer_types`` is derived from ``num_hidden_layers`` and ``full_attention_interval`` unless given.
    The result loads in transformers (``Qwen3_5TextConfig``) and LongStraw alike.
    """
    cfg = {
        "model_type": "qwen3_5_text",
        "architectures": ["Qwen3_5ForCausalLM"],
        "vocab_size": 259,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 4,
        "full_attention_interval": 4,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "head_dim": 16,
        "attention_bias": False,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "linear_key_head_dim": 16,
        "linear_value_head_dim": 16,
        "linear_conv_kernel_dim": 4,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 32768,
        "rope_parameters": {"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.25},
        "tie_word_embeddings": True,
        "initializer_range": 0.02,
        "bos_token_id": None,
        "eos_token_id": None,
        "pad_token_id": None,
    }
    cfg.update(overrides)
    if "layer_types" not in overrides:
        n, k = cfg["num_hidden_layers"], cfg["full_attention_interval"]
        cfg["layer_types"] = ["full_attention" if (i + 1) % k == 0 else "linear_attention" for i in range(n)]
    return cfg


# ---------------------------------------------------------------------------------------------------- build


def _is_moe_layer(mt: str, cfg: dict, r: ConfigReader, i: int) -> bool:
    if mt == "qwen3_5_text":
        return False
    if mt == "qwen3_5_moe_text":
        return True
    only = cfg.get("mlp_only_layers") or []
    step = r.positive("decoder_sparse_step", 1)
    return i not in only and r.opt("num_experts", 0, int) > 0 and (i + 1) % step == 0


def _either(text: dict, cfg: dict, key: str):
    """A token id from the text config, else from the multimodal config around it."""
    return text[key] if text.get(key) is not None else cfg.get(key)


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised hybrid model from an HF config dict (text or multimodal)."""
    text = text_config(cfg)
    mt = text["model_type"]
    r = text_reader(text, cfg)
    n = r.positive("num_hidden_layers")
    types = layer_types(text, r, n)
    hidden = r.positive("hidden_size")
    spec = ModelSpec(
        model_type=mt, vocab_size=r.positive("vocab_size"), hidden_size=hidden, num_layers=n,
        max_position_embeddings=r.positive("max_position_embeddings", 32768),
        tie_word_embeddings=r.opt("tie_word_embeddings", False, bool),
        eos_token_id=_either(text, cfg, "eos_token_id"),
        bos_token_id=_either(text, cfg, "bos_token_id"),
        pad_token_id=_either(text, cfg, "pad_token_id"),
    )
    eps = r.opt("rms_norm_eps", 1e-6, float)
    act = r.opt("hidden_act", "silu", str)
    heads = r.positive("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads, int)
    head_dim = r.positive("head_dim", 256)
    attn_bias = r.opt("attention_bias", False, bool)
    lin = dict(num_k_heads=r.positive("linear_num_key_heads", 16), num_v_heads=r.positive("linear_num_value_heads", 32),
               head_k_dim=r.positive("linear_key_head_dim", 128), head_v_dim=r.positive("linear_value_head_dim", 128))
    conv_k = r.positive("linear_conv_kernel_dim", 4)
    layout = "qwen3_next" if mt == "qwen3_next" else "qwen3_5"

    layers = []
    for i, lt in enumerate(types):
        if lt == "linear_attention":
            mixer = GatedDeltaNet(hidden, **lin, conv_kernel=conv_k, norm_eps=eps, activation=act, layout=layout)
            name = "linear_attn"
        else:
            mixer = Attention(hidden, heads, kv_heads, head_dim, qkv_bias=attn_bias, o_bias=attn_bias, qk_norm=True,
                              qk_norm_zero_centered=True, norm_eps=eps, output_gate=True)
            name = "self_attn"
        if _is_moe_layer(mt, text, r, i):
            norm_topk = True if mt == "qwen3_5_moe_text" else r.opt("norm_topk_prob", True, bool)
            ffn = qwen_moe_block(hidden, r.positive("num_experts"), r.positive("num_experts_per_tok"),
                                 r.positive("moe_intermediate_size"), r.opt("shared_expert_intermediate_size", 0, int),
                                 norm_topk, act)
        else:
            ffn = GatedMLP(hidden, r.positive("intermediate_size"), act)
        layers.append(DecoderLayer(mixer, ffn, RMSNorm(hidden, eps, zero_centered=True),
                                   RMSNorm(hidden, eps, zero_centered=True), mixer_name=name))
    rotary = RotaryEmbedding(rope_params_from_hf(_rope_config(text), head_dim))
    backbone = Backbone(spec.vocab_size, hidden, layers, RMSNorm(hidden, eps, zero_centered=True), rotary)
    return CausalLM(spec, text, backbone)


# ---------------------------------------------------------------------------------------------------- weights

_MTP = r"(model\.)?mtp\..*"


class HybridWeightMap(ExpertWeightMap):
    """Names of the hybrid checkpoints: ``model.language_model.`` -> ``model.``, vision tower and MTP skipped with
    one warning each (a checkpoint of MTP weights only is refused), experts fused/split by
    :class:`~longstraw.models.weights.ExpertWeightMap`."""

    def sources(self, ckpt_names: list[str], reader: CheckpointReader) -> list[WeightSource]:
        used = [n for n in ckpt_names if self.param_name(n) is not None]
        mtp = [n for n in ckpt_names if re.fullmatch(_MTP, n)]
        if mtp and not used:
            raise ValueError(f"this checkpoint holds only multi-token-prediction weights ({len(mtp)} tensors, e.g. "
                             f"{mtp[0]}); LongStraw trains the main model and does not support MTP heads: point to "
                             "the main checkpoint")
        return super().sources(ckpt_names, reader)


def weights(cfg: dict) -> HybridWeightMap:
    wm = skip_qwen_visual(HybridWeightMap())
    wm.skip_with_warning.append((_MTP, "multi-token-prediction (MTP) weights are not used by LongStraw"))
    return wm


FAMILY = Family("qwen_hybrid", MODEL_TYPES, build, weights)
