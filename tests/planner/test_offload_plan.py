"""The plan of an exact step with the state gradient in host memory (``--offload-state-grad``,
``GRPOConfig(offload_state_grad=True)``): the attention K/V and MLA latent gradient buffers leave the device's
peak for the host's, a recurrent layer's gradient leaves stay; the host bytes and the traffic are reported."""

import json

import pytest
from test_planner import DENSE, MLA, NEXT, _cli

from longstraw import GRPOConfig
from longstraw.planner import plan

CASES = {"llama": DENSE, "qwen3_next": NEXT, "deepseek_v3": MLA}


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("prompt_len", [3000, 150_000])  # a direct dry run; a length on the long-prompt line
def test_offload_moves_the_sink_buffers_to_the_host(name, prompt_len):
    hf = CASES[name]
    kw = dict(prompt_len=prompt_len, response_len=64, group=6, dtype="bfloat16", gpus=2, cp=2,
              max_positions=200_000, gpu_mem=8 << 30)
    base = GRPOConfig(prefill_chunk=512, branch_batch=2)
    on = plan(hf, cfg=base, **kw)
    off = plan(hf, cfg=GRPOConfig(prefill_chunk=512, branch_batch=2, offload_state_grad=True), **kw)
    host = off.settings["host"]
    moved = host["prompt_state_grad_bytes"]
    assert moved > 0 and host["optimizer_bytes"] == 0 and host["total_bytes"] == moved
    assert off.breakdown["prompt_state_grad"] + moved == on.breakdown["prompt_state_grad"]
    assert on.peak_bytes - off.peak_bytes == moved
    for k in off.breakdown:
        if k != "prompt_state_grad":
            assert off.breakdown[k] == on.breakdown[k], k
    if name == "llama":  # float32 K and V gradients of every prefilled position, split over cp = 2
        n = prompt_len - 1
        assert moved == DENSE["num_hidden_layers"] * 2 * n * DENSE["hidden_size"] * 4 // 2
        assert off.breakdown["prompt_state_grad"] == 0
    if name == "qwen3_next":  # the DeltaNet layers' gradient leaves stay on the device
        assert off.breakdown["prompt_state_grad"] > 0
    traffic = host["state_grad_traffic_bytes"]
    assert traffic["replay_device_to_host"] == 3 * moved  # G = 6 in branch batches of 2
    assert traffic["reverse_host_to_device"] == moved
    steps = -(-(prompt_len - 1) // (2 * 512))
    assert traffic["reverse_device_to_host"] == moved * (steps - 1) // 2
    assert off.max_prompt_len >= on.max_prompt_len
    assert "host memory" in off.settings["assumptions"]["prompt_state_grad"]
    assert off.to_json()["host"] == host and "host" not in on.to_json()


def test_optimizer_offload_reports_its_host_bytes():
    kw = dict(prompt_len=2048, response_len=64, group=2, dtype="bfloat16", gpus=2)
    on = plan(DENSE, **kw)
    off = plan(DENSE, optimizer_offload=True, **kw)
    assert off.breakdown["optimizer"] == 0
    assert off.settings["host"]["optimizer_bytes"] == on.breakdown["optimizer"] > 0
    assert off.settings["host"]["prompt_state_grad_bytes"] == 0


def test_cli_offload_state_grad(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    args = ["--model", str(tmp_path), "--prompt-len", "8K", "--response-len", "64", "--gpus", "2", "--cp", "2",
            "--gpu-mem", "1G", "--reserve", "0"]
    out = _cli(*args, "--offload-state-grad")
    assert out.returncode == 0, out.stderr
    assert "host memory per device: " in out.stdout and "device->host in the replay" in out.stdout
    assert "the rest in host memory (offload_state_grad)" in out.stdout
    d = json.loads(_cli(*args, "--offload-state-grad", "--json").stdout)
    assert d["host"]["prompt_state_grad_bytes"] > 0 and d["breakdown"]["prompt_state_grad"] == 0
    bad = _cli(*args, "--offload-state-grad", "--prompt-grad", "detached")
    assert bad.returncode == 2 and "--offload-state-grad moves the exact mode's state gradient" in bad.stderr
    assert len(bad.stderr.strip().splitlines()) == 1


def test_optimizer_offload_of_the_masters():
    """optimizer_offload="masters" (optim.offload = "masters", HostAdamW(master_on_host=True)): the device holds the
    weights and gradients in the compute dtype, the host float32 masters and moments (12 bytes per parameter)."""
    from longstraw.rl.config import OptimOffload

    kw = dict(prompt_len=2048, response_len=64, group=2, dtype="bfloat16", gpus=2)
    on = plan(DENSE, **kw)
    masters = plan(DENSE, optimizer_offload="masters", **kw)
    n = on.breakdown["grads"] // 4 * 2  # float32 gradient shards of the 2-way sharded parameters: n / 2 each
    assert masters.breakdown["weights"] == on.breakdown["weights"] // 2 and masters.breakdown["optimizer"] == 0
    assert masters.breakdown["grads"] == on.breakdown["grads"] // 2  # bf16
    assert masters.settings["host"]["optimizer_bytes"] == 12 * n // 2
    assert "float32 masters on the host" in masters.settings["assumptions"]["parameters"]
    assert plan(DENSE, optimizer_offload=OptimOffload.MASTERS, **kw).peak_bytes == masters.peak_bytes
    assert plan(DENSE, optimizer_offload="moments", **kw).peak_bytes == plan(DENSE, optimizer_offload=True,
                                                                             **kw).peak_bytes
    with pytest.raises(ValueError, match="optimizer_offload='all' is not supported; allowed: True, False, 'none'"):
        plan(DENSE, optimizer_offload="all", **kw)


def test_cli_optimizer_offload_values(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(DENSE))
    args = ["--model", str(tmp_path), "--prompt-len", "2K", "--gpus", "2", "--json"]
    plain = json.loads(_cli(*args, "--optimizer-offload").stdout)
    assert plain == json.loads(_cli(*args, "--optimizer-offload", "moments").stdout)
    masters = json.loads(_cli(*args, "--optimizer-offload", "masters").stdout)
    assert masters["host"]["optimizer_bytes"] > plain["host"]["optimizer_bytes"] > 0
    assert masters["peak_bytes"] < plain["peak_bytes"]
    bad = _cli(*args, "--optimizer-offload", "all")
    assert bad.returncode == 2 and "--optimizer-offload='all' is not supported; allowed: moments, masters" in bad.stderr
