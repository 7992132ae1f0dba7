"""The GRPO step on one group: prefill the shared prompt once, replay branches with autograd, optional exact pass.

``grpo_backward`` adds the gradient of the group's GRPO loss into the parameters' ``.grad``:

1. prefill ``prompt[:-1]`` in chunks under ``no_grad`` -> :class:`PromptState` (shared, read-only);
2. for each batch of ``branch_batch`` branches: run ``[prompt[-1], response[:-1]]`` at positions ``P-1 ...`` against
   the state with autograd, float32 log-probs of the response tokens (chunked over the vocabulary), the branch's
   share of the loss (its weight fixed before the first branch from the group's, or the caller's, normaliser),
   backward, graph freed. Peak memory: state + one branch graph, flat in G;
3. ``prompt_grad="exact"``: the gradient the branches sent into the state is carried back through the prompt by
   recomputing its chunks in reverse (:mod:`longstraw.engine.prompt_backward`). ``"detached"`` stops at the state,
   as the published system does.

All inputs are validated before anything is computed, so a call that raises leaves ``.grad`` as it was.
"""

from __future__ import annotations

import contextlib
import math
import time
from dataclasses import dataclass, field, fields
from enum import Enum

import torch
from torch import Tensor

from longstraw import distributed
from longstraw.engine.prefill import prefill
from longstraw.engine.prompt_backward import prompt_backward
from longstraw.models.transformer import CausalLM
from longstraw.ops.logprobs import token_logprobs
from longstraw.profiling import PhaseMeter
from longstraw.rl.losses import KLType, LossAggMode, PolicyLoss, branch_weight, loss_denominator, parse_enum
from longstraw.state import PromptState


class PromptGrad(str, Enum):
    EXACT = "exact"
    DETACHED = "detached"


_COMPUTE_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class GRPOConfig:
    """Settings of one GRPO backward (validated on construction; strings become enums).

    prompt_grad: ``"exact"`` (gradient through the prompt state) or ``"detached"``.
    loss_agg_mode, clip_ratio_low/high, clip_ratio_c (dual clip, None disables), kl_coef, kl_type, entropy_coef:
        the loss, as verl defines it (see :mod:`longstraw.rl.losses`).
    loss_scale_factor: the divisor of ``seq-mean-token-sum-norm`` (default: the longest response of the group;
        set a constant, e.g. the max response length, to reproduce Dr. GRPO exactly).
    prefill_chunk: prompt tokens per prefill chunk (memory: one chunk's activations; exact mode: one chunk's graph).
    branch_batch: branches replayed together (right-padded); checkpoint_layers: recompute each layer in backward.
    logprob_chunk: tokens per chunk of the LM-head log-prob op; temperature: logits are divided by it.
    compute_dtype: None (the parameters' dtype) or ``"bfloat16"`` / ``"float16"`` autocast over float32
        parameters, which gives float32 gradient accumulation with low-precision compute.
    """

    prompt_grad: PromptGrad = PromptGrad.EXACT
    loss_agg_mode: LossAggMode = LossAggMode.TOKEN_MEAN
    clip_ratio_low: float = 0.2
    clip_ratio_high: float = 0.2
    clip_ratio_c: float | None = 3.0
    kl_coef: float = 0.0
    kl_type: KLType = KLType.LOW_VAR_KL
    entropy_coef: float = 0.0
    loss_scale_factor: float | None = None
    prefill_chunk: int = 4096
    branch_batch: int = 1
    checkpoint_layers: bool = False
    logprob_chunk: int = 1024
    temperature: float = 1.0
    compute_dtype: str | None = None

    def __post_init__(self):
        set_ = lambda k, v: object.__setattr__(self, k, v)  # noqa: E731
        set_("prompt_grad", parse_enum(PromptGrad, self.prompt_grad, "prompt_grad"))
        set_("loss_agg_mode", parse_enum(LossAggMode, self.loss_agg_mode, "loss_agg_mode"))
        set_("kl_type", parse_enum(KLType, self.kl_type, "kl_type"))
        for name in ("prefill_chunk", "branch_batch", "logprob_chunk"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name}={v!r} must be an integer >= 1")
        for name in ("clip_ratio_low", "clip_ratio_high", "kl_coef", "entropy_coef"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0:
                raise ValueError(f"{name}={v!r} must be a finite number >= 0")
        if self.clip_ratio_low >= 1:
            raise ValueError(f"clip_ratio_low={self.clip_ratio_low} must be < 1 (the ratio is clipped to 1 - it)")
        if self.clip_ratio_c is not None and not (self.clip_ratio_c > 1):
            raise ValueError(f"clip_ratio_c={self.clip_ratio_c!r} must be > 1 (dual clip), or None to disable it")
        if not (self.temperature > 0):
            raise ValueError(f"temperature={self.temperature!r} must be > 0")
        if self.loss_scale_factor is not None and not (self.loss_scale_factor > 0):
            raise ValueError(f"loss_scale_factor={self.loss_scale_factor!r} must be > 0 or None")
        if self.compute_dtype is not None and self.compute_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"compute_dtype={self.compute_dtype!r} is not supported; allowed: None, "
                             f"{', '.join(map(repr, _COMPUTE_DTYPES))}")

    @property
    def exact(self) -> bool:
        return self.prompt_grad is PromptGrad.EXACT

    def policy_loss(self) -> PolicyLoss:
        return PolicyLoss(self.clip_ratio_low, self.clip_ratio_high, self.clip_ratio_c, self.kl_coef, self.kl_type,
                          self.entropy_coef)

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


