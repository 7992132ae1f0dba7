"""Exact mode with the state gradient in host memory (``GRPOConfig(offload_state_grad=True)``).

On a CPU host and device are one, so what can be checked here is the contract that makes it work on a GPU: every
read and write of an offloaded sink goes through ``longstraw.ops.sinks`` (which moves the data to the sink's or the
computation's device), enforced by ``tests/sink_guard.py``, with the gradients equal to the naive float64
reference for every family kind (K/V, DeltaNet, MLA in both forms, DSA's sparse path), with and without kept
graphs. The cross-device copies themselves run in ``benchmarks/gpu_check.py`` (section a).
"""

import dataclasses

import pytest
import torch
from grpo_reference import assert_grads_close, random_group, reference_loss
from sink_guard import guarded_sinks
from test_graph_budget import V, _pair, _patch

import longstraw
from longstraw.models.mla import set_mla_mode
from longstraw.ops import sinks

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

CASES = {"llama": None, "qwen3_next": None, "deepseek_v3": "decompressed", "deepseek_v3-absorbed": "absorbed",
         "glm_moe_dsa": "absorbed"}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_sinks_give_the_reference_gradients(case):
    name = case.split("-")[0]
    hf, path = _pair(name)
    prompt, responses, adv = random_group(3, 30, [5, 1, 7], V)
    model = longstraw.load_model(path)
    if CASES[case] is not None:
        set_mla_mode(model, CASES[case], decompress_chunk=4)
    hf.zero_grad()
    with _patch(name):
        loss, _ = reference_loss(hf, prompt, responses, adv, mode="token-mean", clip_c=3.0, kl_coef=0.0,
                                 kl_type="low_var_kl", entropy_coef=0.01, old=None, ref=None, detached=False)
        loss.backward()
    cfg = longstraw.GRPOConfig(entropy_coef=0.01, prefill_chunk=8, offload_state_grad=True)
    for budget in (None, 1 << 40):  # every step recomputed; every step's graph kept from the prefill
        model.zero_grad(set_to_none=True)
        with guarded_sinks() as touched:
            stats = longstraw.grpo_backward(model, prompt, responses, adv,
                                            dataclasses.replace(cfg, graph_budget_bytes=budget))
        assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
        assert "add_" in touched or "index_add_" in touched, "no gradient reached an offloaded sink"
        assert "to" in touched  # the reverse pass read its seeds through ops.sinks.read
        assert stats.prompt_state_grad_bytes > 0
        assert stats.prompt_state_grad_host_bytes == 0  # a CPU state is in host memory already: nothing apart


def test_the_guard_sees_a_direct_write():
    """The check has teeth: an op on an offloaded sink outside ops/sinks.py raises, the helpers pass."""
    like = torch.zeros(2, 3)
    with guarded_sinks():
        import longstraw.state as state

        sink = state.new_sink(like, torch.float64, True)
        sinks.add_into(sink[:, :2], torch.ones(2, 2))
        with pytest.raises(AssertionError, match="outside longstraw/ops/sinks.py"):
            sink[:, :2] += 1
        with pytest.raises(AssertionError, match="outside longstraw/ops/sinks.py"):
            torch.cat([sink, like])
        assert torch.equal(sinks.read(sink, like), torch.tensor([[1.0, 1, 0], [1, 1, 0]]))


def test_sink_placement():
    cpu = torch.zeros(2)
    meta = torch.zeros(2, device="meta")
    assert sinks.sink_device(cpu, True) == cpu.device and not sinks.offloads(cpu, True)
    assert sinks.sink_device(meta, True).type == "meta" and sinks.offloads(meta, True)  # the planner books it
    assert not sinks.offloads(meta, False)
    s = sinks.new_sink(cpu, torch.float64, True)
    assert s.dtype == torch.float64 and s.shape == cpu.shape and not s.any()
    rows = torch.zeros(3, 2)
    sinks.index_add_into(rows, torch.tensor([0, 2, 0]), torch.ones(3, 2, dtype=torch.float64))
    assert torch.equal(rows, torch.tensor([[2.0, 2], [0, 0], [1, 1]]))


@pytest.mark.parametrize("kwargs,msg", [
    (dict(offload_state_grad=True, prompt_grad="detached"), "with prompt_grad='detached' there is none"),
    (dict(offload_state_grad=1), "offload_state_grad=1 must be true or false"),
])
def test_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.GRPOConfig(**kwargs)
