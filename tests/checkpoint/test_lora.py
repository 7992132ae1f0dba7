"""LoRA against PEFT on transformers, in float64, for every family: logits of base + adapter, grpo_backward's
adapter gradients (exact and detached) against the naive full-graph loss on the PEFT model, PEFT's adapter format
both ways, merging, rsLoRA / rank and alpha patterns / regex and all-linear targets / modules_to_save, bad input.

PEFT 0.21 on transformers 5 re-targets ``gate_proj`` / ``up_proj`` / ``down_proj`` / ``gate`` of the model types
whose MoE layers transformers fuses (``REMAPPED``) to the routed experts' fused parameters and the router, dropping
those names from ``target_modules``: the dense MLP layers and the shared experts, plain ``nn.Linear`` modules in
transformers as here, then get no adapter from PEFT (and an adapter file's tensors for them are ignored). The
reference for those families is PEFT's LoRA on the same ``nn.Linear`` modules with that re-targeting switched off
(``no_moe_remap``); ``test_stock_peft_on_remapped_moe_families`` pins what stock PEFT does there.
"""

import contextlib
import copy
import json
import os
import re
import sys
import warnings

import peft
import peft.utils.transformers_weight_conversion as twc
import pytest
import torch
from hf_reference import cached_pairs, tiny_moe_hf, true_float64
from peft.utils import get_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import (AutoModelForCausalLM, BailingHybridConfig, DeepseekV3Config, Gemma3TextConfig,
                          Glm4MoeConfig, Glm4MoeLiteConfig, GlmMoeDsaConfig, GptOssConfig, KimiLinearConfig,
                          LlamaConfig, MiniMaxM2Config, Ministral3Config, MixtralConfig, Olmo2Config, Olmo3Config,
                          OlmoeConfig, Qwen2MoeConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig)
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

import longstraw
from longstraw.models.bailing import tiny_config as ling_tiny_config
from longstraw.models.kimi import tiny_config as kimi_tiny_config
from longstraw.models.lora import LoRALinear, adapted_modules
from longstraw.models.mla import set_mla_mode
from longstraw.rl.optim import make_optimizer

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "engine"))
from grpo_reference import random_group, run_against_reference  # noqa: E402
from test_hybrid_grpo import router64  # noqa: E402  (the hybrid reference's float64 + cache patches)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

V = 53
ATTN = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP = ["gate_proj", "up_proj", "down_proj"]
MLA_T = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
HYB = dict(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
           linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, vocab_size=V,
           max_position_embeddings=512)
MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
           num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
           first_k_dense_replace=1, max_position_embeddings=256, n_group=2, topk_group=1, routed_scaling_factor=1.7)
MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=10)
GQA_MOE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               max_position_embeddings=256)

