"""DeepSeek / GLM MoE families (deepseek_v3, glm4_moe, deepseek_v32, glm_moe_dsa, glm4_moe_lite; kimi_k2, kimi_k25):
logits and gradients against transformers in float64 (both MLA forms), float32, chunked prefill + continuation,
save/load through transformers with per-expert names, MTP layers skipped, prompt-state bytes per position, bad
configs."""

import warnings

import pytest
import torch
from hf_reference import (continuation_error, moe_save_round_trip, save_tiny, tiny_hf, true_float64,
                          weighted_logit_grads)
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, DeepseekV3Config, DeepseekV32Config, Glm4MoeConfig, Glm4MoeLiteConfig,
                          GlmMoeDsaConfig)

import longstraw
from longstraw.engine.prefill import prefill
from longstraw.models import dsa
from longstraw.models.attention import Attention
from longstraw.models.mla import MLAttention, set_mla_mode
from longstraw.state import KVState

V = 59
MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
           first_k_dense_replace=1, max_position_embeddings=256, n_group=2, topk_group=1, routed_scaling_factor=1.7,
           n_shared_experts=2)
MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5)
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64, "mscale": 1.0,
        "mscale_all_dim": 0.8, "rope_theta": 10000.0}
DSA = dict(q_lora_rank=10, index_head_dim=8, index_n_heads=32)
CONFIGS = {
    "v3": lambda: DeepseekV3Config(**MOE, **MLA, q_lora_rank=10),
    "v3-yarn-noqlora-halfsplit-bias": lambda: DeepseekV3Config(**MOE, **MLA, q_lora_rank=None, rope_interleave=False,
                                                               attention_bias=True, rope_parameters=YARN,
                                                               norm_topk_prob=False),
    "glm4_moe": lambda: Glm4MoeConfig(**{**MOE, "num_key_value_heads": 2, "n_group": 1}, head_dim=8, use_qk_norm=True,
                                      attention_bias=True),
    "v32-dense": lambda: DeepseekV32Config(**MOE, **MLA, **{**DSA, "index_n_heads": 4}, index_topk=64),
    "v32-sparse": lambda: DeepseekV32Config(**MOE, **MLA, **DSA, index_topk=6),
    "glm5-shared-sparse": lambda: GlmMoeDsaConfig(**MOE, **MLA, **DSA, index_topk=7,
                                                  indexer_types=["full", "shared", "full"]),
    # GLM-4.7-Flash: DeepSeek-V3's MLA, GLM's MoE, mlp_layer_types (no first_k_dense_replace: one dense layer)
    "glm4_moe_lite": lambda: Glm4MoeLiteConfig(**{k: v for k, v in MOE.items() if k != "first_k_dense_replace"},
                                               **MLA, q_lora_rank=None, rope_interleave=False),
}
MLA_NAMES = [n for n in CONFIGS if n != "glm4_moe"]


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def hf_model(name, seed=0):
    cfg = CONFIGS[name]()
    cfg._experts_implementation = "eager"  # HF's grouped_mm has no float64 kernel
    hf = tiny_hf(cfg, seed=seed)
    with torch.no_grad():  # the correction bias is a buffer, tiny_hf leaves it at zero: make it matter
        g = torch.Generator().manual_seed(seed)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.3)
    return hf


@pytest.fixture(scope="module", params=sorted(CONFIGS))
def pair(request):
    hf = hf_model(request.param, seed=sorted(CONFIGS).index(request.param))
    return request.param, hf, save_tiny(hf)


def _modes(name):
    return ["auto", "absorbed", "decompressed"] if name in MLA_NAMES else [None]


def _load(path, mode=None, **kw):
    model = longstraw.load_model(path, **kw)
    if mode is not None:
        set_mla_mode(model, mode, decompress_chunk=5)  # several decompression chunks even at these lengths
    return model


def test_logits_match_transformers_float64(pair):
    name, hf, path = pair
    ids = torch.randint(0, V, (2, 31))
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    for mode in _modes(name):
        model = _load(path, mode)
        assert next(model.parameters()).dtype == torch.float64
        with torch.no_grad():
            got = model(ids)
        assert (got - want).abs().max().item() <= 1e-10, mode


