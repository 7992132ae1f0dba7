"""Kimi-Linear (``kimi_linear``): Kimi Delta Attention hybrid with NoPE MLA and DeepSeek-style MoE.

Each decoder layer mixes tokens with either Kimi Delta Attention (``"linear_attention"``,
:mod:`longstraw.models.kda`: a delta rule with a decay per key channel, O(1) state) or Multi-head Latent Attention
without positions (``"full_attention"``, :mod:`longstraw.models.mla` with ``rope=False``: ``k_rot`` is shared by
the heads but never rotated; scale ``qk_head_dim^-0.5``; the prompt state is the ``kv_lora_rank + qk_rope_head_dim``
latents per position). Both sit under ``self_attn`` as in transformers. The model has no rotary embedding at all.
Feed-forward: SwiGLU on the first ``first_k_dense_replace`` layers (or where ``mlp_layer_types`` says
``"dense"``), else DeepSeek-V3's sigmoid-routed MoE (``e_score_correction_bias``, group-limited top-k,
renormalised, times ``routed_scaling_factor``) with ``num_shared_experts`` shared experts
(:mod:`longstraw.models.deepseek`).

Config, as transformers' ``KimiLinearConfig`` reads it: the released ``config.json`` nests the linear layers'
settings in ``linear_attn_config`` (``num_heads``, ``head_dim``, ``short_conv_kernel_size``, and the 1-indexed
``kda_layers`` / ``full_attn_layers``); ``layer_types`` wins when present, else those lists, else every 4th layer
after the first is full attention. The MoE keys are Kimi's (``num_experts``, ``num_experts_per_token``,
``num_shared_experts``, ``num_expert_group``, ``moe_renormalize``), each also read under the DeepSeek-style alias
transformers accepts (``num_local_experts``, ``num_experts_per_tok``, ``n_shared_experts``, ``n_group``,
``norm_topk_prob``); ``model_max_length`` is the context length. Refused in one line, because transformers'
model would silently compute something else: ``mla_use_nope: false``, ``moe_router_activation_func`` other than
``sigmoid``, ``moe_layer_freq`` other than 1, ``tie_word_embeddings: true`` (transformers' model never ties), and
the later KDA variants' ``linear_attn_config`` settings (``gate_lower_bound``, ``use_full_rank_gate``, 0-indexed
``kda_layer_index_base``).

Weights: our parameter names are transformers' in-memory ones. The released checkpoints name the MoE block
``block_sparse_moe`` with per-expert ``w1`` (gate) / ``w3`` (up) / ``w2`` (down), keep the forget gate's tensors
directly under ``self_attn`` (``f_a_proj``, ``f_b_proj``, ``dt_bias``, ``A_log``) and store the short conv as
``q_conv1d`` / ``k_conv1d`` / ``v_conv1d``: :class:`KimiWeightMap` reads that layout (and transformers' own, which
uses ``block_sparse_moe`` for dense layers too) and writes the released one. Multi-token-prediction layers
(``num_nextn_predict_layers``) are skipped with one warning, as for DeepSeek.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

from longstraw.models.config import ConfigReader
from longstraw.models.deepseek import DeepseekWeightMap, MoeKeys, _moe_block
from longstraw.models.family import Family
from longstraw.models.kda import KimiDeltaAttention
from longstraw.models.mla import MLAttention
from longstraw.models.mlp import GatedMLP
from longstraw.models.norms import RMSNorm
from longstraw.models.transformer import Backbone, CausalLM, DecoderLayer, ModelSpec
from longstraw.models.weights import CheckpointReader, Rows, WeightSource

MODEL_TYPES = ("kimi_linear",)
LAYER_TYPES = ("linear_attention", "full_attention")

# (transformers' stored key, the alias it also accepts): the first one a config sets is read
_ALIASES = {"num_experts": "num_local_experts", "num_experts_per_token": "num_experts_per_tok",
            "num_shared_experts": "n_shared_experts", "num_expert_group": "n_group",
            "moe_renormalize": "norm_topk_prob", "model_max_length": "max_position_embeddings"}
_HF_DEFAULTS = {"num_experts": 256, "num_experts_per_token": 8, "moe_intermediate_size": 1024,
                "intermediate_size": 9216, "kv_lora_rank": 512, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128,
                "v_head_dim": 128, "model_max_length": 1048576, "num_attention_heads": 32}


def _key(cfg: dict, key: str) -> str:
    """``key``, or its alias where only the alias is set."""
    alias = _ALIASES.get(key)
    return alias if cfg.get(key) is None and alias is not None and cfg.get(alias) is not None else key


def _reader(cfg: dict, defaults: dict = _HF_DEFAULTS) -> ConfigReader:
    """A reader over ``cfg`` with transformers' ``defaults`` filled in for the keys it defaults (never over a value
    the config sets, under either spelling). Ling 3.0's config (``models/bailing.py``) spells its keys so too."""
    filled = dict(cfg)
    for key, default in defaults.items():
        if filled.get(key) is None and filled.get(_ALIASES.get(key, key)) is None:
            filled[key] = default
    return ConfigReader(filled)


