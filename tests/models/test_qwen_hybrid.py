"""Hybrid Qwen families (qwen3_next, qwen3_5[_text], qwen3_5_moe[_text]): logits and gradients against transformers,
chunked prefill, save/load, the multimodal checkpoints' text weights, bad input, the built-in tiny config."""

import json
import warnings

import pytest
import torch
from hf_reference import (check_multimodal_text_model, continuation_error, randomised, save_tiny,
                          tiny_hf, true_float64, weighted_logit_grads)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Qwen3NextConfig
from transformers.models.qwen3_5 import Qwen3_5Config, Qwen3_5ForConditionalGeneration, Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import (Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration,
                                             Qwen3_5MoeTextConfig)

import longstraw
from longstraw.models.deltanet import RecurrentState
from longstraw.models.qwen_hybrid import tiny_config
from longstraw.state import KVState

V = 67


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def _common(layers=4, kv=1, hk=2, hv=4, dk=8, dv=8, **kw):
    return dict(hidden_size=32, num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=kv, head_dim=16,
                linear_num_key_heads=hk, linear_num_value_heads=hv, linear_key_head_dim=dk,
                linear_value_head_dim=dv, vocab_size=V, max_position_embeddings=512, **kw)


MOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=24)
CONFIGS = {
    # full_attention_interval 2 / 3 / 4; grouped and ungrouped value heads; MoE, dense-only and mixed layers
    "next-i2-mlp_only": lambda: Qwen3NextConfig(**_common(), intermediate_size=48, full_attention_interval=2,
                                                mlp_only_layers=[1], **MOE),
    "next-i3-sparse_step2-nonorm": lambda: Qwen3NextConfig(**_common(kv=2, hk=2, hv=2, dk=12), intermediate_size=40,
                                                           full_attention_interval=3, decoder_sparse_step=2,
                                                           norm_topk_prob=False, **MOE),
    "q35-i3": lambda: Qwen3_5TextConfig(**_common(), intermediate_size=48, full_attention_interval=3),
    "q35-i4-tied": lambda: Qwen3_5TextConfig(**_common(hk=1, hv=2, dv=12), intermediate_size=48,
                                             full_attention_interval=4, tie_word_embeddings=True),
    "q35moe-i2": lambda: Qwen3_5MoeTextConfig(**_common(), full_attention_interval=2, **MOE),
}


def hf_model(config, seed):
    config._experts_implementation = "eager"  # HF's default grouped_mm has no float64 kernel
    return tiny_hf(config, seed=seed)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = hf_model(CONFIGS[request.param](), seed=sorted(CONFIGS).index(request.param))
    return hf, save_tiny(hf)


def test_logits_match_transformers_float64(pair):
    hf, path = pair
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (2, 150))  # crosses the 64-token chunk twice, not a multiple of it
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-10


def test_logits_match_transformers_float32(pair):
    _, path = pair
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = longstraw.load_model(path, dtype="float32")
    ids = torch.randint(0, V, (3, 70))
    with torch.no_grad():
        want, got = hf32(ids).logits, model(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_prefill_then_continuation_equals_full_forward(pair, chunk):
    hf, path = pair
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (1, 150))
    p = 131
    err, states = continuation_error(model, ids, p, chunk)
    assert {type(st) for st in states} == {RecurrentState, KVState}
    assert all(st.length == p for st in states)
    assert err <= 1e-10


def test_hf_grads_match_transformers(pair):
    hf, path = pair
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (2, 70))
    got, want = weighted_logit_grads(hf, model, ids, torch.randn(2, 70, V, dtype=torch.float64))
    assert set(got) == set(want)
    for n in want:
        err, scale = (got[n] - want[n]).abs().max().item(), want[n].abs().max().item()
        assert err <= 1e-9 * scale, f"{n}: {err:.3e} vs max |grad| {scale:.3e}"


def test_save_model_round_trips_through_transformers(pair, tmp_path):
    _, path = pair
    model = longstraw.load_model(path)
    longstraw.save_model(model, tmp_path / "out")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64,
                                                experts_implementation="eager").eval()
    assert {n for n, _ in back.named_parameters()} == {n for n, _ in model.named_parameters()}
    ids = torch.randint(0, V, (1, 80))
    with torch.no_grad(), true_float64():
        hf_logits = back(ids).logits
    with torch.no_grad():
        ours = model(ids)
    assert (hf_logits - ours).abs().max().item() <= 1e-10
    again = longstraw.load_model(tmp_path / "out")
    for (n, a), (_, b) in zip(model.named_parameters(), again.named_parameters()):
        assert torch.equal(a, b), n


# ----------------------------------------------------------------------------------------------- multimodal

VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32, patch_size=4,
              num_position_embeddings=16, temporal_patch_size=2, spatial_merge_size=2)
TOKENS = dict(image_token_id=V - 4, video_token_id=V - 3, vision_start_token_id=V - 2, vision_end_token_id=V - 1)


def _multimodal(kind):
    if kind == "qwen3_5":
        text = dict(model_type="qwen3_5_text", **_common(layers=3), intermediate_size=48, full_attention_interval=3)
        cfg = Qwen3_5Config(text_config=text, vision_config=VISION, **TOKENS)
        cls = Qwen3_5ForConditionalGeneration
    else:
        text = dict(model_type="qwen3_5_moe_text", **_common(layers=2), full_attention_interval=2, **MOE)
        cfg = Qwen3_5MoeConfig(text_config=text, vision_config=VISION, **TOKENS)
        cls = Qwen3_5MoeForConditionalGeneration
    cfg._experts_implementation = "eager"
    cfg.text_config._experts_implementation = "eager"
    return randomised(cls(cfg), seed=3)


