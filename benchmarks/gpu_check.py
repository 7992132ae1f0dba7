"""The prepared GPU run: one command, at most ~8 minutes on one H200, one JSON. Every section (and every part of
section b) catches its own failure and writes the error and traceback into the JSON, which is rewritten after each
part, so a crash or a kill still leaves what was measured.

  python benchmarks/gpu_check.py --json gpu_check.json          # on the GPU machine
  python benchmarks/gpu_check.py --smoke --json smoke.json      # every section at tiny size on the CPU (the suite)

Needs torch and LongStraw's own dependencies (safetensors, numpy, tqdm; ``src/`` is put on the path), transformers
only for the naive-HF baseline of b (without it that one entry records the ImportError), fla-core if installed
(``device.fla`` and every step's ``delta_rule_kernel`` say whether it ran).

a. Exactness on the device (``--a-s``, default 150 s). For every model family the test suite covers (the tiny
   configs below, one per ``model_type``), a random model is built in float64 on the CPU: its logits and the
   ``grpo_backward`` gradients in exact and detached mode are the REFERENCE (the suite holds that float64 path to
   transformers at <= 1e-10 for logits and <= 1e-8 for gradients). The same weights then run on the device (cuda
   when present; ``--smoke``: cpu) in float32 and bfloat16. Reported per (family, dtype): the relative errors
   ``||x - ref|| / ||ref||`` (Frobenius) of the logits, of each parameter's gradient (the worst one) and of all
   gradients together, and the max-abs errors over max|ref|. Pass (TOLERANCES): float32 logits <= 1e-4 and EVERY
   parameter's gradient <= 1e-3; bfloat16 logits <= 5e-2 and all gradients together <= 1e-1 (bf16 carries 8
   mantissa bits and every layer rounds; a parameter whose gradient is a small sum of cancelling terms, e.g. a
   DeltaNet ``dt_bias`` or a norm weight, or a routed / top-k choice near a tie, can be off by tens of percent
   alone, and a flipped expert or top-k choice moves whole gradients. Measured on the CPU (2026-12-03, these configs,
   all 22 entries pass): float32 logits <= 1.9e-7, every parameter <= 4.3e-6; bfloat16 logits <= 6e-3 (DSA: 2.5e-2),
   all gradients together <= 1.9e-2 except glm_moe_dsa's 7.3e-2 (top-k near-ties flip in bf16); a wrong kernel call
   gives O(1)). On one H200 (2026-12-04, torch 2.11, routers drawn at random as below): all 22 pass, float32
   logits <= 1.6e-7 and every parameter <= 3.5e-6, bfloat16 logits <= 2.5e-2 and all gradients together <= 7.3e-2.
   Decoding (the token-by-token rollout path, which logits and gradients do not take): two branches of
   DECODE_TOKENS sampled tokens from the shared state; the decoder's log-probs against the float64 reference's
   for the same tokens, max abs, pass at <= 1e-4 (float32) and DECODE_BF16 (bfloat16). Measured on the CPU
   (2026-12-04, smoke): float32 <= 5e-7, bfloat16 <= 4.8e-2 (glm_moe_dsa; dense 6e-3); a broken step is O(1).
   Routers that transformers initialises to zero are drawn at random (every expert would tie, and CPU and CUDA
   ``topk`` break ties differently). Then LoRA (LORA_FAMILIES: a hybrid MoE, an MLA MoE and GPT-OSS, all-linear
   adapters and the routed experts' ``target_parameters``, B drawn non-zero): the same checks, the gradients being the
   adapters'. Order (``section_a_order``): the families not yet run on a GPU, then the LoRA entries, then those
   that passed on the H200 (RAN_ON_GPU), so that a budget cut short drops re-checks, not first runs (each entry
   skipped for time is reported as such). ``--smoke`` runs bfloat16 for SMOKE_BF16 and the LoRA entries only,
   float32 for all. First, fla's backward (``fla_backward``, CUDA with fla only; added 2026-12-07, not yet run on a
   GPU): fla's kernels, per-head and per-channel, forward and backward in bfloat16 against the torch rule on the
   device at the engine's shapes (FLA_SHAPES), the check the dispatcher now runs once per shape before trusting
   fla's backward (``ops.deltanet.fla_backward_check``); reported, not part of the pass. Last, the
   DeltaNet state scan of context parallelism on one device (``deltanet_scan``): a Qwen3.5-shaped mixer (heads of
   128) over 256 tokens from a random state, through the scan prefix of a one-rank group
   (``cp_recurrent.rehearsal_prefix``: the rule called with ``Dv + Dk`` value columns and an identity initial state,
   then composed) against the plain prefix, without and with a graph (fla's forward in the first where it imports):
   output and final state, ``||x - ref|| / ||ref||``, pass at SCAN_TOL (added 2026-12-05, not yet run on a GPU;
   on the CPU ~1e-7 in float32); the same for a Kimi Delta Attention mixer (4 heads of 128, per-channel decays:
   fla's ``chunk_kda``; added 2026-12-06).
b. The engine's figures on a ~1.1B Qwen3.5-style hybrid (the rest of ``--budget-s``, default 480 s): prefill tokens/s
   and MFU; one GRPO step per mode (detached, exact) and G in ``--groups``: peak memory above the post-load baseline,
   seconds per phase, REPLAY tokens/s (``G x R / replay seconds``); rollout decoding of G=max(groups) branches from
   the shared prompt state (``longstraw.generate``): decode tokens/s; naive HF (transformers on the G concatenated
   sequences), the shared-prefix step (``grpo_step._prefix_step``: prompt graph kept, one backward) and LongStraw at
   the same prompt ``--compare-len`` through ``grpo_step.measure_method``: peaks and seconds, and their ratios to
   LongStraw detached; the longest prompt reached per mode in ``--longest-s`` (default 120 s) each; one exact step
   with ``checkpoint_layers``; the torch chunked delta rule alone (fwd + bwd of one prefill chunk of this model's
   DeltaNet shape) at three ``block_tokens``, and with plain autograd beside the recomputing backward at the default
   block (its GPU time is launches: data for choosing a GPU default); one DeltaNet mixer with the plain prefix and
   with the CP state scan's (``deltanet_cp_scan.py``, added 2026-12-05: the widening's cost on the device); the
   memory planner's peak beside every measured step (``--no-planner`` turns it off:
   computed in CPU worker processes while the GPU measures, waited for at most PLAN_WAIT_S at the end; on the H200
   run of 2026-12-04, planned after the fact for the same steps, it was within 0.04% of every measured peak).
d. The trainer on the device (``--d-s``, default 60 s; ``gpu_trainer.py``): ``longstraw train``'s Trainer on the
   built-in tiny hybrid, exact mode, G=8: a 4-step run with checkpoints (its export loads in transformers), the
   same run stopped at 2 steps and resumed to 4 (equality with the uninterrupted run reported; required on the
   CPU only), and a LoRA run (PEFT adapter checkpoint). Runs before b, which takes what is left.
c. Context parallelism and FSDP2 (``--c-s``, default 90 s): with more than one GPU, ``min(4, count)`` NCCL ranks
   (torch.multiprocessing) each run ``grpo_backward`` (exact) of one group with the prompt split over the ranks,
   without and with FSDP2, for a dense Llama, the Qwen3.5 hybrid and GPT-OSS (attention sinks, sliding windows the
   group reaches past), float32 and bfloat16; the gathered gradients
   are compared with one process on one GPU. One GPU: "skipped: 1 GPU". ``--smoke``: 2 gloo ranks on the CPU.

Model figures of b: hidden 2048, 16 layers (every 4th full attention: 16 query heads with output gate, 2 K/V heads,
head dim 128; 12 Gated DeltaNet with 16 key / 32 value heads of dim 128), SwiGLU 6144, vocabulary 32768, untied
head, bfloat16, random normal(0, 0.02) weights. FLOPs of the MFU: ``2 x`` the parameters of every linear layer but
the LM head per token plus ``4 x heads x head_dim`` per causal (query, key) pair of each full-attention layer; the
DeltaNet kernels' own FLOPs are not counted (a lower bound). Peak: ``--peak-tflops`` (default 989 for H100/H200
dense bf16, read from the device name). ``--smoke`` shrinks everything (and widens the time budgets to 1800 s in all,
900 s for a, 600 s for c, 20 s per mode for the longest prompt, so that a loaded CPU never cuts a section short);
its figures mean nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import shlex
import sys
import tempfile
import time
import traceback
from types import SimpleNamespace

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))  # uninstalled checkout
sys.path.insert(0, HERE)  # grpo_step.py (measure_method and the baselines)

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}
# a: pass when the logits' norm-relative error and the gradients' (float32: of EVERY parameter; bfloat16: of all
# parameters together, the worst single one reported) are within these
DECODE_TOKENS = 6  # a: tokens decoded per branch by the decoding check
DECODE_BF16 = 0.25  # a: bfloat16 decoding check's bound on |log-prob - float64 log-prob| (see section_a)
TOLERANCES = {"float32": {"logits": 1e-4, "grads": 1e-3, "grads_over": "every parameter", "decode": 1e-4},
              "bfloat16": {"logits": 5e-2, "grads": 1e-1, "grads_over": "all parameters together",
                           "decode": DECODE_BF16}}
PLAN_WAIT_S = 60.0  # b: how long the finished measurements wait for the planner's predictions (CPU workers)
SMOKE_BF16 = ("llama", "qwen3_5_text", "glm_moe_dsa")  # --smoke: bfloat16 for one family per architecture only
SCAN_TOL = {"float32": 1e-4, "bfloat16": 3e-2}  # a: the CP DeltaNet scan (one rank) against the plain mixer

# ---------------------------------------------------------------------------------------------------- a. configs
# The tiny configs of the suite's family tests (tests/models), as plain dicts (no transformers needed); each builds
# the same model as transformers' config class with these arguments (checked when this file was written).
# float32 on CUDA is checked without TF32 (section_a switches it off for matmuls and cuDNN convolutions).
_DENSE = dict(vocab_size=61, hidden_size=48, intermediate_size=80, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512)
# the hybrids' DeltaNet head dims are 32 (the suite's are 12): Triton's tl.dot inside fla wants dims >= 16, and the
# three hybrid families share one shape, so fla's autotuning runs once
_HYBRID = dict(vocab_size=61, hidden_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=12, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
               linear_value_head_dim=32, max_position_embeddings=512, full_attention_interval=3)
_HMOE = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, shared_expert_intermediate_size=16)
_MOE = dict(vocab_size=59, hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=3,
            first_k_dense_replace=1, max_position_embeddings=256, n_group=2, topk_group=1, routed_scaling_factor=1.7,
            n_shared_experts=2)
_MLA = dict(kv_lora_rank=12, qk_rope_head_dim=4, qk_nope_head_dim=6, v_head_dim=5)
_DSA = dict(q_lora_rank=10, index_head_dim=8, index_n_heads=32)
FAMILY_CONFIGS = {
    "llama": {**_DENSE},
    "qwen2": {**_DENSE},
    "qwen3": {**_DENSE, "head_dim": 16},
    "mistral": {**_DENSE, "sliding_window": 11},  # prompts and responses past the window: the tiled band kernels
    "qwen3_5_text": {**_HYBRID, "intermediate_size": 48},
    "qwen3_next": {**_HYBRID, "intermediate_size": 48, **_HMOE, "decoder_sparse_step": 1},
    "qwen3_5_moe_text": {**_HYBRID, **_HMOE},
    "deepseek_v3": {**_MOE, **_MLA, "q_lora_rank": 10},
    "glm4_moe": {**_MOE, "num_key_value_heads": 2, "n_group": 1, "head_dim": 8, "use_qk_norm": True,
                 "attention_bias": True, "rms_norm_eps": 1e-5},
    "deepseek_v32": {**_MOE, **_MLA, **_DSA, "index_topk": 6},  # sparse: prompts longer than index_topk
    "glm_moe_dsa": {**_MOE, **_MLA, **_DSA, "index_topk": 7, "indexer_types": ["full", "shared", "full"],
                    "rms_norm_eps": 1e-5},
    # added 2026-12-05 (not yet run on a GPU), last: a short budget leaves out these before the families that ran
    "qwen3_moe": {**_DENSE, "head_dim": 16, "moe_intermediate_size": 16, "num_experts": 8, "num_experts_per_tok": 2,
                  "norm_topk_prob": True, "mlp_only_layers": [1]},
    "mixtral": {**_DENSE, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2},
    "minimax_m2": {**_DENSE, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                   "rotary_dim": 8, "bos_token_id": None, "eos_token_id": None},
    "glm4_moe_lite": {**{k: v for k, v in _MOE.items() if k != "first_k_dense_replace"}, **_MLA,
                      "q_lora_rank": 10, "rms_norm_eps": 1e-5},
    "olmoe": {**_DENSE, "intermediate_size": 32, "num_experts": 4, "num_experts_per_tok": 2, "clip_qkv": 4.0,
              "pad_token_id": None, "eos_token_id": None},
    # added 2026-12-05 (second session): attention sinks, sliding windows past their edge (the tiled band kernels),
    # biased experts in the transposed interleaved layout (grouped_mm with biases on CUDA bf16)
    "gpt_oss": {**_DENSE, "head_dim": 16, "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                "sliding_window": 11, "swiglu_limit": 3.0, "pad_token_id": None, "eos_token_id": None,
                "bos_token_id": None},
    # two RoPEs (the sliding layers' and the full one's), sandwich norms, scaled embeddings, windows past their edge
    "gemma3_text": {**_DENSE, "hidden_size": 64, "head_dim": 16, "num_hidden_layers": 3, "sliding_window": 11,
                    "query_pre_attn_scalar": 24, "layer_types": ["sliding_attention", "full_attention",
                                                              "sliding_attention"]},
    # post-norm blocks, q/k norms over all heads, sliding windows with their own RoPE (YaRN on the full layer's)
    "olmo3": {**_DENSE, "num_hidden_layers": 4, "sliding_window": 11, "eos_token_id": None,
              "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0,
                                                     "original_max_position_embeddings": 64, "rope_theta": 5e5},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 5e5}}},
    # added 2026-12-06 (not yet run on a GPU): Kimi Delta Attention (per-channel decays: fla's chunk_kda on CUDA bf16,
    # head size 32 as the hybrids' for Triton's tl.dot), NoPE MLA, sigmoid-routed MoE after a dense first layer
    "kimi_linear": {"vocab_size": 61, "hidden_size": 48, "intermediate_size": 48, "moe_intermediate_size": 16,
                    "num_hidden_layers": 3, "num_attention_heads": 4, "kv_lora_rank": 12, "q_lora_rank": None,
                    "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5, "model_max_length": 512,
                    "linear_attn_config": {"num_heads": 2, "head_dim": 32, "short_conv_kernel_size": 4,
                                           "kda_layers": [1, 3], "full_attn_layers": [2]},
                    "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1, "first_k_dense_replace": 1,
                    "routed_scaling_factor": 2.446, "rms_norm_eps": 1e-5, "tie_word_embeddings": False},
    # added 2026-12-07 (not yet run on a GPU): Ling 3.0's KDA with full-rank, bounded ("safe") gates (fla's chunk_kda
    # on CUDA bf16, heads of 32), MLA with RoPE and a sigmoid gate per head, sigmoid-routed MoE in 2 groups
    "bailing_hybrid": {"vocab_size": 61, "hidden_size": 48, "intermediate_size": 48, "moe_intermediate_size": 16,
                       "num_hidden_layers": 3, "num_attention_heads": 4, "head_dim": 32, "kv_lora_rank": 12,
                       "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5, "model_max_length": 512,
                       "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                       "num_experts": 4, "num_experts_per_token": 2, "num_shared_experts": 1,
                       "num_expert_group": 2, "topk_group": 1, "first_k_dense_replace": 1,
                       "routed_scaling_factor": 2.5, "rms_norm_eps": 1e-6, "tie_word_embeddings": False,
                       "pad_token_id": None, "eos_token_id": None},
}


def family_config(model_type: str) -> dict:
    return {"model_type": model_type, **FAMILY_CONFIGS[model_type]}


# a: LoRA entries (nothing of LoRA had run on a GPU): every linear layer and the routed experts' fused weights (the
# grouped_mm path with the adapters' low-rank products on CUDA bf16), B drawn non-zero so the adapters change the
# logits; the gradients checked are the adapters' (the base is frozen). Rank 8: 16-byte rows in bf16.
# gpt_oss (added 2026-12-05, last): adapters on transposed [E, in, out] experts with biases (grouped_mm + LoRA)
LORA_FAMILIES = ("qwen3_5_moe_text", "deepseek_v3", "gpt_oss")
LORA = dict(rank=8, alpha=16, target_modules="all-linear",
            target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])

# a: the families that passed on a GPU (H200, 2026-12-04). Section a runs the others first, then the LoRA entries,
# then these, so that a budget cut short by a tight GPU session drops re-checks rather than first runs
RAN_ON_GPU = ("llama", "qwen2", "qwen3", "mistral", "qwen3_5_text", "qwen3_next", "qwen3_5_moe_text", "deepseek_v3",
              "glm4_moe", "deepseek_v32", "glm_moe_dsa")


def section_a_order() -> list[tuple[str, bool]]:
    """(family, with LoRA) in the order section a runs them: families not yet run on a GPU, the LoRA entries, then
    the families that ran (RAN_ON_GPU); the config order within each."""
    fresh = [(f, False) for f in FAMILY_CONFIGS if f not in RAN_ON_GPU]
    return fresh + [(f, True) for f in LORA_FAMILIES] + [(f, False) for f in FAMILY_CONFIGS if f in RAN_ON_GPU]


# ---------------------------------------------------------------------------------------------------- helpers


def _error(e: BaseException) -> dict:
    return {"ok": False, "error": f"{type(e).__name__}: {str(e)[:500]}", "traceback": traceback.format_exc()[-4000:]}


def _rel(x, ref) -> tuple[float, float]:
    """(||x - ref|| / ||ref||, max|x - ref| / max|ref|) in float64 on the CPU."""
    x, ref = x.detach().double().cpu(), ref.detach().double().cpu()
    d = x - ref
    nr = float(ref.norm()) or 1.0
    mr = float(ref.abs().max()) if ref.numel() else 1.0
    return float(d.norm()) / nr, (float(d.abs().max()) / (mr or 1.0)) if d.numel() else 0.0


def _group(vocab: int, p: int, lens: list[int], seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (p,), generator=g)
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    adv = torch.tensor([1.3, -0.7, 0.4, -1.6, 0.9, -0.2][: len(lens)], dtype=torch.float64)
    return prompt, responses, adv


def _grads(model) -> dict:
    return {n: p.grad.detach().double().cpu() for n, p in model.named_parameters() if p.grad is not None}


def _decode_check(model, dev, prompt, ref_model, chunk: int) -> dict:
    """Rollout decoding on ``dev`` (the token-by-token path, which the logits and gradients above do not take): two
    branches of DECODE_TOKENS tokens sampled from the shared prompt state; the log-probs the decoder reported
    against the float64 reference's (``ref_model`` on the CPU) for the same tokens. Max absolute difference
    (log-probs of a vocabulary of ~60 are about -4; a broken decoding step is off by O(1))."""
    import longstraw

    ro = longstraw.generate(model, prompt.to(dev), 2, longstraw.SamplingConfig(max_new_tokens=DECODE_TOKENS, seed=0),
                            prefill_chunk=chunk)
    ref = longstraw.score(ref_model, prompt, [r.cpu() for r in ro.responses], longstraw.GRPOConfig(prefill_chunk=chunk))
    err = max(float((a.double().cpu() - b.double()).abs().max()) for a, b in zip(ro.logprobs, ref))
    return {"max_abs": err, "tokens": sum(int(r.numel()) for r in ro.responses)}


MODES = ("exact", "detached")
# exact with the state gradient and the state's K/V in host memory (offload_state_grad, offload_state): held to
# exact's reference
DEVICE_MODES = MODES + ("exact_offload",)


def _logits_and_grads(model, dev, prompt, responses, adv, chunk, modes=MODES) -> dict:
    """Logits of the whole first sequence and the gradients of one group in each of ``modes``, on ``dev``
    (``exact_offload``: ``GRPOConfig(offload_state_grad=True, offload_state=True)``, on a GPU the sinks and the
    attention K/V in host memory; its ``exact_offload_host_bytes`` and ``exact_offload_state_host_bytes`` say how
    many bytes were)."""
    import torch

    import longstraw

    out = {}
    with torch.no_grad():
        ids = torch.cat([prompt, responses[0]])[None].to(dev)
        out["logits"] = model(ids).double().cpu()
    for mode in modes:
        for p in model.parameters():
            p.grad = None
        cfg = longstraw.GRPOConfig(prompt_grad=mode.split("_")[0], prefill_chunk=chunk, clip_ratio_c=None,
                                   offload_state_grad=mode == "exact_offload", offload_state=mode == "exact_offload")
        from longstraw.ops import host_memory

        floor = host_memory.REGISTER_MIN_BYTES
        host_memory.REGISTER_MIN_BYTES = 0  # a tiny model's state is page-locked too: the registered path checked
        try:
            st = longstraw.grpo_backward(model, prompt.to(dev), [r.to(dev) for r in responses], adv.to(dev), cfg)
        finally:
            host_memory.REGISTER_MIN_BYTES = floor
        out[mode] = _grads(model)
        out[f"{mode}_kernel"] = st.delta_rule_kernel
        out[f"{mode}_host_bytes"] = st.prompt_state_grad_host_bytes
        out[f"{mode}_state_host_bytes"] = st.prompt_state_host_bytes
    for p in model.parameters():
        p.grad = None
    return out


def section_a(args, dev, res: dict, deadline: float, say, flush) -> None:
    import torch

    import longstraw
    from longstraw.models.attention import Attention

    if dev.type == "cuda":  # the float32 check means IEEE float32: no TF32 in matmuls or cuDNN convolutions
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        res["tf32"] = "off"
    res["tolerances"] = TOLERANCES
    res["metric"] = ("norm: ||x - ref|| / ||ref|| (gradients: the worst parameter; all_params_norm: every gradient "
                     "as one vector); max: max|x - ref| / max|ref|")
    res["reference"] = "the same weights in float64 on the CPU (held to transformers by the test suite)"
    res["device"] = str(dev)
    entries = res.setdefault("entries", [])
    res["lora"] = LORA
    res["fla_backward"] = _fla_backward(dev, say)
    flush()
    for fam, lora in section_a_order():
        label = fam + (" + LoRA" if lora else "")
        if time.perf_counter() > deadline:
            entries.append({"family": label, "ok": False, "error": "section budget spent before this family"})
            continue
        try:
            cfg = family_config(fam)
            torch.manual_seed(0)
            ref_model = longstraw.build_model(cfg).double()
            with torch.no_grad():  # make the router bias matter (it is a buffer, zero at init)
                g = torch.Generator().manual_seed(1)
                for n, b in ref_model.named_buffers():
                    if n.endswith("e_score_correction_bias"):
                        b.copy_(torch.randn(b.shape, generator=g, dtype=b.dtype) * 0.3)
                # a router initialised to zero (Qwen3-Next / Qwen3.5 MoE, as transformers does) ties every expert,
                # and CPU and CUDA topk break ties differently: the first H200 run (2026-12-04) failed both such
                # families in float32 on that alone (logits 1.4e-3, router gradients O(1)); random routers choose
                for n, p in ref_model.named_parameters():
                    if n.endswith("mlp.gate.weight") and not p.any():
                        p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.3)
            if lora:
                longstraw.add_lora(ref_model, **LORA, seed=0)
                with torch.no_grad():  # PEFT's B = 0 leaves the model unchanged: draw B so the adapters act
                    for n, p in ref_model.named_parameters():
                        if ".lora_B." in n:
                            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * 0.2)
            prompt, responses, adv = _group(cfg["vocab_size"], args.a_prompt, [4, 7], seed=2)
            ref = _logits_and_grads(ref_model, torch.device("cpu"), prompt, responses, adv, args.a_chunk)
        except Exception as e:
            entries.append({"family": label, "stage": "float64 reference", **_error(e)})
            continue
        for dtype_name in ("float32", "bfloat16"):
            if args.smoke and dtype_name == "bfloat16" and fam not in SMOKE_BF16 and not lora:
                continue
            entry = {"family": label, "dtype": dtype_name}
            try:
                model = copy.deepcopy(ref_model).to(device=dev, dtype=getattr(torch, dtype_name))
                got = _logits_and_grads(model, dev, prompt, responses, adv, args.a_chunk, DEVICE_MODES)
                tol = TOLERANCES[dtype_name]
                entry["logits"] = dict(zip(("norm", "max"), _rel(got["logits"], ref["logits"])))
                ok = entry["logits"]["norm"] <= tol["logits"]
                for mode in DEVICE_MODES:
                    want = ref[mode.split("_")[0]]
                    missing = sorted(set(want) ^ set(got[mode]))
                    per = {n: _rel(got[mode][n], want[n]) for n in want if n in got[mode]}
                    worst = max(per, key=lambda n: per[n][0])
                    names = [n for n in want if n in got[mode]]
                    total = _rel(torch.cat([got[mode][n].flatten() for n in names]),
                                 torch.cat([want[n].flatten() for n in names]))[0]
                    entry[mode] = {"norm": per[worst][0], "all_params_norm": total,
                                   "max": max(v[1] for v in per.values()), "worst_param": worst, "params": len(per),
                                   "missing": missing}
                    held = per[worst][0] if dtype_name == "float32" else total
                    ok = ok and held <= tol["grads"] and not missing
                # on a GPU the offloaded run must really have held its state gradient in host memory, and the
                # attention K/V of the families that have them (MLA latents stay)
                entry["exact_offload"]["host_bytes"] = got["exact_offload_host_bytes"]
                entry["exact_offload"]["state_host_bytes"] = got["exact_offload_state_host_bytes"]
                kv = any(isinstance(layer.mixer, Attention) for layer in model.layers)
                ok = ok and (dev.type == "cpu" or (got["exact_offload_host_bytes"] > 0
                                                   and (got["exact_offload_state_host_bytes"] > 0) == kv))
                entry["decode"] = _decode_check(model, dev, prompt, ref_model, args.a_chunk)
                ok = ok and entry["decode"]["max_abs"] <= tol["decode"]
                entry["delta_rule_kernel"] = got["exact_kernel"]
                entry["ok"] = bool(ok)
                del model
            except Exception as e:
                entry.update(_error(e))
            entries.append(entry)
            flush()
            say(f"  a {label:23s} {dtype_name:8s} " + (
                f"logits {entry['logits']['norm']:.1e}, grads (all / worst param) exact "
                f"{entry['exact']['all_params_norm']:.1e} / {entry['exact']['norm']:.1e}, detached "
                f"{entry['detached']['all_params_norm']:.1e} / {entry['detached']['norm']:.1e}, exact offloaded "
                f"{entry['exact_offload']['all_params_norm']:.1e} / {entry['exact_offload']['norm']:.1e} "
                f"({entry['exact_offload']['host_bytes']:,} B gradient, "
                f"{entry['exact_offload']['state_host_bytes']:,} B K/V in host memory), decode "
                f"{entry['decode']['max_abs']:.1e} -> "
                f"{'pass' if entry['ok'] else 'FAIL'}" if "logits" in entry
                and "exact" in entry else f"error {entry.get('error')}"))
            if dev.type == "cuda":
                torch.cuda.empty_cache()
    res["deltanet_scan"] = scan = _scan_check(dev, args.smoke)
    say("  a deltanet_scan " + (", ".join(f"{k} out {v['out']:.1e} state {v['state']:.1e}"
                                           for k, v in scan.items() if isinstance(v, dict))
                                 or f"error {scan.get('error')}") + f" -> {'pass' if scan['ok'] else 'FAIL'}")
    res["ok"] = bool(entries) and all(e.get("ok") for e in entries) and scan["ok"]
    res["passed"] = sum(bool(e.get("ok")) for e in entries)
    res["total"] = len(entries)


# a: fla's backward checked at the engine's shapes (fla's heads after repetition, Dk, Dv), most wanted first:
# section a's tiny Kimi-Linear and hybrids (their entries' calls check the same shapes), Kimi-Linear-48B's layers,
# the ~1.1B hybrid of b, the scan check's widened calls (Dv + Dk). Each new shape compiles and autotunes fla's
# kernels once (Triton specialises on the head sizes), so the part stops starting shapes after FLA_BUDGET_S
FLA_SHAPES = (("chunk_kda", (2, 32, 32)), ("chunk_gated_delta_rule", (4, 32, 32)), ("chunk_kda", (32, 128, 128)),
              ("chunk_gated_delta_rule", (32, 128, 128)), ("chunk_kda", (4, 128, 256)),
              ("chunk_gated_delta_rule", (4, 128, 256)))
FLA_BUDGET_S = 60.0


def _fla_backward(dev, say, require_cuda: bool = True, budget_s: float = FLA_BUDGET_S) -> dict:
    """fla's kernels, forward and backward, against the torch rule on the device in bfloat16
    (``ops.deltanet.fla_backward_errors``: the check the dispatcher runs once per shape before a pass that needs a
    gradient takes fla's backward, and takes the torch rule where it fails) at FLA_SHAPES, in order, until
    ``budget_s`` is spent: per (kernel, shape) the relative errors of the output, final state and every input
    gradient, pass at ``FLA_CHECK_TOL``, and the seconds (compiling and autotuning included). Facts for the record,
    not part of the section's pass (the dispatcher routes around a failure); fla's Hopper guard refusing the
    per-head backward is reported as its error. Added 2026-12-07, not yet run on a GPU."""
    import torch

    from longstraw.ops import deltanet as dn

    try:
        if require_cuda and (dev.type != "cuda" or not dn.fla_available()):
            return {"skipped": "needs CUDA and fla"}
        tol = dn.FLA_CHECK_TOL[torch.bfloat16]
        out: dict = {"tolerance": tol, "tokens": dn.FLA_CHECK_TOKENS, "guard": dn.fla_backward_refusal()}
    except Exception as e:
        return _error(e)
    end = time.perf_counter() + budget_s
    for kernel, (heads, dk, dv) in FLA_SHAPES:
        key = f"{kernel} {heads}x{dk}x{dv}"
        if time.perf_counter() > end:
            out[key] = {"skipped": f"the part's {budget_s:.0f} s were spent"}
            say(f"  a fla backward {key}: skipped for time")
            continue
        try:
            t0 = time.perf_counter()
            errs = dn.fla_backward_errors(dev, torch.bfloat16, kernel == "chunk_kda", heads, dk, dv)
            out[key] = {"errors": errs, "ok": max(errs.values()) <= tol, "seconds": time.perf_counter() - t0}
            worst = max(errs, key=errs.get)
            say(f"  a fla backward {key}: worst {errs[worst]:.1e} ({worst}), {out[key]['seconds']:.1f} s -> "
                + ("pass" if out[key]["ok"] else "FAIL (the dispatcher takes the torch rule there)"))
        except Exception as e:
            out[key] = _error(e)
            say(f"  a fla backward {key}: error {out[key]['error']}")
    return out


def _scan_check(dev, smoke: bool) -> dict:
    """The DeltaNet CP scan's rule call on the device: a one-rank group's scan prefix against the plain prefix (see
    the module docstring, section a); per dtype and pass ("prefill": no graph, "grad": with one) the relative errors
    of the output and the final state."""
    import torch

    from longstraw.distributed.cp_recurrent import rehearsal_prefix
    from longstraw.models.deltanet import GatedDeltaNet, RecurrentPrefix
    from longstraw.models.kda import KimiDeltaAttention

    out: dict = {}
    try:
        d, t = (16, 24) if smoke else (128, 256)
        # Gated DeltaNet (a decay per head) and, added 2026-12-06, Kimi Delta Attention (per key channel: chunk_kda)
        for kind, make in (("", lambda: GatedDeltaNet(4 * d, 2, 4, d, d)),
                           ("kda ", lambda: KimiDeltaAttention(4 * d, 4, d))):
            for dtype_name in ("float32", "bfloat16"):
                dt = getattr(torch, dtype_name)
                torch.manual_seed(0)
                m = make()
                a_log = m.forget_gate.A_log if kind else m.A_log
                with torch.no_grad():  # slow decays (A in [0.01, 0.2], not up to 16): the initial state matters
                    a_log.copy_(torch.empty_like(a_log).uniform_(0.01, 0.2).log())
                m = m.to(device=dev, dtype=dt)
                x = torch.randn(1, t, 4 * d, device=dev, dtype=dt)
                plain = RecurrentPrefix(torch.randn(1, m.conv_dim, 3, device=dev, dtype=dt),
                                        torch.randn(1, 4, d, d, device=dev) * 0.1)
                for name, grad in (("prefill", False), ("grad", True)):
                    with torch.set_grad_enabled(grad):
                        xi = x.detach().requires_grad_(grad)
                        y0, (_, s0) = m(xi, None, plain)
                        y1, (_, s1) = m(xi, None, rehearsal_prefix(plain, 1, t))
                    err = {"out": _rel(y1.detach().float(), y0.detach().float())[0],
                           "state": _rel(s1.detach().float(), s0.detach().float())[0]}
                    out[f"{kind}{dtype_name} {name}"] = {**err, "ok": max(err.values()) <= SCAN_TOL[dtype_name]}
        out["ok"] = all(v["ok"] for v in out.values())
    except Exception as e:
        out.update(_error(e))
        out["ok"] = False
    return out


# ---------------------------------------------------------------------------------------------------- b


def hybrid_config(smoke: bool, max_len: int) -> dict:
    from longstraw.models.qwen_hybrid import tiny_config

    if smoke:
        return tiny_config(max_position_embeddings=max_len + 4096)
    return tiny_config(
        vocab_size=32768, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, full_attention_interval=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=max_len + 4096,
    )


def prefill_flops(model, cfg: dict, p: int) -> float:
    """Matmul FLOPs of a prefill of ``p`` tokens (see the module docstring for what is counted)."""
    import torch

    head = getattr(model, "lm_head", None)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    n_attn = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    attn = n_attn * 4 * cfg["num_attention_heads"] * cfg["head_dim"] * p * p / 2
    return 2.0 * linear * p + attn


@contextlib.contextmanager
def _hf_delta_rule(model, dev):
    """Where fla's gated backward refuses this GPU (``ops.deltanet.fla_backward_refusal``), transformers' model would
    raise in its backward too (it calls fla whenever fla imports): for the naive baseline, its modeling module's
    chunked delta rule is swapped for the pure torch function under it (``inspect.unwrap``) while the step runs.
    Yields what the baseline ran ("" when nothing was swapped: not a transformers hybrid, or fla's backward runs)."""
    import inspect

    from longstraw.ops.deltanet import fla_available, fla_backward_refusal

    module = sys.modules.get(type(model).__module__)
    fn = getattr(module, "torch_chunk_gated_delta_rule", None)
    if fn is None or dev.type != "cuda" or not fla_available() or fla_backward_refusal() is None:
        yield ""
        return
    module.torch_chunk_gated_delta_rule = inspect.unwrap(fn)
    try:
        yield f"transformers' torch chunked rule ({fla_backward_refusal()})"
    finally:
        module.torch_chunk_gated_delta_rule = fn


def _plan_step(hf_config: dict, mode: str, prompt_len: int, response_len: int, group: int, chunk: int,
               dtype_name: str, checkpoint_layers: bool = False, gpu_mem: int | None = None,
               offload: bool = False, state_offload: bool = False) -> int:
    """The planner's peak for one measured step, as section b measures it: above the weights (no optimiser), the
    model held in ``dtype_name`` alone (no float32 masters: ``master_dtype`` = the compute dtype). With ``gpu_mem``:
    the longest prompt that fits it instead. ``offload``: the state gradient in host memory (the device's peak);
    ``state_offload``: the state's K/V too (offload_state: the larger of the backward phases' peak and the
    prefill's, since the measured step runs no rollout).
    Runs in a worker process (meta device, CPU only)."""
    import longstraw
    from longstraw.planner import plan

    cfg = longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=chunk, checkpoint_layers=checkpoint_layers,
                               offload_state_grad=offload, offload_state=state_offload)
    pl = plan(hf_config, prompt_len=prompt_len, response_len=response_len, group=group, dtype=dtype_name,
              master_dtype=dtype_name, cfg=cfg, gpu_mem=gpu_mem)
    if gpu_mem is not None:
        return pl.max_prompt_len
    peak = pl.peak_bytes
    if "phase_peaks" in pl.settings:  # the measured step is grpo_backward's: a prefill, no rollout
        pk, ft = pl.settings["phase_peaks"], pl.settings["forward_terms"]
        prefill = pk["forward"] - max(ft.values()) + ft["prefill_chunk"]
        peak = max(pk["backward"], prefill)
    return peak - pl.breakdown["weights"] - pl.breakdown["optimizer"]


def _plan_worker_init() -> None:
    import torch

    torch.set_num_threads(1)  # the measuring process keeps the CPU it needs


class _Plans:
    """The planner's predictions beside the measured steps, computed in worker processes on the CPU (its dry run
    needs no GPU) while the GPU measures, so that they cost no device time; collected at the end of section b.
    Workers still planning then are terminated (a plan left running must not keep the device's run alive)."""

    def __init__(self, workers: int):
        import multiprocessing

        self.pool = None
        if workers > 0:
            self.pool = multiprocessing.get_context("spawn").Pool(workers, initializer=_plan_worker_init)
        self.jobs: list = []

    def submit(self, rec: dict, key: str, **kw) -> None:
        if self.pool is not None:
            self.jobs.append((rec, key, self.pool.apply_async(_plan_step, kwds=kw)))

    def collect(self, deadline: float) -> None:
        """Write each prediction into its record under ``key`` (or ``key + "_error"``) until ``deadline``."""
        import multiprocessing

        for rec, key, job in self.jobs:
            try:
                rec[key] = job.get(timeout=max(0.0, deadline - time.perf_counter()))
            except multiprocessing.TimeoutError:
                rec[f"{key}_error"] = "not done within the section budget"
            except Exception as e:  # the planner failing must not lose the measurement
                rec[f"{key}_error"] = repr(e)[:300]
        self.jobs = []

    def close(self) -> None:
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()


def section_b(args, dev, res: dict, deadline: float, say, flush) -> None:
    plans = _Plans(min(4, max(1, (os.cpu_count() or 2) - 2)) if args.planner else 0)
    try:
        _section_b(args, dev, res, deadline, say, flush, plans)
    finally:
        plans.close()


def _section_b(args, dev, res: dict, deadline: float, say, flush, plans: _Plans) -> None:
    import gc

    import torch

    import longstraw
    from longstraw.engine.prefill import prefill
    from longstraw.profiling import PhaseMeter, measure_step

    smoke = args.smoke
    prefill_len = args.prefill_len or (1024 if smoke else 131072)
    step_len = args.step_len or (512 if smoke else 65536)
    compare_len = args.compare_len or (256 if smoke else 8192)
    max_len = args.max_len or (1024 if smoke else 4194304)
    chunk = args.chunk or (256 if smoke else 8192)
    rlen = args.response_len or (32 if smoke else 256)
    groups = [int(g) for g in args.groups.split(",")]
    gmax = max(groups)
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    dtype_name = str(dtype).removeprefix("torch.")
    peak_tflops = args.peak_tflops
    if peak_tflops is None and dev.type == "cuda":
        name = torch.cuda.get_device_name(dev)
        peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)

    cfg = hybrid_config(smoke, max(max_len, prefill_len, step_len) + rlen)
    torch.manual_seed(0)
    with torch.device(dev):
        model = longstraw.build_model(cfg)
    model.to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0, 0.02)
    n_params = sum(q.numel() for q in model.parameters())
    res["model"] = {"parameters": n_params, "dtype": dtype_name, "peak_tflops": peak_tflops,
                    "config": {k: cfg[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads",
                                                   "num_key_value_heads", "head_dim", "linear_num_key_heads",
                                                   "linear_num_value_heads", "intermediate_size", "vocab_size")}}
    say(f"  b model: {n_params / 1e9:.3f}B parameters, {dtype_name}")
    gen = torch.Generator().manual_seed(1)
    params = [q for q in model.parameters() if q.requires_grad]

    def ids(n):
        return torch.randint(0, cfg["vocab_size"], (n,), generator=gen).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def free():
        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    def part(name, fn):
        """Run one part of the section; its failure is recorded and the next part runs."""
        t0 = time.perf_counter()
        try:
            fn()
            res.setdefault(name, {})["ok"] = res.get(name, {}).get("ok", True)
        except Exception as e:
            res.setdefault(name, {}).update(_error(e))
            say(f"  b {name}: {res[name]['error']}")
        res[name]["seconds_spent"] = time.perf_counter() - t0
        for q in params:
            q.grad = None
        free()
        flush()

    oom = getattr(torch, "OutOfMemoryError", RuntimeError)

    # ---- prefill throughput, and the state the rollout decodes from
    shared = {}

    def do_prefill():
        prompt = ids(prefill_len)
        with torch.no_grad():
            prefill(model, prompt[: min(prefill_len, 2 * chunk)], chunk)  # warm-up: kernels, autotuning
            sync()
            t0 = time.perf_counter()
            state = prefill(model, prompt, chunk)
            sync()
            secs = time.perf_counter() - t0
        flops = prefill_flops(model, cfg, prefill_len)
        res["prefill"] = {"prompt_len": prefill_len, "chunk": chunk, "seconds": secs,
                          "tokens_per_s": prefill_len / secs, "flops": flops, "tflops_per_s": flops / secs / 1e12,
                          "mfu": flops / secs / (peak_tflops * 1e12) if peak_tflops else None,
                          "state_bytes": state.nbytes()}
        shared["prompt"], shared["state"] = prompt, state
        mfu = f", MFU {res['prefill']['mfu']:.1%}" if res["prefill"]["mfu"] is not None else ""
        say(f"  b prefill {prefill_len:,} tokens in {secs:.2f} s: {prefill_len / secs:,.0f} tokens/s{mfu}")

    # ---- rollout decoding from the shared state
    def do_rollout():
        if "state" not in shared:
            raise RuntimeError("no prompt state: the prefill part failed")
        prompt = torch.cat([shared["prompt"], ids(1)])  # the state is that of prompt[:-1]
        sampling = longstraw.SamplingConfig(temperature=1.0, max_new_tokens=rlen, seed=0)
        warm = longstraw.SamplingConfig(temperature=1.0, max_new_tokens=4, seed=0)
        longstraw.generate(model, prompt, gmax, warm, prompt_state=shared["state"], prefill_chunk=chunk)
        meter = PhaseMeter(dev)
        sync()
        t0 = time.perf_counter()
        ro = longstraw.generate(model, prompt, gmax, sampling, prompt_state=shared["state"], prefill_chunk=chunk,
                                meter=meter)
        sync()
        wall = time.perf_counter() - t0
        n_tok = sum(int(r.numel()) for r in ro.responses)
        dec = meter.seconds.get("decode", wall)
        res["rollout"] = {"prompt_len": int(prompt.numel()), "G": gmax, "max_new_tokens": rlen, "tokens": n_tok,
                          "decode_seconds": dec, "decode_tokens_per_s": n_tok / dec,
                          "steps_per_s": (n_tok / gmax) / dec, "wall_seconds": wall}
        shared.clear()
        say(f"  b rollout G={gmax} from P={prefill_len:,}: {n_tok} tokens in {dec:.2f} s decoding: "
            f"{n_tok / dec:,.0f} tokens/s")

    # ---- GRPO steps
    def step(mode, p, g, ckpt=False, offload=False, state_offload=False) -> dict:
        gcfg = longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=chunk, clip_ratio_c=None, checkpoint_layers=ckpt,
                                    offload_state_grad=offload, offload_state=state_offload)
        prompt, responses = ids(p), [ids(rlen) for _ in range(g)]
        adv = torch.randn(g, generator=gen)
        box = {}

        def run():
            box["stats"] = longstraw.grpo_backward(model, prompt, responses, adv, gcfg)

        rec = {"mode": mode, "prompt_len": p, "G": g, "response_len": rlen, "checkpoint_layers": ckpt,
               "offload_state_grad": offload, "offload_state": state_offload}
        try:
            peak, secs = measure_step(run, params, dev)
        except oom as e:
            rec.update(error=f"out of memory: {str(e).splitlines()[0][:200]}", oom=True)
        except Exception as e:  # recorded; the next configuration still runs
            rec.update(_error(e))
        else:
            st = box["stats"]
            rec.update(peak_bytes=peak, seconds=secs, phase_seconds=st.seconds,
                       replay_tokens_per_s=g * rlen / st.seconds["replay"] if st.seconds.get("replay") else None,
                       prompt_state_bytes=st.prompt_state_bytes, prompt_state_grad_bytes=st.prompt_state_grad_bytes,
                       prompt_state_grad_host_bytes=st.prompt_state_grad_host_bytes,
                       prompt_state_host_bytes=st.prompt_state_host_bytes, delta_rule_kernel=st.delta_rule_kernel,
                       finite=all(bool(torch.isfinite(q.grad).all()) for q in params if q.grad is not None))
            plans.submit(rec, "planned_bytes", hf_config=cfg, mode=mode, prompt_len=p, response_len=rlen, group=g,
                         chunk=chunk, dtype_name=dtype_name, checkpoint_layers=ckpt, offload=offload,
                         state_offload=state_offload)
        for q in params:
            q.grad = None
        box.clear()
        free()
        tag = f"{mode}{'+ckpt' if ckpt else ''}{'+offload' if offload else ''}{'+kv' if state_offload else ''}"
        if "peak_bytes" in rec:
            say(f"  b {tag:13s} P={p:>9,} G={g}: peak {rec['peak_bytes'] / 2**30:7.2f} GiB, "
                f"{rec['seconds']:7.2f} s, "
                f"replay {rec['replay_tokens_per_s'] or 0:,.0f} tokens/s "
                f"{ {k: round(v, 2) for k, v in rec['phase_seconds'].items()} }")
        else:
            say(f"  b {tag:13s} P={p:>9,} G={g}: {rec['error']}")
        return rec

    def do_steps():
        runs = res.setdefault("steps", {}).setdefault("runs", [])
        for mode in ("detached", "exact"):  # warm-up: no one-time costs in the first measured step
            step(mode, min(step_len, 2 * chunk), min(groups))
        for mode in ("detached", "exact"):
            for g in groups:
                runs.append(step(mode, step_len, g))
                flush()
        # exact with checkpointed layers: one layer's graph at a time in replay and the reverse pass
        runs.append(step("exact", step_len, gmax, ckpt=True))
        flush()
        # exact with the state gradient in host memory: the device peak it saves, the time its copies cost
        runs.append(step("exact", step_len, gmax, offload=True))
        flush()
        # ... and the state's K/V too (offload_state): the device peak of the backward phases and the time the
        # per-block host-to-device copies cost, exact and detached
        runs.append(step("exact", step_len, gmax, offload=True, state_offload=True))
        flush()
        runs.append(step("detached", step_len, gmax, state_offload=True))
        flush()
        for mode in ("detached", "exact"):
            same = [r for r in runs if r["mode"] == mode and not r["checkpoint_layers"]
                    and not r["offload_state_grad"] and not r["offload_state"]]
            a = next((r.get("peak_bytes") for r in same if r["G"] == min(groups)), None)
            b = next((r.get("peak_bytes") for r in same if r["G"] == gmax), None)
            if a and b:
                res["steps"][f"{mode}_peak_ratio_G{gmax}_over_G{min(groups)}"] = b / a
                say(f"  b {mode}: peak G={gmax} / G={min(groups)} at P={step_len:,}: {b / a:.3f}")

    # ---- naive HF and LongStraw at one prompt (grpo_step.measure_method)
    def do_compare():
        import grpo_step

        prompt, responses = ids(compare_len).cpu(), [ids(rlen).cpu() for _ in range(gmax)]
        adv = torch.randn(gmax, generator=gen)
        rows = res.setdefault("compare", {}).setdefault("methods", {})
        res["compare"].update(prompt_len=compare_len, G=gmax, response_len=rlen)
        for method in ("detached", "exact", "prefix", "naive"):
            if time.perf_counter() > deadline - 30:
                rows[method] = {"skipped": "section budget"}
                continue
            bargs = SimpleNamespace(prompt_len=compare_len, worker_method=method, chunk=chunk)
            target = model
            try:
                if method == "naive":
                    from transformers import AutoModelForCausalLM

                    with tempfile.TemporaryDirectory(prefix="gpu-check-hf-") as d:
                        longstraw.save_model(model, d)
                        target = AutoModelForCausalLM.from_pretrained(d, dtype=dtype).to(dev)
                    target.config._attn_implementation = "sdpa"
                    target.train()
                with _hf_delta_rule(target, dev) as hf_rule:
                    peak, first, secs, _ = grpo_step.measure_method(grpo_step._step_fn, target, bargs, prompt,
                                                                    responses, adv, dev)
                rows[method] = {"peak_bytes": int(peak), "seconds": secs, "first_step_seconds": first}
                if method == "naive" and hf_rule:
                    rows[method]["delta_rule"] = hf_rule
                say(f"  b compare {method:8s} P={compare_len:,} G={gmax}: peak {peak / 2**30:.2f} GiB, {secs:.2f} s")
            except oom as e:
                rows[method] = {"error": f"out of memory: {str(e).splitlines()[0][:200]}"}
            except Exception as e:
                rows[method] = _error(e)
                say(f"  b compare {method}: {rows[method]['error']}")
            finally:
                if target is not model:
                    for q in target.parameters():
                        q.grad = None
                    del target
                for q in params:
                    q.grad = None
                free()
            flush()
        ls = rows.get("detached", {})
        for method in ("naive", "prefix", "exact"):
            r = rows.get(method, {})
            if r.get("peak_bytes") and ls.get("peak_bytes"):
                res["compare"][f"{method}_over_detached_peak"] = r["peak_bytes"] / ls["peak_bytes"]
                res["compare"][f"{method}_over_detached_seconds"] = r["seconds"] / ls["seconds"]

    # ---- longest prompt per mode in --longest-s each
    def do_longest():
        runs = res.get("steps", {}).get("runs", [])
        for mode in ("detached", "exact"):
            mode_end = min(deadline, time.perf_counter() + args.longest_s)
            prev = next((r for r in runs if r["mode"] == mode and r["G"] == gmax), None)
            if prev is None:
                prev = step(mode, step_len, gmax)
            tried, stop, p = [prev], None, prev["prompt_len"]
            while stop is None:
                if "error" in prev:
                    stop = "memory" if prev.get("oom") else f"error: {prev['error'][:200]}"
                elif 2 * p > max_len:
                    stop = f"--max-len {max_len}"
                elif time.perf_counter() + 4 * prev["seconds"] > mode_end:  # attention: ~4x per doubling
                    stop = f"time ({args.longest_s:.0f} s per mode, or the section budget)"
                else:
                    p *= 2
                    prev = step(mode, p, gmax)
                    tried.append(prev)
                    flush()
            ok = [r for r in tried if "peak_bytes" in r]
            res.setdefault("longest", {})[mode] = {"G": gmax, "measured_max": max((r["prompt_len"] for r in ok),
                                                                                   default=0),
                                                   "stopped_by": stop, "runs": tried[1:]}
            if dev.type == "cuda":
                plans.submit(res["longest"][mode], "planner_max_for_device", hf_config=cfg, mode=mode,
                             prompt_len=step_len, response_len=rlen, group=gmax, chunk=chunk, dtype_name=dtype_name,
                             gpu_mem=torch.cuda.get_device_properties(dev).total_memory)
            say(f"  b longest {mode}: {res['longest'][mode]['measured_max']:,} tokens (stopped by {stop})")

    def do_planner():
        """The planner's predictions (computed beside the measurements) against the measured peaks."""
        if plans.pool is None:
            return
        plans.collect(min(deadline, time.perf_counter() + PLAN_WAIT_S))
        rows = res.get("steps", {}).get("runs", []) + [r for m in ("detached", "exact")
                                                       for r in res.get("longest", {}).get(m, {}).get("runs", [])]
        both = [r for r in rows if r.get("planned_bytes") and r.get("peak_bytes")]
        for r in both:
            say(f"  b planned {r['mode']}{'+ckpt' if r['checkpoint_layers'] else ''} P={r['prompt_len']:,} "
                f"G={r['G']}: {r['planned_bytes'] / 2**30:.2f} GiB, measured {r['peak_bytes'] / 2**30:.2f} GiB "
                f"({r['planned_bytes'] / r['peak_bytes']:.3f}x)")
        ratios = [r["planned_bytes"] / r["peak_bytes"] for r in both]
        res["planner"] = {"steps": len(both), "missing": len(rows) - len(both),
                          "ratio_min": min(ratios, default=None), "ratio_max": max(ratios, default=None)}
        if both:
            say(f"  b planner / measured over {len(both)} steps: {min(ratios):.3f}x to {max(ratios):.3f}x")

    def do_rule_blocks():
        """The torch chunked delta rule (what passes that need a gradient run where fla's backward is refused) at
        one prefill chunk of this model's DeltaNet shape, forward + backward, for several ``block_tokens``: on a GPU
        its time is kernel launches more than arithmetic (the default block is sized for the CPU's memory); and at
        the default block with plain autograd (``recompute=False``) beside the default recomputing backward."""
        from longstraw.ops.deltanet import chunk_gated_delta_rule

        hv, hk, dk, dv = (cfg[k] for k in ("linear_num_value_heads", "linear_num_key_heads", "linear_key_head_dim",
                                            "linear_value_head_dim"))
        t = chunk
        g2 = torch.Generator(device=dev).manual_seed(5)

        def rand(*shape):
            return torch.randn(*shape, device=dev, dtype=dtype, generator=g2)

        rows = res.setdefault("rule_blocks", {}).setdefault("runs", [])
        for blk, recompute in ((None, False), (None, True), (1024, True), (4096, True)):
            xs = [rand(1, t, hk, dk), rand(1, t, hk, dk), rand(1, t, hv, dv),  # q, k, v
                  -torch.rand(1, t, hv, device=dev, generator=g2) * 0.1,  # g (log decay)
                  torch.rand(1, t, hv, device=dev, dtype=dtype, generator=g2),  # beta
                  torch.zeros(1, hv, dk, dv, device=dev)]  # initial state
            for x in xs:
                x.requires_grad_(True)

            def once(xs=xs, blk=blk, recompute=recompute):
                o, s1 = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], block_tokens=blk, recompute=recompute)
                (o.float().square().mean() + s1.square().mean()).backward()

            once()  # warm-up
            sync()
            if dev.type == "cuda":
                torch.cuda.reset_peak_memory_stats(dev)
            base = torch.cuda.memory_allocated(dev) if dev.type == "cuda" else 0
            t0 = time.perf_counter()
            once()
            sync()
            secs = time.perf_counter() - t0
            peak = torch.cuda.max_memory_allocated(dev) - base if dev.type == "cuda" else None
            rows.append({"tokens": t, "block_tokens": blk, "recompute": recompute, "seconds": secs,
                         "peak_bytes": peak})
            say(f"  b torch delta rule, {t:,} tokens x {hv} heads fwd+bwd, block_tokens={blk}, "
                f"{'recomputing backward' if recompute else 'plain autograd'}: {secs:.3f} s"
                + (f", peak {peak / 2**30:.2f} GiB" if peak is not None else ""))
            del xs, once
            free()

    def do_scan_cost():
        """One DeltaNet mixer of this model, forward and forward + backward over one prefill chunk, with the plain
        prefix and with the CP state scan's (``benchmarks/deltanet_cp_scan.py``: the widened rule, rehearsed as the
        last of 8 ranks): what the scan costs per layer on the device, and what it saves against the hand-off."""
        import deltanet_cp_scan

        out = deltanet_cp_scan.main([
            "--device", str(dev), "--dtype", str(dtype).removeprefix("torch."), "--hidden", str(cfg["hidden_size"]),
            "--key-heads", str(cfg["linear_num_key_heads"]), "--value-heads", str(cfg["linear_num_value_heads"]),
            "--head-dim", str(cfg["linear_key_head_dim"]), "--value-head-dim", str(cfg["linear_value_head_dim"]),
            "--piece", str(chunk), "--ranks", "8", "--repeats", "3"])
        res.setdefault("scan_cost", {}).update(
            {"piece": chunk, "ranks": 8, "times": out["times"],
             "saved_in_mixer_times": {str(r): v for r, v in out["saved"].items()}})
        t = out["times"]
        say("  b CP DeltaNet scan / plain mixer, one chunk: forward "
            f"{t['forward']['scan'] / t['forward']['plain']:.2f}x, forward+backward "
            f"{t['forward+backward']['scan'] / t['forward+backward']['plain']:.2f}x")

    part("prefill", do_prefill)
    part("rollout", do_rollout)
    part("steps", do_steps)
    part("rule_blocks", do_rule_blocks)
    part("scan_cost", do_scan_cost)
    part("compare", do_compare)
    part("longest", do_longest)
    part("planner", do_planner)
    res["ok"] = all(res[k].get("ok") for k in ("prefill", "rollout", "steps", "compare", "longest"))


