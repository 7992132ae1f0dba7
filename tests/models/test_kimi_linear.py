"""Kimi-Linear (kimi_linear: Kimi Delta Attention + NoPE MLA + DeepSeek-style MoE): logits and gradients against
transformers in float64 (both MLA forms), float32 / bfloat16, chunked prefill + continuation, the released
checkpoint layout in and out (q/k/v convs, forget gate, block_sparse_moe, w1/w2/w3) and transformers' own save,
the prompt state per layer kind, config variants and bad configs."""

import pytest
import torch
from hf_reference import (check_continuation_in_every_form, check_grads_in_every_form, check_logits_in_every_form,
                          check_low_precision, load_in_form, save_tiny, tiny_moe_hf, true_float64)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, KimiLinearConfig

import longstraw
from longstraw.engine.prefill import prefill
from longstraw.models.deltanet import RecurrentState
from longstraw.models.kda import KimiDeltaAttention
from longstraw.models.kimi import tiny_config
from longstraw.models.mla import MLAttention

V = 64

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

CONFIGS = {
    # the built-in tiny config: KDA, KDA, MLA, KDA; layer 0 dense
    "tiny": lambda: tiny_config(),
    # low-rank queries, 2 groups of experts, 2 shared experts, no renormalisation, layer_types given directly,
    # 3 KDA heads of 6 (not a power of 2), conv kernel 3
    "qlora-groups": lambda: tiny_config(
        q_lora_rank=12, num_experts=8, num_experts_per_token=3, num_expert_group=2, topk_group=1,
        num_shared_experts=2, moe_renormalize=False, routed_scaling_factor=1.3,
        layer_types=["full_attention", "linear_attention", "linear_attention", "full_attention"],
        linear_attn_config={"num_heads": 3, "head_dim": 6, "short_conv_kernel_size": 3},
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"]),
}


def hf_model(name, seed=0):
    cfg = {k: v for k, v in CONFIGS[name]().items() if k not in ("model_type", "architectures")}
    return tiny_moe_hf(KimiLinearConfig(**cfg), seed=seed)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = hf_model(request.param, seed=sorted(CONFIGS).index(request.param) + 3)
    return request.param, hf, save_tiny(hf)


def test_logits_match_transformers_float64(pair):
    _, hf, path = pair
    ids = torch.randint(0, V, (2, 150))  # crosses the 64-token chunk twice, not a multiple of it
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    check_logits_in_every_form(path, want, ids)


def test_logits_match_transformers_float32_and_bfloat16(pair):
    """In bfloat16 a routing flip moves a tiny Kimi-Linear's logits by up to 80% of the largest (routed_scaling_factor
    2.446 on near-tied sigmoid scores), on our side or transformers' for a given input: measured over 40 inputs the
    two are as far from float64 (mean 0.225 against 0.223), over 8 they can differ by chance; 24 inputs here."""
    _, hf, path = pair
    check_low_precision(path, V, hf64=hf, bf16_inputs=24, experts_implementation="eager")


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_chunked_prefill_then_continuation_equals_full_forward(pair, chunk):
    _, _, path = pair
    states = check_continuation_in_every_form(path, torch.randint(0, V, (1, 90)), 70, chunk)
    kinds = [type(s).__name__ for s in states]
    assert "RecurrentState" in kinds and "LatentState" in kinds


def test_hf_grads_match_transformers(pair):
    _, hf, path = pair
    ids = torch.randint(0, V, (2, 70))
    want = check_grads_in_every_form(hf, path, ids, torch.randn(2, 70, V, dtype=torch.float64))
    assert any(".forget_gate.A_log" in n for n in want) and any("conv1d" in n for n in want)


def test_save_writes_the_released_layout_that_transformers_loads(pair, tmp_path):
    """Our save writes the released checkpoint names (dense layers under ``mlp``, MoE layers under
    ``block_sparse_moe`` with per-expert w1/w3/w2, the forget gate directly under ``self_attn``, the conv as three
    tensors); transformers loads it with our logits, and we load transformers' own save (``block_sparse_moe`` for
    the dense layers too) and ours back to the same tensors."""
    _, hf, path = pair
    model = load_in_form(path)
    longstraw.save_model(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(path / "model.safetensors")
    dense = [f"model.layers.{i}.block_sparse_moe." for i, layer in enumerate(model.layers)
             if type(layer.mlp).__name__ == "GatedMLP"]
    expect = {n.replace(".block_sparse_moe.", ".mlp.") if n.startswith(tuple(dense)) else n for n in theirs}
    assert set(saved) == expect
    kda = next(i for i, layer in enumerate(model.layers) if isinstance(layer.mixer, KimiDeltaAttention))
    for part in ("q_conv1d.weight", "k_conv1d.weight", "v_conv1d.weight", "f_a_proj.weight", "dt_bias", "A_log"):
        assert f"model.layers.{kda}.self_attn.{part}" in saved
    for n, t in saved.items():
        assert torch.equal(t, theirs[n if n in theirs else n.replace(".mlp.", ".block_sparse_moe.")]), n
    assert any(".mlp.gate_proj" in n for n in saved) and any(".block_sparse_moe.experts.0.w1" in n for n in saved)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64,
                                                experts_implementation="eager").eval()
    ids = torch.randint(0, V, (1, 40))
    with torch.no_grad(), true_float64():
        want = back(ids).logits
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= 1e-10
    again = load_in_form(tmp_path / "out")
    for (n, a), (m, b) in zip(model.named_weights(), again.named_weights()):
        assert n == m and torch.equal(a, b), n


def test_sharded_rows_of_the_concatenated_conv():
    """A rank's rows of the fused conv (FSDP2 shards dim 0) read only the parts of q/k/v_conv1d that fall in them."""
    from longstraw.models.kimi import weights
    from longstraw.models.weights import TensorDictReader

    parts = {f"model.layers.0.self_attn.{c}_conv1d.weight": torch.randn(6, 1, 4) for c in "qkv"}
    src = next(s for s in weights({"num_hidden_layers": 1}).sources(list(parts), TensorDictReader(parts))
               if s.param.endswith("conv1d.weight"))
    full = torch.cat(list(parts.values()))
    assert src.param == "model.layers.0.self_attn.conv1d.weight" and src.shape == (18, 1, 4)
    for a, b in ((0, 18), (0, 5), (4, 13), (6, 12), (11, 18), (7, 7)):
        assert torch.equal(src.read((a, b)), full[a:b]), (a, b)
        out = torch.empty(b - a, 1, 4)
        assert src.read((a, b), out) is out and torch.equal(out, full[a:b])


def test_prompt_state_per_layer_kind(pair):
    """KDA layers keep an O(1) conv window + per-head [D, D] state; MLA layers kv_lora_rank + qk_rope_head_dim
    latents per position."""
    _, _, path = pair
    model = load_in_form(path)
    state = prefill(model, torch.randint(0, V, (21,)), chunk_size=8)
    cfg = model.hf_config
    for layer, st in zip(model.layers, state.layers):
        if isinstance(layer.mixer, KimiDeltaAttention):
            m = layer.mixer
            assert isinstance(st, RecurrentState)
            assert tuple(st.S.shape) == (1, m.num_v_heads, m.head_k_dim, m.head_v_dim)
            assert tuple(st.conv.shape) == (1, 3 * m.num_v_heads * m.head_k_dim, m.conv_kernel - 1)
            assert st.nbytes() == m.state_bytes(torch.float64)
        else:
            assert isinstance(layer.mixer, MLAttention) and not layer.mixer.rope
            assert st.nbytes() == 21 * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 8


def test_model_has_no_rotary_embedding_and_reads_no_positions():
    """NoPE MLA: the same tokens at another start position give the same output (only the KDA states and the
    MLA keys before them matter)."""
    model = longstraw.build_model(tiny_config(layer_types=["full_attention"] * 2, num_hidden_layers=2,
                                              mlp_layer_types=["dense", "dense"]))
    assert model.model.rotary_emb is None
    ids = torch.randint(0, V, (1, 9))
    with torch.no_grad():
        a, _ = model.run(ids, 0, None)
        b, _ = model.run(ids, 1000, None)
    assert torch.equal(a, b)


def test_config_reading_follows_transformers():
    """Layer kinds from linear_attn_config's 1-indexed lists, else every 4th layer after the first; the MoE keys
    under Kimi's names or transformers' aliases; model_max_length is the context length."""
    from longstraw.models.config import ConfigReader
    from longstraw.models.kimi import layer_types

    cfg = tiny_config(num_hidden_layers=9, linear_attn_config={"num_heads": 2, "head_dim": 8})
    assert layer_types(cfg, ConfigReader(cfg), 9) == KimiLinearConfig(num_hidden_layers=9).layer_types
    model = longstraw.build_model(cfg)
    assert [isinstance(layer.mixer, MLAttention) for layer in model.layers] == [i in (4, 8) for i in range(9)]
    assert model.spec.max_position_embeddings == 4096
    aliased = {k: v for k, v in tiny_config().items() if k not in ("num_experts", "num_experts_per_token",
                                                                   "model_max_length")}
    aliased.update(num_local_experts=4, num_experts_per_tok=2, max_position_embeddings=2048)
    model = longstraw.build_model(aliased)
    gate = model.layers[1].mlp.gate
    assert gate.weight.shape[0] == 4 and gate.top_k == 2 and model.spec.max_position_embeddings == 2048
    assert KimiLinearConfig(**{k: v for k, v in aliased.items() if k != "model_type"}).num_experts == 4


@pytest.mark.parametrize("changes,msg", [
    ({"mla_use_nope": False}, "mla_use_nope=False is not supported for kimi_linear"),
    ({"moe_router_activation_func": "softmax"}, "moe_router_activation_func='softmax' is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq=2 is not supported"),
    ({"linear_attn_config": {"num_heads": 2, "head_dim": 8, "gate_lower_bound": -5.0}}, "gate_lower_bound=-5.0"),
    ({"linear_attn_config": {"num_heads": 2, "head_dim": 8, "kda_layers": [0, 1, 3], "full_attn_layers": [2]}},
     r"kda_layers holds 0; layers are numbered 1 \.\. 4"),
    ({"linear_attn_config": {"num_heads": 2, "head_dim": 8, "kda_layers": [1, 2], "full_attn_layers": [3]}},
     r"layers \[4\] are in neither"),
    ({"linear_attn_config": {"num_heads": 0, "head_dim": 8}}, "num_heads=0 must be >= 1"),
    ({"hidden_act": "situ"}, "hidden_act='situ' is not supported"),
    ({"num_expert_group": 3}, "num_expert_group=3 must divide num_experts=4"),
    ({"num_experts_per_token": 5}, "num_experts_per_token=5 must be <= num_experts=4"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types must give one of"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported"),
])
def test_bad_configs_name_the_value(changes, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.build_model(tiny_config(**changes))


def test_mtp_layers_are_skipped(tmp_path):
    """Layers past num_hidden_layers (multi-token prediction) are skipped with one warning, as for DeepSeek."""
    hf = hf_model("tiny")
    d = save_tiny(hf)
    sd = load_file(d / "model.safetensors")
    for k in [k for k in sd if k.startswith("model.layers.3.")]:
        sd[k.replace("model.layers.3.", "model.layers.4.")] = sd[k].clone()
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"multi-token-prediction \(MTP\) layers \[4\]"):
        model = longstraw.load_model(d)
    assert len(model.layers) == 4
