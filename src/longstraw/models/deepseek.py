"""DeepSeek / GLM mixture-of-experts families: ``deepseek_v3``, ``glm4_moe`` (GLM-4.5), ``deepseek_v32``
(DeepSeek-V3.2), ``glm_moe_dsa`` (GLM-5) and ``glm4_moe_lite`` (GLM-4.7-Flash: DeepSeek-V3's MLA with GLM's MoE).
``kimi_k2`` (Kimi-K2's text checkpoints, whose config names the DeepSeek-V3 architecture under its own model type;
transformers reads such a text config as ``deepseek_v3``, ``Kimi_K25Config``) is built as ``deepseek_v3``, and so is
the text model of ``kimi_k25`` (Kimi-K2.5 / K2.6: a vision tower and projector beside DeepSeek-V3's text model,
whose ``text_config`` names ``kimi_k2`` or ``deepseek_v3``; the vision weights are skipped with one warning,
:func:`~longstraw.models.weights.skip_kimi_vision`, and ``save_model`` writes the text model as ``deepseek_v3``).

Attention:

* ``deepseek_v3``, ``glm4_moe_lite``: Multi-head Latent Attention (:mod:`longstraw.models.mla`), optional low-rank
  queries (``q_lora_rank``), RoPE interleaved unless ``rope_interleave`` is false, yarn mscale squared in the scale;
* ``glm4_moe``: grouped-query attention (:class:`~longstraw.models.attention.Attention`) with q/k/v bias
  (``attention_bias``; ``o_proj`` never has one), optional per-head q/k RMSNorm (``use_qk_norm``) and partial RoPE
  (``partial_rotary_factor``, 0.5 when the config does not say, as transformers defaults it), half-split layout;
* ``deepseek_v32`` / ``glm_moe_dsa``: MLA (low-rank queries required, interleaved RoPE) plus DeepSeek Sparse
  Attention (:mod:`longstraw.models.dsa`); GLM-5's ``indexer_types`` make ``"shared"`` layers reuse the last
  ``"full"`` layer's selection and its indexer uses interleaved RoPE (DeepSeek-V3.2: half-split).

Feed-forward: SwiGLU on dense layers, else the sparse MoE block (:mod:`longstraw.models.moe_block`) with
:class:`SigmoidGroupedRouter` (``sigmoid`` scores, ``e_score_correction_bias`` for the choice only,
group-limited top-k over ``n_group`` groups keeping ``topk_group``, optional renormalisation, times
``routed_scaling_factor``) and ``n_shared_experts`` always-on shared experts of ``moe_intermediate_size`` each
(one SwiGLU ``shared_experts`` of ``n_shared * moe_intermediate_size``). Which layers are sparse:
``layer >= first_k_dense_replace`` (``deepseek_v3``, ``glm4_moe``) or ``mlp_layer_types[layer] == "sparse"``
(``deepseek_v32``, ``glm_moe_dsa``, ``glm4_moe_lite``; when absent, derived from ``first_k_dense_replace``
(default 3), except for ``glm4_moe_lite``, whose config class has no such key: its first layer alone is dense), as
transformers does.

Weights: experts are fused in memory as transformers 5 keeps them (``experts.gate_up_proj [E, 2I, H]``,
``experts.down_proj [E, H, I]``) and stored per expert in checkpoints (``experts.{e}.{gate,up,down}_proj.weight``),
so our parameter names are the in-memory HF names. ``e_score_correction_bias`` is a buffer, as in transformers:
loaded and saved, never trained, float32 in bf16/fp16 models. Multi-token-prediction layers (``model.layers.{n}.*`` for
``n >= num_hidden_layers``, ``num_nextn_predict_layers`` of them) are skipped on load with one warning.

The DSA indexer's ``weights_proj`` is float32 in fp16 models, as transformers keeps it (fp16 only; bf16 models, ours
and transformers', compute it in bf16 and take its output in float32): :class:`~longstraw.models.dsa.HeadWeights`.

Left out: the MTP heads themselves, auxiliary balance losses, FP8 checkpoints (dequantise first).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from longstraw.models.attention import Attention
from longstraw.models.config import ConfigReader, known_text_config, text_reader
from longstraw.models.dsa import Indexer, SparseMLAttention
from longstraw.models.family import Family
from longstraw.models.keep_fp32 import KeepsFloat32
from longstraw.models.mla import MLAttention, mla_softmax_scale
from longstraw.models.mlp import GatedMLP
from longstraw.models.moe_block import Experts, SparseMoeBlock
from longstraw.models.norms import RMSNorm
from longstraw.models.rope import RotaryEmbedding, rope_params_from_hf
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec
from longstraw.models.weights import ExpertWeightMap, skip_kimi_vision
from longstraw.ops.moe import router_logits, sigmoid_grouped_route

MODEL_TYPES = ("deepseek_v3", "glm4_moe", "deepseek_v32", "glm_moe_dsa", "glm4_moe_lite", "kimi_k2", "kimi_k25")
KIMI_TEXT_TYPES = ("kimi_k2", "deepseek_v3")  # what a kimi_k25 text_config may name (transformers: the same model)
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")
INDEXER_TYPES = ("full", "shared")


# ---------------------------------------------------------------------------------------------------- MoE


class SigmoidGroupedRouter(KeepsFloat32, nn.Module):
    """DeepSeek-V3 / GLM router: ``weight [E, H]`` (logits in float32, float64 for float64 models) and the
    ``e_score_correction_bias [E]`` buffer; ``forward(x [N, H]) -> (weights [N, k] float32/64, expert_ids [N, k])``.

    The bias is a persistent buffer (loaded and saved, never trained, never sharded by FSDP) that stays float32 when
    the model is cast to bf16/fp16, as transformers keeps it (``_keep_in_fp32_modules_strict``): it only ranks the
    experts, and DeepSeek-V3's biases differ in digits bf16 does not hold, so a bf16 bias would change which
    experts are chosen. A float64 model takes it in float64."""

    keep_float32 = ("e_score_correction_bias",)  # strict: bf16 and fp16 models (models.keep_fp32)

    def __init__(self, hidden: int, num_experts: int, top_k: int, n_group: int, topk_group: int,
                 norm_topk_prob: bool, routed_scaling_factor: float, upcast_logits: bool = True):
        super().__init__()
        self.upcast_logits = upcast_logits  # False: logits in x's dtype, sigmoid in float32 (MiniMax-M2)
        self.top_k, self.n_group, self.topk_group = top_k, n_group, topk_group
        self.norm_topk_prob, self.routed_scaling_factor = norm_topk_prob, routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(num_experts, hidden).normal_(0, 0.02))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts, dtype=torch.float32))

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        return sigmoid_grouped_route(router_logits(x, self.weight, upcast=self.upcast_logits),
                                     self.e_score_correction_bias,
                                     self.top_k, self.n_group, self.topk_group, self.norm_topk_prob,
                                     self.routed_scaling_factor)


@dataclass(frozen=True)
class MoeKeys:
    """The config keys (and defaults where a key may be absent) of the sigmoid-routed MoE block: DeepSeek's names
    by default; Kimi-Linear's configs spell them otherwise (``models/kimi.py``)."""

    experts: str = "n_routed_experts"
    top_k: str = "num_experts_per_tok"
    n_group: str = "n_group"
    shared: str = "n_shared_experts"
    renormalize: str = "norm_topk_prob"
    scaling_default: float = 1.0


