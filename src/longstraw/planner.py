"""Predict the peak memory of a LongStraw GRPO step before running it: a dry run on the meta device.

The model is built on the ``meta`` device (no memory, no compute) and the real engine code runs on it: prefill,
branch replay with backward, the exact reverse pass. A dispatch mode watches every tensor storage the ops create
and its lifetime (storages are freed when the last tensor using them dies), so the tracker knows the bytes alive
at every moment and their peak, phase by phase. This is the program's own allocation pattern, not a formula, so it
follows each family's code (attention K/V, DeltaNet boundary states, MLA latents, MoE routing) without per-family
bookkeeping. What it does not see: allocator fragmentation and caching (CUDA caching allocator, glibc arenas), the
framework's own context (CUDA context ~0.5 GB, Python), and kernels' private workspaces.

Breakdown (bytes per device):

``weights``, ``grads``, ``optimizer`` (AdamW: two moments per parameter, in the parameter dtype)
``prompt_state``       the stored state of the prompt (after prefill)
``prompt_state_grad``  its gradient buffers (exact mode)
``prefill_chunk``      transient peak above the state while one chunk is prefilled (and, in exact mode, while a
                       chunk is recomputed and back-propagated)
``branch_graph``       transient peak of one branch batch's forward + backward, excluding the LM-head chunk
``logits``             the float32 logits of one LM-head chunk (forward + backward buffers)

``peak = weights + grads + optimizer + prompt_state + prompt_state_grad + max(prefill_chunk, branch_graph +
logits)``. With ``gpus > 1`` the parameters, gradients and optimizer state are taken as sharded (FSDP) over the
GPUs plus one layer's gathered weights; with context parallelism ``cp`` the prompt state and its gradient are
divided by ``cp`` (sharded by position).

``max_prompt_len`` and long prompts: beyond two prefill chunks and one attention block, the transients stop growing
and the state grows linearly (K/V per position, recurrent states per chunk), so two dry runs give the line for
any longer prompt, solved for the memory limit; shorter prompts are dry-run directly.
"""

from __future__ import annotations

import argparse
import json
import weakref
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.units import format_bytes, parse_bytes

_ATTN_BLOCK = 32768  # ops.attention.segment_attention's default max_segment
_PEAK_CHUNKS_ONLY = True  # the dry run's exact reverse pass walks only the chunks that can set its peak

BREAKDOWN_KEYS = ("weights", "grads", "optimizer", "prompt_state", "prompt_state_grad", "branch_graph",
                  "prefill_chunk", "logits")


def _tensors(x):
    """The tensors in a nest of lists, tuples and dicts (an op's arguments or results); a plain recursion, as
    ``tree_flatten`` made a dry run 17% slower."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


class LiveBytes(TorchDispatchMode):
    """Tracks bytes of tensor storages created under the mode that are still alive, and their peak."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._ids: set[int] = set()

    def reset_peak(self) -> None:
        self.peak = self.live

    def _free(self, key: int, nbytes: int) -> None:
        self._ids.discard(key)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = list(_tensors(out))
        if not outs:
            return out
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for t in outs:
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in self._ids:
                continue
            n = st.nbytes()
            self._ids.add(key)
            self.live += n
            weakref.finalize(st, self._free, key, n)
        self.peak = max(self.peak, self.live)
        return out


@dataclass
class Plan:
    peak_bytes: int
    breakdown: dict[str, int]
    max_prompt_len: int | None
    settings: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"peak_bytes": int(self.peak_bytes), "breakdown": {k: int(self.breakdown[k]) for k in BREAKDOWN_KEYS},
                "max_prompt_len": self.max_prompt_len}


def _meta_model(hf_config: dict, dtype: torch.dtype):
    from longstraw.models.registry import build_model

    with torch.device("meta"):
        model = build_model(hf_config)
    return model.to(dtype)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _layer_bytes(model) -> int:
    return max((sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers), default=0)


