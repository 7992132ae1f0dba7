"""Reward functions: built-ins, user functions, and scoring with per-call timeouts and recorded errors.

A reward maps ``(response, answer, **meta) -> float``. ``make_reward(spec, **options)`` returns a :class:`RewardFn`:

``exact_match``   1.0 if the whitespace-stripped response equals the stripped answer (``case_sensitive=True``).
``contains``      1.0 if the answer occurs in the response (``case_sensitive=True``).
``regex``         ``pattern=`` (default: the answer itself is the pattern), ``mode="search"|"full"``
                  (``re.search`` or ``re.fullmatch`` of the stripped response), ``case_sensitive=True``. A pattern
                  with a capture group instead extracts group 1 and compares it (stripped) to the stripped answer.
``numeric``       the first number in the response vs the answer, equal within ``rel_tol`` (1e-6) or ``abs_tol``
                  (1e-9). Numbers may be ``-12``, ``1,000``, ``3.5``, ``1e3``, ``.5`` or fractions ``3/4``. A response
                  with no number scores 0.0; an answer that is not a number is an error.
``digit_match``   a SHAPED reward for training tiny models: the fraction of positions ``i`` where the stripped
                  response and answer agree, over ``max(len(answer), len(response))``, so partial answers earn
                  partial credit and extra trailing characters cost credit (only the exact answer scores 1.0).
``digits_shaped``  a SHAPED reward for training tiny models from scratch with GRPO alone: ``0.5 * format +
                  0.5 * digit_match`` where ``format`` is the number of digit characters among the response's first
                  ``len(answer)`` characters over ``max(len(answer), len(response))``. A random model emits a digit
                  now and then, so groups differ in reward from the first step (``digit_match`` alone is almost
                  always 0 for every response and gives GRPO no signal); only the exact answer scores 1.0.
``"module:function"`` or ``"path/to/file.py:function"``
                  a user function ``fn(response: str, answer: str, **meta) -> float``; ``options`` are passed to
                  every call as extra keyword arguments (they override meta keys of the same name). It is imported
                  in the worker process only, never in this one (see below): ``make_reward`` starts the worker and
                  waits for the import, so a bad spec, an import that raises or one that hangs past the start-up
                  timeout is a ``ValueError`` there.

:func:`score_rewards` scores a batch and never raises for a bad reward: an exception, a non-number, a non-finite
number or (user functions) a call running past ``timeout_s`` becomes ``RewardResult(0.0, error)``. A number is any
``numbers.Real`` (so ``True`` counts as 1.0, numpy scalars work) or a 0-d array/tensor.

Timeout mechanism (user functions only; built-ins are plain in-process calls with no timeout machinery). A thread
with a deadline cannot stop arbitrary Python code: a ``while True: pass`` keeps running (and holding the GIL share)
forever, and ``signal.alarm`` works only in the main thread on POSIX and not inside C code. So user functions run in
a persistent worker PROCESS, which can always be killed: :mod:`longstraw.rl.reward_worker`, a standard-library-only
script run by path as ``python -I reward_worker.py`` (isolated mode: it imports neither torch nor this package, and
it is not a ``multiprocessing`` child, which would import this package and torch in the child and re-import the
parent's ``__main__`` script: slow and, for a script without a ``__main__`` guard, wrong). The worker takes the
parent's ``sys.path``, imports the user function once (from the spec string, so nothing is pickled but the
arguments), then serves length-prefixed pickle frames over its stdin/stdout (the user's own prints go to stderr).
The import runs under a start-up timeout (``_STARTUP_TIMEOUT_S``); the parent waits for each result with a deadline
(a reader thread feeding a queue); on a timeout it kills the worker, records the error, and starts a new worker for
the next call. Per-call overhead is one pipe round trip (~0.1 ms); the start-up (~30 ms plus the user module's
imports) is not counted against the per-call timeout. The user module is never imported in the calling process, so
an import that hangs or crashes cannot take the trainer with it.
"""

from __future__ import annotations

import functools
import math
import numbers
import os
import pickle
import queue
import re
import struct
import subprocess
import sys
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

# ---------------------------------------------------------------------------------------------- built-ins


def _norm(s: str, case_sensitive: bool) -> str:
    s = s.strip()
    return s if case_sensitive else s.casefold()


def exact_match(response: str, answer: str, *, case_sensitive: bool = True, **_meta) -> float:
    return float(_norm(response, case_sensitive) == _norm(answer, case_sensitive))


def contains(response: str, answer: str, *, case_sensitive: bool = True, **_meta) -> float:
    a = answer if case_sensitive else answer.casefold()
    r = response if case_sensitive else response.casefold()
    return float(a.strip() in r)