# ---------------------------------------------------------------------------------------------------- c

# gpt_oss (added 2026-12-05, third session): the 37-token group reaches past its window of 11, so the sliding layers
# run their replicated tails and halo exchange (distributed/cp_window.py) and every layer's sinks merge after the
# group's LSE merge, over NCCL
C_FAMILIES = {"llama": _DENSE, "qwen3_5_text": {**_HYBRID, "intermediate_size": 48},
              "gpt_oss": FAMILY_CONFIGS["gpt_oss"]}


def _c_group(vocab: int):
    return _group(vocab, 37, [5, 7], seed=3)


def _c_run(model, dev, prompt, responses, adv) -> dict:
    import longstraw

    cfg = longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=4, clip_ratio_c=None)
    st = longstraw.grpo_backward(model, prompt.to(dev), [r.to(dev) for r in responses], adv.to(dev), cfg)
    grads = {n: g.detach().double().cpu() for n, g in longstraw.hf_grads(model).items()}
    return {"loss": float(st.loss), "grads": grads}


def _c_rank(rank: int, world: int, port: int, backend: str, jobs: list, out_dir: str) -> None:
    """One rank of section c (torch.multiprocessing.spawn): every job on this process group, results to a file."""
    import torch

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import longstraw
    from longstraw import distributed

    results = {}
    ctx = None
    try:
        ctx = longstraw.init_distributed(cp=world, fsdp=False, backend=backend, timeout_s=120)
        for job in jobs:
            key = f"{job['family']}/{job['dtype']}/{'fsdp' if job['fsdp'] else 'cp'}"
            try:
                model = longstraw.load_model(job["path"], dtype=job["dtype"], master_dtype=job["dtype"])
                if job["fsdp"]:
                    distributed.parallelize(model, ctx, fsdp=True)
                prompt, responses, adv = _c_group(job["vocab"])
                results[key] = _c_run(model, ctx.device, prompt, responses, adv)
                del model
            except Exception as e:
                results[key] = _error(e)
                break  # the other ranks may wait in a collective: stop here
    except Exception as e:
        results["init"] = _error(e)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    if ctx is not None:
        longstraw.shutdown_distributed()


