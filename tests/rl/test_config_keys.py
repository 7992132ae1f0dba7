"""Every config key changes behaviour or does not exist: a few short real runs read every key of every section.

Reads are recorded by patching ``__getattribute__`` of the section classes and of the embedded engine configs
(``GRPOConfig``, ``SamplingConfig``: a read by the engine of the object the trainer passed it counts for the
key it came from). Reads by the config machinery itself (``longstraw.rl.config``: loading, validation, dumping,
diffing; dataclasses' generated methods, ``replace`` and ``asdict``; the engine configs' own ``__post_init__``) do not
count: they touch every field whether or not the run uses it.
"""

import json
import socket
import sys
import types

from longstraw.engine.config import GRPOConfig
from longstraw.rl import config as C
from longstraw.rl.config import RunConfig, apply_overrides, config_keys
from longstraw.rl.trainer import Trainer

TINY = ['model.builtin="tiny-dense"', "data.prompt_len=160", "data.max_prompt_len=256", "rollout.group_size=3",
        "rollout.max_new_tokens=3", "algorithm.prefill_chunk=64", "train.plots=false", "optim.warmup_steps=1",
        "train.steps=2"]
NOT_USES = ("__post_init__", "to_dict", "__eq__", "__repr__", "__hash__")


def _key_of_field() -> dict:
    """(class, field name) -> the TOML key whose value that field holds."""
    out = {}
    for k in config_keys():
        owner = C.SECTIONS[k.section]
        if k.via is not None:
            owner = C._embedded(owner)[k.via]  # GRPOConfig or SamplingConfig
        out[(owner, k.name)] = k.path
    for (section, name), source in C.DERIVED_FROM.items():
        assert section == "algorithm"
        out[(GRPOConfig, name)] = source
    return out


def _is_machinery(frame) -> bool:
    code = frame.f_code
    return (code.co_filename.startswith("<") or code.co_filename.endswith("dataclasses.py")
            or code.co_filename == C.__file__ or code.co_name in NOT_USES)


def _record_reads(monkeypatch, read: set) -> dict:
    keymap = _key_of_field()
    for cls in {c for c, _ in keymap}:
        def get(self, name, cls=cls):
            key = keymap.get((cls, name))
            if key is not None and not _is_machinery(sys._getframe(1)):
                read.add(key)
            return object.__getattribute__(self, name)

        monkeypatch.setattr(cls, "__getattribute__", get)
    return keymap


class _FakeRun:
    def __init__(self, **kw):
        self.kw, self.logged, self.finished = kw, [], False

    def log(self, metrics, step):
        self.logged.append((step, metrics))

    def finish(self):
        self.finished = True


def fake_wandb(monkeypatch) -> list:
    """A stand-in ``wandb`` module in sys.modules; returns the list its runs are appended to."""
    runs = []
    mod = types.ModuleType("wandb")
    mod.init = lambda **kw: runs.append(_FakeRun(**kw)) or runs[-1]
    monkeypatch.setitem(sys.modules, "wandb", mod)
    return runs


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_every_key_of_every_section_is_read_by_a_real_run(tmp_path, monkeypatch):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"q": f"Say {i}: ", "a": str(i)}) + "\n" for i in range(2)))
    rollouts = tmp_path / "rollouts.jsonl"
    rollouts.write_text(json.dumps({"prompt": "2+2=", "answer": "4", "responses": ["4", "5", "four"],
                                    "rewards": [1.0, 0.0, 0.0]}) + "\n")
    runs = [  # together they reach every branch that reads a key
        ["algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.01", "algorithm.ppo_epochs=2",
         "algorithm.prompts_per_step=2", "train.save_every=1", "train.progress=false", 'train.memory_limit="64G"',
         "data.num_prompts=2", "train.wandb=true", 'train.wandb_mode="offline"', "train.plots=true"],
        ['data.task=""', f'data.path="{prompts}"', 'data.prompt_key="q"', 'data.answer_key="a"',
         f'model.path="{tmp_path / "0" / "initial_model"}"', "model.trust_remote_code=true",  # run 0's model
         'reward.fn="exact_match"', "reward.options={case_sensitive=false}", 'train.memory_check="off"',
         "train.progress=true", 'rollout.stop_strings=["\\n"]'],
        ['data.task=""', f'data.path="{rollouts}"', "data.offline=true", "train.progress=false",
         'model.dtype="bfloat16"',  # master weights (of the adapters: the LoRA run)
         "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1", 'algorithm.prompt_grad="detached"', "lora.use_rslora=true",
         'lora.target_modules=["q_proj","down_proj"]', 'lora.modules_to_save=["norm"]'],
        # under torchrun ([parallel] read to join the job): a job of one rank, in this process
        ["train.progress=false", 'train.memory_check="off"'],
    ]
    cfgs = [apply_overrides(RunConfig(), TINY + [f'train.out_dir="{tmp_path / str(i)}"'] + extra)
            for i, extra in enumerate(runs)]
    wandb_runs = fake_wandb(monkeypatch)
    read: set = set()
    keymap = _record_reads(monkeypatch, read)
    for i, cfg in enumerate(cfgs):
        with monkeypatch.context() as env:
            if i == len(cfgs) - 1:
                env.setenv("RANK", "0")
                env.setenv("LOCAL_RANK", "0")
                env.setenv("WORLD_SIZE", "1")
                env.setenv("MASTER_ADDR", "127.0.0.1")
                env.setenv("MASTER_PORT", str(_free_port()))
            Trainer(cfg, resume=False, echo=lambda *_: None).train()
    assert wandb_runs and wandb_runs[0].finished
    all_keys = {k.path for k in config_keys()}
    assert set(keymap.values()) == all_keys
    assert sorted(all_keys - read) == [], "config keys no run read (ignored settings)"
