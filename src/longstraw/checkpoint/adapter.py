"""LoRA adapters in PEFT's format: add them, read and write ``adapter_config.json`` + ``adapter_model.safetensors``,
and the adapters' gradients under PEFT's names.

PEFT saves an adapter tensor as ``base_model.model.<module>.lora_A.weight`` / ``.lora_B.weight`` (the adapter name
removed), ``<module>`` being the module's name in transformers' model, which is the name of the same module here
(``models.weights``: our module tree mirrors transformers'); a module trained whole (``modules_to_save``) as
``base_model.model.<module>.<param>``. Adapters on routed experts (``target_parameters``) are keyed by PEFT's
nesting of its parameter wrappers (``<experts>[.base_layer].lora_A.weight``, ``models.lora.expert_peft_names``),
with PEFT's shapes (``[E*r, in]``, ``[out, r*E]``). vLLM's LoRA loader reads the same files (not checked for
expert adapters). On load the family's checkpoint renames apply to the module part too, so an adapter trained on a
multimodal Qwen3.5 checkpoint (``model.language_model.layers...``) loads into the text model, and the adapters of a
model loaded from such a checkpoint are written (and their gradients keyed) under that prefix, as PEFT on the
multimodal model keys them.

Sharded models (FSDP2): adapters must exist before the model is sharded, so they are created by
``load_model(path, lora=..., adapter=...)`` (on the meta device, before ``parallelize``); :func:`add_lora` on an
already-sharded model is refused with that advice. :func:`load_adapter` then fills the adapters a sharded model
already has (each rank its rows), and :func:`save_adapter` / :func:`lora_grads` gather each tensor whole in turn
(collectives: call them on every rank).

Expert parallelism (``ep > 1``): each rank's experts module holds its experts' part of each expert adapter
(``models.lora.ExpertLoRA``: the rows of ``lora_A``, the columns of ``lora_B``'s interleaved layout), created by
``load_model`` before ``shard_experts`` splits them like the fused weights (``lora_seed`` draws each whole tensor, so
every layout starts from one process's values). :func:`save_adapter` / :func:`lora_grads` rebuild the whole
``[E*r, in]`` / ``[out, r*E]`` tensors in PEFT's layout (an all-gather over the EP group), :func:`load_adapter` fills
each rank's part.
"""

from __future__ import annotations

import json
import os
import shutil
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from longstraw.distributed.fsdp import is_sharded, local_rows
from longstraw.models.lora import (ALL_LINEAR, ExpertLoRA, LoraSettings, LoRALinear, adapted_modules, add_adapters,
                                   all_adapters, expert_adapter_shapes, expert_adapters, expert_peft_names,
                                   expert_targets, is_adapter_param, kept_modules, lora_targets, trained_ids)
from longstraw.models.registry import family_for

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def _check_model(model) -> None:
    if getattr(model, "spec", None) is None:
        raise ValueError(f"expected a LongStraw model (longstraw.load_model), got {type(model).__name__}")


def _sharded(model) -> bool:
    return any(is_sharded(p) for p in model.parameters())


def _ep_adapters(model) -> dict:
    """``{parameter name: (EP module, ExpertLoRA, "lora_A" | "lora_B")}`` of the adapters on expert-parallel experts
    (each rank holds its experts' part; :func:`longstraw.distributed.expert_parallel.ep_adapter_params`)."""
    from longstraw.distributed.expert_parallel import ep_adapter_params

    return ep_adapter_params(model)


def _whole(t: torch.Tensor, name: str, ep: dict) -> torch.Tensor:
    """The full tensor of parameter ``name``'s ``t`` (itself or its gradient): gathered over FSDP (a DTensor) or,
    for an adapter on expert-parallel experts (``ep``: :func:`_ep_adapters`), over the EP group in PEFT's layout;
    either is a collective every rank joins."""
    if name in ep:
        from longstraw.distributed.expert_parallel import gather_adapter

        return gather_adapter(*ep[name], t)
    return _full(t)


