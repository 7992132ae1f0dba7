"""GPT-OSS (``gpt_oss``): logits and gradients against transformers in float64 on sequences several sliding windows
long (sinks, alternating windows, biased experts with the clamped SwiGLU, YaRN), float32 and bf16 logits, chunked
prefill + continuation, save/load through transformers, the released configs' defaults, what is refused."""

import pytest
import torch
from hf_reference import (cached_pairs, check_float64_parity, check_low_precision, check_windowed_continuation,
                          moe_save_round_trip, tiny_moe_hf, true_float64)
from transformers import AutoModelForCausalLM, GptOssConfig

import longstraw
from longstraw.models.gpt_oss import GptOssMoE

V = 61


def gpt_oss(**changes):
    """Alternating sliding (window 5) / full layers, 4 experts of 16, swiglu_limit low enough to clamp here."""
    kw = dict(vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=8, num_local_experts=4, num_experts_per_tok=2, sliding_window=5,
              max_position_embeddings=256, swiglu_limit=1.5, pad_token_id=None, eos_token_id=None,
              bos_token_id=None)
    return GptOssConfig(**{**kw, **changes})


CONFIGS = {
    "gpt_oss": gpt_oss,
    # no biases on attention, plain RoPE, every layer full, top-1
    "gpt_oss-plain": lambda: gpt_oss(attention_bias=False, num_experts_per_tok=1,
                                     layer_types=["full_attention"] * 3,
                                     rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py
pair = cached_pairs(lambda name: tiny_moe_hf(CONFIGS[name](), seed=list(CONFIGS).index(name) + 40, attn="eager"))


@pytest.mark.parametrize("name", list(CONFIGS))
def test_logits_and_grads_match_transformers_float64(name):
    hf, path = pair(name)
    got = check_float64_parity(hf, longstraw.load_model(path), V, torch.randint(0, V, (2, 37)))
    assert {n for n in got if n.endswith(("sinks", "router.bias", "gate_up_proj_bias", "down_proj_bias"))}


def test_float32_and_bf16_logits_close_to_transformers():
    hf, path = pair("gpt_oss")
    check_low_precision(path, V, hf64=hf, experts_implementation="eager", attn_implementation="eager")


@pytest.mark.parametrize("chunk", [1, 4, 13])
def test_chunked_prefill_then_continuation_equals_full_forward(chunk):
    check_windowed_continuation(pair("gpt_oss")[1], V, chunk)


def test_save_model_round_trips_through_transformers(tmp_path):
    _, path = pair("gpt_oss")
    model = longstraw.load_model(path)
    saved, back = moe_save_round_trip(model, path, tmp_path / "out", V, attn_implementation="eager")
    assert saved["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)  # [E, H, 2I], as transformers
    assert {n for n, _ in back.named_parameters()} == {n for n, _ in model.named_parameters()}


def test_released_config_defaults():
    """What the released config.json leaves to transformers' defaults: alternating layers from sliding, window
    128, YaRN (factor 32, truncate off) at theta 150000, float32 norm weights, attention biases, sinks."""
    cfg = {k: v for k, v in gpt_oss().to_dict().items()
           if k not in ("layer_types", "rope_parameters", "sliding_window", "attention_bias")}
    model = longstraw.build_model(cfg)
    assert [layer.self_attn.window for layer in model.model.layers] == [128, None, 128]
    p = model.model.rotary_emb.params
    assert (p.rope_type, p.theta, p.extra["factor"], p.extra["truncate"]) == ("yarn", 150000.0, 32.0, False)
    hf_p = GptOssConfig(**cfg).to_dict()["rope_parameters"]
    assert longstraw.build_model({**cfg, "rope_parameters": hf_p}).model.rotary_emb.params == p
    layer = model.model.layers[0]
    assert layer.self_attn.sinks.shape == (4,) and layer.self_attn.q_proj.bias is not None
    assert layer.input_layernorm.weight_in_float32 and isinstance(layer.mlp, GptOssMoE)


@pytest.mark.parametrize("changes,match", [
    ({"quantization_config": {"quant_method": "fp8"}}, r"quant_method='fp8'\) is not supported for gpt_oss: MXFP4"),
    ({"layer_types": ["full_attention"] * 2}, r"layer_types must give one of \['sliding_attention', "
                                              r"'full_attention'\] for each of the 3 layers"),
    ({"sliding_window": 1}, r"sliding_window=1 must be an integer >= 2"),
    ({"num_experts_per_tok": 5}, r"num_experts_per_tok=5 must be between 1 and num_local_experts=4"),
    ({"swiglu_limit": 0.0}, r"swiglu_limit=0.0 must be > 0"),
])
def test_bad_configs_are_refused(changes, match):
    with pytest.raises(ValueError, match=match):
        longstraw.build_model({**gpt_oss().to_dict(), **changes})


def test_planner_splits_the_biased_experts_over_expert_parallel_ranks():
    """ep=2: the experts (weights and biases) leave FSDP's gathered units, each GPU holding its two experts; an ep
    that does not divide the 4 experts is refused (tests/distributed/test_cp.py runs GPT-OSS under EP)."""
    from longstraw.planner import plan

    kw = dict(prompt_len=5, response_len=2, group=2, dtype="float32", gpus=6)
    fsdp, ep = plan(gpt_oss().to_dict(), **kw), plan(gpt_oss().to_dict(), ep=2, **kw)
    assert ep.breakdown["gathered"] < fsdp.breakdown["gathered"] and ep.breakdown["all_to_all"] > 0
    with pytest.raises(ValueError, match=r"ep=3 does not divide the 4 routed experts of a layer"):
        plan(gpt_oss().to_dict(), ep=3, **kw)


def _quantised_checkpoint(hf, tmp_path):
    """transformers' checkpoint of ``hf`` with its experts replaced by random MXFP4 blocks and scales, as the
    released checkpoints store them (``quantization_config: mxfp4``), and ``hf`` with the experts set to their
    dequantised values (transformers' own converter)."""
    import json

    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    d = tmp_path / "mxfp4"
    hf.save_pretrained(d)
    tensors = load_file(d / "model.safetensors")
    gen = torch.Generator().manual_seed(11)
    for name in [n for n in tensors if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, h_in, out = tensors.pop(name).shape  # in-memory [E, in, out]
        blocks = torch.randint(0, 256, (e, out, h_in // 32, 16), generator=gen, dtype=torch.uint8)
        scales = torch.randint(122, 128, (e, out, h_in // 32), generator=gen, dtype=torch.uint8)
        tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        with torch.no_grad():
            hf.get_parameter(name).copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float64))
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                      "model.layers.*.mlp.router"]}
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def test_mxfp4_checkpoint_is_dequantised_on_load_and_saved_plain(tmp_path):
    """A released-style MXFP4 checkpoint (experts as blocks + scales, H and I multiples of 32) loads with the
    dequantised experts (logits equal transformers' with them, float64); save_model writes plain weights and a
    config without the quantisation, which transformers loads."""
    hf = tiny_moe_hf(gpt_oss(hidden_size=64, intermediate_size=32), seed=9, attn="eager")
    d = _quantised_checkpoint(hf, tmp_path)
    model = longstraw.load_model(d, dtype="float64")
    ids = torch.randint(0, V, (1, 21))
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= 1e-10
    longstraw.save_model(model, tmp_path / "plain")
    import json

    assert "quantization_config" not in json.loads((tmp_path / "plain" / "config.json").read_text())
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "plain", dtype=torch.float64,
                                                experts_implementation="eager", attn_implementation="eager").eval()
    with torch.no_grad(), true_float64():
        assert (back(ids).logits - want).abs().max().item() <= 1e-10
    assert longstraw.load_model(d).model.layers[0].mlp.experts.gate_up_proj.dtype == torch.float64  # its dtype


def test_mxfp4_pair_must_be_complete(tmp_path):
    from safetensors.torch import load_file, save_file

    d = _quantised_checkpoint(tiny_moe_hf(gpt_oss(hidden_size=64, intermediate_size=32), seed=9, attn="eager"),
                              tmp_path)
    tensors = load_file(d / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"has model.layers.1.mlp.experts.down_proj_blocks but not "
                                         r"model.layers.1.mlp.experts.down_proj_scales \(MXFP4 needs both\)"):
        longstraw.load_model(d)
