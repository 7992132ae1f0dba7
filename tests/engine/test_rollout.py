"""Rollouts from the shared prompt state: sampled log-probs equal score, seeds, stops, truncation, reuse."""

import pytest
import torch
from hf_reference import save_tiny, tiny_hf
from transformers import LlamaConfig

import longstraw
from longstraw.engine.rollout import sample_tokens

V = 53


@pytest.fixture(scope="module")
def model():
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=128)
    return longstraw.load_model(save_tiny(tiny_hf(cfg, seed=21, init_std=0.3)))


def _prompt(n=23):
    return torch.randint(0, V, (n,), generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.0, 0, 1.0)])
def test_sampled_logprobs_equal_score(model, temperature, top_k, top_p):
    prompt = _prompt()
    sp = longstraw.SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p, max_new_tokens=12, seed=3,
                                  stop_token_ids=(7,))
    ro = longstraw.generate(model, prompt, 6, sp, prefill_chunk=8)
    assert len(ro.responses) == 6 and all(1 <= r.numel() <= 12 for r in ro.responses)
    cfg = longstraw.GRPOConfig(prefill_chunk=5, temperature=temperature or 1.0)
    want = longstraw.score(model, prompt, ro.responses, cfg)
    for a, b in zip(ro.logprobs, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    for r, why in zip(ro.responses, ro.finish_reasons):
        assert (why == "stop") == (r[-1].item() == 7) and (why == "stop" or r.numel() == 12)
        assert 7 not in r[:-1].tolist()


def test_seed_determinism_and_greedy(model):
    prompt = _prompt()
    sp = longstraw.SamplingConfig(max_new_tokens=9, seed=11)
    a = longstraw.generate(model, prompt, 4, sp)
    b = longstraw.generate(model, prompt, 4, sp)
    assert all(torch.equal(x, y) for x, y in zip(a.responses, b.responses))
    c = longstraw.generate(model, prompt, 4, longstraw.SamplingConfig(max_new_tokens=9, seed=12))
    assert not all(torch.equal(x, y) for x, y in zip(a.responses, c.responses))
    g = longstraw.generate(model, prompt, 3, longstraw.SamplingConfig(temperature=0, max_new_tokens=9))
    assert all(torch.equal(g.responses[0], r) for r in g.responses)
    # greedy equals the argmax continuation of a full forward
    seq = prompt.clone()
    for _ in range(9):
        nxt = model(seq[None])[0, -1].argmax()
        seq = torch.cat([seq, nxt[None]])
    assert torch.equal(g.responses[0], seq[prompt.numel():])


def test_top_k_and_top_p_restrict_support():
    torch.manual_seed(0)
    logits = torch.randn(2000, 10, dtype=torch.float64)
    logits[:] = logits[0]
    gen = torch.Generator().manual_seed(0)
    ids, _ = sample_tokens(logits, longstraw.SamplingConfig(top_k=3), gen)
    assert set(ids.tolist()) == set(torch.topk(logits[0], 3).indices.tolist())
    p = torch.softmax(logits[0], -1)
    order = torch.argsort(p, descending=True)
    need = int((torch.cumsum(p[order], 0) < 0.6).sum()) + 1
    ids, _ = sample_tokens(logits, longstraw.SamplingConfig(top_p=0.6), gen)
    assert set(ids.tolist()) == set(order[:need].tolist())


def test_stop_strings_and_length_limit(model):
    prompt = _prompt()
    decode = lambda ids: "".join(chr(65 + (i % 26)) for i in ids)  # noqa: E731
    ro = longstraw.generate(model, prompt, 8, longstraw.SamplingConfig(max_new_tokens=40, seed=5, stop_strings=("A",)),
                            decode=decode)
    for r, why in zip(ro.responses, ro.finish_reasons):
        text = decode(r.tolist())
        if why == "stop":
            assert text.endswith("A") and "A" not in text[:-1]
        else:
            assert r.numel() == 40 and "A" not in text
    # the model's position limit caps the response: 23 + n <= 128
    ro = longstraw.generate(model, _prompt(120), 2, longstraw.SamplingConfig(max_new_tokens=50, seed=1))
    assert all(r.numel() == 8 for r in ro.responses)


def test_state_reuse_by_the_training_step(model):
    prompt = _prompt()
    ro = longstraw.generate(model, prompt, 3, longstraw.SamplingConfig(max_new_tokens=6, seed=2), keep_state=True,
                            exact_state=True, prefill_chunk=8)
    adv = torch.tensor([1.0, -0.5, 0.2])
    cfg = longstraw.GRPOConfig(prefill_chunk=8)
    model.zero_grad()
    longstraw.grpo_backward(model, prompt, ro.responses, adv, cfg, old_logprobs=ro.logprobs, prompt_state=ro.prompt_state)
    reused = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    longstraw.grpo_backward(model, prompt, ro.responses, adv, cfg, old_logprobs=ro.logprobs)
    for n, p in model.named_parameters():
        torch.testing.assert_close(reused[n], p.grad, rtol=0, atol=1e-12)
    model.zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="prompt_state holds 22 positions, the prompt needs 9"):
        longstraw.grpo_backward(model, prompt[:10], ro.responses, adv, cfg, prompt_state=ro.prompt_state)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(temperature=-1), "temperature=-1 must be a finite number >= 0"),
    (dict(top_k=-2), "top_k=-2 must be an integer >= 0"),
    (dict(top_p=0), r"top_p=0 must be in \(0, 1\]"),
    (dict(max_new_tokens=0), "max_new_tokens=0 must be an integer >= 1"),
    (dict(stop_strings=("",)), "must not contain an empty string"),
    (dict(temperature=float("inf")), "temperature=inf must be a finite number >= 0"),
    (dict(seed="7"), "seed='7' must be an integer or None"),
    (dict(top_p="0.9"), r"top_p='0.9' must be in \(0, 1\]"),
])
def test_sampling_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.SamplingConfig(**kwargs)


