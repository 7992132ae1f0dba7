"""Gemma 3 (``gemma3_text``, and the text weights of the multimodal ``gemma3``): logits and gradients against
transformers in float64 on sequences several sliding windows long (two RoPEs, sandwich norms, scaled embeddings,
query_pre_attn_scalar, the pad row's gradient), float32 and bf16 logits, chunked prefill + continuation, save/load,
transformers 4's config keys, the multimodal checkpoint, what is refused."""

import json
import warnings

import pytest
import torch
from hf_reference import cached_pairs, continuation_error, float32_rope, tiny_hf, true_float64, weighted_logit_grads
from transformers import AutoModelForCausalLM, Gemma3TextConfig

import longstraw
from longstraw.models.gemma3 import GemmaDecoderLayer, ScaledEmbedding
from longstraw.state import KVState, SlidingKVState

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
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (2, 37))
    ids[:, 3] = 0  # the pad id
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-10
    got_g, want_g = weighted_logit_grads(hf, model, ids[:, :23], torch.randn(2, 23, V, dtype=torch.float64))
    assert set(got_g) == set(want_g)
    for n, g in want_g.items():
        assert (got_g[n] - g).abs().max().item() <= 1e-9 * max(1.0, g.abs().max().item()), n


def test_float32_and_bf16_logits_close_to_transformers():
    _, path = pair("gemma3")
    ids = torch.randint(0, V, (2, 19))
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, attn_implementation="eager").eval()
        model = longstraw.load_model(path, dtype=str(dtype).removeprefix("torch."))
        with torch.no_grad():
            want, got = hf(ids).logits.float(), model(ids).float()
        assert (got - want).abs().max().item() <= tol * want.abs().max().item(), dtype


@pytest.mark.parametrize("chunk", [1, 4, 13])
def test_chunked_prefill_then_continuation_equals_full_forward(chunk):
    _, path = pair("gemma3")
    err, states = continuation_error(longstraw.load_model(path), torch.randint(0, V, (1, 40)), 27, chunk)
    assert err <= 1e-10 and all(st.length == 27 for st in states)
    for st, layer in zip(states, longstraw.load_model(path).model.layers):  # a sliding layer keeps its window only
        w = layer.self_attn.window
        assert isinstance(st, KVState if w is None else SlidingKVState)
        assert w is None or sum(t.k.shape[2] for t in st.tails) < w + chunk


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
    ({"sliding_window": 1}, r"sliding_window=1 must be >= 2"),
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
    torch.manual_seed(5)
    hf = Gemma3ForConditionalGeneration(cfg)
    with torch.no_grad():
        for _, p in hf.named_parameters():
            p.normal_(0, 0.2) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.1)
    hf = float32_rope(hf.to(torch.float64)).eval()
    hf.save_pretrained(tmp_path / "mm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = longstraw.load_model(tmp_path / "mm")
    assert len([w for w in caught if "vision tower" in str(w.message)]) == 1
    assert model.spec.model_type == "gemma3_text" and model.hf_config["model_type"] == "gemma3_text"
    ids = torch.randint(0, V - 4, (2, 30))
    with torch.no_grad(), true_float64():
        want = hf(input_ids=ids).logits
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= 1e-10
    longstraw.save_model(model, tmp_path / "text")
    saved = json.loads((tmp_path / "text" / "config.json").read_text())
    assert saved["model_type"] == "gemma3_text" and "vision_config" not in saved
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "text", dtype=torch.float64,
                                                attn_implementation="eager").eval()
    with torch.no_grad(), true_float64():
        assert (float32_rope(back)(ids).logits - want).abs().max().item() <= 1e-10

