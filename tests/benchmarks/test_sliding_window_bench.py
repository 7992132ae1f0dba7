"""benchmarks/sliding_window.py runs end to end at tiny size (its figures are docs/BENCHMARKS.md's): both models
step in both modes, and the windowed state is what ``state.SlidingKVState`` keeps."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import sliding_window  # noqa: E402


def test_runs_and_reports_ratios(tmp_path):
    out = sliding_window.main(["--prompt-lens", "96", "--window", "16", "--chunk", "32", "--hidden", "32",
                               "--layers", "1", "--heads", "2", "--response-len", "8", "--repeats", "1",
                               "--json", str(tmp_path / "r.json")])
    runs = {r["mode"]: r for r in out["runs"]}
    assert set(runs) == {"exact", "detached"} and (tmp_path / "r.json").exists()
    assert runs["exact"]["state_ratio"] == 3 * 15 / 95  # W - 1 positions of each of the 3 chunks, of 95
    assert runs["detached"]["state_ratio"] < runs["exact"]["state_ratio"]
    assert all(r[k]["seconds"] > 0 for r in runs.values() for k in ("window", "full"))


def test_op_mode():
    out = sliding_window.main(["--op-windows", "8,16", "--op-queries", "64", "--op-stored", "96"])
    assert set(out["op"]) == {"full", "8", "16"} and all(v["forward_backward_s"] > 0 for v in out["op"].values())
