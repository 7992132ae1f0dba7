"""Rollouts: G branches sampled together from one shared prompt state.

The prompt is prefilled once (or its state is handed in, e.g. the state the training step then reuses). Decoding
runs all live branches as one batch: each layer's decoder reads the shared prompt state in place (attention: the
prompt K/V segment with batch 1, broadcast over the branches by query folding; recurrent layers: the prompt's
final state, expanded without copying) plus the branch's own generated tokens. Finished branches are dropped from
the batch. The same ``model.run`` path as prefill and replay processes every step.

Each sampled token's log-probability is kept: ``log_softmax(logits / temperature)`` of the full distribution (before
top-k / top-p truncation), which is exactly what :func:`longstraw.score` with the same temperature computes, so it
serves as ``old_logprobs`` of an on-policy update. With ``temperature == 0`` decoding is greedy and log-probs are
those of the temperature-1 distribution.

A response includes the stop token (so the policy learns to stop); a stop string ends a branch after the token
that completes it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor

from longstraw.engine.checks import check_ids_1d
from longstraw.engine.config import COMPUTE_DTYPES, SamplingConfig
from longstraw.engine.lockstep import idle_decode_step
from longstraw.engine.prefill import prefill
from longstraw.models.transformer import CausalLM
from longstraw.profiling import PhaseMeter
from longstraw.state import PromptState, finishes_placement


@dataclass
class Rollout:
    """Sampled responses of one prompt: token ids, the log-prob of each sampled token, why each ended."""

    responses: list[Tensor]
    logprobs: list[Tensor]
    finish_reasons: list[str] = field(default_factory=list)
    prompt_state: PromptState | None = None


def sample_tokens(logits: Tensor, cfg: SamplingConfig, generator: torch.Generator | None) -> tuple[Tensor, Tensor]:
    """logits ``[n, V]`` -> (sampled ids ``[n]``, their log-probs under the temperature-scaled full softmax)."""
    logits = logits.to(torch.float64 if logits.dtype == torch.float64 else torch.float32)
    if cfg.temperature == 0:
        ids = logits.argmax(-1)
        return ids, torch.log_softmax(logits, -1).gather(1, ids[:, None])[:, 0]
    z = logits / cfg.temperature
    logp = torch.log_softmax(z, -1)
    filt = z
    if cfg.top_k and cfg.top_k < z.shape[-1]:
        kth = torch.topk(z, cfg.top_k, dim=-1).values[:, -1:]
        filt = filt.masked_fill(filt < kth, float("-inf"))
    if cfg.top_p < 1.0:
        sorted_z, order = torch.sort(filt, dim=-1, descending=True)
        probs = torch.softmax(sorted_z, -1)
        cum = probs.cumsum(-1)
        drop = (cum - probs) >= cfg.top_p  # keep the smallest prefix whose mass reaches top_p (always the first)
        sorted_z = sorted_z.masked_fill(drop, float("-inf"))
        filt = torch.full_like(filt, float("-inf")).scatter(1, order, sorted_z)
    probs = torch.softmax(filt, -1)
    ids = torch.multinomial(probs.float(), 1, generator=generator)[:, 0]
    return ids, logp.gather(1, ids[:, None])[:, 0]


def _stop_string_hit(decode: Callable[[list[int]], str], ids: list[int], stops: Sequence[str], window: int) -> bool:
    text = decode(ids[-window:])
    return any(s in text for s in stops)


@torch.no_grad()
@finishes_placement
def generate(model: CausalLM, prompt_ids: Tensor, n: int, sampling: SamplingConfig, *,
             prompt_state: PromptState | None = None, prefill_chunk: int = 4096,
             decode: Callable[[list[int]], str] | None = None, keep_state: bool = False,
             exact_state: bool = False, compute_dtype: str | None = None, meter: PhaseMeter | None = None,
             offload_state: bool = False) -> Rollout:
    """Sample ``n`` responses to ``prompt_ids [P]`` from one shared prompt state.

    prompt_state: the state of ``prompt_ids[:-1]`` if already computed. decode: token ids -> text, needed for
    stop strings. keep_state: return the prompt state in the result, for the training step to reuse
    (``exact_state`` builds it with what exact mode needs). compute_dtype: None or ``"bfloat16"`` / ``"float16"``:
    prefill and decoding under autocast, as the training step computes with ``GRPOConfig(compute_dtype=...)``, so
    that a reused state and the sampled log-probs are those the step would compute. meter: time, memory and
    progress of the ``prefill`` and ``decode`` phases (:class:`~longstraw.profiling.PhaseMeter`). offload_state:
    as ``GRPOConfig.offload_state`` for the state this call prefills (a kept exact state's DeltaNet chunk
    boundaries go to host memory as the prefill supersedes them; the K/V stay for decoding).
    """
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise ValueError(f"n={n!r} must be an integer >= 1")
    if not isinstance(sampling, SamplingConfig):
        raise ValueError(f"sampling must be a longstraw.SamplingConfig, got {type(sampling).__name__}")
    if compute_dtype is not None and compute_dtype not in COMPUTE_DTYPES:
        raise ValueError(f"compute_dtype={compute_dtype!r} is not supported; allowed: None, "
                         f"{', '.join(map(repr, COMPUTE_DTYPES))}")
    if not isinstance(prefill_chunk, int) or isinstance(prefill_chunk, bool) or prefill_chunk < 1:
        raise ValueError(f"prefill_chunk={prefill_chunk!r} must be an integer >= 1")
    check_ids_1d("prompt_ids", prompt_ids)
    model.check_ids(prompt_ids)
    if sampling.stop_strings and decode is None:
        raise ValueError("stop_strings need a decode function (token ids -> text), e.g. tokenizer.decode")
    p = int(prompt_ids.numel())
    limit = model.spec.max_position_embeddings
    what = f"the model's max_position_embeddings={limit}"
    if p >= limit:
        raise ValueError(f"a prompt of {p} tokens leaves no room for a response below {what}")
    max_new = min(sampling.max_new_tokens, limit - p)
    device = next(model.parameters()).device
    meter = meter if meter is not None else PhaseMeter(device)
    prompt_ids = prompt_ids.to(device)
    autocast = (torch.autocast(device.type, dtype=COMPUTE_DTYPES[compute_dtype]) if compute_dtype is not None
                else contextlib.nullcontext())
    if prompt_state is None:
        with meter.phase("prefill") as report, autocast:
            prompt_state = prefill(model, prompt_ids[:-1], prefill_chunk, exact=exact_state, report=report,
                                   offload_history=offload_state)
    elif prompt_state.length != p - 1:
        raise ValueError(f"prompt_state holds {prompt_state.length} positions, the prompt needs {p - 1}")
    gen = None
    if sampling.seed is not None:
        gen = torch.Generator(device=device)
        gen.manual_seed(sampling.seed)
    decoders = [ls.decoder(n, max_new) for ls in prompt_state.layers]
    stop_ids = torch.tensor(sampling.stop_token_ids, dtype=torch.long, device=device)
    window = max((len(s) for s in sampling.stop_strings), default=0) + 8
    out_ids: list[list[int]] = [[] for _ in range(n)]
    out_lp: list[list[float]] = [[] for _ in range(n)]
    reasons = ["length"] * n
    live = torch.arange(n, device=device)  # original branch index of each live row
    tokens = prompt_ids[-1:].expand(n)[:, None]
    with meter.phase("decode") as report:
        step, done = 0, False
        # processes whose layers share collectives decode in step: each step, while any of them has live branches,
        # all run one (a process with none runs an idle one); in one process this is a plain loop
        while model.placement.lockstep(int(not done and step < max_new)):
            if done or step >= max_new:
                with autocast:
                    idle_decode_step(model)
                step += 1
                continue
            with autocast:
                hidden, pieces = model.run(tokens, p - 1 + step, [d.prefix(step) for d in decoders])
            for d, piece in zip(decoders, pieces):
                d.append(piece, step)
            logits = model.lm_head(hidden[:, -1])  # outside autocast, as score's log-probs
            ids, lp = sample_tokens(logits, sampling, gen)
            ids, lp = model.placement.agree(ids, lp)  # processes sharing the state decode the same branches
            finished = torch.zeros_like(ids, dtype=torch.bool)
            if stop_ids.numel():
                finished |= (ids[:, None] == stop_ids[None]).any(-1)
            # whole tensors read once a step (on a GPU each read waits for the device), not row by row
            ids_l, lp_l, live_l, fin_l = ids.tolist(), lp.tolist(), live.tolist(), finished.tolist()
            for row, b in enumerate(live_l):
                out_ids[b].append(ids_l[row])
                out_lp[b].append(lp_l[row])
                if fin_l[row]:
                    reasons[b] = "stop"
                elif sampling.stop_strings and _stop_string_hit(decode, out_ids[b], sampling.stop_strings, window):
                    fin_l[row] = True
                    reasons[b] = "stop"
            step += 1
            report(step, max_new)
            if all(fin_l):
                done = True
                continue
            if any(fin_l):
                keep = torch.tensor([r for r, f in enumerate(fin_l) if not f], dtype=torch.long, device=device)
                for d in decoders:
                    d.select(keep)
                live, ids = live[keep], ids[keep]
            tokens = ids[:, None]
    dtype = torch.float64 if model.lm_head.weight.dtype == torch.float64 else torch.float32
    return Rollout(
        responses=[torch.tensor(x, dtype=torch.long) for x in out_ids],
        logprobs=[torch.tensor(x, dtype=dtype) for x in out_lp],
        finish_reasons=reasons,
        prompt_state=prompt_state if keep_state else None,
    )
