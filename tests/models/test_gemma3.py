"""Gemma 3 (``gemma3_text``, and the text weights of the multimodal ``gemma3``): logits and gradients against
transformers in float64 on sequences several sliding windows long (two RoPEs, sandwich norms, scaled embeddings,
query_pre_attn_scalar, the pad row's gradient), float32 and bf16 logits, chunked prefill + continuation, save/load,
transformers 4's config keys, the multimodal checkpoint, what is refused."""


import pytest
import torch
from hf_reference import (cached_pairs, check_float64_parity, check_low_precision, check_multimodal_text_model,
                          check_windowed_continuation, float32_rope, randomised, tiny_hf, true_float64)
from transformers import AutoModelForCausalLM, Gemma3TextConfig

import longstraw
from longstraw.models.gemma3 import GemmaDecoderLayer, ScaledEmbedding

V = 61
SLIDE, FULL = "sliding_attention", "full_attention"


def gemma3(**changes):
    """Hidden 64 (sqrt exact in float32: transformers' scale buffer), sliding window 5, a full layer between
    sliding ones, linear-scaled RoPE on the full layer (the 4B+ releases), query_pre_attn_scalar apart from head_dim,
    pad id 0 (occurs in the random ids: its row gets no gradient)."""
    kw = dict(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, sliding_window=5, query_pre_attn_scalar=24,
              max_position_embeddings=256, layer_types=[SLIDE, FULL, SLIDE, SLIDE],
              rope_parameters={FULL: {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                               SLIDE: {"rope_type": "default", "rope_theta": 1e4}})
    return Gemma3TextConfig(**{**kw, **changes})


CONFIGS = {
    "gemma3": gemma3,
    # untied, MQA, default layer types (pattern 6: five sliding, one full), default RoPEs
    "gemma3-untied": lambda: gemma3(tie_word_embeddings=False, num_key_value_heads=1, num_hidden_layers=6,
                                    layer_types=None, rope_parameters=None),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py
pair = cached_pairs(lambda name: tiny_hf(CONFIGS[name](), seed=list(CONFIGS).index(name) + 20, attn="eager"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_transformers_float64(name):
    hf, path = pair(name)
    ids = torch.randint(0, V, (2, 37))
    ids[:, 3] = 0  # the pad id
    check_float64_parity(hf, longstraw.load_model(path), V, ids)


def test_float32_and_bf16_logits_close_to_transformers():
    check_low_precision(pair("gemma3")[1], V, attn_implementation="eager")


@pytest.mark.parametrize("chunk", [1, 4, 13])
def test_chunked_prefill_then_continuation_equals_full_forward(chunk):
    check_windowed_continuation(pair("gemma3")[1], V, chunk)


def test_save_model_round_trips_through_transformers(tmp_path):
    hf, path = pair("gemma3-untied")
    model = longstraw.load_model(path)
    longstraw.save_model(model, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64,
                                                attn_implementation="eager").eval()
    ids = torch.randint(0, V, (1, 29))
    with torch.no_grad(), true_float64():
        assert (float32_rope(back)(ids).logits - hf(ids).logits).abs().max().item() <= 1e-10
    assert {n for n, _ in back.named_parameters()} == {n for n, _ in model.named_parameters()}


def test_structure_and_transformers_4_config_keys():
    """The released config.json (transformers 4): rope_theta (full layers), rope_local_base_freq (sliding),
    rope_scaling (full only), sliding_window_pattern; the same model as transformers 5's per-type
    rope_parameters."""
    v5 = longstraw.build_model(gemma3().to_dict())
    released = {k: v for k, v in gemma3().to_dict().items() if k not in ("rope_parameters", "layer_types")}
    released.update(rope_theta=1e6, rope_local_base_freq=1e4, rope_scaling={"rope_type": "linear", "factor": 8.0},
                    sliding_window_pattern=2)
    v4 = longstraw.build_model(released)
    assert v4.model.rotary_emb.params == v5.model.rotary_emb.params
    assert v4.model.local_rotary_emb.params == v5.model.local_rotary_emb.params
    assert [layer.self_attn.window for layer in v4.model.layers] == [5, None, 5, None]
    layer = v5.model.layers[1]
    assert isinstance(layer, GemmaDecoderLayer) and isinstance(v5.model.embed_tokens, ScaledEmbedding)
    assert layer.self_attn.scale == 24 ** -0.5 and not layer.self_attn.local_rope
    assert v5.model.layers[0].self_attn.local_rope and v5.model.embed_tokens.padding_idx == 0
    assert v5.model.rotary_emb.params.extra["factor"] == 8.0 and v5.model.local_rotary_emb.params.theta == 1e4


@pytest.mark.parametrize("changes,match", [
    ({"final_logit_softcapping": 30.0}, r"final_logit_softcapping=30.0 is not supported \(Gemma 2's soft-capping\)"),
    ({"attn_logit_softcapping": 50.0}, r"attn_logit_softcapping=50.0 is not supported"),
    ({"use_bidirectional_attention": True}, r"use_bidirectional_attention=true is not supported"),
    ({"layer_types": [SLIDE, "chunked_attention", SLIDE, SLIDE]}, r"layer_types must give one of"),
    ({"sliding_window": 1}, r"sliding_window=1 must be an integer >= 2"),
])
def test_bad_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        longstraw.build_model({**gemma3().to_dict(), **changes})


def test_multimodal_checkpoint_text_weights(tmp_path):
    """A multimodal Gemma 3 checkpoint (text + SigLIP vision tower): the text model loads with transformers'
    logits, the vision tower is skipped with one warning, save_model writes the text model."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                image_size=16, patch_size=4)
    cfg = Gemma3Config(text_config=gemma3().to_dict(), vision_config=vision.to_dict(), mm_tokens_per_image=4,
                       image_token_index=V - 1, boi_token_index=V - 3, eoi_token_index=V - 2)
    cfg._attn_implementation = "eager"
    cfg.text_config._attn_implementation = "eager"
    hf = randomised(Gemma3ForConditionalGeneration(cfg), seed=5)
    check_multimodal_text_model(hf, tmp_path, "gemma3_text", torch.randint(0, V - 4, (2, 30)),
                                attn_implementation="eager")
