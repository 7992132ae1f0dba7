"""The GRPO step on one group: the three phases, and ``score``.

``grpo_backward`` adds the gradient of the group's GRPO loss into the parameters' ``.grad``:

1. prefill ``prompt[:-1]`` under ``no_grad`` -> the prompt state, shared and read-only
   (:mod:`longstraw.engine.prefill`), unless the caller hands in one (e.g. the rollout's);
2. replay the branches a batch at a time with autograd against it, each batch's share of the loss back-propagated
   and its graph freed (:mod:`longstraw.engine.replay`): peak memory is the state plus one batch's graph, flat in G;
3. ``prompt_grad="exact"``: the gradient the branches sent into the state is carried back through the prompt by
   recomputing its steps in reverse (:mod:`longstraw.engine.prompt_backward`). ``"detached"`` stops at the state,
   as the published system does.

All inputs are validated before anything is computed (:mod:`longstraw.engine.checks`), so a call that raises leaves
``.grad`` as it was. Time, memory and progress of each phase go to a :class:`~longstraw.profiling.PhaseMeter`, made
here or handed in by the caller (the trainer shows progress with it; the memory planner measures a dry run with it).
"""

from __future__ import annotations

import math
import time

import torch
from torch import Tensor

from longstraw.engine.checks import check_state, validate_group, validate_step
from longstraw.engine.config import GRPOConfig, GRPOStats, autocast_context
from longstraw.engine.kept_graphs import check_budget_placement
from longstraw.engine.lockstep import idle_score_batch
from longstraw.engine.prefill import prefill, prefill_keeping
from longstraw.engine.prompt_backward import prompt_backward
from longstraw.engine.replay import branch_batches, branch_logprobs, replay
from longstraw.losses import loss_denominator
from longstraw.models.deltanet import delta_rule_calls, kernels_since
from longstraw.models.lora import active_dropout
from longstraw.models.transformer import CausalLM
from longstraw.profiling import PhaseMeter
from longstraw.state import PromptState, finishes_placement


def _device(model: torch.nn.Module) -> torch.device:
    return next(model.parameters()).device


def build_prompt_state(model: CausalLM, prompt_ids: Tensor, cfg: GRPOConfig, exact: bool, report=None
                       ) -> PromptState:
    """The prompt state of ``prompt_ids[:-1]`` under ``cfg``'s compute dtype and prefill chunk (with
    ``cfg.offload_state``, what only the reverse pass reads again in host memory as the prefill supersedes it)."""
    with autocast_context(cfg, prompt_ids.device):
        return prefill(model, prompt_ids[:-1], cfg.prefill_chunk, exact=exact, report=report,
                       offload_history=cfg.offload_state)