# family: (tiny HF config, LoRA targets covering its projections, MLA form)
FAMILIES = {
    "llama": (lambda: LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=2, vocab_size=V, max_position_embeddings=512),
              ATTN + MLP, None),
    "qwen3": (lambda: Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                                  num_key_value_heads=1, head_dim=12, vocab_size=V, max_position_embeddings=512,
                                  tie_word_embeddings=True),
              ATTN + MLP, None),
    "qwen3_next": (lambda: Qwen3NextConfig(**HYB, num_hidden_layers=3, intermediate_size=40, full_attention_interval=3,
                                           num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                           shared_expert_intermediate_size=24, mlp_only_layers=[1]),
                   ATTN + MLP + ["shared_expert_gate", "in_proj_qkvz", "in_proj_ba", "out_proj"], None),
    "qwen3_5": (lambda: Qwen3_5TextConfig(**HYB, num_hidden_layers=3, intermediate_size=48, full_attention_interval=2),
                ATTN + MLP + ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj"], None),
    "qwen3_5_moe": (lambda: Qwen3_5MoeTextConfig(**HYB, num_hidden_layers=4, full_attention_interval=2, num_experts=4,
                                                 num_experts_per_tok=2, moe_intermediate_size=16,
                                                 shared_expert_intermediate_size=24),
                    ATTN + MLP + ["shared_expert_gate", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a",
                                  "out_proj"], None),
    "deepseek_v3": (lambda: DeepseekV3Config(**MOE, **MLA), MLA_T + MLP, "absorbed"),
    # MLA without q_lora_rank: one q_proj
    "deepseek_v3_q": (lambda: DeepseekV3Config(**MOE, **{**MLA, "q_lora_rank": None}),
                      ["q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"] + MLP, "decompressed"),
    "glm4_moe": (lambda: Glm4MoeConfig(**{**MOE, "num_key_value_heads": 2, "n_group": 1}, head_dim=8,
                                       use_qk_norm=True, attention_bias=True),
                 ATTN + MLP, None),
    # MLA + DSA; index_topk 7 < the positions of a group: the sparse path is exercised
    "glm_moe_dsa": (lambda: GlmMoeDsaConfig(**MOE, **MLA, index_topk=7, index_head_dim=8, index_n_heads=32,
                                            indexer_types=["full", "shared", "full"]),
                    MLA_T + MLP + ["wq_b", "wk", "weights_proj"], "decompressed"),
    # GQA + softmax-routed MoE: a dense layer (mlp_only_layers), a gated shared expert, Mixtral (every layer sparse:
    # no nn.Linear MLP to adapt)
    "qwen3_moe": (lambda: Qwen3MoeConfig(**GQA_MOE, intermediate_size=40, moe_intermediate_size=8, head_dim=12,
                                         num_experts=6, num_experts_per_tok=2, norm_topk_prob=True,
                                         mlp_only_layers=[1]),
                  ATTN + MLP, None),
    "qwen2_moe": (lambda: Qwen2MoeConfig(**GQA_MOE, intermediate_size=40, moe_intermediate_size=8,
                                         shared_expert_intermediate_size=12, num_experts=6, num_experts_per_tok=2),
                  ATTN + MLP + ["shared_expert_gate"], None),
    "mixtral": (lambda: MixtralConfig(**GQA_MOE, intermediate_size=16, num_local_experts=4, num_experts_per_tok=2),
                ATTN, None),
    "glm4_moe_lite": (lambda: Glm4MoeLiteConfig(**{k: v for k, v in MOE.items() if k != "first_k_dense_replace"},
                                                **MLA),
                      MLA_T + MLP, "decompressed"),
    "minimax_m2": (lambda: MiniMaxM2Config(**GQA_MOE, head_dim=8, intermediate_size=16, num_local_experts=4,
                                           num_experts_per_tok=2, rotary_dim=4, bos_token_id=None, eos_token_id=None),
                   ATTN, None),
    "olmoe": (lambda: OlmoeConfig(**GQA_MOE, intermediate_size=16, num_experts=4, num_experts_per_tok=2,
                                  clip_qkv=0.5, pad_token_id=None, eos_token_id=None),
              ATTN, None),
    # attention sinks, alternating sliding windows (5; the groups here reach past them), biased experts
    "gpt_oss": (lambda: GptOssConfig(**GQA_MOE, head_dim=8, intermediate_size=16, num_local_experts=4,
                                     num_experts_per_tok=2, sliding_window=5, swiglu_limit=1.5, pad_token_id=None,
                                     eos_token_id=None, bos_token_id=None),
                ATTN, None),
    # two RoPEs, sandwich norms, scaled embeddings, sliding windows (5), pad id 0 in the groups
    "gemma3": (lambda: Gemma3TextConfig(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                                        num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                        query_pre_attn_scalar=24, max_position_embeddings=256,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
               ATTN + MLP, None),
    # post-norm blocks, q/k norms over all heads, sliding windows (5) with their own RoPE
    "olmo3": (lambda: Olmo3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=4,
                                  num_attention_heads=4, num_key_value_heads=2, sliding_window=5,
                                  max_position_embeddings=256, eos_token_id=None, pad_token_id=None),
              ATTN + MLP, None),
    "olmo2": (lambda: Olmo2Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                  eos_token_id=None, pad_token_id=None),
              ATTN + MLP, None),
    # queries scaled with the position (the scale changes every 8 positions here), YaRN
    "ministral3": (lambda: Ministral3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                            num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                            max_position_embeddings=256, pad_token_id=None,
                                            rope_parameters={"rope_type": "yarn", "rope_theta": 1e6, "factor": 16.0,
                                                             "original_max_position_embeddings": 8,
                                                             "max_position_embeddings": 256, "beta_fast": 32.0,
                                                             "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0,
                                                             "llama_4_scaling_beta": 0.1}),
                   ATTN + MLP, None),
    # Kimi Delta Attention (its low-rank forget and output gates, which the released layout keeps directly under
    # self_attn) + NoPE MLA with one q_proj + DeepSeek-style MoE with a shared expert and a dense first layer
    "kimi_linear": (lambda: KimiLinearConfig(**{k: v for k, v in kimi_tiny_config(vocab_size=V).items()
                                                if k not in ("model_type", "architectures")}),
                    ATTN + ["f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj", "kv_a_proj_with_mqa",
                            "kv_b_proj"] + MLP, "absorbed"),
    # Ling 3.0: KDA with full-rank forget and output gates (f_proj, g_proj) + MLA with RoPE and a head gate (g_proj
    # too) + DeepSeek-style MoE; the released layout renames the mixers (attention, dense)
    "bailing_hybrid": (lambda: BailingHybridConfig(**{k: v for k, v in ling_tiny_config(vocab_size=V).items()
                                                      if k not in ("model_type", "architectures")}),
                       ATTN + ["f_proj", "b_proj", "g_proj", "kv_a_proj_with_mqa", "kv_b_proj"] + MLP, "absorbed"),
}
REMAPPED = {"qwen3_next", "deepseek_v3", "deepseek_v3_q", "glm4_moe", "glm_moe_dsa", "qwen3_moe", "mixtral",
            "glm4_moe_lite", "minimax_m2", "olmoe"}
NAMES = list(FAMILIES)

# (random float64 HF model, its checkpoint directory) of a family, built once per process
pair = cached_pairs(lambda name: tiny_moe_hf(FAMILIES[name][0](), seed=NAMES.index(name) + 70,
                                             attn="eager" if name in ("gpt_oss", "gemma3") else "sdpa"))


def random_b(modules, seed=0, std=0.1):
    """Non-zero ``B`` (PEFT's ``B = 0`` leaves the model unchanged: a comparison would be vacuous); ``modules``:
    ``{name: (lora_B weight)}``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, b in sorted(modules.items()):
            b.copy_(torch.randn(b.shape, generator=g, dtype=torch.float64) * std)


def load(name, **kw):
    model = longstraw.load_model(pair(name)[1], dtype="float64", **kw)
    if FAMILIES[name][2] is not None:
        set_mla_mode(model, FAMILIES[name][2], decompress_chunk=4)
    return model


def ours(name, *, rank=4, alpha=8, targets=None, **kw):
    model = load(name)
    longstraw.add_lora(model, rank, alpha, FAMILIES[name][1] if targets is None else targets, seed=1, **kw)
    random_b({n: m.lora_B.weight for n, m in adapted_modules(model).items()})
    return model


@contextlib.contextmanager
def no_moe_remap():
    """PEFT's LoRA on the ``nn.Linear`` modules its targets name, without the transformers-v5 MoE re-targeting."""
    orig = twc.convert_peft_config_for_transformers
    twc.convert_peft_config_for_transformers = lambda *a, **k: None
    try:
        yield
    finally:
        twc.convert_peft_config_for_transformers = orig


