"""Ling 3.0 (bailing_hybrid: Kimi Delta Attention with full-rank and bounded "safe" gates + MLA with a head gate
and RoPE + DeepSeek-style MoE): logits and gradients against transformers in float64 (both MLA forms), float32 /
bfloat16, chunked prefill + continuation, the released checkpoint layout in and out (word_embeddings, attention,
dense, q/k/v convs, the forget gate under attention, expert_bias), the config as transformers reads it, bad
configs, MTP layers skipped."""

import json

import pytest
import torch
from hf_reference import (MLA_FORMS, check_continuation_in_every_form, check_grads_in_every_form,
                          check_logits_in_every_form, check_low_precision, load_in_form, save_tiny, tiny_moe_hf,
                          true_float64, weighted_logit_grads)
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, BailingHybridConfig

import longstraw
from longstraw.models.bailing import tiny_config
from longstraw.models.kda import KimiDeltaAttention
from longstraw.models.mla import MLAttention

V = 61

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.8, "rope_theta": 10000.0}
CONFIGS = {
    # the built-in tiny config: KDA, MLA, KDA, MLA (layer_group_size 2); layer 0 dense; the safe gate
    "tiny": lambda: tiny_config(),
    # Kimi-Linear's unbounded gate, yarn RoPE, biased MLA projections, KDA heads of their own (3 of 6, conv 3),
    # layer_types and mlp_layer_types given, no renormalisation, 2 shared experts
    "plain-gate-yarn": lambda: tiny_config(
        kda_safe_gate=False, rope_parameters=YARN, attention_bias=True, linear_num_heads=3, linear_head_dim=6,
        linear_conv_kernel_dim=3, layer_types=["full_attention", "linear_attention", "linear_attention",
                                               "full_attention"],
        mlp_layer_types=["sparse", "dense", "sparse", "sparse"], moe_renormalize=False, num_shared_experts=2,
        routed_scaling_factor=1.3),
}


def hf_config(cfg: dict) -> BailingHybridConfig:
    return BailingHybridConfig(**{k: v for k, v in cfg.items() if k not in ("model_type", "architectures")})


def hf_model(name, seed=0):
    return tiny_moe_hf(hf_config(CONFIGS[name]()), seed=seed)


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = hf_model(request.param, seed=sorted(CONFIGS).index(request.param) + 11)
    return request.param, hf, save_tiny(hf)


def _hf_logits(hf, ids):
    with torch.no_grad(), true_float64():
        return hf(ids, use_cache=False).logits


def test_logits_match_transformers_float64(pair):
    _, hf, path = pair
    ids = torch.randint(0, V, (2, 150))  # crosses the 64-token rule chunk twice, not a multiple of it
    check_logits_in_every_form(path, _hf_logits(hf, ids), ids)


def test_logits_match_transformers_float32_and_bfloat16(pair):
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
    for part in (".forget_gate.A_log", ".forget_gate.f_proj.", "conv1d", ".self_attn.g_proj."):
        assert any(part in n for n in want), part


def test_save_writes_the_released_layout_that_transformers_loads(pair, tmp_path):
    """Our save writes what transformers' save_pretrained writes (the released names: word_embeddings, attention,
    dense, f_proj / dt_bias / A_log under attention, q/k/v convs, expert_bias, experts one by one), the same
    tensors; transformers loads it with our logits, and we load it back to the same tensors."""
    _, hf, path = pair
    model = load_in_form(path)
    longstraw.save_model(model, tmp_path / "out")
    saved = load_file(tmp_path / "out" / "model.safetensors")
    theirs = load_file(path / "model.safetensors")
    assert set(saved) == set(theirs)
    for n, t in saved.items():
        assert torch.equal(t, theirs[n]), n
    kda = next(i for i, layer in enumerate(model.layers) if isinstance(layer.mixer, KimiDeltaAttention))
    mla = next(i for i, layer in enumerate(model.layers) if isinstance(layer.mixer, MLAttention))
    for part in ("q_conv1d.weight", "f_proj.weight", "dt_bias", "A_log", "dense.weight", "g_proj.weight"):
        assert f"model.layers.{kda}.attention.{part}" in saved, part
    assert f"model.layers.{mla}.attention.g_proj.weight" in saved and "model.word_embeddings.weight" in saved
    assert any(n.endswith(".mlp.gate.expert_bias") for n in saved)
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "out", dtype=torch.float64,
                                                experts_implementation="eager").eval()
    ids = torch.randint(0, V, (1, 40))
    with torch.no_grad():
        assert (model(ids) - _hf_logits(back, ids)).abs().max().item() <= 1e-10
    again = load_in_form(tmp_path / "out")
    for (n, a), (m, b) in zip(model.named_weights(), again.named_weights()):
        assert n == m and torch.equal(a, b), n


