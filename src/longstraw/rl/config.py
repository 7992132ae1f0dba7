"""The training run's configuration: typed sections, validated, read from TOML, written beside the run.

A run config is a :class:`RunConfig` of sections (``model``, ``data``, ``rollout``, ``reward``, ``algorithm``,
``optim``, ``train``), each a frozen dataclass. ``load_config`` reads TOML; ``apply_overrides`` applies
``section.key=value`` strings (values parsed as TOML literals, else taken as strings). Unknown sections or keys are
errors that suggest the nearest valid name; a value of the wrong type names the key, the value and the type.
``dump_config`` writes the resolved config as TOML, so that ``longstraw train --config RUN/config.toml`` repeats
the run.
"""

from __future__ import annotations

import difflib
import json
import math
import tomllib
import types
import typing
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from longstraw.units import parse_bytes


@dataclass(frozen=True)
class ModelSection:
    path: str = ""  # an HF checkpoint directory; empty: build the built-in model named by `builtin`
    builtin: str = "tiny-hybrid"  # tiny-hybrid | tiny-dense: random models for demos and tests
    dtype: str = "float32"
    compute_dtype: str = ""  # "" (the parameters' dtype) | bfloat16 | float16: autocast compute
    device: str = "cpu"


@dataclass(frozen=True)
class DataSection:
    task: str = "passkey"  # a built-in synthetic task, or "" to read prompts from `path`
    path: str = ""  # JSONL/Parquet prompts, or offline rollouts with `offline = true`
    offline: bool = False  # rows carry responses and rewards produced elsewhere (vLLM, SGLang)
    prompt_key: str = "prompt"
    answer_key: str = "answer"
    prompt_len: int = 4096  # target prompt length in tokens for built-in tasks
    max_prompt_len: int = 1_048_576  # longer prompts are an error
    answer_digits: int = 2  # passkey length for built-in tasks
    num_prompts: int = 0  # built-in tasks: distinct prompts in the epoch (0: a new prompt every time)
    seed: int = 0


@dataclass(frozen=True)
class RolloutSection:
    group_size: int = 8
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    max_new_tokens: int = 8
    stop_strings: list = field(default_factory=list)
    stop_at_eos: bool = True


@dataclass(frozen=True)
class RewardSection:
    fn: str = "digit_match"  # a built-in reward or "module:function" / "path.py:function"
    timeout_s: float = 10.0
    case_sensitive: bool = True


@dataclass(frozen=True)
class AlgorithmSection:
    prompt_grad: str = "exact"
    loss_agg_mode: str = "token-mean"
    norm_adv_by_std: bool = True
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float = 3.0  # dual clip; 0 disables it
    kl_coef: float = 0.0  # > 0 keeps a frozen reference model
    kl_type: str = "low_var_kl"
    entropy_coef: float = 0.0
    loss_scale_factor: float = 0.0  # seq-mean-token-sum-norm divisor; 0: the step's longest response
    ppo_epochs: int = 1  # optimisation epochs over one rollout batch
    prompts_per_step: int = 1
    reuse_rollout_state: bool = True  # keep each group's rollout prompt state for the first update (memory:
    # prompts_per_step states at once); false re-prefills each group in the update instead
    prefill_chunk: int = 4096
    branch_batch: int = 1
    checkpoint_layers: bool = False


@dataclass(frozen=True)
class OptimSection:
    lr: float = 1e-3
    betas: list = field(default_factory=lambda: [0.9, 0.99])
    weight_decay: float = 0.0
    eps: float = 1e-8
    warmup_steps: int = 10
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio at the last step
    grad_clip: float = 1.0  # 0 disables clipping


@dataclass(frozen=True)
class TrainSection:
    steps: int = 100
    seed: int = 0
    out_dir: str = "runs/longstraw"
    save_every: int = 50  # 0: only at the end
    keep_last: int = 2
    log_every: int = 1
    progress: bool = True
    tensorboard: bool = True  # used when the tensorboard package is installed
    plots: bool = True
    memory_check: str = "warn"  # warn | error | off: the planner's peak against memory_limit before the run
    memory_limit: str = ""  # e.g. "80G"; "": the device's memory (CUDA: total; CPU: available now)


