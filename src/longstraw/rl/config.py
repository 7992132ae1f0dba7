"""The training run's configuration: typed sections, validated, read from TOML, written beside the run.

A run config is a :class:`RunConfig` of sections (``model``, ``data``, ``rollout``, ``reward``, ``algorithm``,
``optim``, ``lora``, ``train``, ``parallel``), each a frozen dataclass. Two sections embed the engine's own settings
instead of restating them: ``algorithm.grpo`` is a :class:`~longstraw.engine.config.GRPOConfig` and ``rollout.sampling`` a
:class:`~longstraw.engine.config.SamplingConfig`, so those settings' defaults, types and range checks are defined
once, in the engine. The TOML stays flat for users (``[algorithm] clip_ratio_low = 0.2``, ``[rollout]
temperature = 1.0``): the loader routes each key to the embedded config and :func:`dump_config` writes it back flat.
A few engine fields are not keys because the run derives them (:data:`DERIVED`).

Values are coerced and checked by the fields' type hints, element types included: a field typed ``X | None`` is
written ``"none"`` in TOML, tuples come from TOML lists, enums from their strings, floats must be finite. Unknown
sections or keys are errors that suggest the nearest valid name; a bad value is one ``ValueError`` naming
``section.key=value`` and what is allowed. A :class:`RunConfig` validates itself on construction (:func:`validate`).

``load_config`` reads TOML; ``apply_overrides`` applies ``section.key=value`` strings (values parsed as TOML
literals, else taken as strings); ``dump_config`` writes the resolved config, so that ``longstraw train --config
RUN/config.toml`` repeats the run. Every field carries a help text (``field(metadata={"help": ...})``), from which
:func:`default_config_toml` (``longstraw config``: every key, its default and its help, a file to copy) and
:func:`config_reference` (``longstraw config --markdown``: docs/CONFIG.md) are generated.
"""

from __future__ import annotations

import dataclasses
import difflib
import functools
import json
import math
import re
import textwrap
import types
import typing
from dataclasses import MISSING, dataclass, field, fields
from enum import Enum
from pathlib import Path
from typing import Any

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10: the same parser, as a package
    import tomli as tomllib

from longstraw.engine.config import GRPOConfig, SamplingConfig
from longstraw.units import parse_bytes


def _key(default=MISSING, help: str = "", *, default_factory=MISSING):
    """A config field with its help text (the generated reference and the commented default config show it)."""
    return field(default=default, default_factory=default_factory, metadata={"help": help})


class MemoryCheck(str, Enum):
    WARN = "warn"
    ERROR = "error"
    OFF = "off"


class OptimOffload(str, Enum):
    NONE = "none"
    MOMENTS = "moments"
    MASTERS = "masters"


class WandbMode(str, Enum):
    ONLINE = "online"
    OFFLINE = "offline"


class _Section:
    """Base of the sections: construction coerces and checks each field by its type hint (an embedded engine
    config checks itself), so a section built in Python holds the same types as one loaded from TOML."""

    def __post_init__(self):
        name = _SECTION_NAMES[type(self)]
        for f in fields(self):
            typ, value = _hints(type(self))[f.name], getattr(self, f.name)
            if not dataclasses.is_dataclass(typ):
                object.__setattr__(self, f.name, _coerce(f"{name}.{f.name}", value, typ))
            elif not isinstance(value, typ):
                raise ValueError(f"{name}.{f.name}={value!r} must be a {typ.__name__}")


BUILTIN_MODELS = ("tiny-hybrid", "tiny-dense", "tiny-moe", "tiny-kimi")
MODEL_DTYPES = ("float32", "float64", "bfloat16", "float16")


@dataclass(frozen=True)
class ModelSection(_Section):
    """The policy model: an HF checkpoint directory, or a built-in random model for demos and tests."""

    path: str = _key("", "an HF checkpoint directory (config.json, safetensors, tokenizer); empty: build the "
                         "built-in random model named by model.builtin")
    builtin: str = _key("tiny-hybrid", "the built-in random model used when model.path is empty: tiny-hybrid "
                                       "(Gated DeltaNet + attention, Qwen3.5-style), tiny-dense (Llama-style) or tiny-moe (the hybrid with 8 "
                                       "routed experts, top-2, and a shared expert in every layer: Qwen3.5-MoE-style) "
                                       "or tiny-kimi (Kimi-Linear-style: Kimi Delta Attention, NoPE MLA, "
                                       "sigmoid-routed MoE)")
    dtype: str = _key("float32", "the model's dtype (its compute dtype; the checkpoint is read into it): float32, "
                                 "float64, bfloat16 or float16 (bfloat16/float16: see model.master_weights)")
    compute_dtype: str | None = _key(None, "autocast compute dtype over float32 parameters: bfloat16 or float16 "
                                           "(float32 gradient accumulation, low-precision compute); none: the "
                                           "parameters' dtype")
    master_weights: bool = _key(True, "with a bfloat16/float16 model.dtype: keep float32 master weights (so float32 "
                                      "gradients and AdamW moments; sharded under FSDP) and compute in model.dtype; "
                                      "false: parameters, gradients and optimiser state all in model.dtype (half "
                                      "the memory; updates below its resolution are lost)")
    device: str = _key("cpu", "cpu, cuda, cuda:N or mps; checked against this machine when the config is loaded")
    trust_remote_code: bool = _key(False, "import a tokenizer that is the checkpoint's own Python code "
                                          "(tokenizer_config.json's auto_map, e.g. Kimi's tokenization_kimi.py, "
                                          "which needs tiktoken); false: such a tokenizer is an error naming it")


