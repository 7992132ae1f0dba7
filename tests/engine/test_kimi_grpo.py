"""grpo_backward (exact and detached), score and generate on Kimi-Linear (Kimi Delta Attention + NoPE MLA + MoE)
against the naive float64 HF reference: the per-channel-gate delta rule's state handed chunk to chunk in the
prefill, differentiated through in the exact reverse pass, and decoded one token at a time."""

import pytest
import torch
from grpo_reference import assert_grads_close, check_score_and_generate, random_group, run_against_reference
from hf_reference import cached_pairs, tiny_moe_hf
from test_hybrid_grpo import router64
from transformers import KimiLinearConfig

import longstraw
from longstraw.models.deltanet import RecurrentState
from longstraw.models.kimi import tiny_config
from longstraw.models.mla import LatentState, set_mla_mode

V = 64

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

CONFIGS = {
    "kimi": lambda: tiny_config(),
    # MLA first and a KDA head size that is no power of two; low-rank queries
    "kimi-mla-first": lambda: tiny_config(
        q_lora_rank=12, linear_attn_config={"num_heads": 3, "head_dim": 6, "short_conv_kernel_size": 3,
                                            "kda_layers": [2, 3], "full_attn_layers": [1, 4]}),
}


def _hf_config(name):
    return KimiLinearConfig(**{k: v for k, v in CONFIGS[name]().items() if k not in ("model_type", "architectures")})


pair = cached_pairs(lambda name: tiny_moe_hf(_hf_config(name), seed=list(CONFIGS).index(name) + 60))


def _load(name, mode="absorbed"):
    model = longstraw.load_model(pair(name)[1])
    set_mla_mode(model, mode, decompress_chunk=4)
    return model


CASES = [  # (config, MLA form, prompt length P, prefill_chunk, branch_batch): P - 1 not a multiple of / below /
    # equal to the chunk, P = 1, several 64-token rule chunks in one prefill chunk
    ("kimi", "absorbed", 23, 7, 1), ("kimi", "decompressed", 9, 8, 2), ("kimi", "absorbed", 1, 8, 1),
    ("kimi", "absorbed", 150, 100, 3), ("kimi-mla-first", "decompressed", 30, 8, 1),
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


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_checkpointed_layers_match_reference(prompt_grad):
    hf, _ = pair("kimi")
    prompt, responses, adv = random_group(5, 31, [4, 1, 6], V)
    model = _load("kimi")
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=8, branch_batch=2, checkpoint_layers=True)
    run_against_reference(model, hf, prompt, responses, adv, cfg, hf_patch=router64)
    assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
    hf.zero_grad()


def test_exact_differs_from_detached_and_reports_the_state():
    """The KDA state carries gradient to the prompt; the state bytes: the conv window + per-head [D, D] matrix per
    boundary for each KDA layer, the latents per position for the MLA layer."""
    prompt, responses, adv = random_group(3, 41, [4, 4], V)
    grads, stats = {}, {}
    for mode in ("exact", "detached"):
        model = _load("kimi")
        stats[mode] = longstraw.grpo_backward(model, prompt, responses, adv,
                                              longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=8))
        grads[mode] = longstraw.hf_grads(model)
    name = "model.layers.0.self_attn.forget_gate.f_a_proj.weight"
    assert (grads["exact"][name] - grads["detached"][name]).abs().max() > 1e-6
    one = 3 * 16 * 3 * 8 + 2 * 8 * 8 * 8  # conv [3 * 2 * 8, K - 1 = 3] + S [2, 8, 8], float64
    lat = 40 * (8 + 4) * 8
    assert stats["detached"].prompt_state_bytes == 3 * one + lat
    assert stats["exact"].prompt_state_bytes == 3 * 5 * one + lat  # 40 positions, chunk 8: 5 boundaries


def test_score_and_generate():
    hf, _ = pair("kimi")
    model = _load("kimi")
    prompt, responses, adv = random_group(8, 19, [5, 1, 8], V)
    with router64():
        ro = check_score_and_generate(model, hf, prompt, responses, adv,
                                      longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=10, seed=4))
    assert len(ro.responses) == 3
    ro = longstraw.generate(model, prompt, 2, longstraw.SamplingConfig(max_new_tokens=3, seed=1), keep_state=True)
    assert [type(s) for s in ro.prompt_state.layers] == [RecurrentState, RecurrentState, LatentState, RecurrentState]
    assert model.layers[0].mixer.kernel_calls.get("recurrent", 0) > 0  # decoding took the one-token step