def test_logits_match_transformers_float32(pair):
    _, _, path = pair
    hf32 = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model = longstraw.load_model(path, dtype="float32")
    ids = torch.randint(0, V, (2, 23))
    with torch.no_grad():
        want, got = hf32(ids).logits, model(ids)
    assert (got - want).abs().max().item() <= 1e-4 * want.abs().max().item()


@pytest.mark.parametrize("chunk", [1, 7, 40])
def test_chunked_prefill_then_continuation_equals_full_forward(pair, chunk, monkeypatch):
    name, _, path = pair
    calls = []
    sparse = dsa.sparse_latent_attention
    monkeypatch.setattr(dsa, "sparse_latent_attention", lambda *a: calls.append(1) or sparse(*a))
    ids = torch.randint(0, V, (1, 45))
    p = 33
    for mode in _modes(name):
        assert continuation_error(_load(path, mode), ids, p, chunk)[0] <= 1e-10, mode
    assert bool(calls) == name.endswith("sparse")  # top-k < length: the selection is exercised


def test_hf_grads_match_transformers(pair):
    name, hf, path = pair
    ids = torch.randint(0, V, (2, 17))
    w = torch.randn(2, 17, V, dtype=torch.float64)
    for mode in _modes(name):
        got, want = weighted_logit_grads(hf, _load(path, mode), ids, w)
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11, msg=f"{mode} {n}")
    hf.zero_grad()
    if name.startswith(("v32", "glm5")):  # the indexer is not differentiated, as upstream
        assert not any(".indexer." in n for n in want)


def test_save_model_round_trips_through_transformers_with_per_expert_names(pair, tmp_path):
    _, _, path = pair
    model = longstraw.load_model(path)
    saved, back = moe_save_round_trip(model, path, tmp_path / "out", V)
    assert "model.layers.1.mlp.experts.7.gate_proj.weight" in saved
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in saved
    hf_names = {n for n, _ in back.named_parameters()} | {n for n, _ in back.named_buffers() if "rotary" not in n}
    assert hf_names == {n for n, _ in model.named_weights()}
    bias = model.model.layers[1].mlp.gate.e_score_correction_bias
    assert bias.abs().sum() > 0 and not any(b is bias for b in model.parameters())  # loaded, a buffer: never trained


def test_router_bias_stays_float32_as_transformers_keeps_it(pair):
    """bf16/fp16 models keep the router's e_score_correction_bias in float32 (transformers'
    _keep_in_fp32_modules_strict), loaded or cast; a float64 model takes it in float64."""
    _, _, path = pair
    want = load_file(path / "model.safetensors")["model.layers.1.mlp.gate.e_score_correction_bias"]
    for dtype in (torch.bfloat16, torch.float16):
        model = longstraw.load_model(path, dtype=dtype)
        bias = model.model.layers[1].mlp.gate.e_score_correction_bias
        assert model.model.layers[1].mlp.gate.weight.dtype == dtype
        assert bias.dtype == torch.float32 and torch.equal(bias, want.float())
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, experts_implementation="eager")
        assert hf.model.layers[1].mlp.gate.e_score_correction_bias.dtype == torch.float32
    model = longstraw.load_model(path, dtype=torch.float32)
    gate = model.model.layers[1].mlp.gate
    model.to(torch.bfloat16)
    assert gate.weight.dtype == torch.bfloat16 and gate.e_score_correction_bias.dtype == torch.float32
    model.half()
    assert gate.e_score_correction_bias.dtype == torch.float32
    model.double()
    assert gate.e_score_correction_bias.dtype == torch.float64
    assert torch.equal(gate.e_score_correction_bias, want.float().double())  # loaded as float32 above