def dry_run(model, prompt_len: int, response_len: int, group: int, grpo_cfg) -> dict[str, int]:
    """Run one grpo_backward on the meta ``model`` and return the tracked bytes per phase."""
    from longstraw.engine import prompt_backward as pb
    from longstraw.engine.grpo import branch_batches, branch_logprobs, build_prompt_state

    prompt = torch.zeros(prompt_len, dtype=torch.long, device="meta")
    responses = [torch.zeros(response_len, dtype=torch.long, device="meta") for _ in range(group)]
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # an accumulating step holds them throughout
    w, b = model.head()
    vocab = w.shape[0]
    with LiveBytes() as lb:
        state = build_prompt_state(model, prompt, grpo_cfg, grpo_cfg.exact)
        state_bytes = state.nbytes()
        prefill_peak = lb.peak - lb.live  # transient above everything that stays (state, small caches)
        if grpo_cfg.exact:
            state.enable_grad()
        grad_bytes = state.grad_nbytes()
        prefix = state.prefix(grad=grpo_cfg.exact)
        lb.reset_peak()
        before = lb.live
        for batch in branch_batches(group, grpo_cfg.branch_batch)[:1]:  # every batch is alike: one is the peak
            with torch.enable_grad():
                logps, _ = branch_logprobs(model, prefix, prompt_len - 1, [responses[i] for i in batch],
                                           prompt[-1], grpo_cfg, grpo_cfg.entropy_coef != 0)
                torch.stack([lp.sum() for lp in logps]).sum().backward()
            del logps
        branch_peak = lb.peak - before
        recompute_peak = 0
        if grpo_cfg.exact:
            lb.reset_peak()
            before = lb.live
            pb.prompt_backward(model, state, checkpoint_layers=grpo_cfg.checkpoint_layers,
                               peak_chunks_only=_PEAK_CHUNKS_ONLY)
            recompute_peak = lb.peak - before
        del state, prefix
    tokens = min(grpo_cfg.logprob_chunk, grpo_cfg.branch_batch * response_len)
    acc = 8 if w.dtype == torch.float64 else 4
    logits = 3 * tokens * vocab * acc  # forward logits, softmax/grad buffer, grad in the weights' dtype (upper bound)
    for p in model.parameters():
        p.grad = None
    return {"prompt_state": state_bytes, "prompt_state_grad": grad_bytes,
            "prefill_chunk": max(prefill_peak, recompute_peak), "branch_graph": max(0, branch_peak - logits),
            "logits": min(logits, branch_peak)}


def naive_step_bytes(model_or_config, prompt_len: int, response_len: int, group: int, dtype=None) -> int:
    """Peak bytes above the weights of a naive full-graph GRPO step (G x (P + R) tokens through autograd with
    logits for every position, as an HF model computes them), from a meta-device dry run of our model."""
    from longstraw.ops.logprobs import token_logprobs_reference

    hf_cfg = model_or_config if isinstance(model_or_config, dict) else model_or_config.hf_config
    if dtype is None:
        dtype = next(model_or_config.parameters()).dtype if not isinstance(model_or_config, dict) else torch.float32
    from longstraw.checkpoint.hf import parse_dtype

    model = _meta_model(hf_cfg, parse_dtype(dtype))
    ids = torch.zeros(group, prompt_len + response_len, dtype=torch.long, device="meta")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with LiveBytes() as lb:
        with torch.enable_grad():
            hidden, _ = model.run(ids)
            w, b = model.head()
            lp, _ = token_logprobs_reference(hidden.reshape(-1, hidden.shape[-1]), w, ids.reshape(-1), bias=b)
            lp.sum().backward()
        peak = lb.peak
    return int(peak + _param_bytes(model))  # + the gradients


