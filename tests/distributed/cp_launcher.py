"""Start ``world`` gloo ranks of cp_worker.py as plain subprocesses with the environment torchrun would set
(RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), wait, and return each rank's results."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

# CP_WORKER: another worker script with the same interface (e.g. one that logs every collective, for debugging)
WORKER = Path(os.environ.get("CP_WORKER", Path(__file__).with_name("cp_worker.py")))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(world: int, *, cp: int, paths: dict, scenarios: list[str], fsdp: bool = False, replicate: int = 1, ep: int = 1,
           ep_shard: bool = True, timeout_s: float = 300.0, collective_timeout_s: float = 120.0) -> list[dict]:
    out = Path(tempfile.mkdtemp(prefix="longstraw-cp-"))
    spec = out / "spec.json"
    spec.write_text(json.dumps({"cp": cp, "fsdp": fsdp, "replicate": replicate, "ep": ep, "ep_shard": ep_shard,
                                "paths": {k: str(v) for k, v in paths.items()},
                                "scenarios": scenarios, "out": str(out),
                                "timeout_s": collective_timeout_s}))
    port = _free_port()
    procs = []
    for rank in range(world):
        env = dict(os.environ, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(Path(__file__).parents[2] / "src"),
                                                            os.environ.get("PYTHONPATH")])))
        env.pop("PYTEST_XDIST_WORKER", None)
        log = open(out / f"rank{rank}.log", "w")
        procs.append((subprocess.Popen([sys.executable, str(WORKER), str(spec)], env=env, stdout=log,
                                       stderr=subprocess.STDOUT), log))
    deadline = time.monotonic() + timeout_s
    try:
        for p, _ in procs:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        for p, _ in procs:
            if p.poll() is None:
                p.kill()
        raise AssertionError(f"CP job (world {world}) did not finish in {timeout_s:.0f} s; logs: {out}") from None
    finally:
        for _, log in procs:
            log.close()
    bad = [(r, p.returncode) for r, (p, _) in enumerate(procs) if p.returncode != 0]
    if bad:
        tail = "\n".join(f"--- rank {r} (exit {rc}) ---\n" + (out / f"rank{r}.log").read_text()[-3000:]
                         for r, rc in bad)
        raise AssertionError(f"CP job (world {world}) failed:\n{tail}")
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(world)]