def add_lora(model, rank: int, alpha: float, target_modules: Sequence[str] | str, dropout: float = 0.0, *,
             use_rslora: bool = False, modules_to_save: Sequence[str] | str = (), rank_pattern: Mapping | None = None,
             alpha_pattern: Mapping | None = None, seed: int | None = None,
             target_parameters: Sequence[str] | str = ()):
    """Add LoRA adapters to ``model`` in place (PEFT's ``get_peft_model`` with a ``LoraConfig`` of the same
    fields) and return it.

    target_modules: transformers' module names (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
    ``up_proj``, ``down_proj``; the Gated DeltaNet projections ``in_proj_qkvz``, ``in_proj_ba``, ``in_proj_qkv``,
    ``in_proj_z``, ``in_proj_b``, ``in_proj_a``, ``out_proj``; the MLA projections ``q_a_proj``, ``q_b_proj``,
    ``kv_a_proj_with_mqa``, ``kv_b_proj``; DSA's indexer ``wq_b``, ``wk``, ``weights_proj``): a module matches when
    its name is the target or ends with ``.`` + target (so ``gate_proj`` also takes the shared expert's); one string
    is a regular expression over whole module names, or ``"all-linear"``; a list may be empty when
    ``target_parameters`` is given. ``target_parameters``: the routed experts' fused weights, PEFT's way to adapt
    them (``["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]``, or either; a name matches a parameter whose
    name is it or ends with ``.`` + it): one adapter per fused weight in PEFT's layout (``models.lora``); no
    dropout there. ``gate_proj`` / ``up_proj`` / ``down_proj`` in ``target_modules`` keep naming the linear layers
    (dense MLP, shared experts), not the routed experts: see docs/SUPPORT.md for stock PEFT's re-targeting of those
    names on transformers 5. ``rank_pattern`` / ``alpha_pattern`` keys match an expert adapter by its parameter's
    name (``...experts.gate_up_proj``). ``modules_to_save``: modules trained whole besides the adapters (e.g.
    ``["embed_tokens"]``). Initialisation as PEFT's (``B = 0``: the model is unchanged); ``seed``: draw the ``A``
    matrices from a generator seeded with it (module by module in name order) instead of the global generator.
    Every base parameter is frozen. A ValueError names a bad value (a target that matches nothing, with the names
    that can be targeted) and changes nothing.

    On a model sharded by FSDP2 adapters cannot be added afterwards: pass ``lora=`` to :func:`longstraw.load_model`.
    """
    _check_model(model)
    settings = LoraSettings(r=rank, lora_alpha=alpha, target_modules=target_modules, lora_dropout=dropout,
                            use_rslora=use_rslora, modules_to_save=modules_to_save,
                            rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}),
                            target_parameters=target_parameters)
    _add(model, settings, seed)
    return model


def _add(model, settings: LoraSettings, seed: int | None) -> list[str]:
    if _sharded(model):
        raise ValueError("add_lora on a model already sharded by FSDP2: adapters must exist before sharding; load it "
                         "with longstraw.load_model(path, lora=dict(rank=..., alpha=..., target_modules=...)) or "
                         "load_model(path, adapter=ADAPTER_DIR)")
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    targets = add_adapters(model, settings, generator=gen)
    compute = getattr(model, "compute_dtype", None)
    if compute is not None:  # master weights in one process: the frozen base needs no float32 copy
        for p in model.parameters():
            if not p.requires_grad and p.is_floating_point():
                p.data = p.data.to(compute)
    return targets


def lora_settings(model) -> LoraSettings | None:
    """The adapters' settings of ``model`` (None: it has none)."""
    return getattr(model, "lora_settings", None) if all_adapters(model) else None