@dataclass(frozen=True)
class DataSection(_Section):
    """Where prompts come from: a built-in synthetic task (``task``), a prompt file, or offline rollouts
    (``path``); set exactly one of ``task`` and ``path``."""

    task: str = _key("passkey", "a built-in synthetic long-context task (passkey, kv_retrieval, "
                                "variable_tracking), or \"\" to read data.path")
    path: str = _key("", "a JSONL or Parquet file of prompt rows {prompt, answer, ...} (prompt: a string or "
                         "chat messages), or of rollouts with data.offline = true")
    offline: bool = _key(False, "data.path holds rollouts produced elsewhere (vLLM, SGLang): rows {prompt, "
                                "responses, rewards, old_logprobs?}; nothing is sampled")
    prompt_key: str = _key("prompt", "the prompt's field in the rows of a prompt file (not offline rollouts)")
    answer_key: str = _key("answer", "the answer's field in the rows of a prompt file (passed to the reward)")
    prompt_len: int = _key(4096, "target prompt length in tokens of built-in task prompts (>= 16)")
    max_prompt_len: int = _key(1_048_576, "the longest prompt in tokens; a longer one is an error naming its "
                                          "index (built-in models: also their max_position_embeddings with "
                                          "rollout.max_new_tokens)")
    answer_digits: int = _key(2, "answer length in digits of built-in task prompts (1 to 32)")
    num_prompts: int = _key(0, "built-in tasks: the number of distinct prompts cycled through; 0: a new prompt "
                               "for every group")
    seed: int = _key(0, "seed of the built-in task prompts (prompt i is built from data.seed and i)")


@dataclass(frozen=True)
class RolloutSection(_Section):
    """How responses are sampled from each prompt's shared state: the engine's :class:`SamplingConfig` (its
    fields are keys of ``[rollout]``) plus the group size and the stop at EOS."""

    group_size: int = _key(8, "G: responses sampled per prompt (>= 2: GRPO compares them)")
    # the trainer's default answers are short (the built-in tasks' answers are a few digits): 8 new tokens, not the
    # engine's 256
    sampling: SamplingConfig = _key(help="the engine's sampling settings, written flat in [rollout]",
                                    default_factory=lambda: SamplingConfig(max_new_tokens=8))
    stop_at_eos: bool = _key(True, "end a response at the tokenizer's EOS token (offline rollouts: append EOS to "
                                   "each response)")


@dataclass(frozen=True)
class RewardSection(_Section):
    """The reward of a response: a built-in reward by name with its options, or your own function."""

    fn: str = _key("digit_match", "a built-in reward (exact_match, contains, regex, numeric, digit_match, "
                                  "digits_shaped) or a user function \"module:function\" / \"path.py:function\"")
    timeout_s: float = _key(10.0, "seconds one call of a user reward function may take (a call over it scores 0 "
                                  "and is recorded as an error)")
    options: dict[str, Any] = _key(help="keyword options of the reward, a TOML table such as { case_sensitive = "
                                        "false }: built-ins check theirs (exact_match, contains: case_sensitive; "
                                        "regex: pattern, mode, case_sensitive; numeric: rel_tol, abs_tol); a user "
                                        "function gets them in every call", default_factory=dict)


@dataclass(frozen=True)
class AlgorithmSection(_Section):
    """The GRPO update: the engine's :class:`GRPOConfig` (the loss, prompt gradient and memory settings; its
    fields are keys of ``[algorithm]``) plus what the trainer does around it."""

    grpo: GRPOConfig = _key(help="the engine's loss and memory settings, written flat in [algorithm]",
                            default_factory=GRPOConfig)
    norm_adv_by_std: bool = _key(True, "divide each group's advantages by its reward std (GRPO); false: "
                                       "advantages are reward - group mean (Dr. GRPO)")
    ppo_epochs: int = _key(1, "optimisation epochs over one step's rollouts (later epochs re-prefill under the "
                              "updated weights)")
    prompts_per_step: int = _key(1, "prompts (groups) per optimiser step, with one step-global loss normaliser")
    reuse_rollout_state: bool = _key(True, "keep each group's rollout prompt state for the first epoch's update "
                                           "(saves one prefill per group; memory: prompts_per_step states at "
                                           "once); false: re-prefill each group in the update")
    graph_budget: str | int = _key(0, "exact mode: memory that may hold prompt-step graphs from the prefill so "
                                      "the reverse pass does not recompute them (GRPOConfig.graph_budget_bytes): "
                                      "\"auto\" (what the memory check leaves after everything else; 0 when no "
                                      "limit is known or memory_check is off), a size (\"8G\") or bytes, 0: none. "
                                      "Applies to updates that prefill themselves (not to a reused rollout state: "
                                      "reuse_rollout_state, first epoch); under FSDP only with parallel.cp = the "
                                      "world size (every rank on one prompt), under cp > 1 not for the DeltaNet "
                                      "hybrids")


