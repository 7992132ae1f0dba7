"""Sizes and lengths as users type them, and bytes as people read them.

``parse_bytes("80G")``: memory, binary units (``K`` = 2^10 ... ``T`` = 2^40; an optional ``B`` / ``iB``), or a plain
number of bytes. ``parse_tokens("2.1M")``: a token count; ``K`` / ``M`` / ``G`` are powers of 1024 as context lengths
are quoted (``128K`` = 131,072, ``1M`` = 1,048,576, ``2.1M`` = 2,202,010), a fraction of a unit is rounded to
the nearest token and a plain number must be whole. Both reject
non-finite, negative and zero values with a ``ValueError`` that names the setting and shows what is allowed.
"""

from __future__ import annotations

import math
import re

__all__ = ["parse_bytes", "parse_tokens", "format_bytes", "format_tokens"]

_BINARY = {"": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
_SIZE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*([KMGT]?)(?:I?B)?\s*", re.IGNORECASE)


def _parse(text, name: str, example: str, units: dict[str, int], what: str, whole: str) -> float:
    """``text``'s value in the base unit; a plain number (no unit) must be whole (``whole``: what to say if not)."""
    if isinstance(text, bool):
        raise ValueError(f"{name}={text!r} must be {what} like {example}")
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        m = _SIZE.fullmatch(str(text))
        if m is None or m.group(2).upper() not in units:
            raise ValueError(f"{name}={text!r} must be {what} like {example}")
        unit = m.group(2).upper()
        value = float(m.group(1)) * units[unit]
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name}={text!r} must be {what} like {example} (finite and > 0)")
    if not unit and not value.is_integer():
        raise ValueError(f"{name}={text!r} must be {whole}")
    return value


def parse_bytes(text, name: str = "size") -> int:
    """``"80G"``, ``"141GiB"``, ``"512M"``, ``"1.5T"`` or a whole number of bytes -> bytes (binary units; a fraction
    of a unit is rounded to the nearest byte)."""
    return round(_parse(text, name, "80G, 141G, 512M or a number of bytes", _BINARY, "a memory size",
                        "a whole number of bytes, or a size with a unit like 1.5G"))


def parse_tokens(text, name: str = "length") -> int:
    """``"512K"``, ``"1M"``, ``"2.1M"`` or an integer -> a number of tokens (K, M, G = 1024, 1024^2, 1024^3)."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"{name}={text!r} must be a token count > 0, like 4096, 512K, 1M or 2.1M")
        return text
    units = {k: v for k, v in _BINARY.items() if k != "T"}
    value = _parse(text, name, "4096, 512K, 1M or 2.1M", units, "a token count",
                   "a whole number of tokens, or a length with a unit like 2.1M")
    return max(1, round(value))


def format_bytes(n: float) -> str:
    """Bytes in the largest binary unit that keeps the number >= 1: ``"1.50 GiB"``."""
    for unit, div in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= div:
            return f"{n / div:.2f} {unit}"
    return f"{int(n)} B"


def format_tokens(n: int) -> str:
    """``2,202,010`` (thousands separators; the exact count a parsed length stands for)."""
    return f"{int(n):,}"
