"""Dense GQA transformers: ``llama``, ``qwen2``, ``qwen3``, ``mistral``.

They differ only in switches of the shared blocks: attention/MLP bias (Llama's ``attention_bias`` and
``mlp_bias``), Qwen2's q/k/v bias, Qwen3's per-head q/k RMSNorm and free ``head_dim``. Sliding-window attention
(Mistral's ``sliding_window``, transformers' default 4096; Qwen2/Qwen3's ``use_sliding_window`` for the layers from
``max_window_layers`` on) is per layer, as transformers decides it (:func:`layer_windows`); the attention op tiles
the queries so that no key outside a window is read (:mod:`longstraw.ops.window`).
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
        sliding_window=narrowest_window(layer_windows(cfg, r)),
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
    if types is not None and mt in ("qwen2", "qwen3", "qwen2_moe") and len(types) != n:
        raise ValueError(f"{r.where}: layer_types has {len(types)} entries for num_hidden_layers={n}")
    window = cfg.get("sliding_window")
    on = bool(cfg.get("use_sliding_window"))
    if mt in ("mistral", "mixtral"):
        slides = [window is not None] * n
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
    if any(slides) and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
        raise ValueError(f"{r.where}: sliding_window={window!r} must be an integer >= 2 when layers slide "
                         f"(layers {[i for i, x in enumerate(slides) if x]})")
    return [window if x else None for x in slides]


def narrowest_window(windows: list[int | None]) -> int | None:
    """The narrowest window of any sliding layer (None: no layer slides), for :class:`ModelSpec`."""
    return min((w for w in windows if w is not None), default=None)


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
                      qk_norm=qk_norm, norm_eps=eps, window=window),
            GatedMLP(spec.hidden_size, inter, act, bias=mlp_bias),
            RMSNorm(spec.hidden_size, eps),
            RMSNorm(spec.hidden_size, eps),
        )
        for window in layer_windows(cfg, r)
    ]
    rotary = RotaryEmbedding(rope_params_from_hf(cfg, head_dim))
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, spec.hidden_size, layers, RMSNorm(spec.hidden_size, eps),
                                        rotary))


FAMILY = Family("dense", MODEL_TYPES, build)