def settings_from(spec) -> LoraSettings:
    """``LoraSettings`` from one: a :class:`LoraSettings`, a dict with ``add_lora``'s keyword names (``rank``,
    ``alpha``, ``target_modules``, ``dropout``, ``use_rslora``, ``modules_to_save``, ``rank_pattern``,
    ``alpha_pattern``, ``target_parameters``) or PEFT's (``r``, ``lora_alpha``, ``lora_dropout``...)."""
    if isinstance(spec, LoraSettings):
        return spec
    if not isinstance(spec, Mapping):
        raise ValueError(f"lora={spec!r} must be a dict of add_lora's arguments (rank, alpha, target_modules, ...)")
    names = {"rank": "r", "alpha": "lora_alpha", "dropout": "lora_dropout"}
    fields = {"r", "lora_alpha", "target_modules", "lora_dropout", "use_rslora", "modules_to_save", "rank_pattern",
              "alpha_pattern", "target_parameters"}
    out = {}
    for k, v in spec.items():
        key = names.get(k, k)
        if key not in fields:
            raise ValueError(f"lora: unknown key {k!r}; allowed: rank, alpha, target_modules, dropout, use_rslora, "
                             "modules_to_save, rank_pattern, alpha_pattern, target_parameters")
        out[key] = v
    if out.get("target_parameters") and "target_modules" not in out:
        out["target_modules"] = ()
    for need in ("r", "lora_alpha", "target_modules"):
        if need not in out:
            raise ValueError(f"lora: {dict((v, k) for k, v in names.items()).get(need, need)!r} is required")
    if "modules_to_save" in out:
        out["modules_to_save"] = out["modules_to_save"] or ()
    if out.get("target_modules") is not None and not isinstance(out["target_modules"], str):
        out["target_modules"] = tuple(out["target_modules"])
    if out.get("target_parameters") is not None and not isinstance(out["target_parameters"], str):
        out["target_parameters"] = tuple(out["target_parameters"])
    return LoraSettings(**out)


# ---------------------------------------------------------------------------------------------- PEFT's format
# PEFT initialisations that change the base model's weights (PEFT applies them again to the base it loads onto)
_BASE_REWRITING_INITS = ("pissa", "olora", "corda", "loftq", "lora_ga")


