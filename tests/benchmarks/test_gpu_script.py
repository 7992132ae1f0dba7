"""The prepared GPU run (benchmarks/gpu_check.py) runs end to end with ``--smoke`` (every section at tiny size on
the CPU; section c on 2 gloo ranks, d the trainer), so a lent GPU's minutes are not spent finding a bug in the
script. Its figures on a CPU mean nothing and are not checked; its pass/fail entries are (CPU float32/bfloat16
against float64)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "gpu_check.py"


@pytest.mark.slow  # a subprocess running the whole script
def test_gpu_check_smoke(tmp_path):
    out = tmp_path / "gpu.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--device", "cpu", "--planner", "--json", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert set(res["sections"]) == {"a", "b", "c", "d"}
    for name, sec in res["sections"].items():
        assert sec["ok"], (name, {k: v for k, v in sec.items() if k in ("error", "traceback")})
    a = res["sections"]["a"]
    fams = {e["family"] for e in a["entries"]}
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_check import FAMILY_CONFIGS, LORA_FAMILIES

    assert fams == set(FAMILY_CONFIGS) | {f + " + LoRA" for f in LORA_FAMILIES}  # every family, some with LoRA
    assert all(e["ok"] for e in a["entries"])
    lora = [e for e in a["entries"] if e["family"].endswith(" + LoRA")]
    assert {e["dtype"] for e in lora} == {"float32", "bfloat16"} and len(lora) == 2 * len(LORA_FAMILIES)
    assert all(e["exact"]["params"] > 0 and ".lora_" in e["exact"]["worst_param"] for e in lora)  # adapters only
    assert {e["dtype"] for e in a["entries"]} == {"float32", "bfloat16"}
    assert all(e["exact_offload"]["params"] == e["exact"]["params"] for e in a["entries"])  # held to exact's ref
    kernels = {e["family"]: e["delta_rule_kernel"] for e in a["entries"]}
    assert kernels["qwen3_5_text"] == "torch" and kernels["llama"] == ""  # CPU: the torch delta rule, named
    b = res["sections"]["b"]
    assert b["prefill"]["tokens_per_s"] > 0 and b["rollout"]["decode_tokens_per_s"] > 0
    assert b["rollout"]["tokens"] == 8 * 32
    steps = {(r["mode"], r["G"], r["checkpoint_layers"], r["offload_state_grad"]): r for r in b["steps"]["runs"]}
    assert set(steps) == {("detached", 2, False, False), ("detached", 8, False, False), ("exact", 2, False, False),
                          ("exact", 8, False, False), ("exact", 8, True, False), ("exact", 8, False, True)}
    for r in steps.values():
        assert r["finite"] and r["peak_bytes"] > 0 and r["replay_tokens_per_s"] > 0 and r["planned_bytes"] > 0
        assert r["prompt_state_grad_bytes"] > 0 if r["mode"] == "exact" else r["prompt_state_grad_bytes"] == 0
        assert r["prompt_state_grad_host_bytes"] == 0  # a CPU state is in host memory: nothing apart
    for method in ("naive", "prefix", "detached", "exact"):
        assert b["compare"]["methods"][method]["peak_bytes"] > 0, b["compare"]["methods"][method]
    assert "naive_over_detached_peak" in b["compare"] and "prefix_over_detached_peak" in b["compare"]
    runs = b["rule_blocks"]["runs"]
    assert [(r["block_tokens"], r["recompute"]) for r in runs] == [(None, False), (None, True), (1024, True),
                                                                   (4096, True)]
    assert all(r["seconds"] > 0 for r in b["rule_blocks"]["runs"])
    for mode in ("detached", "exact"):
        assert b["longest"][mode]["measured_max"] >= 512 and b["longest"][mode]["stopped_by"]
    d = res["sections"]["d"]  # the trainer: 4 steps, resumed bit for bit on the CPU, LoRA
    assert d["runs"]["full"]["steps"] == 4 and d["runs"]["resume"]["resume_equal"] is True
    assert d["runs"]["full"]["loss"] != 0.0  # the shaped reward gives the random model's groups a signal
    c = res["sections"]["c"]
    assert c["backend"] == "gloo" and c["world"] == 2 and len(c["entries"]) == 6  # dense, hybrid, GPT-OSS; CP, FSDP
    assert b["planner"]["steps"] == len(b["steps"]["runs"]) + sum(len(b["longest"][m]["runs"])
                                                                  for m in ("detached", "exact"))
    assert "planner / measured over" in proc.stdout and "summary:" in proc.stdout
    # benchmarks/plan_vs_measured.py re-plans the run's measured steps from its JSON alone: the same predictions
    again = subprocess.run([sys.executable, str(SCRIPT.parent / "plan_vs_measured.py"), str(out), "--json",
                            str(tmp_path / "plans.json")], capture_output=True, text=True, timeout=600)
    assert again.returncode == 0, again.stderr[-2000:]
    replanned = json.loads((tmp_path / "plans.json").read_text())
    key = lambda r: (r["mode"], r["prompt_len"], r["G"], r["checkpoint_layers"], r.get("offload_state_grad"),  # noqa: E731
                     r.get("offload_state"))
    planned = {key(r): r["planned_bytes"] for r in b["steps"]["runs"]}
    assert all(planned[key(r)] == r["planned_bytes"] for r in replanned if key(r) in planned)
    assert sum(key(r) in planned for r in replanned) == len(b["steps"]["runs"])
    assert len(replanned) == b["planner"]["steps"] + 2  # and the two LongStraw rows of the comparison


def test_naive_baseline_takes_transformers_torch_rule_where_fla_refuses(monkeypatch):
    """On the H200 of 2026-12-04 fla's gated backward refused Triton 3.6, and transformers' Qwen3.5 (which calls fla
    whenever it imports) raised in the naive baseline's backward: the check swaps in the torch function under
    transformers' kernel wrapper for that step only, and says so; elsewhere nothing is swapped."""
    import importlib
    import inspect
    from types import SimpleNamespace

    transformers = pytest.importorskip("transformers")
    from longstraw.ops import deltanet as ops_dn

    sys.path.insert(0, str(SCRIPT.parent))
    gpu_check = importlib.import_module("gpu_check")
    hf = importlib.import_module("transformers.models.qwen3_5.modeling_qwen3_5")
    cfg = transformers.Qwen3_5TextConfig(vocab_size=32, hidden_size=32, intermediate_size=48,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         linear_num_key_heads=2, linear_num_value_heads=2, linear_key_head_dim=16,
                                         linear_value_head_dim=16, num_hidden_layers=2,
                                         layer_types=["linear_attention", "full_attention"])
    model = hf.Qwen3_5ForCausalLM(cfg)
    wrapped = hf.torch_chunk_gated_delta_rule
    cuda = SimpleNamespace(type="cuda")
    monkeypatch.setattr(ops_dn, "fla_available", lambda channels=False: True)
    monkeypatch.setattr(ops_dn, "fla_backward_refusal", lambda: "fla refuses (test)")
    with gpu_check._hf_delta_rule(model, cuda) as what:
        assert hf.torch_chunk_gated_delta_rule is inspect.unwrap(wrapped) is not wrapped
        assert "fla refuses (test)" in what
        model(torch.randint(0, 32, (1, 5)), use_cache=False).logits.sum().backward()  # the swapped-in rule runs
    assert hf.torch_chunk_gated_delta_rule is wrapped
    with gpu_check._hf_delta_rule(model, SimpleNamespace(type="cpu")) as what:
        assert what == "" and hf.torch_chunk_gated_delta_rule is wrapped
    monkeypatch.setattr(ops_dn, "fla_backward_refusal", lambda: None)
    with gpu_check._hf_delta_rule(model, cuda) as what:
        assert what == "" and hf.torch_chunk_gated_delta_rule is wrapped


