"""Dense families (llama, qwen2, qwen3, mistral, seed_oss; Qwen3-VL's text model): logits parity with transformers,
chunked prefill, save/load, bad input."""

import json

import pytest
import torch
from hf_reference import (check_multimodal_text_model, continuation_error, qwen3_vl_config, randomised, save_tiny,
                          tiny_hf, true_float64, weighted_logit_grads)
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config, SeedOssConfig

import longstraw
from longstraw.state import KVState

V = 101


def llama(kv=2, tied=False, rope=None, bias=False, mlp_bias=False):
    extra = {"rope_scaling": rope} if rope else {}
    return LlamaConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=kv, vocab_size=V, tie_word_embeddings=tied, rope_theta=500.0,
                       attention_bias=bias, mlp_bias=mlp_bias, max_position_embeddings=256, **extra)


def qwen2(kv=4, tied=False):
    return Qwen2Config(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=kv, vocab_size=V, tie_word_embeddings=tied, max_position_embeddings=256)


def qwen3(kv=1, tied=True, head_dim=20):
    return Qwen3Config(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=kv, head_dim=head_dim, vocab_size=V, tie_word_embeddings=tied,
                       max_position_embeddings=256)


def seed_oss(out_bias=False, mlp_bias=False):
    """Seed-OSS: q/k/v bias by default, o_proj bias and MLP bias as switched, a free head_dim, dropout 0.1 as
    released (transformers' eval mode, as LongStraw computes, applies none)."""
    return SeedOssConfig(hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=V, max_position_embeddings=256,
                         attention_out_bias=out_bias, mlp_bias=mlp_bias, attention_dropout=0.1, residual_dropout=0.1)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
CONFIGS = {
    "llama-gqa2": lambda: llama(kv=2),
    "llama-mha-tied-bias": lambda: llama(kv=4, tied=True, bias=True, mlp_bias=True),
    "llama-gqa4-llama3rope": lambda: llama(kv=1, rope=LLAMA3),
    "llama-linear-rope": lambda: llama(kv=2, rope={"rope_type": "linear", "factor": 2.0}),
    "llama-yarn-rope": lambda: llama(kv=2, rope={"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": 64}),
    "qwen2-mha": lambda: qwen2(kv=4),
    "qwen2-gqa2-tied": lambda: qwen2(kv=2, tied=True),
    "qwen3-gqa4-tied": lambda: qwen3(kv=1, tied=True),
    "qwen3-gqa2-untied": lambda: qwen3(kv=2, tied=False, head_dim=12),
    "seed_oss": lambda: seed_oss(),
    "seed_oss-out-mlp-bias": lambda: seed_oss(out_bias=True, mlp_bias=True),
}


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = tiny_hf(CONFIGS[request.param](), seed=hash(request.param) % 1000)
    return hf, save_tiny(hf)


def test_logits_match_transformers_float64(pair):
    hf, path = pair
    model = longstraw.load_model(path)
    assert next(model.parameters()).dtype == torch.float64
    ids = torch.randint(0, V, (2, 45))
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        got = model(ids)
    assert got.shape == want.shape == (2, 45, V)
    assert (got - want).abs().max().item() <= 1e-10


def test_logits_match_transformers_float32(pair):
    hf, path = pair
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = longstraw.load_model(path, dtype="float32")
    ids = torch.randint(0, V, (3, 29))
    with torch.no_grad():
        want, got = hf32(ids).logits, model(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("chunk", [1, 7, 16, 45])
def test_chunked_prefill_then_continuation_equals_full_forward(pair, chunk):
    _, path = pair
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (1, 45))
    p = 33  # prompt positions prefilled, the rest is a continuation
    err, states = continuation_error(model, ids, p, chunk)
    assert all(isinstance(st, KVState) and st.length == p for st in states)
    assert err <= 1e-10


def test_hf_grads_match_transformers(pair):
    hf, path = pair
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (2, 19))
    got, want = weighted_logit_grads(hf, model, ids, torch.randn(2, 19, V, dtype=torch.float64))
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)