def _peft_ctx(name, stock):
    return contextlib.nullcontext() if stock or name not in REMAPPED else no_moe_remap()


def peft_load(name, adapter_dir, stock=False):
    """A fresh copy of the family's HF model with the adapter directory loaded by PEFT."""
    with _peft_ctx(name, stock):
        return peft.PeftModel.from_pretrained(copy.deepcopy(pair(name)[0]), str(adapter_dir), is_trainable=True).eval()


def peft_new(name, stock=False, **cfg):
    """PEFT's own adapters (``get_peft_model``) on a fresh copy of the family's HF model, ``B`` random."""
    with _peft_ctx(name, stock):
        pm = peft.get_peft_model(copy.deepcopy(pair(name)[0]), peft.LoraConfig(**cfg)).eval()
    random_b({n: p for n, p in pm.named_parameters() if ".lora_B." in n}, seed=5)
    return pm


def peft_adapted(pm) -> set:
    return {n.removeprefix("base_model.model.") for n, m in pm.named_modules()
            if isinstance(m, peft.tuners.lora.LoraLayer)}


def tokens(seed=0, t=17):
    return torch.randint(0, V, (1, t), generator=torch.Generator().manual_seed(seed))


def hf_logits(hf, x):
    with torch.no_grad(), true_float64():
        return hf(x).logits


def our_logits(model, x):
    with torch.no_grad():
        return model(x)


def max_err(a, b):
    return (a - b).abs().max().item()


def compare_grads(got: dict, want: dict, rel=1e-8) -> float:
    assert set(got) == set(want), sorted(set(got) ^ set(want))
    worst = 0.0
    for k, w in want.items():
        scale = w.abs().max().item()
        r = (got[k] - w).abs().max().item() / (scale if scale > 0 else 1.0)
        worst = max(worst, r)
        assert r <= rel, f"{k}: relative error {r:.3e} > {rel:.0e} (max |grad| {scale:.3e})"
    return worst


def peft_grads(pm) -> dict:
    """The PEFT model's gradients under the keys PEFT saves (``get_peft_model_state_dict``: ``.default`` and the
    ``modules_to_save`` wrapper removed)."""
    grads = {n: p.grad for n, p in pm.named_parameters(remove_duplicate=False) if p.grad is not None}
    return get_peft_model_state_dict(pm, state_dict=grads)


# --------------------------------------------------------------------------------------------------- logits
@pytest.mark.parametrize("name", NAMES)
def test_logits_equal_peft(name, tmp_path):
    """save_adapter -> PeftModel.from_pretrained: PEFT adapts the same modules and computes the same logits."""
    model = ours(name)
    assert {n.rsplit(".", 1)[-1] for n in adapted_modules(model)} == set(FAMILIES[name][1])
    longstraw.save_adapter(model, tmp_path / "a")
    pm = peft_load(name, tmp_path / "a")
    assert peft_adapted(pm) == set(adapted_modules(model))
    x = tokens()
    want = hf_logits(pm, x)
    assert max_err(our_logits(model, x), want) <= 1e-10
    assert max_err(hf_logits(pair(name)[0], x), want) > 0.1  # the adapters matter


@pytest.mark.filterwarnings("ignore:Found missing adapter keys", "ignore:The following (rank|alpha)_pattern keys")
@pytest.mark.parametrize("name", sorted(REMAPPED - {"mixtral", "minimax_m2", "olmoe"}))  # no linear MLP layers
def test_stock_peft_on_remapped_moe_families(name, tmp_path):
    """Stock PEFT re-targets the MLP names to the routed experts' fused parameters (``experts``, a ParamWrapper
    around ``experts.base_layer``) and leaves the dense MLP layers and shared experts alone; every other target
    (attention, MLA, DeltaNet, DSA indexer, Qwen's shared_expert_gate) is adapted as here, with equal logits. An
    adapter stock PEFT saves with MLP targets (target_parameters on the routed experts) loads here."""
    model = ours(name)
    with pytest.warns(UserWarning, match=r"save_adapter: \d+ adapters on MLP projections .*stock PEFT on "
                                         r"transformers 5 re-targets"):
        longstraw.save_adapter(model, tmp_path / "all")
    pm = peft_load(name, tmp_path / "all", stock=True)
    mine = set(adapted_modules(model))
    mlp = {n for n in mine if n.rsplit(".", 1)[-1] in MLP}
    experts = {n.removesuffix(".base_layer") for n in peft_adapted(pm) - mine}
    assert mlp and peft_adapted(pm) & mine == mine - mlp
    assert experts and all(n.endswith("mlp.experts") for n in experts)
    rest = [t for t in FAMILIES[name][1] if t not in MLP]
    model = ours(name, targets=rest)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing stock PEFT would drop: no warning
        longstraw.save_adapter(model, tmp_path / "rest")
    pm = peft_load(name, tmp_path / "rest", stock=True)
    assert peft_adapted(pm) == set(adapted_modules(model))
    x = tokens(1)
    assert max_err(our_logits(model, x), hf_logits(pm, x)) <= 1e-10
    # what stock PEFT saves with the MLP names (target_parameters on the routed experts) loads here with its logits
    # (test_lora_experts.py tests those adapters in full)
    pm = peft_new(name, stock=True, r=2, lora_alpha=4, target_modules=FAMILIES[name][1])
    pm.save_pretrained(tmp_path / "p")
    assert sorted(json.loads((tmp_path / "p" / "adapter_config.json").read_text())["target_parameters"]) == [
        "down_proj", "gate_up_proj"]
    assert max_err(our_logits(longstraw.load_adapter(load(name), tmp_path / "p"), x), hf_logits(pm, x)) <= 1e-10