def test_prompt_state_bytes_per_position(pair):
    name, _, path = pair
    model = longstraw.load_model(path)
    state = prefill(model, torch.randint(0, V, (21,)), chunk_size=8)
    cfg, b = model.hf_config, 8  # float64
    if name == "glm4_moe":
        assert all(isinstance(s, KVState) for s in state.layers)
        want = [2 * cfg["num_key_value_heads"] * cfg["head_dim"] * b] * 3
    else:
        lat = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * b
        kinds = cfg.get("indexer_types") or (["full"] * 3 if name.startswith("v32") else None)
        want = [lat + (cfg["index_head_dim"] * b if kinds and k == "full" else 0) for k in (kinds or [None] * 3)]
    assert state.bytes_per_position() == want
    assert [layer.mixer.state_bytes_per_position(torch.float64) for layer in model.layers
            if isinstance(layer.mixer, MLAttention)] == (want if name != "glm4_moe" else [])


def test_kimi_k2_text_checkpoints_are_deepseek_v3(tmp_path):
    """Kimi-K2's config names the DeepSeek-V3 architecture under model_type ``kimi_k2`` (transformers reads such a
    text config as ``deepseek_v3``): it loads as one, with the same logits, and saves with its own config."""
    import json
    import shutil

    hf = hf_model("v3", seed=7)
    src = save_tiny(hf)
    d = tmp_path / "kimi"
    shutil.copytree(src, d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="kimi_k2", architectures=["DeepseekV3ForCausalLM"])
    (d / "config.json").write_text(json.dumps(cfg))
    model = longstraw.load_model(d)
    ids = torch.randint(0, V, (1, 19))
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= 1e-10
    longstraw.save_model(model, tmp_path / "out")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["model_type"] == "kimi_k2"
    assert set(load_file(tmp_path / "out" / "model.safetensors")) == set(load_file(src / "model.safetensors"))


def kimi_k25(tied: bool, seed: int = 5):
    """A tiny Kimi-K2.5 (``kimi_k25``: DeepSeek-V3's text model, named ``kimi_k2`` in its text config as the released
    files name it, beside a one-block vision tower), float64, random weights and correction biases."""
    from hf_reference import randomised
    from transformers import Kimi_K25Config, Kimi_K25ForConditionalGeneration

    text = dict(**MOE, **MLA, q_lora_rank=10, model_type="kimi_k2")
    vision = dict(patch_size=4, pos_emb_height=4, pos_emb_width=4, pos_emb_time=2, num_attention_heads=2,
                  num_hidden_layers=1, hidden_size=16, intermediate_size=32)
    cfg = Kimi_K25Config(text_config=text, vision_config=vision, projection_hidden_size=16, image_token_id=V - 1,
                         video_token_id=V - 2, vision_start_token_id=V - 3, vision_end_token_id=V - 4,
                         tie_word_embeddings=tied)
    cfg.text_config._experts_implementation = "eager"  # (float64)
    hf = randomised(Kimi_K25ForConditionalGeneration(cfg), seed=seed)
    with torch.no_grad():
        g = torch.Generator().manual_seed(seed)
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.3)
    return hf