@pytest.mark.parametrize("tied", [False, True])
def test_pad_token_row_gets_no_gradient_as_in_transformers(tied):
    """transformers builds every family's embedding with ``padding_idx=pad_token_id``: the pad token's row gets no
    gradient (GLM, GPT-OSS and Gemma releases set a pad id that occurs in text, e.g. ``<|endoftext|>``)."""
    hf = tiny_hf(LlamaConfig(**{**llama(tied=tied).to_dict(), "pad_token_id": 7}), seed=4)
    model = longstraw.load_model(save_tiny(hf))
    assert model.model.embed_tokens.padding_idx == 7
    ids = torch.tensor([[3, 7, 7, 11, 7, 2], [7, 5, 9, 7, 1, 0]])
    got, want = weighted_logit_grads(hf, model, ids, torch.randn(2, 6, V, dtype=torch.float64))
    emb = "model.embed_tokens.weight"
    assert want[emb][7].abs().max() == 0 or tied  # tied: the LM head's gradient reaches the row
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-10, atol=1e-12, msg=n)


def test_save_model_round_trips_through_transformers(pair, tmp_path):
    _, path = pair
    model = longstraw.load_model(path)
    longstraw.save_model(model, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64).eval()
    ids = torch.randint(0, V, (1, 23))
    with torch.no_grad(), true_float64():
        assert torch.equal(back(ids).logits, back(ids).logits)
        hf_logits = back(ids).logits
    with torch.no_grad():
        ours = model(ids)
    assert (hf_logits - ours).abs().max().item() <= 1e-10