def _linear_attn(cfg: dict, r: ConfigReader) -> dict:
    """``linear_attn_config`` (or transformers' flat ``linear_*`` keys): heads, head size, conv kernel; refuses the
    settings of later KDA models (module docstring)."""
    lac = cfg.get("linear_attn_config") or {}
    if not isinstance(lac, dict):
        raise ValueError(f"{r.where}: linear_attn_config must be an object, got {lac!r}")
    where = f"{r.where} linear_attn_config"
    if lac.get("gate_lower_bound") is not None:
        raise ValueError(f"{where}: gate_lower_bound={lac['gate_lower_bound']!r} (the bounded 'safe' KDA gate of "
                         "later models) is not supported for kimi_linear; supported: absent or null")
    if lac.get("use_full_rank_gate"):
        raise ValueError(f"{where}: use_full_rank_gate={lac['use_full_rank_gate']!r} is not supported for "
                         "kimi_linear (its forget gate is the rank-head_dim f_a_proj / f_b_proj); supported: false")
    if lac.get("kda_layer_index_base", 1) != 1:
        raise ValueError(f"{where}: kda_layer_index_base={lac['kda_layer_index_base']!r} is not supported; "
                         "kimi_linear numbers its kda_layers / full_attn_layers from 1")
    lin = ConfigReader({"num_heads": lac.get("num_heads", cfg.get("linear_num_heads", 32)),
                        "head_dim": lac.get("head_dim", cfg.get("linear_head_dim", 128)),
                        "short_conv_kernel_size": lac.get("short_conv_kernel_size",
                                                          cfg.get("linear_conv_kernel_dim", 4))}, where)
    return dict(num_heads=lin.positive("num_heads"), head_dim=lin.positive("head_dim"),
                conv_kernel=lin.positive("short_conv_kernel_size"))


def layer_types(cfg: dict, r: ConfigReader, n: int) -> list[str]:
    """Each layer's mixer, as transformers derives it (module docstring)."""
    types = cfg.get("layer_types")
    lac = cfg.get("linear_attn_config") or {}
    if types is None and "full_attn_layers" in lac and "kda_layers" in lac:
        types = [None] * n
        for key, kind in (("full_attn_layers", "full_attention"), ("kda_layers", "linear_attention")):
            for layer in lac[key]:
                if not isinstance(layer, int) or not 1 <= layer <= n:
                    raise ValueError(f"{r.where} linear_attn_config: {key} holds {layer!r}; layers are numbered 1 .. "
                                     f"{n} (num_hidden_layers)")
                types[layer - 1] = kind
        missing = [i + 1 for i, t in enumerate(types) if t is None]
        if missing:
            raise ValueError(f"{r.where} linear_attn_config: layers {missing} are in neither kda_layers nor "
                             "full_attn_layers")
    if types is None:
        types = ["full_attention" if i and i % 4 == 0 else "linear_attention" for i in range(n)]
    return checked_layer_types(types, r, n)


def checked_layer_types(types, r: ConfigReader, n: int) -> list[str]:
    """``types`` as a list, refused in one line unless it gives one of :data:`LAYER_TYPES` for each of ``n``
    layers."""
    if not isinstance(types, list) or len(types) != n or any(t not in LAYER_TYPES for t in types):
        raise ValueError(f"{r.where}: layer_types must give one of {list(LAYER_TYPES)} for each of the {n} layers, "
                         f"got {types!r}")
    return list(types)