# ---------------------------------------------------------------------------------------------------- validation


def check_ids_1d(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a 1-D LongTensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty")


def _check_per_token(name: str, values, responses: list[Tensor]) -> list[Tensor] | None:
    if values is None:
        return None
    if len(values) != len(responses):
        raise ValueError(f"{name} has {len(values)} entries for {len(responses)} responses")
    out = []
    for i, (v, r) in enumerate(zip(values, responses)):
        v = torch.as_tensor(v)
        if v.shape != r.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(v.shape)}, response {i} has {r.numel()} tokens")
        if not torch.isfinite(v).all():
            raise ValueError(f"{name}[{i}] holds a non-finite value ({v[~torch.isfinite(v)][0].item()})")
        out.append(v)
    return out


def validate_group(model: CausalLM, prompt_ids, responses) -> None:
    """ValueError naming the first bad value among a prompt and its responses."""
    check_ids_1d("prompt_ids", prompt_ids)
    if not isinstance(responses, (list, tuple)) or len(responses) == 0:
        raise ValueError("responses must be a non-empty list of 1-D LongTensors")
    model.check_ids(prompt_ids)
    limit = model.spec.max_position_embeddings
    p = prompt_ids.numel()
    for i, r in enumerate(responses):
        check_ids_1d(f"responses[{i}]", r)
        model.check_ids(r)
        if p + r.numel() > limit:
            raise ValueError(f"prompt ({p} tokens) + responses[{i}] ({r.numel()} tokens) = {p + r.numel()} positions "
                             f"exceeds the model's max_position_embeddings={limit}")
    if (ctx := distributed.cp_active()) is not None:  # CP ranks run in lockstep: they must agree on the group
        distributed.check_same_group(ctx, prompt_ids, responses)


def _check_state(state, prompt_ids) -> None:
    if state is not None and state.length != prompt_ids.numel() - 1:
        raise ValueError(f"prompt_state holds {state.length} positions, the prompt needs {prompt_ids.numel() - 1}")


def _validate(model, prompt_ids, responses, advantages, old_logprobs, ref_logprobs, cfg: GRPOConfig):
    validate_group(model, prompt_ids, responses)
    adv = torch.as_tensor(advantages, dtype=torch.float64).flatten() if not isinstance(advantages, Tensor) \
        else advantages.detach().flatten()
    if adv.numel() != len(responses):
        raise ValueError(f"{adv.numel()} advantages for {len(responses)} responses")
    if not torch.isfinite(adv).all():
        raise ValueError(f"advantages must be finite, got {adv[~torch.isfinite(adv)][0].item()}")
    old = _check_per_token("old_logprobs", old_logprobs, responses)
    ref = _check_per_token("ref_logprobs", ref_logprobs, responses)
    if cfg.kl_coef != 0 and ref is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs (log-probs of the responses under the reference "
                         "model, e.g. from longstraw.score)")
    return adv, old, ref