@pytest.mark.parametrize("tied", [False, True])
def test_kimi_k25_checkpoint_loads_as_its_deepseek_v3_text_model(tied, tmp_path):
    """A Kimi-K2.5 / K2.6 checkpoint (``kimi_k25``) loads as its text model, a ``deepseek_v3``, with transformers'
    logits on text, the vision tower and projector skipped with one warning; ``save_model`` writes a
    ``deepseek_v3`` checkpoint that transformers loads with the same logits. transformers 5.23 saves the text
    weights as ``language_model.model.blocks.N`` (its vision renames reversed everywhere); the released files'
    ``language_model.model.layers.N`` (with ``kimi_k2`` in the text config, as they name it) and transformers'
    in-memory ``model.language_model.layers.N`` load too."""
    import json
    import re

    from hf_reference import check_multimodal_text_model

    hf = kimi_k25(tied)
    ids = torch.randint(0, V - 5, (2, 21))
    model = check_multimodal_text_model(hf, tmp_path, "deepseek_v3", ids, experts_implementation="eager")
    assert model.spec.tie_word_embeddings == tied
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == ["GatedMLP", "SparseMoeBlock",
                                                                          "SparseMoeBlock"]
    with torch.no_grad(), true_float64():
        want = hf(input_ids=ids).logits
    f = tmp_path / "mm" / "model.safetensors"
    sd = load_file(f)
    assert any(k.startswith("language_model.model.blocks.") for k in sd)  # what transformers writes
    for layout, (pat, repl) in {"released": (r"^language_model\.model\.blocks\.", "language_model.model.layers."),
                                "in-memory": (r"^language_model\.model\.blocks\.", "model.language_model.layers.")
                                }.items():
        d = tmp_path / layout
        d.mkdir()
        cfg = json.loads((tmp_path / "mm" / "config.json").read_text())
        assert cfg["text_config"]["model_type"] == "deepseek_v3"  # transformers' name for it
        if layout == "released":
            cfg["text_config"]["model_type"] = "kimi_k2"
        (d / "config.json").write_text(json.dumps(cfg))
        renamed = {re.sub(pat, repl, k): v for k, v in sd.items()}
        if layout == "in-memory":
            renamed = {re.sub(r"^language_model\.model\.", "model.language_model.", k): v
                       for k, v in renamed.items()}
        save_file(renamed, d / "model.safetensors", metadata={"format": "pt"})
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # (the vision tower's, checked above)
            other = longstraw.load_model(d)
        with torch.no_grad():
            assert (other(ids) - want).abs().max().item() <= 1e-10, layout
    assert json.loads((tmp_path / "text" / "config.json").read_text())["architectures"] == ["DeepseekV3ForCausalLM"]


def test_kimi_k25_refuses_a_text_model_it_does_not_build(tmp_path):
    import json

    hf = kimi_k25(False)
    hf.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["text_config"]["model_type"] = "qwen3"
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="kimi_k25 text_config model_type 'qwen3' is not supported; supported: "
                                         "kimi_k2, deepseek_v3"):
        longstraw.load_model(tmp_path)


def test_mtp_layers_are_skipped_with_one_warning(tmp_path):
    hf = hf_model("v3")
    d = save_tiny(hf)
    sd = load_file(d / "model.safetensors")
    for k in [k for k in sd if k.startswith("model.layers.2.")]:
        sd[k.replace("model.layers.2.", "model.layers.3.")] = sd[k].clone()  # an MTP layer after the 3 main ones
    sd["model.layers.3.eh_proj.weight"] = torch.zeros(32, 64, dtype=torch.float64)
    save_file(sd, d / "model.safetensors", metadata={"format": "pt"})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = longstraw.load_model(d)
    mtp = [w for w in caught if "multi-token-prediction" in str(w.message)]
    assert len(mtp) == 1 and "[3]" in str(mtp[0].message)
    assert len(model.layers) == 3


def test_layer_kinds_follow_the_config():
    model = longstraw.build_model(CONFIGS["glm5-shared-sparse"]().to_dict())
    kinds = [type(layer.mixer).__name__ for layer in model.layers]
    assert kinds == ["SparseMLAttention"] * 3
    assert [layer.mixer.indexer is not None for layer in model.layers] == [True, False, True]
    assert [layer.mixer.source_index for layer in model.layers] == [0, 0, 2]
    assert [type(layer.mlp).__name__ for layer in model.layers] == ["GatedMLP", "SparseMoeBlock", "SparseMoeBlock"]
    glm = longstraw.build_model(CONFIGS["glm4_moe"]().to_dict())
    a = glm.layers[0].mixer
    assert isinstance(a, Attention) and a.q_proj.bias is not None and a.o_proj.bias is None and a.q_norm is not None
    assert glm.model.rotary_emb.params.rotary_dim == 4  # partial_rotary_factor 0.5 of head_dim 8
    lite = CONFIGS["glm4_moe_lite"]().to_dict()
    for types, want in ((None, [False, True, True]), (["sparse", "dense", "sparse"], [True, False, True])):
        # first_k_dense_replace is not a key of transformers' Glm4MoeLiteConfig: ignored, as there
        model = longstraw.build_model({**lite, "mlp_layer_types": types, "first_k_dense_replace": 2})
        assert [type(layer.mlp).__name__ == "SparseMoeBlock" for layer in model.layers] == want
        assert all(isinstance(layer.mixer, MLAttention) for layer in model.layers)
    assert model.model.rotary_emb.params.rotary_dim == 4  # all of qk_rope_head_dim (no partial factor: MLA)


