"""Dense GQA transformers: ``llama``, ``qwen2``, ``qwen3``, ``mistral``, ``ministral``, ``ministral3`` (and the
text model of the multimodal ``mistral3`` checkpoints: Mistral Small 3.x, Ministral 3), ``seed_oss`` (ByteDance
Seed-OSS-36B, 512K positions), and the text model of the dense Qwen3-VL checkpoints (``qwen3_vl``: a Qwen3 whose
interleaved M-RoPE is ordinary RoPE at text positions, as Qwen3.5's; built and saved as ``qwen3``).

They differ only in switches of the shared blocks: attention/MLP bias (Llama's ``attention_bias`` and
``mlp_bias``; Seed-OSS's q/k/v bias ``attention_bias``, default on, and o_proj bias ``attention_out_bias``), Qwen2's
q/k/v bias, Qwen3's per-head q/k RMSNorm and free ``head_dim``, Ministral 3's query scaling
with the position (``rope_parameters["llama_4_scaling_beta"]``: queries times
``1 + beta log(1 + floor(p / original_max_position_embeddings))``, after RoPE). Sliding-window attention
(Mistral's ``sliding_window``, transformers' default 4096; Ministral's ``layer_types``; Qwen2/Qwen3's
``use_sliding_window`` for the layers from ``max_window_layers`` on) is per layer, as transformers decides it
(:func:`layer_windows`); the attention op tiles the queries so that no key outside a window is read
(:mod:`longstraw.ops.window`). ``mistral3`` checkpoints hold the text weights under ``model.language_model.`` (or
the released ``language_model.model.``); the vision tower and projector are skipped with a warning (Qwen3-VL's:
``model.language_model.`` and ``model.visual.``). Dropout
(Seed-OSS's ``residual_dropout`` and ``attention_dropout``, 0.1 in its released config) is not applied: every pass
computes the eval-mode forward, what the sampler computes (transformers applies it in train mode only).
"""

from __future__ import annotations

from longstraw.models.attention import Attention
from longstraw.models.config import (ConfigReader, known_text_config, multimodal_text_config, narrowest_window,
                                     text_reader, windows_of)
from longstraw.models.family import Family
from longstraw.models.mlp import GatedMLP
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec
from longstraw.models.weights import WeightMap, skip_qwen_visual, skip_vision_tower

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "ministral", "ministral3", "mistral3", "seed_oss", "qwen3_vl")
_ARCHITECTURES = {"mistral": "MistralForCausalLM", "ministral3": "Ministral3ForCausalLM"}


def text_config(cfg: dict) -> dict:
    """``cfg``, or for a multimodal ``mistral3`` checkpoint its text model's (``text_config``: ``mistral`` or
    ``ministral3``), for a ``qwen3_vl`` one its text model's as ``qwen3`` (the same layers; what ``save_model``
    writes, and transformers loads as ``Qwen3ForCausalLM``)."""
    if cfg.get("model_type") == "qwen3_vl":
        return multimodal_text_config(cfg, {"qwen3_vl": "qwen3"}, {"qwen3": "Qwen3ForCausalLM"})
    return known_text_config(cfg, "mistral3", {k: k for k in _ARCHITECTURES}, "mistral", _ARCHITECTURES,
                             tie_default=True)


def model_spec(cfg: dict, r: ConfigReader, windows: list[int | None]) -> ModelSpec:
    return ModelSpec(
        model_type=cfg["model_type"],
        vocab_size=r.positive("vocab_size"),
        hidden_size=r.positive("hidden_size"),
        num_layers=r.positive("num_hidden_layers"),
        max_position_embeddings=r.positive("max_position_embeddings", 2048),
        tie_word_embeddings=r.opt("tie_word_embeddings", False, bool),
        eos_token_id=cfg.get("eos_token_id"),
        bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"),
        sliding_window=narrowest_window(windows),
    )