def sparse_layers(cfg: dict, r: ConfigReader, n: int, first_dense: int = 1) -> list[bool]:
    """Which layers have the MoE block: ``mlp_layer_types`` (``"dense"`` / ``"sparse"``), else the layers from
    ``first_k_dense_replace`` (default ``first_dense``: Kimi-Linear's 1, Ling 3.0's 2) on."""
    types = cfg.get("mlp_layer_types")
    if types is None:
        first = r.opt("first_k_dense_replace", first_dense, int)
        return [i >= first for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in ("dense", "sparse") for t in types):
        raise ValueError(f"{r.where}: mlp_layer_types must list 'dense' or 'sparse' for each of the {n} layers, "
                         f"got {types!r}")
    return [t == "sparse" for t in types]


def moe_keys(r: ConfigReader, scaling_default: float) -> MoeKeys:
    """The MoE block's config keys as this config spells each (Kimi's / Ling's name, or transformers' alias)."""
    return MoeKeys(experts=_key(r.cfg, "num_experts"), top_k=_key(r.cfg, "num_experts_per_token"),
                   n_group=_key(r.cfg, "num_expert_group"), shared=_key(r.cfg, "num_shared_experts"),
                   renormalize=_key(r.cfg, "moe_renormalize"), scaling_default=scaling_default)


def _max_positions(r: ConfigReader) -> int:
    """``model_max_length``; ``max_position_embeddings`` (transformers' name for it) wins where both are set: it is
    what ``longstraw plan --max-positions`` sets (Kimi-Linear's NoPE and KDA read no positions; Ling 3.0's RoPE
    reads the same number)."""
    return r.positive("max_position_embeddings" if r.cfg.get("max_position_embeddings") is not None
                      else "model_max_length")


def _refuse_unsupported(cfg: dict, r: ConfigReader) -> None:
    for key, allowed in (("mla_use_nope", True), ("moe_router_activation_func", "sigmoid"), ("moe_layer_freq", 1),
                         ("tie_word_embeddings", False)):  # transformers' KimiLinearForCausalLM ties nothing
        if cfg.get(key) is not None and cfg[key] != allowed:
            raise ValueError(f"{r.where}: {key}={cfg[key]!r} is not supported for kimi_linear (transformers' model "
                             f"assumes it); supported: {allowed!r}")


def tiny_config(**overrides) -> dict:
    """HF config dict of a tiny Kimi-Linear for tests and benchmarks: hidden 32, 4 layers (KDA, KDA, MLA, KDA; the
    first dense, the others MoE with 4 experts of which 2 per token, one shared), KDA with 2 heads of 8, MLA with 2
    heads (kv_lora_rank 8, nope 8, "rope" 4, v 8), vocabulary 64. Loads in transformers (``KimiLinearConfig``)."""
    cfg = {
        "model_type": "kimi_linear", "architectures": ["KimiLinearForCausalLM"], "vocab_size": 64,
        "hidden_size": 32, "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 4,
        "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 8, "q_lora_rank": None,
        "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8, "mla_use_nope": True,
        "linear_attn_config": {"num_heads": 2, "head_dim": 8, "short_conv_kernel_size": 4, "kda_layers": [1, 2, 4],
                               "full_attn_layers": [3]},
        "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "num_expert_group": 1,
        "topk_group": 1, "moe_renormalize": True, "routed_scaling_factor": 2.446, "first_k_dense_replace": 1,
        "moe_router_activation_func": "sigmoid", "hidden_act": "silu", "rms_norm_eps": 1e-5,
        "model_max_length": 4096, "tie_word_embeddings": False, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": None, "pad_token_id": None,
    }
    cfg.update(overrides)
    return cfg