def plan(hf_config: dict, *, prompt_len: int, response_len: int, group: int, prompt_grad: str = "exact",
         dtype: str | torch.dtype = "bfloat16", gpus: int = 1, cp: int = 1, gpu_mem: float | None = None,
         prefill_chunk: int = 4096, branch_batch: int = 1, logprob_chunk: int = 1024,
         checkpoint_layers: bool = False, optimizer_states: int = 2) -> Plan:
    """Peak memory per device of a GRPO step (see module docstring). ``gpu_mem`` in bytes enables
    ``max_prompt_len``."""
    from longstraw.checkpoint.hf import parse_dtype
    from longstraw.engine.grpo import GRPOConfig

    _check_positive(prompt_len=prompt_len, response_len=response_len, group=group, gpus=gpus, cp=cp)
    if prompt_len < 2:
        raise ValueError(f"prompt_len={prompt_len} must be >= 2")
    if gpus % cp:
        raise ValueError(f"cp={cp} must divide gpus={gpus}")
    dt = parse_dtype(dtype)
    gcfg = GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=prefill_chunk, branch_batch=branch_batch,
                      logprob_chunk=logprob_chunk, checkpoint_layers=checkpoint_layers)
    model = _meta_model(hf_config, dt)
    pbytes = _param_bytes(model)
    shard = gpus if gpus > 1 else 1
    fixed = {
        "weights": pbytes // shard + (_layer_bytes(model) if shard > 1 else 0),
        "grads": pbytes // shard,
        "optimizer": optimizer_states * pbytes // shard,
    }

    cache: dict[int, dict[str, int]] = {}

    def at(p: int) -> dict[str, int]:
        if p not in cache:
            d = dry_run(model, p, response_len, group, gcfg)
            d["prompt_state"] //= cp
            d["prompt_state_grad"] //= cp
            cache[p] = {**fixed, **d}
        return cache[p]

    def peak_of(b: dict[str, int]) -> int:
        return (b["weights"] + b["grads"] + b["optimizer"] + b["prompt_state"] + b["prompt_state_grad"]
                + max(b["prefill_chunk"], b["branch_graph"] + b["logits"]))

    # Beyond T positions (two prefill chunks and one attention block) the transients no longer grow and the state
    # grows linearly (K/V per position, recurrent states per chunk), so two dry runs at T and 2T give every longer
    # prompt; shorter ones are dry-run directly. (Dry runs at a million positions would spend minutes in the
    # per-chunk loops of recurrent layers.)
    t = -(-max(2 * prefill_chunk, _ATTN_BLOCK + prefill_chunk) // prefill_chunk) * prefill_chunk

    def linear(p: int) -> dict[str, int]:
        if p <= 2 * t:
            return at(p)
        b1, b2 = at(t), at(2 * t)
        out = dict(b2)
        for k in ("prompt_state", "prompt_state_grad"):
            out[k] = int(b1[k] + (b2[k] - b1[k]) * (p - t) / t)
        return out

    breakdown = linear(prompt_len)
    peak = peak_of(breakdown)
    max_len = None
    if gpu_mem is not None:
        max_len = _solve_max_len(lambda x: peak_of(linear(x)), gpu_mem, t, known=(prompt_len, peak))
    settings = dict(prompt_len=prompt_len, response_len=response_len, group=group, prompt_grad=prompt_grad,
                    dtype=str(dt).removeprefix("torch."), gpus=gpus, cp=cp, gpu_mem=gpu_mem,
                    prefill_chunk=prefill_chunk, branch_batch=branch_batch)
    return Plan(int(peak), breakdown, max_len, settings)


def _solve_max_len(peak_at, limit: float, t: int, known: tuple[int, int] | None = None) -> int | None:
    """Largest prompt length whose peak fits ``limit``: exact on the line beyond ``2t`` (see ``plan``), by
    bisection over dry runs below it. ``known = (p, peak(p))``, the plan's own length: when it is already over the
    limit, the answer lies below it and no dry run longer than ``p`` is needed."""
    if known is not None and known[1] > limit:
        lo, hi = 2, known[0]
    else:
        y1, y2 = peak_at(t), peak_at(2 * t)
        if y2 <= limit:
            if y2 <= y1:
                return None  # nothing grows with the prompt: memory sets no limit
            return int(2 * t + (limit - y2) * t / (y2 - y1))
        lo, hi = 2, 2 * t  # peak(lo) <= limit < peak(hi), or no prompt fits
        if known is not None:
            lo = max(lo, known[0])
    if peak_at(lo) > limit:
        return 0
    while hi - lo > max(1, lo // 100):  # 1% resolution
        mid = (lo + hi) // 2
        if peak_at(mid) <= limit:
            lo = mid
        else:
            hi = mid
    return lo


def _check_positive(**kw) -> None:
    for k, v in kw.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}={v!r} must be an integer >= 1")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or config.json (nothing is loaded)")
    p.add_argument("--prompt-len", type=int, required=True)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--group", type=int, default=8, help="G, responses per prompt")
    p.add_argument("--prompt-grad", default="exact", choices=["exact", "detached"])
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--gpus", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context-parallel ranks sharing the prompt state")
    p.add_argument("--gpu-mem", default=None, help="memory per device (e.g. 80G, 141G) for max_prompt_len")
    p.add_argument("--prefill-chunk", type=int, default=4096)
    p.add_argument("--branch-batch", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def plan_from_args(args) -> int:
    from longstraw.checkpoint.hf import read_config

    cfg = read_config(args.model)
    res = plan(cfg, prompt_len=args.prompt_len, response_len=args.response_len, group=args.group,
               prompt_grad=args.prompt_grad, dtype=args.dtype, gpus=args.gpus, cp=args.cp,
               gpu_mem=parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem is not None else None, prefill_chunk=args.prefill_chunk, branch_batch=args.branch_batch)
    if args.json:
        print(json.dumps(res.to_json()))
        return 0
    print(f"model {Path(args.model)} ({cfg.get('model_type')}), prompt {args.prompt_len}, response {args.response_len},"
          f" G={args.group}, {args.prompt_grad}, {args.dtype}, gpus={args.gpus}, cp={args.cp}")
    for k in BREAKDOWN_KEYS:
        print(f"  {k:<18} {format_bytes(res.breakdown[k]):>12}")
    print(f"  {'peak per device':<18} {format_bytes(res.peak_bytes):>12}")
    if res.max_prompt_len is not None:
        print(f"  longest prompt fitting {args.gpu_mem}: {res.max_prompt_len:,} tokens")
    return 0

