"""grpo_backward (exact and detached), score and generate on hybrid DeltaNet models against the naive float64 HF
reference: a dense Qwen3.5 hybrid and a Qwen3-Next MoE hybrid."""

import contextlib

import pytest
import torch
from grpo_reference import assert_grads_close, random_group, reference_loss, run_against_reference
from hf_reference import float64_softmax, save_tiny, tiny_hf
from transformers import AutoModelForCausalLM, Qwen3NextConfig
from transformers.cache_utils import LinearAttentionLayer
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

import longstraw
import longstraw.engine.grpo
from longstraw.models.deltanet import RecurrentState

V = 53


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def _update_recurrent_out_of_place(self, recurrent_states, state_idx=0, **kwargs):
    if not self.is_recurrent_states_initialized[state_idx]:
        self.lazy_initialization(recurrent_states=recurrent_states, state_idx=state_idx)
    self.recurrent_states[state_idx] = recurrent_states
    return recurrent_states


@contextlib.contextmanager
def router64():
    """Make the HF hybrid a float64 reference that autograd can run through a cache:

    * HF's MoE router computes its softmax with ``dtype=torch.float``: keep it float64;
    * HF's linear-attention cache updates the recurrent state with an in-place ``copy_`` (static addresses for
      CUDA graphs), which breaks autograd through a branch that reads and then updates the cached prompt state
      (the detached reference): assign the new state instead. The math is unchanged.
    """
    orig = LinearAttentionLayer.update_recurrent_state
    LinearAttentionLayer.update_recurrent_state = _update_recurrent_out_of_place
    try:
        with float64_softmax():
            yield
    finally:
        LinearAttentionLayer.update_recurrent_state = orig


COMMON = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
              linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=V,
              max_position_embeddings=512)


def _pair(config, seed):
    config._experts_implementation = "eager"
    hf = tiny_hf(config, seed=seed, init_std=0.15)
    return hf, save_tiny(hf)


@pytest.fixture(scope="module")
def dense_pair():
    return _pair(Qwen3_5TextConfig(**COMMON, num_hidden_layers=3, intermediate_size=48, full_attention_interval=2),
                 seed=31)


@pytest.fixture(scope="module")
def moe_pair():
    return _pair(Qwen3NextConfig(**COMMON, num_hidden_layers=3, intermediate_size=40, full_attention_interval=3,
                                 num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                 shared_expert_intermediate_size=24, mlp_only_layers=[1]), seed=32)


@pytest.fixture(scope="module")
def q35_moe_pair():
    return _pair(Qwen3_5MoeTextConfig(**COMMON, num_hidden_layers=4, full_attention_interval=2, num_experts=4,
                                      num_experts_per_tok=2, moe_intermediate_size=16,
                                      shared_expert_intermediate_size=24), seed=33)


def _group(seed, p, lens):
    return random_group(seed, p, lens, V)


