"""The graph budget outside the engine: the planner's kept graphs and predicted saving, ``algorithm.graph_budget``
in the run config, and the trainer's resolution of "auto"."""

import types

import pytest

from longstraw import GRPOConfig
from longstraw.planner import plan
from longstraw.rl.config import RunConfig, apply_overrides
from longstraw.rl.trainer import Trainer

DENSE = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 256, "max_position_embeddings": 20000}
KW = dict(prompt_len=1025, response_len=8, group=2, dtype="float32")


def test_plan_adds_the_kept_graphs_and_predicts_the_saving(monkeypatch):
    cfg = GRPOConfig(prefill_chunk=128)
    base = plan(DENSE, cfg=cfg, **KW)
    assert base.breakdown["kept_graphs"] == 0 and "graph_budget" not in base.settings
    step = base.breakdown["prefill_chunk"]  # one step's graph, as the planner prices it
    some = plan(DENSE, cfg=GRPOConfig(prefill_chunk=128, graph_budget_bytes=3 * step), **KW)
    gb = some.settings["graph_budget"]
    assert some.breakdown["kept_graphs"] == gb["kept_bytes"] <= 3 * step
    assert gb["kept_tokens"] == 3 * 128 and gb["steps"] == 8
    assert some.peak_bytes == base.peak_bytes + gb["kept_bytes"]
    assert 3 / 8 < gb["recompute_saved"] < 1 and gb["step_time_saved"] == pytest.approx(gb["recompute_saved"] / 4,
                                                                                          abs=1e-4)
    assert some.to_json()["graph_budget"] == gb
    everything = plan(DENSE, cfg=cfg, graph_budget=10 ** 12, **KW).settings["graph_budget"]
    assert everything["kept_tokens"] == 1024 and everything["recompute_saved"] == 1.0
    # "auto": what the memory left after the peak without them buys (none without a device's memory); the longest
    # prompt's search (dry runs at long prompts) is not what this checks
    monkeypatch.setattr("longstraw.planner._solve_max_len", lambda *a, **k: 0)
    auto = plan(DENSE, cfg=cfg, graph_budget="auto", gpu_mem=base.peak_bytes + 2 * step, **KW)
    assert auto.settings["graph_budget"]["budget"] == 2 * step and auto.peak_bytes <= base.peak_bytes + 2 * step
    assert auto.settings["graph_budget"]["kept_tokens"] == 2 * 128
    assert plan(DENSE, cfg=cfg, graph_budget="auto", **KW).settings["graph_budget"]["kept_bytes"] == 0
    with pytest.raises(ValueError, match="graph_budget=-1 must be"):
        plan(DENSE, cfg=cfg, graph_budget=-1, **KW)


def test_under_context_parallelism_a_rank_keeps_its_pieces():
    """cp=2 (FSDP off, as a graph budget needs): every rank keeps its own pieces' graphs, 512 of the 1,024 positions
    in 4 pieces of 128 (distributed/placement.py ContextParallel.check_kept_graphs)."""
    cfg = GRPOConfig(prefill_chunk=128)
    one = plan(DENSE, cfg=cfg, graph_budget=10 ** 12, **KW).settings["graph_budget"]
    two = plan(DENSE, cfg=cfg, graph_budget=10 ** 12, gpus=2, cp=2, fsdp=False, **KW).settings["graph_budget"]
    assert one["kept_tokens"] == 1024 and two["kept_tokens"] == 512 and two["steps"] == 4
    assert two["kept_bytes"] == pytest.approx(one["kept_bytes"] / 2, rel=0.01)


def test_run_config_graph_budget_values():
    cfg = RunConfig()
    assert cfg.algorithm.graph_budget == 0 and not cfg.algorithm.grpo.graph_budget_bytes  # none kept
    for text, want in [('"auto"', None), ('"8G"', 8 << 30), ("123", 123), ("0", None), ('"0"', None)]:
        assert apply_overrides(cfg, [f"algorithm.graph_budget={text}"]).algorithm.grpo.graph_budget_bytes == want
    for bad, msg in [('"lots"', "algorithm.graph_budget='lots' must be"), ("-5", "algorithm.graph_budget=-5 must"),
                     ("1.5", "algorithm.graph_budget=1.5 must be")]:
        with pytest.raises(ValueError, match=msg):
            apply_overrides(cfg, [f"algorithm.graph_budget={bad}"])
    with pytest.raises(ValueError, match="algorithm.graph_budget_bytes is not a key"):
        apply_overrides(cfg, ["algorithm.graph_budget_bytes=5"])
    detached = ['algorithm.prompt_grad="detached"']
    assert apply_overrides(cfg, [*detached, 'algorithm.graph_budget="auto"']).algorithm.grpo.graph_budget_bytes is None
    with pytest.raises(ValueError, match="algorithm.graph_budget=1073741824 keeps prompt-step graphs"):
        apply_overrides(cfg, [*detached, 'algorithm.graph_budget="1G"'])


def _resolve(budget, memory, world=1, reuse=False, sharded=None, dp=None):
    cfg = apply_overrides(RunConfig(), [f"algorithm.graph_budget={budget}",
                                        f"algorithm.reuse_rollout_state={str(reuse).lower()}"])
    said = []
    fake = types.SimpleNamespace(cfg=cfg, gcfg=cfg.algorithm.grpo, memory=memory, echo=said.append,
                                 job=types.SimpleNamespace(world=world, sharded=world > 1 if sharded is None
                                                           else sharded, dp_size=world if dp is None else dp))
    return Trainer._graph_budget(fake), said


def test_trainer_resolves_auto_from_the_memory_check():
    verdict = types.SimpleNamespace(limit_bytes=10 << 30, peak_bytes=4 << 30)
    assert _resolve('"auto"', verdict) == (6 << 30, ['algorithm.graph_budget = "auto": up to 6.00 GiB for '
                                                     "prompt-step graphs (the memory plan's limit less its peak), in "
                                                     "every update"])
    n, said = _resolve('"auto"', verdict, reuse=True)  # each update reuses its rollout's state: nothing to keep
    assert n == 0 and "has no effect" in said[0]
    n, said = _resolve('"auto"', None)
    assert n == 0 and "no memory limit known" in said[0]
    assert _resolve('"2G"', None) == (2 << 30, [])
    assert _resolve('"auto"', verdict, world=2) == (0, [])  # FSDP over 2 replicas: nothing kept
    with pytest.raises(ValueError, match=r"kept prompt-step graphs under FSDP need every rank on one prompt "
                                         r"\(parallel.cp = the world size 2\), but this job has 2 data-parallel"):
        _resolve('"2G"', verdict, world=2)
    # FSDP with every rank on one prompt (cp = world): kept, "auto" from the memory check as in one process
    assert _resolve('"2G"', verdict, world=2, dp=1) == (2 << 30, [])
    assert _resolve('"auto"', verdict, world=2, dp=1)[0] == 6 << 30
    # several ranks without FSDP (context parallelism, or replicas): each rank keeps its pieces' graphs
    assert _resolve('"2G"', verdict, world=2, sharded=False) == (2 << 30, [])
    assert _resolve('"auto"', verdict, world=2, sharded=False)[0] == 6 << 30