def test_transformers_in_memory_names_load_too(pair, tmp_path):
    """A checkpoint under transformers' in-memory names (embed_tokens, self_attn, o_proj, forget_gate.*, one conv,
    e_score_correction_bias) loads with the same logits."""
    _, hf, _ = pair
    d = tmp_path / "mem"
    d.mkdir()
    (d / "config.json").write_text((save_tiny(hf) / "config.json").read_text())
    sd = {n: t.detach().clone() for n, t in hf.state_dict().items() if not n.endswith("inv_freq")}
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    assert any(".forget_gate.f_proj." in n for n in sd) and any(n.endswith("self_attn.conv1d.weight") for n in sd)
    ids = torch.randint(0, V, (1, 33))
    with torch.no_grad():
        assert (load_in_form(d)(ids) - _hf_logits(hf, ids)).abs().max().item() <= 1e-10


def test_config_reading_follows_transformers():
    """Layer kinds from layer_group_size (the last of each group is MLA), dense layers from first_k_dense_replace,
    KDA's heads / head size / conv kernel from linear_* else num_attention_heads / head_dim /
    short_conv_kernel_size, the MoE keys under Ling's names or transformers' aliases, model_max_length the context
    length: as transformers' config derives each."""
    cfg = {k: v for k, v in tiny_config(num_hidden_layers=13).items()
           if k not in ("first_k_dense_replace", "layer_group_size")}  # transformers' defaults: 2 dense, groups of 6
    theirs = hf_config(cfg)
    model = longstraw.build_model(cfg)
    assert [("full_attention" if isinstance(layer.mixer, MLAttention) else "linear_attention")
            for layer in model.layers] == theirs.layer_types
    assert [("sparse" if type(layer.mlp).__name__ == "SparseMoeBlock" else "dense")
            for layer in model.layers] == theirs.mlp_layer_types
    kda = model.layers[0].mixer
    assert (kda.num_v_heads, kda.head_v_dim, kda.conv_kernel) == (theirs.linear_num_heads, theirs.linear_head_dim,
                                                                  theirs.linear_conv_kernel_dim)
    assert kda.forget_gate.lower_bound == theirs.kda_lower_bound == -5.0
    aliased = {k: v for k, v in tiny_config().items() if k not in ("num_experts", "num_experts_per_token",
                                                                   "model_max_length")}
    aliased.update(num_local_experts=8, num_experts_per_tok=3, max_position_embeddings=2048)
    model = longstraw.build_model(aliased)
    gate = model.layers[1].mlp.gate
    theirs = hf_config(aliased)
    assert gate.weight.shape[0] == theirs.num_experts == 8 and gate.top_k == theirs.num_experts_per_token == 3
    assert model.spec.max_position_embeddings == theirs.model_max_length == 2048
    both = tiny_config(num_local_experts=4, num_experts_per_tok=1)  # Ling's keys set too: they win, as there
    gate = longstraw.build_model(both).layers[1].mlp.gate
    theirs = hf_config(both)
    assert gate.weight.shape[0] == theirs.num_experts == 8 and gate.top_k == theirs.num_experts_per_token == 2


@pytest.mark.parametrize("changes,msg", [
    ({"kda_lower_bound": 0.5}, r"kda_lower_bound=0.5 must be < 0"),
    ({"linear_num_heads": 0}, "linear_num_heads=0 must be >= 1"),
    ({"hidden_act": "situ"}, "hidden_act='situ' is not supported"),
    ({"num_expert_group": 3}, "num_expert_group=3 must divide num_experts=8"),
    ({"num_experts_per_token": 9}, "num_experts_per_token=9 must be <= num_experts=8"),
    ({"layer_types": ["linear_attention"] * 3}, "layer_types must give one of"),
    ({"mlp_layer_types": ["dense", "moe", "sparse", "sparse"]}, "mlp_layer_types must list 'dense' or 'sparse'"),
    ({"tie_word_embeddings": True}, "tie_word_embeddings=True is not supported for bailing_hybrid"),
    ({"qk_rope_head_dim": 5}, "qk_rope_head_dim=5 must be even"),
    ({"gated_attention_proj_granularity_type": "element_wise"},
     "gated_attention_proj_granularity_type='element_wise' is not supported"),
    ({"q_lora_rank": 0}, "q_lora_rank=0 must be >= 1"),
    ({"moe_shared_expert_intermediate_size": 16}, "moe_shared_expert_intermediate_size=16 differs from "
                                                  "moe_intermediate_size=8"),
])
def test_bad_configs_name_the_value(changes, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.build_model(tiny_config(**changes))


def test_mtp_layers_are_skipped(tmp_path):
    """Layers past num_hidden_layers (multi-token prediction, ``model.layers.{n}.*``) are skipped with one warning."""
    hf = hf_model("tiny")
    d = save_tiny(hf)
    sd = load_file(d / "model.safetensors")
    for k in [k for k in sd if k.startswith("model.layers.3.")]:
        sd[k.replace("model.layers.3.", "model.layers.4.")] = sd[k].clone()
    sd["model.mtp.layers.0.enorm.weight"] = torch.ones(32, dtype=torch.float64)  # where Ling 3.0's releases keep
    sd["model.mtp.layers.0.eh_proj.weight"] = torch.ones(32, 64, dtype=torch.float64)  # theirs
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=r"multi-token-prediction \(MTP\) layers \[4\] \(model.layers.4\+\), "
                                         r"model.mtp.\* are not used"):
        model = longstraw.load_model(d)
    assert len(model.layers) == 4