def section_c(args, dev, res: dict, deadline: float, say) -> None:
    import socket

    import torch
    import torch.multiprocessing as mp

    import longstraw

    n_gpu = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if args.smoke and dev.type == "cpu":
        world, backend, run_dev = 2, "gloo", torch.device("cpu")
    elif n_gpu > 1:
        world, backend, run_dev = min(4, n_gpu), "nccl", torch.device("cuda", 0)
    else:
        res.update(ok=True, skipped=f"skipped: {n_gpu} GPU")
        say(f"  c {res['skipped']}")
        return
    res.update(world=world, backend=backend, tolerances={"float32": 1e-4, "bfloat16": 5e-2},
               metric="norm-relative error of every gathered gradient against one process on one device")
    dtypes = ["float32"] if args.smoke else ["float32", "bfloat16"]
    tmp = tempfile.mkdtemp(prefix="gpu-check-c-")
    jobs, refs = [], {}
    for fam, kw in C_FAMILIES.items():
        cfg = {"model_type": fam, **kw}
        torch.manual_seed(0)
        model = longstraw.build_model(cfg)
        path = os.path.join(tmp, fam)
        longstraw.save_model(model, path)
        for dt in dtypes:
            ref_model = longstraw.load_model(path, dtype=dt, device=run_dev)
            prompt, responses, adv = _c_group(cfg["vocab_size"])
            ref = _c_run(ref_model, run_dev, prompt, responses, adv)
            del ref_model
            for fsdp in (False, True):
                key = f"{fam}/{dt}/{'fsdp' if fsdp else 'cp'}"
                refs[key] = ref
                jobs.append({"family": fam, "dtype": dt, "fsdp": fsdp, "path": path, "vocab": cfg["vocab_size"]})
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.start_processes(_c_rank, args=(world, port, backend, jobs, tmp), nprocs=world, join=False,
                             start_method="spawn")
    while not ctx.join(timeout=5):
        if time.perf_counter() > deadline:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
            raise TimeoutError(f"the {world} ranks did not finish within the section budget")
    got = torch.load(os.path.join(tmp, "rank0.pt"), weights_only=False)
    if "init" in got:
        res.update(got["init"])
        return
    entries = res.setdefault("entries", [])
    for key, ref in refs.items():
        r = got.get(key)
        entry = {"case": key}
        if r is None or "grads" not in r:
            entry.update(r or {"ok": False, "error": "not run (an earlier case failed on the ranks)"})
        else:
            per = {n: _rel(r["grads"][n], g)[0] for n, g in ref["grads"].items() if n in r["grads"]}
            worst = max(per, key=per.get)
            missing = sorted(set(ref["grads"]) ^ set(r["grads"]))
            tol = res["tolerances"][key.split("/")[1]]
            entry.update(grads_norm=per[worst], worst_param=worst, loss_rel=abs(r["loss"] - ref["loss"]) /
                         (abs(ref["loss"]) or 1.0), missing=missing, ok=per[worst] <= tol and not missing)
        entries.append(entry)
        say(f"  c {key:28s} " + (f"grads {entry['grads_norm']:.1e} -> {'pass' if entry['ok'] else 'FAIL'}"
                                 if "grads_norm" in entry else f"error {entry.get('error')}"))
    res["ok"] = all(e.get("ok") for e in entries)