SECTIONS = {
    "model": ModelSection,
    "data": DataSection,
    "rollout": RolloutSection,
    "reward": RewardSection,
    "algorithm": AlgorithmSection,
    "optim": OptimSection,
    "train": TrainSection,
}


@dataclass(frozen=True)
class RunConfig:
    model: ModelSection = field(default_factory=ModelSection)
    data: DataSection = field(default_factory=DataSection)
    rollout: RolloutSection = field(default_factory=RolloutSection)
    reward: RewardSection = field(default_factory=RewardSection)
    algorithm: AlgorithmSection = field(default_factory=AlgorithmSection)
    optim: OptimSection = field(default_factory=OptimSection)
    train: TrainSection = field(default_factory=TrainSection)

    def to_dict(self) -> dict:
        return asdict(self)


def _suggest(name: str, options) -> str:
    close = difflib.get_close_matches(name, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else f"; valid: {', '.join(sorted(options))}"


def _field_type(cls, name):
    hints = typing.get_type_hints(cls)
    return hints[name]


def _coerce(where: str, value: Any, typ) -> Any:
    origin = typing.get_origin(typ)
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValueError(f"{where}={value!r} must be a number")
        value = float(value)
        if not math.isfinite(value):
            raise ValueError(f"{where}={value!r} must be finite")
        return value
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{where}={value!r} must be an integer")
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise ValueError(f"{where}={value!r} must be true or false")
        return value
    if typ is str:
        if not isinstance(value, str):
            raise ValueError(f"{where}={value!r} must be a string")
        return value
    if typ is list or origin is list:
        if not isinstance(value, list):
            raise ValueError(f"{where}={value!r} must be a list")
        return list(value)
    if origin in (typing.Union, types.UnionType):
        return value
    raise AssertionError(f"unhandled config type {typ} for {where}")


def _section(name: str, cls, values: dict):
    if not isinstance(values, dict):
        raise ValueError(f"[{name}] must be a table of keys, got {values!r}")
    valid = {f.name: f for f in fields(cls)}
    kwargs = {}
    for k, v in values.items():
        if k not in valid:
            raise ValueError(f"unknown key {name}.{k}{_suggest(k, valid)}")
        kwargs[k] = _coerce(f"{name}.{k}", v, _field_type(cls, k))
    return cls(**kwargs)


def config_from_dict(d: dict) -> RunConfig:
    for name in d:
        if name not in SECTIONS:
            raise ValueError(f"unknown section [{name}]{_suggest(name, SECTIONS)}")
    cfg = RunConfig(**{name: _section(name, cls, d.get(name, {})) for name, cls in SECTIONS.items()})
    validate(cfg)
    return cfg


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


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v, ensure_ascii=False)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    raise TypeError(f"cannot write {v!r} as TOML")


