"""The delta-rule kernel a step took is visible: in GRPOStats (what the trainer records per step) and once in the
log of ops.deltanet. On the CPU it is the torch chunked rule; a model without Gated DeltaNet layers names none."""

import logging

import torch

import longstraw
from longstraw.models.qwen_hybrid import tiny_config
from longstraw.ops import deltanet


def _step(cfg):
    torch.manual_seed(0)
    model = longstraw.build_model(cfg)
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg["vocab_size"], (20,), generator=g)
    responses = [torch.randint(0, cfg["vocab_size"], (n,), generator=g) for n in (3, 5)]
    return longstraw.grpo_backward(model, prompt, responses, torch.tensor([1.0, -1.0]),
                                   longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=8))


def test_hybrid_step_names_the_torch_kernel_on_cpu(caplog):
    deltanet._log_kernel.cache_clear()
    with caplog.at_level(logging.INFO, logger="longstraw.ops.deltanet"):
        st = _step(tiny_config())
        _step(tiny_config())
    assert st.delta_rule_kernel == "torch"
    lines = [r.getMessage() for r in caplog.records if r.name == "longstraw.ops.deltanet"]
    assert lines == ["Gated DeltaNet: the torch delta-rule kernel runs for cpu torch.float32 inputs"]  # once


def test_dense_step_names_no_kernel():
    st = _step({"model_type": "llama", "vocab_size": 61, "hidden_size": 32, "intermediate_size": 48,
                "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
                "max_position_embeddings": 64})
    assert st.delta_rule_kernel == ""


def test_step_names_every_kernel_its_passes_took(monkeypatch):
    """Where fla's backward refuses the GPU, forward-only passes (the prefill) take fla and passes that need a
    gradient take the torch rule: the step names both. Emulated on the CPU by the layer's kernel rule (the
    computation itself stays the torch rule here)."""
    from longstraw.models import deltanet as model_dn

    monkeypatch.setattr(model_dn, "delta_rule_kernel",
                        lambda device, dtype, needs_grad=False, channels=False, shape=None:
                        "torch" if needs_grad else "fla")
    assert _step(tiny_config()).delta_rule_kernel == "fla+torch"
    monkeypatch.setattr(model_dn, "delta_rule_kernel",
                        lambda device, dtype, needs_grad=False, channels=False, shape=None: "torch")
    assert _step(tiny_config()).delta_rule_kernel == "torch"  # a fresh model each step; and per call below
    torch.manual_seed(0)
    model = longstraw.build_model(tiny_config())
    before = model_dn.delta_rule_calls(model)
    assert before == {} and model_dn.kernels_since(model, before) == ""
    with torch.no_grad():
        model(torch.tensor([[1, 2, 3]]))
    assert model_dn.kernels_since(model, before) == "torch"
    assert model_dn.kernels_since(model, model_dn.delta_rule_calls(model)) == ""