# ---------------------------------------------------------------------------------------------------- main


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--smoke", action="store_true", help="every section at tiny size (on the CPU: c on 2 gloo ranks)")
    ap.add_argument("--sections", default="a,d,b,c", help="in this order; b takes what the others leave")
    ap.add_argument("--budget-s", type=float, default=None, help="the whole run: default 480 s (smoke: 1800 s, so "
                    "that a loaded CPU never cuts a section short and the suite's smoke test never depends on time)")
    ap.add_argument("--a-s", type=float, default=None, help="budget of section a: default 150 s, first calls compile "
                    "kernels (smoke: 900 s)")
    ap.add_argument("--c-s", type=float, default=None, help="budget of section c, b gets the rest: default 90 s "
                    "(smoke: 600 s)")
    ap.add_argument("--d-s", type=float, default=None, help="budget of section d (the trainer): default 60 s "
                    "(smoke: 600 s)")
    ap.add_argument("--d-prompt", type=int, default=None, help="section d's prompt tokens: default 4096 (smoke 256)")
    ap.add_argument("--a-prompt", type=int, default=28, help="tokens (past mistral's test window of 11)")
    ap.add_argument("--a-chunk", type=int, default=16)
    ap.add_argument("--prefill-len", type=int, default=None, help="default 131072 (smoke 1024)")
    ap.add_argument("--step-len", type=int, default=None, help="default 65536 (smoke 512)")
    ap.add_argument("--compare-len", type=int, default=None, help="naive HF vs LongStraw: default 8192 (smoke 256)")
    ap.add_argument("--max-len", type=int, default=None, help="default 4194304 (smoke 1024)")
    ap.add_argument("--longest-s", type=float, default=None, help="time per mode for the longest prompt: default "
                    "120 s (smoke 20 s)")
    ap.add_argument("--groups", default="2,8")
    ap.add_argument("--response-len", type=int, default=None, help="default 256 (smoke 32)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk; default 8192 (smoke 256)")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--planner", action=argparse.BooleanOptionalAction, default=True,
                    help="b: the memory planner's prediction beside each measured step, computed in worker "
                    "processes on the CPU while the GPU measures (default on; it models the torch delta rule, an "
                    "not fla's kernels)")
    ap.add_argument("--json", default="gpu_check.json")
    args = ap.parse_args(argv)
    for name, full, smoke in (("longest_s", 120.0, 20.0), ("budget_s", 480.0, 1800.0), ("a_s", 150.0, 900.0),
                              ("c_s", 90.0, 600.0), ("d_s", 60.0, 600.0)):
        if getattr(args, name) is None:
            setattr(args, name, smoke if args.smoke else full)
    t_start = time.perf_counter()

    import torch

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    out: dict = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "smoke": args.smoke,
                 "sections": {}}

    def say(msg: str) -> None:
        print(msg, flush=True)

    def flush() -> None:
        out["wall_s"] = time.perf_counter() - t_start
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(out, f, indent=2, default=str)
        os.replace(tmp, args.json)

    try:
        name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
        info = {"name": name, "torch": torch.__version__, "cuda": torch.version.cuda,
                "gpus": torch.cuda.device_count() if torch.cuda.is_available() else 0,
                "total_memory": torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None}
        if dev.type == "cuda":
            from longstraw.ops.deltanet import delta_rule_kernel

            try:
                import fla

                info["fla"] = getattr(fla, "__version__", "importable")
            except Exception as e:
                info["fla"] = f"not importable ({type(e).__name__}: {str(e)[:200]})"
            info["delta_rule_kernel_bf16"] = delta_rule_kernel(dev, torch.bfloat16)
        out["device"] = info
    except Exception as e:
        out["device"] = _error(e)
    say(f"gpu_check: {out['command']}\ndevice: {out['device']}")
    flush()

    wanted = [s.strip() for s in args.sections.split(",") if s.strip()]
    end = t_start + args.budget_s
    multi = (torch.cuda.is_available() and torch.cuda.device_count() > 1) or (args.smoke and dev.type == "cpu")
    for sec in wanted:
        res = out["sections"].setdefault(sec, {})
        now = time.perf_counter()
        if sec == "a":
            deadline = min(end, now + args.a_s)
        elif sec == "b":  # what is left, keeping the budgets of sections that run after it
            later = wanted[wanted.index("b"):]
            deadline = end - (args.c_s if "c" in later and multi else 0) - (args.d_s if "d" in later else 0)
        elif sec == "d":
            deadline = min(end, now + args.d_s)
        else:
            deadline = min(end, now + args.c_s)
        say(f"section {sec} (budget {max(0.0, deadline - now):.0f} s):")
        try:
            if sec == "a":
                section_a(args, dev, res, deadline, say, flush)
            elif sec == "b":
                section_b(args, dev, res, deadline, say, flush)
            elif sec == "c":
                section_c(args, dev, res, deadline, say)
            elif sec == "d":
                from gpu_trainer import section_d

                section_d(args, dev, res, deadline, say, flush)
            else:
                raise ValueError(f"unknown section {sec!r}; allowed: a, b, c, d")
        except Exception as e:
            res.update(_error(e))
            say(f"  section {sec} failed: {res['error']}")
        res["seconds"] = time.perf_counter() - now
        res.setdefault("ok", False)
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        flush()
    summary = {s: out["sections"][s].get("ok") for s in wanted}
    say(f"summary: {summary}, wall {time.perf_counter() - t_start:.0f} s, json {args.json}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    raise SystemExit(main())
