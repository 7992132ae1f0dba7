"""Reading HF ``config.json`` dicts with errors that name the key, the value and what is allowed."""

from __future__ import annotations

from typing import Any


class ConfigReader:
    """Typed access to an HF config dict: ``req`` for required keys, ``opt`` for optional ones."""

    def __init__(self, cfg: dict, where: str = "config.json"):
        self.cfg, self.where = cfg, where

    def _check(self, key: str, value: Any, typ: type | tuple[type, ...]):
        if typ is float and isinstance(value, int) and not isinstance(value, bool):
            return float(value)
        if not isinstance(value, typ) or (isinstance(value, bool) and typ is int):
            names = typ.__name__ if isinstance(typ, type) else " or ".join(t.__name__ for t in typ)
            raise ValueError(f"{self.where}: {key}={value!r} must be {names}")
        return value

    def req(self, key: str, typ: type | tuple[type, ...] = int):
        if self.cfg.get(key) is None:
            raise ValueError(f"{self.where}: required key {key!r} is missing")
        return self._check(key, self.cfg[key], typ)

    def opt(self, key: str, default: Any, typ: type | tuple[type, ...] | None = None):
        value = self.cfg.get(key)
        if value is None:
            return default
        return self._check(key, value, typ or type(default))

    def positive(self, key: str, default: Any = None) -> int:
        value = self.req(key) if default is None else self.opt(key, default, int)
        if value < 1:
            raise ValueError(f"{self.where}: {key}={value} must be >= 1")
        return value


def multimodal_text_config(cfg: dict, multimodal: dict[str, str], architectures: dict[str, str],
                           tie_default: bool = False) -> dict:
    """The config of the text model: ``cfg`` itself unless its ``model_type`` is a key of ``multimodal`` (a
    multimodal checkpoint: Qwen3.5's, Gemma 3's, Mistral 3's); then its ``text_config`` with the ``model_type`` the
    map gives and ``architectures`` of that text-only causal LM, and the checkpoint's dtype where the text config
    has none. Whether the LM head is tied to the embedding is the multimodal config's ``tie_word_embeddings`` (what
    transformers' model of it reads; ``tie_default``: its config class's default), not the text config's."""
    mt = cfg.get("model_type")
    if mt not in multimodal:
        return dict(cfg)
    tc = cfg.get("text_config")
    if not isinstance(tc, dict):
        raise ValueError(f"config.json: model_type {mt!r} needs a 'text_config' object, got {type(tc).__name__}")
    text = dict(tc)
    text["model_type"] = multimodal[mt]
    text["architectures"] = [architectures[multimodal[mt]]]
    for key in ("dtype", "torch_dtype"):
        if key not in text and key in cfg:
            text[key] = cfg[key]
    tie = cfg.get("tie_word_embeddings")
    text["tie_word_embeddings"] = tie_default if tie is None else tie
    return text


def known_text_config(cfg: dict, multimodal_type: str, kinds: dict[str, str], default_kind: str,
                      architectures: dict[str, str], tie_default: bool = False) -> dict:
    """:func:`multimodal_text_config` for a multimodal type whose ``text_config`` may name one of a few text models:
    ``cfg`` itself unless its ``model_type`` is ``multimodal_type``; then the text config, built as
    ``kinds[its model_type]`` (``default_kind`` where it names none); any other model type is refused in one
    line."""
    if cfg.get("model_type") != multimodal_type:
        return dict(cfg)
    tc = cfg.get("text_config")
    kind = tc.get("model_type", default_kind) if isinstance(tc, dict) else default_kind
    if kind not in kinds:
        raise ValueError(f"config.json: {multimodal_type} text_config model_type {kind!r} is not supported; "
                         f"supported: {', '.join(kinds)}")
    return multimodal_text_config(cfg, {multimodal_type: kinds[kind]}, architectures, tie_default=tie_default)


def text_reader(text: dict, cfg: dict) -> ConfigReader:
    """A reader of the text model's config ``text`` (:func:`multimodal_text_config` of ``cfg``) whose errors say
    where the keys are: ``config.json``, or its ``text_config`` for a multimodal checkpoint."""
    return ConfigReader(text, "config.json" if text.get("model_type") == cfg.get("model_type") else
                        "config.json text_config")


def num_routed_experts(cfg: dict, r: ConfigReader, default: int = 0) -> tuple[str, int]:
    """(the key, the number of routed experts): ``num_experts`` (Qwen's published configs) or ``num_local_experts``
    (Mixtral's, GPT-OSS's; transformers 5 writes Qwen3-MoE's under it too, an alias of ``num_experts``); ``default``
    if neither is set; a disagreement between the two is refused."""
    given = {k: r.opt(k, 0, int) for k in ("num_experts", "num_local_experts") if cfg.get(k) is not None}
    if len(set(given.values())) > 1:
        raise ValueError(f"{r.where}: num_experts={given['num_experts']} and num_local_experts="
                         f"{given['num_local_experts']} disagree (they name the same number)")
    key, n = next(iter(given.items()), ("num_experts", default))
    if n < 0:
        raise ValueError(f"{r.where}: {key}={n} must be >= 0")
    return key, n


WINDOW_LAYER_TYPES = ("sliding_attention", "full_attention")


def interleaved_windows(cfg: dict, r: ConfigReader, n: int, *, full_every: int, default_window: int
                        ) -> list[int | None]:
    """Each layer's attention window for the families that interleave sliding and full layers (Gemma 3, GPT-OSS,
    OLMo 3), as transformers sets them: ``layer_types`` (one of :data:`WINDOW_LAYER_TYPES` per layer), by default
    every ``full_every``-th layer full and the others sliding; ``sliding_window`` (default ``default_window``) on
    the sliding layers, None on the full ones."""
    types = cfg.get("layer_types")
    if types is None:
        types = ["sliding_attention" if (i + 1) % full_every else "full_attention" for i in range(n)]
    if not isinstance(types, list) or len(types) != n or any(t not in WINDOW_LAYER_TYPES for t in types):
        raise ValueError(f"{r.where}: layer_types must give one of {list(WINDOW_LAYER_TYPES)} for each of the {n} "
                         f"layers, got {types!r}")
    window = cfg.get("sliding_window")
    return windows_of([t == "sliding_attention" for t in types], default_window if window is None else window, r)


def windows_of(slides: list[bool], window, r: ConfigReader) -> list[int | None]:
    """Each layer's window: ``window`` on the layers that slide (``slides[i]``), None on the others; ValueError
    unless ``window`` is an integer >= 2 when some layer slides."""
    if any(slides) and (isinstance(window, bool) or not isinstance(window, int) or window < 2):
        raise ValueError(f"{r.where}: sliding_window={window!r} must be an integer >= 2 when layers slide "
                         f"(layers {[i for i, x in enumerate(slides) if x]})")
    return [window if s else None for s in slides]


def narrowest_window(windows: list[int | None]) -> int | None:
    """The narrowest window of any sliding layer (None: no layer slides), for ``ModelSpec.sliding_window``."""
    return min((w for w in windows if w is not None), default=None)
