"""Exact mode with a graph budget (``GRPOConfig(graph_budget_bytes=N)``): the prefill keeps the graphs of the
latest steps that fit, the reverse pass back-propagates them without recomputation. Gradients must equal the naive
float64 reference (1e-8) for every budget: none, one step's graph, a budget that ends inside a step (its top
layers kept, the rest recomputed) and everything; for every family the exact tests cover."""

import dataclasses
import types

import pytest
import torch
from grpo_reference import assert_grads_close, random_group, reference_loss
from hf_reference import cached_pairs, tiny_hf, tiny_moe_hf
from transformers import DeepseekV3Config, GlmMoeDsaConfig, LlamaConfig, Qwen3NextConfig

import longstraw
from longstraw.engine.kept_graphs import plan_splits
from longstraw.engine.prefill import prefill
from longstraw.models.mla import set_mla_mode

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

V = 53
MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
           first_k_dense_replace=1, max_position_embeddings=256, n_group=2, topk_group=1, routed_scaling_factor=1.7)
MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=10)
HYBRID = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=V,
              max_position_embeddings=512)


def _llama():
    return tiny_hf(LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
                               num_key_value_heads=2, vocab_size=V, max_position_embeddings=512,
                               rope_theta=1000.0), seed=11, init_std=0.15)


def _qwen3_next():
    cfg = Qwen3NextConfig(**HYBRID, num_hidden_layers=3, intermediate_size=40, full_attention_interval=3,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                          shared_expert_intermediate_size=24, mlp_only_layers=[1])
    cfg._experts_implementation = "eager"
    return tiny_hf(cfg, seed=32, init_std=0.15)


FAMILIES = {  # name: (HF reference builder, MLA form, reference patch)
    "llama": (_llama, None),
    "qwen3_next": (_qwen3_next, None),
    "deepseek_v3": (lambda: tiny_moe_hf(DeepseekV3Config(**MOE, **MLA), seed=40), "decompressed"),
    "glm_moe_dsa": (lambda: tiny_moe_hf(GlmMoeDsaConfig(**MOE, **MLA, index_topk=7, index_head_dim=8,
                                                        index_n_heads=32, indexer_types=["full", "shared", "full"]),
                                        seed=42), "absorbed"),
}
_pair = cached_pairs(lambda name: FAMILIES[name][0]())


def _patch(name):
    if name == "qwen3_next":
        from test_hybrid_grpo import router64
        return router64()
    import contextlib
    return contextlib.nullcontext()


