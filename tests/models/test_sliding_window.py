"""Sliding-window attention beyond the window, per family that has it (Mistral, Qwen2/Qwen3 with
``use_sliding_window``, Qwen3-MoE, Qwen2-MoE, Mixtral): which layers slide (as transformers decides), float64 logits
and gradients against transformers on sequences several windows long, chunked prefill + continuation with chunks
shorter and longer than the window, bad window values."""

import pytest
import torch
from hf_reference import cached_pairs, continuation_error, tiny_moe_hf, true_float64, weighted_logit_grads
from transformers import MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig

import longstraw

V = 61
BASE = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SLIDE, FULL = "sliding_attention", "full_attention"
# name -> (config, each layer's window as transformers sets it)
CONFIGS = {
    "mistral": (lambda: MistralConfig(**BASE, num_hidden_layers=2, intermediate_size=48, sliding_window=7), [7, 7]),
    # the layers from max_window_layers on slide (transformers' default layer_types)
    "qwen2": (lambda: Qwen2Config(**BASE, num_hidden_layers=3, intermediate_size=48, use_sliding_window=True,
                                  sliding_window=6, max_window_layers=1), [None, 6, 6]),
    # explicit layer_types; q/k norms, free head_dim
    "qwen3": (lambda: Qwen3Config(**BASE, num_hidden_layers=3, intermediate_size=48, head_dim=12,
                                  use_sliding_window=True, sliding_window=5, layer_types=[SLIDE, FULL, SLIDE]),
              [5, None, 5]),
    "qwen3_moe": (lambda: Qwen3MoeConfig(**BASE, num_hidden_layers=2, intermediate_size=40, moe_intermediate_size=8,
                                         num_experts=6, num_experts_per_tok=2, use_sliding_window=True,
                                         sliding_window=9), [9, 9]),
    # the even layers below max_window_layers slide
    "qwen2_moe": (lambda: Qwen2MoeConfig(**BASE, num_hidden_layers=3, intermediate_size=40, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=12, num_experts=6, num_experts_per_tok=2,
                                         use_sliding_window=True, sliding_window=6, max_window_layers=3),
                  [6, None, 6]),
    "mixtral": (lambda: MixtralConfig(**BASE, num_hidden_layers=2, intermediate_size=16, num_local_experts=4,
                                      num_experts_per_tok=2, sliding_window=8), [8, 8]),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py
pair = cached_pairs(lambda name: tiny_moe_hf(CONFIGS[name][0](), seed=list(CONFIGS).index(name) + 90))


def _windows(model):
    return [layer.self_attn.window for layer in model.model.layers]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_transformers_beyond_the_window(name):
    hf, path = pair(name)
    model = longstraw.load_model(path)
    want_windows = CONFIGS[name][1]
    assert _windows(model) == want_windows
    assert model.spec.sliding_window == min(w for w in want_windows if w is not None)
    ids = torch.randint(0, V, (2, 41))  # several windows long
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-10
    got_g, want_g = weighted_logit_grads(hf, model, ids[:, :29], torch.randn(2, 29, V, dtype=torch.float64))
    assert set(got_g) == set(want_g)
    for n, g in want_g.items():
        assert (got_g[n] - g).abs().max().item() <= 1e-9 * max(1.0, g.abs().max().item()), n


@pytest.mark.parametrize("name", ["mistral", "qwen3", "qwen2_moe"])
@pytest.mark.parametrize("chunk", [1, 4, 13])
def test_chunked_prefill_then_continuation_beyond_the_window(name, chunk):
    _, path = pair(name)
    model = longstraw.load_model(path)
    err, states = continuation_error(model, torch.randint(0, V, (1, 44)), 30, chunk)
    assert err <= 1e-10


def test_windowed_flops_count_only_the_window():
    model = longstraw.build_model(CONFIGS["qwen2"][0]().to_dict())
    full, slid = model.model.layers[0].self_attn, model.model.layers[1].self_attn
    assert slid.flops_per_token(1000) == slid.flops_per_token(6) < full.flops_per_token(1000)


@pytest.mark.parametrize("changes,match", [
    ({"sliding_window": 1}, r"sliding_window=1 must be an integer >= 2 when layers slide \(layers \[0, 1\]\)"),
    ({"sliding_window": "8"}, r"sliding_window='8' must be an integer >= 2"),
])
def test_bad_windows_are_refused(changes, match):
    cfg = {**CONFIGS["mistral"][0]().to_dict(), **changes}
    with pytest.raises(ValueError, match=match):
        longstraw.build_model(cfg)


def test_qwen2_window_needs_use_sliding_window_and_layer_types_must_fit():
    cfg = CONFIGS["qwen3"][0]().to_dict()
    off = {**cfg, "use_sliding_window": False}  # transformers drops the window: typed-sliding layers attend all
    assert _windows(longstraw.build_model(off)) == [None, None, None]
    with pytest.raises(ValueError, match=r"layer_types has 2 entries for num_hidden_layers=3"):
        longstraw.build_model({**cfg, "layer_types": [SLIDE, FULL]})