@dataclass(frozen=True)
class OptimSection(_Section):
    """AdamW with linear warm-up then cosine decay, and global-norm gradient clipping."""

    lr: float = _key(1e-3, "peak learning rate (> 0)")
    betas: tuple[float, float] = _key((0.9, 0.99), "AdamW's beta1 and beta2, each in [0, 1)")
    weight_decay: float = _key(0.0, "AdamW weight decay of matrices (norms and biases are not decayed)")
    eps: float = _key(1e-8, "AdamW epsilon")
    warmup_steps: int = _key(10, "optimiser steps of linear warm-up from lr / warmup_steps to lr")
    min_lr_ratio: float = _key(0.1, "the cosine decays to lr * min_lr_ratio at the last optimiser step, in [0, 1]")
    grad_clip: float = _key(1.0, "clip the global gradient norm to this; 0 disables clipping")
    offload: OptimOffload = _key(OptimOffload.NONE, "AdamW's state in host memory: none; moments (the two moments "
                                                    "on the host, the update computed there); masters (also the "
                                                    "float32 master weights on the host, the device keeping "
                                                    "model.dtype: needs a bfloat16/float16 model.dtype)")


@dataclass(frozen=True)
class LoraSection(_Section):
    """LoRA adapters instead of a full fine-tune (PEFT's format and names: ``longstraw.add_lora``): the base is
    frozen in model.dtype (no gradients, master weights or optimiser state), the adapters are trained, and
    checkpoints hold ``adapter/`` (a PEFT adapter directory: vLLM and PEFT load it) instead of the whole model."""

    rank: int | None = _key(None, "the adapters' rank r; \"none\": no adapters (a full fine-tune)")
    alpha: float | None = _key(None, "the scaling numerator: adapters add alpha / rank * B A x (alpha / sqrt(rank) "
                                     "with use_rslora); \"none\": twice the rank")
    target_modules: tuple[str, ...] = _key(("all-linear",), "the projections that get adapters, by transformers' "
                                           "module names (q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, "
                                           "down_proj; in_proj_qkvz, in_proj_ba, in_proj_qkv, in_proj_z, in_proj_b, "
                                           "in_proj_a, out_proj of Gated DeltaNet; f_a_proj, f_b_proj, b_proj, "
                                           "g_a_proj, g_b_proj of Kimi Delta Attention (f_proj, g_proj in "
                                           "Ling 3.0's); q_a_proj, q_b_proj, "
                                           "kv_a_proj_with_mqa, kv_b_proj of MLA), or [\"all-linear\"]: every "
                                           "linear layer but the LM head")
    dropout: float = _key(0.0, "dropout on the adapters' input, in [0, 1) (needs algorithm.prompt_grad = "
                               "\"detached\": the exact reverse pass recomputes the prompt)")
    use_rslora: bool = _key(False, "rank-stabilised LoRA: scale by alpha / sqrt(rank)")
    modules_to_save: tuple[str, ...] = _key((), "modules trained whole besides the adapters, e.g. "
                                                "[\"embed_tokens\", \"lm_head\"]")
    target_parameters: tuple[str, ...] = _key((), "routed experts' fused weights that get adapters (PEFT's "
                                                  "target_parameters; MoE models): \"mlp.experts.gate_up_proj\" "
                                                  "(one adapter for gate and up), \"mlp.experts.down_proj\"; with "
                                                  "them target_modules may be [] (not with dropout)")

    @property
    def enabled(self) -> bool:
        return self.rank is not None


@dataclass(frozen=True)
class TrainSection(_Section):
    """The loop: steps, seed, run directory, checkpoints, logging, and the memory check before the run."""

    steps: int = _key(100, "training steps (each: prompts_per_step groups, ppo_epochs optimiser steps)")
    seed: int = _key(0, "seed of the initial weights (built-in models) and of every step's sampling")
    out_dir: str = _key("runs/longstraw", "the run directory (config.toml, metrics.jsonl, plots/, checkpoints/)")
    save_every: int = _key(50, "checkpoint every this many steps; 0: only at the end (the last step is always "
                               "saved)")
    keep_last: int = _key(2, "complete checkpoints kept (older ones are deleted)")
    log_every: int = _key(1, "print a log line every this many steps when train.progress is false")
    progress: bool = _key(True, "a progress bar instead of log lines")
    tensorboard: bool = _key(True, "write TensorBoard events to RUN/tensorboard when the tensorboard package is "
                                   "installed")
    wandb: bool = _key(False, "log each step's metrics to Weights & Biases (needs pip install wandb)")
    wandb_project: str = _key("longstraw", "the W&B project of the run")
    wandb_mode: WandbMode = _key(WandbMode.ONLINE, "online: sync to the W&B server as the run goes; offline: "
                                                   "write RUN/wandb only (wandb sync uploads it later)")
    plots: bool = _key(True, "write RUN/plots/*.png at the end (needs matplotlib)")
    memory_check: MemoryCheck = _key(MemoryCheck.WARN, "before the run, the planner's peak memory against "
                                                       "train.memory_limit: warn, error (refuse a run that does "
                                                       "not fit) or off")
    memory_limit: str = _key("", "memory per device for the check, e.g. \"80G\"; \"\": the device's (CUDA: total; "
                                 "CPU: available now)")


