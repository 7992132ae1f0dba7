"""benchmarks/grpo_step.py's shared-prefix baseline (prompt graph kept, one backward) on the Qwen3.5 hybrid: its
Gated DeltaNet layers start from the prompt's final state. Both it and LongStraw's exact mode are the exact gradient
of the same loss, so they agree to float64 rounding (a baseline that drifted would make gpu_check.py's ratios
compare different computations)."""

import sys
from pathlib import Path

import torch

import longstraw
from longstraw.models.qwen_hybrid import tiny_config

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import grpo_step  # noqa: E402


def test_shared_prefix_baseline_equals_exact_mode_on_the_hybrid():
    torch.manual_seed(0)
    model = longstraw.build_model(tiny_config()).double()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 259, (40,), generator=g)
    responses = [torch.randint(0, 259, (6,), generator=g) for _ in range(3)]
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    grpo_step._prefix_step(model, prompt, responses, adv)
    want = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    for p in model.parameters():
        p.grad = None
    longstraw.grpo_backward(model, prompt, responses, adv,
                            longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=16, clip_ratio_c=None))
    got = {n: p.grad for n, p in model.named_parameters() if p.grad is not None}
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)