def _run_both(pair, *, p, lens, chunk, prompt_grad, branch_batch=1, mode="token-mean", seed=0, **extra):
    hf, path = pair
    prompt, responses, adv = _group(seed, p, lens)
    model = longstraw.load_model(path)
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, loss_agg_mode=mode, kl_coef=0.05, entropy_coef=0.01,
                               prefill_chunk=chunk, branch_batch=branch_batch, **extra)
    stats = run_against_reference(model, hf, prompt, responses, adv, cfg, seed=seed, hf_patch=router64)
    return model, hf, stats


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("p,chunk", [(6, 8), (9, 8), (30, 8), (1, 8), (100, 64)])
def test_dense_hybrid_matches_reference(dense_pair, prompt_grad, p, chunk):
    # P-1 prompt positions below / equal to / not a multiple of prefill_chunk, none at all, one 64-chunk + rest;
    # ragged responses with a one-token response
    model, hf, _ = _run_both(dense_pair, p=p, lens=[5, 1, 7], chunk=chunk, prompt_grad=prompt_grad)
    assert_grads_close(longstraw.hf_grads(model), hf)


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("p,chunk,branch_batch", [(23, 7, 1), (17, 16, 3), (2, 4, 2)])
def test_moe_hybrid_matches_reference(moe_pair, prompt_grad, p, chunk, branch_batch):
    model, hf, _ = _run_both(moe_pair, p=p, lens=[4, 1, 6, 3], chunk=chunk, prompt_grad=prompt_grad,
                             branch_batch=branch_batch, mode="seq-mean-token-mean")
    assert_grads_close(longstraw.hf_grads(model), hf)


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_hybrid_with_checkpointed_layers_matches_reference(dense_pair, prompt_grad):
    """Layer checkpointing re-runs each layer's forward in the backward, the delta rule's recomputing backward
    included (its forward saved nothing but inputs and block states)."""
    model, hf, _ = _run_both(dense_pair, p=30, lens=[5, 1, 7], chunk=8, prompt_grad=prompt_grad, branch_batch=2,
                             checkpoint_layers=True)
    assert_grads_close(longstraw.hf_grads(model), hf)


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_qwen3_5_moe_matches_reference(q35_moe_pair, prompt_grad):
    model, hf, _ = _run_both(q35_moe_pair, p=19, lens=[5, 1, 3], chunk=8, prompt_grad=prompt_grad,
                             mode="seq-mean-token-sum-norm")
    assert_grads_close(longstraw.hf_grads(model), hf)


def test_exact_differs_from_detached_and_reports_state(dense_pair):
    """The recurrent state carries real gradient to the prompt; the stats report the O(P/chunk) boundary storage."""
    _, path = dense_pair
    prompt, responses, adv = _group(3, 41, [4, 4])
    grads, stats = {}, {}
    for mode in ("exact", "detached"):
        model = longstraw.load_model(path)
        stats[mode] = longstraw.grpo_backward(model, prompt, responses, adv,
                                              longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=8))
        grads[mode] = longstraw.hf_grads(model)
    name = "model.layers.0.linear_attn.in_proj_qkv.weight"
    assert (grads["exact"][name] - grads["detached"][name]).abs().max() > 1e-6
    # 40 positions, chunk 8 -> 5 boundaries; 2 DeltaNet layers: conv [C=32+32, K-1=3] + S [4, 8, 8], float64;
    # 1 attention layer: K and V of 40 positions x 1 head x 16 dims
    one = (2 * 16 + 32) * 3 * 8 + 4 * 8 * 8 * 8
    kv = 2 * 40 * 16 * 8
    assert stats["detached"].prompt_state_bytes == 2 * one + kv
    assert stats["exact"].prompt_state_bytes == 2 * 5 * one + kv
    assert stats["exact"].prompt_state_grad_bytes == 2 * 2 * one + kv  # two boundary leaf sets at once per layer
    assert stats["detached"].prompt_state_grad_bytes == 0


def test_score_equals_naive_logprobs(moe_pair):
    hf, path = moe_pair
    model = longstraw.load_model(path)
    prompt, responses, adv = _group(8, 19, [5, 1, 8])
    got = longstraw.score(model, prompt, responses, longstraw.GRPOConfig(prefill_chunk=6, branch_batch=2))
    with torch.no_grad(), router64():
        _, want = reference_loss(hf, prompt, responses, adv)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