def _moe_block(hidden: int, r: ConfigReader, act: str, keys: MoeKeys = MoeKeys()) -> SparseMoeBlock:
    for key, allowed in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):  # DeepSeek's own config keys
        if r.cfg.get(key) not in (None, allowed):
            raise ValueError(f"{r.where}: {key}={r.cfg[key]!r} is not supported for {r.cfg['model_type']}; "
                             f"supported: {allowed!r}")
    e = r.positive(keys.experts)
    k = r.positive(keys.top_k)
    n_group = r.positive(keys.n_group, 1)
    topk_group = r.positive("topk_group", 1)
    if k > e:
        raise ValueError(f"{r.where}: {keys.top_k}={k} must be <= {keys.experts}={e}")
    if e % n_group:
        raise ValueError(f"{r.where}: {keys.n_group}={n_group} must divide {keys.experts}={e}")
    if topk_group > n_group:
        raise ValueError(f"{r.where}: topk_group={topk_group} must be <= {keys.n_group}={n_group}")
    if k > topk_group * (e // n_group):
        raise ValueError(f"{r.where}: {keys.top_k}={k} exceeds the {topk_group * (e // n_group)} experts of "
                         f"topk_group={topk_group} groups of {e // n_group}")
    inter = r.positive("moe_intermediate_size")
    shared = r.opt(keys.shared, 1, int)
    if shared < 0:
        raise ValueError(f"{r.where}: {keys.shared}={shared} must be >= 0")
    router = SigmoidGroupedRouter(hidden, e, k, n_group, topk_group, r.opt(keys.renormalize, True, bool),
                                  r.opt("routed_scaling_factor", keys.scaling_default, float))
    return SparseMoeBlock(router, Experts(hidden, e, inter, act), GatedMLP(hidden, inter * shared, act),
                          shared_name="shared_experts")


def sparse_layers(cfg: dict, r: ConfigReader, n: int) -> list[bool]:
    """Which layers have the MoE block (see module docstring)."""
    mt = cfg["model_type"]
    first = r.opt("first_k_dense_replace", 1 if mt == "glm4_moe" else 3, int)
    if mt not in DSA_TYPES + ("glm4_moe_lite",):
        return [i >= first for i in range(n)]
    types = cfg.get("mlp_layer_types")
    if types is None:  # GLM-4.7-Flash's config class has no first_k_dense_replace: one dense layer, always
        return [i >= (1 if mt == "glm4_moe_lite" else min(first, n)) for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"{r.where}: mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers, "
                         f"got {types!r}")
    return [t == "sparse" for t in types]


# ---------------------------------------------------------------------------------------------------- attention


def indexer_types(cfg: dict, r: ConfigReader, n: int) -> list[str]:
    """Per-layer indexer mode: all ``"full"`` for ``deepseek_v32``; for ``glm_moe_dsa`` ``indexer_types``, else
    ``index_topk_pattern`` (``"F"``/``"S"`` string or list), else every ``index_topk_freq``-th layer counted from
    ``index_skip_topk_offset`` (defaults 1 and 2, i.e. all full), as transformers derives it."""
    if cfg["model_type"] != "glm_moe_dsa":
        return ["full"] * n
    types = cfg.get("indexer_types")
    if types is None and cfg.get("index_topk_pattern") is not None:
        pat = cfg["index_topk_pattern"]
        if isinstance(pat, str):
            bad = sorted(set(pat) - {"F", "S"})
            if bad:
                raise ValueError(f"{r.where}: index_topk_pattern={pat!r} may hold only 'F' and 'S', got {bad}")
            types = [{"F": "full", "S": "shared"}[c] for c in pat]
        else:
            types = list(pat)
    if types is None:
        freq = max(r.opt("index_topk_freq", 1, int), 1)
        offset = r.opt("index_skip_topk_offset", 2, int)
        types = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in INDEXER_TYPES for t in types):
        raise ValueError(f"{r.where}: indexer_types must list one of {list(INDEXER_TYPES)} for each of the {n} "
                         f"layers, got {types!r}")
    if types[0] != "full":
        raise ValueError(f"{r.where}: indexer_types[0]={types[0]!r}: the first layer must be 'full' (a shared layer "
                         "reuses the selection of a full layer below it)")
    return types


