"""fla's Triton kernels on the CPU, under Triton's interpreter: the test helper of ``make test-fla``.

No CUDA machine is at hand for most changes, and fla (flash-linear-attention / fla-core) has no CPU path. Triton's
interpreter (``TRITON_INTERPRET=1``) runs a ``@triton.jit`` kernel's Python body on NumPy arrays, program by program,
so fla's real kernels (forward AND backward, which no GPU run here has reached yet) can be held to the torch delta
rule on the CPU: shapes, the ``[B, Hv, Dk, Dv]`` state layout, ``initial_state`` / final-state gradients, tile masks
at sizes that are not powers of two. What it cannot show: GPU numerics (tensor-core accumulation), bfloat16 (NumPy
has no bfloat16: the interpreter's emulation overflows; float16 and float32 run), speed, or the Hopper guard firing.

Two things stop fla 0.6.0 under Triton 3.9.0's interpreter, and :func:`install` works around both, in this process:

* fla's ``@triton.autotune`` benchmarks its configurations through the active GPU driver, and there is none: keep
  the first configuration after Triton's own pruning (no benchmark runs; any configuration computes the same).
* A ``for i in range(n)`` inside a kernel binds ``i`` to a Python int in the interpreter, where compiled Triton gives
  an int32 scalar tensor; fla calls ``i.to(tl.int64)`` on it. The interpreter already rewrites each kernel's AST
  (it wraps every assignment in ``interpreter_semantic.to_tensor``); this adds one such assignment of the loop
  variable at the top of every ``range`` / ``tl.range`` loop body (``tl.static_range`` loops keep Python ints, as
  compiled Triton keeps constexprs there).

The interpreter must be on before triton is first imported (``jit`` reads it when fla's kernels are defined), so the
tests that use this skip unless ``TRITON_INTERPRET=1`` is in the environment (``make test-fla`` sets it) and fla and
triton are importable (``.venv-fla``: the ``fla-cpu`` extra, without transformers, which would pick fla's kernels for
its own Qwen3-Next CPU forward and crash).
"""

from __future__ import annotations

import ast
import importlib.util
import os

import pytest


def unavailable() -> str | None:
    """Why these tests cannot run in this process, or None. Imports nothing."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "fla under Triton's interpreter needs TRITON_INTERPRET=1 (make test-fla)"
    missing = [m for m in ("triton", "fla") if importlib.util.find_spec(m) is None]
    if missing:
        return f"{' and '.join(missing)} not installed (make test-fla installs fla-core and triton into .venv-fla)"
    return None


_installed = False


def install() -> None:
    """Apply the two interpreter workarounds (module docstring) once per process; raises naming what changed in
    Triton if its interpreter no longer has the pieces they patch."""
    global _installed
    if _installed:
        return
    import triton.runtime.autotuner as autotuner
    import triton.runtime.interpreter as interpreter

    for owner, name in ((autotuner.Autotuner, "prune_configs"), (interpreter, "ASTTransformer"),
                        (interpreter.FunctionRewriter, "ast_transformer")):
        if not hasattr(owner, name):
            raise RuntimeError(f"Triton's interpreter has no {owner.__name__}.{name}: the fla-on-CPU workarounds "
                               "were written for triton 3.9.0 (the fla-cpu extra's pin)")

    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]

    class LoopVariablesAsTensors(interpreter.ASTTransformer):
        def visit_For(self, node):
            node = self.generic_visit(node)
            it = node.iter
            name = it.func.attr if isinstance(it, ast.Call) and isinstance(it.func, ast.Attribute) else (
                it.func.id if isinstance(it, ast.Call) and isinstance(it.func, ast.Name) else None)
            if name == "range" and isinstance(node.target, ast.Name):
                rebind = ast.Assign(targets=[ast.Name(id=node.target.id, ctx=ast.Store())],
                                    value=ast.Name(id=node.target.id, ctx=ast.Load()))
                node.body.insert(0, ast.copy_location(self.visit_Assign(rebind), node))
            return node

    interpreter.FunctionRewriter.ast_transformer = LoopVariablesAsTensors()
    _installed = True


def force_fla(monkeypatch: pytest.MonkeyPatch) -> None:
    """Route every delta-rule call that is not pinned to ``backend="torch"`` to fla's kernel, on any device and
    dtype (the dispatcher sends only CUDA bf16/fp16 there): the model code then runs exactly its GPU path."""
    install()
    from longstraw.ops import deltanet

    monkeypatch.setattr(deltanet, "_dispatch",
                        lambda backend, device_type, dtype, needs_grad, channels=False, where=None:
                        ("torch" if backend == "torch" else "fla", None))
