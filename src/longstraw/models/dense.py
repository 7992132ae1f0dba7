"""Dense GQA transformers: ``llama``, ``qwen2``, ``qwen3``, ``mistral``.

They differ only in switches of the shared blocks: attention/MLP bias (Llama's ``attention_bias`` and
``mlp_bias``), Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm and free ``head_dim``. Sliding-window attention is
not implemented; it is off in the released Qwen2/Qwen3/Llama checkpoints, but Mistral's configs carry
``sliding_window=4096`` (transformers' default) and Qwen2/Qwen3 configs may turn it on. Such a model is accepted and
its :class:`~longstraw.models.transformer.ModelSpec` records the window: every sequence that fits in the window is
computed exactly (a token then sees every earlier token either way), and a longer one is a ``ValueError`` naming the
window (``ModelSpec.check_length``).
"""

from __future__ import annotations

from longstraw.models.attention import Attention
from longstraw.models.config import ConfigReader
from longstraw.models.family import Family
from longstraw.models.mlp import GatedMLP
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec

MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def model_spec(cfg: dict, r: ConfigReader) -> ModelSpec:
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
        sliding_window=sliding_window(cfg, r),
    )


def sliding_window(cfg: dict, r: ConfigReader) -> int | None:
    """The attention window if any layer slides (None: every layer attends all earlier tokens), as transformers
    decides it: Mistral's and Mixtral's ``sliding_window``; Qwen2/Qwen3's ``use_sliding_window`` for the layers from
    ``max_window_layers`` on; Qwen3-MoE's ``use_sliding_window`` for every layer; Qwen2-MoE's for the even layers
    below ``max_window_layers``; or ``layer_types`` naming ``sliding_attention`` layers."""
    mt = cfg["model_type"]
    types = cfg.get("layer_types") or []
    bad = sorted({t for t in types if t not in ("full_attention", "sliding_attention")})
    if bad:
        raise ValueError(f"{r.where}: layer_types {bad} are not supported for {mt}; supported: "
                         "['full_attention', 'sliding_attention']")
    window = cfg.get("sliding_window")
    on = bool(cfg.get("use_sliding_window"))
    if types:
        slides = "sliding_attention" in types
    elif mt in ("mistral", "mixtral"):
        slides = window is not None
    elif mt in ("qwen2", "qwen3"):
        slides = on and window is not None and r.opt("max_window_layers", 0, int) < r.positive("num_hidden_layers")
    elif mt == "qwen3_moe":
        slides = on and window is not None
    elif mt == "qwen2_moe":  # transformers' layer_types: layer i slides iff i is even, i < max_window_layers
        slides = on and r.opt("max_window_layers", 28, int) > 0
    else:
        slides = False
    if not slides:
        return None
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"{r.where}: sliding_window={window!r} must be an integer >= 1 (or null) when layers slide")
    return window


def build(cfg: dict) -> CausalLM:
    r = ConfigReader(cfg)
    mt = cfg["model_type"]
    spec = model_spec(cfg, r)
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
    else:  # llama, mistral
        attn_bias = r.opt("attention_bias", False, bool)
        qkv_bias, o_bias, mlp_bias, qk_norm = attn_bias, attn_bias, r.opt("mlp_bias", False, bool), False
    layers = [
        DecoderLayer(
            Attention(spec.hidden_size, heads, kv_heads, head_dim, qkv_bias=qkv_bias, o_bias=o_bias,
                      qk_norm=qk_norm, norm_eps=eps),
            GatedMLP(spec.hidden_size, inter, act, bias=mlp_bias),
            RMSNorm(spec.hidden_size, eps),
            RMSNorm(spec.hidden_size, eps),
        )
        for _ in range(spec.num_layers)
    ]
    rotary = RotaryEmbedding(rope_params_from_hf(cfg, head_dim))
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, spec.hidden_size, layers, RMSNorm(spec.hidden_size, eps),
                                        rotary))


FAMILY = Family("dense", MODEL_TYPES, build)
