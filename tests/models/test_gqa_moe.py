"""GQA + MoE families (qwen3_moe, qwen2_moe, mixtral, minimax_m2, olmoe; Qwen3-VL-MoE's text model): logits and
gradients against transformers in float64 and float32, chunked prefill + continuation, bf16 logits (Mixtral's float32
routing weights), save/load through transformers under the names it writes (Mixtral's block_sparse_moe / w1 w2 w3),
the num_experts alias, which layers are sparse, sliding windows, bad configs."""

import json
import warnings

import pytest
import torch
from hf_reference import (continuation_error, moe_save_round_trip, save_tiny, tiny_moe_hf, true_float64,
                          weighted_logit_grads)
from safetensors.torch import save_file
from transformers import (AutoModelForCausalLM, MiniMaxM2Config, MixtralConfig, OlmoeConfig, Qwen2MoeConfig,
                          Qwen3MoeConfig)

import longstraw
from longstraw.models.mlp import GatedMLP
from longstraw.models.moe_block import SparseMoeBlock
from longstraw.state import KVState

V = 59
BASE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256)
CONFIGS = {
    # norm_topk_prob on (the released Qwen3-MoE checkpoints), a dense layer from mlp_only_layers, free head_dim
    "qwen3_moe": lambda: Qwen3MoeConfig(**BASE, intermediate_size=40, moe_intermediate_size=8, head_dim=12,
                                        num_experts=8, num_experts_per_tok=3, norm_topk_prob=True,
                                        mlp_only_layers=[1]),
    # norm_topk_prob off (transformers' default), q/k/v and o biases, tied embeddings
    "qwen3_moe-bias-tied": lambda: Qwen3MoeConfig(**{**BASE, "num_key_value_heads": 4}, intermediate_size=40,
                                                  moe_intermediate_size=8, num_experts=6, num_experts_per_tok=2,
                                                  attention_bias=True, tie_word_embeddings=True),
    # gated shared expert, every second layer sparse (decoder_sparse_step), q/k/v bias
    "qwen2_moe": lambda: Qwen2MoeConfig(**BASE, intermediate_size=40, moe_intermediate_size=8,
                                        shared_expert_intermediate_size=12, num_experts=8, num_experts_per_tok=2,
                                        decoder_sparse_step=2),
    "mixtral": lambda: MixtralConfig(**{**BASE, "num_hidden_layers": 2}, intermediate_size=16, num_local_experts=6,
                                     num_experts_per_tok=2),
    # sigmoid router with a correction bias, q/k norms over all heads, partial RoPE from the released configs'
    # rotary_dim (6 of head_dim 8)
    "minimax_m2": lambda: MiniMaxM2Config(**{**BASE, "num_hidden_layers": 2}, head_dim=8, intermediate_size=16,
                                          num_local_experts=6, num_experts_per_tok=2, rotary_dim=6,
                                          bos_token_id=None, eos_token_id=None),
    # q/k norms over all heads, q/k/v clipped (clip_qkv 0.3: active at these weights), biases, renormalised top-k
    "olmoe": lambda: OlmoeConfig(**BASE, intermediate_size=16, num_experts=6, num_experts_per_tok=2, clip_qkv=0.3,
                                 attention_bias=True, norm_topk_prob=True, pad_token_id=None, eos_token_id=None),
}


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = tiny_moe_hf(CONFIGS[request.param](), seed=sorted(CONFIGS).index(request.param) + 60)
    return request.param, hf, save_tiny(hf)


def test_logits_match_transformers_float64(pair):
    _, hf, path = pair
    model = longstraw.load_model(path)
    assert next(model.parameters()).dtype == torch.float64
    ids = torch.randint(0, V, (2, 31))
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        got = model(ids)
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-10


