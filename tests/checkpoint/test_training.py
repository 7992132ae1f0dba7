"""The run directory: one trainer at a time (flock, released by the kernel when the holder dies), a probe for
writability before anything is written, and damaged checkpoints named with the one to resume from instead."""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longstraw.checkpoint.training import RunDirLock, check_writable, load_trainer_state

SRC = str(Path(__file__).resolve().parents[2] / "src")
HOLD = ("import sys, time\nfrom longstraw.checkpoint.training import RunDirLock\n"
        "lock = RunDirLock(sys.argv[1])\nlock.acquire()\nprint('locked', flush=True)\ntime.sleep(600)\n")


@pytest.mark.slow  # a subprocess holds the lock
def test_a_lock_held_by_another_process_names_its_pid_and_a_killed_holder_leaves_no_stale_lock(tmp_path):
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path)], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONPATH": SRC})
    try:
        assert holder.stdout.readline().strip() == "locked"
        mine = RunDirLock(tmp_path)
        for attempt in (mine.check, mine.acquire):
            with pytest.raises(ValueError, match=rf"run directory '{tmp_path}' is in use by another trainer "
                                                 rf"\(pid {holder.pid} holds .lock\)"):
                attempt()
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    mine.check()  # the kernel released the killed process's lock
    mine.acquire()
    assert (tmp_path / ".lock").read_text().strip() == str(os.getpid())
    other = RunDirLock(tmp_path)
    with pytest.raises(ValueError, match=rf"pid {os.getpid()}"):  # also within one process
        other.acquire()
    mine.release()
    other.acquire()
    other.release()


def test_check_does_not_create_anything(tmp_path):
    RunDirLock(tmp_path / "new").check()
    assert not (tmp_path / "new").exists()


def test_check_writable(tmp_path):
    check_writable(tmp_path / "a" / "b")
    assert (tmp_path / "a" / "b").is_dir() and not list((tmp_path / "a" / "b").iterdir())
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match=r"run directory '.*/f' is a file, not a directory"):
        check_writable(tmp_path / "f")
    with pytest.raises(ValueError, match=r"run directory '.*/f/run' cannot be written: Not a directory"):
        check_writable(tmp_path / "f" / "run")


def test_a_truncated_trainer_state_names_the_checkpoint_and_the_earlier_one(tmp_path):
    for step in (1, 2):
        d = tmp_path / "checkpoints" / f"step-{step:08d}"
        d.mkdir(parents=True)
        torch.save({"step": step, "opt_step": step, "optimizer": {}, "rng": {}}, d / "trainer.pt")
    last = tmp_path / "checkpoints" / "step-00000002"
    (last / "trainer.pt").write_bytes((last / "trainer.pt").read_bytes()[:100])
    with pytest.raises(ValueError, match=r"checkpoint '.*step-00000002' is damaged \(trainer.pt cannot be read: "
                                         r".*\); delete it to resume from the earlier step-00000001"):
        load_trainer_state(last)
    first = tmp_path / "checkpoints" / "step-00000001"
    torch.save({"step": 1}, first / "trainer.pt")
    with pytest.raises(ValueError, match=r"step-00000001' is damaged \(trainer.pt lacks opt_step, optimizer, rng\); "
                                         r"there is no earlier checkpoint"):
        load_trainer_state(first)
