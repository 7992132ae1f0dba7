"""Start a command on ``world`` gloo ranks as plain processes with the environment torchrun sets (RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), wait for all of them, and return each rank's exit code and
output; and ``longstraw train`` in one process, for comparison."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

SRC = str(Path(__file__).resolve().parents[1] / "src")


@dataclass
class Rank:
    returncode: int
    stdout: str
    stderr: str


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def base_env(extra: dict | None = None) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(filter(None, [SRC, os.environ.get("PYTHONPATH")])))
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
              "PYTEST_XDIST_WORKER"):
        env.pop(k, None)
    env.update(extra or {})
    return env


def _wait(procs: list, files: list, timeout_s: float, what: str) -> list[Rank]:
    deadline = time.monotonic() + timeout_s
    try:
        for p in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
        logs = "\n".join(f"--- {i}\n{Path(e.name).read_text()[-3000:]}" for i, (_, e) in enumerate(files))
        raise AssertionError(f"{what} did not finish in {timeout_s:.0f} s:\n{logs}") from None
    out = []
    for p, (o, e) in zip(procs, files):
        o.close()
        e.close()
        out.append(Rank(p.returncode, Path(o.name).read_text(), Path(e.name).read_text()))
    return out


def launch(world: int, args: list[str], *, env: dict | None = None, timeout_s: float = 300.0) -> list[Rank]:
    """``python ARGS`` on ``world`` ranks (one thread each) of one job on 127.0.0.1."""
    port = free_port()
    logs = Path(tempfile.mkdtemp(prefix="longstraw-job-"))
    procs, files = [], []
    for rank in range(world):
        e = base_env({**(env or {}), "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                      "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
        o, r = open(logs / f"rank{rank}.out", "w"), open(logs / f"rank{rank}.err", "w")
        files.append((o, r))
        procs.append(subprocess.Popen([sys.executable, *args], env=e, stdout=o, stderr=r))
    return _wait(procs, files, timeout_s, f"job of {world} ranks ({' '.join(args[:4])} ...)")


def run_commands(commands: list[list[str]], *, env: dict | None = None, timeout_s: float = 300.0) -> list[Rank]:
    """Several commands at once (e.g. one torchrun per "node"), each with ``env``; their exit codes and outputs."""
    logs = Path(tempfile.mkdtemp(prefix="longstraw-nodes-"))
    procs, files = [], []
    for i, cmd in enumerate(commands):
        o, r = open(logs / f"cmd{i}.out", "w"), open(logs / f"cmd{i}.err", "w")
        files.append((o, r))
        procs.append(subprocess.Popen(cmd, env=base_env(env), stdout=o, stderr=r))
    return _wait(procs, files, timeout_s, f"{len(commands)} commands ({' '.join(commands[0][:6])} ...)")


def train(world: int, args: list[str], **kw) -> list[Rank]:
    """``python -m longstraw train ARGS`` on ``world`` ranks; ``world=0``: one process without torchrun's
    environment."""
    if world == 0:
        return run_commands([[sys.executable, "-m", "longstraw", "train", *args]], **kw)
    return launch(world, ["-m", "longstraw", "train", *args], **kw)
