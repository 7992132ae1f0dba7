"""Run configs: TOML in and out, overrides, the embedded engine configs, typed values, and errors that name the key
and suggest the nearest one."""

import dataclasses
import importlib.util
import sys
from pathlib import Path

import pytest

from longstraw.engine.config import GRPOConfig, PromptGrad, SamplingConfig
from longstraw.losses import LossAggMode
from longstraw.rl import config as config_module
from longstraw.rl.config import (SECTIONS, AlgorithmSection, MemoryCheck, RolloutSection, RunConfig, TrainSection,
                                 apply_overrides, config_from_dict, config_keys, config_reference,
                                 default_config_toml, diff_configs, dump_config, grpo_config, load_config,
                                 sampling_config)


def test_defaults_round_trip_through_toml(tmp_path):
    cfg = apply_overrides(RunConfig(), ['rollout.stop_strings=["\\n", "END"]', "optim.lr=3e-4", "train.steps=7",
                                        'reward.fn="exact_match"', "reward.options={case_sensitive=false}",
                                        "algorithm.clip_ratio_c=none", "algorithm.loss_scale_factor=64",
                                        'model.compute_dtype="bfloat16"', 'train.memory_check="off"'])
    p = tmp_path / "run.toml"
    p.write_text(dump_config(cfg))
    again = load_config(p)
    assert again == cfg and dump_config(again) == p.read_text()
    assert again.rollout.sampling.stop_strings == ("\n", "END") and again.train.steps == 7
    assert again.reward.options == {"case_sensitive": False} and again.algorithm.grpo.clip_ratio_c is None
    text = p.read_text()
    assert 'clip_ratio_c = "none"' in text and "options = { case_sensitive = false }" in text


def test_the_toml_is_flat_and_routed_to_the_embedded_engine_configs(tmp_path):
    p = tmp_path / "run.toml"
    p.write_text('[algorithm]\nclip_ratio_low = 0.1\nloss_agg_mode = "seq-mean-token-sum-norm"\nppo_epochs = 2\n'
                 '[rollout]\ntemperature = 0.7\ntop_k = 5\nstop_strings = ["x"]\ngroup_size = 3\n'
                 '[model]\ncompute_dtype = "bfloat16"\n')
    cfg = load_config(p)
    g, s = cfg.algorithm.grpo, cfg.rollout.sampling
    assert isinstance(g, GRPOConfig) and isinstance(s, SamplingConfig)
    assert g.clip_ratio_low == 0.1 and g.loss_agg_mode is LossAggMode.SEQ_MEAN_TOKEN_SUM_NORM
    assert cfg.algorithm.ppo_epochs == 2 and cfg.rollout.group_size == 3
    assert s.temperature == 0.7 and s.top_k == 5 and s.stop_strings == ("x",)
    # derived: the loss's temperature is the sampling temperature, autocast is the model's compute dtype
    assert grpo_config(cfg) is g and g.temperature == 0.7 and g.compute_dtype == "bfloat16"
    assert sampling_config(cfg, (7,)) == dataclasses.replace(s, stop_token_ids=(7,))
    assert cfg.to_dict()["algorithm"]["clip_ratio_low"] == 0.1 and "grpo" not in cfg.to_dict()["algorithm"]


def test_defaults_come_from_the_engine_configs_except_documented_trainer_defaults():
    cfg = RunConfig()
    assert cfg.algorithm.grpo == GRPOConfig()
    assert cfg.rollout.sampling == SamplingConfig(max_new_tokens=8)  # the trainer's short-answer default
    keys = {k.path for k in config_keys()}
    engine = {f"algorithm.{f.name}" for f in dataclasses.fields(GRPOConfig)} | {
        f"rollout.{f.name}" for f in dataclasses.fields(SamplingConfig)}
    assert engine - keys == {"algorithm.temperature", "algorithm.compute_dtype", "algorithm.graph_budget_bytes",
                             "rollout.stop_token_ids", "rollout.seed"}  # the derived fields, and nothing else, are not keys


def test_overrides_parse_toml_literals_else_strings():
    cfg = apply_overrides(RunConfig(), ["algorithm.prompt_grad=detached", "rollout.temperature=0.7",
                                        "train.progress=false", "optim.betas=[0.9, 0.95]", "model.compute_dtype=none"])
    assert cfg.algorithm.grpo.prompt_grad is PromptGrad.DETACHED and cfg.rollout.sampling.temperature == 0.7
    assert cfg.train.progress is False and cfg.optim.betas == (0.9, 0.95) and cfg.model.compute_dtype is None


