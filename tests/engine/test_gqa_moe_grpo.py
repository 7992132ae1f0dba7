"""grpo_backward (exact and detached), score and generate on the GQA + softmax-routed MoE families against the
naive float64 HF reference: Qwen3-MoE (a dense layer between sparse ones), Qwen2-MoE (gated shared expert),
Mixtral (float32 routing weights), MiniMax-M2 (sigmoid router with a correction bias, q/k norms over all heads)
and OLMoE (clipped q/k/v)."""

import sys
from pathlib import Path

import pytest
from grpo_reference import check_group, check_score_and_generate, random_group
from hf_reference import cached_pairs, tiny_moe_hf

import longstraw

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_gqa_moe import CONFIGS, V  # noqa: E402  (the family tests' tiny configs)


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


pair = cached_pairs(lambda name: tiny_moe_hf(CONFIGS[name](), seed=list(CONFIGS).index(name) + 70))


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name,p,chunk,branch_batch,checkpoint", [
    ("qwen3_moe", 22, 8, 1, False), ("qwen3_moe", 1, 8, 1, False), ("qwen2_moe", 17, 5, 2, True),
    ("qwen3_moe-bias-tied", 13, 4, 2, False), ("mixtral", 22, 8, 1, False), ("mixtral", 9, 8, 3, True),
    ("minimax_m2", 22, 8, 2, True), ("olmoe", 17, 5, 1, True),
])
def test_matches_naive_reference(name, p, chunk, branch_batch, checkpoint, prompt_grad):
    hf, path = pair(name)
    prompt, responses, adv = random_group(p, p, [5, 1, 7], V)
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, kl_coef=0.05, entropy_coef=0.01, prefill_chunk=chunk,
                               branch_batch=branch_batch, checkpoint_layers=checkpoint)
    check_group(longstraw.load_model(path), hf, prompt, responses, adv, cfg, seed=p)


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe", "mixtral", "minimax_m2", "olmoe"])
def test_score_and_generate_equal_naive_logprobs(name):
    hf, path = pair(name)
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=9, seed=4, stop_token_ids=(5, 7))
    check_score_and_generate(longstraw.load_model(path), hf, *random_group(8, 19, [5, 1, 8], V), sp, g=4)
