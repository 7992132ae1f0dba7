"""The engine's settings: :class:`GRPOConfig` (one GRPO backward), :class:`SamplingConfig` (rollouts), and
:class:`GRPOStats` (what one backward did). Frozen dataclasses validated on construction: a bad value raises a
``ValueError`` naming it and what is allowed, before anything is computed. The trainer's run config embeds these
classes (``longstraw.rl.config``), so each setting is defined, defaulted and checked here only.
"""

from __future__ import annotations

import contextlib
import math
import numbers
from dataclasses import dataclass, field, fields
from enum import Enum

import torch
from torch import Tensor

from longstraw.losses import KLType, LossAggMode, PolicyLoss, RatioLevel, parse_enum


class PromptGrad(str, Enum):
    EXACT = "exact"
    DETACHED = "detached"


COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GRPOConfig:
    """Settings of one GRPO backward (validated on construction; strings become enums).

    prompt_grad: ``"exact"`` (gradient through the prompt state) or ``"detached"``.
    loss_agg_mode, clip_ratio_low/high, clip_ratio_c (dual clip, None disables), kl_coef, kl_type, entropy_coef:
        the loss, as verl defines it (see :mod:`longstraw.losses`); ratio_level (``"token"`` or GSPO's
        ``"sequence"``) and kl_ratio_weight (the KL term times the ratio), as TRL offers them.
    loss_scale_factor: the divisor of ``seq-mean-token-sum-norm`` (default: the longest response of the group;
        set a constant, e.g. the max response length, to reproduce Dr. GRPO exactly).
    prefill_chunk: prompt tokens per prefill chunk (memory: one chunk's activations; exact mode: one chunk's graph).
    branch_batch: branches replayed together (right-padded); checkpoint_layers: recompute each layer in backward.
    logprob_chunk: tokens per chunk of the LM-head log-prob op; temperature: logits are divided by it.
    compute_dtype: None (the parameters' dtype) or ``"bfloat16"`` / ``"float16"`` autocast over float32
        parameters, which gives float32 gradient accumulation with low-precision compute.
    graph_budget_bytes: exact mode: bytes for prompt-step graphs kept from the prefill, so the reverse pass
        recomputes only the steps that did not fit (:mod:`longstraw.engine.kept_graphs`); None / 0: none kept.
    offload_state_grad: exact mode: the prompt state's gradient buffers in host memory (``ops/sinks.py``).
    offload_state: the prompt state's attention K/V in host memory for the backward phases, streamed through the
        device block by block, and exact mode's DeltaNet chunk-boundary states from the prefill on
        (``ops/host_memory.py``).
    """

    prompt_grad: PromptGrad = field(default=PromptGrad.EXACT, metadata={"help": (
        "exact: the gradient also flows back through the prompt state (a reverse pass over the prompt chunks, "
        "about three more prefills of compute); detached: the prompt state is a constant, as in the published "
        "system")})
    loss_agg_mode: LossAggMode = field(default=LossAggMode.TOKEN_MEAN, metadata={"help": (
        "how token losses are aggregated (verl's modes; seq-mean-token-sum-norm is Dr. GRPO's)")})
    clip_ratio_low: float = field(default=0.2, metadata={"help": (
        "PPO clip: the probability ratio is clipped below at 1 - clip_ratio_low (>= 0 and < 1)")})
    clip_ratio_high: float = field(default=0.2, metadata={"help": (
        "PPO clip: the probability ratio is clipped above at 1 + clip_ratio_high (>= 0)")})
    clip_ratio_c: float | None = field(default=3.0, metadata={"help": (
        "dual clip c (> 1): the loss of a negative-advantage token is at most -A * c; none disables the dual clip")})
    kl_coef: float = field(default=0.0, metadata={"help": (
        "weight of the KL penalty to a frozen reference model (the initial weights); > 0 keeps that copy and "
        "scores every response with it")})
    kl_type: KLType = field(default=KLType.LOW_VAR_KL, metadata={"help": (
        "the KL estimator, as verl's kl_penalty (k1: logp - ref; k2: (logp - ref)^2 / 2; low_var_kl: clamped k3; "
        "k3: e^(ref - logp) - (ref - logp) - 1 unclamped, TRL's)")})
    entropy_coef: float = field(default=0.0, metadata={"help": (
        "weight of the entropy bonus (subtracted from the loss; > 0 computes the entropy of every token)")})
    ratio_level: RatioLevel = field(default=RatioLevel.TOKEN, metadata={"help": (
        "the importance ratio of the PPO clip: token (per token) or sequence (GSPO: one ratio per response, exp of "
        "its mean log-ratio)")})
    kl_ratio_weight: bool = field(default=False, metadata={"help": (
        "multiply the KL term by the importance ratio (the unbiased reverse-KL gradient of DeepSeek-V3.2; TRL's "
        "use_bias_correction_kl)")})
    loss_scale_factor: float | None = field(default=None, metadata={"help": (
        "the divisor of seq-mean-token-sum-norm (used by that mode only); none: the longest response (the "
        "trainer's: of the step); a constant such as the max response length reproduces Dr. GRPO exactly")})
    prefill_chunk: int = field(default=4096, metadata={"help": (
        "prompt tokens per prefill chunk (memory: one chunk's activations; exact mode: one chunk's graph in the "
        "reverse pass)")})
    branch_batch: int = field(default=1, metadata={"help": (
        "response branches replayed together, right-padded (faster; holds that many branch graphs at once)")})
    checkpoint_layers: bool = field(default=False, metadata={"help": (
        "recompute each layer in backward: less activation memory (one layer's graph, not all), about one more "
        "forward of compute")})
    logprob_chunk: int = field(default=1024, metadata={"help": (
        "tokens per chunk of the LM head's float32 log-prob computation (bounds the tokens x vocab float32 logits"
        " held at once)")})
    temperature: float = field(default=1.0, metadata={"help": (
        "logits are divided by it before the log-probs (the sampling temperature; the trainer takes it from "
        "rollout.temperature)")})
    compute_dtype: str | None = field(default=None, metadata={"help": (
        "autocast compute dtype over float32 parameters, bfloat16 or float16 (float32 gradient accumulation, low-"
        "precision compute); none: the parameters' dtype (the trainer takes it from model.compute_dtype)")})
    graph_budget_bytes: int | None = field(default=None, metadata={"help": (
        "exact mode: bytes that may hold prompt-step graphs; the prefill keeps the graphs of the latest steps that "
        "fit (then the top layers of one more) and the reverse pass recomputes only the others; none or 0: keep "
        "none (every step recomputed). Applies when grpo_backward prefills itself (not to a handed-in "
        "prompt_state)")})
    offload_state_grad: bool = field(default=False, metadata={"help": (
        "exact mode: keep the prompt state's float32 gradient (attention K/V and MLA latents; twice the bf16 state) "
        "in host memory while the model runs on a GPU: each branch batch's backward adds the whole gradient there "
        "once and each reverse-pass step the gradient of the prefix before it (device-to-host copies); no effect "
        "on a CPU run")})
    offload_state: bool = field(default=False, metadata={"help": (
        "keep the prompt state's attention K/V in host memory for the replay and the reverse pass while the model "
        "runs on a GPU: it is moved there once the prefill and the rollouts are over, and every attention call "
        "copies one block of 32,768 positions of it to the device at a time (host-to-device copies of the whole "
        "K/V per branch pass and, in exact mode, of each reverse-pass step's prefix); exact mode's DeltaNet "
        "chunk-boundary states go there during the prefill, as it supersedes them (each read back once by the "
        "reverse pass); MLA latents stay on the device; no effect on a CPU run")})

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("prompt_grad", parse_enum(PromptGrad, self.prompt_grad, "prompt_grad"))
        b = self.graph_budget_bytes
        if b is not None and (not _is_int(b) or b < 0):
            raise ValueError(f"graph_budget_bytes={b!r} must be None or an integer number of bytes >= 0")
        set_("graph_budget_bytes", None if b is None else int(b))
        for name in ("checkpoint_layers", "offload_state_grad", "offload_state", "kl_ratio_weight"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name}={getattr(self, name)!r} must be true or false")
        if b and self.prompt_grad is not PromptGrad.EXACT:
            raise ValueError(f"graph_budget_bytes={b} keeps prompt-step graphs for the exact reverse pass; with "
                             "prompt_grad='detached' there is none: use graph_budget_bytes=None or 0")
        if self.offload_state_grad and self.prompt_grad is not PromptGrad.EXACT:
            raise ValueError("offload_state_grad=True moves the exact mode's state gradient to host memory; with "
                             "prompt_grad='detached' there is none: use offload_state_grad=False")
        if self.offload_state and b:
            raise ValueError(f"offload_state=True with graph_budget_bytes={b}: the kept prompt-step graphs hold the "
                             "state's K/V on the device, so moving it to host memory would free nothing; use one of "
                             "the two (graph_budget_bytes=None or 0 with offload_state)")
        set_("loss_agg_mode", parse_enum(LossAggMode, self.loss_agg_mode, "loss_agg_mode"))
        set_("kl_type", parse_enum(KLType, self.kl_type, "kl_type"))
        set_("ratio_level", parse_enum(RatioLevel, self.ratio_level, "ratio_level"))
        for name in ("prefill_chunk", "branch_batch", "logprob_chunk"):
            v = getattr(self, name)
            if not _is_int(v) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
            set_(name, int(v))
        for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not _is_finite(v) or v < 0:
                raise ValueError(f"{name}={v!r} must be a finite number >= 0")
        if self.clip_ratio_low >= 1:
            raise ValueError(f"clip_ratio_low={self.clip_ratio_low} must be < 1 (the ratio is clipped to 1 - it)")
        if self.clip_ratio_c is not None and not (_is_finite(self.clip_ratio_c) and self.clip_ratio_c > 1):
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c!r} must be a finite number > 1 (dual clip), or None to "
                             "disable it")
        if not (_is_finite(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number > 0")
        if self.loss_scale_factor is not None and not (_is_finite(self.loss_scale_factor)
                                                       and self.loss_scale_factor > 0):
            raise ValueError(f"loss_scale_factor={self.loss_scale_factor!r} must be a finite number > 0 or None")
        if self.compute_dtype is not None and self.compute_dtype not in COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not supported; allowed: None, "
                             f"{', '.join(map(repr, COMPUTE_DTYPES))}")

    @property
    def exact(self) -> bool:
        return self.prompt_grad is PromptGrad.EXACT

    def policy_loss(self) -> PolicyLoss:
        return PolicyLoss(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c, self.kl_coef, self.kl_type,
                          self.entropy_coef, self.ratio_level, self.kl_ratio_weight)

    def to_dict(self) -> dict:
        return {f.name: (v.value if isinstance(v := getattr(self, f.name), Enum) else v) for f in fields(self)}


@dataclass
class GRPOStats:
    """What one ``grpo_backward`` did: the loss it back-propagated, per-branch log-probs, time and memory."""

    loss: float
    logprobs: list[Tensor]
    entropy: list[Tensor] | None
    metrics: dict[str, float]
    num_tokens: int
    prompt_len: int
    seconds: dict[str, float] = field(default_factory=dict)
    peak_memory: dict[str, int] = field(default_factory=dict)
    prompt_state_bytes: int = 0
    prompt_state_grad_bytes: int = 0
    prompt_state_grad_host_bytes: int = 0  # ... of which in host memory (offload_state_grad on an accelerator)
    prompt_state_host_bytes: int = 0  # bytes of the state itself in host memory (offload_state on an accelerator)
    kept_graph_bytes: int = 0  # exact mode with graph_budget_bytes: bytes of the prompt-step graphs kept
    kept_steps: int = 0  # ... whole steps kept (not recomputed)
    kept_layers: int = 0  # ... top layers kept of one more step (0: none)
    step_graph_bytes: int = 0  # ... measured graph bytes of one whole prefill step (0: not measured)
    delta_rule_kernel: str = ""  # Gated DeltaNet layers: the kernels this call's forwards took ("fla", "torch",
    # "fla+torch": fla's backward refusing the GPU leaves the passes that need a gradient to torch); "" for none


@dataclass(frozen=True)
class SamplingConfig:
    """How to sample: temperature (0 = greedy), top_k (0 = off), top_p (1 = off), max_new_tokens, stops, seed."""

    temperature: float = field(default=1.0, metadata={"help": (
        "sampling temperature; 0 samples greedily (training rollouts need > 0)")})
    top_k: int = field(default=0, metadata={"help": "sample among the top_k most likely tokens only; 0 disables it"})
    top_p: float = field(default=1.0, metadata={"help": (
        "nucleus sampling: sample among the smallest set of most likely tokens whose probability reaches top_p, "
        "in (0, 1]; 1 disables it")})
    max_new_tokens: int = field(default=256, metadata={"help": (
        "the most tokens sampled per response (also capped by the model's max_position_embeddings)")})
    stop_token_ids: tuple[int, ...] = field(default=(), metadata={"help": (
        "token ids that end a response (the stop token is kept in it); the trainer sets the tokenizer's EOS when "
        "rollout.stop_at_eos is true")})
    stop_strings: tuple[str, ...] = field(default=(), metadata={"help": (
        "strings that end a response as soon as its decoded text contains one (the tokens that complete it are "
        "kept)")})
    seed: int | None = field(default=None, metadata={"help": (
        "seed of the sampling generator; none: torch's global generator (the trainer derives a seed per step and "
        "prompt from train.seed)")})

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        object.__setattr__(self, "stop_strings", tuple(self.stop_strings))
        if not (_is_finite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature={self.temperature!r} must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ValueError(f"top_k={self.top_k!r} must be an integer >= 0 (0 disables it)")
        if not (_is_finite(self.top_p) and 0 < self.top_p <= 1):
            raise ValueError(f"top_p={self.top_p!r} must be in (0, 1]")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 1")
        if self.seed is not None and not _is_int(self.seed):
            raise ValueError(f"seed={self.seed!r} must be an integer or None")
        for name in ("top_k", "max_new_tokens", "seed"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))
        if any(not s for s in self.stop_strings):
            raise ValueError("stop_strings must not contain an empty string")


def _is_int(v) -> bool:
    """An integer (Python's or numpy's), not a bool."""
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _is_finite(v) -> bool:
    """A finite real number (Python's or numpy's), not a bool or a string."""
    return isinstance(v, numbers.Real) and not isinstance(v, bool) and math.isfinite(v)


def autocast_context(cfg: GRPOConfig, device: torch.device):
    """Autocast to ``cfg.compute_dtype`` on ``device`` (a no-op context when it is None)."""
    if cfg.compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=COMPUTE_DTYPES[cfg.compute_dtype])