@dataclass(frozen=True)
class ParallelSection(_Section):
    """How the run spreads over the ranks of a ``torchrun`` job (docs/DISTRIBUTED.md, "Training on many GPUs"):
    ``cp`` ranks share each prompt (context parallelism), the job's ``W / cp`` data-parallel replicas take different
    prompts of a step, and FSDP2 shards every parameter, gradient and optimiser state over the job. Without
    ``torchrun`` the run is one process and only the defaults are allowed."""

    cp: int = _key(1, "context parallelism: ranks that share each prompt, each holding ~1/cp of its prompt state; "
                      "must divide the job's world size, which leaves world / cp data-parallel replicas (each takes "
                      "algorithm.prompts_per_step / replicas prompts of a step)")
    fsdp: bool = _key(True, "shard every parameter, gradient and optimiser state over the job's ranks with FSDP2 "
                            "(sharded checkpoints); with one process it is off; false: every rank holds the whole "
                            "model")
    replicate: int = _key(1, "HSDP: shard over each of this many groups of world / replicate consecutive ranks and "
                             "replicate across them (the number of nodes, so parameter all-gathers stay inside a "
                             "node); 1: shard over the whole job; > 1 needs fsdp = true")
    ep: int = _key(1, "expert parallelism (MoE models): the routed experts of every MoE layer are split over groups "
                      "of this many consecutive ranks, which exchange tokens (all-to-all) instead of gathering "
                      "experts; must divide the world size and every layer's number of experts; > 1 needs fsdp = "
                      "true; with more ranks than ep each rank's block of experts is FSDP-sharded again over the "
                      "ranks holding it (ep_shard; docs/DISTRIBUTED.md)")
    ep_shard: bool = _key(True, "with more ranks than ep: FSDP-shard each rank's block of experts over the world / ep "
                                "ranks holding it (1/world of the experts per rank, gathered while its layer runs); "
                                "false: replicate it there (1/ep per rank, no gathers: where memory allows, e.g. "
                                "frozen LoRA experts, or HSDP with ep = the ranks of a node)")


SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "rollout": RolloutSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "optim": OptimSection,
    "lora": LoraSection,
    "train": TrainSection,
    "parallel": ParallelSection,
}

_SECTION_NAMES = {cls: name for name, cls in SECTIONS.items()}


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


# Fields of the embedded engine configs that are not keys of their section: where the run takes each from.
DERIVED = {
    ("algorithm", "temperature"): "taken from rollout.temperature",
    ("algorithm", "compute_dtype"): "taken from model.compute_dtype",
    ("algorithm", "graph_budget_bytes"): "taken from algorithm.graph_budget (\"auto\": resolved by the trainer)",
    ("rollout", "stop_token_ids"): "the tokenizer's EOS token when rollout.stop_at_eos = true",
    ("rollout", "seed"): "derived per step and prompt from train.seed",
}
# the keys those derived from keys come from (an engine error about the field names the key)
DERIVED_FROM = {("algorithm", "temperature"): "rollout.temperature",
                 ("algorithm", "compute_dtype"): "model.compute_dtype",
                 ("algorithm", "graph_budget_bytes"): "algorithm.graph_budget"}


def graph_budget_bytes(value: str | int) -> int | None:
    """``algorithm.graph_budget`` as bytes: None for ``"auto"`` (the trainer resolves it), else the size."""
    if value == "auto":
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 0:
            raise ValueError(f"algorithm.graph_budget={value} must be >= 0, a size such as \"8G\", or \"auto\"")
        return value
    if isinstance(value, str) and value.strip() == "0":
        return 0
    try:
        return parse_bytes(value, "algorithm.graph_budget")
    except ValueError:
        raise ValueError(f"algorithm.graph_budget={value!r} must be \"auto\", a size such as \"8G\", or a number "
                         "of bytes >= 0") from None


@dataclass(frozen=True)
class RunConfig:
    """A whole run's settings; validated on construction (:func:`validate`)."""

    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimSection = field(default_factory=OptimSection)
    lora: LoraSection = field(default_factory=LoraSection)
    train: TrainSection = field(default_factory=TrainSection)
    parallel: ParallelSection = field(default_factory=ParallelSection)

    def __post_init__(self):
        validate(self)

    def to_dict(self) -> dict:
        """``{section: {key: value}}`` as the TOML has it: flat, enums as their strings, tuples as lists."""
        return {name: {k.name: _plain(k.value(self)) for k in section_keys(name)} for name in SECTIONS}


# ---------------------------------------------------------------------------------------------------- keys


@dataclass(frozen=True)
class Key:
    """One TOML key ``[section] name``: its type hint, help text, and (``via``) the embedded engine config that
    holds it (``grpo``, ``sampling``), or None for a field of the section itself."""

    section: str
    name: str
    type: Any
    help: str
    via: str | None = None

    @property
    def path(self) -> str:
        return f"{self.section}.{self.name}"

    def value(self, cfg: RunConfig):
        obj = getattr(cfg, self.section)
        return getattr(getattr(obj, self.via) if self.via else obj, self.name)


def _embedded(cls) -> dict[str, type]:
    """The section's fields that embed an engine config: ``{field name: config class}``."""
    return {f.name: _hints(cls)[f.name] for f in fields(cls) if dataclasses.is_dataclass(_hints(cls)[f.name])}


@functools.cache
def section_keys(section: str) -> tuple[Key, ...]:
    """The keys of ``[section]`` in order (an embedded engine config's fields in its place, less :data:`DERIVED`)."""
    cls = SECTIONS[section]
    hints, emb = _hints(cls), _embedded(cls)
    out = []
    for f in fields(cls):
        if f.name in emb:
            sub = _hints(emb[f.name])
            out += [Key(section, g.name, sub[g.name], g.metadata.get("help", ""), f.name) for g in fields(emb[f.name])
                    if (section, g.name) not in DERIVED]
        else:
            out.append(Key(section, f.name, hints[f.name], f.metadata.get("help", "")))
    return tuple(out)


def config_keys() -> list[Key]:
    """Every key of every section, in order."""
    return [k for name in SECTIONS for k in section_keys(name)]


# ---------------------------------------------------------------------------------------------------- values


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"


