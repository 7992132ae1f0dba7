"""PNG plots of a run from its ``metrics.jsonl``: reward, loss, KL and peak memory against the step."""

from __future__ import annotations

import warnings
from pathlib import Path

from longstraw.rl.runlog import read_metrics

PANELS = (
    ("reward", ("reward_mean", "solved"), "reward (mean) / solved fraction"),
    ("loss", ("loss",), "loss"),
    ("kl", ("kl", "ppo_kl"), "KL to reference / PPO KL (old -> new)"),
    ("memory", ("peak_memory_bytes",), "peak memory (MiB)"),
)


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def plot_run(run_dir: str | Path) -> list[Path]:
    """Write ``RUN/plots/{reward,loss,kl,memory}.png``; returns the paths (empty if matplotlib is missing)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl rows to plot")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        warnings.warn("matplotlib is not installed (pip install longstraw[plot]); no plots written", stacklevel=2)
        return []
    out_dir = run_dir / "plots"
    out_dir.mkdir(exist_ok=True)
    steps = [r["step"] for r in rows]
    paths = []
    window = max(1, len(rows) // 20)
    for name, keys, title in PANELS:
        fig, ax = plt.subplots(figsize=(6, 3.5), dpi=100)
        drawn = False
        for key in keys:
            ys = [r.get(key) for r in rows]
            if all(y is None for y in ys):
                continue
            ys = [float("nan") if y is None else float(y) for y in ys]
            if key.endswith("_bytes"):
                ys = [y / 2**20 for y in ys]
            ax.plot(steps, ys, alpha=0.35, lw=1)
            ax.plot(steps, _smooth(ys, window), lw=2, label=f"{key} (smoothed over {window})")
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        ax.set_xlabel("step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
        fig.tight_layout()
        p = out_dir / f"{name}.png"
        fig.savefig(p)
        plt.close(fig)
        paths.append(p)
    return paths
