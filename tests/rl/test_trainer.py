"""The trainer end to end on a tiny built-in model: metrics, checkpoints, exact resume after SIGKILL mid-save."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from longstraw.checkpoint.training import checkpoint_dirs
from longstraw.rl.config import RunConfig, apply_overrides
from longstraw.rl.runlog import read_metrics
from longstraw.rl.trainer import Trainer

TINY = ["model.builtin=\"tiny-dense\"", "data.prompt_len=160", "data.max_prompt_len=256", "rollout.group_size=4",
        "rollout.max_new_tokens=4", "algorithm.prefill_chunk=64", "train.progress=false", "train.plots=false",
        "train.tensorboard=false", "optim.warmup_steps=2"]
VOLATILE = {"rollout_s", "train_s", "step_s", "peak_memory_bytes", "train_peak_bytes", "peak_above_start_bytes"}


def _cfg(out, *extra):
    return apply_overrides(RunConfig(), TINY + [f"train.out_dir=\"{out}\""] + list(extra))


def _stable(rows):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def test_trainer_runs_logs_and_checkpoints(tmp_path):
    cfg = _cfg(tmp_path / "run", "train.steps=4", "train.save_every=2", "train.keep_last=1",
               "algorithm.ppo_epochs=2", "algorithm.kl_coef=0.01", "algorithm.entropy_coef=0.001")
    s = Trainer(cfg, resume=False, echo=lambda *_: None).train()
    rows = read_metrics(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and s.steps == 4
    for r in rows:
        assert 0.0 <= r["reward_mean"] <= 1.0 and r["prompt_len"] >= 150 and math_finite(r["loss"])
        assert "kl" in r and "entropy" in r and r["peak_memory_bytes"] > 0
    ckpts = checkpoint_dirs(tmp_path / "run")
    assert [c.name for c in ckpts] == ["step-00000004"]  # keep_last=1
    model_dir = ckpts[0] / "model"
    assert (model_dir / "config.json").exists() and (model_dir / "model.safetensors").exists()
    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(model_dir)  # servable as an HF checkpoint
    assert (tmp_path / "run" / "config.toml").exists()


def math_finite(x):
    return x == x and abs(x) != float("inf")


def _train_cli(args, env=None):
    e = dict(os.environ)
    e.update(env or {})
    e["PYTHONPATH"] = str(Path(__file__).resolve().parents[2] / "src")
    return subprocess.run([sys.executable, "-m", "longstraw.cli", "train", *args], capture_output=True, text=True,
                          env=e, timeout=600)


@pytest.mark.slow  # kills a subprocess
def test_sigkill_during_checkpoint_then_resume_matches_uninterrupted(tmp_path):
    sets = [x for t in TINY + ["train.steps=6", "train.save_every=2", "train.keep_last=3"] for x in ("--set", t)]
    ref = _train_cli(sets + ["--set", f"train.out_dir=\"{tmp_path / 'ref'}\""])
    assert ref.returncode == 0, ref.stderr
    run = tmp_path / "run"
    killed = _train_cli(sets + ["--set", f"train.out_dir=\"{run}\""], env={"LONGSTRAW_FAULT": "kill-during-save:4"})
    assert killed.returncode == -9, killed.stderr  # SIGKILL while writing checkpoint 4
    assert [c.name for c in checkpoint_dirs(run)] == ["step-00000002"]  # the last complete one survives
    assert list((run / "checkpoints").glob(".tmp-*"))  # the torn one is left as a temp dir, never as a checkpoint
    resumed = _train_cli(["--resume", str(run)])
    assert resumed.returncode == 0, resumed.stderr
    assert _stable(read_metrics(run)) == _stable(read_metrics(tmp_path / "ref"))
    from safetensors.torch import load_file

    a = load_file(checkpoint_dirs(run)[-1] / "model" / "model.safetensors")
    b = load_file(checkpoint_dirs(tmp_path / "ref")[-1] / "model" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not list((run / "checkpoints").glob(".tmp-*"))  # cleaned up by the next save


def test_resume_refuses_a_different_config(tmp_path):
    cfg = _cfg(tmp_path / "run", "train.steps=2")
    Trainer(cfg, resume=False, echo=lambda *_: None).train()
    other = apply_overrides(cfg, ["data.seed=5"])
    with pytest.raises(ValueError, match=r"was written by a different config: data.seed: 0 != 5"):
        Trainer(other, resume=True)
    with pytest.raises(ValueError, match="already holds a run; resume it with --resume"):
        Trainer(cfg, resume=False)
    longer = apply_overrides(cfg, ["train.steps=3"])  # extending a run is allowed
    Trainer(longer, resume=True, echo=lambda *_: None).train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


def test_offline_rollouts(tmp_path):
    rows = [{"prompt": "What is 2+2? ", "answer": "4", "responses": ["4", "5", "four", "44"],
             "rewards": [1.0, 0.0, 0.0, 0.5]}]
    data = tmp_path / "rollouts.jsonl"
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = _cfg(tmp_path / "run", "train.steps=2", "data.task=\"\"", f"data.path=\"{data}\"", "data.offline=true")
    Trainer(cfg, resume=False, echo=lambda *_: None).train()
    m = read_metrics(tmp_path / "run")
    assert len(m) == 2 and m[0]["reward_mean"] == pytest.approx(0.375)


def test_a_failed_write_during_the_run_is_one_value_error(tmp_path, monkeypatch):
    import errno

    import longstraw.rl.trainer as trainer_mod

    cfg = _cfg(tmp_path / "run", "train.steps=3", "train.save_every=1")
    t = Trainer(cfg, resume=False, echo=lambda *_: None)
    real = trainer_mod.append_metrics

    def full_after_two(run_dir, row):
        if row["step"] > 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(run_dir / "metrics.jsonl"))
        real(run_dir, row)

    monkeypatch.setattr(trainer_mod, "append_metrics", full_after_two)
    with pytest.raises(ValueError, match=r"cannot write in run directory '.*run': No space left on "
                                         r"device \(.*metrics.jsonl\); the last complete checkpoint, step-00000002, "
                                         r"is intact: fix the cause and continue with --resume"):
        t.train()
    assert not t._lock.held  # released: resuming in this process works
    monkeypatch.setattr(trainer_mod, "append_metrics", real)
    Trainer(cfg, resume=True, echo=lambda *_: None).train()
    assert [r["step"] for r in read_metrics(tmp_path / "run")] == [1, 2, 3]


@pytest.mark.parametrize("master_weights,offload", [("true", "none"), pytest.param("false", "none", marks=pytest.mark.slow),
                                                    pytest.param("true", "moments", marks=pytest.mark.slow),
                                                    ("true", "masters")])
def test_bf16_model_precision_and_offload_resume_exactly(tmp_path, master_weights, offload):
    """model.dtype = bfloat16: float32 master weights by default (bf16 compute, float32 gradients and AdamW moments),
    everything in bf16 with master_weights = false, the AdamW state in host memory with optim.offload (masters: the
    float32 masters too, the model's parameters bf16). Each resumes bit for bit: 2 steps + 1 resumed = 3 straight."""
    (tmp_path / "rw.py").write_text("def fn(response, answer, **meta):\n"
                                    "    return (sum(response.encode('utf-8', 'replace')) % 13) / 12.0\n")
    sets = ["model.dtype=\"bfloat16\"", f"model.master_weights={master_weights}", f"optim.offload=\"{offload}\"",
            "train.save_every=1", "optim.lr=1e-2", f"reward.fn=\"{tmp_path / 'rw.py'}:fn\""]  # rewards that vary
    straight = Trainer(_cfg(tmp_path / "a", "train.steps=3", *sets), resume=False, echo=lambda *_: None)
    straight.train()
    params = list(straight.model.parameters())
    want = torch.float32 if (master_weights == "true" and offload != "masters") else torch.bfloat16
    assert {p.dtype for p in params} == {want}
    assert straight.model.compute_dtype == (torch.bfloat16 if want == torch.float32 else None)
    assert type(straight.opt).__name__ == ("AdamW" if offload == "none" else "HostAdamW")
    moments = {s["exp_avg"].dtype for s in straight.opt.state.values()}
    assert moments == {torch.float32 if (want == torch.float32 or offload == "masters") else torch.bfloat16}
    Trainer(_cfg(tmp_path / "b", "train.steps=2", *sets), resume=False, echo=lambda *_: None).train()
    resumed = Trainer(_cfg(tmp_path / "b", "train.steps=3", *sets), resume=True, echo=lambda *_: None)
    resumed.train()
    assert _stable(read_metrics(tmp_path / "b")) == _stable(read_metrics(tmp_path / "a"))
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert a.dtype == b.dtype and torch.equal(a, b), n
    if offload == "masters":
        for p, q in zip(params, resumed.model.parameters()):
            assert torch.equal(straight.opt.state[p]["master"], resumed.opt.state[q]["master"])


def test_lora_run_trains_only_adapters_checkpoints_them_and_resumes_exactly(tmp_path):
    """[lora]: the base frozen (no gradient, no optimiser state), the adapters trained; a checkpoint holds adapter/
    (a PEFT adapter directory) and no model/; 2 steps + 1 resumed = 3 straight, bit for bit; the adapter applied to
    the base with load_model(adapter=) gives the trained model's log-probs."""
    import longstraw

    (tmp_path / "rw.py").write_text("def fn(response, answer, **meta):\n"
                                    "    return (sum(response.encode('utf-8', 'replace')) % 13) / 12.0\n")
    sets = ["lora.rank=4", 'lora.target_modules=["q_proj","v_proj","down_proj","in_proj_qkv","out_proj"]',
            'lora.modules_to_save=["norm"]', "train.save_every=1", "optim.lr=5e-2",
            f"reward.fn=\"{tmp_path / 'rw.py'}:fn\""]
    straight = Trainer(_cfg(tmp_path / "a", "train.steps=3", *sets), resume=False, echo=lambda *_: None)
    straight.train()
    trained = {n for n, p in straight.model.named_parameters() if p.requires_grad}
    # modules_to_save "norm": every module whose name ends with it (PEFT's rule): the final norm and each layer's
    assert trained and all(".lora_A." in n or ".lora_B." in n or n.rsplit(".", 2)[-2].endswith("norm")
                           for n in trained)
    assert {"model.norm.weight", "model.layers.0.input_layernorm.weight"} <= trained
    assert {id(p) for p in straight.opt.state} <= {id(p) for p in straight.model.parameters() if p.requires_grad}
    assert any(".lora_B." in n and p.abs().max() > 0 for n, p in straight.model.named_parameters())  # it learned
    ckpt = checkpoint_dirs(tmp_path / "a")[-1]
    assert (ckpt / "adapter" / "adapter_model.safetensors").is_file() and not (ckpt / "model").exists()
    Trainer(_cfg(tmp_path / "b", "train.steps=2", *sets), resume=False, echo=lambda *_: None).train()
    resumed = Trainer(_cfg(tmp_path / "b", "train.steps=3", *sets), resume=True, echo=lambda *_: None)
    resumed.train()
    assert _stable(read_metrics(tmp_path / "b")) == _stable(read_metrics(tmp_path / "a"))
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n
    served = longstraw.load_model(tmp_path / "a" / "initial_model", adapter=ckpt / "adapter")
    ids = torch.randint(0, served.spec.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    straight.model.eval()
    with torch.no_grad():
        assert torch.equal(served(ids), straight.model(ids))


EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]  # not sorted: adapter_config.json sorts them


def test_lora_on_routed_experts_trains_them_saves_peft_adapters_and_resumes_exactly(tmp_path):
    """lora.target_parameters (and target_modules = []: adapters on the routed experts only) on the built-in MoE
    model (8 experts per layer): every expert of every layer gets an update of both fused weights' adapters; the
    checkpoint's adapter/ records target_parameters and stock PEFT (PeftModel.from_pretrained on the transformers
    model) computes our logits with it in float64; a run resumed from step 1 repeats step 2 bit for bit."""
    import shutil

    import peft
    from hf_reference import float32_rope, true_float64
    from transformers import AutoModelForCausalLM

    import longstraw
    from longstraw.models.lora import expert_adapters

    (tmp_path / "rw.py").write_text("def fn(response, answer, **meta):\n"
                                    "    return (sum(response.encode('utf-8', 'replace')) % 13) / 12.0\n")
    cfg = _cfg(tmp_path / "a", 'model.builtin="tiny-moe"', "lora.rank=4", "lora.target_modules=[]",
               f"lora.target_parameters={json.dumps(EXPERTS)}", "train.steps=2", "train.save_every=1",
               "optim.lr=5e-2", f"reward.fn=\"{tmp_path / 'rw.py'}:fn\"")
    straight = Trainer(cfg, resume=False, echo=lambda *_: None)
    straight.train()
    trained = {n for n, p in straight.model.named_parameters() if p.requires_grad}
    assert trained and all(".mlp.experts.lora_adapters." in n for n in trained)
    experts = expert_adapters(straight.model)
    assert sorted(experts) == sorted(f"model.layers.{i}.{t}" for i in range(4) for t in EXPERTS)
    for key, m in experts.items():  # B starts at 0: a non-zero B_e is an update that reached expert e
        _, b = m.factors()
        assert all(b[e].abs().max() > 0 for e in range(m.num_experts)), key
    ckpts = checkpoint_dirs(tmp_path / "a")
    adapter = ckpts[-1] / "adapter"
    saved = json.loads((adapter / "adapter_config.json").read_text())
    assert saved["target_parameters"] == sorted(EXPERTS) and saved["target_modules"] == []

    base = tmp_path / "a" / "initial_model"
    hf = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float64)
    hf.config._experts_implementation = "eager"
    pm = peft.PeftModel.from_pretrained(float32_rope(hf), str(adapter)).eval()
    assert sum(type(m).__name__ == "ParamWrapper" for m in pm.modules()) == len(experts)
    ours = longstraw.load_model(base, dtype="float64", adapter=adapter)
    ids = torch.randint(0, ours.spec.vocab_size, (1, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), true_float64():
        want = pm(ids).logits
        with pm.disable_adapter():
            assert (pm(ids).logits - want).abs().max() > 1e-3  # the trained expert adapters matter
    assert (ours(ids) - want).abs().max() <= 1e-12

    # resume: the run directory as it was after step 1, continued to step 2
    shutil.copytree(tmp_path / "a", tmp_path / "b", ignore=shutil.ignore_patterns(ckpts[-1].name))
    resumed = Trainer(cfg, tmp_path / "b", resume=True, echo=lambda *_: None)
    assert resumed.start_step == 1
    resumed.train()
    assert _stable(read_metrics(tmp_path / "b")) == _stable(read_metrics(tmp_path / "a"))
    for (n, a), b in zip(straight.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(a, b), n


@pytest.mark.parametrize("model,sets,msg", [
    ("tiny-moe", ['lora.target_parameters=["mlp.experts.up_proj"]'],
     r"^lora.target_parameters entry 'mlp.experts.up_proj' matches no parameter of this model; its routed experts' "
     r"fused parameters are mlp.experts.gate_up_proj and mlp.experts.down_proj$"),
    ("tiny-moe", ['lora.target_parameters=["self_attn.q_proj.weight"]'],
     r"^lora.target_parameters entry 'self_attn.q_proj.weight' names 'model.layers.3.self_attn.q_proj.weight', "
     r"which is not a routed expert's fused weight; .*through target_modules"),
    ("tiny-dense", ['lora.target_parameters=["mlp.experts.down_proj"]'],
     r"^lora.target_parameters entry .* this model has no routed experts$"),
    ("tiny-moe", ['lora.target_modules=["experts"]'],
     r"^lora.target_modules entry 'experts' names routed experts .*adapt them with lora.target_parameters = "),
    ("tiny-dense", ['lora.target_modules=["nope"]'], r"^lora.target_modules entry 'nope' matches no module"),
    ("tiny-dense", ['lora.modules_to_save=["nope"]'], r"^lora.modules_to_save entry 'nope' matches no module"),
])
def test_lora_names_the_model_lacks_are_refused_before_the_run_starts(tmp_path, model, sets, msg):
    """A [lora] name that fits no part of the model (a target_parameters entry that is not a routed expert's fused
    weight, ...) is one ValueError naming the config key, before the run directory is written."""
    with pytest.raises(ValueError, match=msg) as e:
        Trainer(_cfg(tmp_path / "run", f'model.builtin="{model}"', "lora.rank=4", *sets), resume=False,
                echo=lambda *_: None)
    assert "\n" not in str(e.value) and not (tmp_path / "run").exists()


def test_lora_kl_reference_is_the_base_with_adapters_off(tmp_path):
    """kl_coef > 0 with [lora]: no second model; the reference log-probs (adapters off) are the initial model's."""
    from longstraw.engine.grpo import score
    from longstraw.models.lora import adapters_disabled

    (tmp_path / "rw.py").write_text("def fn(response, answer, **meta):\n"
                                    "    return (sum(response.encode('utf-8', 'replace')) % 13) / 12.0\n")
    t = Trainer(_cfg(tmp_path / "a", "train.steps=2", "lora.rank=4", "algorithm.kl_coef=0.05", "optim.lr=5e-2",
                     f"reward.fn=\"{tmp_path / 'rw.py'}:fn\""), resume=False, echo=lambda *_: None)
    t.train()
    assert t.ref_model is None and any(p.abs().max() > 0 for n, p in t.model.named_parameters() if "lora_B" in n)
    base = t._reference_model()
    ids = torch.randint(0, base.spec.vocab_size, (20,), generator=torch.Generator().manual_seed(1))
    with adapters_disabled(t.model):
        off = score(t.model, ids[:16], [ids[16:]], t.gcfg)
    assert torch.equal(off[0], score(base, ids[:16], [ids[16:]], t.gcfg)[0])
    assert not torch.equal(score(t.model, ids[:16], [ids[16:]], t.gcfg)[0], off[0])
    assert read_metrics(tmp_path / "a")[-1]["kl"] != 0


def test_the_delta_rule_kernel_is_named_once_and_in_every_step(tmp_path):
    said = []
    cfg = _cfg(tmp_path / "run", "model.builtin=\"tiny-hybrid\"", "train.steps=2", "train.save_every=0")
    Trainer(cfg, resume=False, echo=said.append).train()
    rows = read_metrics(tmp_path / "run")
    # CPU: the torch chunked rule, and the recurrence's single step for each decoded token of the rollouts
    assert [r["delta_rule_kernel"] for r in rows] == ["recurrent+torch", "recurrent+torch"]
    assert [s for s in said if "delta-rule kernel" in s] == [
        "Gated DeltaNet layers run the delta-rule kernels: recurrent, torch"]


def test_graph_budget_use_is_in_the_metrics(tmp_path):
    """With algorithm.graph_budget the metrics say what the budget kept (the most of a step's calls); without one
    the keys are absent."""
    run = ["train.steps=1", "train.save_every=0", "algorithm.prompt_grad=\"exact\"",
           "algorithm.entropy_coef=0.001"]  # an update runs whatever the (untrained) model's rewards
    cfg = _cfg(tmp_path / "kept", *run, "algorithm.graph_budget=\"1G\"",
               "algorithm.reuse_rollout_state=false")  # the update prefills (a reused rollout state: no budget)
    Trainer(cfg, resume=False, echo=lambda *_: None).train()
    (row,) = read_metrics(tmp_path / "kept")
    assert row["kept_steps"] == 3 and row["kept_graph_bytes"] > 0  # 159 positions in 64-token steps: all kept
    cfg = _cfg(tmp_path / "none", *run)
    Trainer(cfg, resume=False, echo=lambda *_: None).train()
    (row,) = read_metrics(tmp_path / "none")
    assert "kept_steps" not in row and "kept_graph_bytes" not in row
    said = []  # a budget that every update's reused rollout state leaves nothing to do for is said, not silent
    cfg = _cfg(tmp_path / "reused", *run, "algorithm.graph_budget=\"1G\"")
    Trainer(cfg, resume=False, echo=said.append).train()
    (row,) = read_metrics(tmp_path / "reused")
    assert "kept_steps" not in row
    assert [s for s in said if "has no effect" in s and "reuse_rollout_state = false" in s]


def test_state_offload_trains_alike(tmp_path):
    """algorithm.offload_state on the hybrid, two prompts a step (the first group's kept state waits while the
    second rolls out) and a KL reference (its own prefill): moved after each rollout (forced on the CPU, every read
    through ops/host_memory.py, tests/host_guard.py), the run's losses and weights equal a run without it."""
    from host_guard import guarded_host

    common = ["model.builtin=\"tiny-hybrid\"", "train.steps=2", "algorithm.prompts_per_step=2",
              "algorithm.kl_coef=0.05", "reward.fn=\"regex\"", "reward.options={ pattern = \"[a-z]\" }",
              "rollout.max_new_tokens=8"]  # a random model's bytes: some contain a letter, some not
    plain = Trainer(_cfg(tmp_path / "a", *common), resume=False, echo=lambda *_: None)
    plain.train()
    with guarded_host() as read:
        moved = Trainer(_cfg(tmp_path / "b", *common, "algorithm.offload_state=true"), resume=False,
                        echo=lambda *_: None)
        moved.train()
    assert read
    a, b = read_metrics(tmp_path / "a"), read_metrics(tmp_path / "b")
    assert all(r["grad_norm"] > 0 for r in a)  # the reward gives the random model's groups a signal
    assert [r["prompt_state_bytes"] for r in b] < [r["prompt_state_bytes"] for r in a]  # device bytes: less
    drop = VOLATILE | {"prompt_state_bytes"}
    assert [{k: v for k, v in r.items() if k not in drop} for r in a] == [
        {k: v for k, v in r.items() if k not in drop} for r in b]
    for (n, p), q in zip(plain.model.named_parameters(), moved.model.parameters()):
        assert torch.equal(p, q), n


def test_builtin_kimi_trains_resumes_exactly_and_exports_for_transformers(tmp_path):
    """model.builtin = "tiny-kimi" (Kimi Delta Attention + NoPE MLA + MoE), exact mode: the run's metrics and
    weights repeat bit for bit when resumed from step 1, and the checkpoint's model loads in transformers
    (KimiLinearForCausalLM) with our logits."""
    from transformers import AutoModelForCausalLM

    import longstraw

    args = ['model.builtin="tiny-kimi"', "train.steps=2", "train.save_every=1", "algorithm.prompt_grad=\"exact\""]
    Trainer(_cfg(tmp_path / "a", *args), resume=False, echo=lambda *_: None).train()
    b = tmp_path / "b"
    Trainer(_cfg(b, *args[:1], "train.steps=1", *args[2:]), resume=False, echo=lambda *_: None).train()
    Trainer(_cfg(b, *args), resume=True, echo=lambda *_: None).train()
    assert _stable(read_metrics(tmp_path / "a")) == _stable(read_metrics(b))
    assert read_metrics(b)[0]["delta_rule_kernel"]
    model_dir = checkpoint_dirs(tmp_path / "a")[-1] / "model"
    ours = longstraw.load_model(model_dir, dtype="float32")
    assert type(ours.layers[0].mixer).__name__ == "KimiDeltaAttention"
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, experts_implementation="eager").eval()
    ids = torch.randint(0, ours.spec.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert (hf(ids).logits - ours(ids)).abs().max() <= 1e-4
    again = longstraw.load_model(checkpoint_dirs(b)[-1] / "model", dtype="float32")
    assert all(torch.equal(p, q) for (_, p), (_, q) in zip(ours.named_weights(), again.named_weights()))