def _regex(response: str, answer: str, *, compiled: re.Pattern | None = None, mode: str = "search",
           case_sensitive: bool = True, **_meta) -> float:
    pat = compiled if compiled is not None else re.compile(answer, 0 if case_sensitive else re.IGNORECASE)
    r = response.strip()
    m = pat.fullmatch(r) if mode == "full" else pat.search(r)
    if m is None:
        return 0.0
    if compiled is not None and pat.groups >= 1:
        return float(_norm(m.group(1) or "", case_sensitive) == _norm(answer, case_sensitive))
    return 1.0


# -12, +3.5, 1,000, 1,000.25, 1e3, .5, 3/4 ; a comma group must be exactly three digits
_NUM = r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)?(?:\.\d+)?(?:[eE][-+]?\d+)?"
_NUMBER_RE = re.compile(rf"(?<![\w.])({_NUM})(?:\s*/\s*({_NUM}))?")


def _to_float(tok: str) -> float | None:
    tok = tok.replace(",", "")
    if not any(c.isdigit() for c in tok):
        return None
    try:
        return float(tok)
    except ValueError:
        return None


def parse_number(text: str, *, whole: bool = False) -> float | None:
    """The first number in ``text`` (or, with ``whole``, ``text`` itself as a number); None if there is none."""
    for m in _NUMBER_RE.finditer(text.strip()):
        if whole and (m.start() != 0 or m.end() != len(text.strip())):
            continue
        num = _to_float(m.group(1))
        if num is None:
            continue
        if m.group(2):
            den = _to_float(m.group(2))
            if den is not None and den != 0:
                return num / den
        return num
    return None


def numeric(response: str, answer: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9, **_meta) -> float:
    want = parse_number(str(answer), whole=True)
    if want is None:
        raise ValueError(f"answer {answer!r} is not a number")
    got = parse_number(response)
    if got is None:
        return 0.0
    return float(math.isclose(got, want, rel_tol=rel_tol, abs_tol=abs_tol))


def digit_match(response: str, answer: str, **_meta) -> float:
    r, a = response.strip(), answer.strip()
    n = max(len(r), len(a))
    if n == 0:
        return 1.0
    return sum(x == y for x, y in zip(r, a)) / n


def digits_shaped(response: str, answer: str, **_meta) -> float:
    r, a = response.strip(), answer.strip()
    n = max(len(r), len(a))
    if n == 0:
        return 1.0
    fmt = sum(c.isdigit() for c in r[: len(a)]) / n
    return 0.5 * fmt + 0.5 * digit_match(response, answer)


# name -> (function, {option: (default, validator)})
def _bool(name, v):
    if not isinstance(v, bool):
        raise ValueError(f"{name}={v!r} must be true or false")
    return v


def _tol(name, v):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
        raise ValueError(f"{name}={v!r} must be a finite number >= 0")
    return float(v)


def _mode(name, v):
    if v not in ("search", "full"):
        raise ValueError(f"{name}={v!r}; allowed: 'search', 'full'")
    return v


def _pattern(name, v):
    if v is not None and not isinstance(v, str):
        raise ValueError(f"{name}={v!r} must be a string (a regular expression) or None")
    return v


BUILTINS: dict[str, tuple[Callable[..., float], dict]] = {
    "exact_match": (exact_match, {"case_sensitive": (True, _bool)}),
    "contains": (contains, {"case_sensitive": (True, _bool)}),
    "regex": (_regex, {"pattern": (None, _pattern), "mode": ("search", _mode), "case_sensitive": (True, _bool)}),
    "numeric": (numeric, {"rel_tol": (1e-6, _tol), "abs_tol": (1e-9, _tol)}),
    "digit_match": (digit_match, {}),
    "digits_shaped": (digits_shaped, {}),
}


@dataclass(frozen=True)
class RewardResult:
    value: float
    error: str | None = None


class RewardFn:
    """A reward function made by :func:`make_reward`. Call it directly or score batches with :func:`score_rewards`.
    Built-ins run in this process. User functions run in their worker process (see the module doc), also when
    called directly (no timeout; an error in the function raises ``RuntimeError`` with its message); close the
    worker with :meth:`close` or by using the object as a context manager (it is also closed at exit)."""

    def __init__(self, spec: str, fn: Callable[..., float] | None, options: dict, *, builtin: bool,
                 target: tuple[str, str, str] | None = None):
        self.spec = spec
        self.fn = fn
        self.options = options
        self.builtin = builtin
        self._target = target  # ("module" | "file", module name or absolute path, function name)
        self._worker: _Worker | None = None

    def __call__(self, response: str, answer: str, **meta) -> float:
        if self.builtin:  # built-ins take only their own options (bound in fn), never meta
            return self.fn(response, answer)
        res = self._get_worker().call(response, answer, meta, None)
        if res.error is not None:
            raise RuntimeError(f"reward {self.spec!r}: {res.error}")
        return res.value

    def close(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self) -> str:
        options = self.fn.keywords if self.builtin else self.options
        opts = "".join(f", {k}={v!r}" for k, v in options.items())
        return f"RewardFn({self.spec!r}{opts})"

    def _get_worker(self) -> "_Worker":
        if self._worker is None:
            self._worker = _Worker(self._target, dict(self.options))
        return self._worker