# -------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name", NAMES)
def test_grads_equal_peft_reference(name, prompt_grad, tmp_path):
    """grpo_backward's adapter gradients (lora_grads, PEFT's keys) equal the naive full-graph GRPO loss's on the
    PEFT model; the frozen base gets no gradient and the optimiser holds only the adapters."""
    model = ours(name)
    longstraw.save_adapter(model, tmp_path / "a")
    pm = peft_load(name, tmp_path / "a")
    prompt, responses, adv = random_group(3, 14, [4, 1, 6], V)
    # P - 1 = 13 prompt positions in chunks of 5; two branches replayed together; exact: layers recomputed
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, kl_coef=0.05, entropy_coef=0.01, prefill_chunk=5,
                               branch_batch=2, checkpoint_layers=prompt_grad == "exact")
    run_against_reference(model, pm, prompt, responses, adv, cfg, hf_patch=router64)
    got = longstraw.lora_grads(model)
    compare_grads(got, peft_grads(pm))
    # every adapter has a gradient, but the DSA indexer's (its scores only select keys: no gradient path)
    lora = set(adapted_modules(model))
    indexer = {n for n in lora if ".indexer." in n}
    assert {k.removeprefix("base_model.model.").rsplit(".lora_", 1)[0] for k in got} == lora - indexer
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
    opt = make_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, eps=1e-8)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if ".lora_" in n}


# ------------------------------------------------------------------------------------ PEFT's own adapters
@pytest.mark.parametrize("name", NAMES)
def test_peft_saved_adapter_loads_and_merges(name, tmp_path):
    """An adapter PEFT saved itself loads (load_adapter, load_model(adapter=)) with PEFT's logits; merged by
    save_model(merge_lora=True), the checkpoint gives them too, in LongStraw and in transformers."""
    pm = peft_new(name, r=3, lora_alpha=5, target_modules=FAMILIES[name][1])
    pm.save_pretrained(tmp_path / "a")
    x = tokens(2)
    want = hf_logits(pm, x)
    model = longstraw.load_adapter(load(name), tmp_path / "a")
    assert set(adapted_modules(model)) == peft_adapted(pm)
    assert max_err(our_logits(model, x), want) <= 1e-10
    loaded = load(name, adapter=tmp_path / "a")
    assert max_err(our_logits(loaded, x), want) <= 1e-10
    longstraw.save_model(model, tmp_path / "merged", merge_lora=True)
    merged = longstraw.load_model(tmp_path / "merged", dtype="float64")
    assert not adapted_modules(merged)
    if FAMILIES[name][2] is not None:
        set_mla_mode(merged, FAMILIES[name][2], decompress_chunk=4)
    assert max_err(our_logits(merged, x), want) <= 1e-10
    if name in ("llama", "glm_moe_dsa", "kimi_linear", "bailing_hybrid"):  # the last two: merged through the
        # released layout's renames
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float64,
                                                  experts_implementation="eager")
        assert max_err(hf_logits(hf.eval(), x), want) <= 1e-10


def test_released_layout_adapter_loads_as_in_stock_peft(tmp_path):
    """Kimi-Linear: an adapter keyed in the released checkpoint layout (what PEFT on the checkpoint's own modelling
    code writes: the forget gate's projections directly under self_attn, the MoE block as block_sparse_moe) loads
    here as stock PEFT loads it (transformers' renames apply to the adapter keys), with the same logits."""
    name = "kimi_linear"
    model = ours(name)
    longstraw.save_adapter(model, tmp_path / "a")
    released = {"self_attn.forget_gate.": "self_attn.", ".mlp.shared_experts.": ".block_sparse_moe.shared_experts."}

    def to_released(sd):
        for k in list(sd):
            new = k
            for a, b in released.items():
                new = new.replace(a, b)
            sd[new] = sd.pop(k)

    _edit_tensors(tmp_path / "a", to_released)
    keys = set(load_file(tmp_path / "a" / "adapter_model.safetensors"))
    assert any(".self_attn.f_a_proj.lora_A." in k for k in keys) and not any(".forget_gate." in k for k in keys)
    assert any(".block_sparse_moe.shared_experts." in k for k in keys)
    pm = peft_load(name, tmp_path / "a")
    assert peft_adapted(pm) == set(adapted_modules(model))
    x = tokens(9)
    want = hf_logits(pm, x)
    assert max_err(our_logits(model, x), want) <= 1e-10
    again = longstraw.load_adapter(load(name), tmp_path / "a")
    assert max_err(our_logits(again, x), want) <= 1e-10
    mine = dict(model.named_parameters())
    assert all(torch.equal(mine[n], p) for n, p in again.named_parameters() if ".lora_" in n)


