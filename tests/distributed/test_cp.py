"""Context parallelism (and FSDP2) on 2 and 4 gloo ranks against the single-process run, float64.

Jobs, each one launch of plain processes with torchrun's environment (cp_launcher.py), running many
scenarios per launch (cp_scenarios.py) to keep start-up cost low:

* 2 ranks, cp=2: every scenario (dense Llama and Qwen3 with tied embeddings, the Qwen3.5 DeltaNet hybrid; exact
  and detached; FSDP2 applied explicitly; checkpointed layers and batched branches; score; generate);
* 4 ranks, cp=4: the same on an oversubscribed machine (one thread per rank);
* 4 ranks, cp=2, ``init_distributed(fsdp=True)`` (FSDP2 applied by load_model, the user path): two data-parallel
  replicas of a 2-rank CP group (dense exact, hybrid exact and detached), their gradients summed;
* 2 and 4 ranks, MLA with each form forced under CP (the decompressed CP twin and the absorbed path) against one
  process forced alike: DeepSeek-V3 (exact, detached, FSDP2, score, generate), GLM-5 and DeepSeek-V3.2 (dense DSA
  calls);
* 2 and 4 ranks, the MoE families: DeepSeek-V3 (MLA latents, the form "auto" picks),
  GLM-5 (MLA + DSA sparse indexer with a shared indexer layer, its top-k over the sharded prompt), DeepSeek-V3.2
  (2 ranks), GLM-4.5 (GQA + MoE), Qwen3-Next (DeltaNet + MoE) and Kimi-Linear (KDA + NoPE MLA + MoE): exact and
  detached, FSDP2 on 2 ranks (MLA; DSA with checkpointed layers and batched branches), generate, score, per-rank
  state bytes;
* 2 and 4 ranks, sliding windows the groups reach past (the replicated tails and halo exchange of
  ``distributed/cp_window.py``): Gemma 3 with a window of 5 and GPT-OSS (attention sinks, windows of 4): exact and
  detached, checkpointed layers, offloads, FSDP2, score, generate, the tails each rank keeps.

Every scenario of every job is one test (``test_scenario[job-scenario]``), so a failure names it. A job is launched
once, by the first of its tests that runs, and its tests share the result: they carry the job's ``xdist_group``,
and ``make test`` runs ``pytest -n 2 --dist loadgroup``, which keeps a group on one worker (a job never launches
twice). They launch subprocesses, so they carry the ``slow`` mark (``make test-slow``; CI runs both suites).
"""

import pytest
import torch
from cp_launcher import launch
from cp_scenarios import SCENARIOS, V
from hf_reference import save_tiny, tiny_hf
from transformers import (BailingHybridConfig, DeepseekV3Config, DeepseekV32Config, Gemma3TextConfig, Glm4MoeConfig,
                          Glm4MoeLiteConfig, GlmMoeDsaConfig, GptOssConfig, KimiLinearConfig, LlamaConfig,
                          MiniMaxM2Config, MixtralConfig, OlmoeConfig, Qwen3Config, Qwen3MoeConfig, Qwen3NextConfig)
from transformers.models.qwen3_5 import Qwen3_5TextConfig
from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

import longstraw
from longstraw import distributed
from longstraw.models.bailing import tiny_config as ling_tiny_config
from longstraw.models.kimi import tiny_config as kimi_tiny_config

pytestmark = pytest.mark.timeout(600)

ALL = ["exact", "detached", "exact_fsdp", "detached_fsdp", "qwen3_exact_ckpt", "qwen3_exact_fsdp",
       "hybrid_exact", "hybrid_detached", "hybrid_exact_fsdp_ckpt", "hybrid_generate", "score", "generate",
       "generate_fsdp", "state_bytes", "bad_inputs", "op_blocks", "low_precision", "hybrid_exact_offload",
       "exact_state_offload", "hybrid_exact_state_offload", "hybrid_detached_state_offload", "kept_exact",
       "kept_split", "hybrid_kept_refused", "hybrid_exact_q_only", "hybrid_exact_kept", "hybrid_kept_split",
       "hybrid_exact_kept_q_only"]
FOUR = ["exact", "detached", "exact_fsdp", "qwen3_exact_ckpt", "hybrid_exact", "hybrid_detached",
        "hybrid_exact_fsdp_ckpt", "score", "generate", "state_bytes", "bad_inputs", "op_blocks",
        "exact_state_offload", "kept_exact", "kept_split", "hybrid_exact_q_only", "hybrid_exact_kept",
        "hybrid_kept_split"]
DP = ["exact", "hybrid_exact", "dp_sum", "hybrid_dp_sum_fsdp", "v3_exact", "v3_dp_sum_fsdp", "fp32_exact",
      "bf16_exact"]
MOE2 = ["v3_exact", "v3_detached", "v3_exact_fsdp", "v3_generate", "v3_state_bytes",
        "dsa_exact", "dsa_detached", "dsa_exact_fsdp_ckpt", "dsa_generate", "dsa_score", "dsa_state_bytes",
        "dsa_ring_exact", "dsa_ring_score", "dsa_ring_generate", "v32_exact", "glm4_moe_exact", "glm4_moe_detached",
        "next_exact", "next_detached", "q35moe_exact", "q35moe_detached", "dsa_exact_offload", "q3moe_exact",
        "q3moe_detached", "mixtral_exact", "mixtral_detached", "lite_exact", "lite_detached", "minimax_exact",
        "olmoe_detached", "gemma3_exact", "v3_exact_kept", "dsa_exact_kept", "next_exact_q_only", "kimi_exact",
        "kimi_detached", "kimi_generate", "kimi_state_bytes", "kimi_exact_kept", "ling_exact", "ling_detached",
        "ling_generate"]
