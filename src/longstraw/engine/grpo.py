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

import math
import time

import torch
from torch import Tensor

from longstraw.engine.checks import check_state as _check_state
from longstraw.engine.checks import validate_group
from longstraw.engine.checks import validate_step as _validate
from longstraw.engine.config import GRPOConfig, GRPOStats, PromptGrad, autocast_context  # noqa: F401
from longstraw.engine.prefill import prefill
from longstraw.engine.prompt_backward import prompt_backward
from longstraw.losses import branch_weight, loss_denominator
from longstraw.models.transformer import CausalLM
from longstraw.ops.logprobs import token_logprobs
from longstraw.profiling import PhaseMeter
from longstraw.state import PromptState


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


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
    of the loss (default: this group's, :func:`longstraw.losses.loss_denominator`).
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