def test_sharded_checkpoints_load_both_ways(tmp_path):
    hf = tiny_hf(llama(kv=2), seed=3)
    hf.save_pretrained(tmp_path / "hf", max_shard_size="40KB")
    assert (tmp_path / "hf" / "model.safetensors.index.json").exists()
    model = longstraw.load_model(tmp_path / "hf")
    longstraw.save_model(model, tmp_path / "ours", max_shard_size="40KB")
    index = json.loads((tmp_path / "ours" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    again = longstraw.load_model(tmp_path / "ours")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "ours", dtype=torch.float64)
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n
    assert {n for n, _ in back.named_parameters()} == {n for n, _ in model.named_parameters()}


def test_dtype_and_device_arguments(pair):
    _, path = pair
    m = longstraw.load_model(path, dtype=torch.bfloat16, device="cpu")
    assert all(p.dtype == torch.bfloat16 for p in m.parameters())
    logits = m(torch.randint(0, V, (1, 5)))
    assert logits.dtype == torch.bfloat16 and torch.isfinite(logits.float()).all()


# ----------------------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def good_dir():
    return save_tiny(tiny_hf(llama(kv=2), seed=5))


def _copy(src, dst):
    import shutil

    shutil.copytree(src, dst)
    return dst


def test_missing_config(tmp_path):
    with pytest.raises(ValueError, match="has no config.json"):
        longstraw.load_model(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        longstraw.load_model(tmp_path / "nope")


def test_unsupported_model_type_lists_supported(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "gpt2"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"unsupported model_type 'gpt2'; supported: .*llama.*qwen3"):
        longstraw.load_model(d)


def test_missing_and_unexpected_weights_are_listed(good_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    d = _copy(good_dir, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    sd.pop("model.layers.1.mlp.up_proj.weight")
    sd["model.layers.0.self_attn.extra.weight"] = torch.zeros(2)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"unexpected weights .*model\.layers\.0\.self_attn\.extra\.weight"):
        longstraw.load_model(d)
    sd.pop("model.layers.0.self_attn.extra.weight")
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"weights missing .*model\.layers\.1\.mlp\.up_proj\.weight"):
        longstraw.load_model(d)


def test_shape_mismatch_names_tensor_and_shapes(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["intermediate_size"] = 64
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"shape mismatch for model\.layers\.0\.mlp\.down_proj\.weight: "
                                         r"checkpoint has \(48, 80\), the config implies \(48, 64\)"):
        longstraw.load_model(d)


def test_pickled_weights_refused_unless_allowed(good_dir, tmp_path):
    from safetensors.torch import load_file

    d = _copy(good_dir, tmp_path / "m")
    sd = load_file(d / "model.safetensors")
    (d / "model.safetensors").unlink()
    torch.save(sd, d / "pytorch_model.bin")
    with pytest.raises(ValueError, match="only pickled weights .*allow_pickle=True"):
        longstraw.load_model(d)
    m = longstraw.load_model(d, allow_pickle=True)
    assert torch.equal(m.model.embed_tokens.weight, sd["model.embed_tokens.weight"])


def test_no_weights_at_all(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    (d / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="has no weights"):
        longstraw.load_model(d)


def test_token_ids_outside_vocab(good_dir):
    m = longstraw.load_model(good_dir)
    with pytest.raises(ValueError, match=rf"token id {V} is outside the vocabulary \[0, {V}\)"):
        m(torch.tensor([[1, V]]))
    with pytest.raises(ValueError, match=r"token id -1 is outside"):
        m(torch.tensor([[-1, 2]]))
    with pytest.raises(ValueError, match="must be an int64 tensor"):
        m(torch.tensor([[1.0, 2.0]]))


def test_unsupported_rope_and_layer_types(good_dir, tmp_path):
    d = _copy(good_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported rope_type 'dynamic'; supported: default, linear, llama3, yarn"):
        longstraw.load_model(d)
    cfg = qwen3().to_dict()
    cfg["layer_types"] = ["chunked_attention", "full_attention", "full_attention"]
    with pytest.raises(ValueError, match=r"layer_types \['chunked_attention'\] are not supported for qwen3; "
                                         r"supported: \['full_attention', 'sliding_attention'\]"):
        longstraw.build_model(cfg)


def test_sliding_window_defaults_follow_transformers():
    """Mistral's transformers default window (4096) is every layer's; Qwen2's use_sliding_window is off in the
    released checkpoints (no window). Beyond the window: tests/models/test_sliding_window.py."""
    from transformers import MistralConfig

    mistral = longstraw.build_model(MistralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                                  num_attention_heads=4, num_key_value_heads=2,
                                                  vocab_size=V).to_dict())
    assert mistral.spec.sliding_window == 4096
    assert [layer.self_attn.window for layer in mistral.model.layers] == [4096, 4096]
    off = qwen2().to_dict()  # use_sliding_window off (the released checkpoints): no window
    assert longstraw.build_model(off).spec.sliding_window is None



def test_quantised_checkpoints_are_refused_before_anything_is_read(good_dir, tmp_path):
    """An FP8 (DeepSeek-V3, MiniMax-M2 style) or other quantised checkpoint: one line naming the method, before any
    tensor is read (GPT-OSS's MXFP4 is dequantised on load: tests/models/test_gpt_oss.py)."""
    d = _copy(good_dir, tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"quantization_config \(quant_method='fp8'\) is not supported: dequantise"):
        longstraw.load_model(d)


@pytest.mark.parametrize("tied", [False, True])
def test_qwen3_vl_checkpoint_loads_as_its_qwen3_text_model(tied, tmp_path):
    """A dense Qwen3-VL checkpoint (``qwen3_vl``: the text model under ``model.language_model.``, a vision tower under
    ``model.visual.``, interleaved M-RoPE with ``mrope_section``) loads as its text model, a ``qwen3``, with
    transformers' logits on text (its M-RoPE at text positions is ordinary RoPE), the vision tower skipped with one
    warning; ``save_model`` writes a ``qwen3`` checkpoint that transformers loads with the same logits."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=256)
    cfg = qwen3_vl_config(Qwen3VLConfig, V, text, tie_word_embeddings=tied)
    hf = randomised(Qwen3VLForConditionalGeneration(cfg), seed=7)
    model = check_multimodal_text_model(hf, tmp_path, "qwen3", torch.randint(0, V - 5, (2, 27)))
    assert model.spec.tie_word_embeddings == tied
    assert all(layer.self_attn.q_norm is not None for layer in model.model.layers)


@pytest.mark.parametrize("multimodal,kind,allowed", [("mistral3", "qwen3", "mistral, ministral3"),
                                                     ("kimi_k25", "llama", "kimi_k2, deepseek_v3")])
def test_a_multimodal_config_naming_another_text_model_is_refused(multimodal, kind, allowed):
    """Mistral 3's and Kimi-K2.5's text_config may name only the text models they are built as; anything else is one
    line naming it and what is allowed."""
    cfg = {"model_type": multimodal, "text_config": {"model_type": kind, "vocab_size": 8, "hidden_size": 8}}
    with pytest.raises(ValueError, match=f"config.json: {multimodal} text_config model_type '{kind}' is not "
                                         f"supported; supported: {allowed}"):
        longstraw.build_model(cfg)