MOE4 = ["v3_exact", "v3_detached", "v3_state_bytes", "dsa_exact", "dsa_detached", "dsa_generate",
        "dsa_state_bytes", "dsa_ring_exact", "dsa_ring_score", "glm4_moe_exact", "glm4_moe_detached", "next_exact",
        "next_detached", "kimi_exact", "kimi_detached", "ling_exact"]
# MLA under CP with each form forced (the decompressed CP twin and the absorbed path, so neither goes untested
# whatever "auto" picks), against one process forced alike: exact and detached (batched branches), FSDP2,
# checkpointed layers with batched branches, score, generate (decoding over the generated tokens' latents), the
# dense path of DSA layers (GLM-5, DeepSeek-V3.2)
MLA2 = ["v3_exact_decompressed", "v3_exact_absorbed", "v3_detached_decompressed", "v3_exact_fsdp_decompressed",
        "v3_exact_ckpt_decompressed", "v3_decompressed_score", "v3_absorbed_score", "v3_decompressed_generate",
        "dsa_exact_decompressed", "dsa_exact_absorbed", "dsa_decompressed_score", "v32_exact_decompressed",
        "dsa_exact_decompressed_offload"]
MLA4 = ["v3_exact_decompressed", "v3_exact_absorbed", "v3_detached_decompressed", "v3_decompressed_score",
        "dsa_exact_decompressed", "dsa_exact_absorbed"]
# FSDP2 over every rank of the job (init_distributed(fsdp=True)), cp = 1, 2, 4 on 2 and 4 ranks, one family of each
# kind (dense, hybrid, MLA), float64 and float32/bf16; data-parallel replicas with prompts of different lengths
FSDP_CP1_W2 = ["exact", "detached", "hybrid_exact", "v3_exact", "fp32_exact", "bf16_exact", "dp_sum_fsdp",
               "hybrid_dp_sum_q_only", "generate", "score", "master_weights", "registered_shards", "offload_dcp"]
FSDP_CP1_W4 = ["exact", "hybrid_exact", "v3_detached", "fp32_exact", "dp_sum_fsdp", "hybrid_dp_sum_fsdp",
               "v3_dp_sum_fsdp"]
# kept prompt-step graphs under FSDP: every rank on one prompt (cp = the world size)
FSDP_CP2_W2 = ["kept_exact", "kept_split", "exact", "hybrid_exact", "v3_exact", "hybrid_fp32_exact",
               "hybrid_exact_kept", "registered_shards", "kimi_exact", "kimi_exact_kept"]
FSDP_CP4_W4 = ["exact", "hybrid_exact", "v3_exact", "fp32_exact", "kept_exact", "hybrid_exact_kept"]
HSDP = ["exact", "dp_sum_fsdp", "hybrid_exact"]
# expert parallelism (init_distributed(cp, fsdp=True, ep=E)): the MoE gradient scenarios against one process, the
# routed-expert bytes and values per rank, save_model of the split experts, the one-line init errors
EP2 = ["v3_exact", "v3_detached", "next_exact", "next_detached", "ep_experts", "ep_save", "ep_init", "gpt_oss_exact",
       "gpt_oss_detached", "gpt_oss_ep_experts", "gpt_oss_ep_save", "kimi_exact"]
EP2_CP2 = ["v3_exact", "v3_detached", "next_exact", "next_detached", "glm4_moe_exact", "glm4_moe_detached",
           "q35moe_exact", "q35moe_detached", "dsa_exact", "dsa_detached", "v32_exact", "dsa_exact_ckpt",
           "q3moe_exact", "mixtral_detached", "minimax_exact", "gpt_oss_exact", "gpt_oss_detached", "kimi_exact",
           "kimi_detached", "ling_exact",
           # frozen models but for the top attention: a MoE layer has work to differentiate on one CP rank only
           "next_exact_q_only", "q35moe_exact_q_only", "v3_exact_kept_top_only", "next_exact_kept",
           "kimi_exact_q_only"]
EP4 = ["v3_exact", "v3_detached", "next_exact", "next_detached", "ep_experts", "ep_init", "gpt_oss_exact",
       "gpt_oss_ep_experts"]
EP2_CP2_W4 = ["v3_exact", "v3_detached", "next_exact", "v3_dp_sum_fsdp", "ep_experts", "ep_save", "ep_init",
              "gpt_oss_exact", "gpt_oss_ep_experts", "gpt_oss_ep_save", "minimax_exact", "mixtral_detached",
              "minimax_ep_experts", "minimax_ep_save", "q35moe_exact_q_only", "next_dp_sum_q_only"]
# HSDP (2 replica groups of 2) with EP groups of 2 and ep_shard=False: the dense part sharded inside a group and
# replicated across, each EP block replicated over the 2 ranks (one per group) holding it (gradients all-reduced)
EP2_HSDP_W4 = ["v3_exact", "v3_detached", "next_exact", "gpt_oss_exact", "ep_experts", "ep_save", "minimax_exact",
               "minimax_ep_experts", "minimax_ep_save"]
# sliding windows past which the groups reach (replicated tails, the halo exchange) and attention sinks (GPT-OSS):
# exact and detached (checkpointed layers, batched branches, the state and its gradient offloaded),
# score, generate, the replicated state's bytes
WINDOW2 = ["w5_exact", "w5_detached", "w5_exact_ckpt", "w5_exact_offload", "w5_exact_state_offload",
           "w5_score", "w5_generate", "w5_state_bytes", "w5_exact_state_bytes", "gpt_oss_exact", "gpt_oss_detached",
           "gpt_oss_exact_fsdp", "gpt_oss_score", "gpt_oss_generate", "gemma3_exact", "w5_exact_kept",
           "gpt_oss_exact_kept"]