def test_load_model_with_lora_equals_add_lora(tmp_path):
    """load_model(lora=..., lora_seed=s) adds the adapters add_lora(seed=s) adds: PEFT's initialisation (A drawn in
    name order, B = 0: the logits are the base model's), base frozen."""
    name = "glm_moe_dsa"
    spec = dict(rank=3, alpha=6, target_modules=["q_b_proj", "kv_b_proj", "down_proj", "wk"])
    model = load(name, lora=spec, lora_seed=4)
    ref = load(name)
    longstraw.add_lora(ref, 3, 6, spec["target_modules"], seed=4)
    mine, theirs = adapted_modules(model), adapted_modules(ref)
    assert set(mine) == set(theirs) and len(mine) == 3 + 3 + 3 + 2  # wk: the indexers of the two full DSA layers
    for n, m in mine.items():
        assert torch.equal(m.lora_A.weight, theirs[n].lora_A.weight) and not m.lora_B.weight.any()
        assert m.lora_A.weight.abs().max() > 0 and m.scaling == 2.0
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n in dict(model.named_parameters()) if ".lora_" in n}
    x = tokens(8)
    assert max_err(our_logits(model, x), hf_logits(pair(name)[0], x)) <= 1e-10
    peft_names = load(name, lora=dict(r=3, lora_alpha=6, target_modules=spec["target_modules"]), lora_seed=4)
    assert all(torch.equal(m.lora_A.weight, mine[n].lora_A.weight) for n, m in adapted_modules(peft_names).items())
    longstraw.save_adapter(model, tmp_path / "a")
    with pytest.raises(ValueError, match="give lora= .* or adapter= .*, not both"):
        load(name, lora=spec, adapter=tmp_path / "a")


# ---------------------------------------------------------------------------------- LoraConfig features
def test_rslora_and_rank_alpha_patterns_equal_peft(tmp_path):
    name = "qwen3_5"
    kw = dict(use_rslora=True, rank_pattern={"q_proj": 2, r"layers\.2\.mlp\.down_proj": 6, "in_proj_qkv": 5},
              alpha_pattern={"v_proj": 3.0, r"linear_attn\.out_proj": 11})
    model = ours(name, **kw)
    ranks = {n: m.r for n, m in adapted_modules(model).items()}
    assert ranks["model.layers.1.self_attn.q_proj"] == 2 and ranks["model.layers.1.self_attn.k_proj"] == 4
    assert ranks["model.layers.2.mlp.down_proj"] == 6 and ranks["model.layers.0.mlp.down_proj"] == 4
    assert ranks["model.layers.0.linear_attn.in_proj_qkv"] == 5
    longstraw.save_adapter(model, tmp_path / "a")
    pm = peft_load(name, tmp_path / "a")
    theirs = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules()
              if isinstance(m, peft.tuners.lora.LoraLayer)}
    for n, m in adapted_modules(model).items():
        assert theirs[n].r["default"] == m.r and theirs[n].scaling["default"] == m.scaling, n
    x = tokens(3)
    assert max_err(our_logits(model, x), hf_logits(pm, x)) <= 1e-10
    # and PEFT's own config of the same loads here with PEFT's logits
    pm2 = peft_new(name, r=4, lora_alpha=8, target_modules=FAMILIES[name][1], **kw)
    pm2.save_pretrained(tmp_path / "b")
    model2 = longstraw.load_adapter(load(name), tmp_path / "b")
    assert max_err(our_logits(model2, x), hf_logits(pm2, x)) <= 1e-10


@pytest.mark.parametrize("name,target", [
    ("llama", r".*\.(self_attn\.(q|v)_proj|layers\.1\.mlp\.down_proj)"),
    ("qwen3_5", r".*layers\.[02]\..*(in_proj_(qkv|a)|o_proj|gate_proj)"),
])
def test_regex_targets_equal_peft(name, target, tmp_path):
    model = ours(name, targets=target)
    pm = peft_new(name, r=4, lora_alpha=8, target_modules=target)
    assert set(adapted_modules(model)) == peft_adapted(pm)
    longstraw.save_adapter(model, tmp_path / "a")
    pm = peft_load(name, tmp_path / "a")
    assert set(adapted_modules(model)) == peft_adapted(pm)
    x = tokens(4)
    assert max_err(our_logits(model, x), hf_logits(pm, x)) <= 1e-10


def test_retargeted_model_types_are_those_stock_peft_retargets():
    """``PEFT_MOE_RETARGETED`` (save_adapter's warning) is the set of supported model types whose transformers
    conversion pattern PEFT's MoE target mapping covers (PEFT's own tables, read from the installed version)."""
    from longstraw.checkpoint.adapter import PEFT_MOE_RETARGETED

    want = {mt for mt in longstraw.supported_model_types()
            if twc._MODEL_TO_CONVERSION_PATTERN.get(mt) in twc._MOE_TARGET_MODULE_MAPPING}
    assert want == set(PEFT_MOE_RETARGETED)


@pytest.mark.parametrize("name", NAMES)
def test_all_linear_adapts_what_peft_adapts(name):
    """"all-linear": every nn.Linear but the LM head, the same modules as PEFT's (without its MoE re-targeting for
    the REMAPPED families); transformers' linear layers are ours, routers and fused routed experts are not linear
    layers in either."""
    model = load(name)
    longstraw.add_lora(model, 2, 4, "all-linear")
    pm = peft_new(name, r=2, lora_alpha=4, target_modules="all-linear")
    assert set(adapted_modules(model)) == peft_adapted(pm)
    hf_linear = {n for n, m in pair(name)[0].named_modules() if type(m) is torch.nn.Linear and n != "lm_head"}
    assert set(adapted_modules(model)) == hf_linear


def test_all_linear_logits_equal_peft(tmp_path):
    name = "qwen3_5_moe"  # attention, DeltaNet, MoE with a gated shared expert
    model = ours(name, targets="all-linear")
    longstraw.save_adapter(model, tmp_path / "a")
    pm = peft_load(name, tmp_path / "a")
    assert peft_adapted(pm) == set(adapted_modules(model))
    x = tokens(5)
    assert max_err(our_logits(model, x), hf_logits(pm, x)) <= 1e-10


