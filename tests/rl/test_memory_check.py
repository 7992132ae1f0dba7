"""The trainer's pre-run memory check: the planner's peak plus what a run holds besides, against a limit."""

import pytest

from longstraw import GRPOConfig
from longstraw.planner import plan
from longstraw.rl.config import RunConfig, apply_overrides
from longstraw.rl.trainer import Trainer, builtin_model_config

TINY = ["model.builtin=\"tiny-dense\"", "data.prompt_len=160", "data.max_prompt_len=256", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "algorithm.prefill_chunk=64", "train.progress=false", "train.plots=false",
        "train.tensorboard=false"]


def _cfg(out, *extra):
    return apply_overrides(RunConfig(), TINY + [f"train.out_dir=\"{out}\""] + list(extra))


def test_fitting_run_reports_its_plan(tmp_path):
    lines = []
    tr = Trainer(_cfg(tmp_path / "run"), echo=lines.append)
    v = tr.memory
    assert v.fits and v.limit_bytes > v.peak_bytes > 0
    assert any(line.startswith("memory plan: peak ") and "cpu memory" in line for line in lines)


def test_peak_is_the_plan_plus_reference_model_and_kept_rollout_states(tmp_path):
    cfg = _cfg(tmp_path / "run", "algorithm.kl_coef=0.05", "algorithm.prompts_per_step=3",
               "train.memory_limit=\"4G\"")
    tr = Trainer(cfg, echo=lambda *_: None)
    hf = builtin_model_config("tiny-dense", tr.tokenizer.vocab_size, 256 + 4 + 1)
    p = plan(hf, prompt_len=tr.source.longest_prompt, response_len=4, group=4, dtype="float32",
             cfg=GRPOConfig(prompt_grad="exact", prefill_chunk=64, kl_coef=0.05))
    b = tr.memory.breakdown
    assert b["reference_model"] == p.breakdown["weights"]
    assert b["rollout_states"] == 2 * p.breakdown["prompt_state"]
    assert tr.memory.peak_bytes == p.peak_bytes + b["reference_model"] + b["rollout_states"]
    assert tr.memory.limit_bytes == 4 * 2**30


def test_lora_run_is_planned_with_its_adapters_and_no_reference_copy(tmp_path):
    """[lora]: the planner counts the adapters (the frozen base as weights only), and with kl_coef > 0 the reference is
    the base with the adapters off (no second model) unless modules_to_save trains some of the base."""
    tr = Trainer(_cfg(tmp_path / "a", "algorithm.kl_coef=0.05", "lora.rank=4", 'train.memory_limit="4G"'),
                 echo=lambda *_: None)
    hf = builtin_model_config("tiny-dense", tr.tokenizer.vocab_size, 256 + 4 + 1)
    p = plan(hf, prompt_len=tr.source.longest_prompt, response_len=4, group=4, dtype="float32",
             cfg=GRPOConfig(prompt_grad="exact", prefill_chunk=64, kl_coef=0.05), lora=dict(rank=4, alpha=8.0,
                                                                                            target_modules="all-linear"))
    assert "reference_model" not in tr.memory.breakdown and tr.memory.peak_bytes == p.peak_bytes
    trained = sum(q.numel() * q.element_size() for q in tr.model.parameters() if q.requires_grad)
    assert p.breakdown["grads"] == trained
    saved = Trainer(_cfg(tmp_path / "b", "algorithm.kl_coef=0.05", "lora.rank=4", 'lora.modules_to_save=["norm"]',
                         'train.memory_limit="4G"'), echo=lambda *_: None)
    assert saved.memory.breakdown["reference_model"] > 0 and saved.ref_model is not None


def test_run_that_does_not_fit_warns_with_advice(tmp_path):
    lines = []
    tr = Trainer(_cfg(tmp_path / "run", "train.memory_limit=\"1800K\""), echo=lines.append)
    v = tr.memory
    assert not v.fits and v.peak_bytes > 1800 * 1024
    assert v.max_prompt_len is not None and 2 < v.max_prompt_len < 160
    warning = next(line for line in lines if line.startswith("warning: the run will not fit"))
    assert "train.memory_limit 1800K" in warning and "algorithm.prompt_grad = 'detached'" in warning
    assert f"the longest prompt that fits is {v.max_prompt_len:,} tokens" in warning


