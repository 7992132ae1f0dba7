"""Built-in synthetic long-context tasks (in the manner of RULER), sized in tokens of a given tokenizer.

Why: a GRPO run on million-token prompts needs prompts of an exact, controllable length whose answer is checkable,
with no data set to download. Each task builds one :class:`Sample` (``prompt``, ``answer``, ``meta``) from
``(length, seed, tokenizer)``, deterministically: the same arguments give the same sample on every machine
(``random.Random`` seeded with a string, which is hashed with SHA-512, independent of ``PYTHONHASHSEED``).

Tasks (``make_task(name, length, seed, tokenizer, **options)``):

``passkey``
    A number hidden at a random depth inside filler text; asked at the end.
``kv_retrieval``
    Many ``key: value`` lines (random alphanumeric keys, numeric values); the value of one key is asked.
``variable_tracking``
    ``chains`` chains of assignments ``VAR A = 48213.``, ``VAR B = A.``, ... (``hops`` copies each) scattered in
    order through filler text; asked: the value of the LAST variable of the first chain (a number, so the answer
    form is the same as the other tasks). Distractor chains hold other values.

Every prompt ends with a cue (``\nThe pass key is ``) so that the ideal response is the answer followed by EOS.
The fixed text is kept short on purpose (the passkey task needs about 60 byte tokens besides its filler), so that
tiny models can be trained on short prompts; at long lengths its wording does not matter.
``answer_digits`` sets the answer's digit count (a tiny model can be trained on 1-2 digits); the answer has exactly
that many digits (no leading zero unless it is a single digit).

Length fitting, O(length): the prompt is ``header + body(n, p) + question`` where ``body`` is a deterministic
function of a character budget ``n`` (a prefix of a seeded sentence/line stream, with the needles inserted at
sentence boundaries at their depth fraction) plus ``p`` characters of filler. The fixed part is measured once
(``n = 0``), tokens per body character are estimated from a ~20k-character probe, and the whole prompt is tokenised;
if it misses the target, the rate is re-measured from that result and ``n`` corrected (secant steps). Where the
body moves in steps larger than the tolerance (``kv_retrieval``'s whole lines), a second stage tunes the filler
``p``. Typically two or three whole-prompt tokenisations in all; the byte tokenizer lands exactly on the first. The
result satisfies ``length - tolerance <= tokens <= length`` (``tolerance`` defaults to ``max(4, length // 500)``)
and never exceeds ``length`` (a warning if a tokenizer defeats the search). Token counts are of the prompt string
as encoded by ``tokenizer.encode`` (no chat template, no special tokens).

The filler is cut at a character, so it may end mid-word (as RULER cuts its haystack); in ``kv_retrieval`` the
remainder smaller than one line is filled with filler text right after the header.
"""

from __future__ import annotations

import bisect
import inspect
import random
import string
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

MAX_LENGTH = 1 << 24  # 16M tokens
MAX_ANSWER_DIGITS = 32
_PROBE_CHARS = 20_000
_MAX_FITS = 8

# bland filler: no digits, no ':' and none of the words the questions use (pass, key, value, VAR)
FILLER_SENTENCES = (
    "The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.", "There and back again.",
    "The river flows to the sea.", "Birds sing in the morning.", "The road is long and quiet.",
    "Clouds drift over the hills.", "A cat sleeps by the window.", "The wind moves the tall trees.",
    "Rain falls on the old roof.", "The market opens at dawn.", "Snow covers the distant mountains.",
    "A boat rests on the calm lake.", "The library is warm and still.",
)


@dataclass(frozen=True)
class Sample:
    """One task instance: the prompt text, the reference answer, and metadata (passed to rewards as ``**meta``)."""

    prompt: str
    answer: str
    meta: dict = field(default_factory=dict)


# ------------------------------------------------------------------------------------------------ helpers


