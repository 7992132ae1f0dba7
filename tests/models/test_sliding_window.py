"""Sliding-window attention beyond the window, per family that has it (Mistral, Ministral, Ministral 3, Qwen2/Qwen3
with ``use_sliding_window``, Qwen3-MoE, Qwen2-MoE, Mixtral): which layers slide (as transformers decides), float64
logits and gradients against transformers on sequences several windows long, chunked prefill + continuation with
chunks shorter and longer than the window, bad window values; Ministral 3's query scale and multimodal checkpoint."""

import pytest
import torch
from hf_reference import (cached_pairs, check_float64_parity, check_multimodal_text_model, continuation_error,
                          randomised, tiny_moe_hf)
from transformers import (Ministral3Config, MinistralConfig, MistralConfig, MixtralConfig, Qwen2Config, Qwen2MoeConfig,
                          Qwen3Config, Qwen3MoeConfig)

import longstraw

V = 61
BASE = dict(vocab_size=V, hidden_size=32, num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
SLIDE, FULL = "sliding_attention", "full_attention"
MINISTRAL3_ROPE = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0, "original_max_position_embeddings": 8,
                   "max_position_embeddings": 256, "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0,
                   "mscale": 1.0, "llama_4_scaling_beta": 0.1}
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
    # Ministral: layer_types
    "ministral": (lambda: MinistralConfig(**BASE, num_hidden_layers=3, intermediate_size=48, head_dim=8,
                                          sliding_window=5, layer_types=[SLIDE, FULL, SLIDE]), [5, None, 5]),
    # Ministral 3: every layer slides when a window is set; YaRN, and the queries scaled with the position
    # (original_max_position_embeddings 8: the scale changes every 8 positions here)
    "ministral3": (lambda: Ministral3Config(**BASE, num_hidden_layers=2, intermediate_size=48, head_dim=8,
                                            sliding_window=6, rope_parameters=MINISTRAL3_ROPE), [6, 6]),
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
    check_float64_parity(hf, model, V, torch.randint(0, V, (2, 41)), grad_len=29)  # several windows long


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


def test_ministral3_query_scale_and_the_multimodal_checkpoint(tmp_path):
    """Ministral 3 scales the queries by ``1 + beta log(1 + floor(p / L))`` (from the RoPE settings); a multimodal
    ``mistral3`` checkpoint (Pixtral vision tower) loads as its text model with transformers' logits, the vision
    tower skipped with one warning, and save_model writes the text model."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration, PixtralVisionConfig

    model = longstraw.build_model(CONFIGS["ministral3"][0]().to_dict())
    assert model.model.layers[0].self_attn.position_q_scale == (0.1, 8)
    with pytest.raises(ValueError, match="llama_4_scaling_beta needs original_max_position_embeddings >= 1"):
        longstraw.build_model({**CONFIGS["ministral3"][0]().to_dict(),
                               "rope_parameters": {"rope_type": "default", "llama_4_scaling_beta": 0.1}})
    vision = PixtralVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                 image_size=16, patch_size=4, head_dim=8)
    cfg = Mistral3Config(vision_config=vision.to_dict(), text_config=CONFIGS["ministral3"][0]().to_dict(),
                         image_token_index=V - 1)
    hf = randomised(Mistral3ForConditionalGeneration(cfg), seed=6)
    check_multimodal_text_model(hf, tmp_path, "ministral3", torch.randint(0, V - 2, (2, 30)))