def dump_config(cfg: RunConfig) -> str:
    lines = []
    for name, values in cfg.to_dict().items():
        lines.append(f"[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
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


def _require(cond: bool, msg: str) -> None:
    if not cond:
        raise ValueError(msg)


def validate(cfg: RunConfig) -> None:
    """Range checks that the types alone do not express. Engine-level values are re-checked by GRPOConfig."""
    m, d, r, a, o, t = cfg.model, cfg.data, cfg.rollout, cfg.algorithm, cfg.optim, cfg.train
    _require(bool(m.path) or m.builtin in ("tiny-hybrid", "tiny-dense"),
             f"model.builtin={m.builtin!r} is not a built-in model; allowed: 'tiny-hybrid', 'tiny-dense' "
             "(or set model.path to a checkpoint directory)")
    _require(m.dtype in ("float32", "float64", "bfloat16", "float16"),
             f"model.dtype={m.dtype!r}; allowed: 'float32', 'float64', 'bfloat16', 'float16'")
    _require(m.compute_dtype in ("", "bfloat16", "float16"),
             f"model.compute_dtype={m.compute_dtype!r}; allowed: '', 'bfloat16', 'float16'")
    _require(bool(d.task) != bool(d.path), "set exactly one of data.task (a built-in task) and data.path (a file)")
    _require(not d.offline or bool(d.path), "data.offline = true needs data.path (a JSONL of rollouts)")
    _require(d.prompt_len >= 16, f"data.prompt_len={d.prompt_len} must be >= 16")
    _require(d.max_prompt_len >= 2, f"data.max_prompt_len={d.max_prompt_len} must be >= 2")
    _require(d.prompt_len <= d.max_prompt_len,
             f"data.prompt_len={d.prompt_len} exceeds data.max_prompt_len={d.max_prompt_len}")
    _require(1 <= d.answer_digits <= 32, f"data.answer_digits={d.answer_digits} must be in [1, 32]")
    _require(d.num_prompts >= 0, f"data.num_prompts={d.num_prompts} must be >= 0")
    _require(r.group_size >= 2, f"rollout.group_size={r.group_size} must be >= 2 (GRPO compares responses)")
    _require(r.temperature > 0, f"rollout.temperature={r.temperature} must be > 0 for training rollouts")
    _require(r.max_new_tokens >= 1, f"rollout.max_new_tokens={r.max_new_tokens} must be >= 1")
    _require(r.top_k >= 0 and 0 < r.top_p <= 1, f"rollout.top_k={r.top_k} must be >= 0 and rollout.top_p={r.top_p} "
             "in (0, 1]")
    _require(cfg.reward.timeout_s > 0, f"reward.timeout_s={cfg.reward.timeout_s} must be > 0")
    _require(a.ppo_epochs >= 1, f"algorithm.ppo_epochs={a.ppo_epochs} must be >= 1")
    _require(a.prompts_per_step >= 1, f"algorithm.prompts_per_step={a.prompts_per_step} must be >= 1")
    _require(a.clip_ratio_c == 0 or a.clip_ratio_c > 1,
             f"algorithm.clip_ratio_c={a.clip_ratio_c} must be > 1, or 0 to disable the dual clip")
    _require(o.lr > 0, f"optim.lr={o.lr} must be > 0")
    _require(len(o.betas) == 2 and all(isinstance(b, (int, float)) and 0 <= b < 1 for b in o.betas),
             f"optim.betas={o.betas} must be two numbers in [0, 1)")
    _require(o.warmup_steps >= 0, f"optim.warmup_steps={o.warmup_steps} must be >= 0")
    _require(0 <= o.min_lr_ratio <= 1, f"optim.min_lr_ratio={o.min_lr_ratio} must be in [0, 1]")
    _require(o.grad_clip >= 0, f"optim.grad_clip={o.grad_clip} must be >= 0 (0 disables clipping)")
    _require(t.steps >= 1, f"train.steps={t.steps} must be >= 1")
    _require(t.save_every >= 0, f"train.save_every={t.save_every} must be >= 0")
    _require(t.keep_last >= 1, f"train.keep_last={t.keep_last} must be >= 1")
    _require(t.log_every >= 1, f"train.log_every={t.log_every} must be >= 1")
    _require(t.memory_check in ("warn", "error", "off"),
             f"train.memory_check={t.memory_check!r}; allowed: 'warn', 'error', 'off'")
    if t.memory_limit:
        parse_bytes(t.memory_limit, "train.memory_limit")
    try:
        grpo_config(cfg)  # engine-level checks (prompt_grad, loss_agg_mode, kl_type, chunk sizes, ...)
    except ValueError as e:
        raise ValueError(f"algorithm.{e}") from None


def grpo_config(cfg: RunConfig):
    from longstraw.engine.grpo import GRPOConfig

    a = cfg.algorithm
    return GRPOConfig(
        prompt_grad=a.prompt_grad, loss_agg_mode=a.loss_agg_mode, clip_ratio_low=a.clip_ratio_low,
        clip_ratio_high=a.clip_ratio_high, clip_ratio_c=a.clip_ratio_c or None, kl_coef=a.kl_coef,
        kl_type=a.kl_type, entropy_coef=a.entropy_coef, loss_scale_factor=a.loss_scale_factor or None,
        prefill_chunk=a.prefill_chunk, branch_batch=a.branch_batch, checkpoint_layers=a.checkpoint_layers,
        temperature=cfg.rollout.temperature, compute_dtype=cfg.model.compute_dtype or None,
    )

