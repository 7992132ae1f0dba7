"""GQA transformers with mixture-of-experts feed-forward blocks: ``qwen3_moe`` (Qwen3-30B-A3B, Qwen3-235B-A22B,
Qwen3-Coder-480B-A35B), ``qwen2_moe`` (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B), ``mixtral`` (Mixtral-8x7B / 8x22B),
``minimax_m2`` (MiniMax-M2: Mixtral's layout with a sigmoid router) and ``olmoe`` (OLMoE-1B-7B); the text model of
the Qwen3-VL MoE checkpoints (``qwen3_vl_moe``: Qwen3-VL-30B-A3B / 235B-A22B), built and saved as ``qwen3_moe``.

The attention is the dense families' (:mod:`longstraw.models.dense`): Qwen3-MoE's per-head q/k RMSNorm, free
``head_dim`` and ``attention_bias`` on q/k/v/o; Qwen2-MoE's q/k/v bias (``qkv_bias``, on by default); Mixtral's plain
GQA. The feed-forward block of layer ``i`` is a :class:`~longstraw.models.moe_block.SparseMoeBlock` (a top-k
router, fused routed experts) where transformers puts one, a dense SwiGLU otherwise:

* ``qwen3_moe`` / ``qwen2_moe``: sparse iff ``i not in mlp_only_layers`` and ``num_experts > 0`` and
  ``(i + 1) % decoder_sparse_step == 0``; the top-k probabilities are renormalised iff ``norm_topk_prob``
  (transformers' default: off; the released Qwen3-MoE configs turn it on). Qwen2-MoE adds the sigmoid-gated shared
  expert (``shared_expert``, ``shared_expert_gate``), as Qwen3-Next does.
* ``mixtral``: sparse on every layer, ``num_local_experts`` experts, the top-k always renormalised and kept in
  float32 (each expert's output is weighted in float32 and rounded once, as transformers does).
* ``olmoe``: sparse on every layer, ``num_experts`` experts of ``intermediate_size``, softmax top-k renormalised
  iff ``norm_topk_prob``; attention with q/k RMSNorm over all heads (as MiniMax-M2) and ``clip_qkv``.
* ``minimax_m2``: as Mixtral, routed by sigmoid scores (logits in the model's dtype) whose top-k is chosen with
  ``e_score_correction_bias`` added (DeepSeek's router with one group, no scaling:
  :class:`~longstraw.models.deepseek.SigmoidGroupedRouter`), renormalised, float32; attention with one RMSNorm over
  all heads' queries and one over all keys (``Attention(qk_norm="all")``) and partial RoPE (``rotary_dim`` of the
  released configs, or ``partial_rotary_factor``; theta 5e6 when unset, transformers' default for it). The
  released configs' ``attn_type_list`` must say full attention (1) for every layer; MiniMax's lightning
  (linear) attention layers are not implemented.

Checkpoint names: Qwen's are transformers' in-memory names except the routed experts, stored one by one
(``mlp.experts.{e}.{gate,up,down}_proj.weight``; fused on load, split on save by
:class:`~longstraw.models.weights.ExpertWeightMap`). Mixtral's checkpoints name the block ``block_sparse_moe`` and
the experts' matrices ``w1`` (gate), ``w3`` (up), ``w2`` (down) (MiniMax-M2's too, with the routing bias
``block_sparse_moe.e_score_correction_bias``, ours ``mlp.gate.e_score_correction_bias``); :class:`MixtralWeightMap`
maps them to transformers 5's in-memory names (``mlp.gate``, ``mlp.experts.gate_up_proj`` / ``down_proj``) on load
and back on save, so a saved model loads in transformers 4 and 5, vLLM and SGLang alike, and ``hf_grads`` needs no
renaming. A checkpoint already in the fused in-memory layout loads as it is. Qwen3-VL-MoE's (:class:`VLMoeWeightMap`):
the text weights under ``model.language_model.`` renamed, the vision tower ``model.visual.`` skipped with a warning,
its fused experts stored transposed (``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``, as released) turned to the
in-memory layout row range by row range (a file already in that layout loads as it is: the shapes decide, as
transformers' own conversion does); its router always renormalises the top-k (``norm_topk_prob`` on), and its
interleaved M-RoPE is ordinary RoPE at text positions.

Left out, as for every family: auxiliary load-balancing losses (``output_router_logits``, ``router_aux_loss_coef``);
FP8 checkpoints (MiniMax-M2 is released so: dequantise first, as for DeepSeek-V3).
Mixtral's ``router_jitter_noise`` (a pre-training regulariser transformers applies only in training mode) is
ignored with a warning: the policy's forward must be deterministic, the same when sampling and when scoring.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from torch import Tensor

from longstraw.models.attention import Attention
from longstraw.models.config import (ConfigReader, multimodal_text_config, narrowest_window, num_routed_experts,
                                     text_reader)
from longstraw.models.deepseek import SigmoidGroupedRouter
from longstraw.models.dense import layer_windows
from longstraw.models.family import Family
from longstraw.models.mlp import GatedMLP
from longstraw.models.moe_block import Experts, SoftmaxTopKRouter, SparseMoeBlock, qwen_moe_block
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec
from longstraw.models.weights import FUSED_EXPERTS, CheckpointReader, ExpertWeightMap, WeightSource, skip_qwen_visual

MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "minimax_m2", "olmoe", "qwen3_vl_moe")
MIXTRAL_LAYOUT = ("mixtral", "minimax_m2")  # every layer sparse, block_sparse_moe / w1 w2 w3 in checkpoints
ALL_SPARSE = MIXTRAL_LAYOUT + ("olmoe",)  # every layer sparse, the experts ``intermediate_size`` wide


def _is_sparse(mt: str, cfg: dict, r: ConfigReader, i: int) -> bool:
    if mt in ALL_SPARSE:
        return True
    only = cfg.get("mlp_only_layers") or []
    if not isinstance(only, list) or not all(isinstance(j, int) and not isinstance(j, bool) for j in only):
        raise ValueError(f"{r.where}: mlp_only_layers={only!r} must be a list of layer indices")
    return i not in only and num_routed_experts(cfg, r)[1] > 0 and (i + 1) % r.positive("decoder_sparse_step", 1) == 0


def _ffn(mt: str, cfg: dict, r: ConfigReader, hidden: int, act: str, i: int):
    if not _is_sparse(mt, cfg, r, i):
        return GatedMLP(hidden, r.positive("intermediate_size"), act)
    key, experts = num_routed_experts(cfg, r)
    top_k = r.positive("num_experts_per_tok")
    if experts < 1 or top_k > experts:
        raise ValueError(f"{r.where}: num_experts_per_tok={top_k} must be <= {key}={experts} (and that >= 1)")
    width = r.positive("intermediate_size" if mt in ALL_SPARSE else "moe_intermediate_size")
    if mt == "minimax_m2":
        router = SigmoidGroupedRouter(hidden, experts, top_k, 1, 1, True, 1.0, upcast_logits=False)
        return SparseMoeBlock(router, Experts(hidden, experts, width, act))
    norm_topk = mt == "mixtral" or r.opt("norm_topk_prob", False, bool)  # Mixtral: always renormalised
    if mt == "qwen2_moe":
        return qwen_moe_block(hidden, experts, top_k, width, r.positive("shared_expert_intermediate_size"), norm_topk,
                              act)
    router = SoftmaxTopKRouter(hidden, experts, top_k, norm_topk, float_weights=mt == "mixtral")
    return SparseMoeBlock(router, Experts(hidden, experts, width, act))


def text_config(cfg: dict) -> dict:
    """``cfg``, or for a ``qwen3_vl_moe`` checkpoint its text model's as ``qwen3_moe`` (its router always renormalises
    the top-k: ``norm_topk_prob`` on)."""
    if cfg.get("model_type") != "qwen3_vl_moe":
        return dict(cfg)
    text = multimodal_text_config(cfg, {"qwen3_vl_moe": "qwen3_moe"}, {"qwen3_moe": "Qwen3MoeForCausalLM"})
    text["norm_topk_prob"] = True
    return text


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised model from an HF config dict."""
    text = text_config(cfg)
    r, cfg = text_reader(text, cfg), text  # the text model's config from here on (qwen3_vl_moe: its text_config)
    mt = cfg["model_type"]
    hidden = r.positive("hidden_size")
    windows = layer_windows(cfg, r)
    spec = ModelSpec(
        model_type=mt, vocab_size=r.positive("vocab_size"), hidden_size=hidden,
        num_layers=r.positive("num_hidden_layers"),
        max_position_embeddings=r.positive("max_position_embeddings",
                                           {"mixtral": 131072, "minimax_m2": 196608, "olmoe": 4096}.get(mt, 32768)),
        tie_word_embeddings=r.opt("tie_word_embeddings", False, bool),
        eos_token_id=cfg.get("eos_token_id"), bos_token_id=cfg.get("bos_token_id"),
        pad_token_id=cfg.get("pad_token_id"), sliding_window=narrowest_window(windows),
    )
    heads = r.positive("num_attention_heads")
    kv_heads = r.opt("num_key_value_heads", heads, int)
    head_dim = r.opt("head_dim", hidden // heads, int)
    eps = r.opt("rms_norm_eps", 1e-5 if mt in ("mixtral", "olmoe") else 1e-6, float)
    act = r.opt("hidden_act", "silu", str)
    if mt == "qwen3_moe":
        bias = r.opt("attention_bias", False, bool)
        qkv_bias, o_bias, qk_norm = bias, bias, True
    elif mt == "qwen2_moe":
        qkv_bias, o_bias, qk_norm = r.opt("qkv_bias", True, bool), False, False
    elif mt == "olmoe":
        bias = r.opt("attention_bias", False, bool)
        qkv_bias, o_bias, qk_norm = bias, bias, "all"
    else:
        qkv_bias = o_bias = False
        qk_norm = "all" if mt == "minimax_m2" else False
        kinds = cfg.get("attn_type_list")
        if mt == "minimax_m2" and kinds is not None and (not isinstance(kinds, list) or any(k != 1 for k in kinds)):
            raise ValueError(f"{r.where}: attn_type_list={kinds!r}: only full attention (1) is supported for "
                             "minimax_m2; MiniMax's lightning (linear) attention layers are not implemented")
        if r.opt("router_jitter_noise", 0.0, float) > 0:
            warnings.warn(f"{r.where}: router_jitter_noise={cfg['router_jitter_noise']} is ignored: LongStraw's "
                          "forward is deterministic (the log-probs of sampling and of training must agree)",
                          stacklevel=2)
    layers = [
        DecoderLayer(
            Attention(hidden, heads, kv_heads, head_dim, qkv_bias=qkv_bias, o_bias=o_bias, qk_norm=qk_norm,
                      norm_eps=eps, clip_qkv=_clip_qkv(r) if mt == "olmoe" else None, window=windows[i]),
            _ffn(mt, cfg, r, hidden, act, i),
            RMSNorm(hidden, eps),
            RMSNorm(hidden, eps),
        )
        for i in range(spec.num_layers)
    ]
    rotary = RotaryEmbedding(rope_params_from_hf(_minimax_rope(cfg, r, head_dim) if mt == "minimax_m2" else cfg,
                                                 head_dim))
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, hidden, layers, RMSNorm(hidden, eps), rotary))


