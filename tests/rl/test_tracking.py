"""Metric writers: TensorBoard and Weights & Biases get every step's numeric metrics; W&B asked for but not
installed is one ValueError before anything is written."""

import sys
import time
import types

import pytest

from longstraw.rl.config import RunConfig, apply_overrides
from longstraw.rl.runlog import read_metrics
from longstraw.rl.tracking import log_metrics, make_writers
from longstraw.rl.trainer import Trainer

from test_config_keys import fake_wandb

TINY = ['model.builtin="tiny-dense"', "data.prompt_len=100", "data.max_prompt_len=128", "rollout.group_size=3",
        "rollout.max_new_tokens=3", "algorithm.prefill_chunk=64", "train.plots=false", "train.progress=false",
        "train.tensorboard=false", 'train.memory_check="off"', "train.steps=2"]


def _cfg(out, *extra):
    return apply_overrides(RunConfig(), TINY + [f'train.out_dir="{out}"', *extra])


def test_wandb_gets_each_steps_numeric_metrics(tmp_path, monkeypatch):
    runs = fake_wandb(monkeypatch)
    cfg = _cfg(tmp_path / "run", "train.wandb=true", 'train.wandb_project="proj"', 'train.wandb_mode="offline"')
    Trainer(cfg, resume=False, echo=lambda *_: None).train()
    (run,) = runs
    assert run.kw["project"] == "proj" and run.kw["mode"] == "offline" and run.kw["dir"] == str(tmp_path / "run")
    assert run.kw["config"]["algorithm"]["clip_ratio_low"] == 0.2  # the resolved config, flat as in config.toml
    rows = read_metrics(tmp_path / "run")
    assert [s for s, _ in run.logged] == [1, 2] and run.finished
    for (_, logged), row in zip(run.logged, rows):
        assert "sample" not in logged  # text is not a metric
        assert logged == {k: v for k, v in row.items() if k != "sample"}


def test_wandb_enabled_but_not_installed_is_one_error_before_anything_is_written(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    cfg = _cfg(tmp_path / "run", "train.wandb=true")
    with pytest.raises(ValueError, match=r"train.wandb = true needs the wandb package: pip install wandb") as e:
        Trainer(cfg, resume=False, echo=lambda *_: None)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


@pytest.mark.slow  # wandb runs a service process
def test_wandb_offline_run_with_the_real_package(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    for k, v in {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_CONFIG_DIR": str(tmp_path / "wbcfg"),
                 "WANDB_CACHE_DIR": str(tmp_path / "wbcache"), "WANDB_DATA_DIR": str(tmp_path / "wbdata")}.items():
        monkeypatch.setenv(k, v)
    cfg = _cfg(tmp_path / "run", "train.wandb=true", 'train.wandb_mode="offline"')
    Trainer(cfg, resume=False, echo=lambda *_: None).train()
    files = list((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(files) == 1
    for _ in range(600):  # wandb's service process writes the records after finish() returns: wait up to a minute
        data = files[0].read_bytes()
        if b"reward_mean" in data and b"grad_norm" in data:
            break
        time.sleep(0.1)
    assert b"reward_mean" in data and b"grad_norm" in data  # the logged metric names are in the run's records


def test_tensorboard_writer(tmp_path, monkeypatch):
    """TensorBoard is used when it imports (here a stand-in SummaryWriter) and skipped when it does not."""
    scalars, closed = [], []

    class SummaryWriter:
        def __init__(self, log_dir):
            self.log_dir = log_dir

        def add_scalar(self, k, v, step):
            scalars.append((k, v, step))

        def close(self):
            closed.append(self.log_dir)

    cfg = _cfg(tmp_path / "run", "train.tensorboard=true")
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)
    assert make_writers(cfg, tmp_path / "run") == []  # not installed: metrics.jsonl and the plots have it all
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", types.SimpleNamespace(SummaryWriter=SummaryWriter))
    writers = make_writers(cfg, tmp_path / "run")
    log_metrics(writers, {"step": 3, "loss": 0.5, "sample": "text"})
    for w in writers:
        w.close()
    assert scalars == [("step", 3, 3), ("loss", 0.5, 3)] and closed == [str(tmp_path / "run" / "tensorboard")]