# ---------------------------------------------------------------------------------------------------- helpers


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def autocast_context(cfg: GRPOConfig, device: torch.device):
    if cfg.compute_dtype is None:
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=_COMPUTE_DTYPES[cfg.compute_dtype])


def branch_batches(n: int, size: int) -> list[list[int]]:
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def pack_branches(last_token: Tensor, responses: list[Tensor]) -> tuple[Tensor, list[int]]:
    """``[b, T_max]`` inputs ``[last prompt token, response[:-1]]``, right-padded (causal mixing makes padding
    harmless to the real positions), and the response lengths."""
    lens = [int(r.numel()) for r in responses]
    ids = torch.zeros(len(responses), max(lens), dtype=torch.long, device=last_token.device)
    for i, r in enumerate(responses):
        ids[i, 0] = last_token
        ids[i, 1 : lens[i]] = r[:-1]
    return ids, lens


def branch_logprobs(model: CausalLM, prefix, start: int, responses: list[Tensor], last_token: Tensor,
                    cfg: GRPOConfig, with_entropy: bool) -> tuple[list[Tensor], list[Tensor] | None]:
    """Float32 log-probs (and entropies) of each response's tokens, replayed against ``prefix`` at ``start``."""
    ids, lens = pack_branches(last_token, responses)
    with autocast_context(cfg, ids.device):
        hidden, _ = model.run(ids, start, prefix, checkpoint_layers=cfg.checkpoint_layers)
    h = torch.cat([hidden[i, :n] for i, n in enumerate(lens)]) if len(lens) > 1 else hidden[0, : lens[0]]
    targets = torch.cat(list(responses))
    weight, bias = model.head()
    logp, ent = token_logprobs(h, weight, targets, bias=bias, temperature=cfg.temperature,
                               chunk_size=cfg.logprob_chunk, with_entropy=with_entropy)
    return list(logp.split(lens)), (list(ent.split(lens)) if ent is not None else None)


def build_prompt_state(model: CausalLM, prompt_ids: Tensor, cfg: GRPOConfig, exact: bool) -> PromptState:
    with autocast_context(cfg, prompt_ids.device):
        return prefill(model, prompt_ids[:-1], cfg.prefill_chunk, exact=exact)


# ---------------------------------------------------------------------------------------------------- API


