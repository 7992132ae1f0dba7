"""Every CLI command once, and each bad input: one line on stderr, exit code 2, nothing written is corrupted."""

import json
import re
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
            "--warmup-steps", 5, "--eval-prompts", 2, "--set", "data.max_prompt_len=512",
            "--set", "algorithm.prefill_chunk=64")
    assert r.returncode == 0, r.stderr
    return out, r.stdout


@pytest.mark.slow  # runs the demo in a subprocess
def test_demo_prints_the_summary(demo_run):
    out, stdout = demo_run
    for line in ("prompt length      200 tokens", "group size G       4", "steps              3 in ", "reward ",
                 "warm-up            5 supervised steps", "steps with a learning signal: ", " of 3 ",
                 "exactly solved: ", "held-out evaluation", "peak memory", "naive full-graph GRPO step", "plots"):
        assert line in stdout
    assert re.search(r"exactly solved: \d+% -> \d+%", stdout)
    table = stdout[stdout.index("held-out evaluation"):].splitlines()[2:5]
    assert [x.split()[:2] for x in table] == [["200", "2"], ["800", "2"], ["3,200", "2"]]
    summary = json.loads((out / "demo_summary.json").read_text())
    assert summary["grpo_steps"] == 3 and 0 <= summary["signal_steps"] <= 3 and len(summary["eval"]) == 3
    assert summary["solved_before"] == summary["eval"][0]["before"]
    for name in ("reward", "solved", "signal", "memory"):
        assert (out / "plots" / f"{name}.png").exists()
    assert (out / "metrics.jsonl").exists() and (out / "warmup_model" / "config.json").exists()
    assert json.loads((out / "naive_estimate.json").read_text())["bytes"] > 0  # drawn in plots/memory.png
    assert (out / "checkpoints" / "step-00000003" / "model" / "longstraw_tokenizer.json").exists()


@pytest.mark.slow  # runs the CLI in subprocesses
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


@pytest.mark.slow  # runs the CLI in subprocesses
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


@pytest.mark.slow  # runs the CLI in subprocesses
def test_plan_json(demo_run, tmp_path):
    out, _ = demo_run
    over = cli("plan", "--model", out / "warmup_model", "--prompt-len", "64K", "--response-len", 16)
    _one_error_line(over, "needs 65552 positions, more than the model's max_position_embeddings=")
    cfg = json.loads((out / "warmup_model" / "config.json").read_text())
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


@pytest.mark.slow  # runs the CLI in subprocesses
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
    _one_error_line(cli("demo", "--warmup-until", "1.5", "--out", tmp_path / "d"),
                    "--warmup-until=1.5 must be a fraction in [0, 1]")
    _one_error_line(cli("generate", "--model", tmp_path / "nowhere", "--prompt", "x"), "does not exist")


@pytest.mark.slow  # runs the CLI in subprocesses
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


@pytest.mark.slow  # runs the CLI in subprocesses
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


# ------------------------------------------------------------------------ user mistakes: one line, exit 2, no debris

DENSE = ["--set", "train.progress=false", "--set", 'model.builtin="tiny-dense"', "--set", "data.prompt_len=100",
         "--set", "data.max_prompt_len=256", "--set", "train.plots=false", "--set", "train.tensorboard=false",
         "--set", "rollout.group_size=2", "--set", "rollout.max_new_tokens=2", "--set", "algorithm.prefill_chunk=64"]


def _files(root):
    return {p: p.read_bytes() for p in Path(root).rglob("*") if p.is_file()}


@pytest.fixture(scope="module")
def dense_run(tmp_path_factory):
    """A finished 2-step run with checkpoints after steps 1 and 2."""
    run = tmp_path_factory.mktemp("dense") / "run"
    r = cli("train", *DENSE, "--set", f'train.out_dir="{run}"', "--set", "train.steps=2", "--set", "train.save_every=1")
    assert r.returncode == 0, r.stderr
    return run


def _copy_run(run, tmp_path):
    import shutil

    return Path(shutil.copytree(run, tmp_path / "copy"))


@pytest.mark.slow  # runs the CLI in subprocesses
def test_an_unknown_option_prints_the_subcommands_usage():
    r = cli("train", "--steps", 5)
    assert r.returncode == 2
    assert r.stderr.startswith("usage: longstraw train "), r.stderr
    assert "longstraw train: error: unrecognized arguments: --steps 5" in r.stderr


