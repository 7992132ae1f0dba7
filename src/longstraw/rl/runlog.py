"""A run's log: ``RUN/metrics.jsonl`` (one JSON object per step, appended and fsynced), read back by the plots and
the summary, truncated to the last checkpoint on resume; ``RUN/expert_load.jsonl`` beside it for MoE models (per step,
the routed slots of every expert of every MoE layer: too large for a metrics row), kept the same way; and atomic
writes of small text files.

A crash can leave a torn last line; readers stop at the first line that is not JSON (everything before it is
intact, because every complete line was fsynced before the next step began).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

METRICS = "metrics.jsonl"
EXPERT_LOAD = "expert_load.jsonl"


def read_metrics(run_dir: str | Path, name: str = METRICS) -> list[dict]:
    """The complete rows of ``run_dir/metrics.jsonl`` (or of the log ``name``; empty if there is none)."""
    p = Path(run_dir) / name
    if not p.exists():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            break
    return out


def append_metrics(run_dir: str | Path, row: dict, name: str = METRICS) -> None:
    """Append one row (with its ``step``) to the log ``name`` and fsync it (a later crash cannot lose it)."""
    with open(Path(run_dir) / name, "a") as f:
        f.write(json.dumps(row) + "\n")
        f.flush()
        os.fsync(f.fileno())


def truncate_metrics(run_dir: str | Path, upto_step: int, name: str = METRICS) -> None:
    """Keep the rows of steps ``<= upto_step`` of the log ``name`` (resuming from a checkpoint drops what came
    after it)."""
    p = Path(run_dir) / name
    if not p.exists():
        return
    keep = []
    for line in p.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= upto_step:
                keep.append(line)
        except (json.JSONDecodeError, KeyError):
            break  # a torn last line from a crash
    write_atomic(p, "".join(x + "\n" for x in keep))


def write_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temporary file, fsync, rename: readers see the old or the new file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
