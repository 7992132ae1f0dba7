"""Training checkpoints that survive a crash at any moment.

``RUN/checkpoints/step-00000042/`` holds ``model/`` (an HF checkpoint directory: vLLM or transformers serve it as
is; a LoRA run's holds ``adapter/`` instead, a PEFT adapter directory, the frozen base being where the run started)
and ``trainer.pt`` (optimiser and scheduler state, RNG states, step, data position). A checkpoint is written
into ``.tmp-step-...`` beside it, every file fsynced, then the directory is renamed into place and the parent
fsynced: a run killed mid-save leaves the previous complete checkpoint untouched and at worst a ``.tmp-`` directory
that the next save removes. Only the last ``keep_last`` checkpoints are kept.

A run whose model is FSDP-sharded writes the *sharded* format (:func:`save_sharded_checkpoint`, a collective):
``sharded/`` holds the model's and the optimiser's state as ``torch.distributed.checkpoint`` (DCP) files, each rank
writing its own shards (``__<rank>_0.distcp``; DCP's ``.metadata`` maps every tensor's global shape to the shards);
``model/`` is the same HF export as above, written without gathering the model on one rank
(:func:`longstraw.checkpoint.hf.save_model`); ``trainer.pt`` has ``"format": "sharded"``, no optimiser state, and
the RNG state of every rank (``rng_ranks``). Every rank writes into the same ``.tmp-step-...`` directory; rank 0
renames it once every rank's files are complete (their errors agreed on first:
:mod:`longstraw.distributed.agree`). :func:`load_sharded_state` reads it back into a model and optimiser of any
layout (DCP reshards: another world size, another ``cp``, one process).

``trainer.pt`` is our own file, read with ``torch.load(weights_only=True)``: plain containers of tensors and numbers.
A checkpoint that cannot be read (a disk that filled up, a copy cut short) is one ``ValueError`` naming it and the
checkpoint before it, which ``--resume`` takes once the damaged one is deleted.

One trainer at a time per run directory: :class:`RunDirLock` holds an exclusive ``flock`` on ``RUN/.lock`` while a
trainer writes there. The kernel drops the lock when the process ends in any way (SIGKILL included), so a crashed
run never leaves a stale lock behind; a second trainer is refused with the pid holding it. Before taking the lock,
:func:`check_writable` creates the directory and writes, fsyncs and removes a probe file, so a directory that
cannot be written is refused before anything lands in it.
"""

from __future__ import annotations

import errno
import fcntl
import os
import re
import shutil
import signal
from pathlib import Path

import torch

from longstraw.checkpoint.hf import save_model
from longstraw.distributed.fsdp import reshard

_STEP_DIR = re.compile(r"^step-(\d{8})$")
LOCK_FILE = ".lock"
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
    out = _save_weights(model, tmp)
    for name, src in (extra_files or {}).items():
        shutil.copy2(src, out / name)
    torch.save(trainer_state, tmp / "trainer.pt")
    _maybe_fault(step)
    _publish(tmp, final, run_dir, keep_last)
    return final


def _publish(tmp: Path, final: Path, run_dir: str | Path, keep_last: int) -> None:
    """Make the complete checkpoint ``tmp`` the step's ``final`` directory: fsync it, rename it into place (replacing
    a checkpoint of the same step: a resumed run reaching it again), fsync the parent, keep the last ``keep_last``."""
    _fsync_tree(tmp)
    if final.exists():
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(final.parent)
    for old in checkpoint_dirs(run_dir)[:-keep_last]:
        shutil.rmtree(old, ignore_errors=True)


SHARDED_DIR = "sharded"  # the DCP files of a sharded checkpoint
ADAPTER_DIR = "adapter"  # a LoRA run's checkpoint: its adapters as a PEFT adapter directory (no model/)


def _has_adapters(model) -> bool:
    from longstraw.checkpoint.adapter import lora_settings

    return lora_settings(model) is not None


def _save_weights(model, tmp: Path, dtype: torch.dtype | None = None) -> Path:
    """``tmp/model`` (the HF export, its parameters in ``dtype`` if given) or, for a model with LoRA adapters,
    ``tmp/adapter`` (a PEFT adapter directory; the frozen base is where the run started). A collective on a sharded
    model. Returns the directory."""
    if _has_adapters(model):
        from longstraw.checkpoint.adapter import save_adapter

        save_adapter(model, tmp / ADAPTER_DIR)
        return tmp / ADAPTER_DIR
    save_model(model, tmp / "model", dtype=dtype)
    return tmp / "model"


