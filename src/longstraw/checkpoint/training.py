"""Training checkpoints that survive a crash at any moment.

``RUN/checkpoints/step-00000042/`` holds ``model/`` (an HF checkpoint directory: vLLM or transformers serve it as
is) and ``trainer.pt`` (optimiser and scheduler state, RNG states, step, data position). A checkpoint is written
into ``.tmp-step-...`` beside it, every file fsynced, then the directory is renamed into place and the parent
fsynced: a run killed mid-save leaves the previous complete checkpoint untouched and at worst a ``.tmp-`` directory
that the next save removes. Only the last ``keep_last`` checkpoints are kept.

``trainer.pt`` is our own file, read with ``torch.load(weights_only=True)``: plain containers of tensors and numbers.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
from pathlib import Path

import torch

from longstraw.checkpoint.hf import save_model

_STEP_DIR = re.compile(r"^step-(\d{8})$")
FAULT_ENV = "LONGSTRAW_FAULT"  # "kill-during-save:STEP": SIGKILL this process mid-save (crash-safety tests)


def _fsync_tree(path: Path) -> None:
    for root, _dirs, files in os.walk(path):
        for f in files:
            fd = os.open(os.path.join(root, f), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        _fsync_dir(Path(root))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _maybe_fault(step: int) -> None:
    spec = os.environ.get(FAULT_ENV, "")
    if spec == f"kill-during-save:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def checkpoint_dirs(run_dir: str | Path) -> list[Path]:
    """Complete checkpoints of a run, oldest first."""
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and _STEP_DIR.match(p.name))


def latest_checkpoint(run_dir: str | Path) -> Path | None:
    dirs = checkpoint_dirs(run_dir)
    return dirs[-1] if dirs else None


def save_checkpoint(run_dir: str | Path, step: int, model, trainer_state: dict, *, keep_last: int = 2,
                    extra_files: dict[str, Path] | None = None) -> Path:
    """Write checkpoint ``step`` atomically; returns its directory. ``extra_files``: name -> file copied into
    ``model/`` (tokenizer files, so the model directory is servable on its own)."""
    root = Path(run_dir) / "checkpoints"
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(".tmp-step-*"):
        shutil.rmtree(stale, ignore_errors=True)
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}-{os.getpid()}"
    save_model(model, tmp / "model")
    for name, src in (extra_files or {}).items():
        shutil.copy2(src, tmp / "model" / name)
    torch.save(trainer_state, tmp / "trainer.pt")
    _maybe_fault(step)
    _fsync_tree(tmp)
    if final.exists():  # re-saving the same step (a resumed run reaching it again): replace
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def load_trainer_state(ckpt_dir: str | Path) -> dict:
    p = Path(ckpt_dir) / "trainer.pt"
    if not p.is_file():
        raise ValueError(f"{str(ckpt_dir)!r} is not a LongStraw checkpoint (no trainer.pt)")
    return torch.load(p, map_location="cpu", weights_only=True)


def rng_state() -> dict:
    import random

    st = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1]), "python_pos": random.getstate()[2]}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state_all()
    return st


def set_rng_state(st: dict) -> None:
    import random

    torch.set_rng_state(st["torch"])
    random.setstate((3, tuple(st["python"]), st["python_pos"]))
    if "cuda" in st and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(st["cuda"])
