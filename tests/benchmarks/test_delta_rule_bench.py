"""benchmarks/delta_rule_recompute.py runs end to end at a tiny size: its gradient check, both parts' fresh worker
processes, the summary lines and the JSON. Structure and memory direction only: timings are not checked."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "delta_rule_recompute.py"
TINY = ["--tokens=512", "--heads=4", "--key-heads=2", "--dk=32", "--dv=32", "--prompt-len=512", "--prefill-chunk=256",
        "--response-len=8", "--group=2", "--hidden=64", "--step-heads=4", "--step-key-heads=2", "--step-dk=32"]


@pytest.mark.slow
def test_script_runs_both_parts_and_recompute_holds_less(tmp_path):
    out = tmp_path / "drr.json"
    run = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--json-out", str(out)], capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    text = run.stdout
    assert "max |plain - recompute| = 0" in text
    assert text.count("recompute / plain: peak") == 2
    res = json.loads(out.read_text())
    assert res["gradient_max_abs_diff"] == 0
    op = res["op"]["best"]
    assert "error" not in op["plain"] and "error" not in op["recompute"]
    assert op["recompute"]["held_bytes"] < op["plain"]["held_bytes"] / 4  # states per block vs every intermediate
    step = res["step"]["best"]
    assert step["plain"]["layers"] == ["linear_attn", "linear_attn", "linear_attn", "self_attn"]
    assert all(step[m]["phases"]["prompt_backward"] > 0 for m in ("plain", "recompute"))


def test_bad_parts_are_refused():
    run = subprocess.run([sys.executable, str(SCRIPT), "--parts", "op,steps"], capture_output=True, text=True)
    assert run.returncode == 2 and "--parts takes op and/or step (got ['steps'])" in run.stderr


@pytest.mark.slow
def test_script_runs_the_per_channel_gate(tmp_path):
    """``--gate channel`` (Kimi Delta Attention's decay per key channel): the op part, both methods, the same
    gradients."""
    out = tmp_path / "kda.json"
    run = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--parts", "op", "--gate", "channel", "--json-out",
                          str(out)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr
    assert "a decay per channel" in run.stdout and "max |plain - recompute| = 0" in run.stdout
    op = json.loads(out.read_text())["op"]["best"]
    assert op["recompute"]["held_bytes"] < op["plain"]["held_bytes"] / 4