def test_modules_to_save_embedding(tmp_path):
    """modules_to_save=["embed_tokens"]: the embedding is trained whole, saved under PEFT's key, loaded by PEFT, and
    its gradient (lora_grads, PEFT's key) equals the reference's."""
    name = "llama"
    model = ours(name, modules_to_save=["embed_tokens"])
    emb = model.model.embed_tokens.weight
    assert emb.requires_grad
    with torch.no_grad():
        emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(9), dtype=emb.dtype) * 0.3)
    longstraw.save_adapter(model, tmp_path / "a")
    key = "base_model.model.model.embed_tokens.weight"
    assert key in load_file(tmp_path / "a" / "adapter_model.safetensors")
    pm = peft_load(name, tmp_path / "a")
    x = tokens(6)
    assert max_err(our_logits(model, x), hf_logits(pm, x)) <= 1e-10
    prompt, responses, adv = random_group(4, 12, [3, 5], V)
    cfg = longstraw.GRPOConfig(kl_coef=0.05, prefill_chunk=5)
    run_against_reference(model, pm, prompt, responses, adv, cfg)
    got = longstraw.lora_grads(model)
    assert key in got
    compare_grads(got, peft_grads(pm))
    opt = make_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.0, eps=1e-8)
    assert sum(p.numel() for g in opt.param_groups for p in g["params"]) == sum(
        p.numel() for n, p in model.named_parameters() if ".lora_" in n or n == "model.embed_tokens.weight")
    # back into a fresh model: the embedding comes from the adapter file
    again = longstraw.load_adapter(load(name), tmp_path / "a")
    assert torch.equal(again.model.embed_tokens.weight, emb)


