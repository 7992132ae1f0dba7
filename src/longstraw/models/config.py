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