def _rng(task: str, seed: int, stream: str) -> random.Random:
    return random.Random(f"longstraw/{task}/{seed}/{stream}")


def _digits(rng: random.Random, n: int) -> str:
    if n == 1:
        return str(rng.randrange(10))
    return str(rng.randrange(10 ** (n - 1), 10 ** n))


class _Stream:
    """A seeded, prefix-stable stream of text units (sentences or lines); ``text(n)`` is its first ``n`` characters
    and ``starts`` the offsets where units begin (the boundaries needles are snapped to)."""

    def __init__(self, make_unit: Callable[[], str]):
        self.make_unit = make_unit
        self.parts: list[str] = []
        self.starts: list[int] = []
        self.total = 0
        self._joined = ""

    def ensure(self, n: int) -> None:
        if self.total >= n:
            return
        want = n + n // 8 + 256  # headroom: later fits usually ask for a little more
        while self.total < want:
            u = self.make_unit()
            self.starts.append(self.total)
            self.parts.append(u)
            self.total += len(u)
        self._joined = "".join(self.parts)

    def text(self, n: int) -> str:
        self.ensure(n)
        return self._joined[:n]

    def ends_upto(self, n: int) -> int:
        """The number of whole units in the first ``n`` characters."""
        self.ensure(n)
        return bisect.bisect_right(self.starts, n) - 1 if n < self.total else len(self.parts)

    def snap(self, pos: float, n: int) -> int:
        """The unit boundary at or before character ``pos`` (within the first ``n`` characters)."""
        self.ensure(n)
        i = bisect.bisect_right(self.starts, min(pos, n)) - 1
        return self.starts[i] if i >= 0 else 0


def _filler(task: str, seed: int, stream: str = "filler") -> _Stream:
    rng = _rng(task, seed, stream)
    buf: list[str] = []

    def unit() -> str:
        if not buf:
            buf.extend(s + " " for s in rng.choices(FILLER_SENTENCES, k=4096))
            buf.reverse()
        return buf.pop()

    return _Stream(unit)


def _haystack(filler: _Stream, n: int, inserts: list[tuple[float, str]]) -> str:
    """The first ``n`` filler characters with each ``(depth, text)`` inserted at the sentence boundary at or before
    ``depth * n`` (inserts are given in the order they must appear; depths must be non-decreasing)."""
    text = filler.text(n)
    out, prev = [], 0
    for depth, ins in inserts:
        p = max(prev, filler.snap(depth * n, n))
        out.append(text[prev:p])
        out.append(ins)
        prev = p
    out.append(text[prev:])
    return "".join(out)


