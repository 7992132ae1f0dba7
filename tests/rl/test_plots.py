"""Run plots: both axes labelled on every panel, memory from 0 with the naive step's estimate dashed, the KL to
the reference drawn only when the loss had it, ppo_kl labelled a diagnostic."""

import json

import pytest

pytest.importorskip("matplotlib")

from matplotlib.figure import Figure  # noqa: E402

from longstraw.rl.plots import NAIVE_LABEL, plot_run, read_naive_estimate  # noqa: E402


def _run(tmp_path, kl_coef):
    run = tmp_path / f"run-{kl_coef}"
    run.mkdir()
    rows = [{"step": i + 1, "reward_mean": 0.1 * i, "solved": 0.0, "loss": 0.5 - 0.01 * i, "ppo_kl": 1e-3,
             "kl": 0.01 * i if kl_coef else None, "peak_memory_bytes": (300 + i) * 2**20,
             "peak_above_start_bytes": (40 + i) * 2**20, "signal_groups": 0.5 if i % 3 else 0.0,
             "sample": "12"} for i in range(30)]
    (run / "metrics.jsonl").write_text("".join(json.dumps({k: v for k, v in r.items() if v is not None}) + "\n"
                                               for r in rows))
    (run / "config.toml").write_text(f"[algorithm]\nkl_coef = {kl_coef}\n[model]\ndevice = \"cuda:7\"\n")
    return run


@pytest.fixture
def figures(monkeypatch):
    """The figures plot_run saves, by file name."""
    saved = {}
    real = Figure.savefig

    def savefig(self, path, *a, **kw):
        saved[path.stem] = self
        return real(self, path, *a, **kw)

    monkeypatch.setattr(Figure, "savefig", savefig)
    return saved


def test_panels_label_both_axes_and_memory_shows_the_naive_estimate(tmp_path, figures):
    run = _run(tmp_path, 0.01)
    paths = plot_run(run, naive_bytes=900 * 2**20)
    assert [p.name for p in paths] == ["reward.png", "solved.png", "signal.png", "loss.png", "kl.png", "memory.png"]
    assert read_naive_estimate(run) == 900 * 2**20  # recorded: `longstraw plot RUN` draws it again
    for name, fig in figures.items():
        (ax,) = fig.axes
        assert ax.get_xlabel() == "step" and ax.get_ylabel(), name
    mem = figures["memory"].axes[0]
    assert mem.get_ylim()[0] == 0 and "MiB" in mem.get_ylabel()
    (naive,) = [ln for ln in mem.get_lines() if ln.get_label().startswith(NAIVE_LABEL)]
    assert naive.get_linestyle() == "--" and naive.get_ydata()[0] == pytest.approx(900)
    labels = [t.get_text() for t in figures["kl"].axes[0].get_legend().get_texts()]
    assert any(x.startswith("kl:") for x in labels) and any("ppo_kl" in x and "diagnostic" in x for x in labels)


def test_kl_to_the_reference_is_drawn_only_when_the_loss_had_it(tmp_path, figures):
    run = _run(tmp_path, 0.0)
    with open(run / "metrics.jsonl", "a") as f:  # even if a kl value were logged, the loss had no KL term
        f.write(json.dumps({"step": 31, "kl": 0.5, "ppo_kl": 1e-3, "reward_mean": 0, "solved": 0, "loss": 0,
                            "peak_memory_bytes": 1}) + "\n")
    plot_run(run)
    labels = [t.get_text() for t in figures["kl"].axes[0].get_legend().get_texts()]
    assert not any(x.startswith("kl:") for x in labels) and any(x.startswith("ppo_kl") for x in labels)
    mem = figures["memory"].axes[0]
    assert not [ln for ln in mem.get_lines() if ln.get_label().startswith(NAIVE_LABEL)]  # none recorded


def test_the_solved_panel_shows_the_demo_evaluation_before_and_after_grpo(tmp_path, figures):
    run = _run(tmp_path, 0.0)
    (run / "demo_summary.json").write_text(json.dumps({"eval_prompts": 32, "solved_before": 0.125,
                                                       "solved_after": 0.5}))
    plot_run(run)
    ax = figures["solved"].axes[0]
    assert ax.get_ylim() == pytest.approx((-0.02, 1.02))
    points = [tuple(c.get_offsets()[0]) for c in ax.collections]
    assert points == [(1, 0.125), (30, 0.5)]
    labels = [t.get_text() for t in ax.get_legend().get_texts()]
    assert any("before GRPO" in x for x in labels) and any("after GRPO" in x for x in labels)
    sig = figures["signal"].axes[0]
    assert "groups" in sig.get_ylabel() and sig.get_xlabel() == "step"
