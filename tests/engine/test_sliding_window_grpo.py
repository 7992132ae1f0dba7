"""grpo_backward (exact and detached), score and generate with prompts and responses several sliding windows long,
against the naive float64 HF reference: Mistral (every layer slides), Qwen2 / Qwen3 (some layers slide) and
Qwen2-MoE; the state's K/V offloaded and kept prompt-step graphs; the planner (also under context parallelism:
tests/distributed/test_cp.py runs it)."""

import sys
from pathlib import Path

import pytest
import torch
from grpo_reference import check_group, check_score_and_generate, random_group

import longstraw
from longstraw.planner import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "models"))
from test_sliding_window import CONFIGS, V, pair  # noqa: E402  (the family tests' tiny windowed models)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name,p,chunk,branch_batch,checkpoint", [
    ("mistral", 30, 4, 1, False), ("mistral", 23, 13, 2, True), ("qwen2", 26, 5, 3, False),
    ("qwen3", 19, 3, 2, False), ("qwen2_moe", 24, 9, 1, True), ("qwen3", 2, 8, 1, False),
    ("ministral", 21, 4, 2, False), ("ministral3", 25, 7, 1, True),
])
def test_matches_naive_reference(name, p, chunk, branch_batch, checkpoint, prompt_grad):
    hf, path = pair(name)
    prompt, responses, adv = random_group(p, p, [11, 1, 16], V)  # responses longer than the windows
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, kl_coef=0.05, entropy_coef=0.01, prefill_chunk=chunk,
                               branch_batch=branch_batch, checkpoint_layers=checkpoint)
    check_group(longstraw.load_model(path), hf, prompt, responses, adv, cfg, seed=p)


@pytest.mark.parametrize("extra", [dict(offload_state=True), dict(offload_state_grad=True),
                                   dict(graph_budget_bytes=1 << 30), dict(graph_budget_bytes=40_000)])
def test_offloads_and_kept_graphs_beyond_the_window(extra):
    """The state's K/V in host memory (blocks staged per tile), the state gradient in host memory, and prompt steps
    kept with autograd (all, or some): exact gradients unchanged."""
    hf, path = pair("qwen3")
    prompt, responses, adv = random_group(5, 27, [9, 14], V)
    stats = check_group(longstraw.load_model(path), hf, prompt, responses, adv,
                        longstraw.GRPOConfig(prefill_chunk=4, branch_batch=2, **extra), seed=5)
    assert stats.kept_steps >= 1 or "graph_budget_bytes" not in extra


@pytest.mark.parametrize("name", ["mistral", "qwen2_moe"])
def test_score_and_generate_beyond_the_window(name):
    hf, path = pair(name)
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=8, max_new_tokens=15, seed=4, stop_token_ids=(5,))
    ro = check_score_and_generate(longstraw.load_model(path), hf, *random_group(8, 21, [13, 1, 9], V), sp)
    assert max(len(r) for r in ro.responses) > CONFIGS[name][1][0]  # decoding went past the window


def test_planner_plans_past_the_window_with_and_without_context_parallelism():
    """Every layer of Mistral slides (window 7): one process keeps 6 positions per layer (detached); under cp=2 every
    rank keeps the same 6 (replicated tails, distributed/cp_window.py), not half of them."""
    cfg = CONFIGS["mistral"][0]().to_dict()
    kw = dict(prompt_len=200, response_len=8, group=2, dtype="float32",
              cfg=longstraw.GRPOConfig(prompt_grad="detached", prefill_chunk=16))
    one, two = plan(cfg, **kw), plan(cfg, gpus=2, cp=2, **kw)
    assert one.peak_bytes > 0 and one.breakdown["prompt_state"] == two.breakdown["prompt_state"]
    m = longstraw.build_model(cfg)
    layer = m.layers[0].mixer
    assert one.breakdown["prompt_state"] == len(m.layers) * 6 * layer.num_kv_heads * layer.head_dim * 2 * 4