def _mla_kwargs(cfg: dict, r: ConfigReader, rope_params, dsa: bool) -> dict:
    q_lora = cfg.get("q_lora_rank")
    if dsa and q_lora is None:
        raise ValueError(f"{r.where}: {cfg['model_type']} needs q_lora_rank (the indexer reads the low-rank query)")
    if q_lora is not None:
        q_lora = r.positive("q_lora_rank")
    dn, dr = r.req("qk_nope_head_dim"), r.positive("qk_rope_head_dim")
    interleave = True if dsa else r.opt("rope_interleave", True, bool)
    return dict(q_lora_rank=q_lora, kv_lora_rank=r.positive("kv_lora_rank"), qk_nope_head_dim=dn,
                qk_rope_head_dim=dr, v_head_dim=r.positive("v_head_dim"), bias=r.opt("attention_bias", False, bool),
                rope_interleave=interleave, scale=mla_softmax_scale(rope_params, dn + dr))


def _glm_rope_config(cfg: dict) -> dict:
    rp = cfg.get("rope_parameters")
    if cfg.get("partial_rotary_factor") is not None or (isinstance(rp, dict) and "partial_rotary_factor" in rp):
        return cfg
    return {**cfg, "partial_rotary_factor": 0.5}


# ---------------------------------------------------------------------------------------------------- build


