"""grpo_backward (exact and detached), score and generate on the DeepSeek / GLM MoE families against the naive
float64 HF reference: DeepSeek-V3 (MLA, absorbed and decompressed), GLM-4.5 (GQA + MoE), GLM-5 (MLA + DSA with a
shared indexer layer, top-k below the sequence length so the sparse path and its gradient sink are exercised) and
GLM-4.7-Flash (glm4_moe_lite: MLA + GLM's MoE)."""

import pytest
import torch
from grpo_reference import assert_grads_close, random_group, reference_loss, run_against_reference
from hf_reference import cached_pairs, tiny_moe_hf
from transformers import DeepseekV3Config, Glm4MoeConfig, Glm4MoeLiteConfig, GlmMoeDsaConfig

import longstraw
from longstraw.models.dsa import IndexedLatentState
from longstraw.models.mla import LatentState, set_mla_mode

V = 53
MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
           first_k_dense_replace=1, max_position_embeddings=256, n_group=2, topk_group=1, routed_scaling_factor=1.7)
MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=10)
CONFIGS = {
    "deepseek_v3": lambda: DeepseekV3Config(**MOE, **MLA),
    "glm4_moe": lambda: Glm4MoeConfig(**{**MOE, "num_key_value_heads": 2, "n_group": 1}, head_dim=8,
                                      use_qk_norm=True, attention_bias=True),
    "glm_moe_dsa": lambda: GlmMoeDsaConfig(**MOE, **MLA, index_topk=7, index_head_dim=8, index_n_heads=32,
                                           indexer_types=["full", "shared", "full"]),
    "glm4_moe_lite": lambda: Glm4MoeLiteConfig(**{k: v for k, v in MOE.items() if k != "first_k_dense_replace"},
                                               **MLA),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


pair = cached_pairs(lambda name: tiny_moe_hf(CONFIGS[name](), seed=list(CONFIGS).index(name) + 40))


def _group(seed, p, lens):
    return random_group(seed, p, lens, V)


def _load(name, mode):
    model = longstraw.load_model(pair(name)[1])
    if mode is not None:
        set_mla_mode(model, mode, decompress_chunk=4)
    return model


def _run_both(name, *, p, lens, chunk, prompt_grad, mode=None, branch_batch=1, checkpoint_layers=False,
              loss_mode="token-mean", seed=0):
    hf, _ = pair(name)
    prompt, responses, adv = _group(seed, p, lens)
    model = _load(name, mode)
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, loss_agg_mode=loss_mode, kl_coef=0.05, entropy_coef=0.01,
                               prefill_chunk=chunk, branch_batch=branch_batch, checkpoint_layers=checkpoint_layers)
    stats = run_against_reference(model, hf, prompt, responses, adv, cfg, seed=seed)
    assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
    hf.zero_grad()
    return model, stats


CASES = [  # (family, MLA form, prompt length P, prefill_chunk): P-1 not a multiple of / equal to the chunk, P = 1
    ("deepseek_v3", "absorbed", 22, 8), ("deepseek_v3", "absorbed", 9, 8), ("deepseek_v3", "decompressed", 22, 8),
    ("glm4_moe", None, 22, 8), ("glm4_moe", None, 1, 8),
    ("glm_moe_dsa", "absorbed", 22, 8), ("glm_moe_dsa", "absorbed", 1, 8), ("glm_moe_dsa", "decompressed", 17, 5),
    ("glm4_moe_lite", "absorbed", 22, 8), ("glm4_moe_lite", "decompressed", 13, 4),
]


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name,mode,p,chunk", CASES)
def test_matches_naive_reference(name, mode, p, chunk, prompt_grad):
    # ragged responses with a one-token response; GLM-5: 21 + 7 positions > index_topk = 7, so the branches' and
    # the later prefill chunks' queries attend to a selection (sparse path, gradient scattered into the sink)
    _run_both(name, p=p, lens=[5, 1, 7], chunk=chunk, prompt_grad=prompt_grad, mode=mode)