def _clip_qkv(r: ConfigReader) -> float | None:
    clip = r.opt("clip_qkv", None, (int, float))
    if clip is not None and clip <= 0:
        raise ValueError(f"{r.where}: clip_qkv={clip} must be > 0 (or null)")
    return None if clip is None else float(clip)


def _minimax_rope(cfg: dict, r: ConfigReader, head_dim: int) -> dict:
    """MiniMax-M2's RoPE settings as transformers reads them: the released configs' ``rotary_dim`` is a partial
    factor of ``rotary_dim / head_dim`` where no ``partial_rotary_factor`` is given; theta 5e6 when unset."""
    rp = dict(cfg.get("rope_parameters") or {})
    out = dict(cfg)
    if "partial_rotary_factor" not in rp and cfg.get("partial_rotary_factor") is None and cfg.get("rotary_dim"):
        rotary_dim = r.positive("rotary_dim")
        if rotary_dim > head_dim or rotary_dim % 2:
            raise ValueError(f"{r.where}: rotary_dim={rotary_dim} must be even and <= head_dim={head_dim}")
        out["partial_rotary_factor"] = rotary_dim / head_dim
    if rp.get("rope_theta") is None and cfg.get("rope_theta") is None:
        out["rope_theta"] = 5_000_000.0
    return out