def build(cfg: dict) -> CausalLM:
    """Build a randomly initialised Kimi-Linear model from an HF config dict."""
    r = _reader(cfg)
    _refuse_unsupported(cfg, r)
    n = r.positive("num_hidden_layers")
    hidden = r.positive("hidden_size")
    spec = ModelSpec(
        model_type="kimi_linear", vocab_size=r.positive("vocab_size"), hidden_size=hidden, num_layers=n,
        max_position_embeddings=_max_positions(r),
        tie_word_embeddings=False, eos_token_id=cfg.get("eos_token_id"),
        bos_token_id=cfg.get("bos_token_id"), pad_token_id=cfg.get("pad_token_id"),
    )
    eps = r.opt("rms_norm_eps", 1e-5, float)
    act = r.opt("hidden_act", "silu", str)
    types = layer_types(cfg, r, n)
    sparse = sparse_layers(cfg, r, n)
    lin = _linear_attn(cfg, r) if "linear_attention" in types else None
    q_lora = cfg.get("q_lora_rank")
    dn, dr = r.req("qk_nope_head_dim"), r.positive("qk_rope_head_dim")
    mla = dict(q_lora_rank=None if q_lora is None else r.positive("q_lora_rank"),
               kv_lora_rank=r.positive("kv_lora_rank"), qk_nope_head_dim=dn, qk_rope_head_dim=dr,
               v_head_dim=r.positive("v_head_dim"), bias=r.opt("attention_bias", False, bool), scale=(dn + dr) ** -0.5,
               rope=False)
    keys = moe_keys(r, scaling_default=2.446)
    layers = []
    for i in range(n):
        if types[i] == "linear_attention":
            mixer = KimiDeltaAttention(hidden, lin["num_heads"], lin["head_dim"], conv_kernel=lin["conv_kernel"],
                                       norm_eps=eps, activation=act)
        else:
            mixer = MLAttention(hidden, r.positive("num_attention_heads"), **mla)
        ffn = _moe_block(hidden, r, act, keys) if sparse[i] else GatedMLP(hidden, r.positive("intermediate_size"), act)
        layers.append(DecoderLayer(mixer, ffn, RMSNorm(hidden, eps), RMSNorm(hidden, eps)))
    return CausalLM(spec, cfg, Backbone(spec.vocab_size, hidden, layers, RMSNorm(hidden, eps), None))


# ---------------------------------------------------------------------------------------------------- weights

_CONV = re.compile(r"(.*\.self_attn)\.([qkv])_conv1d\.weight")
_FUSED_CONV = re.compile(r"(.*\.self_attn)\.conv1d\.weight")
_LOAD = [(r"\.block_sparse_moe\.", ".mlp."),
         (r"(\.mlp\.experts\.\d+)\.w1\.weight$", r"\1.gate_proj.weight"),
         (r"(\.mlp\.experts\.\d+)\.w3\.weight$", r"\1.up_proj.weight"),
         (r"(\.mlp\.experts\.\d+)\.w2\.weight$", r"\1.down_proj.weight"),
         # the module part, as transformers renames it: a PEFT adapter's keys in the released layout
         # (``...self_attn.f_a_proj.lora_A.weight``, which stock PEFT loads) too
         (r"\.self_attn\.(f_a_proj|f_b_proj)\.", r".self_attn.forget_gate.\1."),
         (r"\.self_attn\.(dt_bias|A_log)$", r".self_attn.forget_gate.\1")]
# saving maps back only parameters' own names: a PEFT adapter's keys (``...forget_gate.f_a_proj.lora_A.weight``,
# ``...mlp.shared_experts.up_proj.lora_B.weight``) are transformers' in-memory names and stay as they are
_SAVE = [(r"\.mlp\.(gate\.weight|gate\.e_score_correction_bias)$", r".block_sparse_moe.\1"),
         (r"\.mlp\.shared_experts\.(gate_proj|up_proj|down_proj)\.weight$",
          r".block_sparse_moe.shared_experts.\1.weight"),
         (r"\.mlp\.experts\.(\d+)\.gate_proj\.weight$", r".block_sparse_moe.experts.\1.w1.weight"),
         (r"\.mlp\.experts\.(\d+)\.up_proj\.weight$", r".block_sparse_moe.experts.\1.w3.weight"),
         (r"\.mlp\.experts\.(\d+)\.down_proj\.weight$", r".block_sparse_moe.experts.\1.w2.weight"),
         (r"\.self_attn\.forget_gate\.(f_a_proj|f_b_proj)\.weight$", r".self_attn.\1.weight"),
         (r"\.self_attn\.forget_gate\.(dt_bias|A_log)$", r".self_attn.\1")]


