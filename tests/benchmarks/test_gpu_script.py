"""The prepared GPU benchmark runs end to end (``--smoke``: tiny model on the CPU), so a lent GPU's minutes are
not spent finding a bug in the script. Its figures on a CPU mean nothing and are not checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_h200.py"


@pytest.mark.slow  # a subprocess running the whole script
def test_gpu_script_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--planner", "--max-step-s", "40",
                           "--budget-s", "60", "--json", str(out)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert res["prefill"]["tokens_per_s"] > 0
    steps = {(r["mode"], r["G"]): r for r in res["steps"]}
    assert set(steps) == {("detached", 2), ("detached", 8), ("exact", 2), ("exact", 8)}
    for r in steps.values():
        assert r["finite"] and r["peak_bytes"] > 0 and r["planned_bytes"] > 0
        assert r["prompt_state_grad_bytes"] > 0 if r["mode"] == "exact" else r["prompt_state_grad_bytes"] == 0
    for mode in ("detached", "exact"):
        longest = res["longest"][mode]
        assert longest["measured_max"] >= 512 and longest["stopped_by"]
    assert "planner vs measured" in proc.stdout
