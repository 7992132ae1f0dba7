"""Every CLI command once, and each bad input: one line on stderr, exit code 2, nothing written is corrupted."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SRC = str(Path(__file__).resolve().parents[1] / "src")
TINY = ["--set", "data.max_prompt_len=512", "--set", "rollout.group_size=4", "--set", "train.plots=true",
        "--set", "train.tensorboard=false", "--set", "algorithm.prefill_chunk=64"]


def cli(*args, cwd=None, timeout=600):
    env = {**os.environ, "PYTHONPATH": SRC}
    return subprocess.run([sys.executable, "-m", "longstraw.cli", *map(str, args)], capture_output=True, text=True,
                          env=env, cwd=cwd, timeout=timeout)


@pytest.fixture(scope="module")
def demo_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "run"
    r = cli("demo", "--steps", 3, "--prompt-len", 200, "--group-size", 4, "--no-progress", "--out", out,
            "--set", "data.max_prompt_len=512", "--set", "algorithm.prefill_chunk=64")
    assert r.returncode == 0, r.stderr
    return out, r.stdout


def test_demo_prints_the_summary(demo_run):
    out, stdout = demo_run
    for line in ("prompt length      200 tokens", "group size G       4", "steps              3", "reward ",
                 "peak memory", "naive full-graph GRPO step", "plots"):
        assert line in stdout
    assert (out / "metrics.jsonl").exists() and (out / "plots" / "reward.png").exists()
    assert json.loads((out / "naive_estimate.json").read_text())["bytes"] > 0  # drawn in plots/memory.png
    assert (out / "checkpoints" / "step-00000003" / "model" / "longstraw_tokenizer.json").exists()


def test_train_with_config_and_overrides_then_plot(tmp_path):
    cfg = tmp_path / "run.toml"
    cfg.write_text('[model]\nbuiltin = "tiny-dense"\n[data]\nprompt_len = 120\nmax_prompt_len = 256\n'
                   '[train]\nsteps = 2\nprogress = false\ntensorboard = false\n')
    r = cli("train", "--config", cfg, "--set", f'train.out_dir="{tmp_path / "run"}"', "--set", "rollout.group_size=3")
    assert r.returncode == 0, r.stderr
    assert "done: 2 steps" in r.stdout
    saved = (tmp_path / "run" / "config.toml").read_text()
    assert "group_size = 3" in saved and 'builtin = "tiny-dense"' in saved
    p = cli("plot", tmp_path / "run")
    assert p.returncode == 0 and "reward.png" in p.stdout


def test_generate_and_score_from_a_checkpoint(demo_run, tmp_path):
    out, _ = demo_run
    model = out / "checkpoints" / "step-00000003" / "model"
    g = cli("generate", "--model", model, "--prompt", "The pass key is 42. The pass key is ", "-n", 2,
            "--max-new-tokens", 5, "--seed", 1, "--json")
    assert g.returncode == 0, g.stderr
    rows = [json.loads(x) for x in g.stdout.splitlines()]
    assert len(rows) == 2 and all(len(x["token_ids"]) == len(x["logprobs"]) <= 5 for x in rows)
    data = tmp_path / "rollouts.jsonl"
    data.write_text(json.dumps({"prompt": "key 7. key ", "responses": ["7", "8"], "rewards": [1, 0]}) + "\n")
    s = cli("score", "--model", model, "--data", data)
    assert s.returncode == 0, s.stderr
    scored = [json.loads(x) for x in s.stdout.splitlines()]
    assert [x["response"] for x in scored] == [0, 1] and all(x["logprob"] < 0 for x in scored)


def test_plan_json(demo_run, tmp_path):
    out, _ = demo_run
    over = cli("plan", "--model", out / "initial_model", "--prompt-len", "64K", "--response-len", 16)
    _one_error_line(over, "needs 65552 positions, more than the model's max_position_embeddings=")
    cfg = json.loads((out / "initial_model" / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "max_position_embeddings": 1 << 20}))
    r = cli("plan", "--model", tmp_path, "--prompt-len", "64K", "--response-len", 16, "--group", 8,
            "--dtype", "float32", "--gpu-mem", "2G", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["peak_bytes"] > d["breakdown"]["prompt_state"] > 0 and d["max_prompt_len"] > 65536 and d["fits"]


def _one_error_line(r, text):
    assert r.returncode == 2, (r.returncode, r.stdout, r.stderr)
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("longstraw: error: ") and text in lines[0], r.stderr


def test_bad_inputs_exit_2_with_one_line(tmp_path):
    base = ["train", "--set", f'train.out_dir="{tmp_path / "r"}"', "--set", "train.progress=false",
            "--set", 'model.builtin="tiny-dense"', "--set", "train.steps=1", "--set", "train.plots=false"]
    _one_error_line(cli(*base, "--set", "rollout.grup_size=4"), "unknown key rollout.grup_size; did you mean "
                                                                "'group_size'?")
    _one_error_line(cli(*base, "--set", "train.steps=many"), "train.steps='many' must be an integer")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": 5}\n')
    _one_error_line(cli(*base, "--set", 'data.task=""', "--set", f'data.path="{bad}"'), "bad.jsonl:2: field 'prompt'")
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"prompt": "x" * 600, "answer": "1"}) + "\n")
    _one_error_line(cli(*base, "--set", 'data.task=""', "--set", f'data.path="{long}"',
                        "--set", "data.max_prompt_len=500", "--set", "data.prompt_len=100"),
                    "prompt 0 has 600 tokens, more than data.max_prompt_len=500")
    _one_error_line(cli(*base, "--set", 'reward.fn="no_such_module_xyz:score"'), "no_such_module_xyz")
    _one_error_line(cli("plot", tmp_path / "nowhere"), "does not exist")
    _one_error_line(cli("generate", "--model", tmp_path / "nowhere", "--prompt", "x"), "does not exist")


def test_resume_from_a_different_config_is_refused_and_nothing_is_touched(tmp_path):
    run = tmp_path / "run"
    args = ["train", "--set", f'train.out_dir="{run}"', "--set", "train.progress=false", "--set", "train.steps=2",
            "--set", 'model.builtin="tiny-dense"', "--set", "data.prompt_len=100", "--set", "data.max_prompt_len=256",
            "--set", "train.plots=false", "--set", "train.tensorboard=false"]
    assert cli(*args).returncode == 0
    before = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    _one_error_line(cli("train", "--resume", run, "--set", "data.seed=9"),
                    "was written by a different config: data.seed: 0 != 9")
    _one_error_line(cli(*args), "already holds a run")
    _one_error_line(cli("train", "--resume", tmp_path / "empty"), "has no config.toml")
    after = {p: p.read_bytes() for p in run.rglob("*") if p.is_file()}
    assert before == after


def test_config_prints_a_commented_default_config_that_train_accepts_unchanged(tmp_path):
    r = cli("config")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("# LongStraw run config") and "\n[algorithm]\n" in r.stdout
    assert "\n# dual clip c (> 1)" in r.stdout and '\nclip_ratio_c = 3.0\n' in r.stdout
    cfg = tmp_path / "run.toml"
    cfg.write_text(r.stdout)  # unchanged; the overrides only make the run tiny
    t = cli("train", "--config", cfg, "--set", f'train.out_dir="{tmp_path / "run"}"',
            "--set", 'model.builtin="tiny-dense"', "--set", "data.prompt_len=100", "--set", "data.max_prompt_len=128", "--set", "train.steps=1",
            "--set", "train.progress=false", "--set", "train.plots=false", "--set", "algorithm.prefill_chunk=64",
            "--set", "rollout.group_size=3", "--set", 'train.memory_check="off"')
    assert t.returncode == 0, t.stderr
    assert "done: 1 steps" in t.stdout
    md = cli("config", "--markdown")
    assert md.returncode == 0 and md.stdout == (Path(__file__).resolve().parents[1] / "docs" / "CONFIG.md").read_text()