def _user_target(spec: str) -> tuple[str, str, str]:
    """``(kind, name, function)`` of a user spec, checked without importing anything."""
    where, _, fname = spec.rpartition(":")
    if not where or not fname.isidentifier():
        raise ValueError(f"reward {spec!r}: a user function is given as 'module:function' or "
                         "'path/to/file.py:function'")
    if where.endswith(".py") or "/" in where or os.sep in where:
        path = Path(where).resolve()
        if not path.is_file():
            raise ValueError(f"reward {spec!r}: file {where!r} does not exist (looking for function {fname!r})")
        return "file", str(path), fname
    return "module", where, fname


def make_reward(spec: str, **options) -> RewardFn:
    """A built-in reward by name (options validated) or a user function ``"module:function"`` /
    ``"path/to/file.py:function"``: its worker is started now and imports it, so a bad spec, an import error or an
    import that hangs past the start-up timeout fails here (a one-line ``ValueError``)."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"reward spec {spec!r} must be a non-empty string")
    if spec in BUILTINS:
        fn, allowed = BUILTINS[spec]
        bad = [k for k in options if k not in allowed]
        if bad:
            raise ValueError(f"unknown option {bad[0]!r} for reward {spec!r}; allowed: "
                             f"{', '.join(allowed) or '(none)'}")
        opts = {k: check(k, options.get(k, default)) for k, (default, check) in allowed.items()}
        if spec == "regex":
            pattern = opts.pop("pattern")
            if pattern is not None:
                try:
                    opts["compiled"] = re.compile(pattern, 0 if opts["case_sensitive"] else re.IGNORECASE)
                except re.error as e:
                    raise ValueError(f"pattern={pattern!r} is not a valid regular expression: {e}") from None
        return RewardFn(spec, functools.partial(fn, **opts), {}, builtin=True)
    if ":" not in spec:
        raise ValueError(f"unknown reward {spec!r}; built-ins: {', '.join(BUILTINS)}; or a user function as "
                         "'module:function' or 'path/to/file.py:function'")
    reward = RewardFn(spec, None, dict(options), builtin=False, target=_user_target(spec))
    err = reward._get_worker().start()
    if err is not None:
        reward.close()
        raise ValueError(f"reward {spec!r}: {err}")
    return reward


# ---------------------------------------------------------------------------------------------- scoring


def _as_number(v):
    """``v`` itself if it is a real number (bool and numpy scalars included); the element of a 0-d array or tensor;
    else None."""
    if isinstance(v, numbers.Real):
        return v
    if getattr(v, "ndim", None) == 0 and callable(getattr(v, "item", None)):
        x = v.item()
        return x if isinstance(x, numbers.Real) else None
    return None


def _check_value(v) -> RewardResult:
    if _as_number(v) is not None:
        v = _as_number(v)
        f = float(v)
        if math.isfinite(f):
            return RewardResult(f)
        return RewardResult(0.0, f"reward is not finite: {f!r}")
    return RewardResult(0.0, f"reward is not a number: {type(v).__name__} {v!r:.80}")


def _call_in_process(fn: RewardFn, response, answer, meta) -> RewardResult:
    try:
        return _check_value(fn(response, answer, **meta))
    except (Exception, SystemExit) as e:
        return RewardResult(0.0, f"{type(e).__name__}: {e}")


def score_rewards(reward_fn: RewardFn, responses: Sequence[str], answers: Sequence, metas: Sequence[dict] | None = None,
                  timeout_s: float | None = 10.0) -> list[RewardResult]:
    """Score each ``(response, answer, meta)``; failures are recorded, never raised (see the module doc).

    Built-ins run in-process. User functions run in the worker process with ``timeout_s`` seconds per call
    (``timeout_s=None``: no timeout; a crash of the worker is still recorded).
    """
    n = len(responses)
    if len(answers) != n or (metas is not None and len(metas) != n):
        raise ValueError(f"score_rewards needs one answer and meta per response: {n} responses, {len(answers)} "
                         f"answers, {len(metas) if metas is not None else n} metas")
    if timeout_s is not None and (isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float))
                                  or not timeout_s > 0):
        raise ValueError(f"timeout_s={timeout_s!r} must be a number > 0 (or None for no timeout)")
    metas = metas if metas is not None else [{}] * n
    if reward_fn.builtin:
        return [_call_in_process(reward_fn, r, a, m) for r, a, m in zip(responses, answers, metas)]
    worker = reward_fn._get_worker()
    return [worker.call(r, a, m, timeout_s) for r, a, m in zip(responses, answers, metas)]


# ---------------------------------------------------------------------------------------------- worker

WORKER_PATH = str(Path(__file__).with_name("reward_worker.py"))  # a script: run by path, never imported here
_STARTUP_TIMEOUT_S = 60.0


def _terminate(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()
    for f in (proc.stdin, proc.stdout):
        try:
            f.close()
        except OSError:
            pass


class _Worker:
    """One worker process serving one user function; restarted after a timeout or a crash."""

    def __init__(self, target: tuple[str, str, str], options: dict):
        self.target = target
        self.options = options
        self.proc: subprocess.Popen | None = None
        self.results: queue.Queue | None = None
        self._finalizer = None

    def start(self) -> str | None:
        """Start the worker and wait until it has imported the function; the error text if that failed (or took
        longer than ``_STARTUP_TIMEOUT_S``; the worker is then killed)."""
        if self.proc is not None:
            return None
        self.proc = subprocess.Popen([sys.executable, "-I", WORKER_PATH], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE)
        self._finalizer = weakref.finalize(self, _terminate, self.proc)  # also runs at interpreter exit
        self.results = queue.Queue()
        threading.Thread(target=_reader, args=(self.proc.stdout, self.results), daemon=True).start()
        try:
            self._send({"sys_path": list(sys.path), "target": self.target, "options": self.options})
        except Exception as e:
            self._kill()
            return f"cannot start the reward worker: {type(e).__name__}: {e}"
        try:
            kind, payload = self.results.get(timeout=_STARTUP_TIMEOUT_S)
        except queue.Empty:
            kind, payload = "err", (f"the reward worker did not import the function within {_STARTUP_TIMEOUT_S:g} s "
                                    "(does the module hang while importing?)")
        if kind == "ready":
            return None
        if kind == "eof":
            payload = f"the reward worker exited with code {self.proc.wait()} while importing the function"
        self._kill()
        return payload

    def _send(self, obj) -> None:
        b = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)  # raises before anything is written
        self.proc.stdin.write(struct.pack(">Q", len(b)) + b)
        self.proc.stdin.flush()

    def _kill(self) -> None:
        if self._finalizer is not None:
            self._finalizer()  # kills, waits, closes the pipes (once)
        self.proc = None
        self._finalizer = None

    def call(self, response, answer, meta, timeout_s: float | None) -> RewardResult:
        if self.proc is None:
            err = self.start()
            if err is not None:
                return RewardResult(0.0, err)
        try:
            b = pickle.dumps((response, answer, meta), protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as e:
            return RewardResult(0.0, f"cannot send the arguments to the reward worker: {type(e).__name__}: {e}")
        try:
            self.proc.stdin.write(struct.pack(">Q", len(b)) + b)
            self.proc.stdin.flush()
        except OSError as e:  # the worker died between calls
            self._kill()
            return RewardResult(0.0, f"the reward worker died: {e}")
        try:
            kind, payload = self.results.get(timeout=timeout_s)
        except queue.Empty:
            self._kill()
            return RewardResult(0.0, f"timeout: the reward took longer than {timeout_s:g} s (worker killed)")
        if kind == "ok":
            return _check_value(payload)
        if kind == "eof":
            code = self.proc.wait()
            self._kill()
            return RewardResult(0.0, f"the reward worker exited with code {code} during the call")
        return RewardResult(0.0, payload)

    def close(self) -> None:
        self._kill()


def _read_exact(stream, n: int) -> bytes | None:
    buf = b""
    while len(buf) < n:
        chunk = stream.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return buf


def _reader(stream, out: queue.Queue) -> None:
    """Feeds the worker's result frames into ``out``; ``("eof", None)`` when the worker's stdout closes."""
    try:
        while True:
            head = _read_exact(stream, 8)
            if head is None:
                break
            body = _read_exact(stream, struct.unpack(">Q", head)[0])
            if body is None:
                break
            out.put(pickle.loads(body))
    except (OSError, ValueError, pickle.UnpicklingError):
        pass
    out.put(("eof", None))
