"""examples/: every run config loads (and explains each key it sets), the ones that need no checkpoint train a step,
python_api.py runs to completion and is the README's "Use it from Python" snippet."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longstraw.rl.config import apply_overrides, config_from_dict, load_config, tomllib
from longstraw.rl.runlog import read_metrics
from longstraw.rl.trainer import Trainer

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
TOMLS = sorted(EXAMPLES.glob("*.toml"))
QUICK = ["train.steps=1", "train.progress=false", "train.plots=false", "train.tensorboard=false"]


def test_the_examples_are_there():
    assert {p.name for p in TOMLS} >= {"passkey_tiny.toml", "prompts_hf.toml", "offline_rollouts.toml",
                                       "my_reward.toml", "long_context_gpu.toml", "gpt_oss_lora.toml"}
    assert (EXAMPLES / "my_reward.py").is_file() and (EXAMPLES / "python_api.py").is_file()


def load_here(path: Path):
    """The example's config as this machine can hold it: a CUDA device where there is none is the config's one-line
    error, then checked with model.device = "cpu" (everything else validated as written)."""
    raw = tomllib.loads(path.read_text())
    device = raw.get("model", {}).get("device", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        with pytest.raises(ValueError, match=rf"model.device='{device}'"):
            load_config(path)
        raw["model"]["device"] = "cpu"
        return config_from_dict(raw)
    return load_config(path)


@pytest.mark.parametrize("path", TOMLS, ids=lambda p: p.name)
def test_every_example_loads_and_comments_every_key_it_sets(path, monkeypatch):
    monkeypatch.chdir(ROOT)  # data paths are relative to the repository root
    cfg = load_here(path)
    if cfg.model.path:
        assert cfg.model.path.startswith("path/to/")  # a placeholder for the user's checkpoint, said so
    if cfg.data.path:
        assert Path(cfg.data.path).is_file()
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if re.match(r"[A-Za-z_]+\s*=", line):
            assert "#" in line, f"{path.name}:{n}: {line!r} has no comment"


def _train(cfg, tmp_path, *overrides):
    cfg = apply_overrides(cfg, QUICK + [f'train.out_dir="{tmp_path / "run"}"', *overrides])
    Trainer(cfg, resume=False, echo=lambda *_: None).train()
    return read_metrics(tmp_path / "run")


def test_the_builtin_passkey_example_trains_a_step(tmp_path):
    rows = _train(load_config(EXAMPLES / "passkey_tiny.toml"), tmp_path)
    assert len(rows) == 1 and rows[0]["prompt_len"] > 4000 and rows[0]["active_groups"] >= 0


def test_the_user_reward_example_trains_a_step(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)  # reward.fn = "examples/my_reward.py:score"
    rows = _train(load_config(EXAMPLES / "my_reward.toml"), tmp_path, "data.prompt_len=256")
    assert len(rows) == 1 and rows[0]["reward_errors"] == 0


@pytest.mark.parametrize("name", ["offline_rollouts.toml", "prompts_hf.toml"])
def test_the_checkpoint_examples_train_a_step_on_a_builtin_model(name, tmp_path, monkeypatch):
    """Their data files, reward and algorithm settings as written; the placeholder checkpoint replaced by the
    built-in tiny model."""
    monkeypatch.chdir(ROOT)
    cfg = load_here(EXAMPLES / name)
    rows = _train(cfg, tmp_path, 'model.path=""', 'model.builtin="tiny-dense"', 'model.dtype="float32"',
                  'model.device="cpu"', "data.max_prompt_len=512")
    assert len(rows) == 1 and rows[0]["reward_errors"] == 0


def test_my_reward_function():
    sys.path.insert(0, str(EXAMPLES))
    try:
        from my_reward import score
    finally:
        sys.path.remove(str(EXAMPLES))
    assert score("42", "42") == 1.0 and score("41", "42") == 0.25 and score("", "42") == 0.0
    assert score("41", "42", partial=1.0, task="passkey") == 0.5


@pytest.mark.slow  # runs the script in a subprocess
def test_python_api_example_runs_to_completion(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    r = subprocess.run([sys.executable, str(EXAMPLES / "python_api.py"), str(tmp_path / "model")], capture_output=True,
                       text=True, env=env, cwd=tmp_path, timeout=600)
    assert r.returncode == 0, r.stderr
    assert "gradient norm" in r.stdout and "saved the model" in r.stdout
    assert (tmp_path / "model" / "config.json").is_file() and (tmp_path / "model" / "model.safetensors").is_file()


def test_the_readme_python_snippet_is_the_example_script():
    readme = (ROOT / "README.md").read_text()
    section = readme[readme.index("## Use it from Python"):]
    block = re.search(r"```python\n(.*?)```\n", section, re.S).group(1)
    assert block == (EXAMPLES / "python_api.py").read_text()
    assert "examples/" in readme


def test_the_gpt_oss_lora_example_trains_a_step_on_a_tiny_gpt_oss(tmp_path, monkeypatch):
    """examples/gpt_oss_lora.toml as written (LoRA on the attention and the routed experts, exact mode), on a tiny
    GPT-OSS checkpoint (sliding window 8, which the prompts reach past) with the built-in byte tokenizer, in
    float32 on the CPU: a step runs (rollouts, rewards, the update) with the example's settings as written."""
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from hf_reference import save_tiny, tiny_moe_hf
    finally:
        sys.path.remove(str(ROOT / "tests"))
    from transformers import GptOssConfig

    from longstraw.tokenizer import ByteTokenizer

    hf = tiny_moe_hf(GptOssConfig(vocab_size=259, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, sliding_window=8, max_position_embeddings=4096,
                                  pad_token_id=258, eos_token_id=257, bos_token_id=256), seed=3, attn="eager")
    ckpt = save_tiny(hf, dtype=torch.float32)
    ByteTokenizer().save(ckpt)
    reward = tmp_path / "varied.py"  # a random tiny model never finds the pass key: a reward that varies with the
    reward.write_text("def score(response, answer, **_):\n    return float(sum(map(ord, response)) % 3)\n")  # text
    monkeypatch.chdir(ROOT)
    cfg = load_here(EXAMPLES / "gpt_oss_lora.toml")
    rows = _train(cfg, tmp_path, f'model.path="{ckpt}"', 'model.dtype="float32"', 'model.device="cpu"',
                  "data.prompt_len=96", "data.max_prompt_len=256", "rollout.group_size=4", "rollout.max_new_tokens=8",
                  "algorithm.prefill_chunk=32", "optim.lr=1e-2", "train.save_every=0", f'reward.fn="{reward}:score"')
    assert len(rows) == 1 and rows[0]["prompt_len"] >= 64 and rows[0]["reward_errors"] == 0
    assert rows[0]["prompt_state_bytes"] > 0