def test_decode_check_sees_a_wrong_decoder():
    """Section a's decoding check: the same weights agree to float32 rounding; other weights (a decoder computing
    something else) are far outside the float32 bound."""
    import copy
    import importlib

    import longstraw

    sys.path.insert(0, str(SCRIPT.parent))
    gpu_check = importlib.import_module("gpu_check")
    cfg = gpu_check.family_config("llama")
    torch.manual_seed(0)
    ref = longstraw.build_model(cfg).double()
    prompt = torch.randint(0, cfg["vocab_size"], (20,), generator=torch.Generator().manual_seed(3))
    same = gpu_check._decode_check(copy.deepcopy(ref).float(), torch.device("cpu"), prompt, ref, 8)
    assert same["max_abs"] <= gpu_check.TOLERANCES["float32"]["decode"]
    assert same["tokens"] == 2 * gpu_check.DECODE_TOKENS
    other = copy.deepcopy(ref).float()
    with torch.no_grad():
        other.layers[-1].ffn.down_proj.weight.mul_(1.5)
    wrong = gpu_check._decode_check(other, torch.device("cpu"), prompt, ref, 8)
    assert wrong["max_abs"] > 100 * gpu_check.TOLERANCES["float32"]["decode"]


def test_section_a_runs_first_what_has_not_run_on_a_gpu():
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_check import FAMILY_CONFIGS, LORA_FAMILIES, RAN_ON_GPU, section_a_order

    order = section_a_order()
    assert sorted(order) == sorted([(f, False) for f in FAMILY_CONFIGS] + [(f, True) for f in LORA_FAMILIES])
    assert set(RAN_ON_GPU) < set(FAMILY_CONFIGS)
    ran = [i for i, (f, lora) in enumerate(order) if not lora and f in RAN_ON_GPU]
    assert min(ran) > max(i for i, (f, lora) in enumerate(order) if lora or f not in RAN_ON_GPU)
    assert order[0] == ("qwen3_moe", False) and ("kimi_linear", False) in order[:len(FAMILY_CONFIGS) - len(RAN_ON_GPU)]


