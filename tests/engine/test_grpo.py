"""grpo_backward (exact and detached) and score against the naive HF reference in float64."""

import pytest
import torch
from grpo_reference import assert_grads_close, random_group, reference_loss, run_against_reference
from hf_reference import save_tiny, tiny_hf
from transformers import LlamaConfig, Qwen3Config, SeedOssConfig

import longstraw

V = 61


@pytest.fixture(scope="module")
def llama_pair():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, rope_theta=1000.0)
    hf = tiny_hf(cfg, seed=11, init_std=0.15)
    return hf, save_tiny(hf)


@pytest.fixture(scope="module")
def qwen3_pair():
    cfg = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=1, head_dim=12, vocab_size=V, max_position_embeddings=512,
                      tie_word_embeddings=True)
    hf = tiny_hf(cfg, seed=12, init_std=0.15)
    return hf, save_tiny(hf)


@pytest.fixture(scope="module")
def seed_oss_pair():
    """Seed-OSS: q/k/v and o_proj biases, a free head_dim, dropout 0.1 as released (not applied)."""
    cfg = SeedOssConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, head_dim=12, vocab_size=V, max_position_embeddings=512,
                        attention_out_bias=True, attention_dropout=0.1, residual_dropout=0.1)
    hf = tiny_hf(cfg, seed=13, init_std=0.15)
    return hf, save_tiny(hf)


def _group(seed, p, lens):
    return random_group(seed, p, lens, V)


def _run_both(pair, *, p, lens, mode, chunk, prompt_grad, branch_batch=1, kl=True, entropy=0.01, clip_c=3.0,
              checkpoint_layers=False, seed=0, off_policy=True, kl_type="low_var_kl", **loss):
    hf, path = pair
    prompt, responses, adv = _group(seed, p, lens)
    model = longstraw.load_model(path)
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, loss_agg_mode=mode, clip_ratio_c=clip_c,
                               kl_coef=0.05 if kl else 0.0, kl_type=kl_type, entropy_coef=entropy,
                               prefill_chunk=chunk, branch_batch=branch_batch, checkpoint_layers=checkpoint_layers,
                               **loss)
    stats = run_against_reference(model, hf, prompt, responses, adv, cfg, seed=seed, off_policy=off_policy)
    return model, hf, stats


MODES = ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_every_loss_mode_matches_reference(llama_pair, mode, prompt_grad):
    # P-1 = 21 prompt positions, chunk 8: not a multiple; ragged responses incl. a one-token response
    model, hf, stats = _run_both(llama_pair, p=22, lens=[5, 1, 9, 3], mode=mode, chunk=8, prompt_grad=prompt_grad)
    assert_grads_close(longstraw.hf_grads(model), hf)
    assert stats.metrics["pg_clipfrac"] > 0 and stats.metrics["pg_clipfrac_lower"] > 0  # both clips active


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("loss", [dict(ratio_level="sequence"), dict(kl_type="k3", kl_ratio_weight=True),
                                  dict(ratio_level="sequence", kl_type="k3", kl_ratio_weight=True)])
def test_sequence_ratio_k3_and_ratio_weighted_kl_match_reference(llama_pair, prompt_grad, loss):
    """TRL's options in the engine (GSPO's sequence-level ratio, the unclamped k3 KL, the ratio-weighted KL)
    against the naive full-graph reference, which states them on its own."""
    model, hf, _ = _run_both(llama_pair, p=19, lens=[4, 1, 7], mode="seq-mean-token-mean", chunk=6,
                             prompt_grad=prompt_grad, branch_batch=2, **loss)
    assert_grads_close(longstraw.hf_grads(model), hf)


@pytest.mark.parametrize("p,chunk", [(6, 16), (17, 16), (41, 16), (2, 4), (1, 4)])
def test_prompt_lengths_around_the_chunk(llama_pair, p, chunk):
    # P-1 below, equal to, and not a multiple of prefill_chunk; a 1-token prompt (nothing to prefill)
    model, hf, _ = _run_both(llama_pair, p=p, lens=[4, 7, 2], mode="token-mean", chunk=chunk, prompt_grad="exact")
    assert_grads_close(longstraw.hf_grads(model), hf)


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_branch_batch_and_checkpointing_and_tied_gqa4(qwen3_pair, prompt_grad):
    model, hf, _ = _run_both(qwen3_pair, p=30, lens=[6, 2, 8, 1, 5], mode="seq-mean-token-mean", chunk=7,
                             prompt_grad=prompt_grad, branch_batch=3, checkpoint_layers=True)
    assert_grads_close(longstraw.hf_grads(model), hf)


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_seed_oss_matches_reference(seed_oss_pair, prompt_grad):
    model, hf, _ = _run_both(seed_oss_pair, p=21, lens=[5, 1, 8], mode="token-mean", chunk=6, prompt_grad=prompt_grad,
                             branch_batch=2)
    assert_grads_close(longstraw.hf_grads(model), hf)