def test_sections_built_in_python_are_coerced_and_checked():
    assert TrainSection(memory_check="off").memory_check is MemoryCheck.OFF
    with pytest.raises(ValueError, match=r"train.steps='3' must be an integer"):
        TrainSection(steps="3")
    with pytest.raises(ValueError, match="it is taken from rollout.temperature"):  # derived fields must agree
        RunConfig(rollout=RolloutSection(sampling=SamplingConfig(temperature=0.5, max_new_tokens=8)))
    with pytest.raises(ValueError, match=r"stop_token_ids=\(1,\) must be empty: it is the tokenizer's EOS"):
        RunConfig(rollout=RolloutSection(sampling=SamplingConfig(stop_token_ids=(1,))))
    ok = RunConfig(algorithm=AlgorithmSection(grpo=GRPOConfig(temperature=0.5)),
                   rollout=RolloutSection(sampling=SamplingConfig(temperature=0.5)))
    assert grpo_config(ok).temperature == 0.5


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.grup_size=4"], r"unknown key rollout.grup_size; did you mean 'group_size'\?"),
    (["rolout.group_size=4"], r"unknown section \[rolout\] .*did you mean 'rollout'\?"),
    (["rollout.group_size=four"], r"rollout.group_size='four' must be an integer"),
    (["optim.lr=-1.0"], r"optim.lr=-1.0 must be > 0"),
    (["optim.lr=nan"], r"optim.lr=nan must be a finite number"),
    (["rollout.top_p=inf"], r"rollout.top_p=inf must be a finite number"),
    (["algorithm.loss_agg_mode=mean"], r"algorithm.loss_agg_mode='mean' is not supported; allowed: 'token-mean'"),
    (["rollout.group_size=1"], r"rollout.group_size=1 must be >= 2"),
    (["model.builtin=big"], r"model.builtin='big' is not a built-in model"),
    (["train.steps"], r"override 'train.steps' must look like section.key=value"),
    (["data.path=x.jsonl"], r"set exactly one of data.task"),
    # element types, tuples from lists
    (["rollout.stop_strings=[1, 2]"], r"^rollout.stop_strings=\[1, 2\] must be a list of strings$"),
    (["optim.betas=[0.9]"], r"optim.betas=\[0.9\] must be a list of 2 finite numbers"),
    (["optim.betas=[0.9, 1.0]"], r"optim.betas=\[0.9, 1.0\] must be two numbers in \[0, 1\)"),
    # None is "none"; the old 0-means-None encodings are errors that say so
    (["algorithm.clip_ratio_c=0"],
     r'algorithm.clip_ratio_c=0.0 must be a finite number > 1 \(dual clip\), or "none" to disable it'),
    (["algorithm.clip_ratio_c=off"], r'algorithm.clip_ratio_c=\'off\' must be a finite number, or "none" to disable'),
    (["algorithm.loss_scale_factor=0"], r'algorithm.loss_scale_factor=0.0 must be a finite number > 0 or "none"'),
    (['model.compute_dtype=""'], r"""model.compute_dtype='' is not supported; allowed: "none", 'bfloat16'"""),
    # engine checks, named by key (a derived field by the key it comes from)
    (["algorithm.prefill_chunk=0"], r"algorithm.prefill_chunk=0 must be an integer >= 1"),
    (["rollout.temperature=0"], r"rollout.temperature=0.0 must be a finite number > 0"),
    (["algorithm.temperature=0.5"], r"algorithm.temperature is not a key: it is taken from rollout.temperature"),
    (["rollout.seed=1"], r"rollout.seed is not a key: it is derived per step"),
    (["train.wandb_mode=cloud"], r"train.wandb_mode='cloud' is not supported; allowed: 'online', 'offline'"),
    # devices are checked against this machine
    (["model.device=gpu"], r"model.device='gpu' is not a device name; available here: cpu"),
    (["model.device=tpu:0"], r"model.device='tpu:0'"),
    # rewards: built-ins and their options are checked now
    (["reward.fn=nope"], r"reward.fn='nope' is not a built-in reward; built-ins: exact_match"),
    (["reward.options={x=1}"], r"reward.options=\{ x = 1 \}: unknown option 'x' for reward 'digit_match'"),
    (['reward.fn="exact_match"', 'reward.options={case_sensitive="no"}'],
     r"reward.options=.*case_sensitive='no' must be true or false"),
    (['reward.fn="regex"', 'reward.options={pattern="("}'], r"pattern='\(' is not a valid regular expression"),
    (["reward.options=3"], r"reward.options=3 must be a table"),
    (["reward.case_sensitive=false"], r"unknown key reward.case_sensitive"),
    # [lora]: target_parameters (routed experts) checked by key; names against the model at Trainer start
    (["lora.rank=4", 'lora.target_parameters="mlp.experts.down_proj"'],
     r"^lora.target_parameters='mlp.experts.down_proj' must be a list of strings$"),
    (["lora.rank=4", "lora.target_parameters=[1]"], r"^lora.target_parameters=\[1\] must be a list of strings$"),
    (["lora.rank=4", 'lora.target_parameters=["mlp.experts.down_proj", ""]'],
     r"lora.target_parameters=\['mlp.experts.down_proj', ''\] has an empty name; allowed: .*gate_up_proj"),
    (["lora.rank=4", "lora.target_modules=[]"], r"lora.target_modules=\[\] must name at least one module .*\[\] only "
                                                r"with lora.target_parameters"),
    (["lora.rank=4", 'lora.target_parameters=["mlp.experts.down_proj"]', "lora.dropout=0.1",
      'algorithm.prompt_grad="detached"'], r"lora.dropout=0.1 with lora.target_parameters=.* set lora.dropout = 0"),
    (["lora.rank=4", 'lora.modules_to_save=[""]'], r"^lora.modules_to_save=\(''.*must be module names"),
])
def test_bad_overrides(overrides, msg):
    with pytest.raises(ValueError, match=msg) as e:
        apply_overrides(RunConfig(), overrides)
    assert "\n" not in str(e.value)