def _optional(typ):
    """``X`` for a type hint ``X | None``, else None."""
    if typing.get_origin(typ) in (typing.Union, types.UnionType):
        inner = [a for a in typing.get_args(typ) if a is not type(None)]
        if len(inner) == 1 and len(typing.get_args(typ)) == 2:
            return inner[0]
    return None


_SINGULAR = {bool: "true or false", int: "an integer", float: "a finite number", str: "a string"}
_PLURAL = {bool: "booleans", int: "integers", float: "finite numbers", str: "strings"}


def _describe(typ) -> str:
    """What a value of type hint ``typ`` must be, for error messages."""
    if (inner := _optional(typ)) is not None:
        return f'{_describe(inner)}, or "none" to disable it'
    if isinstance(typ, types.UnionType):
        return " or ".join(_describe(t) for t in typing.get_args(typ))
    if isinstance(typ, type) and issubclass(typ, Enum):
        return "one of " + ", ".join(repr(m.value) for m in typ)
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (tuple, list):
        elem = args[0] if args else Any
        what = _PLURAL.get(elem, "values")
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        return f"a list of {len(args)} {what}" if fixed else f"a list of {what}"
    if typ is dict or origin is dict:
        return "a table (e.g. { key = value })"
    return _SINGULAR[typ]


def _coerce(where: str, value: Any, typ) -> Any:
    """``value`` (from TOML or Python) as type hint ``typ``; ValueError ``where=value must be ...`` otherwise."""
    bad = ValueError(f"{where}={value!r} must be {_describe(typ)}")
    if typ is Any:
        return value
    if (inner := _optional(typ)) is not None:
        if value is None or value == "none":
            return None
        try:
            return _coerce(where, value, inner)
        except ValueError:
            raise bad from None
    if isinstance(typ, types.UnionType):  # str | int: the first member the value is
        for t in typing.get_args(typ):
            try:
                return _coerce(where, value, t)
            except ValueError:
                pass
        raise bad
    if isinstance(typ, type) and issubclass(typ, Enum):
        if isinstance(value, typ):
            return value
        allowed = ", ".join(repr(m.value) for m in typ)
        try:
            return typ(value)
        except ValueError:
            raise ValueError(f"{where}={value!r} is not supported; allowed: {allowed}") from None
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise bad
        fixed = origin is tuple and args and args[-1] is not Ellipsis
        if fixed and len(value) != len(args):
            raise bad
        elems = args if fixed else [args[0] if args else Any] * len(value)
        try:
            out = [_coerce(where, v, t) for v, t in zip(value, elems)]
        except ValueError:
            raise bad from None
        return tuple(out) if origin is tuple else out
    if typ is dict or origin is dict:
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise bad
        return dict(value)
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise bad
        return float(value)
    if typ in (int, bool, str):
        if not isinstance(value, typ) or (typ is int and isinstance(value, bool)):
            raise bad
        return value
    raise AssertionError(f"unhandled config type {typ} for {where}")


def _plain(v: Any) -> Any:
    """A value as TOML holds it: enums as their strings, tuples as lists (None stays None)."""
    if isinstance(v, Enum):
        return v.value
    if isinstance(v, (list, tuple)):
        return [_plain(x) for x in v]
    if isinstance(v, dict):
        return {k: _plain(x) for k, x in v.items()}
    return v


def _engine_error(section: str, e: ValueError) -> ValueError:
    """An engine config's message (``name=value ...``) in the run config's terms: ``section.name=value ...`` (or the
    key a derived field comes from), with TOML's ``"none"`` for Python's None."""
    msg = str(e)
    m = re.match(r"\w+", msg)
    name = m.group(0) if m else ""
    path = DERIVED_FROM.get((section, name), f"{section}.{name}")
    msg = path + msg[len(name):]
    return ValueError(msg.replace("or None", 'or "none"').replace("allowed: None", 'allowed: "none"'))


def _section(name: str, values: Any, derived: dict):
    """Build section ``name`` from its TOML table (``derived``: values of the embedded configs' derived fields)."""
    cls = SECTIONS[name]
    if not isinstance(values, dict):
        raise ValueError(f"[{name}] must be a table of keys, got {values!r}")
    keys = {k.name: k for k in section_keys(name)}
    own, emb = {}, {f: {} for f in _embedded(cls)}
    for k, v in values.items():
        if k not in keys:
            if (name, k) in DERIVED:
                raise ValueError(f"{name}.{k} is not a key: it is {DERIVED[(name, k)]}")
            raise ValueError(f"unknown key {name}.{k}{_suggest(k, keys)}")
        key = keys[k]
        (emb[key.via] if key.via else own)[k] = _coerce(key.path, v, key.type)
    defaults = {f.name: f.default_factory() for f in fields(cls) if f.name in emb}
    for attr, given in emb.items():
        try:  # the embedded config checks its own values on construction
            own[attr] = dataclasses.replace(defaults[attr], **given, **derived)
        except ValueError as e:
            raise _engine_error(name, e) from None
    return cls(**own)


def config_from_dict(d: dict) -> RunConfig:
    """A validated RunConfig from ``{section: {key: value}}`` (TOML's shape; missing keys take their defaults)."""
    for name in d:
        if name not in SECTIONS:
            raise ValueError(f"unknown section [{name}]{_suggest(name, SECTIONS)}")
    built: dict = {}
    for name in SECTIONS:
        derived = {}
        if name == "algorithm":  # the loss's temperature is the sampling temperature; autocast is the model's
            derived = {"temperature": built["rollout"].sampling.temperature,
                       "compute_dtype": built["model"].compute_dtype,
                       "graph_budget_bytes": _graph_budget_of(d.get(name, {}))}
        built[name] = _section(name, d.get(name, {}), derived)
    return RunConfig(**built)


