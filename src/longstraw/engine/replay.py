"""Phase 2: the response branches replayed against the shared prompt state, with autograd, a few at a time.

Every branch starts at the prompt's last position: its input is ``[prompt[-1], response[:-1]]`` at positions
``P-1 ...`` and it predicts ``response``. A batch of ``branch_batch`` branches is right-padded (causal mixing makes
the padding harmless to the real positions) and run as one ``model.run`` over the prompt state's prefix; float32
log-probs of the response tokens come from the chunked LM-head op (no ``tokens x vocab`` float32 logits at once).

:func:`replay` adds each batch's share of the loss gradient to ``.grad`` and frees the batch's graph before the
next one runs: peak memory is the prompt state plus ONE batch's graph, flat in G. The share of branch ``i`` is its
token-loss sum times a weight fixed before the first branch from the group's (or the caller's) normaliser
(``longstraw.losses``), so the sum of the shares is exactly the batch loss. In exact mode the prefix's gradient
buffers (sinks) collect what the branches send into the prompt state, for the reverse pass.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from longstraw.engine.config import GRPOConfig, autocast_context
from longstraw.engine.lockstep import idle_replay_batch
from longstraw.losses import branch_weight
from longstraw.models.transformer import CausalLM
from longstraw.ops import meta


def branch_batches(n: int, size: int) -> list[list[int]]:
    """Indices of ``n`` branches in batches of ``size``."""
    return [list(range(i, min(n, i + size))) for i in range(0, n, size)]


def pack_branches(last_token: Tensor, responses: list[Tensor]) -> tuple[Tensor, list[int]]:
    """``[b, T_max]`` inputs ``[last prompt token, response[:-1]]``, right-padded, and the response lengths."""
    lens = [int(r.numel()) for r in responses]
    ids = torch.zeros(len(responses), max(lens), dtype=torch.long, device=last_token.device)
    for i, r in enumerate(responses):
        ids[i, 0] = last_token
        ids[i, 1 : lens[i]] = r[:-1]
    return ids, lens


def branch_logprobs(model: CausalLM, prefix, start: int, responses: list[Tensor], last_token: Tensor,
                    cfg: GRPOConfig, with_entropy: bool) -> tuple[list[Tensor], list[Tensor] | None]:
    """Float32 log-probs ``[n_i]`` (and entropies) of each response's tokens, replayed against ``prefix`` (the
    prompt state's per-layer prefixes) at position ``start``."""
    ids, lens = pack_branches(last_token, responses)
    with autocast_context(cfg, ids.device):
        hidden, _ = model.run(ids, start, prefix, checkpoint_layers=cfg.checkpoint_layers)
    h = torch.cat([hidden[i, :n] for i, n in enumerate(lens)]) if len(lens) > 1 else hidden[0, : lens[0]]
    targets = torch.cat(list(responses))
    logp, ent = model.lm_head(h, targets, temperature=cfg.temperature, chunk_size=cfg.logprob_chunk,
                              with_entropy=with_entropy)
    return list(logp.split(lens)), (list(ent.split(lens)) if ent is not None else None)


@dataclass
class ReplayResult:
    """What the replay computed: the loss it back-propagated, per-branch log-probs (and entropies) detached, and
    the sums of the loss's per-token statistics."""

    loss: float
    logprobs: list[Tensor]
    entropy: list[Tensor] | None
    stat_sums: dict[str, float]


def replay(model: CausalLM, prefix, prompt_ids: Tensor, responses: list[Tensor], advantages: Tensor, cfg: GRPOConfig,
           denominator: float, old: list[Tensor] | None, ref: list[Tensor] | None, *,
           report: Callable[[int, int], None] | None = None) -> ReplayResult:
    """Back-propagate every branch's share of the GRPO loss, one batch of ``cfg.branch_batch`` at a time.

    prefix: the prompt state's per-layer prefixes (with gradient sinks in exact mode); advantages ``[G]``;
    denominator: the loss normaliser D; old / ref: per-branch log-probs or None (None old = on-policy).
    """
    loss_fn = cfg.policy_loss()
    need_entropy = cfg.entropy_coef != 0
    lens = [int(r.numel()) for r in responses]
    start = int(prompt_ids.numel()) - 1
    total: Tensor | None = None  # the loss and the statistics stay tensors until the end: no host sync per batch
    all_logp: list[Tensor] = [None] * len(responses)  # type: ignore[list-item]
    all_ent: list[Tensor] | None = [None] * len(responses) if need_entropy else None  # type: ignore[list-item]
    sums: dict[str, Tensor] = {}
    batches = branch_batches(len(responses), cfg.branch_batch)
    total_batches = model.placement.lockstep(len(batches))  # processes sharing the layers' collectives run alike
    for _ in range(total_batches - len(batches)):
        idle_replay_batch(model, cfg, need_entropy)
    for done, batch in enumerate(batches, start=1):
        with torch.enable_grad():
            logps, ents = branch_logprobs(model, prefix, start, [responses[i] for i in batch], prompt_ids[-1], cfg,
                                          need_entropy)
            loss = None
            for j, i in enumerate(batch):
                lp = logps[j]
                old_i = old[i].to(lp) if old is not None else lp.detach()
                ref_i = ref[i].to(lp) if ref is not None else None
                tok_loss, st = loss_fn.token_losses(lp, old_i, float(advantages[i]), ref_i,
                                                    ents[j] if ents is not None else None)
                branch = tok_loss.sum() * branch_weight(lens[i], cfg.loss_agg_mode, denominator)
                loss = branch if loss is None else loss + branch
                for k, v in st.items():
                    s_k = v.sum(dtype=torch.float64)
                    sums[k] = s_k if k not in sums else sums[k] + s_k
                all_logp[i] = lp.detach()
                if all_ent is not None:
                    all_ent[i] = ents[j].detach()
            loss.backward()
        total = loss.detach() if total is None else total + loss.detach()
        del loss, logps, ents
        if report is not None:
            report(done, len(batches))
    return ReplayResult(meta.value(total), all_logp, all_ent, {k: meta.value(v) for k, v in sums.items()})
