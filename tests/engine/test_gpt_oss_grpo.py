"""grpo_backward (exact and detached), score and generate on GPT-OSS (attention sinks, alternating sliding windows
the groups reach past, biased clamped-SwiGLU experts) against the naive float64 HF reference; the planner (one
process and context parallelism; tests/distributed/test_cp.py runs GPT-OSS under CP)."""

import sys
from pathlib import Path

import pytest
from grpo_reference import check_group, check_score_and_generate, random_group

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
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, kl_coef=0.05, entropy_coef=0.01, prefill_chunk=chunk,
                               branch_batch=branch_batch, checkpoint_layers=checkpoint)
    check_group(longstraw.load_model(path), hf, prompt, responses, adv, cfg, seed=p)


@pytest.mark.parametrize("cfg", [dict(branch_batch=2, offload_state=True, offload_state_grad=True),
                                 dict(graph_budget_bytes=1 << 30)])
def test_offloaded_state_and_kept_graphs(cfg):
    hf, path = pair("gpt_oss")
    prompt, responses, adv = random_group(3, 19, [9, 6], V)
    stats = check_group(longstraw.load_model(path), hf, prompt, responses, adv,
                        longstraw.GRPOConfig(prefill_chunk=4, **cfg), seed=3)
    assert stats.kept_steps >= 1 or "graph_budget_bytes" not in cfg


def test_score_and_generate_equal_naive_logprobs():
    hf, path = pair("gpt_oss")
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=12, seed=4, stop_token_ids=(5,))
    check_score_and_generate(longstraw.load_model(path), hf, *random_group(8, 15, [9, 1, 12], V), sp)


@pytest.mark.parametrize("prompt_grad,sliding_positions", [("exact", 7 * 4), ("detached", 4)])
def test_planner_counts_replicated_tails_under_context_parallelism(prompt_grad, sliding_positions):
    """cp=2: the full layer's 199 positions split over the two ranks; each rank keeps the sliding layers' tails of
    the layout's 7 steps of ~28 positions (exact) or of the last one (detached), 4 positions each, not half of one
    process's 13 (distributed/cp_window.py)."""
    cfg = CONFIGS["gpt_oss"]().to_dict()
    pl = plan(cfg, prompt_len=200, response_len=16, group=4, dtype="float32", gpus=2, cp=2,
              cfg=longstraw.GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=16))
    assert pl.breakdown["prompt_state"] == (199 * 2 * 2 * 8 * 4) // 2 + 2 * sliding_positions * 2 * 2 * 8 * 4


@pytest.mark.parametrize("prompt_grad,sliding_positions", [("exact", 13 * 4), ("detached", 4)])
def test_planner_counts_the_sliding_layers_tails(prompt_grad, sliding_positions):
    """The full layer keeps all 199 prefilled positions (2 x 2 heads x 8 dims x 4 bytes each); the two sliding
    layers (window 5) keep the last 4 positions of each of the 13 prefill steps (exact: the reverse pass reads each
    boundary again) or of the last step only (detached)."""
    cfg = CONFIGS["gpt_oss"]().to_dict()
    pl = plan(cfg, prompt_len=200, response_len=16, group=4, dtype="float32",
              cfg=longstraw.GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=16))
    assert pl.breakdown["prompt_state"] == (199 + 2 * sliding_positions) * 2 * 2 * 8 * 4