def _cfg(name, **changes):
    cfg = CONFIGS[name]().to_dict()
    cfg.update(changes)
    return cfg


@pytest.mark.parametrize("name,changes,msg", [
    ("v32-sparse", {"q_lora_rank": None}, "deepseek_v32 needs q_lora_rank"),
    ("glm5-shared-sparse", {"indexer_types": ["shared", "full", "full"]}, r"indexer_types\[0\]='shared'"),
    ("glm5-shared-sparse", {"indexer_types": ["full", "half", "full"]}, "indexer_types must list one of"),
    ("glm5-shared-sparse", {"indexer_types": None, "index_topk_pattern": "FX"}, "may hold only 'F' and 'S'"),
    ("v32-sparse", {"mlp_layer_types": ["dense", "sparse"]}, "mlp_layer_types must list 'dense' or 'sparse'"),
    ("v3", {"n_group": 3}, "n_group=3 must divide n_routed_experts=8"),
    ("v3", {"num_experts_per_tok": 9}, "num_experts_per_tok=9 must be <= n_routed_experts=8"),
    ("v3", {"topk_group": 1, "num_experts_per_tok": 5}, "exceeds the 4 experts of topk_group=1"),
    ("v3", {"qk_rope_head_dim": 5}, "qk_rope_head_dim=5 must be even"),
    ("v32-sparse", {"index_head_dim": 2}, "index_head_dim=2 must be >= qk_rope_head_dim=4"),
    ("v3", {"kv_lora_rank": None}, "required key 'kv_lora_rank' is missing"),
    ("v3", {"scoring_func": "softmax"}, "scoring_func='softmax' is not supported for deepseek_v3; supported: 'sigm"),
])
def test_bad_configs_name_the_value(name, changes, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.build_model(_cfg(name, **changes))


def test_index_topk_pattern_and_frequency_derive_indexer_types():
    from longstraw.models.config import ConfigReader
    from longstraw.models.deepseek import indexer_types

    base = {"model_type": "glm_moe_dsa"}
    assert indexer_types({**base, "index_topk_pattern": "FSSF"}, ConfigReader({}), 4) == ["full", "shared", "shared",
                                                                                        "full"]
    derived = indexer_types({**base, "index_topk_freq": 2}, ConfigReader({"index_topk_freq": 2}), 6)
    assert derived == GlmMoeDsaConfig(num_hidden_layers=6, index_topk_freq=2).indexer_types


@pytest.mark.parametrize("heads", [2, 3])
def test_dsa_selection_with_tied_index_scores_does_not_depend_on_the_chunking(heads, monkeypatch):
    """With 2-3 indexer heads many keys score exactly 0 (every head's ReLU at 0) and top-k must choose among equal
    scores. The selection takes the lowest positions first, so log-probs do not depend on ``prefill_chunk`` (the
    prompt's keys are then scored in other blocks) nor on the score blocking; they equal one full forward. (With
    ``torch.topk``'s own choice among ties they did: up to 0.4 nats apart.)"""
    cfg = GlmMoeDsaConfig(**MOE, **MLA, **{**DSA, "index_n_heads": heads}, index_topk=6,
                          indexer_types=["full", "shared", "full"])
    cfg._experts_implementation = "eager"
    path = save_tiny(tiny_hf(cfg, seed=heads))
    model = longstraw.load_model(path)
    g = torch.Generator().manual_seed(heads)
    prompt = torch.randint(0, V, (40,), generator=g)
    responses = [torch.randint(0, V, (n,), generator=g) for n in (5, 9)]
    ties = []
    real = dsa.Indexer.scores
    monkeypatch.setattr(dsa.Indexer, "scores", lambda self, *a: ties.append(r := real(self, *a)) or r)
    runs = {}
    for chunk, score_elems in ((1, 1 << 24), (7, 1 << 24), (64, 1 << 24), (7, 40)):
        monkeypatch.setattr(dsa, "SCORE_ELEMS", score_elems)  # 40: one query and a few keys per score block
        runs[(chunk, score_elems)] = longstraw.score(model, prompt, responses,
                                                     longstraw.GRPOConfig(prefill_chunk=chunk, branch_batch=2))
    full = torch.cat([prompt, responses[1]])[None]
    with torch.no_grad():
        logits = model(full)[0, prompt.numel() - 1 : -1].double().log_softmax(-1)
    want = logits.gather(1, responses[1][:, None])[:, 0]
    first = next(iter(runs.values()))
    for key, lps in runs.items():
        for a, b in zip(lps, first):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12, msg=str(key))
    torch.testing.assert_close(first[1], want, rtol=0, atol=1e-10)
    # the case is the one that broke: a row's k-th best score is 0 with more zeros than slots left
    straddle = sum(int(((s == 0).sum(-1) > 0).logical_and(s.topk(6, dim=-1).values[..., -1] == 0).sum())
                   for s in ties if s.shape[-1] >= 6)
    assert straddle > 0