# ---------------------------------------------------------------------------------------------------- weights

_MIXTRAL_LOAD = [(r"\.block_sparse_moe\.", ".mlp."),
                 (r"\.mlp\.e_score_correction_bias$", ".mlp.gate.e_score_correction_bias"),  # MiniMax-M2
                 (r"(\.mlp\.experts\.\d+)\.w1\.weight$", r"\1.gate_proj.weight"),
                 (r"(\.mlp\.experts\.\d+)\.w3\.weight$", r"\1.up_proj.weight"),
                 (r"(\.mlp\.experts\.\d+)\.w2\.weight$", r"\1.down_proj.weight")]
# Saving maps back only the router and the per-expert matrices: a PEFT adapter's keys (``mlp.experts`` of the fused
# parameters, attention projections) are transformers 5's in-memory names and stay as they are.
_MIXTRAL_SAVE = [(r"\.mlp\.gate\.weight$", ".block_sparse_moe.gate.weight"),
                 (r"\.mlp\.gate\.e_score_correction_bias$", ".block_sparse_moe.e_score_correction_bias"),
                 (r"\.mlp\.experts\.(\d+)\.gate_proj\.weight$", r".block_sparse_moe.experts.\1.w1.weight"),
                 (r"\.mlp\.experts\.(\d+)\.up_proj\.weight$", r".block_sparse_moe.experts.\1.w3.weight"),
                 (r"\.mlp\.experts\.(\d+)\.down_proj\.weight$", r".block_sparse_moe.experts.\1.w2.weight")]


