"""PNG plots of a run from its ``metrics.jsonl``: reward, solved rate, the fraction of groups with a learning signal,
loss, KL and peak memory against the step, and for a
mixture-of-experts model the expert load (from ``expert_load.jsonl``).

Every panel labels both axes (x: the training step; y: the quantity and its unit) and draws each series raw (faint)
and smoothed. Two panels read more than the metrics:

- KL: ``kl`` (the KL to the frozen reference model, a term of the loss) is drawn only when the run's loss had it
  (``algorithm.kl_coef > 0`` in ``RUN/config.toml``); ``ppo_kl`` (how far one update moved the policy from the one
  that sampled) is a diagnostic and labelled as one.
- solved: with ``RUN/demo_summary.json`` (``longstraw demo``), the greedy solved rate on held-out prompts before
  and after the GRPO phase is drawn as two markers at the first and last step.
- memory: starts at 0; when the run recorded an estimate of a naive full-graph GRPO step
  (``RUN/naive_estimate.json``, written by ``longstraw demo`` through ``plot_run(..., naive_bytes=)``), it is a dashed
  horizontal line beside the measured peaks.
- expert load (MoE models): left, per step, the busiest expert's routed slots over the mean (worst layer and the
  mean over layers; 1 = balanced, what expert parallelism's speed depends on); right, a heat map of every expert's
  share of its layer's slots over the whole run, relative to an even share.
"""

from __future__ import annotations

import json
import textwrap
import warnings
from pathlib import Path

from longstraw.rl.runlog import EXPERT_LOAD, read_metrics

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

NAIVE_ESTIMATE = "naive_estimate.json"
DEMO_SUMMARY = "demo_summary.json"
NAIVE_LABEL = "naive full-graph GRPO step (estimate)"
NAIVE_WHAT = ("peak bytes above the weights of one naive full-graph GRPO step: G x (P + R) tokens through autograd "
              "with logits at every position, at the run's longest prompt (planner dry run)")

# name -> (title, y label, [(metric key, legend label)])
PANELS = {
    "reward": ("reward", "reward / fraction solved (unitless)",
               [("reward_mean", "reward_mean: mean reward of the step's responses"),
                ("solved", "solved: fraction of responses with reward >= 1")]),
    "solved": ("solved rate", "fraction of the step's sampled responses (unitless)",
               [("solved", "solved: fraction of responses with reward >= 1 (sampled, at the training prompt)")]),
    "signal": ("learning signal", "fraction of the step's groups (unitless)",
               [("signal_groups", "groups whose rewards were not all equal (non-zero advantages)")]),
    "loss": ("loss", "loss (unitless; aggregated by loss_agg_mode)", [("loss", "loss: the step's GRPO loss")]),
    "kl": ("KL", "KL (nats per token)",
           [("kl", "kl: KL to the reference model (in the loss, kl_coef > 0)"),
            ("ppo_kl", "ppo_kl: KL(sampling policy -> updated policy), diagnostic only")]),
    "memory": ("peak memory", "peak memory (MiB)",
               [("peak_memory_bytes", "process peak, measured"),
                ("peak_above_start_bytes", "peak above the post-load baseline, measured")]),
}


def _smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _kl_in_loss(run_dir: Path) -> bool | None:
    """Whether the run's loss had a KL term (``algorithm.kl_coef > 0`` in its config.toml); None without one. Read
    as plain TOML, not validated: a run from another machine (e.g. ``model.device = "cuda"``) still plots here."""
    p = run_dir / "config.toml"
    if not p.is_file():
        return None
    try:
        kl_coef = tomllib.loads(p.read_text()).get("algorithm", {}).get("kl_coef", 0.0)
    except tomllib.TOMLDecodeError:
        return None
    return isinstance(kl_coef, (int, float)) and kl_coef > 0


def _demo_evals(run_dir: Path) -> list[tuple[str, float]]:
    """``longstraw demo``'s greedy solved rates at the training length before and after GRPO
    (``RUN/demo_summary.json``), drawn as two markers in the solved panel; empty without that file."""
    p = run_dir / DEMO_SUMMARY
    if not p.is_file():
        return []
    try:
        d = json.loads(p.read_text())
        n = d["eval_prompts"]
        return [(f"greedy, {n} held-out prompts: before GRPO (after warm-up)", float(d["solved_before"])),
                (f"greedy, {n} held-out prompts: after GRPO", float(d["solved_after"]))]
    except (ValueError, KeyError, TypeError):
        return []


def read_naive_estimate(run_dir: str | Path) -> int | None:
    p = Path(run_dir) / NAIVE_ESTIMATE
    if not p.is_file():
        return None
    return int(json.loads(p.read_text())["bytes"])


