"""Ling 3.0 (``bailing_hybrid``): Kimi Delta Attention hybrid with gated MLA and DeepSeek-style MoE.

The layers come in groups of ``layer_group_size`` (default 6): the last of each group mixes tokens with
Multi-head Latent Attention (``"full_attention"``), the others with Kimi Delta Attention (``"linear_attention"``);
``layer_types`` wins when the config gives it. Both sit under ``self_attn`` as in transformers'
``BailingHybridForCausalLM``:

* KDA (:mod:`longstraw.models.kda`) with full-rank gates: ``forget_gate.f_proj`` and ``g_proj`` (``hidden -> H D``,
  where Kimi-Linear has rank-``D`` bottlenecks), ``forget_gate.A_log [H]``, and the bounded "safe" forget gate
  ``kda_lower_bound * sigmoid(exp(A_log) * (f_proj(x) + dt_bias))`` unless ``kda_safe_gate`` is false (then
  Kimi-Linear's ``-exp(A_log) * softplus(...)``). Heads: ``linear_num_heads`` (else ``num_attention_heads``), size
  ``linear_head_dim`` (else ``head_dim``, default 128), conv kernel ``linear_conv_kernel_dim`` (else
  ``short_conv_kernel_size``, default 4), as transformers' config derives them.
* MLA (:mod:`longstraw.models.mla`) with full-rank queries (``q_proj``), or low-rank ones where the config sets
  ``q_lora_rank`` (``q_a_proj`` -> ``q_a_layernorm`` -> ``q_b_proj``, as DeepSeek-V3's: Ling-3.0-tiny's config has
  ``q_lora_rank: 256``, and the released model code reads it; transformers 5.23's port builds ``q_proj`` whatever
  it says, so it cannot load such a checkpoint), interleaved RoPE (``rope_theta`` default 6e6; yarn's mscale in the
  softmax scale as DeepSeek-V3's) and a sigmoid gate per head and token on the attention output (``g_proj: hidden
  -> heads``; ``gated_attention_proj_granularity_type`` other than ``"head_wise"``, the released configs' value,
  is refused).

Feed-forward: SwiGLU where ``mlp_layer_types`` says ``"dense"`` (else the first ``first_k_dense_replace``, default
2), the others DeepSeek-V3's sigmoid-routed, group-limited MoE (:mod:`longstraw.models.deepseek`), its keys spelled
as Ling's configs spell them (``num_experts``, ``num_experts_per_token``, ``num_shared_experts``,
``num_expert_group``, ``moe_renormalize``; transformers' DeepSeek-style aliases read where Ling's key is not set,
as transformers reads them), ``model_max_length`` the context length (``max_position_embeddings``, what
``longstraw plan --max-positions`` sets, wins where both are, as for Kimi-Linear). transformers' model never ties
the head: ``tie_word_embeddings: true`` is refused.

Weights: our parameter names are transformers' in-memory ones. The released checkpoints (and what
transformers' ``save_pretrained`` writes) name the embedding ``model.word_embeddings``, every mixer
``attention`` with its output projection ``dense``, keep the forget gate's tensors directly under it and the short
conv as ``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``, and the router's bias ``expert_bias``; the experts are stored
one by one (``mlp.experts.{e}.{gate,up,down}_proj``). :class:`BailingWeightMap` reads both layouts and writes the
released one; multi-token-prediction layers (``num_nextn_predict_layers``) are skipped with one warning. In bf16
and fp16 models the short convs and the forget gates' ``dt_bias`` / ``A_log`` stay float32, as transformers keeps
them (``_keep_in_fp32_modules_strict``; :mod:`longstraw.models.keep_fp32`), and so does the router's bias.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from longstraw.models.config import ConfigReader
from longstraw.models.deepseek import _moe_block
from longstraw.models.family import Family
from longstraw.models.kda import KEPT_BY_LING, KimiDeltaAttention
from longstraw.models.keep_fp32 import keep_in_float32
from longstraw.models.kimi import (KimiWeightMap, _max_positions, _reader, checked_layer_types, moe_keys,
                                  sparse_layers)
from longstraw.models.mla import MLAttention, mla_softmax_scale
from longstraw.models.mlp import GatedMLP
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec

MODEL_TYPES = ("bailing_hybrid",)

# BailingHybridConfig's defaults for what a config may leave out (under Ling's key or transformers' alias for it,
# as Kimi-Linear's: ``kimi._ALIASES``)
_HF_DEFAULTS = {"num_experts": 512, "num_experts_per_token": 8, "num_shared_experts": 1, "num_expert_group": 8,
                "topk_group": 4, "moe_renormalize": True, "routed_scaling_factor": 2.5, "moe_intermediate_size": 768,
                "intermediate_size": 6144, "model_max_length": 262144, "kv_lora_rank": 512,
                "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "head_dim": 128,
                "num_attention_heads": 32, "rms_norm_eps": 1e-6, "first_k_dense_replace": 2,
                "short_conv_kernel_size": 4, "layer_group_size": 6, "rope_theta": 6_000_000.0}


def layer_types(cfg: dict, r: ConfigReader, n: int) -> list[str]:
    """Each layer's mixer: ``layer_types``, else the last of every ``layer_group_size`` layers is MLA."""
    types = cfg.get("layer_types")
    if types is None:
        group = r.positive("layer_group_size")
        types = ["full_attention" if (i + 1) % group == 0 else "linear_attention" for i in range(n)]
    return checked_layer_types(types, r, n)