def test_logits_match_transformers_float32(pair):
    _, _, path = pair
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, experts_implementation="eager").eval()
    model = longstraw.load_model(path, dtype="float32")
    ids = torch.randint(0, V, (2, 23))
    with torch.no_grad():
        want, got = hf32(ids).logits, model(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


def test_bf16_logits_follow_transformers_routing_weight_dtype(pair):
    """Mixtral weights each expert's output by a float32 routing weight (rounded once), Qwen by a bf16 one: in bf16
    the difference is visible, and ours follows transformers."""
    name, _, path = pair
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager").eval()
    model = longstraw.load_model(path, dtype="bfloat16")
    gate = next(layer.mlp.gate for layer in model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    x = torch.randn(5, 32, dtype=torch.bfloat16)
    assert gate(x)[0].dtype == (torch.float32 if name in ("mixtral", "minimax_m2") else torch.bfloat16)
    # seeded: a router near-tie flips an expert in either bf16 model now and then (MiniMax-M2: 1 input in 20 past
    # 5%, measured 2026-12-05), which says nothing about the routing weights' dtype
    ids = torch.randint(0, V, (1, 19), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want, got = hf(ids).logits.float(), model(ids).float()
    assert (got - want).abs().max().item() <= 0.05 * want.abs().max().item()


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_chunked_prefill_then_continuation_equals_full_forward(pair, chunk):
    _, _, path = pair
    model = longstraw.load_model(path)
    ids = torch.randint(0, V, (1, 45))
    err, states = continuation_error(model, ids, 33, chunk)
    assert all(isinstance(st, KVState) and st.length == 33 for st in states) and err <= 1e-10


def test_hf_grads_match_transformers(pair):
    _, hf, path = pair
    ids = torch.randint(0, V, (2, 17))
    got, want = weighted_logit_grads(hf, longstraw.load_model(path), ids, torch.randn(2, 17, V, dtype=torch.float64))
    assert set(got) == set(want)
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11, msg=n)


def test_save_model_round_trips_through_transformers_under_its_names(pair, tmp_path):
    name, _, path = pair
    model = longstraw.load_model(path)
    saved, back = moe_save_round_trip(model, path, tmp_path / "out", V)
    expert = ("model.layers.1.block_sparse_moe.experts.5.w3.weight" if name in ("mixtral", "minimax_m2")
              else "model.layers.2.mlp.experts.5.up_proj.weight" if name != "qwen2_moe"
              else "model.layers.1.mlp.experts.5.up_proj.weight")
    assert expert in saved
    assert {n for n, _ in back.named_parameters()} == {n for n, _ in model.named_parameters()}  # hf_grads' names


def test_fused_in_memory_checkpoint_names_load_too(tmp_path):
    """A checkpoint written with transformers 5's in-memory names (fused experts, Mixtral's ``mlp``) loads as is."""
    for name in ("qwen3_moe", "mixtral"):
        hf = tiny_moe_hf(CONFIGS[name](), seed=3)
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps(hf.config.to_dict()))
        save_file({n: p.detach().contiguous() for n, p in hf.state_dict().items()}, d / "model.safetensors",
                  metadata={"format": "pt"})
        model = longstraw.load_model(d, dtype="float64")
        ids = torch.randint(0, V, (1, 13))
        with torch.no_grad(), true_float64():
            want = hf(ids).logits
        with torch.no_grad():
            assert (model(ids) - want).abs().max().item() <= 1e-10


def test_layer_kinds_follow_the_config():
    kinds = {n: [type(layer.mlp) for layer in longstraw.build_model(CONFIGS[n]().to_dict()).model.layers]
             for n in CONFIGS}
    assert kinds["qwen3_moe"] == [SparseMoeBlock, GatedMLP, SparseMoeBlock]
    assert kinds["qwen2_moe"] == [GatedMLP, SparseMoeBlock, GatedMLP]  # decoder_sparse_step 2
    assert kinds["mixtral"] == kinds["minimax_m2"] == [SparseMoeBlock, SparseMoeBlock]
    assert kinds["olmoe"] == [SparseMoeBlock] * 3
    ol = longstraw.build_model(CONFIGS["olmoe"]().to_dict()).model.layers[0].self_attn
    assert ol.clip_qkv == 0.3 and ol.q_norm.weight.shape == (32,) and ol.k_norm.weight.shape == (16,)
    assert ol.o_proj.bias is not None
    mm = longstraw.build_model(CONFIGS["minimax_m2"]().to_dict()).model
    a = mm.layers[0].self_attn
    assert a.q_norm.weight.shape == (4 * 8,) and a.k_norm.weight.shape == (2 * 8,)  # over all heads
    assert mm.rotary_emb.params.rotary_dim == 6 and mm.rotary_emb.params.theta == 5_000_000.0  # its default
    q2 = longstraw.build_model(CONFIGS["qwen2_moe"]().to_dict()).model.layers[1]
    assert q2.mlp.shared_expert_gate is not None and q2.self_attn.q_proj.bias is not None
    assert q2.self_attn.o_proj.bias is None
    q3 = longstraw.build_model(CONFIGS["qwen3_moe-bias-tied"]().to_dict()).model.layers[0]
    assert q3.self_attn.q_norm is not None and q3.self_attn.o_proj.bias is not None
    assert q3.mlp.shared_name is None and not q3.mlp.gate.norm_topk_prob


def _cfg(name, **changes):
    cfg = CONFIGS[name]().to_dict()
    cfg.update(changes)
    return cfg


def test_num_experts_is_read_under_either_key():
    """Qwen's published configs say ``num_experts``; transformers 5 writes Qwen3-MoE's as ``num_local_experts``."""
    cfg = _cfg("qwen3_moe")
    assert "num_local_experts" in cfg and "num_experts" not in cfg
    published = {k: v for k, v in cfg.items() if k != "num_local_experts"} | {"num_experts": 8}
    for c in (cfg, published):
        assert longstraw.build_model(c).model.layers[0].mlp.experts.num_experts == 8
    assert all(isinstance(layer.mlp, GatedMLP) for layer in longstraw.build_model(
        {k: v for k, v in cfg.items() if k != "num_local_experts"}).model.layers)  # no experts: dense, as HF


@pytest.mark.parametrize("name,changes,msg", [
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be <= num_local_experts=8"),
    ("qwen3_moe", {"num_experts": 6}, "num_experts=6 and num_local_experts=8 disagree"),
    ("qwen3_moe", {"mlp_only_layers": "1"}, r"mlp_only_layers='1' must be a list of layer indices"),
    ("qwen3_moe", {"decoder_sparse_step": 0}, "decoder_sparse_step=0 must be >= 1"),
    ("qwen2_moe", {"shared_expert_intermediate_size": None}, "required key 'shared_expert_intermediate_size'"),
    ("mixtral", {"num_local_experts": 0}, r"num_experts_per_tok=2 must be <= num_local_experts=0"),
    ("mixtral", {"intermediate_size": -4}, "intermediate_size=-4 must be >= 1"),
    ("olmoe", {"clip_qkv": -1.0}, r"clip_qkv=-1.0 must be > 0"),
    ("minimax_m2", {"attn_type_list": [1, 0]}, r"attn_type_list=\[1, 0\]: only full attention \(1\)"),
    ("minimax_m2", {"rope_parameters": None, "rotary_dim": 7}, "rotary_dim=7 must be even and <= head_dim=8"),
])
def test_bad_configs_name_the_value(name, changes, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.build_model(_cfg(name, **changes))


def test_mixtral_router_jitter_is_ignored_with_a_warning():
    with pytest.warns(UserWarning, match="router_jitter_noise=0.01 is ignored"):
        longstraw.build_model(_cfg("mixtral", router_jitter_noise=0.01))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        longstraw.build_model(_cfg("mixtral"))


def test_minimax_released_config_keys():
    """The released MiniMax-M2 config.json says ``rotary_dim`` (no ``rope_parameters``) and may leave the theta
    out: partial RoPE of ``rotary_dim / head_dim``, theta 5e6, as transformers reads it."""
    hub = {k: v for k, v in _cfg("minimax_m2").items() if k not in ("rope_parameters", "partial_rotary_factor")}
    params = longstraw.build_model({**hub, "rotary_dim": 4}).model.rotary_emb.params
    assert (params.rotary_dim, params.theta) == (4, 5_000_000.0)
    from transformers import AutoConfig

    hf = AutoConfig.for_model(**{**hub, "rotary_dim": 4}).to_dict()
    assert longstraw.build_model(hf).model.rotary_emb.params == params


@pytest.mark.parametrize("name,changes,window", [
    ("qwen3_moe", {}, None),
    ("qwen3_moe", {"use_sliding_window": True, "sliding_window": 64}, 64),
    ("qwen2_moe", {"layer_types": None, "use_sliding_window": True, "sliding_window": 48, "max_window_layers": 2},
     48),
    ("qwen2_moe", {"layer_types": None, "use_sliding_window": True, "sliding_window": 48, "max_window_layers": 0},
     None),
    ("mixtral", {"sliding_window": 80}, 80),
])
def test_sliding_windows_are_recorded_as_transformers_sets_them(name, changes, window):
    model = longstraw.build_model(_cfg(name, **changes))
    assert model.spec.sliding_window == window
    got = [layer.self_attn.window for layer in model.model.layers]
    slides = [i % 2 == 0 and i < 2 for i in range(3)] if name == "qwen2_moe" else [True] * len(got)
    assert got == [window if s else None for s in slides]


def test_mixtral_expert_rows_are_saved_under_mixtral_names():
    """An expert-parallel rank writes its share of the fused experts (``save_rows``, no gather) under the
    checkpoint's names: experts ``first ..`` as ``block_sparse_moe.experts.E.w1/w3/w2``."""
    from longstraw.models.gqa_moe import weights

    wmap = weights({"model_type": "mixtral"})
    gate_up = torch.arange(2 * 6 * 4, dtype=torch.float64).reshape(2, 6, 4)  # experts 3, 4: I = 3, H = 4
    got = dict(wmap.save_rows("model.layers.1.mlp.experts.gate_up_proj", gate_up, 3))
    assert sorted(got) == [f"model.layers.1.block_sparse_moe.experts.{e}.{w}.weight" for e in (3, 4)
                           for w in ("w1", "w3")]
    assert torch.equal(got["model.layers.1.block_sparse_moe.experts.4.w3.weight"], gate_up[1, 3:])
    down = dict(wmap.save_rows("model.layers.0.mlp.experts.down_proj", torch.zeros(1, 4, 3), 5))
    assert list(down) == ["model.layers.0.block_sparse_moe.experts.5.w2.weight"]
    # the router and everything else: one rename each way; adapter keys (in-memory names) are left alone
    assert dict(wmap.save_tensors([("model.layers.0.mlp.gate.weight", None)])) == {
        "model.layers.0.block_sparse_moe.gate.weight": None}
    key = "model.layers.0.mlp.experts.lora_adapters.gate_up_proj.lora_A.weight"
    assert dict(wmap.save_tensors([(key, None)])) == {key: None}
    assert wmap.param_name("model.layers.0.block_sparse_moe.gate.weight") == "model.layers.0.mlp.gate.weight"


def test_qwen3_vl_moe_checkpoint_loads_as_its_qwen3_moe_text_model(tmp_path):
    """A Qwen3-VL MoE checkpoint (``qwen3_vl_moe``: the text model under ``model.language_model.``, a vision tower
    under ``model.visual.``, fused experts) loads as its text model, a ``qwen3_moe`` whose router renormalises the
    top-k, with transformers' logits on text, the vision tower skipped with one warning; ``save_model`` writes a
    ``qwen3_moe`` checkpoint that transformers loads with the same logits. The experts as the released files store
    them (transposed: ``gate_up_proj [E, H, 2I]``, ``down_proj [E, I, H]``; transformers writes its in-memory
    layout) load too."""
    from hf_reference import _perturbed, check_multimodal_text_model, qwen3_vl_config
    from safetensors.torch import load_file
    from transformers import Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration

    text = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=12, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=6, num_experts_per_tok=2,
                mlp_only_layers=[1], max_position_embeddings=256)
    cfg = qwen3_vl_config(Qwen3VLMoeConfig, V, text)
    cfg._experts_implementation = cfg.text_config._experts_implementation = "eager"  # (float64)
    torch.manual_seed(8)
    hf = _perturbed(Qwen3VLMoeForConditionalGeneration(cfg), 0.2)
    ids = torch.randint(0, V - 5, (2, 27))
    model = check_multimodal_text_model(hf, tmp_path, "qwen3_moe", ids, experts_implementation="eager")
    assert model.hf_config["norm_topk_prob"] is True
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["SparseMoeBlock", "GatedMLP",
                                                                          "SparseMoeBlock"]
    f = next((tmp_path / "mm").glob("*.safetensors"))
    sd = load_file(f)
    turned = {k for k in sd if k.endswith(("experts.gate_up_proj", "experts.down_proj"))}
    assert len(turned) == 4 and all(sd[k].shape[2] in (32, 12) for k in turned)  # [E, 2I, H] / [E, H, I]
    save_file({k: v.transpose(1, 2).contiguous() if k in turned else v for k, v in sd.items()}, f,
              metadata={"format": "pt"})
    with torch.no_grad(), true_float64():
        want = hf(input_ids=ids).logits
        back = Qwen3VLMoeForConditionalGeneration.from_pretrained(tmp_path / "mm", dtype=torch.float64,
                                                                  experts_implementation="eager").eval()
        assert (back(input_ids=ids).logits - want).abs().max().item() <= 1e-10  # transformers reads them so too
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the vision tower's, checked above)
        released = longstraw.load_model(tmp_path / "mm")
    with torch.no_grad():
        assert (released(ids) - want).abs().max().item() <= 1e-10