def _state_options(model, setting: bool = False):
    """DCP state-dict options: a LoRA model's frozen base is not the checkpoint's (only what is trained; setting
    it back is then not strict about the frozen keys, which DCP's ``load`` already checked are all there)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    if not _has_adapters(model):
        return None
    return StateDictOptions(ignore_frozen_params=True, strict=not setting)


def _ep_model(model) -> bool:
    from longstraw.distributed.expert_parallel import ep_modules

    return bool(ep_modules(model))


def _ep_to_dtensors(model, state: dict, split_b: bool = True) -> list:
    """Expert-parallel experts (per-rank tensors, or FSDP's shards of them over edp) described as DTensors, so DCP
    stores each expert once and reads it into any layout, and the experts' LoRA adapters in the checkpoint's layout
    (``lora_B`` as ``[out, r, experts]``, DTensors under expert parallelism; ``split_b``: see ``adapters_to_dcp``).
    Returns what :func:`_ep_to_local` puts back (``longstraw.distributed.expert_parallel``)."""
    from longstraw.distributed.expert_parallel import adapters_to_dcp, ep_state_to_dtensors

    undo = ep_state_to_dtensors(model, state["model"], state.get("optimizer")) if _ep_model(model) else []
    return undo + adapters_to_dcp(model, state["model"], state.get("optimizer"), split_b=split_b)


def _ep_to_local(model, state: dict, undo: list) -> None:
    """After DCP has read into them, the inverse of :func:`_ep_to_dtensors`: the entries the state dicts had (the
    model's own shapes, this rank's parts), as ``set_model_state_dict`` / ``set_optimizer_state_dict`` expect."""
    from longstraw.distributed.expert_parallel import restore_entries

    restore_entries(undo)


def _split_b(model, reader) -> bool:
    """Whether the checkpoint holds the expert adapters' ``lora_B`` as ``[out, r, experts]`` (every checkpoint
    written since that layout; ``[out, r * experts]`` before)."""
    from longstraw.distributed.expert_parallel import expert_adapter_tensors

    names = [n for n, (_, which, _) in expert_adapter_tensors(model).items() if which == "lora_B"]
    if not names:
        return True
    size = getattr(reader.read_metadata().state_dict_metadata.get(f"model.{names[0]}"), "size", None)
    return size is None or len(size) == 3


def _dcp_error(what: str, e: BaseException) -> ValueError:
    """A ``CheckpointException`` (DCP's error on every rank) as one line naming the first failing rank's error."""
    import traceback

    failures = getattr(e, "failures", None) or {}
    for rank, (exc, _trace) in sorted(failures.items()):
        line = "".join(traceback.format_exception_only(type(exc), exc)).strip().splitlines()[-1]
        return ValueError(f"{what}: rank {rank}: {line}")
    return ValueError(f"{what}: {e}")


def save_sharded_checkpoint(run_dir: str | Path, step: int, model, optimizer, trainer_state: dict, *,
                            keep_last: int = 2, extra_files: dict[str, Path] | None = None,
                            export_dtype: torch.dtype | None = None) -> Path:
    """Write checkpoint ``step`` of an FSDP-sharded ``model`` and its ``optimizer`` in the sharded format (module
    doc), atomically. A collective: every rank calls it with the same arguments; ``trainer_state`` is rank 0's to
    write (give it the RNG states of all ranks). Returns the checkpoint's directory on every rank.

    ``export_dtype``: the dtype of ``model/``, the HF export beside the DCP state (a run's compute dtype: the float32
    master weights are in the DCP state, which is what a resume reads, so the export is for serving)."""
    from torch.distributed.checkpoint import FileSystemWriter, save
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_optimizer_state_dict

    from longstraw.distributed.agree import JobError, together

    root = Path(run_dir) / "checkpoints"
    final = root / f"step-{step:08d}"
    tmp = root / f".tmp-step-{step:08d}"  # one name for every rank
    with together(main_only=True) as mine:
        if mine:
            root.mkdir(parents=True, exist_ok=True)
            for stale in root.glob(".tmp-step-*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp.mkdir()
    has_optimizer_state = bool(optimizer.state)  # before the first step there is none: nothing to save
    reshard(model)  # the optimiser's (sharded) parameters registered, whatever ran last
    opts = _state_options(model)
    state = {"model": get_model_state_dict(model, options=opts)}
    if has_optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=opts)
    _ep_to_dtensors(model, state)
    try:
        save(state, storage_writer=FileSystemWriter(tmp / SHARDED_DIR))  # each rank its shards; fsynced
    except CheckpointException as e:
        raise JobError(str(_dcp_error(f"cannot write {tmp / SHARDED_DIR}", e))) from None
    del state
    out = _save_weights(model, tmp, export_dtype)  # the HF export (or adapters), by all ranks, no gather on one
    with together(main_only=True) as mine:
        if mine:
            for name, src in (extra_files or {}).items():
                shutil.copy2(src, out / name)
            torch.save({**trainer_state, "format": "sharded", "optimizer_state": has_optimizer_state},
                       tmp / "trainer.pt")
    _maybe_fault(step)  # every rank: the job dies with the checkpoint complete but not yet renamed
    with together(main_only=True) as mine:
        if mine:
            _publish(tmp, final, run_dir, keep_last)
    return final


def load_sharded_state(ckpt_dir: str | Path, model, optimizer, *, optimizer_state: bool = True) -> None:
    """Read a sharded checkpoint's model and (``optimizer_state``) optimiser state into ``model`` and ``optimizer``,
    whatever their layout now: FSDP over another number of ranks, or no sharding at all (one process). A collective
    when a process group is active. ValueError naming the checkpoint if it cannot be read."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    where = Path(ckpt_dir) / SHARDED_DIR
    reshard(model)
    opts = _state_options(model)
    state = {"model": get_model_state_dict(model, options=opts)}
    if optimizer_state:
        state["optimizer"] = get_optimizer_state_dict(model, optimizer, options=opts)
    reader = FileSystemReader(where)
    try:
        undo = _ep_to_dtensors(model, state, split_b=_split_b(model, reader))
    except ValueError as e:  # an old layout this run cannot read
        raise ValueError(f"checkpoint {str(ckpt_dir)!r}: {e}") from None
    except OSError as e:  # no readable .metadata
        raise damaged_checkpoint(ckpt_dir, f"{SHARDED_DIR}: {e}") from None
    try:
        with warnings.catch_warnings():  # one process: DCP says it assumes so
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            load(state, storage_reader=reader)
    except CheckpointException as e:
        raise damaged_checkpoint(ckpt_dir, str(_dcp_error(SHARDED_DIR, e))) from None
    _ep_to_local(model, state, undo)
    set_opts = _state_options(model, setting=True)
    set_model_state_dict(model, state["model"], options=set_opts)
    if optimizer_state:
        set_optimizer_state_dict(model, optimizer, state["optimizer"], options=set_opts)


def load_full_optimizer_state(model, optimizer, state: dict) -> None:
    """Load a one-process optimiser state (``optimizer.state_dict()`` of the same parameters, made in the same
    order) into ``optimizer`` over the FSDP-sharded ``model``: its full tensors are cut into this rank's shards (and,
    under expert parallelism, into this rank's experts and their adapters' parts)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    if not state.get("state"):  # saved before the first optimiser step: nothing to load (and nothing to create)
        return
    reshard(model)
    names = {p: n for n, p in model.named_parameters()}
    order = [names[p] for g in optimizer.param_groups for p in g["params"]]
    state_of = {order[int(i)]: v for i, v in state["state"].items()}
    if _ep_model(model):  # expert-parallel parameters are this rank's part (plain tensors, which the loader below
        # takes as they come): their state cut to the same part
        from longstraw.distributed.expert_parallel import ep_local_parts

        for name, (shape, part) in ep_local_parts(model).items():
            if name in state_of:
                state_of[name] = {k: part(v).clone() if isinstance(v, torch.Tensor) and tuple(v.shape) == shape
                                  else v for k, v in state_of[name].items()}
    groups = [{**g, "params": [order[int(i)] for i in g["params"]]} for g in state["param_groups"]]
    set_optimizer_state_dict(model, optimizer, {"state": state_of, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


def damaged_checkpoint(ckpt_dir: str | Path, detail: str) -> ValueError:
    """The error for a checkpoint that cannot be read: names it, and the earlier one ``--resume`` would take once
    this one is deleted (or says there is none)."""
    ckpt = Path(ckpt_dir)
    earlier = [d for d in checkpoint_dirs(ckpt.parent.parent) if d.name < ckpt.name]
    then = (f"delete it to resume from the earlier {earlier[-1].name}" if earlier else
            "there is no earlier checkpoint: delete it and start the run again")
    return ValueError(f"checkpoint {str(ckpt)!r} is damaged ({detail}); {then}")


TRAINER_STATE_KEYS = ("step", "opt_step", "optimizer", "rng")


def load_trainer_state(ckpt_dir: str | Path) -> dict:
    p = Path(ckpt_dir) / "trainer.pt"
    if not p.is_file():
        raise ValueError(f"{str(ckpt_dir)!r} is not a LongStraw checkpoint (no trainer.pt)")
    try:
        st = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated zip, garbage, a type weights_only refuses
        msg = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
        raise damaged_checkpoint(ckpt_dir, f"trainer.pt cannot be read: {type(e).__name__}: {msg}") from None
    sharded = isinstance(st, dict) and st.get("format") == "sharded"
    keys = [k for k in TRAINER_STATE_KEYS if not (sharded and k == "optimizer")]  # sharded: in sharded/
    missing = [k for k in keys if not isinstance(st, dict) or k not in st]
    if missing:
        raise damaged_checkpoint(ckpt_dir, f"trainer.pt lacks {', '.join(missing)}")
    if sharded and not (Path(ckpt_dir) / SHARDED_DIR / ".metadata").is_file():
        raise damaged_checkpoint(ckpt_dir, f"{SHARDED_DIR}/.metadata is missing")
    return st


# ---------------------------------------------------------------------------------------------- the run directory


def check_writable(run_dir: str | Path) -> None:
    """Create ``run_dir`` (and its parents) and write, fsync and remove a probe file in it; a ValueError naming the
    directory and the reason if any of that fails (read-only file system, a path under a regular file, a full
    disk, no permission)."""
    p = Path(run_dir)
    if p.exists() and not p.is_dir():
        raise ValueError(f"run directory {str(p)!r} is a file, not a directory")
    probe = p / f".write-probe-{os.getpid()}"
    try:
        p.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:
            f.write(b"\0" * 4096)
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        where = f" ({e.filename})" if e.filename and str(e.filename) not in (str(p), str(probe)) else ""
        raise ValueError(f"run directory {str(p)!r} cannot be written: {e.strerror or e}{where}") from None


class RunDirLock:
    """An exclusive ``flock`` on ``RUN/.lock``, held by the one trainer writing ``RUN`` (see the module doc).

    :meth:`check` tells, without creating or writing anything, whether another process holds it; :meth:`acquire`
    takes it (creating the lock file; the directory must exist) and records this pid in it; :meth:`release` lets
    go (the file stays: removing a lock file races with a process that has just opened it).
    """

    def __init__(self, run_dir: str | Path):
        self.run_dir = Path(run_dir)
        self.path = self.run_dir / LOCK_FILE
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        return self._fd is not None

    def _busy(self) -> ValueError:
        try:
            pid = self.path.read_text().strip() or "unknown"
        except OSError:
            pid = "unknown"
        return ValueError(f"run directory {str(self.run_dir)!r} is in use by another trainer (pid {pid} holds "
                          f"{LOCK_FILE}); wait for it to finish or stop it, or choose another train.out_dir")

    def check(self) -> None:
        """ValueError naming the holder's pid if another trainer holds the lock; nothing is written."""
        if self.held:
            return
        try:
            fd = os.open(self.path, os.O_RDONLY)
        except OSError:
            return  # no lock file (or unreadable): nobody to wait for
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._busy() from None
            raise
        finally:
            os.close(fd)  # closing the descriptor also drops a lock this check took

    def acquire(self) -> None:
        if self.held:
            return
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise self._busy() from None
            raise
        try:
            os.ftruncate(fd, 0)
            os.write(fd, f"{os.getpid()}\n".encode())
        except OSError:
            os.close(fd)
            raise
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)  # drops the flock

    def __del__(self):
        self.release()


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