def test_on_policy_no_kl_no_dual_clip(llama_pair):
    model, hf, _ = _run_both(llama_pair, p=13, lens=[3, 6], mode="token-mean", chunk=5, prompt_grad="exact",
                             kl=False, entropy=0.0, clip_c=None, off_policy=False)
    assert_grads_close(longstraw.hf_grads(model), hf)


def test_exact_differs_from_detached(llama_pair):
    """The prompt path carries real gradient: exact != detached on prompt-side parameters."""
    _, path = llama_pair
    prompt, responses, adv = _group(3, 25, [4, 4])
    grads = {}
    for mode in ("exact", "detached"):
        model = longstraw.load_model(path)
        longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=8))
        grads[mode] = longstraw.hf_grads(model)
    name = "model.layers.0.self_attn.k_proj.weight"
    assert (grads["exact"][name] - grads["detached"][name]).abs().max() > 1e-6


def test_groups_accumulate_with_a_step_global_normaliser(llama_pair):
    """Two groups with loss_scale = D over both equal one reference loss over both groups' tokens."""
    hf, path = llama_pair
    model = longstraw.load_model(path)
    groups = [_group(5, 15, [3, 5]), _group(6, 9, [2, 7, 4])]
    d = longstraw.loss_denominator([r.numel() for _, rs, _ in groups for r in rs], "token-mean")
    cfg = longstraw.GRPOConfig(prefill_chunk=4, clip_ratio_c=None)
    hf.zero_grad()
    for prompt, responses, adv in groups:
        longstraw.grpo_backward(model, prompt, responses, adv, cfg, loss_scale=d)
        loss, _ = reference_loss(hf, prompt, responses, adv, mode="seq-mean-token-sum", clip_c=None)
        # seq-mean-token-sum over the group = sum_i sum_t l / G; rescale to sum / D over both groups
        (loss * len(responses) / d).backward()
    assert_grads_close(longstraw.hf_grads(model), hf)


def test_score_equals_naive_logprobs(llama_pair):
    hf, path = llama_pair
    model = longstraw.load_model(path)
    prompt, responses, adv = _group(8, 19, [5, 1, 8])
    got = longstraw.score(model, prompt, responses, longstraw.GRPOConfig(prefill_chunk=6, branch_batch=2))
    with torch.no_grad():
        _, want = reference_loss(hf, prompt, responses, adv)
    for a, b in zip(got, want):
        assert a.dtype == torch.float64 and a.shape == b.shape
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert all(p.grad is None for p in model.parameters())


def test_stats_report_phases_and_state_size(llama_pair):
    _, path = llama_pair
    model = longstraw.load_model(path)
    prompt, responses, adv = _group(9, 33, [3, 4])
    st = longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=8))
    assert set(st.seconds) == {"prefill", "replay", "prompt_backward", "total"}
    assert set(st.peak_memory) == {"prefill", "replay", "prompt_backward"}
    # K and V, 2 layers, 2 kv heads x 8 dims, 32 positions, float64
    assert st.prompt_state_bytes == 2 * 2 * 2 * 8 * 32 * 8 == st.prompt_state_grad_bytes
    assert st.num_tokens == 7 and st.prompt_len == 33


# ------------------------------------------------------------------------------------------------ bad input


def _bad_calls(prompt, responses, adv):
    cfg = longstraw.GRPOConfig(prefill_chunk=8)
    nan = float("nan")
    return [
        (dict(prompt_ids=prompt[:0]), "prompt_ids is empty"),
        (dict(responses=[responses[0], responses[1][:0]]), r"responses\[1\] is empty"),
        (dict(responses=[]), "non-empty list"),
        (dict(advantages=adv[:1]), "1 advantages for 2 responses"),
        (dict(advantages=torch.tensor([0.5, nan])), "advantages must be finite, got nan"),
        (dict(old_logprobs=[torch.zeros(3), torch.zeros(2)]), r"old_logprobs\[1\] has shape \(2,\), response 1 has 4"),
        (dict(old_logprobs=[torch.zeros(3), torch.full((4,), float("inf"))]), r"old_logprobs\[1\] holds a non-finite"),
        (dict(responses=[responses[0], torch.tensor([1, V + 3])]), rf"token id {V + 3} is outside the vocabulary"),
        (dict(responses=[responses[0], torch.zeros(600, dtype=torch.long)]),
         r"prompt \(10 tokens\) \+ responses\[1\] \(600 tokens\) needs 610 positions, more than the model's "
         r"max_position_embeddings=512"),
        (dict(cfg=longstraw.GRPOConfig(kl_coef=0.1)), "kl_coef=0.1 needs ref_logprobs"),
        (dict(loss_scale=0.0), "loss_scale=0.0 must be a finite number > 0"),
    ], cfg


