"""Run configs: TOML in and out, overrides, and errors that name the key and suggest the nearest one."""

import pytest

from longstraw.rl.config import RunConfig, apply_overrides, config_from_dict, diff_configs, dump_config, load_config


def test_defaults_round_trip_through_toml(tmp_path):
    cfg = apply_overrides(RunConfig(), ['rollout.stop_strings=["\\n", "END"]', "optim.lr=3e-4", "train.steps=7"])
    p = tmp_path / "run.toml"
    p.write_text(dump_config(cfg))
    again = load_config(p)
    assert again == cfg and again.rollout.stop_strings == ["\n", "END"] and again.train.steps == 7


def test_overrides_parse_toml_literals_else_strings():
    cfg = apply_overrides(RunConfig(), ["algorithm.prompt_grad=detached", "rollout.temperature=0.7",
                                        "train.progress=false", "optim.betas=[0.9, 0.95]"])
    assert cfg.algorithm.prompt_grad == "detached" and cfg.rollout.temperature == 0.7
    assert cfg.train.progress is False and cfg.optim.betas == [0.9, 0.95]


@pytest.mark.parametrize("overrides,msg", [
    (["rollout.grup_size=4"], r"unknown key rollout.grup_size; did you mean 'group_size'\?"),
    (["rolout.group_size=4"], r"unknown section \[rolout\] .*did you mean 'rollout'\?"),
    (["rollout.group_size=four"], r"rollout.group_size='four' must be an integer"),
    (["optim.lr=-1.0"], r"optim.lr=-1.0 must be > 0"),
    (["algorithm.loss_agg_mode=mean"], r"algorithm.loss_agg_mode='mean' is not supported; allowed: 'token-mean'"),
    (["rollout.group_size=1"], r"rollout.group_size=1 must be >= 2"),
    (["model.builtin=big"], r"model.builtin='big' is not a built-in model"),
    (["train.steps"], r"override 'train.steps' must look like section.key=value"),
    (["data.path=x.jsonl"], r"set exactly one of data.task"),
])
def test_bad_overrides(overrides, msg):
    with pytest.raises(ValueError, match=msg):
        apply_overrides(RunConfig(), overrides)


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
    b = apply_overrides(a, ["train.steps=999", "data.seed=4"])
    assert diff_configs(a, b, ignore=("train.steps",)) == ["data.seed: 0 != 4"]