def test_branch_batch_and_checkpointing_pass_the_shared_selection():
    """Shared DSA layers read the selection of their full layer from the per-call RopeTables, also when a layer is
    recomputed by activation checkpointing and when branches are replayed together."""
    _run_both("glm_moe_dsa", p=19, lens=[4, 1, 6, 3], chunk=6, prompt_grad="exact", mode="absorbed", branch_batch=3,
              checkpoint_layers=True, loss_mode="seq-mean-token-mean")


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_absorbed_backward_spread_over_key_head_views(prompt_grad, monkeypatch):
    """With several threads the absorbed backward spreads the latent key head over stride-0 views (2 here); the
    prompt gradient still reaches the state's sink."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    _run_both("deepseek_v3", p=22, lens=[5, 1, 7], chunk=8, prompt_grad=prompt_grad, mode="absorbed", branch_batch=2)


def test_exact_differs_from_detached_and_reports_the_latent_state():
    prompt, responses, adv = _group(3, 22, [4, 4])
    grads, stats = {}, {}
    for mode in ("exact", "detached"):
        model = _load("glm_moe_dsa", "absorbed")
        stats[mode] = longstraw.grpo_backward(model, prompt, responses, adv,
                                              longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=8))
        grads[mode] = longstraw.hf_grads(model)
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    assert (grads["exact"][name] - grads["detached"][name]).abs().max() > 1e-6
    # 21 positions, float64; latents (12 + 4) in every layer, indexer keys (8) in the two full layers
    assert stats["detached"].prompt_state_bytes == 21 * 8 * (3 * 16 + 2 * 8)
    assert stats["exact"].prompt_state_grad_bytes == 21 * 8 * 3 * 16  # only the latents carry a gradient
    assert stats["detached"].prompt_state_grad_bytes == 0


@pytest.mark.parametrize("name", ["deepseek_v3", "glm_moe_dsa"])
def test_score_equals_naive_logprobs(name):
    hf, _ = pair(name)
    model = _load(name, "absorbed")
    prompt, responses, adv = _group(8, 19, [5, 1, 8])
    got = longstraw.score(model, prompt, responses, longstraw.GRPOConfig(prefill_chunk=6, branch_batch=2))
    with torch.no_grad():
        _, want = reference_loss(hf, prompt, responses, adv)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("name,mode", [("deepseek_v3", "decompressed"), ("glm_moe_dsa", "absorbed"),
                                       ("glm4_moe", None), ("glm4_moe_lite", "absorbed")])
def test_generate_logprobs_equal_score(name, mode):
    model = _load(name, mode)
    prompt = torch.randint(0, V, (15,), generator=torch.Generator().manual_seed(0))
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=9, seed=4, stop_token_ids=(5, 7))
    ro = longstraw.generate(model, prompt, 4, sp, prefill_chunk=4, keep_state=True)
    if name != "glm4_moe":
        kinds = [type(s) for s in ro.prompt_state.layers]
        assert kinds == ([IndexedLatentState, LatentState, IndexedLatentState] if name == "glm_moe_dsa"
                         else [LatentState] * 3)
    want = longstraw.score(model, prompt, ro.responses, longstraw.GRPOConfig(prefill_chunk=5, temperature=0.9))
    for a, b in zip(ro.logprobs, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    # greedy decoding equals the argmax continuation of a full forward (past index_topk for GLM-5)
    g = longstraw.generate(model, prompt, 2, longstraw.SamplingConfig(temperature=0, max_new_tokens=5))
    seq = prompt.clone()
    for _ in range(5):
        seq = torch.cat([seq, model(seq[None])[0, -1].argmax()[None]])
    assert torch.equal(g.responses[0], seq[prompt.numel():]) and torch.equal(g.responses[1], g.responses[0])


@pytest.mark.parametrize("mode", ["absorbed", "decompressed"])
def test_bf16_weights_and_autocast_compute(mode):
    """bf16 latents (autocast promotes the kv norm's output to float32: the state still takes the compute dtype),
    float32 gradient sinks. Log-probs stay close to float64; the gradient only roughly, because expert routing and
    the DSA selection are discrete and some near-ties flip in bf16."""
    prompt, responses, adv = _group(12, 30, [5, 3])
    model64 = _load("glm_moe_dsa", mode)
    st64 = longstraw.grpo_backward(model64, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=8))
    want = longstraw.hf_grads(model64)
    for dtype, compute in [("bfloat16", None), ("float32", "bfloat16")]:
        model = longstraw.load_model(pair("glm_moe_dsa")[1], dtype=dtype)
        set_mla_mode(model, mode, decompress_chunk=4)
        st = longstraw.grpo_backward(model, prompt, responses, adv,
                                     longstraw.GRPOConfig(prefill_chunk=8, compute_dtype=compute))
        assert st.prompt_state_bytes == 29 * 2 * (3 * 16 + 2 * 8) and st.prompt_state_grad_bytes == 29 * 4 * 3 * 16
        for a, b in zip(st.logprobs, st64.logprobs):
            assert a.dtype == torch.float32 and (a.double() - b).abs().max() < 0.25
        got = longstraw.hf_grads(model)
        assert all(torch.isfinite(g).all() and g.dtype == getattr(torch, dtype) for g in got.values())
        num = sum(((got[n].double() - want[n]) ** 2).sum() for n in want)
        den = sum((want[n] ** 2).sum() for n in want)
        assert (num / den).sqrt() < 0.3, f"{dtype}/{compute}: relative gradient error too large"