def _peft_config(path: Path) -> tuple[LoraSettings, dict]:
    f = path / ADAPTER_CONFIG
    if not f.is_file():
        raise ValueError(f"{str(path)!r} is not a PEFT adapter directory: it has no {ADAPTER_CONFIG}")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{f}: cannot read the adapter config ({type(e).__name__}: {e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{f}: expected a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{f}: peft_type={cfg.get('peft_type')!r}; only LoRA adapters (peft_type 'LORA') load")
    unsupported = {"use_dora": (False, None), "fan_in_fan_out": (False, None), "bias": ("none", None),
                   "layers_to_transform": (None,), "layers_pattern": (None, [], ""),
                   "trainable_token_indices": (None,), "lora_bias": (False, None), "use_qalora": (False, None),
                   "megatron_config": (None,), "alora_invocation_tokens": (None,), "arrow_config": (None,)}
    unsupported.update({"exclude_modules": (None, [], ""), "layer_replication": (None, []),
                        "task_type": (None, "CAUSAL_LM"),
                        # PEFT 0.21 variants whose adapter is not the plain W + s B A this module computes:
                        # block-diagonal BD-LoRA, MonteCLoRA's sampled factors, KaSA's SVD-truncated base
                        "use_bdlora": (None, False), "monteclora_config": (None,), "kasa_config": (None,)})
    for key, ok in unsupported.items():
        if key in cfg and cfg[key] not in ok:
            if key == "use_dora" and cfg.get("target_parameters"):
                raise ValueError(f"{f}: use_dora={cfg[key]!r} is not supported, and not on routed experts "
                                 "(target_parameters) in PEFT either (allowed: False)")
            raise ValueError(f"{f}: {key}={cfg[key]!r} is not supported (allowed: {ok[0]!r})")
    init = cfg.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_REWRITING_INITS):
        raise ValueError(f"{f}: init_lora_weights={init!r} is not supported: that initialisation rewrites the base "
                         "weights, which PEFT redoes when it loads the adapter (allowed: true, false, 'gaussian', "
                         "'orthogonal', 'eva'; or convert the adapter to plain LoRA with PEFT's "
                         "path_initial_model_for_weight_conversion)")
    target = cfg.get("target_modules")
    if isinstance(target, list):
        target = tuple(sorted(target))
    params = cfg.get("target_parameters") or ()
    if isinstance(params, list):
        params = tuple(sorted(params))
    if target is None and params:
        target = ()
    try:
        settings = LoraSettings(r=cfg.get("r", 8), lora_alpha=cfg.get("lora_alpha", 8), target_modules=target,
                                lora_dropout=cfg.get("lora_dropout", 0.0) or 0.0,
                                use_rslora=bool(cfg.get("use_rslora", False)),
                                modules_to_save=cfg.get("modules_to_save") or (),
                                rank_pattern=dict(cfg.get("rank_pattern") or {}),
                                alpha_pattern=dict(cfg.get("alpha_pattern") or {}), target_parameters=params)
    except ValueError as e:
        raise ValueError(f"{f}: {e}") from None
    return settings, cfg


def adapter_settings(path: str | os.PathLike) -> LoraSettings:
    """The :class:`LoraSettings` of a PEFT adapter directory (its ``adapter_config.json``, checked)."""
    return _peft_config(Path(path))[0]


def _trained_params(model) -> dict[str, torch.Tensor]:
    """Adapter parameters and those of ``modules_to_save``: what an adapter file holds, by in-memory name."""
    return {n: p for n, p in model.named_parameters() if p.requires_grad or is_adapter_param(n)}


def _tied_aliases(model, params: dict[str, torch.Tensor]) -> dict[str, str]:
    """Other names of the parameters ``params`` holds (a tied LM head: ``{"lm_head.weight":
    "model.embed_tokens.weight"}`` when the embedding is trained whole), alias -> name."""
    names = {id(p): n for n, p in params.items()}
    return {n: names[id(p)] for n, p in model.named_parameters(remove_duplicate=False)
            if id(p) in names and n not in params}


def _multimodal_source(model) -> bool:
    """Whether the model was loaded from a multimodal checkpoint (``load_model`` sets ``source_multimodal``):
    transformers' model of it holds the text model's modules under ``model.language_model.``, so PEFT on that base
    keys the adapters so."""
    return bool(getattr(model, "source_multimodal", False))


def _key(wmap, name: str, multimodal: bool = False) -> str:
    """PEFT's saved key of our parameter ``name`` (``multimodal``: on the base's multimodal model,
    :func:`_multimodal_source`; loading maps the prefix back with the family's checkpoint renames)."""
    inner = next(iter(wmap.save_tensors([(name, None)])))[0]
    if multimodal and inner.startswith("model."):
        inner = "model.language_model." + inner[len("model."):]
    return PREFIX + inner


def _peft_names(model) -> dict[str, str]:
    """``{our expert adapter parameter name: PEFT's}`` (the other names are PEFT's already)."""
    return expert_peft_names(expert_adapters(model))


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if is_sharded(t) else t


# Model types whose MLP targets PEFT (0.18+, transformers 5: peft.utils.transformers_weight_conversion, checked on
# 0.21.2) re-targets to the routed experts' fused parameters, dropping gate_proj / up_proj / down_proj from the
# target modules: stock PEFT then ignores our adapters on the dense MLP layers and the shared experts. Those whose
# transformers conversion pattern (``_MODEL_TO_CONVERSION_PATTERN``) has an entry in PEFT's
# ``_MOE_TARGET_MODULE_MAPPING``; ``qwen2_moe`` itself has no pattern entry (only its aliases do), so stock PEFT
# leaves it alone; ``mixtral`` has no nn.Linear MLP to lose (tests/checkpoint/test_lora.py pins this list).
PEFT_MOE_RETARGETED = frozenset({"qwen3_next", "deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa", "qwen3_moe",
                                 "mixtral", "glm4_moe_lite", "minimax_m2", "olmoe"})
_MLP_NAMES = ("gate_proj", "up_proj", "down_proj")


def peft_ignored_modules(model) -> list[str]:
    """The adapted modules that stock PEFT on transformers 5 does not adapt for this model type
    (:data:`PEFT_MOE_RETARGETED`): its dense-MLP and shared-expert ``gate_proj`` / ``up_proj`` / ``down_proj``."""
    if model.spec.model_type not in PEFT_MOE_RETARGETED:
        return []
    return sorted(n for n in adapted_modules(model) if n.rsplit(".", 1)[-1] in _MLP_NAMES)


def save_adapter(model, path: str | os.PathLike) -> None:
    """Write ``model``'s adapters as a PEFT adapter directory (``adapter_config.json`` +
    ``adapter_model.safetensors``), loadable by ``peft.PeftModel.from_pretrained`` and vLLM's LoRA support. Written
    atomically (a temporary directory renamed over ``path``; an existing adapter directory there is replaced, any
    other existing directory is refused). On an FSDP2 model a collective: call it on every rank (rank 0 writes)."""
    _check_model(model)
    settings = lora_settings(model)
    if settings is None:
        raise ValueError("save_adapter: the model has no LoRA adapters (longstraw.add_lora adds them)")
    p = Path(path)
    if p.exists() and (not p.is_dir() or (any(p.iterdir()) and not (p / ADAPTER_CONFIG).is_file())):
        raise ValueError(f"save_adapter: {str(p)!r} exists and is not an adapter directory; give a new or an "
                         "adapter directory")
    ignored = peft_ignored_modules(model)
    if ignored:
        warnings.warn(f"save_adapter: {len(ignored)} adapters on MLP projections ({ignored[0]}, ...): stock PEFT on "
                      f"transformers 5 re-targets gate_proj/up_proj/down_proj of {model.spec.model_type} models to "
                      "the routed experts and will not load these (vLLM and PEFT on transformers 4 do); see "
                      "docs/SUPPORT.md", stacklevel=2)
    wmap = family_for(model.spec.model_type).weights(model.hf_config)
    mm = _multimodal_source(model)
    peft_names = _peft_names(model)
    tensors = {}
    trained = _trained_params(model)
    ep = _ep_adapters(model)
    with torch.no_grad():
        for name, t in trained.items():
            full = _whole(t.detach(), name, ep)  # every rank joins each gather
            tensors[_key(wmap, peft_names.get(name, name), mm)] = full.to("cpu").contiguous()
    # a trained embedding tied to the LM head: PEFT keeps them tied only with ensure_weight_tying, and then reads
    # (and writes) the LM head's tensor too
    aliases = _tied_aliases(model, trained)
    for alias, name in aliases.items():
        tensors[_key(wmap, alias, mm)] = tensors[_key(wmap, name, mm)].clone()
    distributed = _sharded(model) or bool(ep)
    rank = torch.distributed.get_rank() if distributed else 0
    if rank == 0:
        cfg = peft_config_dict(settings, getattr(model, "source_dir", None), tied=bool(aliases))
        tmp = p.with_name(f".{p.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        save_file(tensors, str(tmp / ADAPTER_WEIGHTS), metadata={"format": "pt"})
        (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        for f in (tmp / ADAPTER_WEIGHTS, tmp / ADAPTER_CONFIG):
            with open(f, "rb") as fh:
                os.fsync(fh.fileno())
        old = None
        if p.exists():
            old = p.with_name(f".{p.name}.old-{os.getpid()}")
            os.replace(p, old)
        os.replace(tmp, p)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
    if distributed:
        torch.distributed.barrier()


def peft_config_dict(settings: LoraSettings, base: str | os.PathLike | None = None, tied: bool = False) -> dict:
    """PEFT's ``adapter_config.json`` for ``settings`` (a LoRA config for a causal LM). ``tied``: a module trained
    whole is tied to another (the embedding to the LM head), which PEFT keeps so with ``ensure_weight_tying``."""
    t = settings.target_modules
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(base) if base else None,
            "r": settings.r, "lora_alpha": settings.lora_alpha, "lora_dropout": settings.lora_dropout,
            "target_modules": t if isinstance(t, str) else sorted(t), "bias": "none",
            "target_parameters": sorted(settings.target_parameters) or None,
            "use_rslora": settings.use_rslora, "modules_to_save": list(settings.modules_to_save) or None,
            "rank_pattern": dict(settings.rank_pattern), "alpha_pattern": dict(settings.alpha_pattern),
            "fan_in_fan_out": False, "init_lora_weights": True, "inference_mode": True, "use_dora": False,
            "layers_to_transform": None, "layers_pattern": None, "revision": None, "ensure_weight_tying": tied}


def load_adapter(model, path: str | os.PathLike):
    """Read a PEFT adapter directory into ``model`` and return it: the adapters its config names are created (as
    :func:`add_lora` would, base frozen) unless the model has the same ones already, then filled from
    ``adapter_model.safetensors``. Keys are PEFT's (``base_model.model.<module>.lora_A.weight``; the family's
    checkpoint renames apply); a missing or unexpected tensor or a shape mismatch is a ValueError naming it, checked
    before any adapter is added or value written. On an FSDP2 model the adapters must exist already
    (``load_model(path, adapter=...)`` creates them); each rank fills its rows."""
    _check_model(model)
    if not isinstance(path, (str, os.PathLike)):
        raise ValueError(f"load_adapter: path={path!r} must be a PEFT adapter directory (a str or os.PathLike)")
    p = Path(path)
    settings, _ = _peft_config(p)
    have = lora_settings(model)
    if have is None:
        _check_file(model, p, *_planned(model, settings))  # the file fits the adapters: checked before adding them
        _add(model, settings, None)
    elif _comparable(have) != _comparable(settings):
        raise ValueError(f"load_adapter: the model's adapters ({_describe(have)}) differ from {str(p)!r}'s "
                         f"({_describe(settings)})")
    fill_adapter(model, p)
    return model


def _comparable(s: LoraSettings) -> tuple:
    t = s.target_modules if isinstance(s.target_modules, str) else tuple(sorted(s.target_modules))
    return (s.r, float(s.lora_alpha), t, bool(s.use_rslora), tuple(sorted(s.modules_to_save)),
            tuple(sorted(s.rank_pattern.items())), tuple(sorted(s.alpha_pattern.items())),
            tuple(sorted(s.target_parameters)))


def _describe(s: LoraSettings) -> str:
    params = f", target_parameters={s.target_parameters!r}" if s.target_parameters else ""
    return f"r={s.r}, alpha={s.lora_alpha}, target_modules={s.target_modules!r}{params}"


def fill_adapter(model, path: Path) -> None:
    """Copy the adapter file's tensors into the model's adapters (and ``modules_to_save`` parameters); an adapter on
    expert-parallel experts takes its experts' part of the whole tensor (``ExpertLoRA.take``)."""
    params = _trained_params(model)
    ep = _ep_adapters(model)
    shapes = {n: ep[n][1].full_shape(ep[n][2]) if n in ep else tuple(t.shape) for n, t in params.items()}
    handle, found = _check_file(model, path, shapes, _tied_aliases(model, params), _peft_names(model))
    with torch.no_grad():
        for name, k in found.items():
            full = handle.get_tensor(k)
            fill(params[name], ep[name][1].take(ep[name][2], full) if name in ep else full)


def _planned(model, settings: LoraSettings) -> tuple[dict[str, tuple], dict[str, str], dict[str, str]]:
    """What :func:`_check_file` checks a file against, for the adapters ``settings`` would add to ``model``: the
    shapes of the tensors they train, by parameter name, the tied aliases of those, and PEFT's names of the expert
    adapters."""
    modules = dict(model.named_modules())
    shapes = {}
    for name in lora_targets(model, settings):
        r, _ = settings.rank_alpha(name)
        shapes[f"{name}.lora_A.weight"] = (r, modules[name].in_features)
        shapes[f"{name}.lora_B.weight"] = (modules[name].out_features, r)
    shapes.update(expert_adapter_shapes(model, settings))
    ids = trained_ids(model, kept_modules(model, settings.modules_to_save))
    whole = {n: t for n, t in model.named_parameters() if id(t) in ids}
    shapes.update({n: tuple(t.shape) for n, t in whole.items()})
    return shapes, _tied_aliases(model, whole), expert_peft_names(expert_targets(model, settings))


def _check_file(model, path: Path, shapes: dict[str, tuple], aliases: dict[str, str], peft_names: dict[str, str]):
    """Check the adapter file in ``path`` against the trained tensors' ``shapes`` (by parameter name; ``aliases``:
    their tied names; ``peft_names``: PEFT's names of the expert adapters, ours -> theirs): every tensor present, none
    unexpected, each of its shape. Returns (open file, {parameter name: file key})."""
    f = path / ADAPTER_WEIGHTS
    if not f.is_file():
        raise ValueError(f"{str(path)!r} has no {ADAPTER_WEIGHTS}")
    wmap = family_for(model.spec.model_type).weights(model.hf_config)
    if aliases and not _peft_config(path)[1].get("ensure_weight_tying", False):
        alias, name = next(iter(aliases.items()))
        raise ValueError(f"{path / ADAPTER_CONFIG}: the adapter trains {name} whole without ensure_weight_tying, so "
                         f"PEFT unties it from {alias} (only the copy in {name} is trained); this model ties them "
                         "and cannot hold that adapter")
    try:
        handle = safe_open(str(f), framework="pt", device="cpu")
        keys = list(handle.keys())
    except Exception as e:  # noqa: BLE001 - a truncated or garbage file
        raise ValueError(f"{f}: cannot read the adapter ({type(e).__name__}: {e})") from None
    ours = {theirs: mine for mine, theirs in peft_names.items()}
    found, unexpected = {}, []
    for k in keys:
        inner = k[len(PREFIX):] if k.startswith(PREFIX) else k
        inner = inner.replace(".lora_A.default.", ".lora_A.").replace(".lora_B.default.", ".lora_B.")
        name = wmap.param_name(inner)
        name = ours.get(name, name)
        if name is None or name in aliases:  # PEFT's copy of a tied tensor (the LM head of a trained embedding)
            continue
        if name not in shapes:
            unexpected.append(k)
            continue
        found[name] = k
    if unexpected:
        raise ValueError(f"{f}: tensors the model's adapters do not have: {', '.join(sorted(unexpected)[:10])}")
    missing = sorted(set(shapes) - set(found))
    if missing:
        mm = _multimodal_source(model)
        named = ", ".join(_key(wmap, peft_names.get(n, n), mm) for n in missing[:10])
        raise ValueError(f"{f}: adapter tensors missing: {named}")
    for name, k in found.items():
        shape = tuple(handle.get_slice(k).get_shape())
        if shape != shapes[name]:
            layout = " (routed experts: [E*r, in] / [out, r*E], PEFT's layout)" if name in peft_names else ""
            raise ValueError(f"{f}: {k} has shape {shape}, the model's adapter {shapes[name]}{layout}")
    return handle, found


def fill(param: torch.Tensor, full: torch.Tensor) -> None:
    """Write the full tensor ``full`` into ``param`` (a DTensor: this rank's rows), converting its dtype."""
    rows = local_rows(param)
    local = param.to_local() if is_sharded(param) else param
    if rows is not None:
        full = full[rows[0]:rows[1]]
    if local.numel():
        local.copy_(full)


def init_adapters(model, seed: int | None) -> None:
    """PEFT's initialisation of every adapter of a materialised (possibly sharded) model: ``A`` Kaiming-uniform,
    drawn whole from a generator seeded with ``seed`` module by module in name order (so every rank and every
    layout draws the same values), ``B = 0``; ``seed`` None: the global generator, one process only."""
    mods = sorted(all_adapters(model).items())
    gen = torch.Generator().manual_seed(seed) if seed is not None else None
    with torch.no_grad():
        for _, m in mods:
            if not is_sharded(m.lora_A.weight):
                m.reset_lora_parameters(gen)
                continue
            if gen is None:
                raise ValueError("initialising the adapters of a sharded model needs a seed (every rank draws them)")
            a = m.lora_A.weight
            bound = 1.0 / (a.shape[1] ** 0.5)
            fill(a, torch.empty(tuple(a.shape), dtype=torch.float64).uniform_(-bound, bound, generator=gen))
            fill(m.lora_B.weight, torch.zeros(tuple(m.lora_B.weight.shape), dtype=torch.float64))


def lora_grads(model) -> dict[str, torch.Tensor]:
    """The adapters' current gradients (and those of ``modules_to_save``), full tensors keyed exactly as PEFT keys
    them in ``adapter_model.safetensors`` (``base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight``).
    Parameters without a gradient are left out; on an FSDP2 model every rank must call it (each gradient is
    gathered)."""
    _check_model(model)
    if lora_settings(model) is None:
        raise ValueError("lora_grads: the model has no LoRA adapters (longstraw.add_lora adds them)")
    wmap = family_for(model.spec.model_type).weights(model.hf_config)
    mm = _multimodal_source(model)
    peft_names = _peft_names(model)
    ep = _ep_adapters(model)
    out = {}
    for name, prm in _trained_params(model).items():
        if prm.grad is not None:
            out[_key(wmap, peft_names.get(name, name), mm)] = _whole(prm.grad, name, ep)
    return out


def merged_weights(model) -> dict[str, tuple]:
    """For :func:`longstraw.save_model` with ``merge_lora=True``: ``{weight name: (shape, dtype, make)}`` where
    ``make()`` returns the merged full weight ``W + s B A`` (a collective on a sharded model); for routed experts
    split by expert parallelism, this rank's rows merged with its experts' adapter part (no collective)."""
    out = {}
    for name, m in adapted_modules(model).items():
        out[f"{name}.weight"] = (tuple(m.weight.shape), m.weight.dtype, _merger(m, m.weight))
    # the fused expert weight [E, out, in], one at a time; under expert parallelism this rank's rows [local, out, in]
    # with its experts' part of the adapter (save_model writes each EP rank's rows itself; with the block FSDP-sharded
    # over edp, this rank's rows of it)
    for name, m in expert_adapters(model).items():
        w = model.get_parameter(name)
        parent = model.get_submodule(name.rpartition(".")[0])
        transposed = getattr(parent, "transposed", False)
        out[name] = (tuple(w.shape), w.dtype, _merger(m, w, transposed, own_rows=hasattr(parent, "shard_edp")))
    return out


def _merger(m: LoRALinear | ExpertLoRA, weight: torch.Tensor, transposed: bool = False, own_rows: bool = False):
    """``make()`` of a merged weight: the full tensor (a collective for a sharded one), or with ``own_rows`` (an
    expert-parallel module's) this rank's rows of it, merged with the rows' part of the adapter (no collective)."""
    def make() -> torch.Tensor:
        rows = local_rows(weight) if own_rows else None
        w = weight.detach().to_local() if rows is not None else _full(weight.detach())
        a, b = _full(m.lora_A.weight.detach()), _full(m.lora_B.weight.detach())
        acc = torch.float64 if w.dtype == torch.float64 else torch.float32
        a, b = a.to(acc), b.to(acc)
        if isinstance(m, ExpertLoRA):  # per expert B_e A_e, PEFT's layout (models.lora.ExpertLoRA.factors)
            e = m.num_experts
            delta = torch.bmm(b.view(m.out_features, m.r, e).permute(2, 0, 1), a.view(e, m.r, m.in_features))
            if transposed:  # experts kept as [E, in, out] (GPT-OSS: x @ W)
                delta = delta.transpose(1, 2)
            if rows is not None:
                delta = delta[rows[0]:rows[1]]
        else:
            delta = b @ a
        return (w.to(acc) + delta * m.scaling).to(w.dtype)
    return make


__all__ = ["add_lora", "load_adapter", "save_adapter", "lora_grads", "adapter_settings", "peft_config_dict",
           "ALL_LINEAR"]