def _linear_attn(r: ConfigReader) -> dict:
    """KDA's heads, head size, conv kernel and forget gate, as transformers' config derives them."""
    cfg = r.cfg
    heads = cfg.get("linear_num_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("linear_head_dim", cfg["head_dim"])
    kernel = cfg.get("linear_conv_kernel_dim", cfg["short_conv_kernel_size"])
    lin = ConfigReader({"linear_num_heads": heads, "linear_head_dim": head_dim, "linear_conv_kernel_dim": kernel},
                       r.where)
    safe = r.opt("kda_safe_gate", True, bool)
    bound = r.opt("kda_lower_bound", -5.0, float) if safe else None
    if bound is not None and bound >= 0:
        raise ValueError(f"{r.where}: kda_lower_bound={bound!r} must be < 0 (the forget gate's floor in log space)")
    return dict(num_heads=lin.positive("linear_num_heads"), head_dim=lin.positive("linear_head_dim"),
                conv_kernel=lin.positive("linear_conv_kernel_dim"), full_rank_gates=True, gate_lower_bound=bound)


def tiny_config(**overrides) -> dict:
    """HF config dict of a tiny Ling 3.0 hybrid for tests and benchmarks: hidden 32, 4 layers (KDA, MLA, KDA, MLA;
    the first dense, the others MoE with 8 experts in 2 groups, 2 per token, one shared), KDA with 2 heads of 8
    and the safe gate, gated MLA with 2 heads (kv_lora_rank 8, nope 6, rope 4, v 5), vocabulary 61. Loads in
    transformers (``BailingHybridConfig``)."""
    cfg = {
        "model_type": "bailing_hybrid", "architectures": ["BailingHybridForCausalLM"], "vocab_size": 61,
        "hidden_size": 32, "intermediate_size": 40, "moe_intermediate_size": 8, "num_hidden_layers": 4,
        "num_attention_heads": 2, "head_dim": 8, "kv_lora_rank": 8, "qk_nope_head_dim": 6, "qk_rope_head_dim": 4,
        "v_head_dim": 5, "layer_group_size": 2, "short_conv_kernel_size": 4, "kda_safe_gate": True,
        "kda_lower_bound": -5.0, "num_experts": 8, "num_experts_per_token": 2, "num_shared_experts": 1,
        "num_expert_group": 2, "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.5,
        "first_k_dense_replace": 1, "hidden_act": "silu", "rms_norm_eps": 1e-6, "model_max_length": 4096,
        "rope_theta": 6_000_000.0, "tie_word_embeddings": False, "num_nextn_predict_layers": 0,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    cfg.update(overrides)
    return cfg


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised Ling 3.0 model from an HF config dict."""
    r = _reader(cfg, _HF_DEFAULTS)
    if cfg.get("tie_word_embeddings"):
        raise ValueError(f"{r.where}: tie_word_embeddings={cfg['tie_word_embeddings']!r} is not supported for "
                         "bailing_hybrid (transformers' BailingHybridForCausalLM never ties its head); supported: "
                         "false")
    n = r.positive("num_hidden_layers")
    hidden = r.positive("hidden_size")
    positions = _max_positions(r)
    spec = ModelSpec(
        model_type="bailing_hybrid", vocab_size=r.positive("vocab_size"), hidden_size=hidden, num_layers=n,
        max_position_embeddings=positions, tie_word_embeddings=False, eos_token_id=cfg.get("eos_token_id"),
        bos_token_id=cfg.get("bos_token_id"), pad_token_id=cfg.get("pad_token_id"),
    )
    eps = r.opt("rms_norm_eps", 1e-6, float)
    act = r.opt("hidden_act", "silu", str)
    types = layer_types(cfg, r, n)
    sparse = sparse_layers(cfg, r, n, first_dense=2)
    lin = _linear_attn(r) if "linear_attention" in types else None
    dn, dr = r.req("qk_nope_head_dim"), r.positive("qk_rope_head_dim")
    rope_cfg = {"rope_theta": r.opt("rope_theta", 6_000_000.0, float), "max_position_embeddings": positions,
                **{k: cfg[k] for k in ("rope_parameters", "rope_scaling") if cfg.get(k) is not None}}
    rope = rope_params_from_hf(rope_cfg, dr)
    gate = cfg.get("gated_attention_proj_granularity_type")
    if gate not in (None, "head_wise"):
        raise ValueError(f"{r.where}: gated_attention_proj_granularity_type={gate!r} is not supported; supported: "
                         "\"head_wise\" (a sigmoid gate per head, what Ling 3.0 and transformers' model use)")
    q_lora = r.positive("q_lora_rank") if cfg.get("q_lora_rank") is not None else None
    shared_inter = cfg.get("moe_shared_expert_intermediate_size")
    if shared_inter is not None and shared_inter != (inter := r.positive("moe_intermediate_size")):
        raise ValueError(f"{r.where}: moe_shared_expert_intermediate_size={shared_inter!r} differs from "
                         f"moe_intermediate_size={inter}, which is not supported "
                         "(the shared experts are built moe_intermediate_size wide, as transformers builds them; "
                         "Ling 3.0's releases set both alike)")
    mla = dict(q_lora_rank=q_lora, kv_lora_rank=r.positive("kv_lora_rank"), qk_nope_head_dim=dn, qk_rope_head_dim=dr,
               v_head_dim=r.positive("v_head_dim"), bias=r.opt("attention_bias", False, bool),
               scale=mla_softmax_scale(rope, dn + dr), rope_interleave=True, head_gate=True)
    keys = moe_keys(r, scaling_default=2.5)
    layers = []
    for i in range(n):
        if types[i] == "linear_attention":
            # float32 in bf16/fp16 models, as transformers keeps them
            mixer = keep_in_float32(KimiDeltaAttention(hidden, norm_eps=eps, activation=act, **lin), *KEPT_BY_LING)
        else:
            mixer = MLAttention(hidden, r.positive("num_attention_heads"), **mla)
        ffn = _moe_block(hidden, r, act, keys) if sparse[i] else GatedMLP(hidden, r.positive("intermediate_size"), act)
        layers.append(DecoderLayer(mixer, ffn, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    rotary = RotaryEmbedding(rope) if "full_attention" in types else None
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, hidden, layers, RMSNorm(hidden, eps), rotary))


# ---------------------------------------------------------------------------------------------------- weights

_LOAD = [(r"^model\.word_embeddings\.", "model.embed_tokens."),
         (r"\.attention\.", ".self_attn."),
         # the module part: a PEFT adapter's keys in the released layout (``...attention.f_proj.lora_A.weight``) too
         (r"\.self_attn\.f_proj\.", ".self_attn.forget_gate.f_proj."),
         (r"\.self_attn\.(dt_bias|A_log)$", r".self_attn.forget_gate.\1"),
         (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
         (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias")]
# back, parameters' own names only (a PEFT adapter's keys are transformers' in-memory names and stay so)
_SAVE = [(r"^model\.embed_tokens\.weight$", "model.word_embeddings.weight"),
         (r"\.self_attn\.forget_gate\.f_proj\.weight$", ".self_attn.f_proj.weight"),
         (r"\.self_attn\.forget_gate\.(dt_bias|A_log)$", r".self_attn.\1"),
         (r"\.self_attn\.o_proj\.(weight|bias)$", r".self_attn.dense.\1"),
         (r"\.self_attn\.(\w+\.(?:weight|bias)|dt_bias|A_log)$", r".attention.\1"),
         (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.expert_bias")]


@dataclass
class BailingWeightMap(KimiWeightMap):
    """The released Ling 3.0 layout (module docstring) on load and save: the KDA conv split into q / k / v and
    the experts one by one as :class:`~longstraw.models.kimi.KimiWeightMap` does, with Ling's names."""

    load_renames: ClassVar[list[tuple[str, str]]] = _LOAD
    save_renames_released: ClassVar[list[tuple[str, str]]] = _SAVE


def weights(cfg: dict) -> BailingWeightMap:
    return BailingWeightMap(num_layers=int(cfg.get("num_hidden_layers") or 0))


FAMILY = Family("bailing", MODEL_TYPES, build, weights)
