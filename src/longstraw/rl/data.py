"""Prompt data and offline rollouts from JSONL or Parquet files, validated row by row.

Why validate here: a training run on million-token prompts is expensive to start, so a malformed row must fail at
load time with the file, the line (JSONL) or row (Parquet, 1-based) and the field named, not hours later inside the
trainer.

``load_prompts(path)`` reads rows ``{"prompt": str | [{"role", "content"}, ...], "answer": ..., <anything else>}``
into :class:`PromptRow` (``answer``: a string, or a number turned into its string; optional unless
``require_answer``, which the trainer sets: a row keyed ``target`` where the answer key is ``answer`` would
otherwise train at reward 0 without a word; every other key goes to ``meta`` and reaches the reward as keyword
arguments).

``load_rollouts(path)`` reads rollouts sampled elsewhere (vLLM, SGLang): rows ``{"prompt", "responses": [str],
"rewards": [float], "old_logprobs"?: [[float]], "answer"?}`` into :class:`RolloutGroup`; one ``old_logprobs`` list
per response (its per-token log-probabilities under the sampling policy), all numbers finite.

Format by suffix: ``.jsonl``/``.json``/``.ndjson`` (one JSON object per line, UTF-8; blank lines skipped) or
``.parquet``/``.pq`` (pyarrow, imported only then). Nothing here tokenises: rendering and encoding belong to
:func:`longstraw.tokenizer.render_prompt` and the trainer.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


@dataclass
class PromptRow:
    prompt: str | list[dict]
    answer: str | None
    meta: dict = field(default_factory=dict)
    where: str = ""  # "file:line" (JSONL) or "file:row N" (Parquet), for error messages downstream


@dataclass
class RolloutGroup:
    prompt: str | list[dict]
    responses: list[str]
    rewards: list[float]
    old_logprobs: list[list[float]] | None = None
    answer: str | None = None
    meta: dict = field(default_factory=dict)
    where: str = ""


def _read_rows(path: str | Path) -> Iterator[tuple[str, object]]:
    """``(location, row)`` for every row; ValueError for a missing file, an unknown suffix or bad JSON."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"data file {str(p)!r} does not exist")
    suffix = p.suffix.lower()
    if suffix in JSONL_SUFFIXES:
        with open(p, "rb") as f:
            for i, raw in enumerate(f, 1):
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as e:
                    raise ValueError(f"{p}:{i}: not UTF-8 text (byte 0x{raw[e.start]:02x} at column {e.start + 1}); "
                                     "save the file as UTF-8") from None
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{p}:{i}: invalid JSON ({e.msg} at column {e.colno})") from None
                yield f"{p}:{i}", row
    elif suffix in PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise ValueError(f"reading {str(p)!r} needs pyarrow: pip install longstraw[parquet]") from None
        try:
            table = pq.read_table(p)
        except Exception as e:  # pyarrow raises ArrowInvalid/OSError for broken files
            raise ValueError(f"{p}: cannot read Parquet ({type(e).__name__}: {e})") from None
        for i, row in enumerate(table.to_pylist(), 1):
            yield f"{p}:row {i}", row
    else:
        raise ValueError(f"data file {str(p)!r} has suffix {suffix!r}; allowed: "
                         f"{', '.join(JSONL_SUFFIXES + PARQUET_SUFFIXES)}")


def _prompt(where: str, row: dict, key: str):
    if key not in row:
        raise ValueError(f"{where}: missing field {key!r} (the row has: {', '.join(map(repr, row)) or 'nothing'})")
    v = row[key]
    if isinstance(v, str):
        return v
    if isinstance(v, list) and v:
        for j, m in enumerate(v):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ValueError(f"{where}: field {key!r}[{j}] must be a message {{'role': str, 'content': str}}, "
                                 f"got {m!r:.120}")
        return [{"role": m["role"], "content": m["content"]} for m in v]
    raise ValueError(f"{where}: field {key!r} must be a string or a non-empty list of messages, got "
                     f"{type(v).__name__} {v!r:.120}")