def text_config(cfg: dict) -> dict:
    """``cfg``, or for a multimodal ``kimi_k25`` checkpoint its text model's, as ``deepseek_v3`` (what transformers
    builds from it, and what ``save_model`` writes). Whether the head is tied is the multimodal config's
    ``tie_word_embeddings`` (its config class defaults it to true), as transformers reads it."""
    return known_text_config(cfg, "kimi_k25", {k: "deepseek_v3" for k in KIMI_TEXT_TYPES}, "deepseek_v3",
                             {"deepseek_v3": "DeepseekV3ForCausalLM"}, tie_default=True)


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised model of one of :data:`MODEL_TYPES` from an HF config dict (a ``kimi_k25``
    one: its text model)."""
    text = text_config(cfg)
    r, cfg = text_reader(text, cfg), text
    mt = cfg["model_type"]
    n = r.positive("num_hidden_layers")
    hidden = r.positive("hidden_size")
    spec = ModelSpec(
        model_type=mt, vocab_size=r.positive("vocab_size"), hidden_size=hidden, num_layers=n,
        max_position_embeddings=r.positive("max_position_embeddings", 4096),
        tie_word_embeddings=r.opt("tie_word_embeddings", False, bool), eos_token_id=cfg.get("eos_token_id"),
        bos_token_id=cfg.get("bos_token_id"), pad_token_id=cfg.get("pad_token_id"),
    )
    eps = r.opt("rms_norm_eps", 1e-6, float)
    act = r.opt("hidden_act", "silu", str)
    heads = r.positive("num_attention_heads")
    sparse = sparse_layers(cfg, r, n)
    dsa = mt in DSA_TYPES

    if mt == "glm4_moe":
        kv = r.opt("num_key_value_heads", heads, int)
        head_dim = r.opt("head_dim", hidden // heads, int)
        rotary = RotaryEmbedding(rope_params_from_hf(_glm_rope_config(cfg), head_dim))
        bias = r.opt("attention_bias", False, bool)
        qk_norm = r.opt("use_qk_norm", False, bool)
        mixers = [Attention(hidden, heads, kv, head_dim, qkv_bias=bias, o_bias=False, qk_norm=qk_norm, norm_eps=eps)
                  for _ in range(n)]
    else:
        rope_params = rope_params_from_hf({k: v for k, v in cfg.items() if k != "partial_rotary_factor"},
                                          r.positive("qk_rope_head_dim"))
        mla = _mla_kwargs(cfg, r, rope_params, dsa)
        if not dsa:
            rotary = RotaryEmbedding(rope_params)
            mixers = [MLAttention(hidden, heads, **mla) for _ in range(n)]
        else:
            rotary = RotaryEmbedding(rope_params)
            kinds = indexer_types(cfg, r, n)
            topk = r.positive("index_topk")
            idx = dict(hidden=hidden, q_lora_rank=mla["q_lora_rank"], num_heads=r.positive("index_n_heads"),
                       head_dim=r.positive("index_head_dim"), rope_dim=mla["qk_rope_head_dim"], topk=topk,
                       interleaved=mt == "glm_moe_dsa")
            mixers, source = [], None
            for i, kind in enumerate(kinds):
                if kind == "full":
                    source = i
                mixers.append(SparseMLAttention(hidden, heads, indexer=Indexer(**idx) if kind == "full" else None,
                                                index_topk=topk, layer_index=i, source_index=source, **mla))
                if kind != "full":  # its full layer's selection must outlive that layer's call
                    mixers[source].keeps_selection = True

    layers = []
    for i in range(n):
        ffn = _moe_block(hidden, r, act) if sparse[i] else GatedMLP(hidden, r.positive("intermediate_size"), act)
        layers.append(DecoderLayer(mixers[i], ffn, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, hidden, layers, RMSNorm(hidden, eps), rotary))


# ---------------------------------------------------------------------------------------------------- weights

_LAYER = re.compile(r"model\.layers\.(\d+)\.")


@dataclass
class DeepseekWeightMap(ExpertWeightMap):
    """Per-expert checkpoint tensors fused on load and split on save (:class:`~longstraw.models.weights.ExpertWeightMap`), and the
    multi-token-prediction layers (index ``>= num_layers``, or under ``model.mtp.``, where Ling 3.0's releases
    keep theirs) skipped with one warning."""

    num_layers: int = 0

    def _mtp(self, name: str) -> bool:
        renamed = self.renamed(name)
        m = _LAYER.match(renamed)
        return (m is not None and int(m.group(1)) >= self.num_layers) or renamed.startswith("model.mtp.")

    def param_name(self, ckpt_name: str) -> str | None:
        return None if self._mtp(ckpt_name) else super().param_name(ckpt_name)

    def warn_skipped(self, ckpt_names: Iterable[str]) -> None:
        names = list(ckpt_names)
        super().warn_skipped(names)
        hits = [n for n in names if self._mtp(n)]
        if hits:
            renamed = [self.renamed(n) for n in hits]
            layers = sorted({int(m.group(1)) for m in map(_LAYER.match, renamed) if m})
            where = ", ".join(([f"layers {layers} (model.layers.{self.num_layers}+)"] if layers else [])
                              + (["model.mtp.*"] if any(n.startswith("model.mtp.") for n in renamed) else []))
            warnings.warn(f"multi-token-prediction (MTP) {where} are not used by LongStraw ({len(hits)} tensors "
                          f"skipped, e.g. {hits[0]})", stacklevel=3)


def weights(cfg: dict) -> DeepseekWeightMap:
    wm = DeepseekWeightMap(num_layers=int(text_config(cfg).get("num_hidden_layers") or 0))
    return skip_kimi_vision(wm) if cfg.get("model_type") == "kimi_k25" else wm


FAMILY = Family("deepseek", MODEL_TYPES, build, weights)