def test_host_offloads_free_nothing_on_a_cpu_device(tmp_path):
    """optim.offload, algorithm.offload_state_grad and offload_state move buffers to host memory: on a CPU device
    that is the same memory, so the check plans them where they are (the planner alone would book them off the
    device)."""
    tr = Trainer(_cfg(tmp_path / "a", 'train.memory_limit="4G"'), echo=lambda *_: None)
    off = Trainer(_cfg(tmp_path / "b", 'train.memory_limit="4G"', "algorithm.offload_state_grad=true",
                       "algorithm.offload_state=true", 'optim.offload="moments"'), echo=lambda *_: None)
    assert off.memory.peak_bytes == tr.memory.peak_bytes and off.memory.breakdown == tr.memory.breakdown
    assert tr.memory.breakdown["prompt_state_grad"] > 0 and tr.memory.breakdown["optimizer"] > 0


def test_error_mode_refuses_before_writing_anything(tmp_path):
    cfg = _cfg(tmp_path / "run", "train.memory_limit=\"1500K\"", "train.memory_check=\"error\"")
    with pytest.raises(ValueError, match=r"the run will not fit: planned peak .* > train.memory_limit 1500K"):
        Trainer(cfg, echo=lambda *_: None)
    assert not (tmp_path / "run").exists()


def test_off_skips_the_plan(tmp_path):
    lines = []
    tr = Trainer(_cfg(tmp_path / "run", "train.memory_check=\"off\"", "train.memory_limit=\"1K\""),
                 echo=lines.append)
    assert tr.memory is None and not any("memory plan" in line or "will not fit" in line for line in lines)


@pytest.mark.parametrize("override,msg", [
    ("train.memory_check=\"maybe\"", r"train.memory_check='maybe' is not supported; allowed: 'warn', 'error', 'off'"),
    ("train.memory_limit=\"lots\"", r"train.memory_limit='lots' must be a memory size like 80G"),
    ("train.memory_limit=\"-3G\"", r"train.memory_limit='-3G' must be a memory size like 80G"),
    ("train.memory_limit=\"inf\"", r"train.memory_limit='inf' must be a memory size like 80G"),
])
def test_bad_values(tmp_path, override, msg):
    with pytest.raises(ValueError, match=msg):
        Trainer(_cfg(tmp_path / "run", override), echo=lambda *_: None)


def test_on_a_gpu_the_limit_is_its_memory_less_the_planners_reserve(tmp_path, monkeypatch):
    """On a GPU the check compares the plan with the device's total memory less ``planner.device_reserve`` (the
    CUDA context, NCCL with several ranks, fragmentation): what ``longstraw plan --gpu-mem`` compares with."""
    import torch

    import longstraw.rl.memory_check as mc
    from longstraw.planner import device_reserve

    total = 80 * 2**30
    monkeypatch.setattr(mc, "device_memory", lambda device: (total, "total memory"))
    cfg = _cfg(tmp_path / "run")
    hf = builtin_model_config("tiny-dense", 300, 256 + 4 + 1)
    lines = []
    v = mc.check_run_memory(cfg, hf, 160, 4, torch.device("cuda"), echo=lines.append)
    assert v.limit_bytes == total - device_reserve(total, 1) and v.fits
    assert "after the planner's reserve" in lines[0]
    v8 = mc.check_run_memory(cfg, hf, 160, 4, torch.device("cuda"), echo=lines.append, shard=8)
    assert v8.limit_bytes == total - device_reserve(total, 8) == v.limit_bytes - 2**30


def test_advice_names_the_state_offloads_on_an_accelerator(tmp_path):
    """On a GPU the advice offers moving the state gradient and the state's K/V to host memory (once each: not
    when already set, nor the K/V with kept graphs, which hold them on the device)."""
    from longstraw.rl.memory_check import _advice

    def on_gpu(cfg):  # a run config for a CUDA device (this machine has none to validate it against)
        object.__setattr__(cfg.model, "device", "cuda")
        return cfg

    b = dict(weights=1, grads=1, optimizer=1, gathered=0, prompt_state=5 << 20, prompt_state_grad=10 << 20,
             prefill_chunk=1 << 20, branch_graph=1 << 10, logits=1 << 10)
    text = " ".join(_advice(on_gpu(_cfg(tmp_path / "a")), b, {}))
    assert "algorithm.offload_state_grad = true" in text and "algorithm.offload_state = true" in text
    done = " ".join(_advice(on_gpu(_cfg(tmp_path / "b", "algorithm.offload_state=true",
                                        "algorithm.offload_state_grad=true")), b, {}))
    assert "offload_state" not in done
    assert "offload_state =" not in " ".join(_advice(_cfg(tmp_path / "c", "algorithm.offload_state=true"), b, {}))
