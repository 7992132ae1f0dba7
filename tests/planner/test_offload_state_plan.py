"""The plan of a step with the prompt state's K/V in host memory for the backward phases (``--offload-state``,
``GRPOConfig(offload_state=True)``): the attention K/V leave the replay's and the reverse pass's peak for the host,
the forward phases (prefill, rollouts) still hold all of it, and the peak is the larger of the two phases'; MLA
latents and recurrent states stay. The host bytes and the traffic are reported, the longest prompt follows the
phase that binds, and the sampled-layer plan stays equal to a dry run of every layer."""

import json

import pytest
import torch
from test_planner import DENSE, MLA, NEXT, _cli, _deep_hybrid

from longstraw import GRPOConfig
from longstraw.planner import _meta_model, plan

CASES = {"llama": DENSE, "qwen3_next": NEXT, "deepseek_v3": MLA}
BLOCK = 32768  # ops.attention.segment_attention's max_segment: the keys one staged block holds


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", ["exact", "detached"])
@pytest.mark.parametrize("prompt_len", [3000, 150_000])  # a direct dry run; a length on the long-prompt line
def test_offload_state_moves_the_kv_to_the_host(name, mode, prompt_len):
    hf = CASES[name]
    kw = dict(prompt_len=prompt_len, response_len=64, group=6, dtype="bfloat16", gpus=2, cp=2,
              max_positions=200_000)
    on = plan(hf, cfg=GRPOConfig(prompt_grad=mode, prefill_chunk=512, branch_batch=2), **kw)
    off = plan(hf, cfg=GRPOConfig(prompt_grad=mode, prefill_chunk=512, branch_batch=2, offload_state=True), **kw)
    host = off.settings.get("host")
    if name == "deepseek_v3":  # MLA latents stay on the device: nothing changes
        assert host is None and off.breakdown == on.breakdown and off.peak_bytes == on.peak_bytes
        assert "moves nothing" in off.settings["assumptions"]["prompt_state"]
        return
    moved = host["prompt_state_bytes"]
    assert moved > 0 and host["total_bytes"] == moved and host["prompt_state_grad_bytes"] == 0
    assert off.breakdown["prompt_state"] + moved == on.breakdown["prompt_state"]
    if name == "llama":  # bf16 K and V of every prefilled position, split over cp = 2: all of the state
        assert moved == DENSE["num_hidden_layers"] * 2 * (prompt_len - 1) * DENSE["hidden_size"] * 2 // 2
        assert off.breakdown["prompt_state"] == 0
    else:  # the DeltaNet layers' recurrent states stay
        assert off.breakdown["prompt_state"] > 0
    # the replay and the reverse pass copy blocks of K and V in, the next one's copy issued before this one's
    # kernels (two on the device at a time), and a reverse-pass step one boundary state of a DeltaNet layer: at
    # most that many bytes more; a rank's share of 75,000 positions (3 blocks) holds both blocks at once
    kv_per_pos = 2 * hf.get("num_key_value_heads", 1) * hf.get("head_dim", hf["hidden_size"] // hf[
        "num_attention_heads"]) * 2
    boundary = 0 if name == "llama" else 4 * 8 * 8 * 4 + (2 * 8 + 4 * 8 + 2 * 8) * 3 * 4  # S and conv, float32
    for k in ("branch_graph", "prefill_chunk"):
        extra = off.breakdown[k] - on.breakdown[k]
        assert 0 <= extra <= 2 * kv_per_pos * min(BLOCK, prompt_len) + boundary, k
        if name == "llama" and prompt_len > 4 * BLOCK and (k == "branch_graph" or mode == "exact"):
            assert extra > kv_per_pos * BLOCK, k  # (a detached step's prefill reads no moved state)
    for k in off.breakdown:
        if k not in ("prompt_state", "branch_graph", "prefill_chunk", "logits"):
            assert off.breakdown[k] == on.breakdown[k], k
    b, peaks = off.breakdown, off.settings["phase_peaks"]
    common = b["weights"] + b["grads"] + b["optimizer"] + b["gathered"]
    assert peaks["backward"] == common + b["prompt_state"] + b["prompt_state_grad"] + max(
        b["prefill_chunk"], b["branch_graph"] + b["logits"])
    early = host["prompt_state_prefill_bytes"]  # the DeltaNet boundaries, moved as the prefill supersedes them
    assert (early > 0) == (name == "qwen3_next" and mode == "exact")
    chunk = peaks["forward"] - common - on.breakdown["prompt_state"] + early  # the state and a no-grad chunk:
    assert 0 < chunk <= on.breakdown["prefill_chunk"]  # the detached plan's prefill term, less than a step's graph
    assert (chunk == on.breakdown["prefill_chunk"]) == (mode == "detached")
    ft = off.settings["forward_terms"]  # the prefill's chunk and the rollout, the larger in the forward peak
    assert peaks["forward"] == common + on.breakdown["prompt_state"] - early + max(ft.values()) and ft["rollout"] > 0
    assert off.peak_bytes == max(peaks.values()) <= on.peak_bytes
    traffic, kv = host["state_traffic_bytes"], moved - early
    assert traffic["device_to_host"] == moved
    assert traffic["replay_host_to_device"] == 3 * 2 * kv  # 3 branch batches, each a forward and a backward
    steps = -(-(prompt_len - 1) // (2 * 512))  # each reverse step reads the K/V before it twice, a boundary once
    assert traffic["reverse_host_to_device"] == (2 * kv * (steps - 1) // 2 + early if mode == "exact" else 0)
    assert "host memory during the replay" in off.settings["assumptions"]["prompt_state"]
    assert off.to_json()["host"] == host


def test_the_longest_prompt_follows_the_phase_that_binds():
    """Offloaded, the backward phases grow slowly with the prompt and the forward phases (the whole state) fast: the
    longest prompt is where the forward peak meets the limit, not where the backward line would."""
    kw = dict(response_len=64, group=2, dtype="bfloat16", gpus=2, cp=2, max_positions=4_000_000, reserve=0,
              cfg=GRPOConfig(prefill_chunk=512, offload_state=True, offload_state_grad=True))
    at = plan(DENSE, prompt_len=150_000, **kw)
    mem = int(at.settings["phase_peaks"]["forward"] * 1.3)
    res = plan(DENSE, prompt_len=150_000, gpu_mem=mem, **kw)
    n = res.max_prompt_len
    assert 150_000 < n < 4_000_000 - 64
    fit, over = plan(DENSE, prompt_len=n, gpu_mem=mem, **kw), plan(DENSE, prompt_len=int(n * 1.02), gpu_mem=mem, **kw)
    assert fit.fits and not over.fits
    assert over.settings["phase_peaks"]["forward"] > mem >= over.settings["phase_peaks"]["backward"]


@pytest.mark.parametrize("mode,ckpt", [("exact", True), ("detached", False)])
def test_sampled_layers_equal_a_full_dry_run_offloaded(monkeypatch, mode, ckpt):
    import longstraw.planner as planner

    cfg = _deep_hybrid()
    kw = dict(prompt_len=1500, response_len=16, group=2, dtype="float32",
              cfg=GRPOConfig(prompt_grad=mode, prefill_chunk=512, checkpoint_layers=ckpt, offload_state=True))
    assert planner.layer_samples(_meta_model(cfg, torch.float32)) is not None
    fast = plan(cfg, **kw)
    monkeypatch.setattr(planner, "SAMPLE_LAYERS", False)
    full = plan(cfg, **kw)
    assert fast.breakdown == full.breakdown and fast.settings["phase_peaks"] == full.settings["phase_peaks"]


def test_cli_offload_state(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    args = ["--model", str(tmp_path), "--prompt-len", "8K", "--response-len", "64", "--gpus", "2", "--cp", "2",
            "--gpu-mem", "1G", "--reserve", "0"]
    out = _cli(*args, "--offload-state", "--offload-state-grad")
    assert out.returncode == 0, out.stderr
    assert "prompt state" in out.stdout and "host->device in the replay" in out.stdout
    assert "the larger of the backward phases'" in out.stdout and "(offload_state: the attention K/V" in out.stdout
    d = json.loads(_cli(*args, "--offload-state", "--json").stdout)
    assert d["host"]["prompt_state_bytes"] > 0 and d["breakdown"]["prompt_state"] == 0
    assert set(d["phase_peaks"]) == {"forward", "backward"} and d["peak_bytes"] == max(d["phase_peaks"].values())
    bad = _cli(*args, "--offload-state", "--graph-budget", "1G")
    assert bad.returncode == 2 and "with offload_state: the kept prompt-step graphs" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


ROLLOUT_PROBE = r"""
import json, sys, torch
torch.set_num_threads(1)
import longstraw
from longstraw.models.registry import build_model
from longstraw.profiling import measure_step
cfg, p, r, g, chunk = json.loads(sys.argv[1])
model = build_model(cfg)
prompt = torch.randint(0, cfg["vocab_size"], (p,), generator=torch.Generator().manual_seed(0))
sp = longstraw.SamplingConfig(temperature=1.0, max_new_tokens=r, seed=0)
step = lambda: longstraw.generate(model, prompt, g, sp, keep_state=True, exact_state=True, prefill_chunk=chunk)
warm = lambda: longstraw.generate(model, prompt[:200], 2, longstraw.SamplingConfig(max_new_tokens=2, seed=0))
peak, _ = measure_step(step, list(model.parameters()), torch.device("cpu"), warmup=warm)
print(peak)
"""


@pytest.mark.slow  # a fresh process
def test_forward_phase_peak_within_ten_percent_of_a_measured_rollout():
    """The forward phases' peak (the state, the larger of a no-grad prefill chunk and the rollout: G branches'
    decode buffers and one decode step) against a measured ``generate`` that keeps its exact state, on a CPU; 16
    branches of 1,024 tokens make the decode buffers as large as the prompt's K/V."""
    import os
    import subprocess
    import sys

    from test_planner import SRC

    cfg = {**DENSE, "max_position_embeddings": 20000}
    p, r, g, chunk = 16384, 1024, 16, 2048
    pl = plan(cfg, prompt_len=p, response_len=r, group=g, dtype="float32",
              cfg=GRPOConfig(prefill_chunk=chunk, offload_state=True))  # offload: the plan names both phases
    predicted = pl.settings["phase_peaks"]["forward"] - pl.breakdown["weights"] - pl.breakdown["optimizer"]
    env = {**os.environ, "PYTHONPATH": SRC, "MALLOC_MMAP_THRESHOLD_": "65536"}
    out = subprocess.run([sys.executable, "-c", ROLLOUT_PROBE, json.dumps([cfg, p, r, g, chunk])], env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr
    measured = int(out.stdout.strip().splitlines()[-1])
    assert abs(predicted - measured) <= 0.10 * measured, (predicted / 2**20, measured / 2**20)


def test_a_rollout_larger_than_the_update_sets_the_peak():
    """Without any offload the forward phases bind where the rollout outgrows the update: 64 branches of 4,000
    tokens decode together (their K/V buffers), the update replays one branch at a time."""
    kw = dict(prompt_len=300, response_len=4000, dtype="bfloat16",
              cfg=GRPOConfig(prompt_grad="detached", prefill_chunk=256))
    many, few = plan(DENSE, group=64, **kw), plan(DENSE, group=2, **kw)
    peaks = many.settings["phase_peaks"]
    assert many.peak_bytes == peaks["forward"] > peaks["backward"]
    assert "phase_peaks" not in few.settings and few.peak_bytes < many.peak_bytes
    buffers = 64 * DENSE["num_hidden_layers"] * 2 * 4000 * DENSE["hidden_size"] * 2  # bf16 K and V per branch
    assert peaks["forward"] - many.breakdown["weights"] - many.breakdown["prompt_state"] >= buffers