def layer_windows(cfg: dict, r: ConfigReader) -> list[int | None]:
    """Each layer's attention window (None: the layer attends every earlier token), as transformers decides it:
    Mistral's and Mixtral's ``sliding_window`` for every layer (their ``layer_types`` are ignored, as transformers
    ignores them); Qwen3-MoE's ``use_sliding_window`` for every layer; Qwen2/Qwen3's and Qwen2-MoE's ``layer_types``,
    whose defaults are the layers from ``max_window_layers`` on (Qwen2/Qwen3: with ``use_sliding_window``) and the
    even layers below ``max_window_layers`` (Qwen2-MoE); other model types have no window."""
    mt = cfg["model_type"]
    n = r.positive("num_hidden_layers")
    types = cfg.get("layer_types")
    bad = sorted({t for t in types or [] if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ValueError(f"{r.where}: layer_types {bad} are not supported for {mt}; supported: "
                         "['full_attention', 'sliding_attention']")
    if types is not None and mt in ("qwen2", "qwen3", "qwen2_moe", "ministral") and len(types) != n:
        raise ValueError(f"{r.where}: layer_types has {len(types)} entries for num_hidden_layers={n}")
    window = cfg.get("sliding_window")
    on = bool(cfg.get("use_sliding_window"))
    if mt in ("mistral", "mixtral", "ministral3"):
        slides = [window is not None] * n
    elif mt == "ministral":  # layer_types (default: every layer sliding when a window is set)
        slides = ([t == "sliding_attention" for t in types] if types is not None else [window is not None] * n)
    elif mt == "qwen3_moe":
        slides = [on and window is not None] * n
    elif mt in ("qwen2", "qwen3"):
        if not on:
            window = None  # transformers drops the window (a layer typed sliding then attends everything)
        lo = r.opt("max_window_layers", 28, int)
        slides = ([t == "sliding_attention" for t in types] if types is not None
                  else [window is not None and i >= lo for i in range(n)])
        slides = [x and window is not None for x in slides]
    elif mt == "qwen2_moe":
        lo = r.opt("max_window_layers", 28, int)
        slides = ([t == "sliding_attention" for t in types] if types is not None
                  else [on and i % 2 == 0 and i < lo for i in range(n)])
        window = window if on else 0  # transformers' value for a sliding layer without use_sliding_window
    else:
        slides = [False] * n
    return windows_of(slides, window, r)


def _position_q_scale(cfg: dict) -> tuple[float, int] | None:
    """Ministral 3's ``(llama_4_scaling_beta, original_max_position_embeddings)`` from its RoPE settings, if set."""
    rp = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    beta, span = rp.get("llama_4_scaling_beta"), rp.get("original_max_position_embeddings")
    if beta is None:
        return None
    if isinstance(span, bool) or not isinstance(span, int) or span < 1:
        raise ValueError(f"config.json: llama_4_scaling_beta needs original_max_position_embeddings >= 1 in the "
                         f"RoPE settings, got {span!r}")
    return float(beta), span


def build(cfg: dict) -> CausalLM:
    text = text_config(cfg)
    r, cfg = text_reader(text, cfg), text  # the text model's config from here on (mistral3: its text_config)
    mt = cfg["model_type"]
    windows = layer_windows(cfg, r)
    spec = model_spec(cfg, r, windows)
    heads = r.positive("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads, int)
    head_dim = r.opt("head_dim", spec.hidden_size // heads, int)
    eps = r.opt("rms_norm_eps", 1e-6, float)
    act = r.opt("hidden_act", "silu", str)
    inter = r.positive("intermediate_size")
    if mt == "qwen2":
        qkv_bias, o_bias, mlp_bias, qk_norm = True, False, False, False
    elif mt == "qwen3":
        attn_bias = r.opt("attention_bias", False, bool)
        qkv_bias, o_bias, mlp_bias, qk_norm = attn_bias, attn_bias, False, True
    elif mt == "seed_oss":
        qkv_bias, o_bias = r.opt("attention_bias", True, bool), r.opt("attention_out_bias", False, bool)
        mlp_bias, qk_norm = r.opt("mlp_bias", False, bool), False
    else:  # llama, mistral, ministral, ministral3
        attn_bias = r.opt("attention_bias", False, bool)
        qkv_bias, o_bias, mlp_bias, qk_norm = attn_bias, attn_bias, r.opt("mlp_bias", False, bool), False
    q_scale = _position_q_scale(cfg) if mt == "ministral3" else None
    layers = [
        DecoderLayer(
            Attention(spec.hidden_size, heads, kv_heads, head_dim, qkv_bias=qkv_bias, o_bias=o_bias,
                      qk_norm=qk_norm, norm_eps=eps, window=window, position_q_scale=q_scale),
            GatedMLP(spec.hidden_size, inter, act, bias=mlp_bias),
            RMSNorm(spec.hidden_size, eps),
            RMSNorm(spec.hidden_size, eps),
        )
        for window in windows
    ]
    rotary = RotaryEmbedding(rope_params_from_hf(cfg, head_dim))
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, spec.hidden_size, layers, RMSNorm(spec.hidden_size, eps),
                                        rotary))


def weights(cfg: dict) -> WeightMap:
    """transformers' names; a ``mistral3`` or ``qwen3_vl`` checkpoint's text weights renamed, its vision tower
    skipped."""
    if cfg.get("model_type") == "qwen3_vl":
        return skip_qwen_visual(WeightMap())
    return skip_vision_tower(WeightMap()) if cfg.get("model_type") == "mistral3" else WeightMap()


FAMILY = Family("dense", MODEL_TYPES, build, weights)
