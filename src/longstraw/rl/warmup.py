"""A short supervised warm-up on SHORT prompts, and greedy evaluation of a built-in task at given lengths.

Why: a random tiny model does not learn retrieval from scratch by RL at a 4K-token prompt in minutes (every sample
of a group is wrong alike: no learning signal). ``longstraw demo`` therefore first teaches the answer's format and
copying on short prompts (:func:`supervised_warmup`: cross-entropy on the answer tokens and EOS of built-in task
prompts of a few dozen to a few hundred tokens), measures what that gives at the long prompt
(:func:`solved_rate`: greedy decoding on held-out prompts), and only then runs GRPO at the long prompt. What the
warm-up does not teach (retrieval at a length it never saw) is what the GRPO phase has to add; the demo reports the
solved rate at the long prompt before and after GRPO, and at 4x and 16x it (:func:`length_table`).

Prompts of the warm-up and of the evaluation come from :func:`longstraw.rl.tasks.make_task` with seeds of their own
(``WARMUP_SEED_BASE``, ``CHECK_SEED_BASE``, ``EVAL_SEED_BASE``), disjoint from a run's training prompts (``data.seed * 1_000_003 + k``
for the small ``data.seed`` values a run uses).
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass

import torch

WARMUP_SEED_BASE = 7_000_000_000_000
CHECK_SEED_BASE = 8_000_000_000_000  # the warm-up's own stopping check (``until_solved``)
EVAL_SEED_BASE = 9_000_000_000_000


@dataclass
class WarmupResult:
    """What :func:`supervised_warmup` did: optimiser steps, the mean loss of the first and last 10 steps (nats per
    answer token), its wall time, and the greedy solved rate on held-out prompts of the longest warm-up length."""

    steps: int
    loss_first: float
    loss_last: float
    seconds: float
    short_len: int
    short_solved: float
    stopped_early: bool = False


def _check_pos_int(name: str, v) -> int:
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be an integer >= 1")
    return v


def _example(task: str, length: int, seed: int, tokenizer, options: dict) -> tuple[list[int], list[int]]:
    """(input ids, targets) of one prompt + answer + EOS; targets are -100 except on the answer and EOS."""
    from longstraw.rl.tasks import make_task

    s = make_task(task, length, seed, tokenizer, **options)
    p = tokenizer.encode(s.prompt)
    a = tokenizer.encode(s.answer) + [tokenizer.eos_token_id]
    return p + a, [-100] * (len(p) - 1) + a + [-100]


def supervised_warmup(model, tokenizer, *, task: str = "passkey", lengths=(64, 96, 128), steps: int = 250,
                      batch_size: int = 16, lr: float = 1e-2, seed: int = 0, eval_prompts: int = 32,
                      until_solved: float | None = None, check_every: int = 25, on_check=None,
                      **task_options) -> WarmupResult:
    """Train ``model`` in place by cross-entropy on the answers of short built-in ``task`` prompts.

    Each step draws one length from ``lengths`` (tokens) and ``batch_size`` prompts of it (right-padded when a
    tokenizer misses the length; padding is masked), and takes one AdamW step (``lr``, no weight decay) on the mean
    loss over the answer tokens and EOS. ``task_options`` go to the task (e.g. ``answer_digits=1``). Afterwards the
    greedy solved rate on ``eval_prompts`` held-out prompts of the longest length is measured (0 prompts: skipped,
    reported as nan). Deterministic for a given ``seed`` and model.

    ``until_solved`` (a fraction in (0, 1]; None: run all ``steps``): every ``check_every`` steps, measure that
    greedy solved rate and stop as soon as it reaches ``until_solved`` (``steps`` is then the most it runs). Why: how
    many steps a tiny model needs before it copies at all varies several-fold with the seed, and training far past
    that point sharpens the copy until it works at lengths it never saw, so a fixed step count gives anything from
    no copying to solved at the long prompt; stopping when the short prompts are solved leaves the long one to RL.
    The check's prompts are its own (``CHECK_SEED_BASE``), not the held-out evaluation's. ``on_check(step,
    solved, loss)`` is called after each check (progress output: steps done, solved fraction, mean answer loss
    of the last ``check_every`` steps).
    """
    from longstraw.rl.tasks import check_task

    _check_pos_int("steps", steps)
    _check_pos_int("batch_size", batch_size)
    lengths = tuple(lengths)
    if not lengths:
        raise ValueError("lengths must name at least one prompt length")
    for n in lengths:
        _check_pos_int("lengths item", n)
    if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
        raise ValueError(f"lr={lr!r} must be a finite number > 0")
    if until_solved is not None:
        if isinstance(until_solved, bool) or not isinstance(until_solved, (int, float)) \
                or not 0 < until_solved <= 1:
            raise ValueError(f"until_solved={until_solved!r} must be a fraction in (0, 1] or None")
        if not eval_prompts:
            raise ValueError("until_solved needs eval_prompts >= 1 (the check measures the solved rate)")
        _check_pos_int("check_every", check_every)
    if tokenizer.eos_token_id is None:
        raise ValueError("the warm-up needs a tokenizer with an EOS token (it is trained to end the answer)")
    check_task(task, **task_options)
    device = next(model.parameters()).device
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr, weight_decay=0.0)
    rng = random.Random(f"longstraw/warmup/{seed}")
    losses = []
    short = max(lengths)
    t0 = time.perf_counter()
    for step in range(steps):
        length = rng.choice(lengths)
        rows = [_example(task, length, WARMUP_SEED_BASE + seed * 1_000_003 + step * batch_size + b, tokenizer,
                         task_options) for b in range(batch_size)]
        width = max(len(x) for x, _ in rows)
        pad = tokenizer.eos_token_id
        ids = torch.tensor([x + [pad] * (width - len(x)) for x, _ in rows], device=device)
        tgt = torch.tensor([y + [-100] * (width - len(y)) for _, y in rows], device=device)
        logits = model(ids)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), tgt.reshape(-1),
                                                 ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item() if not loss.requires_grad else loss.detach().item())
        if until_solved is not None and (step + 1) % check_every == 0 and step + 1 < steps:
            solved = solved_rate(model, tokenizer, task, short, eval_prompts, seed=seed, seed_base=CHECK_SEED_BASE,
                                 **task_options)
            model.train()
            if on_check is not None:
                recent = losses[-check_every:]
                on_check(step + 1, solved, sum(recent) / len(recent))
            if solved >= until_solved:
                break
    seconds = time.perf_counter() - t0
    del opt
    model.zero_grad(set_to_none=True)
    # the reported figure: the held-out evaluation prompts, not the stopping check's
    solved = solved_rate(model, tokenizer, task, short, eval_prompts, seed=seed, **task_options) \
        if eval_prompts else float("nan")
    first, last = losses[:10], losses[-10:]
    return WarmupResult(len(losses), sum(first) / len(first), sum(last) / len(last), seconds, short, solved,
                        stopped_early=len(losses) < steps)


@torch.no_grad()
def solved_rate(model, tokenizer, task: str, length: int, n: int, *, seed: int = 0, prefill_chunk: int = 4096,
                seed_base: int = EVAL_SEED_BASE, **task_options) -> float:
    """The fraction of ``n`` held-out ``task`` prompts of ``length`` tokens whose greedy answer (up to EOS, at
    most the answer's length + 1 tokens) equals the reference exactly (surrounding whitespace ignored). The prompts
    are the same for every model given ``seed`` (``seed_base + seed * 1_000_003 + i``; the warm-up's stopping check
    uses ``CHECK_SEED_BASE``, the held-out evaluation ``EVAL_SEED_BASE``)."""
    from longstraw.engine.config import SamplingConfig
    from longstraw.engine.rollout import generate
    from longstraw.rl.tasks import make_task

    _check_pos_int("n", n)
    was_training = model.training
    model.eval()
    eos = tokenizer.eos_token_id
    device = next(model.parameters()).device
    ok = 0
    try:
        for i in range(n):
            s = make_task(task, length, seed_base + seed * 1_000_003 + i, tokenizer, **task_options)
            ids = torch.tensor(tokenizer.encode(s.prompt), dtype=torch.long, device=device)
            want = len(tokenizer.encode(s.answer)) + 1
            sp = SamplingConfig(temperature=0, max_new_tokens=want, stop_token_ids=(eos,) if eos is not None else ())
            r = generate(model, ids, 1, sp, prefill_chunk=prefill_chunk).responses[0].tolist()
            if r and eos is not None and r[-1] == eos:
                r = r[:-1]
            ok += tokenizer.decode(r).strip() == s.answer.strip()
    finally:
        model.train(was_training)
    return ok / n


def length_table(rows: list[dict]) -> list[str]:
    """Text lines of the evaluation table: ``rows`` of ``{"length", "prompts", "before", "after"}`` (fractions;
    ``before``/``after`` may be None when not measured)."""
    def pct(v):
        return "   n/a" if v is None else f"{v:6.1%}"

    out = ["  prompt tokens  prompts  before GRPO  after GRPO"]
    for r in rows:
        out.append(f"  {r['length']:>13,}  {r['prompts']:>7}  {pct(r['before']):>11}  {pct(r['after']):>10}")
    return out
