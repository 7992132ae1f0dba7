"""OLMo 2 and OLMo 3 (``olmo2``, ``olmo3``): logits and gradients against transformers in float64 (post-norm blocks,
q/k norms over all heads; OLMo 3's sliding windows and per-type RoPE with YaRN on the full layers), float32 and bf16
logits, chunked prefill + continuation, save/load through transformers, transformers 4's config keys, bad configs."""

import pytest
import torch
from hf_reference import (cached_pairs, check_float64_parity, check_low_precision, continuation_error, float32_rope,
                          tiny_hf, true_float64)
from transformers import AutoModelForCausalLM, Olmo2Config, Olmo3Config

import longstraw
from longstraw.models.olmo import PostNormDecoderLayer
from longstraw.state import KVState, SlidingKVState

V = 61
SLIDE, FULL = "sliding_attention", "full_attention"
_BASE = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
             max_position_embeddings=256, eos_token_id=None, pad_token_id=5)


def olmo3(**changes):
    """Sliding window 5 on three of four layers (transformers' default pattern), YaRN on the full layer's RoPE."""
    kw = dict(_BASE, num_hidden_layers=4, sliding_window=5,
              rope_parameters={FULL: {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                                      "rope_theta": 5e5},
                               SLIDE: {"rope_type": "default", "rope_theta": 5e5}})
    return Olmo3Config(**{**kw, **changes})


CONFIGS = {
    "olmo3": olmo3,
    "olmo2": lambda: Olmo2Config(**_BASE, num_hidden_layers=3, attention_bias=True, tie_word_embeddings=True),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py
pair = cached_pairs(lambda name: tiny_hf(CONFIGS[name](), seed=list(CONFIGS).index(name) + 30))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_transformers_float64(name):
    hf, path = pair(name)
    ids = torch.randint(0, V, (2, 37))
    ids[:, 4] = 5  # the pad id: its row gets no gradient
    check_float64_parity(hf, longstraw.load_model(path), V, ids)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_float32_and_bf16_logits_close_to_transformers(name):
    check_low_precision(pair(name)[1], V)


@pytest.mark.parametrize("chunk", [1, 4, 13])
def test_chunked_prefill_then_continuation_equals_full_forward(chunk):
    _, path = pair("olmo3")
    model = longstraw.load_model(path)
    err, states = continuation_error(model, torch.randint(0, V, (1, 40)), 27, chunk)
    assert err <= 1e-10
    assert [type(st) for st in states] == [SlidingKVState] * 3 + [KVState]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_save_model_round_trips_through_transformers(name, tmp_path):
    hf, path = pair(name)
    model = longstraw.load_model(path)
    longstraw.save_model(model, tmp_path / "out")
    back = float32_rope(AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval())
    ids = torch.randint(0, V, (1, 29))
    with torch.no_grad(), true_float64():
        assert (back(ids).logits - hf(ids).logits).abs().max().item() <= 1e-10
    assert {n for n, _ in back.named_parameters()} == {n for n, _ in model.named_parameters()}


def test_structure_and_transformers_4_config_keys():
    """transformers 4's keys (rope_theta and rope_scaling for the full layers, the sliding ones plain at 500,000)
    build the same model as the per-type rope_parameters."""
    v5 = longstraw.build_model(olmo3().to_dict())
    released = {k: v for k, v in olmo3().to_dict().items() if k != "rope_parameters"}
    released.update(rope_theta=5e5, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64})
    v4 = longstraw.build_model(released)
    assert v4.model.rotary_emb.params == v5.model.rotary_emb.params
    assert v4.model.local_rotary_emb.params == v5.model.local_rotary_emb.params
    assert [layer.self_attn.window for layer in v5.model.layers] == [5, 5, 5, None]
    layer = v5.model.layers[0]
    assert isinstance(layer, PostNormDecoderLayer) and not list(layer.input_layernorm.parameters())
    assert layer.self_attn.q_norm.weight.shape == (32,) and layer.self_attn.k_norm.weight.shape == (16,)
    o2 = longstraw.build_model(CONFIGS["olmo2"]().to_dict())
    assert o2.model.local_rotary_emb is None and all(la.self_attn.window is None for la in o2.model.layers)


@pytest.mark.parametrize("changes,match", [
    ({"layer_types": [SLIDE, FULL]}, r"layer_types must give one of \['sliding_attention', 'full_attention'\] for "
                                     r"each of the 4 layers"),
    ({"sliding_window": 1}, r"sliding_window=1 must be an integer >= 2"),
])
def test_bad_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        longstraw.build_model({**olmo3().to_dict(), **changes})