WINDOW4 = ["w5_exact", "w5_exact_c1", "w5_detached", "w5_generate", "w5_state_bytes", "w5_exact_state_bytes",
           "gpt_oss_exact", "gpt_oss_detached", "gpt_oss_score", "w5_exact_kept"]
# job: (world, cp, fsdp from init_distributed, scenarios[, replicate[, ep[, ep_shard]]])
JOBS = {"cp2": (2, 2, False, ALL), "cp4": (4, 4, False, FOUR), "dp2xcp2_fsdp": (4, 2, True, DP),
        "moe_cp2": (2, 2, False, MOE2), "moe_cp4": (4, 4, False, MOE4), "mla_cp2": (2, 2, False, MLA2),
        "mla_cp4": (4, 4, False, MLA4), "fsdp_cp1_w2": (2, 1, True, FSDP_CP1_W2),
        "fsdp_cp1_w4": (4, 1, True, FSDP_CP1_W4), "fsdp_cp2_w2": (2, 2, True, FSDP_CP2_W2),
        "fsdp_cp4_w4": (4, 4, True, FSDP_CP4_W4), "hsdp_r2_w4": (4, 1, True, HSDP, 2),
        "ep2": (2, 1, True, EP2, 1, 2), "ep2_cp2": (2, 2, True, EP2_CP2, 1, 2), "ep4": (4, 1, True, EP4, 1, 4),
        "ep2_cp2_w4": (4, 2, True, EP2_CP2_W4, 1, 2), "window_cp2": (2, 2, False, WINDOW2),
        "window_cp4": (4, 4, False, WINDOW4), "ep2_hsdp_w4": (4, 1, True, EP2_HSDP_W4, 2, 2, False)}
_EP_ONLY = ("ep_experts", "ep_save", "ep_init", "gpt_oss_ep_experts", "gpt_oss_ep_save", "minimax_ep_experts",
            "minimax_ep_save")
_NOT_GRPO = ("score", "state_bytes", "bad_inputs", "op_blocks", "low_precision", "master_weights",
             "registered_shards", "offload_dcp", "kept_refused")
# every job's gradient scenarios (until 2026-12-05 the FSDP and HSDP jobs' dp_sum_fsdp and fsdp_cp2_w2's
# hybrid_fp32_exact ran unchecked: they were in no list this was built from)
GRAD_SCENARIOS = sorted({s for job in JOBS.values() for s in job[3]
                         if s not in _EP_ONLY and not any(s == n or s.endswith("_" + n) for n in _NOT_GRPO)})
# tiny MoE configs (as tests/engine/test_deepseek_grpo.py); DSA: 32 index heads and index_topk below the prompt
# lengths, so the sparse path (and its selection over the whole sharded prompt) runs without score ties
_MOE = dict(vocab_size=V, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
            first_k_dense_replace=1, max_position_embeddings=256, n_group=2, topk_group=1, routed_scaling_factor=1.7)
_MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5, q_lora_rank=10)
_DSA = dict(index_head_dim=8, index_n_heads=32)
_GQA_MOE = dict(vocab_size=V, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                max_position_embeddings=256)