@pytest.mark.slow  # a subprocess
def test_gpu_session_script_runs_the_check_and_leaves_json_and_log(tmp_path):
    """benchmarks/gpu_session.sh (the device tool's one command) on this CPU, section c only (skipped without GPUs):
    the versions, the check's JSON and the log land in $OUT."""
    env = {**os.environ, "OUT": str(tmp_path), "WHEELS": str(tmp_path / "no-wheels"),
           "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", str(SCRIPT.parent / "gpu_session.sh"), "60", "--sections", "c"], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    log = (tmp_path / "gpu_check.log").read_text()
    assert f"torch {torch.__version__}" in log and "--budget-s 60 --a-s 150 --longest-s 40 --sections c" in log
    res = json.loads((tmp_path / "gpu_check.json").read_text())
    assert res["sections"]["c"]["ok"] and "skipped" in res["sections"]["c"]


def test_fla_backward_part_reports_each_shape(monkeypatch):
    """Section a's ``fla_backward`` part, run here with the torch rule standing in for fla's kernels (CUDA and fla
    are not at hand): each FLA_SHAPES entry reports its errors; the right kernel passes, one that halves dk (at
    one shape) fails there, and one that raises (at another) is reported as an error while the rest still run;
    past its budget the part starts no shape."""
    sys.path.insert(0, str(SCRIPT.parent))
    from gpu_check import FLA_SHAPES, _fla_backward

    from deltanet_inputs import HalfGradient

    from longstraw.ops import deltanet as dn
    from longstraw.ops.deltanet import chunk_gated_delta_rule

    def as_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm):
        shape = (g.dim() == 4, *q.shape[2:], v.shape[3])
        if shape == (True, 2, 32, 32):
            raise RuntimeError("no config fits")
        return chunk_gated_delta_rule(q, HalfGradient.apply(k) if shape == (False, 4, 128, 256) else k, v, g, beta,
                                      scale=scale, initial_state=initial_state,
                                      output_final_state=output_final_state, use_qk_l2norm=use_qk_l2norm)

    monkeypatch.setattr(dn, "_fla_call", as_fla)
    monkeypatch.setattr(dn, "fla_backward_refusal", lambda: None)
    monkeypatch.setattr(dn, "FLA_CHECK_TOKENS", 40)
    lines = []
    out = _fla_backward(torch.device("cpu"), lines.append, require_cuda=False)
    keys = [f"{k} {h}x{dk}x{dv}" for k, (h, dk, dv) in FLA_SHAPES]
    assert [k for k in out if k in keys] == keys and len(lines) == len(keys) and out["tokens"] == 40
    assert out["chunk_kda 2x32x32"]["error"] == "RuntimeError: no config fits"
    bad = out["chunk_gated_delta_rule 4x128x256"]
    assert not bad["ok"] and bad["errors"]["dk"] == pytest.approx(0.5, abs=0.01)
    assert "chunk_gated_delta_rule 4x128x256: worst 5.0e-01 (dk), " in "\n".join(lines) and "s -> FAIL" in lines[-1]
    good = [k for k in keys if k not in ("chunk_kda 2x32x32", "chunk_gated_delta_rule 4x128x256")]
    assert all(out[k]["ok"] and set(out[k]["errors"]) >= {"dk", "dg", "dstate"} for k in good)
    assert _fla_backward(torch.device("cpu"), lines.append) == {"skipped": "needs CUDA and fla"}
    out = _fla_backward(torch.device("cpu"), lines.append, require_cuda=False, budget_s=0.0)  # out of time at once
    assert all(out[k] == {"skipped": "the part's 0 s were spent"} for k in keys)