@pytest.mark.parametrize("name", ["v32-sparse", "glm5-shared-sparse"])
def test_indexer_head_weights_stay_float32_in_fp16_models_as_transformers_keeps_them(name):
    """``indexer.weights_proj`` in an fp16 model: float32, loaded with the checkpoint's values (here bf16 values
    below fp16's normal range, which a cast to fp16 would round), computed in float32 from the fp16 hidden states,
    as transformers keeps and computes it (``_keep_in_fp32_modules``: fp16 only); bf16 models keep it in bf16, as
    transformers does; cast to fp16 later (``.half()``) it stays float32, and under fp16 autocast (one process with
    master weights) it is computed in float32 too."""
    hf = hf_model(name)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("indexer.weights_proj.weight"):
                p.mul_(1e-4)  # ~2e-5: fp16 subnormals, 10 bits fewer than bf16 holds there
    path = save_tiny(hf, dtype=torch.bfloat16)
    want = load_file(path / "model.safetensors")["model.layers.0.self_attn.indexer.weights_proj.weight"]
    x = torch.randn(2, 5, hf.config.hidden_size).to(torch.float16)
    ours = longstraw.load_model(path, dtype=torch.float16)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float16, experts_implementation="eager")
    mine = ours.model.layers[0].self_attn.indexer.weights_proj
    ref = theirs.model.layers[0].self_attn.indexer.weights_proj
    assert mine.weight.dtype == ref.weight.dtype == torch.float32
    assert torch.equal(mine.weight, want.float()) and torch.equal(mine.weight, ref.weight)
    assert not torch.equal(want.half().float(), want.float())  # the values fp16 would have lost
    assert ours.model.layers[0].self_attn.indexer.wq_b.weight.dtype == torch.float16
    got = dsa.head_weights(mine, x)
    assert got.dtype == torch.float32 and torch.equal(got, ref(x.to(ref.weight.dtype)).float())
    bf = longstraw.load_model(path, dtype=torch.bfloat16).model.layers[0].self_attn.indexer.weights_proj
    hf_bf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager")
    assert bf.weight.dtype == torch.bfloat16 == hf_bf.model.layers[0].self_attn.indexer.weights_proj.weight.dtype
    model = longstraw.load_model(path, dtype=torch.float32).half()
    assert model.model.layers[0].self_attn.indexer.weights_proj.weight.dtype == torch.float32
    assert model.model.layers[0].self_attn.indexer.wq_b.weight.dtype == torch.float16
    lin = longstraw.load_model(path, dtype=torch.float32).model.layers[0].self_attn.indexer.weights_proj
    with torch.autocast("cpu", dtype=torch.float16):
        auto = dsa.head_weights(lin, x.float())
    assert auto.dtype == torch.float32 and torch.equal(auto, torch.nn.functional.linear(x.float(), lin.weight))
