"""grpo_backward (exact and detached), score and generate on Gemma 3 (two RoPEs, sandwich norms, sliding windows the
groups reach past, the pad row) against the naive float64 HF reference."""

import sys
from pathlib import Path

import pytest
from grpo_reference import check_group, check_score_and_generate, random_group

import longstraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_gemma3 import V, pair  # noqa: E402  (the family tests' tiny models)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name,p,chunk,branch_batch,checkpoint", [
    ("gemma3", 22, 4, 1, False), ("gemma3", 17, 9, 2, True), ("gemma3-untied", 13, 5, 3, False),
])
def test_matches_naive_reference(name, p, chunk, branch_batch, checkpoint, prompt_grad):
    hf, path = pair(name)
    prompt, responses, adv = random_group(p, p, [8, 1, 11], V)
    prompt[2] = 0  # the pad id: its embedding row gets no gradient, as in transformers
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, kl_coef=0.05, entropy_coef=0.01, prefill_chunk=chunk,
                               branch_batch=branch_batch, checkpoint_layers=checkpoint)
    check_group(longstraw.load_model(path), hf, prompt, responses, adv, cfg, seed=p)


@pytest.mark.parametrize("cfg", [dict(branch_batch=2, offload_state=True, offload_state_grad=True),
                                 dict(graph_budget_bytes=1 << 30)])
def test_offloads_and_kept_graphs(cfg):
    hf, path = pair("gemma3")
    prompt, responses, adv = random_group(3, 19, [9, 6], V)
    check_group(longstraw.load_model(path), hf, prompt, responses, adv,
                longstraw.GRPOConfig(prefill_chunk=4, **cfg), seed=3)


def test_score_and_generate_equal_naive_logprobs():
    hf, path = pair("gemma3")
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=12, seed=4, stop_token_ids=(5,))
    check_score_and_generate(longstraw.load_model(path), hf, *random_group(8, 15, [9, 1, 12], V), sp)