@pytest.fixture(scope="module")
def paths():
    llama = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, rope_theta=1000.0)
    qwen3 = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=12, vocab_size=V, max_position_embeddings=512,
                        tie_word_embeddings=True)
    hybrid = Qwen3_5TextConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8, vocab_size=V, max_position_embeddings=512,
                               num_hidden_layers=3, intermediate_size=48, full_attention_interval=2)
    moe = {"deepseek_v3": DeepseekV3Config(**_MOE, **_MLA),
           "glm_moe_dsa": GlmMoeDsaConfig(**_MOE, **_MLA, **_DSA, index_topk=7,
                                          indexer_types=["full", "shared", "full"]),
           "deepseek_v32": DeepseekV32Config(**_MOE, **_MLA, **_DSA, index_topk=6),
           "glm4_moe": Glm4MoeConfig(**{**_MOE, "num_key_value_heads": 2, "n_group": 1}, head_dim=8,
                                     use_qk_norm=True, attention_bias=True),
           "qwen3_next": Qwen3NextConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                         num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                                         linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8,
                                         vocab_size=V, max_position_embeddings=512, intermediate_size=48,
                                         full_attention_interval=2, num_experts=4, num_experts_per_tok=2,
                                         moe_intermediate_size=16, shared_expert_intermediate_size=24),
           "qwen3_5_moe_text": Qwen3_5MoeTextConfig(hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                                                    num_key_value_heads=1, head_dim=16, linear_num_key_heads=2,
                                                    linear_num_value_heads=4, linear_key_head_dim=8,
                                                    linear_value_head_dim=8, vocab_size=V,
                                                    max_position_embeddings=512, full_attention_interval=3,
                                                    num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16,
                                                    shared_expert_intermediate_size=24),
           "qwen3_moe": Qwen3MoeConfig(**_GQA_MOE, intermediate_size=40, moe_intermediate_size=8, head_dim=12,
                                       num_experts=8, num_experts_per_tok=3, norm_topk_prob=True, mlp_only_layers=[1]),
           "mixtral": MixtralConfig(**_GQA_MOE, intermediate_size=16, num_local_experts=6, num_experts_per_tok=2),
           "olmoe": OlmoeConfig(**_GQA_MOE, intermediate_size=16, num_experts=6, num_experts_per_tok=2, clip_qkv=0.5,
                                pad_token_id=None, eos_token_id=None),
           "minimax_m2": MiniMaxM2Config(**_GQA_MOE, head_dim=8, intermediate_size=16, num_local_experts=6,
                                         num_experts_per_tok=2, rotary_dim=4, bos_token_id=None, eos_token_id=None),
           # sliding layers (window 32: every group fits in it), two RoPEs
           "gemma3": Gemma3TextConfig(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=32,
                                      query_pre_attn_scalar=24, max_position_embeddings=512, pad_token_id=None,
                                      layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
           # the groups reach several windows past: window 5 over pieces of 2-4 positions (the halo spans several
           # pieces and the stored tails) and 6-token responses
           "gemma3_w5": Gemma3TextConfig(vocab_size=V, hidden_size=64, intermediate_size=48, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=5,
                                         query_pre_attn_scalar=24, max_position_embeddings=512, pad_token_id=None,
                                         layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
           # attention sinks on every layer, alternating windows of 4, biased experts
           "gpt_oss": GptOssConfig(vocab_size=V, hidden_size=32, intermediate_size=16, num_hidden_layers=3,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                   num_experts_per_tok=2, sliding_window=4, max_position_embeddings=256,
                                   swiglu_limit=1.5, pad_token_id=None, eos_token_id=None, bos_token_id=None),
           "glm4_moe_lite": Glm4MoeLiteConfig(**{k: v for k, v in _MOE.items() if k != "first_k_dense_replace"},
                                              **_MLA),
           # KDA, KDA, NoPE MLA, KDA; sigmoid-routed MoE but for the first layer
           "kimi_linear": KimiLinearConfig(**{k: v for k, v in kimi_tiny_config(vocab_size=V).items()
                                              if k not in ("model_type", "architectures")}),
           # KDA, MLA, KDA, MLA (full-rank, bounded KDA gates; gated MLA with RoPE); MoE but for the first layer
           "bailing_hybrid": BailingHybridConfig(**{k: v for k, v in ling_tiny_config(vocab_size=V).items()
                                                   if k not in ("model_type", "architectures")})}
    out = {"llama": save_tiny(tiny_hf(llama, seed=11, init_std=0.15)),
           "qwen3": save_tiny(tiny_hf(qwen3, seed=12, init_std=0.15)),
           "hybrid": save_tiny(tiny_hf(hybrid, seed=31, init_std=0.15))}
    for i, (name, cfg) in enumerate(moe.items()):
        hf = tiny_hf(cfg, seed=50 + i, init_std=0.15, attn="eager" if name == "gpt_oss" else "sdpa")
        with torch.no_grad():  # the router's correction bias is a zero buffer: make it matter
            for n, b in hf.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(i), dtype=b.dtype) * 0.3)
        out[name] = save_tiny(hf)
    return out


@pytest.fixture(scope="module")
def single(paths):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = SCENARIOS[name](paths)
        return cache[name]

    return get


def _result(ranks, name):
    for r, res in enumerate(ranks):
        got = res.get(name, "not run: an earlier scenario failed on this rank (see its test)")
        assert not isinstance(got, str), f"rank {r}, scenario {name}:\n{got}"
    return [res[name] for res in ranks]


def _assert_grads(got: dict, want: dict, where: str, rel: float = 1e-8) -> None:
    assert set(got) == set(want), f"{where}: {set(got) ^ set(want)}"
    for n, w in want.items():
        scale = w.abs().max().item()
        err = (got[n] - w).abs().max().item()
        r = err / scale if scale > 0 else err
        assert r <= rel, f"{where}: {n} relative error {r:.2e} > {rel:.0e}"


def _assert_close_l2(got: dict, want: dict, where: str, rel: float) -> None:
    num = sum(((got[n] - w) ** 2).sum() for n, w in want.items())
    den = sum((w ** 2).sum() for w in want.values())
    assert (num / den).sqrt() < rel, f"{where}: relative gradient difference {(num / den).sqrt():.2e} >= {rel}"


def check_gradients(ranks, single, job, name):
    """grpo_backward on every rank: .grad (after two accumulated groups), loss and log-probs as one process: float64
    to 1e-8 relative per parameter; float32 and bf16 runs within their precision (relative L2 over all parameters:
    1e-4 and 5e-2; CP and FSDP sum in other orders, so rounding differs)."""
    want = single(name)
    low = "fp32" in name or "bf16" in name
    for r, got in enumerate(_result(ranks, name)):
        if low:
            assert set(got["grads"]) == set(want["grads"])
            _assert_close_l2(got["grads"], want["grads"], f"{job} rank {r} {name}", 1e-4 if "fp32" in name else 5e-2)
            continue
        _assert_grads(got["grads"], want["grads"], f"{job} rank {r} {name}")
        for a, b in zip(got.get("loss", []), want.get("loss", [])):
            assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), (job, r, name, a, b)
        for a, b in zip(got.get("logprobs", []), want.get("logprobs", [])):
            a, b = (torch.cat(x) if isinstance(x, list) else x for x in (a, b))
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"{job} rank {r} {name}")
        if "grad_norm" in got and "grad_norm" in want:
            assert abs(got["grad_norm"] - want["grad_norm"]) <= 1e-8 * want["grad_norm"], (job, r, name)
        if "kept" in name:  # the ranks planned alike (agreed measurements), and the budget kept something
            assert got["kept"] == ranks[0][name]["kept"] and all(k != (0, 0) for k in got["kept"]), got["kept"]
            assert "split" not in name or any(layers > 0 for _, layers in got["kept"]), got["kept"]
        sharded = got.get("sharded_params")
        if sharded is not None:  # FSDP2 really sharded the decoder layers (and only where asked)
            assert (sharded > 0) == ("fsdp" in name or JOBS[job][2]), (job, name, sharded)


