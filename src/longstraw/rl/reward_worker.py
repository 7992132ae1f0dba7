"""The reward worker: a separate Python process that imports one user reward function and serves calls to it.

Started by :mod:`longstraw.rl.rewards` as ``[sys.executable, "-I", <this file>]``: run by path, in isolated mode,
so starting it imports neither torch nor longstraw (this file uses the standard library only, and isolated mode
keeps the script's directory, ``PYTHON*`` variables and user site-packages off ``sys.path``). The parent then sends
its own ``sys.path``, so the user's module is found exactly as the parent would find it.

Protocol over stdin/stdout, every frame an 8-byte big-endian length and a pickle:

1. parent -> worker: ``{"sys_path": [...], "target": (kind, name, function), "options": {...}}`` where kind is
   ``"module"`` (name: a module to import) or ``"file"`` (name: an absolute path to a ``.py`` file);
2. worker -> parent: ``("ready", None)`` once the function is imported, or ``("err", message)`` and exit;
3. then per call: parent -> worker ``(response, answer, meta)``; worker -> parent ``("ok", float)`` or
   ``("err", message)``.

The user's prints go to stderr (stdout carries the protocol). A watchdog thread exits the worker when its parent
dies, even while the user function spins.
"""

import importlib
import importlib.util
import numbers
import os
import pickle
import re
import struct
import sys
import threading
import time


def _watchdog(parent: int) -> None:
    # an orphaned worker (parent killed) exits even while the user function spins; Python switches threads every
    # few milliseconds, so this runs during a `while True: pass`
    while True:
        time.sleep(1.0)
        if os.getppid() != parent:
            os._exit(1)


def _import_target(kind: str, name: str, fname: str):
    """The user function; an error message (str) if it cannot be had."""
    try:
        if kind == "file":
            mod_name = "_longstraw_reward_" + re.sub(r"\W", "_", name)
            spec = importlib.util.spec_from_file_location(mod_name, name)
            mod = importlib.util.module_from_spec(spec)
            sys.modules[mod_name] = mod  # dataclasses and pickling look their module up here
            spec.loader.exec_module(mod)
        else:
            mod = importlib.import_module(name)
    except BaseException as e:  # the user's module may raise anything while importing
        return f"cannot import {kind} {name!r} for function {fname!r}: {type(e).__name__}: {e}"
    fn = getattr(mod, fname, None)
    if fn is None:
        return f"{kind} {name!r} has no function {fname!r}"
    if not callable(fn):
        return f"{kind} {name!r}: {fname!r} is not callable ({type(fn).__name__})"
    return fn


def main() -> None:
    threading.Thread(target=_watchdog, args=(os.getppid(),), daemon=True).start()
    rin = sys.stdin.buffer
    rout = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the user's prints go to stderr, not into the protocol
    sys.stdout = sys.stderr
    sys.stdin = open(os.devnull)

    def read():
        head = rin.read(8)
        if len(head) < 8:
            return None
        (n,) = struct.unpack(">Q", head)
        return pickle.loads(rin.read(n))

    def write(obj):
        b = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        rout.write(struct.pack(">Q", len(b)) + b)
        rout.flush()

    init = read()
    if init is None:
        return
    sys.path[:] = init["sys_path"]
    fn = _import_target(*init["target"])
    if isinstance(fn, str):
        write(("err", fn))
        return
    options = init["options"]
    write(("ready", None))
    while True:
        req = read()
        if req is None:
            return
        response, answer, meta = req
        try:
            v = fn(response, answer, **{**meta, **options})
            if not isinstance(v, numbers.Real) and getattr(v, "ndim", None) == 0 and hasattr(v, "item"):
                v = v.item()  # a 0-d array or tensor
            if isinstance(v, numbers.Real):
                write(("ok", float(v)))
            else:
                write(("err", "reward is not a number: %s %.80r" % (type(v).__name__, v)))
        except BaseException as e:
            write(("err", "%s: %s" % (type(e).__name__, e)))


if __name__ == "__main__":
    main()
