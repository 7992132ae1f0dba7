"""Expert load: routed slots per expert counted from outside the model, in the trainer's metrics and plot."""

import json

import pytest
import torch

from longstraw.expert_load import ExpertLoad, imbalance
from longstraw.models.qwen_hybrid import tiny_config
from longstraw.models.registry import build_model
from longstraw.ops import meta
from longstraw.rl.trainer import init_weights


def _moe(seed=0):
    cfg = tiny_config(model_type="qwen3_5_moe_text", num_hidden_layers=2, full_attention_interval=2, num_experts=6,
                      num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
    model = build_model(cfg).double()
    init_weights(model, seed, std=0.2)
    return model


def test_counts_are_the_routers_choices_while_recording_only():
    model = _moe()
    load = ExpertLoad(model)
    assert load.layers == ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"] and load.num_experts == 6
    chosen = []  # each router's top-k ids, read independently of the hooks
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, a, out: chosen.append(out[1].reshape(-1)))
             for layer in model.layers]
    ids = torch.randint(0, 259, (1, 40))
    with torch.no_grad():
        model.run(ids)  # not recording: nothing counted
        assert int(load.take().sum()) == 0
        chosen.clear()
        with load.recording():
            model.run(ids)
            model.run(ids[:, :7], 40)
    for h in hooks:
        h.remove()
    want = torch.zeros(2, 6, dtype=torch.int64)
    for i, c in enumerate(chosen):  # calls alternate layer 0, layer 1
        want[i % 2] += torch.bincount(c, minlength=6)
    got = load.take()
    assert torch.equal(got, want) and int(got.sum()) == 2 * 2 * 47  # layers x top-k x tokens
    assert int(load.take().sum()) == 0  # take() zeroes
    assert int(load.take(reduce=lambda c: c + 1).sum()) == 12  # the reduce (a sum over ranks) is applied
    load.close()
    with torch.no_grad(), load.recording():
        model.run(ids)
    assert int(load.take().sum()) == 0  # hooks removed


def test_the_planners_meta_dry_run_is_not_counted():
    model = _moe().to("meta")
    load = ExpertLoad(model)
    with torch.no_grad(), load.recording():
        model.run(torch.zeros(1, 16, dtype=torch.long, device="meta"))
    assert meta.is_meta(next(model.parameters())) and int(load.take().sum()) == 0


def test_imbalance_summary():
    c = torch.tensor([[4, 4, 4, 4], [16, 0, 0, 0], [0, 0, 0, 0]])  # balanced; all on one expert; unused layer
    s = imbalance(c)
    assert s == {"expert_load_max_over_mean": 4.0, "expert_load_mean_max_over_mean": 2.5,
                 "expert_idle_fraction": 3 / 8}
    assert imbalance(torch.zeros(2, 3, dtype=torch.int64)) == {}


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_trainer_records_expert_load_per_step_and_plots_it(tmp_path):
    pytest.importorskip("matplotlib")
    from longstraw.rl.config import RunConfig, apply_overrides
    from longstraw.rl.runlog import EXPERT_LOAD, read_metrics
    from longstraw.rl.trainer import Trainer

    run = tmp_path / "run"
    cfg = apply_overrides(RunConfig(), [
        'model.builtin="tiny-moe"', "data.prompt_len=96", "data.max_prompt_len=160", "rollout.group_size=2",
        "rollout.max_new_tokens=3", "algorithm.prefill_chunk=48", "train.progress=false", "train.tensorboard=false",
        "train.steps=2", f'train.out_dir="{run}"'])
    s = Trainer(cfg, resume=False, echo=lambda *_: None).train()
    rows, load = read_metrics(run), read_metrics(run, EXPERT_LOAD)
    assert [r["step"] for r in load] == [1, 2] and len(load[0]["layers"]) == 4
    for r, lr in zip(rows, load):
        tokens = torch.tensor(lr["tokens"])
        assert tokens.shape == (4, 8) and int(tokens.sum()) > 0
        assert r["expert_load_max_over_mean"] == pytest.approx(imbalance(tokens)["expert_load_max_over_mean"])
        # every layer routes the same tokens, top-2, except the last one in the prefill (nothing reads its FFN)
        per_layer = tokens.sum(1).tolist()
        assert len(set(per_layer[:-1])) == 1 and 0 < per_layer[-1] < per_layer[0]
    assert any(p.name == "expert_load.png" for p in s.plots)
    json.dumps(rows)  # the metric rows stay plain JSON
