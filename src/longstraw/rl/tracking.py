"""Where a run's per-step metrics go besides ``RUN/metrics.jsonl``: TensorBoard and Weights & Biases.

``metrics.jsonl`` is the record (the plots, the summary and resume read it); the writers here copy each step's
numeric metrics into the tools people watch runs in. A writer has ``log(metrics, step)`` and ``close()``.

- TensorBoard (``train.tensorboard``): events in ``RUN/tensorboard`` when the ``tensorboard`` package is installed,
  skipped without it (a convenience: ``metrics.jsonl`` and the PNG plots have the same curves).
- Weights & Biases (``train.wandb``): a W&B run in project ``train.wandb_project`` named after the run directory,
  with the resolved config as its config; ``train.wandb_mode = "offline"`` writes ``RUN/wandb`` only (``wandb sync``
  uploads it later). Asking for it without the ``wandb`` package installed is an error before the run starts
  (:func:`check_tracking`), not a silent gap. A resumed run starts a new W&B run whose steps continue from the
  checkpoint's.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from longstraw.rl.config import RunConfig


class MetricWriter(Protocol):
    def log(self, metrics: dict[str, float], step: int) -> None: ...

    def close(self) -> None: ...


class TensorBoardWriter:
    def __init__(self, log_dir: Path):
        from torch.utils.tensorboard import SummaryWriter

        self._writer = SummaryWriter(str(log_dir))

    def log(self, metrics: dict[str, float], step: int) -> None:
        for k, v in metrics.items():
            self._writer.add_scalar(k, v, step)

    def close(self) -> None:
        self._writer.close()


class WandbWriter:
    def __init__(self, cfg: RunConfig, run_dir: Path):
        wandb = _import_wandb()
        t = cfg.train
        try:
            self._run = wandb.init(project=t.wandb_project, mode=t.wandb_mode.value, dir=str(run_dir),
                                   name=run_dir.name, config=cfg.to_dict())
        except Exception as e:  # wandb raises its own error types (not logged in, no network, ...)
            first = str(e).strip().splitlines()[0] if str(e).strip() else ""
            raise ValueError(f"train.wandb: wandb.init failed ({type(e).__name__}: {first}); run `wandb login`, or "
                             "set train.wandb_mode = \"offline\"") from None

    def log(self, metrics: dict[str, float], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def _import_wandb():
    try:
        import wandb
    except ImportError:
        raise ValueError("train.wandb = true needs the wandb package: pip install wandb (or set train.wandb = "
                         "false)") from None
    return wandb


def check_tracking(cfg: RunConfig) -> None:
    """Before anything is written: a writer the config asks for that cannot work here is a ValueError."""
    if cfg.train.wandb:
        _import_wandb()


def make_writers(cfg: RunConfig, run_dir: str | Path) -> list[MetricWriter]:
    """The writers ``train.tensorboard`` and ``train.wandb`` ask for (TensorBoard only where it is installed)."""
    run_dir = Path(run_dir)
    writers: list[MetricWriter] = []
    if cfg.train.tensorboard:
        try:
            writers.append(TensorBoardWriter(run_dir / "tensorboard"))
        except ImportError:  # tensorboard not installed: metrics.jsonl and the PNG plots still have everything
            pass
    if cfg.train.wandb:
        writers.append(WandbWriter(cfg, run_dir))
    return writers


def log_metrics(writers: list[MetricWriter], row: dict) -> None:
    """Send the numeric values of one ``metrics.jsonl`` row to every writer, at the row's ``step``."""
    numeric = {k: v for k, v in row.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
    for w in writers:
        w.log(numeric, int(row["step"]))


def close_writers(writers: list[MetricWriter]) -> None:
    for w in writers:
        w.close()