def check_generate(ranks, single, name):
    """Sampled log-probs equal score of the samples; every rank and one process sample the same tokens."""
    want = single(name)
    ranks = _result(ranks, name)
    for got in ranks:
        for a, b in zip(got["logprobs"], got["score"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        assert all(torch.equal(a, b) for a, b in zip(got["responses"], ranks[0]["responses"]))
        assert all(torch.equal(a, b) for a, b in zip(got["responses"], want["responses"]))
        for a, b in zip(got["logprobs"], want["logprobs"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def check_score(ranks, single, name="score"):
    want = single(name)
    for got in _result(ranks, name):
        for key in ("logprobs", "entropy"):
            for a, b in zip(got[key], want[key]):
                assert a.dtype == torch.float64 and a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def check_state_bytes(ranks, single, job, name="state_bytes"):
    """Each rank holds ~1/R of the single-process K/V and latents (PromptState.nbytes()); nothing twice. A recurrent
    layer's O(1) state (DeltaNet, KDA; detached: the state after the prompt) is whole on every rank, as in one
    process."""
    world = JOBS[job][1]
    want = single(name)
    got = _result(ranks, name)
    recurrent = [i for i, (_, rec) in enumerate(want["layers"]) if rec]
    for r, g in enumerate(got):
        assert [rec for _, rec in g["layers"]] == [rec for _, rec in want["layers"]], (r, g["layers"])
        assert sum(b for b, _ in g["layers"]) == g["nbytes"], (r, g["layers"], g["nbytes"])
        for i in recurrent:
            assert g["layers"][i][0] == want["layers"][i][0], (r, i, g["layers"][i], want["layers"][i])

    def sharded(res):
        return res["nbytes"] - sum(res["layers"][i][0] for i in recurrent)

    nbytes, total = [sharded(g) for g in got], sharded(want)
    assert sum(nbytes) == total
    for r, b in enumerate(nbytes):
        assert abs(b - total / world) <= 0.05 * total / world, (r, b, total)
    print(f"\n{job} {name}: single-process prompt state {want['nbytes']} B; per rank {[g['nbytes'] for g in got]} "
          f"(positions {[g['positions'] for g in got]} of {want['positions']}; recurrent layers {recurrent})")


def check_window_state_bytes(ranks, single, job, name):
    """A full-attention layer holds 1/R of the prompt's K/V per rank, a sliding one (window W) the same tails on every
    rank: detached, the last ``W - 1`` positions; exact, each layout step's last ``W - 1`` (steps of ``R x 8``)."""
    world = JOBS[job][1]
    want = single(name)
    got = _result(ranks, name)
    n, w = 97, want["window"]
    steps = distributed.shard_layout(n, world, 8).steps
    for i, layer in enumerate(want["layers"]):
        mine = [g["layers"][i] for g in got]
        if not layer["sliding"]:
            assert sum(m["nbytes"] for m in mine) == layer["nbytes"], (i, mine, layer)
            continue
        assert all(m == mine[0] for m in mine), (i, mine)  # replicated
        spans = [(max(st[0][0], st[-1][1] - w + 1), st[-1][1]) for st in steps]
        expect = spans if "exact" in name else [spans[-1]]
        assert mine[0]["positions"] == expect, (i, mine[0]["positions"], expect)
        per_position = layer["nbytes"] // sum(e - s for s, e in layer["positions"])
        assert mine[0]["nbytes"] == per_position * sum(e - s for s, e in expect)


def check_kept_refused(ranks, single, job):
    assert single("hybrid_kept_refused")["error"] is None
    for got in _result(ranks, "hybrid_kept_refused"):
        assert got["error"] == (f"graph_budget_bytes=1073741824: layer 0 keeps a RecurrentState prompt state, whose "
                                f"context-parallel form cannot keep prompt-step graphs (cp={JOBS[job][1]}); use "
                                "graph_budget_bytes=None or cp=1"), got["error"]


def check_op_blocks(ranks, single):
    """The attention op over a sharded K/V in blocks: output and dq on every rank, dK/dV of each rank's positions
    in its own sinks, the causal segment's dK/dV through autograd."""
    want = single("op_blocks")
    for got in _result(ranks, "op_blocks"):
        for key in ("out", "dq", "dkc", "dvc"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12)
        pos = got["positions"]
        torch.testing.assert_close(got["dk"], want["dk"][:, :, pos], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["dv"], want["dv"][:, :, pos], rtol=0, atol=1e-12)


def check_low_precision(ranks, single):
    """bf16: CP and one process round differently; their gradients agree to bf16 accuracy (measured ~1e-2)."""
    want = single("low_precision")
    for got in _result(ranks, "low_precision"):
        for dtype, w in want.items():
            num = sum(((got[dtype][n] - w[n]) ** 2).sum() for n in w)
            den = sum((w[n] ** 2).sum() for n in w)
            assert (num / den).sqrt() < 0.05, f"{dtype}: relative gradient difference {(num / den).sqrt():.3f}"


def check_master_weights(ranks):
    """bf16 compute over fp32 master shards: parameters, gradients (reduced in fp32) and so the optimiser state are
    float32; an update of ~1e-8 moves almost every master weight, and almost none of bf16 shards. A float16 DSA
    model keeps the indexer's float32 ``weights_proj`` in FSDP2 units of their own, under float16 or float32 masters;
    a bf16 Ling 3.0 model its short convs and forget-gate rates."""
    for got in _result(ranks, "master_weights"):
        fp32, bf16 = got["fp32"], got["bf16"]
        assert fp32["param_dtypes"] == ["torch.float32"] and fp32["grad_dtypes"] == ["torch.float32"], fp32
        assert bf16["param_dtypes"] == ["torch.bfloat16"], bf16
        assert fp32["changed"] > 0.95 and bf16["changed"] < 0.01, (fp32["changed"], bf16["changed"])
        # float16 DSA: the indexer's weights_proj float32 beside float16 masters (a unit of its own) or float32 ones
        kept32, kept16 = got["fp16_kept_fp32"], got["fp16_kept_fp16"]
        assert kept32["param_dtypes"] == ["torch.float32"] and kept32["head_units"] == [True, True], kept32
        assert kept16["param_dtypes"] == ["torch.float16", "torch.float32"], kept16
        assert kept16["head_dtypes"] == ["torch.float32"] and kept16["head_units"] == [True, True], kept16
        assert kept32["finite"] and kept16["finite"]
        assert got["fp16_kept_grad_rel"] < 2e-2, got["fp16_kept_grad_rel"]
        # bf16 Ling: the short convs and forget-gate rates float32, units of their own, gathered in float32 (the
        # forget gate's f_proj in bf16) with fp32 or bf16 masters and under LoRA; the two steps agree to bf16
        for name in ("ling_fp32", "ling_bf16", "ling_lora"):
            ling = got[name]
            assert ling["kept_dtypes"] == ["torch.float32"] and ling["owner_units"] == [True], (name, ling)
            assert ling["gathered"] == {"ShortConv.weight": "torch.float32", "ForgetGate.dt_bias": "torch.float32",
                                        "ForgetGate.A_log": "torch.float32", "f_proj": "torch.bfloat16"}, (name, ling)
            assert ling["finite"], name
        assert got["ling_grad_rel"] < 1e-2, got["ling_grad_rel"]  # 3.3e-3 measured
        # fp16 GPT-OSS under float16 masters: its 7 norms (2 per layer, the final one) float32 units
        oss = got["gpt_oss_fp16"]
        assert oss["count"] == 7 and oss["gathered"] == oss["weights"] == ["torch.float32"], oss
        assert oss["units"] == [True] and oss["finite"], oss


def check_bad_inputs(ranks, job):
    world = JOBS[job][1]
    for got in _result(ranks, "bad_inputs"):
        short = (f"the prompt is too short to shard: {world - 1} prefilled positions (the prompt without its last "
                 f"token) over cp={world} ranks")
        assert got["too_short_grpo"].startswith(short) and got["too_short_generate"].startswith(short)
        assert got["init_twice"].startswith(f"init_distributed was already called in this process (cp={world}")
        assert "must pass the same prompt and responses" in got["mismatch"]
    for res in ranks:
        errs = res["init_errors"]
        assert errs[0].startswith("cp=0 must be an integer >= 1")
        bad = 3 if world % 3 else 5
        allowed = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        assert errs[bad] == f"cp={bad} does not divide the world size {world}; allowed: {allowed}"


def check_offload_dcp(ranks):
    """The sharded checkpoint of HostAdamW's host-held moments: reloaded on the same ranks the same shards and the
    same next step; loaded in one process (DCP resharding 2 ranks -> 1) the moments and weights the job holds."""
    from longstraw.checkpoint.training import load_sharded_state
    from longstraw.offload import HostAdamW

    got = _result(ranks, "offload_dcp")
    assert all(g["same_state"] and g["same_step"] for g in got)
    model = longstraw.load_model(got[0]["model"])
    opt = HostAdamW(list(model.parameters()), lr=1e-2, weight_decay=0.1)
    load_sharded_state(got[0]["checkpoint"], model, opt)
    names = {p: n for n, p in model.named_parameters()}
    mine = {f"{names[p]}.{k}": v for p, st in opt.state.items() for k, v in st.items() if k != "step"}
    assert mine.keys() == got[0]["moments"].keys() and mine
    for k, v in mine.items():
        assert v.device.type == "cpu" and torch.equal(v, got[0]["moments"][k]), k


def check_registered_shards(ranks):
    for r, got in enumerate(_result(ranks, "registered_shards")):
        for call, gathered in got.items():
            assert not gathered, f"rank {r}: after {call}, parameters registered gathered, not sharded: {gathered}"


def check_ep_experts(ranks, single, job, name="ep_experts"):
    """Each rank holds 1/E of the routed-expert bytes with W == E, and with more ranks its FSDP chunk of its EP
    block (sharded over the W / E ranks holding it, rows as torch.chunk splits them), loaded from its rows of the
    checkpoint: experts ``[ep_rank * n / E, (ep_rank + 1) * n / E)``, or its chunk of them."""
    world, ep = _job(job)[0], _job(job)[5]
    want = single(name)
    got_all = _result(ranks, name)
    sharded = _ep_sharded(job)
    if sharded:  # every expert row held by one rank of the job (6 experts: blocks of 3 over 2 ranks, 2 + 1 rows)
        assert sum(g["expert_bytes"] for g in got_all) == want["expert_bytes"]
    for r, got in enumerate(got_all):
        assert all(s == sharded for s in got["sharded_edp"]), (r, got["sharded_edp"])
        if not sharded:
            assert got["expert_bytes"] * ep == want["expert_bytes"], (r, got["expert_bytes"], want["expert_bytes"])
        for name, (_, w) in want["weights"].items():
            block = w.shape[0] // ep
            a = (r % ep) * block
            parts = world // ep if sharded else 1
            chunk = -(-block // parts)
            d = (r // ep) if sharded else 0
            a, b = a + min(d * chunk, block), a + min((d + 1) * chunk, block)
            first, mine = got["weights"][name]
            assert first == a and torch.equal(mine, w[a:b]), (r, name, first, a, b)


def check_ep_save(ranks, name="ep_save"):
    """The saved checkpoint equals the original. Per-expert checkpoints (DeepSeek-V3) are written by the ranks that
    hold each expert (no gather over the EP group); GPT-OSS's stores each expert tensor fused, so each of the 3
    layers' 4 expert tensors (weights and biases) is gathered whole once, when its turn comes."""
    gathers = {"ep_save": 0, "minimax_ep_save": 0, "gpt_oss_ep_save": 3 * 4}[name]
    for got in _result(ranks, name):
        assert got["same"], got
        assert got["comm_gathers"] == gathers, got


def check_ep_init(ranks, job):
    world, cp, _, _, _, ep = _job(job)
    allowed = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
    for res in ranks:
        errs = res["init_errors"]
        assert errs["ep_no_fsdp"].startswith(f"ep={ep} needs fsdp=True"), errs
        assert errs["ep_zero"].startswith("ep=0 must be an integer >= 1"), errs
        assert errs["ep_not_dividing"] == f"ep=3 does not divide the world size {world}; allowed: {allowed}", errs


def _job(job):
    """``(world, cp, fsdp, scenarios, replicate, ep)`` of a job."""
    world, cp, fsdp, names, *rest = JOBS[job]
    return world, cp, fsdp, names, (rest[0] if rest else 1), (rest[1] if len(rest) > 1 else 1)


def _ep_shard(job) -> bool:
    """The job's ``init_distributed(ep_shard=)`` (default True)."""
    return JOBS[job][6] if len(JOBS[job]) > 6 else True


def _ep_sharded(job) -> bool:
    """Whether the job's EP blocks are FSDP-sharded over the ranks holding them (more ranks than ep, ep_shard)."""
    return _job(job)[0] > _job(job)[5] and _ep_shard(job)


CASES = [(job, name) for job in JOBS for name in _job(job)[3]]


@pytest.fixture(scope="module")
def launched(paths):
    """``get(job)``: every rank's results of the job, launched on first use (once per worker: see the docstring)."""
    cache = {}

    def get(job):
        if job not in cache:
            world, cp, fsdp, names, replicate, ep = _job(job)
            try:
                cache[job] = launch(world, cp=cp, paths=paths, scenarios=[n for n in names if n != "ep_init"],
                                    fsdp=fsdp, replicate=replicate, ep=ep, ep_shard=_ep_shard(job))
            except AssertionError as e:
                cache[job] = e
        if isinstance(cache[job], AssertionError):
            raise cache[job]
        return cache[job]

    return get


def _check(job, name, ranks, single):
    if name in GRAD_SCENARIOS:
        check_gradients(ranks, single, job, name)
    if "generate" in name:
        check_generate(ranks, single, name)
    checks = {"score": lambda: check_score(ranks, single), "state_bytes": lambda: check_state_bytes(ranks, single, job),
              "op_blocks": lambda: check_op_blocks(ranks, single), "bad_inputs": lambda: check_bad_inputs(ranks, job),
              "low_precision": lambda: check_low_precision(ranks, single),
              "master_weights": lambda: check_master_weights(ranks),
              "registered_shards": lambda: check_registered_shards(ranks),
              "offload_dcp": lambda: check_offload_dcp(ranks)}
    checks["hybrid_kept_refused"] = lambda: check_kept_refused(ranks, single, job)
    checks.update({"ep_experts": lambda: check_ep_experts(ranks, single, job),
                   "ep_save": lambda: check_ep_save(ranks), "ep_init": lambda: check_ep_init(ranks, job),
                   "gpt_oss_ep_experts": lambda: check_ep_experts(ranks, single, job, name),
                   "gpt_oss_ep_save": lambda: check_ep_save(ranks, name),
                   "minimax_ep_experts": lambda: check_ep_experts(ranks, single, job, name),
                   "minimax_ep_save": lambda: check_ep_save(ranks, name)})
    if name in checks:
        checks[name]()
    if name.endswith("_score"):  # the MoE families' variants of these checks
        check_score(ranks, single, name)
    if name.startswith("w5_") and name.endswith("state_bytes"):
        check_window_state_bytes(ranks, single, job, name)
    elif name.endswith("_state_bytes"):
        check_state_bytes(ranks, single, job, name)


@pytest.mark.slow
@pytest.mark.parametrize("job,name", [pytest.param(j, n, id=f"{j}-{n}", marks=pytest.mark.xdist_group(j))
                                      for j, n in CASES])
def test_scenario(job, name, launched, single):
    _check(job, name, launched(job), single)


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=pytest.mark.xdist_group(j)) for j in JOBS])
def test_job_context(job, launched):
    """Each rank's place in the job: CP size and rank, data-parallel replicas (FSDP2 applied by load_model when
    init_distributed(fsdp=True): every parameter sharded, the embedding and the LM head included)."""
    world, cp, fsdp, names, replicate, ep = _job(job)
    ranks = launched(job)
    assert [r["context"]["ep_size"] for r in ranks] == [ep] * world
    assert [r["context"]["ep_rank"] for r in ranks] == [i % ep for i in range(world)]
    assert [r["context"]["cp_size"] for r in ranks] == [cp] * world
    assert [r["context"]["cp_rank"] for r in ranks] == [i % cp for i in range(world)]
    assert [r["context"]["dp_size"] for r in ranks] == [world // cp] * world
    assert [r["context"]["replicate"] for r in ranks] == [replicate] * world
    if fsdp:
        for r in _result(ranks, names[0]):
            # nothing left whole on any rank but the expert-parallel experts (each rank's own) when ep is the whole
            # job; with more ranks their blocks are FSDP-sharded over the ranks holding them (edp) too
            assert r["sharded_params"] > 0 and r["whole_params"] == (0 if _ep_sharded(job) else r["ep_params"])
            assert (r["ep_params"] > 0) == (ep > 1)


def test_init_without_process_group_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"init_distributed needs a torch.distributed environment, but RANK, "
                                         r"WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set; launch with `torchrun"):
        longstraw.init_distributed(cp=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT are not set"):
        longstraw.init_distributed(cp=2)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"cp={bad!r} must be an integer >= 1"):
            longstraw.init_distributed(cp=bad)
    with pytest.raises(ValueError, match=r"backend='mpi' is not supported; allowed: None, 'gloo', 'nccl'"):
        longstraw.init_distributed(cp=1, backend="mpi")
    assert longstraw.distributed.get_context() is None


def test_layout_partitions_positions():
    from longstraw.distributed import shard_layout

    for n, world, chunk in [(97, 4, 8), (5, 4, 1), (4, 4, 100), (1000, 2, 7), (33, 3, 2)]:
        lay = shard_layout(n, world, chunk)
        seen = [p for st in lay.steps for s, e in st for p in range(s, e)]
        assert seen == list(range(n))  # steps and pieces in position order, each position once
        for st in lay.steps:
            assert all(e > s for s, e in st) and max(e - s for s, e in st) <= max(chunk, 2)
        sizes = [lay.local_size(r) for r in range(world)]
        assert max(sizes) - min(sizes) <= lay.num_steps
    with pytest.raises(ValueError, match="the prompt is too short to shard: 3 prefilled positions"):
        shard_layout(3, 4, 8)


def test_latent_positions_and_deterministic_topk():
    """cp_latent's helpers: global <-> local positions of a rank's pieces, and the best k of (score, position)
    candidates, whose exact ties go to the lower position whatever the candidates' order, and which merges in any
    grouping to the same result (the ring's reduction: the best of the bests of the parts)."""
    from longstraw.distributed import shard_layout
    from longstraw.distributed.cp_latent import _best, _Owner
    from longstraw.ops.topk import first_topk as _first_topk

    lay = shard_layout(37, 3, 4)
    for r in range(3):
        own = _Owner(lay, r)
        mine = torch.tensor([p for s, e in lay.pieces(r) for p in range(s, e)])
        local, owned = own.to_local(torch.arange(37))
        assert owned.nonzero().flatten().tolist() == mine.tolist()
        assert local[owned].tolist() == list(range(mine.numel()))
        assert own.to_global(torch.arange(mine.numel())).tolist() == mine.tolist()
    vals = torch.tensor([[[1.0, 3.0, 2.0, 3.0, float("-inf"), 2.0]]])
    assert _first_topk(vals, 3).tolist() == [[[1, 2, 3]]]  # both 3s, then the first 2
    pos = torch.tensor([[[9, 7, 5, 2, 0, 4]]])  # shuffled positions: the tie at 2.0 goes to position 4
    v, p = _best([vals], [pos], 3)
    assert sorted(p.flatten().tolist()) == [2, 4, 7] and bool((v > float("-inf")).all())
    v, p = _best([vals], [pos], 8)  # wider than the candidates: padded, and the -inf ones are invalid
    assert (v > float("-inf")).sum().item() == 5 and p.shape[-1] == 8 and 0 in p[v == float("-inf")].tolist()
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 6, (2, 5, 48), generator=g).double()  # many exact ties
    places = torch.randperm(48, generator=g).expand(2, 5, 48)  # distinct positions, shuffled
    want = _best([scores], [places], 7)
    parts = [(scores[..., i : i + 12], places[..., i : i + 12]) for i in range(0, 48, 12)]
    acc = _best([parts[0][0]], [parts[0][1]], 7)
    for sv, sp in parts[1:]:  # the ring's order: a running best merged with the next part's best
        acc = _best([acc[0], _best([sv], [sp], 7)[0]], [acc[1], _best([sv], [sp], 7)[1]], 7)
    assert torch.equal(acc[0], want[0]) and torch.equal(acc[1], want[1])


def test_mla_form_is_the_groups_choice():
    """Under CP the MLA form is chosen from the whole group's call (``group_shape``: a prefill step's pieces share
    every expansion; replicated queries as in one process), so ranks whose pieces differ in length (the last step)
    or whose shares differ choose alike; at DeepSeek-V3 sizes the FLOP rule decompresses a 32-rank step of 4096-token
    pieces and keeps decoding and short replays absorbed."""
    from longstraw.distributed.cp_attention import StepPieces
    from longstraw.distributed.cp_latent import ShardedLatentSegment
    from longstraw.models.mla import MLAttention

    v3 = MLAttention(64, 128, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, scale=1.0, mode="auto").to("meta")

    def seg(local, stored, step=None):
        lat = torch.empty(1, 1, local, 576, device="meta")
        return ShardedLatentSegment(lat, lat, comm=None, step=step, global_length=stored)

    stored = 1 << 20
    lengths = (4096,) * 31 + (17,)  # the last rank's piece is short
    forms = {v3.choose_form(1, lengths[r], [seg(stored // 32 + 7 * r, stored, StepPieces(lengths, r))])
             for r in range(32)}
    assert forms == {"decompressed"}
    assert v3.choose_form(1, 17, [seg(5, 0, StepPieces((17, 17), 1))]) == "absorbed"  # a first step of 34 tokens
    for b, t, want in ((16, 1, "absorbed"), (1, 64, "absorbed"), (1, 4096, "decompressed")):
        got = {v3.choose_form(b, t, [seg(stored // 32 + r, stored)], grad=True) for r in range(4)}
        assert got == {want}, (b, t, got)
    # the count it decides by: the whole step as one call of sum(lengths) queries over the stored prefix
    assert seg(3, stored, StepPieces(lengths, 5)).group_shape(4096) == (sum(lengths), stored)
    assert seg(3, stored).group_shape(9) == (9, stored)
