"""benchmarks/deltanet_cp_scan.py runs end to end at tiny size (its figures are docs/BENCHMARKS.md's): both prefixes
timed in both phases, and the saving follows its formula."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import deltanet_cp_scan  # noqa: E402


def test_runs_and_weighs_the_scan_against_the_hand_off():
    out = deltanet_cp_scan.main(["--hidden", "32", "--key-heads", "1", "--value-heads", "2", "--head-dim", "8",
                                 "--piece", "16", "--ranks", "3", "--repeats", "1", "--threads", "1"])
    times = out["times"]
    assert set(times) == {"forward", "forward+backward"}
    assert all(t[k] > 0 for t in times.values() for k in ("plain", "scan"))
    for r, saved in out["saved"].items():
        for phase, x in saved.items():
            t = times[phase]
            assert abs(x - ((r - 1) - 3 * (t["scan"] / t["plain"] - 1))) < 1e-9