def _concat_source(param: str, names: list[str], reader: CheckpointReader) -> WeightSource:
    """A parameter that is ``cat([reader(n) for n in names], dim 0)`` (KDA's conv: q, k, v): rows ``[a, b)`` read
    only the rows of each part that fall in them. Parts stored ``[C, K]`` (a depthwise kernel without its
    ``nn.Conv1d`` middle dimension, as some ports write it) are read as ``[C, 1, K]``, the parameter's shape."""
    shapes = [tuple(reader.shape(n)) for n in names]
    if any(s[1:] != shapes[0][1:] for s in shapes):
        raise ValueError(f"{param}: the tensors it concatenates differ beyond their rows: "
                         + ", ".join(f"{n} {s}" for n, s in zip(names, shapes)))
    flat = len(shapes[0]) == 2
    starts = [sum(s[0] for s in shapes[:i]) for i in range(len(shapes) + 1)]
    shape = (starts[-1], *((1,) if flat else ()), *shapes[0][1:])

    def read(rows: Rows, out: Tensor | None) -> Tensor:
        a, b = rows if rows is not None else (0, shape[0])
        parts = [reader.read(n, (max(a, lo) - lo, min(b, hi) - lo))
                 for n, lo, hi in zip(names, starts, starts[1:]) if max(a, lo) < min(b, hi)]
        t = torch.cat(parts, dim=0) if parts else reader.read(names[0], (0, 0))
        if flat:
            t = t.unsqueeze(1)
        if out is None:
            return t
        return out.copy_(t)

    return WeightSource(param, shape, read)


@dataclass
class KimiWeightMap(DeepseekWeightMap):
    """The released Kimi-Linear layout (module docstring) on load and save; experts fused and split as
    :class:`~longstraw.models.weights.ExpertWeightMap` does, MTP layers skipped as DeepSeek's map does. A KDA
    family whose released names differ (Ling 3.0: :mod:`longstraw.models.bailing`) gives its own ``load_renames``
    (checkpoint -> in-memory names) and ``save_renames_released`` (parameters' own names only, back)."""

    load_renames: ClassVar[list[tuple[str, str]]] = _LOAD
    save_renames_released: ClassVar[list[tuple[str, str]]] = _SAVE

    def __post_init__(self):
        self.renames.extend(self.load_renames)

    def sources(self, ckpt_names: list[str], reader: CheckpointReader) -> list[WeightSource]:
        convs: dict[str, dict[str, str]] = {}
        rest = []
        for n in ckpt_names:
            m = _CONV.fullmatch(self.renamed(n))
            if m and self.param_name(n) is not None:
                convs.setdefault(m.group(1), {})[m.group(2)] = n
            else:
                rest.append(n)
        out = super().sources(rest, reader)
        for prefix, parts in convs.items():
            missing = [f"{prefix}.{c}_conv1d.weight" for c in "qkv" if c not in parts]
            if missing:
                raise ValueError(f"incomplete KDA conv in the checkpoint: missing {', '.join(missing)}")
            out.append(_concat_source(self.param_name(f"{prefix}.conv1d.weight"), [parts[c] for c in "qkv"], reader))
        return out

    def save_tensors(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, t in super().save_tensors(named):
            m = _FUSED_CONV.fullmatch(name)
            if m and t is not None:
                for c, part in zip("qkv", t.chunk(3, dim=0)):
                    yield self._saved_name(f"{m.group(1)}.{c}_conv1d.weight"), part.clone()
            else:
                yield self._saved_name(name), t

    def save_rows(self, name: str, rows: Tensor, first: int) -> Iterator[tuple[str, Tensor]]:
        for n, t in super().save_rows(name, rows, first):
            yield self._saved_name(n), t

    def _saved_name(self, name: str) -> str:
        for pat, repl in self.save_renames_released:
            name = re.sub(pat, repl, name)
        return name


def weights(cfg: dict) -> KimiWeightMap:
    return KimiWeightMap(num_layers=int(cfg.get("num_hidden_layers") or 0))


FAMILY = Family("kimi", MODEL_TYPES, build, weights)