def _graph_budget_of(values: dict) -> int | None:
    """The engine's graph_budget_bytes for ``[algorithm]``'s raw values: None for none (0, and "auto" in detached
    mode: no reverse pass) and for "auto" until the trainer resolves it, else the bytes."""
    raw = values.get("graph_budget", 0)
    if isinstance(raw, str) and raw != "auto" or isinstance(raw, int):
        b = graph_budget_bytes(raw)  # a bad value: its message names algorithm.graph_budget
    else:
        b = None
    if values.get("prompt_grad", "exact") == "detached" and raw == "auto":
        return None
    return b or None  # 0: none kept, as the engine's default None


def load_config(path: str | Path) -> RunConfig:
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"config file {str(p)!r} does not exist")
    try:
        d = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{p}: invalid TOML ({e})") from None
    return config_from_dict(d)


def _parse_value(text: str) -> Any:
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text


def apply_overrides(cfg: RunConfig, overrides: list[str]) -> RunConfig:
    """Apply ``section.key=value`` overrides; the result is validated like a loaded config."""
    d = cfg.to_dict()
    for ov in overrides:
        if "=" not in ov or "." not in ov.split("=", 1)[0]:
            raise ValueError(f"override {ov!r} must look like section.key=value")
        key, text = ov.split("=", 1)
        section, name = key.strip().split(".", 1)
        if section not in SECTIONS:
            raise ValueError(f"unknown section [{section}] in override {ov!r}{_suggest(section, SECTIONS)}")
        d[section][name] = _parse_value(text.strip())
    return config_from_dict(d)


_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")


def _toml_value(v: Any) -> str:
    v = _plain(v)
    if v is None:
        return '"none"'
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        items = [f"{k if _BARE_KEY.fullmatch(k) else json.dumps(k)} = {_toml_value(x)}" for k, x in v.items()]
        return "{ " + ", ".join(items) + " }" if items else "{}"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_config(cfg: RunConfig) -> str:
    lines = []
    for name in SECTIONS:
        lines.append(f"[{name}]")
        lines += [f"{k.name} = {_toml_value(k.value(cfg))}" for k in section_keys(name)]
        lines.append("")
    return "\n".join(lines)


def diff_configs(a: RunConfig, b: RunConfig, ignore: tuple[str, ...] = ()) -> list[str]:
    """``section.key: a != b`` for every differing value (keys in ``ignore`` skipped)."""
    out = []
    da, db = a.to_dict(), b.to_dict()
    for s in da:
        for k in da[s]:
            if f"{s}.{k}" in ignore:
                continue
            if da[s][k] != db[s][k]:
                out.append(f"{s}.{k}: {da[s][k]!r} != {db[s][k]!r}")
    return out


# ---------------------------------------------------------------------------------------------------- checks


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def _check_reward(r: RewardSection) -> None:
    """Built-in rewards and their options are checked now; a user function is imported by the trainer (not here:
    importing it runs the user's code)."""
    from longstraw.rl.rewards import BUILTINS, make_reward

    if ":" in r.fn:
        return
    _require(r.fn in BUILTINS, f"reward.fn={r.fn!r} is not a built-in reward; built-ins: {', '.join(BUILTINS)}; or a "
                               "user function 'module:function' or 'path/to/file.py:function'")
    try:
        make_reward(r.fn, **r.options)
    except ValueError as e:
        raise ValueError(f"reward.options={_toml_value(r.options)}: {e}") from None