def _fit(task: str, tokenizer, length: int, tolerance: int, build: Callable[[int, int], tuple[str, dict]]):
    """Find ``(n, p)`` with ``length - tolerance <= tokens(build(n, p)) <= length``; see the module doc.

    ``n`` is the body budget in characters (coarse: in ``kv_retrieval`` it moves in whole lines), ``p`` a number of
    filler characters (fine: about one token per few characters). Stage 1 fits ``n`` with ``p = 0``; if its token
    count is a step function that jumps over the band, stage 2 fills the rest with ``p``.
    """

    def count(s: str) -> int:
        return len(tokenizer.encode(s))

    p0, x0 = build(0, 0)
    t0 = count(p0)
    if t0 > length:
        raise ValueError(f"length={length} is too short for task {task!r} with this tokenizer: its fixed text "
                         f"alone is {t0} tokens; allowed: [{t0}, {MAX_LENGTH}]")
    if t0 == length:
        return p0, x0, t0
    lo = length - tolerance
    probe = min(_PROBE_CHARS, 8 * (length - t0))
    probe_tokens = count(build(probe, 0)[0]) - t0
    rate = max(probe_tokens / probe, 1e-6)  # tokens per body character
    # one token per character (byte tokenizer on ASCII): counts add up exactly, so aim at the target itself;
    # otherwise at the middle of the band, which absorbs the merges at the joins
    aim = length if probe_tokens == probe else length - tolerance // 2
    best = (t0, p0, x0, 0)  # (tokens, prompt, extra, n): the most tokens <= length so far
    lowest = None
    seen = set()

    def consider(m, prompt, x, n):
        nonlocal best, lowest
        if m <= length and m > best[0]:
            best = (m, prompt, x, n)
        if lowest is None or m < lowest[0]:
            lowest = (m, prompt, x, n)

    n = max(0, round((aim - t0) / rate))
    for _ in range(_MAX_FITS // 2):  # stage 1: the body budget
        prompt, x = build(n, 0)
        m = count(prompt)
        consider(m, prompt, x, n)
        if lo <= m <= length:
            return prompt, x, m
        if m in seen:
            break  # a step function: moving n cannot land in the band
        seen.add(m)
        if n > 0 and m > t0:
            rate = max((m - t0) / n, 1e-6)
        if m > length:
            aim = length - tolerance // 2
        step = round((aim - m) / rate)
        n = max(0, n + (step or (1 if aim > m else -1)))
    # stage 2: keep the best body, fill up with filler characters
    m_n, _, _, n = best
    pad_probe = 2048
    pad_rate = max((count(build(0, pad_probe)[0]) - t0) / pad_probe, 1e-6)
    pad = max(0, round((aim - m_n) / pad_rate))
    for _ in range(_MAX_FITS - _MAX_FITS // 2):
        prompt, x = build(n, pad)
        m = count(prompt)
        consider(m, prompt, x, n)
        if lo <= m <= length:
            return prompt, x, m
        if m > length:
            aim = length - tolerance // 2
        step = round((aim - m) / pad_rate)
        pad = max(0, pad + (step or (1 if aim > m else -1)))
    m, prompt, x, _ = best if best[0] >= t0 else lowest
    warnings.warn(f"task {task!r}: could not fit length={length} within tolerance={tolerance} in {_MAX_FITS} "
                  f"tokenisations with this tokenizer; the prompt has {m} tokens")
    return prompt, x, m


def _check_int(name: str, value, lo: int, hi: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{name}={value!r} must be an integer in [{lo}, {hi}]")
    if not lo <= value <= hi:
        raise ValueError(f"{name}={value!r} is out of range; allowed: [{lo}, {hi}]")
    return value


def _check_depth_value(depth) -> None:
    if depth is not None and (isinstance(depth, bool) or not isinstance(depth, (int, float))
                              or not 0.0 <= depth <= 1.0):
        raise ValueError(f"depth={depth!r} must be a number in [0, 1] (or None for a random depth)")


def _check_depth(depth, rng: random.Random) -> float:
    drawn = rng.random()  # always drawn, so that a given depth does not shift the other random choices
    _check_depth_value(depth)
    return drawn if depth is None else float(depth)


def _check_chains(chains: int, answer_digits: int) -> None:
    if chains > 10 ** answer_digits - (10 ** (answer_digits - 1) if answer_digits > 1 else 0):
        raise ValueError(f"chains={chains} needs distinct values, but answer_digits={answer_digits} allows fewer")


def _check_common(length, seed, tokenizer, answer_digits, tolerance) -> int:
    _check_int("length", length, 1, MAX_LENGTH)
    _check_int("seed", seed, 0, 2**63 - 1)
    _check_int("answer_digits", answer_digits, 1, MAX_ANSWER_DIGITS)
    if not (callable(getattr(tokenizer, "encode", None)) and callable(getattr(tokenizer, "decode", None))):
        raise ValueError(f"tokenizer={tokenizer!r:.80} is not a tokenizer (it needs encode(text) and decode(ids))")
    if tolerance is None:
        return max(4, length // 500)
    return _check_int("tolerance", tolerance, 0, length)


# ------------------------------------------------------------------------------------------------ tasks


def passkey(length: int, seed: int, tokenizer, *, answer_digits: int = 5, depth: float | None = None,
            tolerance: int | None = None) -> Sample:
    """A pass key hidden at ``depth`` (0: start, 1: end; None: random) of filler text."""
    tol = _check_common(length, seed, tokenizer, answer_digits, tolerance)
    rng = _rng("passkey", seed, "answer")
    key = _digits(rng, answer_digits)
    depth = _check_depth(depth, rng)
    filler = _filler("passkey", seed)
    header = "Remember the pass key.\n"
    needle = f"The pass key is {key}. "
    question = "\nThe pass key is "

    def build(n, p):
        return header + _haystack(filler, n + p, [(depth, needle)]) + question, {}

    prompt, _, m = _fit("passkey", tokenizer, length, tol, build)
    return Sample(prompt, key, {"task": "passkey", "length": length, "prompt_tokens": m, "seed": seed,
                                "answer_digits": answer_digits, "depth": depth})


def kv_retrieval(length: int, seed: int, tokenizer, *, answer_digits: int = 5, key_length: int = 8,
                 depth: float | None = None, tolerance: int | None = None) -> Sample:
    """``key: value`` lines; the value of the key at ``depth`` (None: random) of the list is asked."""
    tol = _check_common(length, seed, tokenizer, answer_digits, tolerance)
    _check_int("key_length", key_length, 4, 64)
    rng = _rng("kv_retrieval", seed, "answer")
    alphabet = string.ascii_lowercase + string.digits
    key = "".join(rng.choices(alphabet, k=key_length))
    value = _digits(rng, answer_digits)
    depth = _check_depth(depth, rng)
    seen = {key}
    line_rng = _rng("kv_retrieval", seed, "pairs")

    def line() -> str:
        while True:
            k = "".join(line_rng.choices(alphabet, k=key_length))
            if k not in seen:
                seen.add(k)
                return f"{k}: {_digits(line_rng, answer_digits)}\n"

    lines = _Stream(line)
    pad = _filler("kv_retrieval", seed, "pad")
    header = "Remember the value of each key.\n"
    target = f"{key}: {value}\n"
    question = f"\nThe value of key {key} is "

    def build(n, p):
        k = lines.ends_upto(n)
        used = lines.starts[k] if k < len(lines.parts) else lines.total
        body = lines.text(used)
        at = lines.starts[round(depth * k)] if round(depth * k) < k else used
        rest = n - used + p  # the budget left over by whole lines, plus the fine fill
        filler = (pad.text(rest - 1) + "\n") if rest > 0 else ""
        return header + filler + body[:at] + target + body[at:] + question, {"pairs": k + 1,
                                                                               "position": round(depth * k)}

    prompt, extra, m = _fit("kv_retrieval", tokenizer, length, tol, build)
    return Sample(prompt, value, {"task": "kv_retrieval", "length": length, "prompt_tokens": m, "seed": seed,
                                  "answer_digits": answer_digits, "depth": depth, "key": key, **extra})


def variable_tracking(length: int, seed: int, tokenizer, *, answer_digits: int = 5, hops: int = 4, chains: int = 2,
                      tolerance: int | None = None) -> Sample:
    """``chains`` assignment chains (``VAR A = 48213.`` then ``hops`` copies ``VAR B = A.``) in filler text, in order
    at random depths; the value of the last variable of the first chain is asked."""
    tol = _check_common(length, seed, tokenizer, answer_digits, tolerance)
    _check_int("hops", hops, 0, 64)
    _check_int("chains", chains, 1, 64)
    _check_chains(chains, answer_digits)
    rng = _rng("variable_tracking", seed, "answer")
    names: list[str] = []
    while len(names) < chains * (hops + 1):
        nm = "".join(rng.choices(string.ascii_uppercase, k=5))
        if nm not in names:
            names.append(nm)
    values: list[str] = []
    while len(values) < chains:
        v = _digits(rng, answer_digits)
        if v not in values:
            values.append(v)
    statements = []  # per chain, in order
    for c in range(chains):
        nm = names[c * (hops + 1):(c + 1) * (hops + 1)]
        statements.append([f"VAR {nm[0]} = {values[c]}. "] + [f"VAR {nm[i]} = {nm[i - 1]}. "
                                                             for i in range(1, hops + 1)])
    order = [c for c in range(chains) for _ in range(hops + 1)]
    rng.shuffle(order)  # an interleaving that keeps each chain's own order
    depths = sorted(rng.random() for _ in order)
    nxt = [0] * chains
    inserts = []
    for d, c in zip(depths, order):
        inserts.append((d, statements[c][nxt[c]]))
        nxt[c] += 1
    asked = names[hops]
    filler = _filler("variable_tracking", seed)
    header = "Track the variable assignments.\n"
    question = f"\nThe value of VAR {asked} is "

    def build(n, p):
        return header + _haystack(filler, n + p, inserts) + question, {}

    prompt, _, m = _fit("variable_tracking", tokenizer, length, tol, build)
    return Sample(prompt, values[0], {"task": "variable_tracking", "length": length, "prompt_tokens": m,
                                      "seed": seed, "answer_digits": answer_digits, "hops": hops, "chains": chains,
                                      "variable": asked})


TASKS: dict[str, Callable[..., Sample]] = {
    "passkey": passkey,
    "kv_retrieval": kv_retrieval,
    "variable_tracking": variable_tracking,
}

_OPTIONS = {
    "passkey": ("answer_digits", "depth", "tolerance"),
    "kv_retrieval": ("answer_digits", "key_length", "depth", "tolerance"),
    "variable_tracking": ("answer_digits", "hops", "chains", "tolerance"),
}


_OPTION_CHECKS = {
    "answer_digits": lambda v: _check_int("answer_digits", v, 1, MAX_ANSWER_DIGITS),
    "depth": _check_depth_value,
    "key_length": lambda v: _check_int("key_length", v, 4, 64),
    "hops": lambda v: _check_int("hops", v, 0, 64),
    "chains": lambda v: _check_int("chains", v, 1, 64),
    "tolerance": lambda v: v is None or _check_int("tolerance", v, 0, MAX_LENGTH),
}


def task_names() -> list[str]:
    return list(TASKS)


def check_task(name: str, **options) -> None:
    """Validate a task name and its options without building a sample (no length or tokenizer needed): the
    early check for a config. The length is checked by :func:`make_task`, against the task's fixed text."""
    if name not in TASKS:
        raise ValueError(f"unknown task {name!r}; built-in tasks: {', '.join(TASKS)}")
    bad = [k for k in options if k not in _OPTIONS[name]]
    if bad:
        raise ValueError(f"unknown option {bad[0]!r} for task {name!r}; allowed: {', '.join(_OPTIONS[name])}")
    for k, v in options.items():
        _OPTION_CHECKS[k](v)
    if name == "variable_tracking":
        defaults = inspect.signature(variable_tracking).parameters
        _check_chains(options.get("chains", defaults["chains"].default),
                      options.get("answer_digits", defaults["answer_digits"].default))


def make_task(name: str, length: int, seed: int, tokenizer, **options) -> Sample:
    """One sample of built-in task ``name`` with a prompt of about ``length`` tokens of ``tokenizer``.

    Options: ``answer_digits`` (1..32, default 5), ``tolerance`` (tokens below ``length`` accepted; default
    ``max(4, length // 500)``), and per task ``depth`` (passkey, kv_retrieval: 0..1 or None), ``key_length``
    (kv_retrieval: 4..64), ``hops`` (0..64) and ``chains`` (1..64) (variable_tracking).
    """
    check_task(name, **options)
    return TASKS[name](length, seed, tokenizer, **options)