def grpo_backward(model: CausalLM, prompt_ids: Tensor, responses: list[Tensor], advantages, cfg: GRPOConfig,
                  old_logprobs: list[Tensor] | None = None, ref_logprobs: list[Tensor] | None = None,
                  loss_scale: float | None = None, prompt_state: PromptState | None = None) -> GRPOStats:
    """Add the gradient of one group's GRPO loss into ``.grad`` (see module docstring).

    prompt_ids ``[P]``; responses: G tensors ``[n_i]``; advantages: G numbers (one per response);
    old_logprobs / ref_logprobs: G tensors ``[n_i]`` or None (None old = on-policy); loss_scale: the normaliser D
    of the loss (default: this group's, :func:`longstraw.rl.losses.loss_denominator`).
    prompt_state: the state of ``prompt_ids[:-1]`` under the CURRENT parameters (e.g. from the rollout), to skip the
    prefill; exact mode needs one built with ``exact=True``.
    """
    if not isinstance(cfg, GRPOConfig):
        raise ValueError(f"cfg must be a longstraw.GRPOConfig, got {type(cfg).__name__}")
    adv, old, ref = _validate(model, prompt_ids, responses, advantages, old_logprobs, ref_logprobs, cfg)
    _check_state(prompt_state, prompt_ids)
    if loss_scale is not None and not (isinstance(loss_scale, (int, float)) and loss_scale > 0
                                       and math.isfinite(loss_scale)):
        raise ValueError(f"loss_scale={loss_scale!r} must be a finite number > 0")
    device = _device(model)
    t_start = time.perf_counter()
    meter = PhaseMeter(device)
    prompt_ids = prompt_ids.to(device)
    responses = [r.to(device) for r in responses]
    lens = [int(r.numel()) for r in responses]
    p = int(prompt_ids.numel())
    denom = float(loss_scale) if loss_scale is not None else loss_denominator(lens, cfg.loss_agg_mode,
                                                                             cfg.loss_scale_factor)
    loss_fn = cfg.policy_loss()
    need_entropy = cfg.entropy_coef != 0

    with meter.phase("prefill"):
        state = prompt_state if prompt_state is not None else build_prompt_state(model, prompt_ids, cfg, cfg.exact)
        if cfg.exact:
            state.enable_grad()
    prefix = state.prefix(grad=cfg.exact)

    total_loss = 0.0
    all_logp: list[Tensor] = [None] * len(responses)  # type: ignore[list-item]
    all_ent: list[Tensor] | None = [None] * len(responses) if need_entropy else None  # type: ignore[list-item]
    sums: dict[str, float] = {}
    with meter.phase("replay"):
        for batch in branch_batches(len(responses), cfg.branch_batch):
            with torch.enable_grad():
                logps, ents = branch_logprobs(model, prefix, p - 1, [responses[i] for i in batch], prompt_ids[-1],
                                              cfg, need_entropy)
                loss = None
                for j, i in enumerate(batch):
                    lp = logps[j]
                    old_i = old[i].to(lp) if old is not None else lp.detach()
                    ref_i = ref[i].to(lp) if ref is not None else None
                    tok_loss, st = loss_fn.token_losses(lp, old_i, float(adv[i]), ref_i,
                                                        ents[j] if ents is not None else None)
                    branch = tok_loss.sum() * branch_weight(lens[i], cfg.loss_agg_mode, denom)
                    loss = branch if loss is None else loss + branch
                    for k, v in st.items():
                        sums[k] = sums.get(k, 0.0) + float(v.sum())
                    all_logp[i] = lp.detach()
                    if all_ent is not None:
                        all_ent[i] = ents[j].detach()
                loss.backward()
            total_loss += float(loss.detach())
            del loss, logps, ents

    if cfg.exact:
        with meter.phase("prompt_backward"), autocast_context(cfg, device):
            prompt_backward(model, state, checkpoint_layers=cfg.checkpoint_layers)

    n_tok = sum(lens)
    metrics = {k: v / n_tok for k, v in sums.items()}
    meter.seconds["total"] = time.perf_counter() - t_start
    stats = GRPOStats(
        loss=total_loss, logprobs=all_logp, entropy=all_ent, metrics=metrics, num_tokens=n_tok, prompt_len=p,
        seconds=dict(meter.seconds), peak_memory=dict(meter.peak_bytes), prompt_state_bytes=state.nbytes(),
        prompt_state_grad_bytes=state.grad_nbytes(),
    )
    del prefix
    state.release_grad()
    return stats


@torch.no_grad()
def score(model: CausalLM, prompt_ids: Tensor, responses: list[Tensor], cfg: GRPOConfig | None = None,
          with_entropy: bool = False, prompt_state: PromptState | None = None):
    """Float32 log-probs of each response given the prompt (the prompt run once). Returns a list of ``[n_i]``
    tensors, or ``(logprobs, entropies)`` with ``with_entropy``."""
    cfg = cfg or GRPOConfig()
    validate_group(model, prompt_ids, responses)
    _check_state(prompt_state, prompt_ids)
    device = _device(model)
    prompt_ids = prompt_ids.to(device)
    responses = [r.to(device) for r in responses]
    state = prompt_state if prompt_state is not None else build_prompt_state(model, prompt_ids, cfg, exact=False)
    prefix = state.prefix(grad=False)
    out: list[Tensor] = []
    ents: list[Tensor] = []
    for batch in branch_batches(len(responses), cfg.branch_batch):
        lp, en = branch_logprobs(model, prefix, prompt_ids.numel() - 1, [responses[i] for i in batch],
                                 prompt_ids[-1], cfg, with_entropy)
        out += lp
        if en is not None:
            ents += en
    return (out, ents) if with_entropy else out