# ------------------------------------------------------------------------------------------ bad input
def _no_adapters_and_nothing_trainable_changed(model):
    assert not adapted_modules(model) and getattr(model, "lora_settings", None) is None
    assert all(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("args,msg", [
    (dict(target_modules=["q_proj", "qkv_proj"]),
     r"LoRA target 'qkv_proj' matches no module of this model; its linear layers are named down_proj, gate_proj, "
     r"k_proj, o_proj, q_proj, up_proj, v_proj \(or give 'all-linear'\)"),
    (dict(target_modules=r".*\.qkv"), re.escape(r"target_modules='.*\\.qkv' matches no module of this model; its "
                                                r"linear layers are named down_proj")),
    (dict(target_modules=["lm_head"]), r"LoRA target 'lm_head': adapters on the lm_head are not supported; train it "
                                       r"whole with modules_to_save=\['lm_head'\]"),
    (dict(target_modules=["input_layernorm"]), r"names 'model.layers.0.input_layernorm', a RMSNorm, not a linear "
                                               r"layer"),
    (dict(rank=0), r"LoRA rank=0 must be an integer >= 1"),
    (dict(rank=2.0), r"LoRA rank=2.0 must be an integer >= 1"),
    (dict(alpha=0), r"LoRA alpha=0 must be a finite number > 0"),
    (dict(alpha=-1.0), r"LoRA alpha=-1.0 must be a finite number > 0"),
    (dict(alpha=float("nan")), r"LoRA alpha=nan must be a finite number > 0"),
    (dict(alpha_pattern={"q_proj": 0}), r"LoRA alpha_pattern\['q_proj'\]=0 must be a finite number > 0"),
    (dict(rank_pattern={"q_(proj": 2}), r"LoRA rank_pattern key 'q_\(proj' is not a regular expression"),
    (dict(modules_to_save=[""]), r"LoRA modules_to_save=\[''\] must be module names"),
    (dict(dropout=1.0), r"LoRA dropout=1.0 must be in \[0, 1\)"),
    (dict(dropout=-0.1), r"LoRA dropout=-0.1 must be in \[0, 1\)"),
    (dict(target_modules=[]), r"must be a non-empty list of module names"),
    (dict(rank_pattern={"q_proj": 0}), r"LoRA rank_pattern\['q_proj'\]=0 must be an integer >= 1"),
    (dict(modules_to_save=["embeddings"]), r"modules_to_save entry 'embeddings' matches no module"),
])
def test_add_lora_bad_input(args, msg):
    model = load("llama")
    kw = dict(rank=2, alpha=4, target_modules=["q_proj"])
    kw.update(args)
    with pytest.raises(ValueError, match=msg):
        longstraw.add_lora(model, **kw)
    _no_adapters_and_nothing_trainable_changed(model)


def test_routed_experts_and_twice_refused():
    model = load("deepseek_v3")
    with pytest.raises(ValueError, match=r"LoRA target 'experts' names routed experts \(model.layers.1.mlp.experts\), "
                                         r"fused 3-D parameters, not linear layers: adapt them with target_parameters"):
        longstraw.add_lora(model, 2, 4, ["q_a_proj", "experts"])
    _no_adapters_and_nothing_trainable_changed(model)
    longstraw.add_lora(model, 2, 4, ["q_a_proj"])
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        longstraw.add_lora(model, 2, 4, ["kv_b_proj"])
    assert {n.rsplit(".", 1)[-1] for n in adapted_modules(model)} == {"q_a_proj"}


def _edit_config(d, **changes):
    f = d / "adapter_config.json"
    cfg = json.loads(f.read_text())
    cfg.update(changes)
    f.write_text(json.dumps(cfg))


def _edit_tensors(d, fn):
    f = d / "adapter_model.safetensors"
    sd = load_file(f)
    fn(sd)
    save_file(sd, f)


Q0A = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.mark.parametrize("edit,msg", [
    (lambda d: _edit_config(d, peft_type="IA3"), r"peft_type='IA3'; only LoRA adapters \(peft_type 'LORA'\) load"),
    (lambda d: _edit_config(d, use_dora=True), r"use_dora=True is not supported \(allowed: False\)"),
    (lambda d: _edit_config(d, r=0), r"LoRA rank=0 must be an integer >= 1"),
    (lambda d: _edit_config(d, init_lora_weights="pissa_niter_4"), r"init_lora_weights='pissa_niter_4' is not "
                                                                   r"supported: that initialisation rewrites the base"),
    (lambda d: _edit_config(d, init_lora_weights="olora"), r"init_lora_weights='olora' is not supported"),
    (lambda d: _edit_config(d, exclude_modules=["v_proj"]), r"exclude_modules=\['v_proj'\] is not supported"),
    (lambda d: _edit_config(d, layer_replication=[[0, 1]]), r"layer_replication=\[\[0, 1\]\] is not supported"),
    (lambda d: _edit_config(d, task_type="SEQ_CLS"), r"task_type='SEQ_CLS' is not supported"),
    (lambda d: _edit_config(d, use_bdlora={"target_modules_bd_a": ["q_proj"]}), r"use_bdlora=.* is not supported"),
    (lambda d: _edit_config(d, kasa_config={"r": 2}), r"kasa_config=\{'r': 2\} is not supported \(allowed: None\)"),
    (lambda d: _edit_config(d, monteclora_config={"n": 1}), r"monteclora_config=\{'n': 1\} is not supported"),
    (lambda d: (d / "adapter_config.json").unlink(), r"is not a PEFT adapter directory: it has no adapter_config.json"),
    (lambda d: (d / "adapter_model.safetensors").unlink(), r"has no adapter_model.safetensors"),
    (lambda d: _edit_tensors(d, lambda sd: sd.pop(Q0A)), rf"adapter tensors missing: {Q0A}"),
    (lambda d: _edit_tensors(d, lambda sd: sd.update({Q0A.replace("q_proj", "k_proj"): sd[Q0A].clone()})),
     r"tensors the model's adapters do not have: base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight"),
    (lambda d: _edit_tensors(d, lambda sd: sd.update({Q0A: sd[Q0A][:, :-1].contiguous()})),
     rf"{Q0A} has shape \(4, 31\), the model's adapter \(4, 32\)"),
    (lambda d: (d / "adapter_model.safetensors").write_bytes(b"\x00" * 20), r"cannot read the adapter"),
])
def test_load_adapter_bad_files(edit, msg, tmp_path):
    model = ours("llama", targets=["q_proj", "v_proj"])
    longstraw.save_adapter(model, tmp_path / "a")
    edit(tmp_path / "a")
    fresh = load("llama")
    with pytest.raises(ValueError, match=msg):
        longstraw.load_adapter(fresh, tmp_path / "a")
    with pytest.raises(ValueError, match=msg):
        load("llama", adapter=tmp_path / "a")
    _no_adapters_and_nothing_trainable_changed(fresh)
    # into a model with the same adapters: refused before any value is written
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    with pytest.raises(ValueError, match=msg):
        longstraw.load_adapter(model, tmp_path / "a")
    assert all(torch.equal(before[n], p) for n, p in model.named_parameters())


def test_adapter_of_a_multimodal_checkpoint_is_keyed_as_peft_keys_it_there(tmp_path):
    """A model loaded from a multimodal Qwen3.5 checkpoint: save_adapter writes (and lora_grads keys) the adapters
    under model.language_model., so PEFT on that checkpoint's transformers model loads them (same logits), and
    PEFT's own adapter there loads back here."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(__file__)), "models"))
    import test_qwen_hybrid as tq

    hf = tq._multimodal("qwen3_5_moe")
    hf.save_pretrained(tmp_path / "mm")
    model = longstraw.load_model(tmp_path / "mm", dtype="float64")
    longstraw.add_lora(model, 2, 4, ["q_proj", "in_proj_qkv", "out_proj"], seed=1)
    random_b({n: m.lora_B.weight for n, m in adapted_modules(model).items()})
    longstraw.save_adapter(model, tmp_path / "a")
    keys = set(load_file(tmp_path / "a" / "adapter_model.safetensors"))
    assert keys and all(k.startswith("base_model.model.model.language_model.layers.") for k in keys)
    x = torch.randint(0, tq.V - 4, (1, 17), generator=torch.Generator().manual_seed(0))
    pm = peft.PeftModel.from_pretrained(copy.deepcopy(hf), str(tmp_path / "a")).eval()
    assert max_err(our_logits(model, x), hf_logits(pm, x)) <= 1e-10
    assert max_err(our_logits(model, x), hf_logits(hf, x)) > 1e-3  # the adapters do something
    model(x).sum().backward()
    assert set(longstraw.lora_grads(model)) == keys
    theirs = peft.get_peft_model(copy.deepcopy(hf), peft.LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj"]))
    random_b({n: p for n, p in theirs.named_parameters() if ".lora_B." in n}, seed=5)
    theirs.save_pretrained(tmp_path / "p")
    again = longstraw.load_adapter(longstraw.load_model(tmp_path / "mm", dtype="float64"), tmp_path / "p")
    assert max_err(our_logits(again, x), hf_logits(theirs.eval(), x)) <= 1e-10


def test_load_adapter_path_must_be_a_path():
    with pytest.raises(ValueError, match=r"load_adapter: path=None must be a PEFT adapter directory"):
        longstraw.load_adapter(load("llama"), None)


def test_modules_to_save_matches_as_peft_matches():
    """PEFT keeps every module whose name ends with a modules_to_save entry ("norm": every norm, "head": the LM
    head), and takes one name as a string."""
    from longstraw.models.lora import kept_modules

    model = ours("llama", targets=["q_proj"], modules_to_save="norm")
    pm = peft_new("llama", r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["norm", "head"])
    theirs = {n.removeprefix("base_model.model.") for n, m in pm.named_modules()
              if type(m).__name__ == "ModulesToSaveWrapper"}
    mine = set(kept_modules(model, ["norm", "head"]))
    assert mine == theirs and {"model.norm", "model.layers.0.input_layernorm", "lm_head"} <= mine
    assert model.model.layers[1].post_attention_layernorm.weight.requires_grad


def test_load_adapter_into_other_adapters_refused(tmp_path):
    model = ours("llama", targets=["q_proj"])
    longstraw.save_adapter(model, tmp_path / "a")
    other = ours("llama", targets=["v_proj"])
    with pytest.raises(ValueError, match=r"the model's adapters \(r=4, alpha=8, target_modules=\('v_proj',\)\) "
                                         r"differ from"):
        longstraw.load_adapter(other, tmp_path / "a")


def test_exact_mode_refuses_active_dropout(tmp_path):
    model = ours("llama", dropout=0.1)
    prompt, responses, adv = random_group(1, 9, [3, 2], V)
    model.train()
    with pytest.raises(ValueError, match=r"prompt_grad='exact' with LoRA dropout active \(model.layers.0.self_attn."
                                         r"q_proj, \.\.\.\)"):
        longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=4))
    assert all(p.grad is None for p in model.parameters())
    st = longstraw.grpo_backward(model, prompt, responses, adv,
                                 longstraw.GRPOConfig(prompt_grad="detached", prefill_chunk=4))
    assert all(torch.isfinite(lp).all() for lp in st.logprobs)
    model.eval()  # dropout inactive: exact is allowed
    longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=4))
    # the absorbed MLA form reads kv_b_proj's weight: no single weight with dropout active
    mla = ours("deepseek_v3", targets=["kv_b_proj"], dropout=0.1)
    mla.train()
    with pytest.raises(ValueError, match=r"a LoRA adapter with dropout=0.1 has no single weight to absorb"):
        longstraw.grpo_backward(mla, prompt, responses, adv,
                                longstraw.GRPOConfig(prompt_grad="detached", prefill_chunk=4))


def test_no_adapters(tmp_path):
    model = load("llama")
    with pytest.raises(ValueError, match=r"lora_grads: the model has no LoRA adapters \(longstraw.add_lora adds "
                                         r"them\)"):
        longstraw.lora_grads(model)
    with pytest.raises(ValueError, match=r"save_adapter: the model has no LoRA adapters"):
        longstraw.save_adapter(model, tmp_path / "a")
    assert not (tmp_path / "a").exists()
    with pytest.raises(ValueError, match=r"save_model\(merge_lora=True\): the model has no LoRA adapters to merge"):
        longstraw.save_model(model, tmp_path / "m", merge_lora=True)
    with pytest.raises(ValueError, match=r"expected a LongStraw model"):
        longstraw.add_lora(pair("llama")[0], 2, 4, ["q_proj"])
    assert not any(isinstance(m, LoRALinear) for m in pair("llama")[0].modules())


@pytest.mark.parametrize("keep", ["embed_tokens", "lm_head"])
def test_modules_to_save_tied_embedding(keep, tmp_path):
    """A tied model (Qwen3 here): the trained embedding is the LM head too (either named). save_adapter writes PEFT's
    form of that (ensure_weight_tying, the LM head's copy of the tensor), which PEFT loads with the same logits;
    PEFT's own save of it loads here."""
    name = "qwen3"
    model = ours(name, targets=["q_proj", "down_proj"], modules_to_save=[keep])
    emb = model.model.embed_tokens.weight
    assert model.lm_head.weight is emb and emb.requires_grad
    with torch.no_grad():
        emb.add_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(9), dtype=emb.dtype) * 0.3)
    longstraw.save_adapter(model, tmp_path / "a")
    assert json.loads((tmp_path / "a" / "adapter_config.json").read_text())["ensure_weight_tying"] is True
    pm = peft_load(name, tmp_path / "a")
    x = tokens(7)
    want = hf_logits(pm, x)
    assert max_err(our_logits(model, x), want) <= 1e-10
    pm.save_pretrained(tmp_path / "b")
    again = longstraw.load_adapter(load(name), tmp_path / "b")
    assert max_err(our_logits(again, x), want) <= 1e-10
    prompt, responses, adv = random_group(4, 12, [3, 5], V)
    run_against_reference(model, pm, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=5))
    # PEFT's default (no ensure_weight_tying) unties them: this model cannot hold that adapter
    _edit_config(tmp_path / "b", ensure_weight_tying=False)
    _edit_tensors(tmp_path / "b", lambda sd: sd.pop("base_model.model.lm_head.weight"))
    with pytest.raises(ValueError, match=r"trains model.embed_tokens.weight whole without ensure_weight_tying, so "
                                         r"PEFT unties it from lm_head.weight"):
        longstraw.load_adapter(load(name), tmp_path / "b")
    want = peft_grads(pm)
    head = want.pop("base_model.model.lm_head.weight")  # PEFT's tied copy: the same gradient, once in lora_grads
    assert head is want["base_model.model.model.embed_tokens.weight"]
    compare_grads(longstraw.lora_grads(model), want)