@dataclass
class MixtralWeightMap(ExpertWeightMap):
    """Mixtral's checkpoint names (module docstring): renamed on load; on save the fused experts are split into
    per-expert tensors first (under our names) and then renamed."""

    def __post_init__(self):
        self.renames.extend(_MIXTRAL_LOAD)

    def save_tensors(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, t in super().save_tensors(named):
            yield _mixtral_name(name), t

    def save_rows(self, name: str, rows: Tensor, first: int) -> Iterator[tuple[str, Tensor]]:
        for n, t in super().save_rows(name, rows, first):
            yield _mixtral_name(n), t


def _mixtral_name(name: str) -> str:
    for pat, repl in _MIXTRAL_SAVE:
        name = re.sub(pat, repl, name)
    return name


@dataclass
class VLMoeWeightMap(ExpertWeightMap):
    """A Qwen3-VL-MoE checkpoint (module docstring): ``hidden`` and ``inter`` (``moe_intermediate_size``) tell the
    released transposed experts from the in-memory layout."""

    hidden: int = 0
    inter: int = 0

    def __post_init__(self):
        skip_qwen_visual(self)

    def sources(self, ckpt_names: list[str], reader: CheckpointReader) -> list[WeightSource]:
        fused = [n for n in ckpt_names if (p := self.param_name(n)) is not None and FUSED_EXPERTS.fullmatch(p)]
        out = super().sources([n for n in ckpt_names if n not in fused], reader)
        for n in fused:
            param = self.param_name(n)
            e, *stored = reader.shape(n)
            gate_up = FUSED_EXPERTS.fullmatch(param).group(2) == "gate_up_proj"
            wide, narrow = (2 * self.inter, self.hidden) if gate_up else (self.hidden, self.inter)
            turn = tuple(stored) == (narrow, wide) and narrow != wide  # released: [E, H, 2I] / [E, I, H]
            out.append(WeightSource(param, (e, wide, narrow) if turn else (e, *stored),
                                    lambda rows, o, n=n, turn=turn: _rows(reader.read(n, rows), o, turn)))
        return out


def _rows(t: Tensor, out: Tensor | None, transpose: bool) -> Tensor:
    """Rows read from a checkpoint (``[r, a, b]``), their last two dims swapped if ``transpose``, into ``out``."""
    t = t.transpose(1, 2) if transpose else t
    if out is None:
        return t.contiguous()
    return out.copy_(t)


def weights(cfg: dict) -> ExpertWeightMap:
    mt = cfg.get("model_type")
    if mt == "qwen3_vl_moe":
        r = text_reader(text_config(cfg), cfg)
        return VLMoeWeightMap(hidden=r.positive("hidden_size"), inter=r.positive("moe_intermediate_size"))
    return MixtralWeightMap() if mt in MIXTRAL_LAYOUT else ExpertWeightMap()


FAMILY = Family("gqa_moe", MODEL_TYPES, build, weights)
