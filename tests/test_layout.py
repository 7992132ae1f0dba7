"""The package's import graph: no circles, and no module imports one that sits above it.

Layers, lowest first (a module may import its own package and any lower layer, never a higher one):

    ops, losses, units, devices, profiling, tokenizer,  pure functions and small utilities
    offload
    state                                                the prompt state protocol and the placement seam
    models                                               model definitions (know nothing of RL or distribution)
    expert_load                                          MoE routing counters hooked onto a model from outside
    engine                                               prefill, replay, reverse pass, score, rollouts
    distributed                                          context parallelism and FSDP, plugged in from outside
    checkpoint                                           HF checkpoints in and out (applies the parallelism)
    planner                                              dry runs of the engine's own step
    rl                                                   the trainer and what it needs
    longstraw (the package's public names)
    integrations                                         drop-ins for other trainers (TRL), over the public API
    cli
    __main__                                             python -m longstraw (runs the CLI)

Every import counts, module-level or inside a function (a lazy import is still a dependency).
"""

import ast
import re
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "longstraw"

LAYERS = [
    {"ops", "losses", "units", "devices", "profiling", "tokenizer", "offload"},
    {"state"},
    {"models"},
    {"expert_load"},
    {"engine"},
    {"distributed"},
    {"checkpoint"},
    {"planner"},
    {"rl"},
    {""},  # longstraw/__init__.py: the public API
    {"integrations"},  # optional drop-ins for other trainers (TRL): above the public API, imported by nothing
    {"cli"},
    {"__main__"},  # python -m longstraw: runs the CLI
]
RANK = {group: i for i, layer in enumerate(LAYERS) for group in layer}


def _modules() -> dict[str, Path]:
    out = {}
    for f in SRC.rglob("*.py"):
        parts = f.relative_to(SRC.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = f
    return out


def _group(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _edges(mods: dict[str, Path]) -> dict[str, set[str]]:
    edges = {}
    for name, f in mods.items():
        pkg = name if f.name == "__init__.py" else name.rsplit(".", 1)[0]
        deps = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = pkg.split(".")[: len(pkg.split(".")) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                for a in node.names:
                    full = f"{target}.{a.name}"
                    deps.add(full if full in mods else target)
        edges[name] = {d for d in deps if d in mods and d != name}
    return edges


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(edges[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def test_every_module_has_a_layer():
    missing = sorted({_group(m) for m in _modules()} - set(RANK))
    assert not missing, f"modules outside the declared layers: {missing} (add them to LAYERS, and to the docstring)"


def test_no_import_circles():
    assert _cycles(_edges(_modules())) == []


def test_nothing_imports_upward():
    bad = []
    for a, deps in _edges(_modules()).items():
        for b in deps:
            ga, gb = _group(a), _group(b)
            if ga != gb and RANK[gb] >= RANK[ga]:
                bad.append(f"{a} ({ga or 'longstraw'}) imports {b} ({gb or 'longstraw'})")
    assert not bad, "\n".join(sorted(bad))


def test_the_engine_and_the_models_know_nothing_of_distribution():
    """Parallelism plugs in through typed interfaces (ops/partitioned.py, RecurrentPrefix.enter/leave, the
    state's schedule and placement): no duck-typed hooks, no process globals below the distributed package."""
    hooks = ("cp_dispatch", "cp_select", "cp_sparse_dispatch", "cp_key_count", "cp_active", "get_context",
             "attach(")
    found = []
    for name, f in _modules().items():
        if _group(name) in ("ops", "state", "models", "engine"):
            text = f.read_text()
            found += [f"{name}: {h}" for h in hooks if h in text]
    assert not found, found


def test_the_checker_sees_lazy_and_relative_imports(tmp_path):
    """The graph builder itself: an import inside a function and a relative import are edges; a circle is found."""
    pkg = tmp_path / "longstraw"
    (pkg / "rl").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "rl" / "__init__.py").write_text("")
    (pkg / "rl" / "plots.py").write_text("def plot():\n    from longstraw.rl.trainer import read\n")
    (pkg / "rl" / "trainer.py").write_text("from . import plots\nread = 1\n")
    mods = {"longstraw": pkg / "__init__.py", "longstraw.rl": pkg / "rl" / "__init__.py",
            "longstraw.rl.plots": pkg / "rl" / "plots.py", "longstraw.rl.trainer": pkg / "rl" / "trainer.py"}
    edges = _edges(mods)
    assert edges["longstraw.rl.plots"] == {"longstraw.rl.trainer"}
    assert edges["longstraw.rl.trainer"] == {"longstraw.rl.plots"}
    assert _cycles(edges) == [["longstraw.rl.plots", "longstraw.rl.trainer"]]


def test_no_wall_clock_assertions_in_tests():
    """Speed is measured by benchmarks/, never asserted in tests (a loaded machine would fail them); waits are
    bounded by pytest-timeout instead."""
    clock = re.compile(r"\bassert\b.*(perf_counter|time\.time\(\)|monotonic\(\)|\bdt\b|elapsed|seconds\s*[<>])")
    bad = []
    for f in sorted(Path(__file__).resolve().parent.rglob("*.py")):
        for i, line in enumerate(f.read_text().splitlines(), 1):
            if clock.search(line):
                bad.append(f"{f.name}:{i}: {line.strip()}")
    assert not bad, "\n".join(bad)