def _answer(where: str, row: dict, key: str) -> str | None:
    v = row.get(key)
    if v is None:
        return None
    if isinstance(v, str):
        return v
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return str(v)
    raise ValueError(f"{where}: field {key!r} must be a string or a number, got {type(v).__name__} {v!r:.120}")


def _object(where: str, row) -> dict:
    if not isinstance(row, dict):
        raise ValueError(f"{where}: a row must be a JSON object, got {type(row).__name__} {row!r:.120}")
    return row


def _non_empty(rows: list, path) -> list:
    if not rows:
        raise ValueError(f"data file {str(path)!r} has no rows")
    return rows


def load_prompts(path: str | Path, prompt_key: str = "prompt", answer_key: str = "answer", *,
                 require_answer: bool = False) -> list[PromptRow]:
    """Prompt rows from JSONL or Parquet (see the module doc). ``require_answer``: a row without ``answer_key`` (or
    with a null answer) is an error naming the file, the line, the key and the keys the row has."""
    rows = []
    for where, row in _read_rows(path):
        row = _object(where, row)
        prompt = _prompt(where, row, prompt_key)
        answer = _answer(where, row, answer_key)
        if answer is None and require_answer:
            what = "is null" if answer_key in row else "is missing"
            raise ValueError(f"{where}: the answer {answer_key!r} {what} (the answer key, set by data.answer_key; "
                             f"data.answer_key = \"\" for rows without answers); the row has: "
                             f"{', '.join(map(repr, row))}")
        meta = {k: v for k, v in row.items() if k not in (prompt_key, answer_key)}
        rows.append(PromptRow(prompt, answer, meta, where))
    return _non_empty(rows, path)


def _number(where: str, name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{where}: {name} must be a number, got {type(v).__name__} {v!r:.60}")
    if not math.isfinite(v):
        raise ValueError(f"{where}: {name} must be finite, got {v!r}")
    return float(v)


def load_rollouts(path: str | Path) -> list[RolloutGroup]:
    """Offline rollout groups from JSONL (or Parquet) rows ``{prompt, responses, rewards, old_logprobs?, answer?}``."""
    groups = []
    for where, row in _read_rows(path):
        row = _object(where, row)
        prompt = _prompt(where, row, "prompt")
        for k in ("responses", "rewards"):
            if k not in row:
                raise ValueError(f"{where}: missing field {k!r}")
        responses, rewards = row["responses"], row["rewards"]
        if not isinstance(responses, list) or not responses:
            raise ValueError(f"{where}: field 'responses' must be a non-empty list of strings, got {responses!r:.120}")
        for j, r in enumerate(responses):
            if not isinstance(r, str):
                raise ValueError(f"{where}: field 'responses'[{j}] must be a string, got {type(r).__name__} {r!r:.60}")
        if not isinstance(rewards, list):
            raise ValueError(f"{where}: field 'rewards' must be a list of numbers, got {rewards!r:.120}")
        if len(rewards) != len(responses):
            raise ValueError(f"{where}: field 'rewards' has {len(rewards)} values but 'responses' has "
                             f"{len(responses)}")
        rewards = [_number(where, f"field 'rewards'[{j}]", v) for j, v in enumerate(rewards)]
        old = row.get("old_logprobs")
        if old is not None:
            if not isinstance(old, list) or len(old) != len(responses):
                n = len(old) if isinstance(old, list) else type(old).__name__
                raise ValueError(f"{where}: field 'old_logprobs' must be one list of floats per response "
                                 f"({len(responses)}), got {n}")
            checked = []
            for j, lp in enumerate(old):
                if not isinstance(lp, list):
                    raise ValueError(f"{where}: field 'old_logprobs'[{j}] must be a list of floats, got "
                                     f"{type(lp).__name__}")
                checked.append([_number(where, f"field 'old_logprobs'[{j}][{t}]", x) for t, x in enumerate(lp)])
            old = checked
        answer = _answer(where, row, "answer")
        meta = {k: v for k, v in row.items() if k not in ("prompt", "responses", "rewards", "old_logprobs", "answer")}
        groups.append(RolloutGroup(prompt, list(responses), rewards, old, answer, meta, where))
    return _non_empty(groups, path)