def validate(cfg: RunConfig) -> None:
    """Range checks that the types alone do not express (the embedded engine configs check their own fields on
    construction), and that the derived engine fields agree with the keys they come from."""
    from longstraw.devices import resolve_device

    m, d, r, a, o, t = cfg.model, cfg.data, cfg.rollout, cfg.algorithm, cfg.optim, cfg.train
    g, s = a.grpo, r.sampling
    _require(bool(m.path) or m.builtin in BUILTIN_MODELS,
             f"model.builtin={m.builtin!r} is not a built-in model; allowed: {', '.join(map(repr, BUILTIN_MODELS))} "
             "(or set model.path to a checkpoint directory)")
    _require(m.dtype in MODEL_DTYPES, f"model.dtype={m.dtype!r}; allowed: 'float32', 'float64', 'bfloat16', 'float16'")
    resolve_device(m.device, "model.device")
    _require(bool(d.task) != bool(d.path), "set exactly one of data.task (a built-in task) and data.path (a file)")
    _require(not d.offline or bool(d.path), "data.offline = true needs data.path (a JSONL of rollouts)")
    _require(d.prompt_len >= 16, f"data.prompt_len={d.prompt_len} must be >= 16")
    _require(d.max_prompt_len >= 2, f"data.max_prompt_len={d.max_prompt_len} must be >= 2")
    _require(not d.task or d.prompt_len <= d.max_prompt_len,  # prompt_len sizes built-in task prompts only
             f"data.prompt_len={d.prompt_len} exceeds data.max_prompt_len={d.max_prompt_len}")
    _require(1 <= d.answer_digits <= 32, f"data.answer_digits={d.answer_digits} must be in [1, 32]")
    _require(d.num_prompts >= 0, f"data.num_prompts={d.num_prompts} must be >= 0")
    _require(r.group_size >= 2, f"rollout.group_size={r.group_size} must be >= 2 (GRPO compares responses)")
    _require(s.temperature > 0, f"rollout.temperature={s.temperature} must be > 0 for training rollouts")
    _require(s.stop_token_ids == (), f"rollout's sampling.stop_token_ids={s.stop_token_ids} must be empty: it is "
                                     f"{DERIVED[('rollout', 'stop_token_ids')]}")
    _require(s.seed is None, f"rollout's sampling.seed={s.seed} must be None: it is {DERIVED[('rollout', 'seed')]}")
    _require(g.temperature == s.temperature, f"algorithm's grpo.temperature={g.temperature} differs from "
                                             f"rollout.temperature={s.temperature}: it is taken from "
                                             "rollout.temperature")
    _require(g.compute_dtype == m.compute_dtype, f"algorithm's grpo.compute_dtype={g.compute_dtype!r} differs from "
                                                 f"model.compute_dtype={m.compute_dtype!r}: it is taken from "
                                                 "model.compute_dtype")
    _require(cfg.reward.timeout_s > 0, f"reward.timeout_s={cfg.reward.timeout_s} must be > 0")
    _check_reward(cfg.reward)
    _require(a.ppo_epochs >= 1, f"algorithm.ppo_epochs={a.ppo_epochs} must be >= 1")
    _require(a.prompts_per_step >= 1, f"algorithm.prompts_per_step={a.prompts_per_step} must be >= 1")
    _require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    _require(all(0 <= b < 1 for b in o.betas), f"optim.betas={list(o.betas)} must be two numbers in [0, 1)")
    _require(o.eps > 0, f"optim.eps={o.eps} must be > 0")
    _require(o.weight_decay >= 0, f"optim.weight_decay={o.weight_decay} must be >= 0")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _require(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    _require(o.offload != OptimOffload.MASTERS or m.dtype in ("bfloat16", "float16"),
             f"optim.offload='masters' keeps float32 master weights on the host for a bfloat16/float16 model.dtype; "
             f"model.dtype={m.dtype!r} (use optim.offload='moments')")
    lo = cfg.lora
    if lo.enabled:
        from longstraw.models.lora import LoraSettings

        _require(lo.rank >= 1, f"lora.rank={lo.rank} must be >= 1 (or \"none\": no adapters)")
        _require(lo.alpha is None or lo.alpha > 0, f"lora.alpha={lo.alpha} must be > 0 (or \"none\": 2 * rank)")
        _require(0 <= lo.dropout < 1, f"lora.dropout={lo.dropout} must be in [0, 1)")
        tp = list(lo.target_parameters)
        _require(all(tp), f"lora.target_parameters={tp} has an empty name; allowed: the routed experts' fused "
                          "weights, \"mlp.experts.gate_up_proj\", \"mlp.experts.down_proj\"")
        _require((len(lo.target_modules) > 0 or tp) and all(lo.target_modules),
                 f"lora.target_modules={list(lo.target_modules)} must name at least one module (or "
                 "[\"all-linear\"]; [] only with lora.target_parameters)")
        _require(lo.dropout == 0 or not a.grpo.exact,
                 f"lora.dropout={lo.dropout} needs algorithm.prompt_grad = \"detached\": the exact reverse pass "
                 "recomputes the prompt and would draw other dropout masks (or set lora.dropout = 0)")
        _require(lo.dropout == 0 or not tp,
                 f"lora.dropout={lo.dropout} with lora.target_parameters={tp}: a fused expert weight's low-rank "
                 "update has no per-input dropout (PEFT refuses it too); set lora.dropout = 0")
        try:
            t_ = "all-linear" if tuple(lo.target_modules) == ("all-linear",) else tuple(lo.target_modules)
            LoraSettings(r=lo.rank, lora_alpha=lo.alpha or 2.0 * lo.rank, target_modules=t_, lora_dropout=lo.dropout,
                         modules_to_save=tuple(lo.modules_to_save), target_parameters=tuple(tp))
        except ValueError as e:
            raise ValueError(lora_key_names(str(e))) from None
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(t.save_every >= 0, f"train.save_every={t.save_every} must be >= 0")
    _require(t.keep_last >= 1, f"train.keep_last={t.keep_last} must be >= 1")
    _require(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _require(bool(t.wandb_project), "train.wandb_project must not be empty")
    if t.memory_limit:
        parse_bytes(t.memory_limit, "train.memory_limit")
    p = cfg.parallel
    _require(p.cp >= 1, f"parallel.cp={p.cp} must be >= 1 (the ranks that share one prompt)")
    _require(p.replicate >= 1, f"parallel.replicate={p.replicate} must be >= 1 (HSDP replica groups; 1: plain FSDP)")
    _require(p.replicate == 1 or p.fsdp, f"parallel.replicate={p.replicate} needs parallel.fsdp = true (it "
                                         "replicates FSDP's shards over groups of ranks)")
    _require(p.ep >= 1, f"parallel.ep={p.ep} must be >= 1 (ranks the routed experts are split over; 1: off)")
    _require(p.ep == 1 or p.fsdp, f"parallel.ep={p.ep} needs parallel.fsdp = true (the rest of the model is FSDP-"
                                  "sharded and every rank runs in lockstep)")


def lora_key_names(message: str) -> str:
    """A ``models.lora`` error (``LoRA target_parameters=...``, ``LoRA dropout=...``) in the ``[lora]`` section's key
    names (``lora.target_parameters=...``), so the user sees which config key to change."""
    message = re.sub(r"\bLoRA (target_modules|target_parameters|modules_to_save|dropout)\b",
                     lambda m: "lora." + m.group(1), message)
    message = re.sub(r"^LoRA target (?=')", "lora.target_modules entry ", message)  # models.lora.lora_targets
    message = re.sub(r"^modules_to_save entry", "lora.modules_to_save entry", message)  # models.lora.kept_modules
    return message.replace("adapt them with target_parameters=", "adapt them with lora.target_parameters = ")


def grpo_config(cfg: RunConfig) -> GRPOConfig:
    """The engine's settings of the run's GRPO backward: ``algorithm``'s embedded GRPOConfig, whose temperature and
    compute dtype the loader took from ``rollout.temperature`` and ``model.compute_dtype``."""
    return cfg.algorithm.grpo


def sampling_config(cfg: RunConfig, stop_token_ids=()) -> SamplingConfig:
    """The run's rollout sampling settings with the tokenizer's stop ids (the seed is set per step by the trainer)."""
    return dataclasses.replace(cfg.rollout.sampling, stop_token_ids=tuple(stop_token_ids))


# ---------------------------------------------------------------------------------------------------- reference


def type_text(typ) -> str:
    """A key's type as the reference shows it (``float or "none"``, ``list of str``, ``"warn" | "error"``)."""
    if (inner := _optional(typ)) is not None:
        return f'{type_text(inner)} or "none"'
    if isinstance(typ, types.UnionType):
        return " or ".join(type_text(t) for t in typing.get_args(typ))
    if isinstance(typ, type) and issubclass(typ, Enum):
        return " | ".join(json.dumps(m.value) for m in typ)
    origin, args = typing.get_origin(typ), typing.get_args(typ)
    if origin in (tuple, list):
        if args and args[-1] is not Ellipsis and origin is tuple:
            return f"list of {len(args)} {type_text(args[0])}"
        return f"list of {type_text(args[0]) if args else 'values'}"
    if typ is dict or origin is dict:
        return "table"
    return typ.__name__


def _default_note(k: Key) -> str:
    """Where the trainer's default of an embedded key differs from the engine class's, say so."""
    if k.via is None:
        return ""
    cls = _embedded(SECTIONS[k.section])[k.via]
    engine = {f.name: f.default for f in fields(cls)}[k.name]
    mine = k.value(_defaults())
    return "" if engine == mine else f" (the trainer's default; {cls.__name__}'s is {_toml_value(engine)})"


@functools.cache
def _defaults() -> RunConfig:
    return RunConfig()


def _doc(cls) -> str:
    return " ".join(textwrap.dedent(cls.__doc__ or "").split()).replace("``", "`").replace(":class:", "")


def default_config_toml() -> str:
    """The default run config as commented TOML: every key with its default and help (``longstraw config``)."""
    cfg = _defaults()
    lines = ["# LongStraw run config: every key with its default value. Copy it, edit what you need, then",
             "#   longstraw train --config run.toml",
             '# Values: "none" leaves an optional setting unset; lists for tuples; strings for choices.',
             "# Reference: docs/CONFIG.md (longstraw config --markdown). Generated from longstraw.rl.config."]
    for name, cls in SECTIONS.items():
        lines += ["", *("# " + x for x in textwrap.wrap(_doc(cls), 114)), f"[{name}]"]
        for k in section_keys(name):
            text = f"{k.help}{_default_note(k)}. Type: {type_text(k.type)}."
            lines += ["# " + x for x in textwrap.wrap(text, 114)]
            lines.append(f"{k.name} = {_toml_value(k.value(cfg))}")
    return "\n".join(lines) + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def config_reference() -> str:
    """docs/CONFIG.md: a table per section of every key, its type, default and meaning (``longstraw config
    --markdown``)."""
    cfg = _defaults()
    intro = [
        "Generated from the config classes (`longstraw.rl.config.config_reference`, printed by `longstraw config "
        "--markdown`); a test keeps this file equal to it, so edit the help texts in the code, not this file.",
        "A run config is a TOML file with the sections below; every key is optional (a missing key takes its "
        "default). `longstraw config` prints all of them with their defaults as a commented file to copy; "
        "`longstraw train --config run.toml --set section.key=value` trains from it. The run directory's "
        "`config.toml` is the resolved config in the same form. An unknown key or a value of the wrong type is an "
        "error naming it. Writing values: `\"none\"` leaves a setting typed `... or \"none\"` unset; lists for lists; "
        "the strings shown for choices. Examples: [examples/](../examples/).",
        "`[algorithm]` holds the engine's `GRPOConfig` and `[rollout]` its `SamplingConfig` (the same fields, "
        "defaults and checks as in Python), plus the trainer's own keys. Not keys, derived by the run: "
        + "; ".join(f"{s}'s `{n}` ({src})" for (s, n), src in DERIVED.items()) + ".",
    ]
    out = ["# Run configuration reference"]
    for para in intro:
        out += ["", *textwrap.wrap(para, 118, break_on_hyphens=False)]
    for name, cls in SECTIONS.items():
        out += ["", f"## [{name}]", "", _doc(cls), "", "| key | type | default | meaning |", "|---|---|---|---|"]
        for k in section_keys(name):
            out.append(f"| `{k.name}` | {_cell(type_text(k.type))} | `{_cell(_toml_value(k.value(cfg)))}` | "
                       f"{_cell(k.help + _default_note(k))} |")
    return "\n".join(out) + "\n"