class _LowRankQuery(torch.nn.Module):
    """The query path of Ling 3.0's released model code where ``q_lora_rank`` is set, ``q_b(RMSNorm(q_a(x)))``, put
    in place of transformers' full-rank ``q_proj`` (transformers 5.23 ignores ``q_lora_rank``): the reference for
    the low-rank-query variant."""

    def __init__(self, hidden: int, rank: int, out: int):
        from transformers.models.bailing_hybrid.modeling_bailing_hybrid import BailingHybridRMSNorm

        super().__init__()
        self.q_a_proj = torch.nn.Linear(hidden, rank, bias=False, dtype=torch.float64)
        self.q_a_layernorm = BailingHybridRMSNorm(rank, eps=1e-6).to(torch.float64)
        self.q_b_proj = torch.nn.Linear(rank, out, bias=False, dtype=torch.float64)
        with torch.no_grad():
            for t in (self.q_a_proj.weight, self.q_b_proj.weight):
                t.normal_(0, 0.3)
            self.q_a_layernorm.weight.normal_(1.0, 0.1)

    def forward(self, x):
        return self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))


@pytest.fixture(scope="module")
def low_rank_q():
    """transformers' model of the tiny config with every MLA layer's queries low-rank (``q_lora_rank`` 12), and the
    checkpoint of it in the released layout (``attention.q_a_proj`` / ``q_a_layernorm`` / ``q_b_proj``)."""
    hf = hf_model("tiny", seed=5)
    torch.manual_seed(5)
    for layer in hf.model.layers:
        attn = layer.self_attn
        if hasattr(attn, "kv_a_proj_with_mqa"):
            attn.q_proj = _LowRankQuery(32, 12, attn.q_proj.out_features)
    path = save_tiny(hf)
    sd = load_file(path / "model.safetensors")
    sd = {n.replace(".q_proj.q_", ".q_"): t for n, t in sd.items()}
    assert any(".attention.q_a_layernorm.weight" in n for n in sd) and not any(".q_proj." in n and "conv" not in n
                                                                               and ".layers.1." in n for n in sd)
    save_file(sd, path / "model.safetensors", metadata={"format": "pt"})
    cfg = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**cfg, "q_lora_rank": 12}))
    return hf, path


def test_low_rank_queries_match_the_released_model_code(low_rank_q, tmp_path):
    """``q_lora_rank`` (Ling-3.0-tiny's config sets 256): the MLA layers take low-rank queries, and logits,
    continuation and gradients equal transformers' model with that query path in float64, in both MLA forms; the
    checkpoint round-trips in the released layout."""
    hf, path = low_rank_q
    model = load_in_form(path)
    mla = next(layer.mixer for layer in model.layers if isinstance(layer.mixer, MLAttention))
    assert mla.q_a_proj.weight.shape == (12, 32) and getattr(mla, "q_proj", None) is None
    ids = torch.randint(0, V, (2, 90))
    check_logits_in_every_form(path, _hf_logits(hf, ids), ids)
    check_continuation_in_every_form(path, torch.randint(0, V, (1, 60)), 45, 7)
    for form in MLA_FORMS:
        got, want = weighted_logit_grads(hf, load_in_form(path, form), ids[:, :40],
                                         torch.randn(2, 40, V, dtype=torch.float64))
        want = {n.replace(".q_proj.q_", ".q_"): g for n, g in want.items()}
        assert set(got) == set(want) and any(".q_a_layernorm." in n for n in got)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11, msg=f"{form} {n}")
    longstraw.save_model(model, tmp_path / "out")
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(load_file(path / "model.safetensors"))
    with torch.no_grad():
        assert torch.equal(load_in_form(tmp_path / "out")(ids), model(ids))


def test_depthwise_conv_kernels_stored_without_their_middle_dimension_load(pair, tmp_path):
    """q / k / v conv kernels stored ``[C, K]`` (as some ports of Ling 3.0 write them) load as ``[C, 1, K]``."""
    _, hf, path = pair
    d = tmp_path / "flat"
    d.mkdir()
    (d / "config.json").write_text((path / "config.json").read_text())
    sd = load_file(path / "model.safetensors")
    flat = {n: (t[:, 0] if "_conv1d." in n else t) for n, t in sd.items()}
    assert sum("_conv1d." in n for n in flat) >= 3
    save_file(flat, d / "model.safetensors", metadata={"format": "pt"})
    ids = torch.randint(0, V, (1, 30))
    with torch.no_grad():
        assert torch.equal(load_in_form(d)(ids), load_in_form(path)(ids))