@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
def test_planner_moves_the_replicated_tails_to_host_memory_with_the_state(prompt_grad):
    """offload_state (and offload_state_grad, exact) under cp=2 on Mistral, every layer sliding: all of a rank's
    state, the replicated tails included, is host memory, and so is its gradient."""
    cfg = CONFIGS["mistral"][0]().to_dict()
    g = longstraw.GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=16, offload_state=True,
                             offload_state_grad=prompt_grad == "exact")
    pl = plan(cfg, prompt_len=200, response_len=8, group=2, dtype="float32", gpus=2, cp=2, cfg=g)
    assert pl.breakdown["prompt_state"] == 0  # the device's share: none
    m = longstraw.build_model(cfg)
    layer = m.layers[0].mixer
    per_position = len(m.layers) * layer.num_kv_heads * layer.head_dim * 2 * 4
    steps = 7 if prompt_grad == "exact" else 1  # 199 positions in 7 layout steps of 28-29; the last one's tail
    host = pl.settings["host"]
    assert host["prompt_state_bytes"] == steps * 6 * per_position, host
    assert host["prompt_state_grad_bytes"] == (steps * 6 * per_position if prompt_grad == "exact" else 0), host


def test_sliding_kept_is_the_states_rule():
    """state.sliding_kept (the planner's count) against what SlidingKVState keeps, over uneven writes."""
    from longstraw.state import SlidingKVState, sliding_kept

    writes = [(0, 3), (3, 11), (11, 12), (12, 13), (13, 30), (30, 33)]
    for window in (2, 5, 9, 40):
        for exact in (False, True):
            st = SlidingKVState(33, window, exact)
            for a, b in writes:
                st.write((torch.zeros(1, 1, b - a, 2), torch.zeros(1, 1, b - a, 2)), a, b)
            assert sliding_kept(writes, window, exact) == sum(t.end - t.start for t in st.tails), (window, exact)


@pytest.mark.parametrize("exact", [False, True])
def test_sliding_layers_keep_only_what_later_reads_see(exact):
    """Mistral (window 7) prefilled in steps of 5 and of 9: a sliding layer keeps the last 6 positions of each step
    (exact: the reverse pass reads every boundary again; steps of 5 < 6 keep everything) or only what a read at
    the last boundaries sees (detached), and its prefix of the whole prompt is positions 34..39, in order."""
    from longstraw.engine.prefill import prefill
    from longstraw.state import SlidingKVState

    _, path = pair("mistral")
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (40,))
    whole = prefill(model, ids, 40, exact=exact)  # one step: its tail is positions 34..39
    for chunk, kept in ((5, 40 if exact else 10), (9, 4 * 6 + 4 if exact else 6 + 4)):
        state = prefill(model, ids, chunk, exact=exact)
        for ls, ref in zip(state.layers, whole.layers):
            assert isinstance(ls, SlidingKVState) and ls.length == 40
            assert sum(t.k.shape[2] for t in ls.tails) == kept, (chunk, kept)
            segs = ls.prefix(40, False)
            torch.testing.assert_close(torch.cat([s.k for s in segs], 2), ref.tails[-1].k, rtol=0, atol=1e-12)
            torch.testing.assert_close(torch.cat([s.v for s in segs], 2), ref.tails[-1].v, rtol=0, atol=1e-12)


def test_a_detached_rollout_state_is_refused_for_the_exact_mode():
    """generate's kept state without exact_state drops the sliding layers' old tails: an exact grpo_backward on it
    is a ValueError before anything is computed; with exact_state it equals a step that prefills itself."""
    hf, path = pair("mistral")
    model = longstraw.load_model(path)
    prompt, responses, adv = random_group(4, 26, [5, 3], V)
    sp = longstraw.SamplingConfig(max_new_tokens=4, seed=1)
    cfg = longstraw.GRPOConfig(prefill_chunk=4)
    state = longstraw.generate(model, prompt, 2, sp, prefill_chunk=4, keep_state=True).prompt_state
    with pytest.raises(ValueError, match="needs a prompt state built with exact=True"):
        longstraw.grpo_backward(model, prompt, responses, adv, cfg, prompt_state=state)
    assert all(p.grad is None for p in model.parameters())
    kept = longstraw.generate(model, prompt, 2, sp, prefill_chunk=4, keep_state=True, exact_state=True).prompt_state
    longstraw.grpo_backward(model, prompt, responses, adv, cfg, prompt_state=kept)
    got = longstraw.hf_grads(model)
    model.zero_grad()
    longstraw.grpo_backward(model, prompt, responses, adv, cfg)
    for n, g in longstraw.hf_grads(model).items():
        torch.testing.assert_close(got[n], g, rtol=0, atol=1e-12)