def test_every_option_has_help_that_states_its_default():
    import argparse

    from longstraw.cli import _HelpFormatter, build_parser

    ap = build_parser()
    subs = next(a for a in ap._actions if isinstance(a, argparse._SubParsersAction)).choices
    assert set(subs) >= {"demo", "train", "generate", "score", "plot", "plan"}
    fmt = _HelpFormatter("longstraw")
    for name, sp in subs.items():
        for a in sp._actions:
            if isinstance(a, argparse._HelpAction):
                continue
            text = fmt._get_help_string(a)
            assert text, f"longstraw {name} {a.option_strings or a.dest}: no help"
            if a.option_strings and not a.required:
                assert "default" in text, f"longstraw {name} {a.option_strings}: the help does not state the default"
        sp.format_help()  # every help string formats


@pytest.mark.slow  # runs the CLI in subprocesses
def test_resuming_a_finished_run_says_so(dense_run):
    before = _files(dense_run)
    _one_error_line(cli("train", "--resume", dense_run),
                    f"run '{dense_run}' finished its 2 steps; raise train.steps (e.g. --set train.steps=4) to continue")
    assert _files(dense_run) == before


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_damaged_checkpoint_names_it_and_the_earlier_one(dense_run, tmp_path):
    run = _copy_run(dense_run, tmp_path)
    state = run / "checkpoints" / "step-00000002" / "trainer.pt"
    state.write_bytes(state.read_bytes()[:200])
    before = _files(run)
    _one_error_line(cli("train", "--resume", run, "--set", "train.steps=3"),
                    f"checkpoint '{run}/checkpoints/step-00000002' is damaged (trainer.pt cannot be read")
    assert "delete it to resume from the earlier step-00000001" in cli("train", "--resume", run).stderr
    assert _files(run) == before
    import shutil

    shutil.copy(dense_run / "checkpoints" / "step-00000002" / "trainer.pt", state)
    weights = run / "checkpoints" / "step-00000002" / "model" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    _one_error_line(cli("train", "--resume", run, "--set", "train.steps=3"),
                    "step-00000002' is damaged (model/: ")
    shutil.rmtree(run / "checkpoints" / "step-00000002")  # what the message says to do
    r = cli("train", "--resume", run)
    assert r.returncode == 0, r.stderr
    assert "resuming" in r.stdout and "from step-00000001 (step 1)" in r.stdout


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_second_trainer_on_a_run_directory_is_refused_and_a_killed_ones_lock_is_not_stale(tmp_path):
    import signal
    import time

    run = tmp_path / "run"
    env = {**os.environ, "PYTHONPATH": SRC}
    first = subprocess.Popen([sys.executable, "-m", "longstraw.cli", "train", *DENSE, "--set", f'train.out_dir="{run}"',
                              "--set", "train.steps=100000", "--set", "train.save_every=1"], env=env,
                             stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        while not list((run / "checkpoints").glob("step-*")):  # the test's timeout bounds this wait
            assert first.poll() is None, first.stderr.read()
            time.sleep(0.2)
        for args in (["--resume", run], [*DENSE, "--set", f'train.out_dir="{run}"']):
            r = cli("train", *args)
            _one_error_line(r, f"run directory '{run}' is in use by another trainer (pid {first.pid} holds .lock)")
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait()
    # the kernel dropped the killed trainer's lock: resuming works (one more step past its last checkpoint)
    from longstraw.checkpoint.training import checkpoint_dirs

    last = int(checkpoint_dirs(run)[-1].name.split("-")[1])
    r = cli("train", "--resume", run, "--set", f"train.steps={last + 1}")
    assert r.returncode == 0, r.stderr
    assert f"done: {last + 1} steps" in r.stdout


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_run_directory_that_cannot_be_written_is_refused_before_anything_is_written(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("a regular file")
    _one_error_line(cli("train", *DENSE, "--set", f'train.out_dir="{blocker}/run"'),
                    f"run directory '{blocker}/run' cannot be written: Not a directory")
    assert blocker.read_text() == "a regular file"


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_read_only_run_directory_is_refused():
    # tests run as root here, where chmod does not stop writes; sysfs refuses new files even to root
    ro = Path("/sys/kernel")
    try:
        (ro / "longstraw-probe").write_text("x")
    except OSError:
        pass
    else:
        (ro / "longstraw-probe").unlink()
        pytest.skip("/sys/kernel is writable here")
    if not ro.is_dir():
        pytest.skip("no /sys/kernel")
    _one_error_line(cli("train", *DENSE, "--set", f'train.out_dir="{ro}"'), f"run directory '{ro}' cannot be written: ")


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_missing_model_path_is_blamed_on_model_path(tmp_path):
    _one_error_line(cli("train", *DENSE, "--set", f'train.out_dir="{tmp_path / "r"}"',
                        "--set", f'model.path="{tmp_path / "nonexistent"}"'),
                    f"model.path='{tmp_path / 'nonexistent'}' is not a directory")
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # runs the CLI in subprocesses
def test_rows_without_the_answer_key_are_refused(tmp_path):
    data = tmp_path / "rows.jsonl"
    data.write_text(json.dumps({"prompt": "What is 2+2? ", "target": "4"}) + "\n")
    r = cli("train", *DENSE, "--set", f'train.out_dir="{tmp_path / "r"}"', "--set", 'data.task=""',
            "--set", f'data.path="{data}"', "--set", "train.steps=1")
    _one_error_line(r, f"{data}:1: the answer 'answer' is missing (the answer key, set by data.answer_key")
    assert "the row has: 'prompt', 'target'" in r.stderr
    assert not (tmp_path / "r").exists()


@pytest.mark.slow  # runs the CLI in subprocesses
def test_devices_damaged_and_absurd_checkpoints_in_generate_and_score(dense_run, tmp_path):
    import shutil

    import torch

    model = dense_run / "checkpoints" / "step-00000002" / "model"
    data = tmp_path / "rollouts.jsonl"
    data.write_text(json.dumps({"prompt": "key 7. key ", "responses": ["7"], "rewards": [1]}) + "\n")
    if not torch.cuda.is_available():
        _one_error_line(cli("generate", "--model", model, "--prompt", "x", "--device", "cuda"), "--device='cuda': ")
        _one_error_line(cli("score", "--model", model, "--data", data, "--device", "cuda:3"), "--device='cuda:3': ")
    _one_error_line(cli("generate", "--model", model, "--prompt", "x", "--device", "gpu0"),
                    "--device='gpu0' is not a device name; available here: cpu")
    cut = Path(shutil.copytree(model, tmp_path / "cut"))
    w = cut / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    _one_error_line(cli("generate", "--model", cut, "--prompt", "x"),
                    f"{w}: cannot read the weights, the file is damaged or truncated")
    w.write_bytes(os.urandom(4096))
    _one_error_line(cli("score", "--model", cut, "--data", data), f"{w}: cannot read the weights")
    huge = Path(shutil.copytree(model, tmp_path / "huge"))
    cfg = json.loads((huge / "config.json").read_text())
    cfg["vocab_size"] = 10**12
    (huge / "config.json").write_text(json.dumps(cfg))
    _one_error_line(cli("generate", "--model", huge, "--prompt", "x"), "parameters need ")


@pytest.mark.slow  # runs the CLI in subprocesses
def test_score_out_validates_first_and_replaces_the_file_whole(dense_run, tmp_path):
    model = dense_run / "checkpoints" / "step-00000002" / "model"
    out = tmp_path / "scores.jsonl"
    out.write_text("precious\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"prompt": "p", "responses": ["a"], "rewards": [1]}) + "\n" + '{"prompt": 5}\n')
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"prompt": "key 7. key ", "responses": ["7", "8"], "rewards": [1, 0]}) + "\n")
    _one_error_line(cli("score", "--model", model, "--data", bad, "--out", out), "bad.jsonl:2: field 'prompt'")
    _one_error_line(cli("score", "--model", tmp_path / "nowhere", "--data", good, "--out", out), "does not exist")
    assert out.read_text() == "precious\n"
    _one_error_line(cli("score", "--model", model, "--data", good, "--out", tmp_path / "no" / "dir" / "x.jsonl"),
                    f"--out '{tmp_path}/no/dir/x.jsonl': directory '{tmp_path}/no/dir' does not exist")
    r = cli("score", "--model", model, "--data", good, "--out", out)
    assert r.returncode == 0, r.stderr
    assert [json.loads(x)["response"] for x in out.read_text().splitlines()] == [0, 1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bad.jsonl", "good.jsonl", "scores.jsonl"]


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_non_utf8_prompt_file_is_named(tmp_path):
    f = tmp_path / "prompt.txt"
    f.write_bytes(b"line one\ncaf\xe9\n")
    _one_error_line(cli("generate", "--model", tmp_path, "--prompt-file", f),
                    f"prompt file '{f}' is not UTF-8 text (byte 0xe9 on line 2)")


@pytest.mark.slow  # runs the CLI in subprocesses
def test_save_model_then_generate_from_the_saved_directory(dense_run, tmp_path):
    out = tmp_path / "out"
    code = ("import sys, longstraw; m = longstraw.load_model(sys.argv[1]); longstraw.save_model(m, sys.argv[2])")
    r = subprocess.run([sys.executable, "-c", code, str(dense_run / "initial_model"), str(out)], capture_output=True,
                       text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=300)
    assert r.returncode == 0, r.stderr
    g = cli("generate", "--model", out, "--prompt", "The pass key is 42. The pass key is ", "--max-new-tokens", 3,
            "--seed", 0, "--json")
    assert g.returncode == 0, g.stderr
    assert len(json.loads(g.stdout)["token_ids"]) <= 3


@pytest.mark.slow  # runs the CLI in subprocesses
def test_generate_with_a_lora_adapter(dense_run, tmp_path):
    """--adapter applies a PEFT adapter directory to --model: other samples than the base with a nonzero B; a missing
    adapter directory is one line."""
    code = ("import sys, torch, longstraw; m = longstraw.load_model(sys.argv[1]);"
            "longstraw.add_lora(m, 4, 8, 'all-linear', seed=0);"
            "[p.data.normal_(0, 2.0) for n, p in m.named_parameters() if n.endswith('lora_B.weight')];"
            "longstraw.save_adapter(m, sys.argv[2])")
    adapter = tmp_path / "adapter"
    r = subprocess.run([sys.executable, "-c", code, str(dense_run / "initial_model"), str(adapter)],
                       capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=300)
    assert r.returncode == 0, r.stderr
    args = ["generate", "--model", dense_run / "initial_model", "--prompt", "The pass key is ", "--max-new-tokens", 6,
            "-n", 2, "--seed", 0, "--json"]
    base, adapted = cli(*args), cli(*args, "--adapter", adapter)
    assert base.returncode == 0 and adapted.returncode == 0, adapted.stderr
    rows = [[json.loads(line) for line in out.stdout.splitlines() if line.strip()] for out in (base, adapted)]
    assert len(rows[0]) == len(rows[1]) == 2 and rows[0] != rows[1]
    bad = cli(*args, "--adapter", tmp_path / "nope")
    _one_error_line(bad, "is not a PEFT adapter directory")


@pytest.mark.slow  # runs the CLI in subprocesses
def test_a_tokenizer_of_the_checkpoints_own_code_needs_trust_remote_code(dense_run, tmp_path):
    """A checkpoint whose tokenizer is its own code (Kimi's layout, ``tests/custom_tokenizer.py``): generate refuses
    it with one line naming ``--trust-remote-code`` and samples with the flag."""
    import shutil

    from custom_tokenizer import write_char_tokenizer

    d = tmp_path / "model"
    d.mkdir()
    for f in (dense_run / "initial_model").iterdir():
        if f.name == "config.json" or f.suffix == ".safetensors":
            shutil.copy(f, d / f.name)
    write_char_tokenizer(d)
    args = ["generate", "--model", d, "--prompt", "the pass key is ", "--max-new-tokens", 3, "--seed", 0, "--json"]
    _one_error_line(cli(*args), "(tokenization_chars.py, named by tokenizer_config.json's auto_map)")
    g = cli(*args, "--trust-remote-code")
    assert g.returncode == 0, g.stderr
    assert 1 <= len(json.loads(g.stdout)["token_ids"]) <= 3


def test_an_os_error_that_reaches_main_is_one_line(monkeypatch, capsys):
    import errno

    from longstraw import cli as cli_mod

    def full(args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "/runs/x/metrics.jsonl")

    monkeypatch.setattr(cli_mod, "cmd_plot", full)
    assert cli_mod.main(["plot", "/runs/x"]) == 2
    assert capsys.readouterr().err == "longstraw: error: /runs/x/metrics.jsonl: No space left on device\n"