@pytest.mark.parametrize("which", ["dense", "moe"])
def test_generate_logprobs_equal_score(which, dense_pair, moe_pair):
    _, path = dense_pair if which == "dense" else moe_pair
    model = longstraw.load_model(path)
    prompt = torch.randint(0, V, (29,), generator=torch.Generator().manual_seed(0))
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=10, seed=4, stop_token_ids=(5,))
    ro = longstraw.generate(model, prompt, 5, sp, prefill_chunk=8, keep_state=True)
    assert len(ro.responses) == 5
    assert all(isinstance(st, RecurrentState) for st, layer in zip(ro.prompt_state.layers, model.layers)
               if layer.mixer_name == "linear_attn")
    want = longstraw.score(model, prompt, ro.responses, longstraw.GRPOConfig(prefill_chunk=5, temperature=0.9))
    for a, b in zip(ro.logprobs, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    # greedy decoding equals the argmax continuation of a full forward
    g = longstraw.generate(model, prompt, 2, longstraw.SamplingConfig(temperature=0, max_new_tokens=6))
    seq = prompt.clone()
    for _ in range(6):
        seq = torch.cat([seq, model(seq[None])[0, -1].argmax()[None]])
    assert torch.equal(g.responses[0], seq[prompt.numel():]) and torch.equal(g.responses[1], g.responses[0])


def test_rollout_state_reused_by_exact_step(dense_pair):
    _, path = dense_pair
    model = longstraw.load_model(path)
    prompt = torch.randint(0, V, (26,), generator=torch.Generator().manual_seed(1))
    ro = longstraw.generate(model, prompt, 3, longstraw.SamplingConfig(max_new_tokens=5, seed=2), keep_state=True,
                            exact_state=True, prefill_chunk=8)
    adv = torch.tensor([1.0, -0.5, 0.2])
    cfg = longstraw.GRPOConfig(prefill_chunk=8)
    longstraw.grpo_backward(model, prompt, ro.responses, adv, cfg, old_logprobs=ro.logprobs,
                            prompt_state=ro.prompt_state)
    reused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    longstraw.grpo_backward(model, prompt, ro.responses, adv, cfg, old_logprobs=ro.logprobs)
    for n, p in model.named_parameters():
        torch.testing.assert_close(reused[n], p.grad, rtol=0, atol=1e-12)
    # a detached-only state cannot serve the exact reverse pass: the boundary states are missing
    ro2 = longstraw.generate(model, prompt, 1, longstraw.SamplingConfig(max_new_tokens=3, seed=2), keep_state=True,
                             prefill_chunk=8)
    before = {n: p.grad.clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match="needs a prompt state built with exact=True"):
        longstraw.grpo_backward(model, prompt, ro2.responses, adv[:1], cfg, prompt_state=ro2.prompt_state)
    assert all(torch.equal(before[n], p.grad) for n, p in model.named_parameters())  # raised before any backward


def test_low_precision(moe_pair):
    """float32: gradients within 1e-4 of float64. bf16 (weights, or autocast over float32): runs, float32 log-probs,
    finite gradients, recurrent state kept in float32, and logits no further from float64 than transformers' own
    bf16 model (these tiny random models are very sensitive to bf16; HF itself is off by O(1) logits)."""
    _, path = moe_pair
    prompt, responses, adv = _group(12, 40, [5, 3])
    model64 = longstraw.load_model(path)
    longstraw.grpo_backward(model64, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=16))
    want = longstraw.hf_grads(model64)
    model = longstraw.load_model(path, dtype="float32")
    longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=16))
    got = longstraw.hf_grads(model)
    num = sum(((got[n].double() - want[n]) ** 2).sum() for n in want)
    assert (num / sum((want[n] ** 2).sum() for n in want)).sqrt() < 1e-4
    for dtype, compute in [("bfloat16", None), ("float32", "bfloat16")]:
        model = longstraw.load_model(path, dtype=dtype)
        cfg = longstraw.GRPOConfig(prefill_chunk=16, compute_dtype=compute)
        st = longstraw.grpo_backward(model, prompt, responses, adv, cfg)
        assert all(lp.dtype == torch.float32 for lp in st.logprobs)
        assert all(torch.isfinite(g).all() for g in longstraw.hf_grads(model).values())
        state = longstraw.engine.grpo.build_prompt_state(model, prompt, cfg, exact=True)
        assert all(ls.S.dtype == torch.float32 for ls in state.layers if isinstance(ls, RecurrentState))
    ids = torch.randint(0, V, (1, 60), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = model64(ids)
        ours = longstraw.load_model(path, dtype="bfloat16")(ids).double()
        hf16 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager")
        theirs = hf16.eval()(ids).logits.double()
    assert (ours - ref).abs().max() <= 1.5 * (theirs - ref).abs().max() + 0.05