def write_naive_estimate(run_dir: str | Path, nbytes: int) -> None:
    (Path(run_dir) / NAIVE_ESTIMATE).write_text(json.dumps({"bytes": int(nbytes), "what": NAIVE_WHAT}) + "\n")


def plot_run(run_dir: str | Path, naive_bytes: int | None = None) -> list[Path]:
    """Write ``RUN/plots/{reward,solved,signal,loss,kl,memory}.png``; returns the paths (empty if matplotlib is missing).

    naive_bytes: an estimate of a naive full-graph GRPO step's peak, recorded in ``RUN/naive_estimate.json`` and
    drawn in the memory panel (a recorded one is drawn without it)."""
    run_dir = Path(run_dir)
    rows = read_metrics(run_dir)
    if not rows:
        raise ValueError(f"{str(run_dir)!r} has no metrics.jsonl rows to plot")
    if naive_bytes is not None:
        write_naive_estimate(run_dir, naive_bytes)
    naive = read_naive_estimate(run_dir)
    kl_in_loss = _kl_in_loss(run_dir)
    evals = _demo_evals(run_dir)
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
    for name, (title, ylabel, series) in PANELS.items():
        fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
        drawn = False
        for key, label in series:
            if key == "kl" and kl_in_loss is False:
                continue  # the loss had no KL term
            ys = [r.get(key) for r in rows]
            if all(y is None for y in ys):
                continue
            ys = [float("nan") if y is None else float(y) for y in ys]
            if key.endswith("_bytes"):
                ys = [y / 2**20 for y in ys]
            (line,) = ax.plot(steps, _smooth(ys, window), lw=2,
                              label=_wrap(label + (f" (smoothed over {window} steps)" if window > 1 else "")))
            if window > 1:
                ax.plot(steps, ys, alpha=0.3, lw=1, color=line.get_color())
            drawn = True
        if not drawn:
            plt.close(fig)
            continue
        if name in ("solved", "signal"):
            ax.set_ylim(-0.02, 1.02)
        if name == "solved" and evals:
            for i, (label, v) in enumerate(evals):
                ax.scatter([steps[0] if i == 0 else steps[-1]], [v], marker="D" if i == 0 else "s", s=50,
                           zorder=5, label=_wrap(label))
        if name == "memory":
            if naive is not None:
                ax.axhline(naive / 2**20, ls="--", color="tab:red", lw=1.5, label=f"{NAIVE_LABEL}: "
                           f"{naive / 2**20:,.0f} MiB")
            ax.set_ylim(bottom=0, top=ax.get_ylim()[1] * 1.05)
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        # below the axes, not over the curves: the labels are sentences, and a legend inside covered the data
        ax.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.16), frameon=False)
        p = out_dir / f"{name}.png"
        fig.savefig(p, bbox_inches="tight")  # grows the figure to hold the legend: nothing cut off
        plt.close(fig)
        paths.append(p)
    load = read_metrics(run_dir, EXPERT_LOAD)
    if load:
        paths.append(_plot_expert_load(plt, rows, load, out_dir / "expert_load.png"))
    return paths


def _wrap(label: str, width: int = 90) -> str:
    """A legend label broken into lines of at most ``width`` characters."""
    return textwrap.fill(label, width)


def _plot_expert_load(plt, rows: list[dict], load: list[dict], path: Path) -> Path:
    """The expert-load figure (module docstring) from the metrics rows and the ``expert_load.jsonl`` rows."""
    import numpy as np

    fig, (ax, hx) = plt.subplots(1, 2, figsize=(12, 4), dpi=100, gridspec_kw={"width_ratios": [1, 1.3]})
    steps = [r["step"] for r in rows]
    for key, label in (("expert_load_max_over_mean", "worst layer"),
                       ("expert_load_mean_max_over_mean", "mean over layers")):
        ys = [r.get(key, float("nan")) for r in rows]
        ax.plot(steps, ys, lw=1.5, label=label)
    ax.axhline(1.0, ls="--", color="gray", lw=1, label="balanced")
    ax.set_xlabel("step")
    ax.set_ylabel("busiest expert's slots / mean (unitless)")
    ax.set_title("expert load imbalance per step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    total = np.sum([np.asarray(r["tokens"], dtype=np.float64) for r in load], axis=0)  # [layers, experts]
    share = total / np.maximum(total.mean(axis=1, keepdims=True), 1e-12)
    im = hx.imshow(share, aspect="auto", cmap="viridis", interpolation="nearest")
    from matplotlib.ticker import MaxNLocator

    hx.xaxis.set_major_locator(MaxNLocator(integer=True))
    hx.yaxis.set_major_locator(MaxNLocator(integer=True))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    hx.set_xlabel("expert")
    hx.set_ylabel("MoE layer (in model order)")
    hx.set_title(f"routed slots over {len(load)} steps / layer mean")
    fig.colorbar(im, ax=hx, label="share of the layer's slots / even share")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