def test_bad_input_raises_and_leaves_grad_untouched(llama_pair):
    _, path = llama_pair
    model = longstraw.load_model(path)
    prompt, responses, adv = _group(10, 10, [3, 4])
    cfg = longstraw.GRPOConfig(prefill_chunk=8)
    longstraw.grpo_backward(model, prompt, responses, adv, cfg)
    before = {n: g.clone() for n, g in longstraw.hf_grads(model).items()}
    calls, cfg = _bad_calls(prompt, responses, adv)
    for override, msg in calls:
        kw = dict(prompt_ids=prompt, responses=responses, advantages=adv, cfg=cfg)
        kw.update(override)
        with pytest.raises(ValueError, match=msg):
            longstraw.grpo_backward(model, **kw)
    after = longstraw.hf_grads(model)
    assert all(torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(prompt_grad="full"), r"prompt_grad='full' is not supported; allowed: 'exact', 'detached'"),
    (dict(loss_agg_mode="mean"), r"loss_agg_mode='mean' is not supported; allowed: 'token-mean'"),
    (dict(kl_type="k4"), r"kl_type='k4' is not supported; allowed: 'k1', 'k2', 'k3', 'low_var_kl'"),
    (dict(ratio_level="seq"), r"ratio_level='seq' is not supported; allowed: 'token', 'sequence'"),
    (dict(kl_ratio_weight=1), r"kl_ratio_weight=1 must be true or false"),
    (dict(prefill_chunk=0), r"prefill_chunk=0 must be an integer >= 1"),
    (dict(clip_ratio_c=0.5), r"clip_ratio_c=0.5 must be a finite number > 1"),
    (dict(clip_ratio_c=float("inf")), r"clip_ratio_c=inf must be a finite number > 1"),
    (dict(temperature=float("inf")), r"temperature=inf must be a finite number > 0"),
    (dict(temperature="1"), r"temperature='1' must be a finite number > 0"),
    (dict(loss_scale_factor=float("nan")), r"loss_scale_factor=nan must be a finite number > 0"),
    (dict(checkpoint_layers="yes"), r"checkpoint_layers='yes' must be true or false"),
    (dict(branch_batch=2.0), r"branch_batch=2.0 must be an integer >= 1"),
    (dict(clip_ratio_low=-0.1), r"clip_ratio_low=-0.1 must be a finite number >= 0"),
    (dict(compute_dtype="int8"), r"compute_dtype='int8' is not supported"),
])
def test_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.GRPOConfig(**kwargs)


def test_config_takes_numpy_numbers():
    import numpy as np

    cfg = longstraw.GRPOConfig(graph_budget_bytes=np.int64(1 << 20), prefill_chunk=np.int32(64),
                               temperature=np.float32(0.7))
    assert type(cfg.graph_budget_bytes) is int and type(cfg.prefill_chunk) is int and cfg.graph_budget_bytes == 1 << 20


def test_group_advantages():
    adv = longstraw.group_advantages([1.0, 0.0, 0.0, 1.0])
    r = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    torch.testing.assert_close(adv, ((r - r.mean()) / (r.std() + 1e-6)).float())
    assert torch.equal(longstraw.group_advantages([0.5, 0.5, 0.5]), torch.zeros(3))
    assert torch.equal(longstraw.group_advantages([2.0, 0.0], norm_by_std=False), torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="rewards must be finite, got nan"):
        longstraw.group_advantages([1.0, float("nan")])


def test_bf16_weights_and_autocast_compute(llama_pair):
    _, path = llama_pair
    prompt, responses, adv = _group(12, 40, [5, 3])
    model64 = longstraw.load_model(path)
    longstraw.grpo_backward(model64, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=16))
    want = longstraw.hf_grads(model64)
    for dtype, compute in [("bfloat16", None), ("float32", "bfloat16")]:
        model = longstraw.load_model(path, dtype=dtype)
        st = longstraw.grpo_backward(model, prompt, responses, adv,
                                     longstraw.GRPOConfig(prefill_chunk=16, compute_dtype=compute))
        assert all(lp.dtype == torch.float32 for lp in st.logprobs)
        got = longstraw.hf_grads(model)
        assert all(g.dtype == getattr(torch, dtype) for g in got.values())
        num = sum(((got[n].double() - want[n]) ** 2).sum() for n in want)
        den = sum((want[n] ** 2).sum() for n in want)
        assert (num / den).sqrt() < 0.1, f"{dtype}/{compute}: relative gradient error too large"