def _run(model, prompt, responses, adv, cfg):
    model.zero_grad(set_to_none=True)
    return longstraw.grpo_backward(model, prompt, responses, adv, cfg)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_every_budget_matches_reference(name):
    hf, path = _pair(name)
    prompt, responses, adv = random_group(0, 30, [5, 1, 7], V)  # 29 prefilled positions: steps of 8, 8, 8, 5
    model = longstraw.load_model(path)
    if FAMILIES[name][1] is not None:
        set_mla_mode(model, FAMILIES[name][1], decompress_chunk=4)
    base = longstraw.GRPOConfig(kl_coef=0.0, entropy_coef=0.01, prefill_chunk=8)
    hf.zero_grad()
    with _patch(name):
        loss, _ = reference_loss(hf, prompt, responses, adv, mode="token-mean", clip_c=base.clip_ratio_c,
                                 kl_coef=0.0, kl_type="low_var_kl", entropy_coef=0.01, old=None, ref=None,
                                 detached=False)
        loss.backward()
    big = _run(model, prompt, responses, adv, dataclasses.replace(base, graph_budget_bytes=1 << 40))
    assert big.kept_steps == 4 and big.kept_layers == 0 and big.kept_graph_bytes > 0
    assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
    one = big.step_graph_bytes  # one whole step of 8 tokens: the last step (5 tokens) and part of the one before
    budgets = {"zero": 0, "one step": one, "mid step": one + one // 2}
    for what, budget in budgets.items():
        stats = _run(model, prompt, responses, adv, dataclasses.replace(base, graph_budget_bytes=budget))
        assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
        assert abs(stats.loss - big.loss) <= 1e-12
        assert stats.kept_graph_bytes <= budget, what
        if what == "zero":
            assert stats.kept_steps == 0 and stats.kept_graph_bytes == 0
        else:
            assert stats.kept_steps >= 1 and 0 < stats.kept_layers < len(model.layers), (what, stats)


def test_budget_zero_and_none_are_todays_step():
    _, path = _pair("llama")
    prompt, responses, adv = random_group(1, 21, [4, 6], V)
    model = longstraw.load_model(path)
    grads = []
    for budget in (None, 0):
        model.zero_grad(set_to_none=True)
        cfg = longstraw.GRPOConfig(prefill_chunk=8, graph_budget_bytes=budget)
        stats = longstraw.grpo_backward(model, prompt, responses, adv, cfg)
        assert stats.kept_graph_bytes == stats.step_graph_bytes == 0
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_plan_splits_latest_steps_first_then_top_layers():
    per_layer = [10.0, 20.0, 30.0]  # bytes per token; whole step of 2 tokens: 120
    assert plan_splits([2, 2, 2], per_layer, 1.0, 0) == {}
    assert plan_splits([2, 2, 2], per_layer, 1.0, 10_000) == {0: (0, 120), 1: (0, 120), 2: (0, 120)}
    # 120 + top layer of step 1 (30 * 2 + boundary 2 = 62) fits in 190, two layers (102) do not
    assert plan_splits([2, 2, 2], per_layer, 1.0, 190) == {2: (0, 120), 1: (2, 62)}
    assert plan_splits([2, 2, 1], per_layer, 1.0, 60) == {2: (0, 60)}


@pytest.mark.parametrize("kwargs,msg", [
    (dict(graph_budget_bytes=-1), "graph_budget_bytes=-1 must be None or an integer"),
    (dict(graph_budget_bytes=True), "graph_budget_bytes=True must be None or an integer"),
    (dict(graph_budget_bytes=1.5), "graph_budget_bytes=1.5 must be None or an integer"),
    (dict(graph_budget_bytes=100, prompt_grad="detached"), "with prompt_grad='detached' there is none"),
])
def test_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.GRPOConfig(**kwargs)
    longstraw.GRPOConfig(graph_budget_bytes=0, prompt_grad="detached")  # 0 keeps nothing: allowed anywhere


def test_checkpointed_recompute_and_branch_batches_with_a_mid_step_budget():
    _, path = _pair("llama")
    prompt, responses, adv = random_group(2, 26, [3, 5, 2], V)
    model = longstraw.load_model(path)
    cfg = longstraw.GRPOConfig(prefill_chunk=6, branch_batch=2, checkpoint_layers=True, kl_coef=0.0)
    ref = _run(model, prompt, responses, adv, cfg)
    want = [p.grad.clone() for p in model.parameters()]
    stats = _run(model, prompt, responses, adv,
                 dataclasses.replace(cfg, graph_budget_bytes=ref.step_graph_bytes or 10 ** 5))
    assert stats.step_graph_bytes > 0
    stats = _run(model, prompt, responses, adv,
                 dataclasses.replace(cfg, graph_budget_bytes=stats.step_graph_bytes * 5 // 2))
    assert stats.kept_steps >= 2 and stats.kept_layers > 0  # steps of 6, 6, 6, 6, 1 tokens
    for p, w in zip(model.parameters(), want):
        torch.testing.assert_close(p.grad, w, rtol=1e-9, atol=1e-12)


def test_handed_in_state_keeps_nothing_and_fsdp_refuses():
    _, path = _pair("llama")
    prompt, responses, adv = random_group(3, 12, [3, 4], V)
    model = longstraw.load_model(path)
    cfg = longstraw.GRPOConfig(prefill_chunk=4, graph_budget_bytes=1 << 30)
    state = prefill(model, prompt[:-1], 4, exact=True)
    stats = longstraw.grpo_backward(model, prompt, responses, adv, cfg, prompt_state=state)
    assert stats.kept_graph_bytes == 0 and stats.step_graph_bytes == 0

    from longstraw.distributed.placement import ContextParallel

    # one rank's CP "group" under FSDP over replicas: the placement refuses, before anything runs
    model.placement = ContextParallel(types.SimpleNamespace(cp_size=1, dp_size=2, world_size=2), fsdp=True)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match=r"graph_budget_bytes=1073741824: kept prompt-step graphs under FSDP need "
                                         r"every rank on one prompt \(cp = the world size\), but this job has 2 "
                                         r"data-parallel replicas \(cp=1 of 2 ranks\)"):
        longstraw.grpo_backward(model, prompt, responses, adv, cfg)
    assert all(p.grad is None for p in model.parameters())