@pytest.mark.parametrize("kind", ["qwen3_5", "qwen3_5_moe"])
def test_multimodal_checkpoint_text_weights(kind, tmp_path):
    """The text model of a multimodal checkpoint (``model.visual.`` skipped with one warning), transformers'
    logits, and save_model writing the text model (a text-only checkpoint transformers loads)."""
    hf = _multimodal(kind)
    hf.save_pretrained(tmp_path / "layout")
    names = load_file(tmp_path / "layout" / "model.safetensors")
    assert any(n.startswith("model.visual.") for n in names) and any(n.startswith("model.language_model.")
                                                                     for n in names)
    check_multimodal_text_model(hf, tmp_path, kind + "_text", torch.randint(0, V - 4, (2, 90)),
                                experts_implementation="eager")


# ----------------------------------------------------------------------------------------------- bad input


@pytest.fixture(scope="module")
def next_dir():
    return save_tiny(hf_model(CONFIGS["next-i2-mlp_only"](), seed=9))


def _rewrite(src, dst, edit_cfg=None, edit_sd=None):
    import shutil

    shutil.copytree(src, dst)
    if edit_cfg:
        cfg = json.loads((dst / "config.json").read_text())
        edit_cfg(cfg)
        (dst / "config.json").write_text(json.dumps(cfg))
    if edit_sd:
        sd = load_file(dst / "model.safetensors")
        sd = edit_sd(sd)
        save_file(sd, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def test_unknown_layer_type_is_named(next_dir, tmp_path):
    def edit(cfg):
        cfg["layer_types"][2] = "sliding_attention"

    d = _rewrite(next_dir, tmp_path / "m", edit_cfg=edit)
    with pytest.raises(ValueError, match=r"layer_types \['sliding_attention'\] are not supported for qwen3_next; "
                                         r"supported: \['linear_attention', 'full_attention'\]"):
        longstraw.load_model(d)
    cfg = tiny_config(layer_types=["linear_attention"] * 3)
    with pytest.raises(ValueError, match=r"layer_types must list one entry per layer \(num_hidden_layers=4\)"):
        longstraw.build_model(cfg)


def test_mtp_weights_skipped_with_one_warning(next_dir, tmp_path):
    def add_mtp(sd):
        sd["mtp.fc.weight"] = torch.zeros(4, 4, dtype=torch.float64)
        sd["mtp.layers.0.input_layernorm.weight"] = torch.zeros(4, dtype=torch.float64)
        return sd

    d = _rewrite(next_dir, tmp_path / "m", edit_sd=add_mtp)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        longstraw.load_model(d)
    msgs = [str(w.message) for w in caught if "multi-token-prediction" in str(w.message)]
    assert len(msgs) == 1 and "2 tensors skipped" in msgs[0]


def test_mtp_only_checkpoint_is_refused(next_dir, tmp_path):
    d = _rewrite(next_dir, tmp_path / "m",
                 edit_sd=lambda sd: {"mtp.fc.weight": torch.zeros(4, 4), "mtp.norm.weight": torch.zeros(4)})
    with pytest.raises(ValueError, match=r"holds only multi-token-prediction weights \(2 tensors, e\.g\. mtp\."):
        longstraw.load_model(d)


def test_incomplete_experts_are_named(next_dir, tmp_path):
    def drop(sd):
        sd.pop("model.layers.2.mlp.experts.3.up_proj.weight")
        return sd

    d = _rewrite(next_dir, tmp_path / "m", edit_sd=drop)
    with pytest.raises(ValueError, match=r"incomplete experts .*missing model\.layers\.2\.mlp\.experts\.3\.up_proj"):
        longstraw.load_model(d)


def test_bad_deltanet_heads(next_dir):
    cfg = tiny_config(linear_num_key_heads=3, linear_num_value_heads=4)
    with pytest.raises(ValueError, match=r"linear_num_value_heads=4 must be a multiple of linear_num_key_heads=3"):
        longstraw.build_model(cfg)


# ----------------------------------------------------------------------------------------------- tiny_config


def test_tiny_config_builds_in_transformers_and_longstraw(tmp_path):
    cfg = tiny_config(vocab_size=259, max_position_embeddings=4096)
    assert cfg["layer_types"] == ["linear_attention"] * 3 + ["full_attention"]
    hf_cfg = Qwen3_5TextConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})
    assert hf_cfg.layer_types == cfg["layer_types"] and hf_cfg.head_dim == 16
    model = longstraw.build_model(cfg)
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    longstraw.save_model(model, tmp_path / "tiny")
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "tiny", dtype=torch.float32).eval()
    assert type(back).__name__ == "Qwen3_5ForCausalLM"
    ids = torch.randint(0, 259, (1, 77))
    with torch.no_grad():
        want, got = back(ids).logits, model(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()
    assert tiny_config(num_hidden_layers=6, full_attention_interval=3)["layer_types"] == (
        ["linear_attention"] * 2 + ["full_attention"]) * 2