def test_generate_bad_input(model):
    with pytest.raises(ValueError, match="n=0 must be an integer >= 1"):
        longstraw.generate(model, _prompt(), 0, longstraw.SamplingConfig())
    with pytest.raises(ValueError, match="stop_strings need a decode function"):
        longstraw.generate(model, _prompt(), 2, longstraw.SamplingConfig(stop_strings=("x",)))
    with pytest.raises(ValueError, match="leaves no room"):
        longstraw.generate(model, _prompt(128), 2, longstraw.SamplingConfig())


def test_reused_state_under_autocast_equals_the_steps_own(tmp_path):
    """``generate(compute_dtype="bfloat16")`` prefills and decodes under autocast as the training step does with
    ``GRPOConfig(compute_dtype="bfloat16")``: a rollout state handed to the step gives exactly the gradients of the
    step's own prefill (the trainer's reuse claim), and the sampled log-probs are the step's within bf16 rounding.
    (Before, generate prefilled in float32: a float32 state under bf16 replay is another computation, and the
    attention kernel refuses the mix.)"""
    cfg = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=128)
    model = longstraw.load_model(save_tiny(tiny_hf(cfg, seed=22, init_std=0.3), dtype=torch.float32))
    prompt = _prompt(40)
    sp = longstraw.SamplingConfig(max_new_tokens=6, seed=5)
    gcfg = longstraw.GRPOConfig(prefill_chunk=16, compute_dtype="bfloat16")
    adv = torch.tensor([1.0, -0.5, 0.25])

    def grads(**kw):
        model.zero_grad(set_to_none=True)
        longstraw.grpo_backward(model, prompt, ro.responses, adv, gcfg, old_logprobs=ro.logprobs, **kw)
        return {n: p.grad.clone() for n, p in model.named_parameters()}

    ro = longstraw.generate(model, prompt, 3, sp, prefill_chunk=16, keep_state=True, exact_state=True,
                            compute_dtype="bfloat16")
    reused, own = grads(prompt_state=ro.prompt_state), grads()
    assert all(torch.equal(reused[n], own[n]) for n in own)
    want = longstraw.score(model, prompt, ro.responses, gcfg)
    for a, b in zip(ro.logprobs, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0.05)
    with pytest.raises(ValueError, match=r"compute_dtype='int8' is not supported; allowed: None, 'bfloat16'"):
        longstraw.generate(model, prompt, 2, sp, compute_dtype="int8")
    with pytest.raises(ValueError, match=r"prefill_chunk=0 must be an integer >= 1"):
        longstraw.generate(model, prompt, 2, sp, prefill_chunk=0)