@finishes_placement
def grpo_backward(model: CausalLM, prompt_ids: Tensor, responses: list[Tensor], advantages, cfg: GRPOConfig,
                  old_logprobs: list[Tensor] | None = None, ref_logprobs: list[Tensor] | None = None,
                  loss_scale: float | None = None, prompt_state: PromptState | None = None,
                  meter: PhaseMeter | None = None) -> GRPOStats:
    """Add the gradient of one group's GRPO loss into ``.grad`` (see module docstring).

    prompt_ids ``[P]``; responses: G tensors ``[n_i]``; advantages: G numbers (one per response);
    old_logprobs / ref_logprobs: G tensors ``[n_i]`` or None (None old = on-policy); loss_scale: the normaliser D
    of the loss (default: this group's, :func:`longstraw.losses.loss_denominator`).
    prompt_state: the state of ``prompt_ids[:-1]`` under the CURRENT parameters (e.g. from the rollout), to skip the
    prefill; exact mode needs one built with ``exact=True`` (``cfg.graph_budget_bytes`` then keeps nothing: the
    graphs are kept by a prefill that this call runs; ``cfg.offload_state`` moves its K/V to host memory, where
    it stays). meter: a fresh :class:`PhaseMeter` to measure (and
    show the progress of) the phases; default: one on the model's device, without a display.
    """
    if not isinstance(cfg, GRPOConfig):
        raise ValueError(f"cfg must be a longstraw.GRPOConfig, got {type(cfg).__name__}")
    adv, old, ref = validate_step(model, prompt_ids, responses, advantages, old_logprobs, ref_logprobs, cfg)
    check_state(prompt_state, prompt_ids)
    if cfg.exact and active_dropout(model):
        raise ValueError(f"prompt_grad='exact' with LoRA dropout active ({active_dropout(model)[0]}, ...): the reverse "
                         "pass recomputes the prompt and would draw other dropout masks than the prefill, so the "
                         "gradient would be inexact; use lora dropout 0, prompt_grad='detached', or model.eval()")
    if cfg.exact and prompt_state is None:
        check_budget_placement(model, cfg.graph_budget_bytes)
    if loss_scale is not None and not (isinstance(loss_scale, (int, float)) and loss_scale > 0
                                       and math.isfinite(loss_scale)):
        raise ValueError(f"loss_scale={loss_scale!r} must be a finite number > 0")
    device = _device(model)
    t_start = time.perf_counter()
    calls_before = delta_rule_calls(model)
    meter = meter if meter is not None else PhaseMeter(device)
    prompt_ids = prompt_ids.to(device)
    responses = [r.to(device) for r in responses]
    lens = [int(r.numel()) for r in responses]
    denom = float(loss_scale) if loss_scale is not None else loss_denominator(lens, cfg.loss_agg_mode,
                                                                             cfg.loss_scale_factor)
    kept = None
    with meter.phase("prefill") as report:
        if prompt_state is not None:
            state = prompt_state
        elif cfg.exact and cfg.graph_budget_bytes:
            with autocast_context(cfg, device):
                state, kept = prefill_keeping(model, prompt_ids[:-1], cfg.prefill_chunk, exact=True,
                                              graph_budget=cfg.graph_budget_bytes,
                                              offload_grad=cfg.offload_state_grad, report=report)
        else:
            state = build_prompt_state(model, prompt_ids, cfg, cfg.exact, report)
        if cfg.offload_state:  # the forward phases are over: the K/V to host memory (before its sinks are placed)
            state.offload()
        if cfg.exact and not (kept is not None and kept.grad_enabled):
            state.enable_grad(offload=cfg.offload_state_grad)
    prefix = state.prefix(grad=cfg.exact)
    with meter.phase("replay") as report:
        res = replay(model, prefix, prompt_ids, responses, adv, cfg, denom, old, ref, report=report)
    del prefix
    if cfg.exact:
        with meter.phase("prompt_backward") as report, autocast_context(cfg, device):
            prompt_backward(model, state, checkpoint_layers=cfg.checkpoint_layers, report=report, kept=kept)
    n_tok = sum(lens)
    meter.seconds["total"] = time.perf_counter() - t_start
    stats = GRPOStats(
        loss=res.loss, logprobs=res.logprobs, entropy=res.entropy, metrics={k: v / n_tok for k, v in
                                                                            res.stat_sums.items()},
        num_tokens=n_tok, prompt_len=int(prompt_ids.numel()), seconds=dict(meter.seconds),
        peak_memory=dict(meter.peak_bytes), prompt_state_bytes=state.nbytes(),
        prompt_state_grad_bytes=state.grad_nbytes(), prompt_state_grad_host_bytes=state.grad_host_nbytes(),
        prompt_state_host_bytes=state.host_nbytes(),
        delta_rule_kernel=kernels_since(model, calls_before),
        **(kept.summary(len(model.layers)) if kept is not None else {}),
    )
    if kept is not None and hasattr(meter, "info"):
        meter.info.update(kept.summary(len(model.layers)))
    state.release_grad()
    return stats


@torch.no_grad()
@finishes_placement
def score(model: CausalLM, prompt_ids: Tensor, responses: list[Tensor], cfg: GRPOConfig | None = None,
          with_entropy: bool = False, prompt_state: PromptState | None = None, meter: PhaseMeter | None = None):
    """Float32 log-probs of each response given the prompt (the prompt run once). Returns a list of ``[n_i]``
    tensors, or ``(logprobs, entropies)`` with ``with_entropy``. ``meter``: as in :func:`grpo_backward`."""
    cfg = cfg or GRPOConfig()
    if not isinstance(cfg, GRPOConfig):
        raise ValueError(f"cfg must be a longstraw.GRPOConfig, got {type(cfg).__name__}")
    validate_group(model, prompt_ids, responses)
    check_state(prompt_state, prompt_ids)
    device = _device(model)
    meter = meter if meter is not None else PhaseMeter(device)
    prompt_ids = prompt_ids.to(device)
    responses = [r.to(device) for r in responses]
    with meter.phase("prefill") as report:
        state = prompt_state if prompt_state is not None else build_prompt_state(model, prompt_ids, cfg, False,
                                                                                 report)
    prefix = state.prefix(grad=False)
    out: list[Tensor] = []
    ents: list[Tensor] = []
    batches = branch_batches(len(responses), cfg.branch_batch)
    with meter.phase("score") as report:
        for _ in range(model.placement.lockstep(len(batches)) - len(batches)):  # processes sharing collectives
            idle_score_batch(model, cfg, with_entropy)
        for done, batch in enumerate(batches, start=1):
            lp, en = branch_logprobs(model, prefix, prompt_ids.numel() - 1, [responses[i] for i in batch],
                                     prompt_ids[-1], cfg, with_entropy)
            out += lp
            if en is not None:
                ents += en
            report(done, len(batches))
    return (out, ents) if with_entropy else out
