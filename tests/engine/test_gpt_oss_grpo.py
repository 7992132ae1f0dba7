"""grpo_backward (exact and detached), score and generate on GPT-OSS (attention sinks, alternating sliding windows
the groups reach past, biased clamped-SwiGLU experts) against the naive float64 HF reference; the planner."""

import sys
from pathlib import Path

import pytest
import torch
from grpo_reference import assert_grads_close, random_group, reference_loss, run_against_reference

import longstraw
from longstraw.planner import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_gpt_oss import CONFIGS, V, pair  # noqa: E402  (the family tests' tiny models)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name,p,chunk,branch_batch,checkpoint", [
    ("gpt_oss", 22, 4, 1, False), ("gpt_oss", 17, 9, 2, True), ("gpt_oss-plain", 13, 5, 3, False),
])
def test_matches_naive_reference(name, p, chunk, branch_batch, checkpoint, prompt_grad):
    hf, path = pair(name)
    prompt, responses, adv = random_group(p, p, [8, 1, 11], V)
    model = longstraw.load_model(path)
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, kl_coef=0.05, entropy_coef=0.01, prefill_chunk=chunk,
                               branch_batch=branch_batch, checkpoint_layers=checkpoint)
    run_against_reference(model, hf, prompt, responses, adv, cfg, seed=p)
    assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
    hf.zero_grad()


def test_offloaded_state_and_kept_graphs():
    hf, path = pair("gpt_oss")
    prompt, responses, adv = random_group(3, 19, [9, 6], V)
    model = longstraw.load_model(path)
    cfg = longstraw.GRPOConfig(prefill_chunk=4, branch_batch=2, offload_state=True, offload_state_grad=True)
    run_against_reference(model, hf, prompt, responses, adv, cfg, seed=3)
    assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
    hf.zero_grad()
    model = longstraw.load_model(path)
    stats = run_against_reference(model, hf, prompt, responses, adv,
                                  longstraw.GRPOConfig(prefill_chunk=4, graph_budget_bytes=1 << 30), seed=3)
    assert stats.kept_steps >= 1
    assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
    hf.zero_grad()


def test_score_and_generate_equal_naive_logprobs():
    hf, path = pair("gpt_oss")
    model = longstraw.load_model(path)
    prompt, responses, adv = random_group(8, 15, [9, 1, 12], V)
    got = longstraw.score(model, prompt, responses, longstraw.GRPOConfig(prefill_chunk=6, branch_batch=2))
    with torch.no_grad():
        _, want = reference_loss(hf, prompt, responses, adv)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=12, seed=4, stop_token_ids=(5,))
    ro = longstraw.generate(model, prompt, 3, sp, prefill_chunk=4)
    again = longstraw.score(model, prompt, ro.responses, longstraw.GRPOConfig(prefill_chunk=5, temperature=0.9))
    for a, b in zip(ro.logprobs, again):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def test_context_parallelism_is_refused_before_anything_runs():
    with pytest.raises(ValueError, match=r"gpt_oss has attention sinks, which context parallelism does not "
                                         r"implement \(cp=2\); use cp=1"):
        plan(CONFIGS["gpt_oss"]().to_dict(), prompt_len=4, response_len=2, group=2, dtype="float32", gpus=2, cp=2)


@pytest.mark.parametrize("prompt_grad,sliding_positions", [("exact", 13 * 4), ("detached", 4)])
def test_planner_counts_the_sliding_layers_tails(prompt_grad, sliding_positions):
    """The full layer keeps all 199 prefilled positions (2 x 2 heads x 8 dims x 4 bytes each); the two sliding
    layers (window 5) keep the last 4 positions of each of the 13 prefill steps (exact: the reverse pass reads each
    boundary again) or of the last step only (detached)."""
    cfg = CONFIGS["gpt_oss"]().to_dict()
    pl = plan(cfg, prompt_len=200, response_len=16, group=4, dtype="float32",
              cfg=longstraw.GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=16))
    assert pl.breakdown["prompt_state"] == (199 + 2 * sliding_positions) * 2 * 2 * 8 * 4