def test_lora_target_parameters_key():
    """[lora] target_parameters: a list of names (default empty), passed to the model's LoRA settings as add_lora's
    target_parameters; target_modules may then be empty (adapters on the routed experts only)."""
    from longstraw.checkpoint.adapter import settings_from
    from longstraw.rl.trainer import lora_settings

    assert RunConfig().lora.target_parameters == ()
    cfg = apply_overrides(RunConfig(), ["lora.rank=4", "lora.target_modules=[]",
                                        'lora.target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]'])
    s = settings_from(lora_settings(cfg.lora))
    assert s.target_parameters == ("mlp.experts.down_proj", "mlp.experts.gate_up_proj") and s.target_modules == ()
    assert settings_from(lora_settings(apply_overrides(RunConfig(), ["lora.rank=4"]).lora)).target_parameters == ()


def test_user_reward_functions_are_not_imported_at_config_time(tmp_path):
    f = tmp_path / "boom.py"
    f.write_text("raise RuntimeError('imported')\n")
    cfg = apply_overrides(RunConfig(), [f'reward.fn="{f}:score"', "reward.options={scale=2}"])
    assert cfg.reward.options == {"scale": 2}


def test_bad_files(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3")
    with pytest.raises(ValueError, match="invalid TOML"):
        load_config(bad)
    with pytest.raises(ValueError, match=r"\[train\] must be a table"):
        config_from_dict({"train": 3})


def test_diff_configs_ignores_listed_keys():
    a = RunConfig()
    b = apply_overrides(a, ["train.steps=999", "data.seed=4", "algorithm.kl_coef=0.1"])
    assert diff_configs(a, b, ignore=("train.steps",)) == ["data.seed: 0 != 4", "algorithm.kl_coef: 0.0 != 0.1"]


def test_python_3_10_reads_toml_with_tomli(monkeypatch, tmp_path):
    """Python 3.10 has no tomllib: the module falls back to tomli (loaded here as a fresh copy of config.py with
    tomllib unimportable, so the module the other tests use is left alone)."""
    pytest.importorskip("tomli")
    monkeypatch.setitem(sys.modules, "tomllib", None)
    name = "_longstraw_config_py310"
    spec = importlib.util.spec_from_file_location(name, config_module.__file__)
    mod = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, mod)  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(mod)
    assert mod.tomllib.__name__ == "tomli"
    p = tmp_path / "run.toml"
    p.write_text('[rollout]\ntemperature = 0.5\n[algorithm]\nclip_ratio_c = "none"\n')
    cfg = mod.load_config(p)
    assert cfg.algorithm.grpo.clip_ratio_c is None and cfg.algorithm.grpo.temperature == 0.5
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\n")
    with pytest.raises(ValueError, match="invalid TOML"):
        mod.load_config(bad)


def test_pyproject_declares_tomli_for_python_3_10():
    with open(Path(__file__).resolve().parents[2] / "pyproject.toml", "rb") as f:
        project = config_module.tomllib.load(f)["project"]
    assert 'tomli>=1.1; python_version < "3.11"' in project["dependencies"]
    assert project["requires-python"] == ">=3.10" and "tomli>=1.1" in project["optional-dependencies"]["test"]


def test_every_field_has_help_and_docs_config_md_is_the_generated_reference():
    for cls in [*SECTIONS.values(), GRPOConfig, SamplingConfig]:
        for f in dataclasses.fields(cls):
            assert f.metadata.get("help", "").strip(), f"{cls.__name__}.{f.name} has no help text"
    doc = Path(__file__).resolve().parents[2] / "docs" / "CONFIG.md"
    assert doc.read_text() == config_reference(), \
        "docs/CONFIG.md is stale: regenerate it with `longstraw config --markdown > docs/CONFIG.md`"
    for k in config_keys():
        assert f"| `{k.name}` |" in doc.read_text()


def test_the_commented_default_config_loads_unchanged_and_sets_every_key(tmp_path):
    text = default_config_toml()
    p = tmp_path / "run.toml"
    p.write_text(text)
    assert load_config(p) == RunConfig()
    raw = config_module.tomllib.loads(text)
    assert {f"{s}.{k}" for s in raw for k in raw[s]} == {k.path for k in config_keys()}
    lines = text.splitlines()
    for k in config_keys():  # each key is preceded by its help and type as a comment
        i = next(i for i, x in enumerate(lines) if x.startswith(f"{k.name} = ") and i > lines.index(f"[{k.section}]"))
        j = i
        while lines[j - 1].startswith("# "):
            j -= 1
        comment = " ".join(x[2:] for x in lines[j:i])
        assert comment.startswith(k.help.split()[0]) and "Type: " in comment
