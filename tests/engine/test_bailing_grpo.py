"""grpo_backward (exact and detached), score and generate on Ling 3.0 (bailing_hybrid: KDA with full-rank, bounded
gates + MLA with a head gate and RoPE + MoE) against the naive float64 HF reference."""

import pytest
import torch
from grpo_reference import assert_grads_close, check_score_and_generate, random_group, run_against_reference
from hf_reference import cached_pairs, tiny_moe_hf
from test_hybrid_grpo import router64
from transformers import BailingHybridConfig

import longstraw
from longstraw.models.bailing import tiny_config
from longstraw.models.deltanet import RecurrentState
from longstraw.models.mla import LatentState, set_mla_mode

V = 61

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

CONFIGS = {
    "ling": lambda: tiny_config(),
    # MLA first, Kimi-Linear's unbounded gate, KDA heads of their own (3 of 6, conv 3)
    "ling-mla-first": lambda: tiny_config(
        kda_safe_gate=False, linear_num_heads=3, linear_head_dim=6, linear_conv_kernel_dim=3,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"]),
}


def _hf_config(name):
    return BailingHybridConfig(**{k: v for k, v in CONFIGS[name]().items()
                                  if k not in ("model_type", "architectures")})


pair = cached_pairs(lambda name: tiny_moe_hf(_hf_config(name), seed=list(CONFIGS).index(name) + 70))


def _load(name, mode="absorbed"):
    model = longstraw.load_model(pair(name)[1])
    set_mla_mode(model, mode, decompress_chunk=4)
    return model


CASES = [  # (config, MLA form, prompt length P, prefill_chunk, branch_batch)
    ("ling", "absorbed", 23, 7, 1), ("ling", "decompressed", 9, 8, 2), ("ling", "absorbed", 150, 100, 3),
    ("ling-mla-first", "decompressed", 30, 8, 1),
]


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name,mode,p,chunk,branch_batch", CASES)
def test_matches_naive_reference(name, mode, p, chunk, branch_batch, prompt_grad):
    hf, _ = pair(name)
    prompt, responses, adv = random_group(p, p, [5, 1, 70, 3], V)  # 70: two rule chunks in one replay
    model = _load(name, mode)
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, loss_agg_mode="seq-mean-token-mean", kl_coef=0.05,
                               entropy_coef=0.01, prefill_chunk=chunk, branch_batch=branch_batch)
    run_against_reference(model, hf, prompt, responses, adv, cfg, seed=p, hf_patch=router64)
    assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
    hf.zero_grad()


def test_exact_differs_from_detached():
    """The KDA and MLA prompt states carry gradient to the prompt's tokens in exact mode only."""
    prompt, responses, adv = random_group(3, 41, [4, 4], V)
    grads = {}
    for mode in ("exact", "detached"):
        model = _load("ling")
        longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=8))
        grads[mode] = longstraw.hf_grads(model)
    for name in ("model.layers.0.self_attn.forget_gate.f_proj.weight", "model.layers.1.self_attn.g_proj.weight"):
        assert (grads["exact"][name] - grads["detached"][name]).abs().max() > 1e-6, name


def test_score_and_generate():
    hf, _ = pair("ling")
    model = _load("ling")
    prompt, responses, adv = random_group(8, 19, [5, 1, 8], V)
    with router64():
        ro = check_score_and_generate(model, hf, prompt, responses, adv,
                                      longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=10, seed=4))
    assert len(ro.responses) == 3
    ro = longstraw.generate(model, prompt, 2, longstraw.SamplingConfig(max_new_tokens=3, seed=1), keep_state=True)
    assert [type(s) for s in ro.prompt_state.layers] == [RecurrentState, LatentState, RecurrentState, LatentState]
