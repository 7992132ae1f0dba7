"""Predict the peak memory of a LongStraw GRPO step before running it: a dry run on the meta device.

The model is built on the ``meta`` device (no memory, no compute) and the engine's own step runs on it: the
planner calls ``engine.prefill`` and ``engine.grpo_backward`` with an injected meter (:class:`LiveMeter`) instead of
restating them. A dispatch mode watches every tensor storage the ops create and its lifetime (storages are freed
when their last tensor dies), so the meter knows the bytes alive at every moment and their peak, phase by phase.
This is the program's own allocation pattern, not a formula, so it follows each family's code (attention K/V,
DeltaNet boundary states, MLA latents, MoE routing) without per-family bookkeeping. What it does not see:
allocator fragmentation and caching (CUDA caching allocator, glibc arenas), the framework's own context (CUDA
context ~0.5 GB, Python), and kernels' private workspaces.

What the dry run samples instead of running it all (its only shortcuts besides the ops' meta paths, which
``longstraw.ops.meta`` lists): ONE branch batch of the G (every batch allocates alike and frees its graph before
the next: the replay's memory is flat in G), and in exact mode the reverse-pass steps that can set its peak
(:func:`peak_steps`: the first and the last two; every other step repeats the second-to-last with a shorter
prefix). Tests hold both to a full dry run.

Breakdown (bytes per device):

``weights``, ``grads``, ``optimizer`` the parameters (master weights), their gradients and AdamW's two moments, in
                       the master dtype (float32 for a bf16/fp16 model, else its own dtype), sharded over the
                       FSDP group when ``gpus > 1``; ``optimizer`` is 0 on the device with ``optimizer_offload``.
                       With LoRA (``lora=``) only the trained parameters (the adapters and ``modules_to_save``)
                       have a master copy, a gradient and moments; the frozen base counts in ``weights`` only, in
                       the compute dtype, sharded alike (``Plan.settings["lora"]`` splits ``weights``)
``gathered``           FSDP's transient full-size buffers: the all-gathered parameters of the current and the
                       prefetched unit in the compute dtype (or the embedding + LM-head group, whichever is
                       larger), plus one unit's unsharded gradient and its float32 copy before the reduce-scatter
                       (of its trained parameters only: with LoRA, the adapters')
``prompt_state``       the stored state of the prompt (after prefill)
``prompt_state_grad``  its gradient buffers (exact mode)
``prefill_chunk``      transient peak above the state while one chunk is prefilled (and, in exact mode, while a
                       chunk is recomputed and back-propagated)
``branch_graph``       transient peak of one branch batch's forward + backward, excluding the LM-head chunk
``logits``             the float32 logits of one LM-head chunk (forward + backward buffers)

``peak = weights + grads + optimizer + gathered + prompt_state + prompt_state_grad + max(prefill_chunk,
branch_graph + logits)``. With ``gpus > 1`` (``fsdp``, the default there) FSDP2 shards every parameter over
``gpus / replicate`` ranks (``replicate`` > 1: HSDP); with context parallelism ``cp`` the prompt state and its
gradient are divided by ``cp`` (sharded by position). ``Plan.assumptions`` says what shards what, in which dtypes.

LoRA: the meta model gets its adapters exactly as a run's does (``models.lora.add_adapters``: the same targets,
shapes and frozen parameters for every family and target rule), and the dry run runs through them, so the
activations of the adapter path are counted where they live: the ``x A^T`` ``[tokens, r]`` each adapted layer
keeps for its backward, the adapter's ``[tokens, out]`` outputs while they are added (prefill and recomputed
chunks included), and, with dropout in detached mode, the dropped copy of each adapted layer's input; and what
it no longer allocates is gone too (no weight gradient of a frozen layer in the backward).

``max_prompt_len`` and long prompts: beyond two prefill chunks and one attention block, the transients stop growing
and the state grows linearly (K/V per position, recurrent states per chunk), so two dry runs give the line for
any longer prompt, solved for the memory limit; shorter prompts are dry-run directly.
"""

from __future__ import annotations

import argparse
import json
import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.units import format_bytes, format_tokens, parse_bytes, parse_tokens

_ATTN_BLOCK = 32768  # ops.attention.segment_attention's default max_segment
PEAK_STEPS_ONLY = True  # the dry run's exact reverse pass walks only the steps that can set its peak

BREAKDOWN_KEYS = ("weights", "grads", "optimizer", "gathered", "prompt_state", "prompt_state_grad", "branch_graph",
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


class LiveMeter:
    """The engine's meter (``profiling.PhaseMeter``'s interface) for a dry run: per phase, the bytes alive when it
    starts (``start``) and ends (``end``) and the peak while it runs (``peak``), from a :class:`LiveBytes`."""

    def __init__(self, lb: LiveBytes):
        self.lb = lb
        self.start: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        self.peak_bytes = self.peak

    @contextmanager
    def phase(self, name: str):
        self.lb.reset_peak()
        self.start[name] = self.lb.live
        try:
            yield lambda done, total: None
        finally:
            self.end[name], self.peak[name] = self.lb.live, self.lb.peak

    def transient(self, name: str) -> int:
        """Peak above what the phase left alive at its end (what it needed only while it ran)."""
        return max(0, self.peak.get(name, 0) - self.end.get(name, 0))

    def above_start(self, name: str) -> int:
        """Peak above what was alive when the phase started."""
        return max(0, self.peak.get(name, 0) - self.start.get(name, 0))


@dataclass
class Plan:
    peak_bytes: int
    breakdown: dict[str, int]
    max_prompt_len: int | None
    settings: dict = field(default_factory=dict)
    limit_bytes: int | None = None  # the memory per device it was planned against (gpu_mem), or None

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits ``limit_bytes`` (None when no limit was given)."""
        return None if self.limit_bytes is None else self.peak_bytes <= self.limit_bytes

    def to_json(self) -> dict:
        out = {"peak_bytes": int(self.peak_bytes), "breakdown": {k: int(self.breakdown[k]) for k in BREAKDOWN_KEYS},
               "max_prompt_len": self.max_prompt_len, "fits": self.fits,
               "assumptions": self.settings.get("assumptions", {})}
        if "lora" in self.settings:  # a LoRA plan: what was adapted, and how ``weights`` splits
            out["lora"] = dict(self.settings["lora"])
        return out


def _meta_model(hf_config: dict, dtype: torch.dtype):
    from longstraw.models.registry import build_model

    with torch.device("meta"):
        model = build_model(hf_config)
    return model.to(dtype)


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _layer_bytes(model) -> int:
    return max((sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers), default=0)


def peak_steps(steps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The prefill steps whose recomputation can set the exact reverse pass's peak: the last two (the longest
    prefixes; the last one may be short) and the first (no prefix: fresh zero states); every other step repeats the
    second-to-last with a shorter prefix. The first step may then run beside a recurrent boundary's gradient that
    the skipped steps would have consumed: a slight over-estimate, never under."""
    return [steps[0]] + steps[-2:] if len(steps) > 3 else list(steps)


def dry_run(model, prompt_len: int, response_len: int, group: int, cfg) -> dict[str, int]:
    """Run the engine's GRPO step (``prefill`` then ``grpo_backward``) on the meta ``model`` under ``cfg`` (a
    ``GRPOConfig``) and return the tracked bytes per phase (module docstring: one branch batch, the peak steps)."""
    from longstraw.engine.grpo import build_prompt_state, grpo_backward

    prompt = torch.zeros(prompt_len, dtype=torch.long)  # host ids, checked like a real call's; moved to meta
    n = min(group, cfg.branch_batch)
    responses = [torch.zeros(response_len, dtype=torch.long) for _ in range(n)]
    ref = [torch.zeros(response_len) for _ in range(n)] if cfg.kl_coef else None
    for p in model.parameters():
        if p.requires_grad:  # (a LoRA model's frozen base has none)
            p.grad = torch.zeros_like(p)  # an accumulating step holds them throughout
    w, _ = model.head()
    vocab = w.shape[0]
    meter = LiveMeter(LiveBytes())
    with meter.lb:
        with meter.phase("prompt_state"):
            state = build_prompt_state(model, prompt.to(w.device), cfg, cfg.exact)
        state_bytes = state.nbytes()
        if cfg.exact and PEAK_STEPS_ONLY:
            state.chunks = peak_steps(state.chunks)
        stats = grpo_backward(model, prompt, responses, torch.zeros(n), cfg, ref_logprobs=ref, prompt_state=state,
                              meter=meter)
        del state
    tokens = min(cfg.logprob_chunk, cfg.branch_batch * response_len)
    acc = 8 if w.dtype == torch.float64 else 4
    logits = 3 * tokens * vocab * acc  # forward logits, softmax/grad buffer, grad in the weights' dtype (upper bound)
    for p in model.parameters():
        p.grad = None
    branch_peak = meter.above_start("replay")
    recompute = meter.above_start("prompt_backward") if cfg.exact else 0
    return {"prompt_state": state_bytes, "prompt_state_grad": stats.prompt_state_grad_bytes,
            "prefill_chunk": max(meter.transient("prompt_state"), recompute),
            "branch_graph": max(0, branch_peak - logits), "logits": min(logits, branch_peak)}


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


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _fixed_bytes(model, compute: torch.dtype, *, gpus: int, cp: int, fsdp: bool | None, replicate: int,
                 master_dtype: str, optimizer_states: int, optimizer_offload: bool) -> tuple[dict, dict, dict]:
    """Per-device bytes of the parameters, gradients, optimiser state and FSDP's gathered buffers, what was assumed
    (which group shards what, in which dtype) and how ``weights`` splits (frozen / adapters / other trained). The
    trained parameters (``requires_grad``: every one, or a LoRA model's adapters and ``modules_to_save``) are held
    in the master dtype with a gradient and the moments; the frozen ones (a LoRA model's base) in the compute
    dtype, weights only."""
    from longstraw.checkpoint.hf import parse_dtype
    from longstraw.models.lora import is_adapter_param

    fsdp = gpus > 1 if fsdp is None else fsdp
    if fsdp and gpus // replicate < 2:
        raise ValueError(f"fsdp with gpus={gpus} and replicate={replicate} leaves one GPU per shard group")
    if master_dtype == "auto":
        master = torch.float32 if compute in (torch.bfloat16, torch.float16) else compute
    else:
        master = parse_dtype(master_dtype)

    def count(params, trained: bool) -> int:
        return sum(p.numel() for p in params if p.requires_grad == trained)

    params = list(model.parameters())
    n, frozen = count(params, True), count(params, False)  # n: trained parameters
    layer_all = max((sum(p.numel() for p in layer.parameters()) for layer in model.layers), default=0)
    layer_n = max((count(layer.parameters(), True) for layer in model.layers), default=0)
    b = model.model
    ends = list({id(p): p for m in (b.embed_tokens, b.norm, model.lm_head) for p in m.parameters()}.values())
    ends_all, ends_n = sum(p.numel() for p in ends), count(ends, True)
    shard = gpus // replicate if fsdp else 1
    mb, cb = _dtype_bytes(master), _dtype_bytes(compute)
    adapter_n = sum(p.numel() for name, p in model.named_parameters() if is_adapter_param(name))
    split = {"frozen_params": frozen, "adapter_params": adapter_n, "saved_params": n - adapter_n,
             "frozen_weight_bytes": frozen * cb // shard, "adapter_weight_bytes": adapter_n * mb // shard,
             "saved_weight_bytes": (n - adapter_n) * mb // shard}
    weights = split["frozen_weight_bytes"] + split["adapter_weight_bytes"] + split["saved_weight_bytes"]
    fixed = {"weights": weights, "grads": n * mb // shard,
             "optimizer": 0 if optimizer_offload else optimizer_states * n * mb // shard, "gathered": 0}
    if fsdp:  # two units gathered (current + prefetched), or the embedding/head group; one unit's gradient
        unit = max(2 * layer_all, ends_all)  # unsharded (compute dtype) and its float32 copy for the reduction
        fixed["gathered"] = unit * cb + max(layer_n, ends_n) * (cb + 4)
    elif master != compute:  # one process with master weights: autocast's compute-dtype copies of one layer
        fixed["gathered"] = layer_n * cb
    m, c = str(master).removeprefix("torch."), str(compute).removeprefix("torch.")
    where = (f"sharded over {shard} GPUs (FSDP2" + (f", HSDP x{replicate})" if replicate > 1 else ")")
             if fsdp else "whole on every GPU")
    of = f"of the {n:,} trained parameters only, " if frozen else ""
    assumptions = {
        "parameters": (f"{n:,} in {m} (master) " + where if not frozen else
                       f"{frozen:,} frozen in {c} (weights only) + {n:,} trained in {m} (master), {where}"),
        "compute_dtype": c,
        "gradients": f"{m}, {of}" + (f"reduce-scattered over {shard} GPUs" if fsdp else "whole"),
        "optimizer": (f"AdamW, {optimizer_states} moments in {m}, {of}"
                      + ("in host memory" if optimizer_offload else f"sharded over {shard} GPUs" if fsdp else "whole")),
        "prompt_state": f"split by position over cp={cp} ranks" if cp > 1 else "whole on each data-parallel replica",
        "data_parallel_replicas": gpus // cp,
    }
    return fixed, assumptions, split


def plan(hf_config: dict, *, prompt_len: int, response_len: int, group: int, cfg=None,
         dtype: str | torch.dtype = "bfloat16", gpus: int = 1, cp: int = 1, gpu_mem: float | None = None,
         optimizer_states: int = 2, fsdp: bool | None = None, replicate: int = 1, master_dtype: str = "auto",
         optimizer_offload: bool = False, lora=None) -> Plan:
    """Peak memory per device of one GRPO step of ``cfg`` (a ``GRPOConfig``; default: its defaults) on a model of
    ``hf_config``, computing in ``dtype`` (see module docstring). ``gpu_mem`` in bytes gives the verdict
    (``Plan.fits``) and ``max_prompt_len``. ``fsdp`` (default: ``gpus > 1``), ``replicate``: FSDP2 over the GPUs as
    ``init_distributed`` sets it up; ``master_dtype``: ``"auto"`` (float32 master weights, gradients and moments for
    a bf16/fp16 model, as FSDP runs it and as the trainer does), or ``"float32"``, ``"bfloat16"``, ...;
    ``optimizer_offload``: AdamW's moments in host memory. ``lora``: plan a LoRA run (a
    ``models.lora.LoraSettings``, or a dict of ``add_lora``'s arguments: ``rank``, ``alpha``, ``target_modules``,
    ``dropout``, ``modules_to_save``, ...): the adapters are added to the meta model as a run adds them, the frozen
    base counts as weights only (compute dtype), the adapters and ``modules_to_save`` as trained parameters (master
    dtype, gradients, moments), and the dry run goes through the adapters (module docstring);
    ``Plan.settings["lora"]`` says what was adapted and splits ``weights``. ValueError for a prompt + response
    longer than the model takes, or a LoRA setting the model refuses (a target that matches none of its linear
    layers, with the names it has)."""
    from longstraw.checkpoint.hf import parse_dtype
    from longstraw.engine.config import GRPOConfig

    cfg = cfg if cfg is not None else GRPOConfig()
    if not isinstance(cfg, GRPOConfig):
        raise ValueError(f"cfg must be a longstraw.GRPOConfig, got {type(cfg).__name__}")
    _check_positive(prompt_len=prompt_len, response_len=response_len, group=group, gpus=gpus, cp=cp)
    if prompt_len < 2:
        raise ValueError(f"prompt_len={prompt_len} must be >= 2")
    if gpus % cp:
        raise ValueError(f"cp={cp} must divide gpus={gpus}")
    _check_positive(replicate=replicate)
    if (gpus // cp) % replicate:
        raise ValueError(f"replicate={replicate} must divide the {gpus // cp} data-parallel replicas (gpus={gpus} / "
                         f"cp={cp})")
    if gpu_mem is not None and not (isinstance(gpu_mem, (int, float)) and math.isfinite(gpu_mem) and gpu_mem > 0):
        raise ValueError(f"gpu_mem={gpu_mem!r} must be a finite number of bytes > 0")
    dt = parse_dtype(dtype)
    lora_settings = None
    if lora is not None:
        from longstraw.checkpoint.adapter import settings_from

        lora_settings = settings_from(lora)
        if lora_settings.lora_dropout > 0 and cfg.exact:  # as grpo_backward refuses it, before any dry run
            raise ValueError(f"LoRA dropout={lora_settings.lora_dropout:g} with prompt_grad='exact': the reverse "
                             "pass recomputes the prompt and would draw other dropout masks; plan LoRA dropout 0 "
                             "or prompt_grad='detached'")
    model = _meta_model(hf_config, dt)
    pbytes = _param_bytes(model)  # the model's own parameters, without adapters, in the compute dtype
    layer = _layer_bytes(model)
    adapted: list[str] = []
    if lora_settings is not None:
        from longstraw.models.lora import add_adapters

        adapted = add_adapters(model, lora_settings)  # on meta: the run's targets, shapes and frozen parameters
    model.spec.check_length(prompt_len + response_len, f"a prompt of {prompt_len} tokens and a response of "
                                                        f"{response_len}")
    longest = model.spec.max_position_embeddings - response_len
    if model.spec.sliding_window is not None:
        longest = min(longest, model.spec.sliding_window - response_len)
    fixed, assumptions, split = _fixed_bytes(model, dt, gpus=gpus, cp=cp, fsdp=fsdp, replicate=replicate,
                                             master_dtype=master_dtype, optimizer_states=optimizer_states,
                                             optimizer_offload=optimizer_offload)

    cache: dict[int, dict[str, int]] = {}

    def at(p: int) -> dict[str, int]:
        if p not in cache:
            d = dry_run(model, p, response_len, group, cfg)
            d["prompt_state"] //= cp
            d["prompt_state_grad"] //= cp
            cache[p] = {**fixed, **d}
        return cache[p]

    def peak_of(b: dict[str, int]) -> int:
        return (b["weights"] + b["grads"] + b["optimizer"] + b["gathered"] + b["prompt_state"]
                + b["prompt_state_grad"] + max(b["prefill_chunk"], b["branch_graph"] + b["logits"]))

    # Beyond T positions (two prefill chunks and one attention block) the transients no longer grow and the state
    # grows linearly (K/V per position, recurrent states per chunk), so two dry runs at T and 2T give every longer
    # prompt; shorter ones are dry-run directly. (Dry runs at a million positions would spend minutes in the
    # per-chunk loops of recurrent layers.)
    chunk = cfg.prefill_chunk
    t = -(-max(2 * chunk, _ATTN_BLOCK + chunk) // chunk) * chunk

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
        max_len = _solve_max_len(lambda x: peak_of(linear(x)), gpu_mem, t, longest, known=(prompt_len, peak))
    settings = dict(prompt_len=prompt_len, response_len=response_len, group=group, prompt_grad=cfg.prompt_grad.value,
                    dtype=str(dt).removeprefix("torch."), gpus=gpus, cp=cp, gpu_mem=gpu_mem,
                    prefill_chunk=cfg.prefill_chunk, branch_batch=cfg.branch_batch,
                    checkpoint_layers=cfg.checkpoint_layers, param_bytes=pbytes, layer_bytes=layer,
                    assumptions=assumptions)
    if lora_settings is not None:
        t = lora_settings.target_modules
        settings["lora"] = {"rank": lora_settings.r, "alpha": lora_settings.lora_alpha,
                            "target_modules": t if isinstance(t, str) else list(t),
                            "modules_to_save": list(lora_settings.modules_to_save), "adapted_modules": len(adapted),
                            **split}
    return Plan(int(peak), breakdown, max_len, settings, int(gpu_mem) if gpu_mem is not None else None)


def _solve_max_len(peak_at, limit: float, t: int, longest: int, known: tuple[int, int] | None = None) -> int:
    """Largest prompt length ``<= longest`` (the model's positions) whose peak fits ``limit``: exact on the line
    beyond ``2t`` (see ``plan``), by bisection over dry runs below it; 0 if none fits. ``known = (p, peak(p))``, the
    plan's own length: when it is already over the limit, the answer lies below it and no dry run longer than ``p``
    is needed."""
    if known is not None and known[1] > limit:
        lo, hi = 2, known[0]
    elif longest <= 2 * t:
        if peak_at(longest) <= limit:
            return longest
        lo, hi = 2, longest
    else:
        y1, y2 = peak_at(t), peak_at(2 * t)
        if y2 <= limit:
            if y2 <= y1:
                return longest  # nothing grows with the prompt: only the model's positions set a limit
            return min(longest, int(2 * t + (limit - y2) * t / (y2 - y1)))
        lo, hi = 2, 2 * t  # peak(lo) <= limit < peak(hi), or no prompt fits
    if known is not None and known[1] <= limit:
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
    p.add_argument("--prompt-len", required=True,
                   help="prompt tokens: 4096, 512K, 1M, 2.1M (K, M = 1024, 1024^2)")
    p.add_argument("--response-len", default="1024", help="response tokens")
    p.add_argument("--group", type=int, default=8, help="G, responses per prompt")
    p.add_argument("--prompt-grad", default="exact", choices=["exact", "detached"],
                   help="gradient through the prompt (exact) or not (detached)")
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype")
    p.add_argument("--gpus", type=int, default=1,
                   help="devices; > 1: parameters, gradients and optimizer state sharded over them")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks sharing one prompt state")
    p.add_argument("--gpu-mem", default=None,
                   help="memory per device, e.g. 80G, 141G: gives the verdict and the longest prompt that fits")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="prompt tokens per prefill chunk")
    p.add_argument("--branch-batch", type=int, default=1, help="branches replayed together")
    p.add_argument("--checkpoint-layers", action="store_true",
                   help="recompute each layer in backward (smaller branch and reverse-pass graphs)")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: shard over gpus/replicate GPUs, replicate over the groups (multi-node)")
    p.add_argument("--no-fsdp", action="store_true", help="parameters whole on every GPU (no FSDP2 sharding)")
    p.add_argument("--master-dtype", default="auto",
                   help="dtype of the parameters the optimiser updates: auto (float32 for a bf16/fp16 model)")
    p.add_argument("--optimizer-offload", action="store_true", help="AdamW's moments in host memory")
    p.add_argument("--lora-rank", default=None, metavar="R",
                   help="plan a LoRA run: adapters of rank R, the base frozen (weights only, in --dtype)")
    p.add_argument("--lora-alpha", default=None, metavar="A",
                   help="LoRA alpha (default 2 x rank; it does not change memory)")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="modules that get adapters: comma-separated names (q_proj,k_proj,v_proj,o_proj,gate_proj,"
                        "up_proj,down_proj, ...) or all-linear (the default)")
    p.add_argument("--lora-modules-to-save", default=None, metavar="NAMES",
                   help="modules trained whole besides the adapters, comma-separated (e.g. embed_tokens,lm_head)")
    p.add_argument("--lora-dropout", default=None, metavar="P",
                   help="LoRA dropout (default 0; > 0 keeps a dropped copy of each adapted input, detached only)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def explain(res: Plan) -> dict[str, str]:
    """What each per-device figure of ``res`` is: which total it divides by what."""
    st, a = res.settings, res.settings["assumptions"]
    cp = st["cp"]
    out = {
        "weights": a["parameters"],
        "grads": a["gradients"],
        "optimizer": a["optimizer"],
        "gathered": "FSDP's all-gathered units (current + prefetched) and one unit's gradient before its reduction"
                    if "FSDP" in a["parameters"] else "autocast's compute-dtype copy of one layer"
                    if res.breakdown["gathered"] else "none (no FSDP, no master weights)",
        "prompt_state": f"the prompt's state / cp={cp}" if cp > 1 else "the prompt's state",
        "prompt_state_grad": (f"its gradient / cp={cp}" if cp > 1 else "its gradient") + " (exact mode)",
        "prefill_chunk": f"one prefill chunk of {st['prefill_chunk']:,} tokens (exact: its recomputed graph)",
        "branch_graph": f"one batch of {st['branch_batch']} branch(es) of {st['response_len']:,} tokens",
        "logits": "one LM-head chunk of float32 logits",
    }
    return out


def lora_lines(res: Plan) -> list[tuple[str, int, str]]:
    """A LoRA plan's ``weights``, split: (label, bytes per device, what) for the frozen base, the adapters and the
    ``modules_to_save`` (when any)."""
    lo, a = res.settings["lora"], res.settings["assumptions"]
    master = a["gradients"].split(",")[0]
    out = [("frozen base", lo["frozen_weight_bytes"], f"{lo['frozen_params']:,} parameters in "
            f"{a['compute_dtype']}: weights only (no gradient, master copy or optimizer state)"),
           ("LoRA adapters", lo["adapter_weight_bytes"], f"{lo['adapter_params']:,} parameters (rank {lo['rank']} "
            f"on {lo['adapted_modules']:,} modules) in {master}, trained: gradients and optimizer below")]
    if lo["modules_to_save"]:
        out.append(("modules_to_save", lo["saved_weight_bytes"], f"{lo['saved_params']:,} parameters "
                    f"({', '.join(lo['modules_to_save'])}) in {master}, trained whole"))
    return out


def verdict(res: Plan) -> str:
    """One line: fits or not, by how much, and the longest prompt that fits."""
    if res.limit_bytes is None:
        return "no --gpu-mem given: no verdict (pass e.g. --gpu-mem 80G)"
    limit, peak = res.limit_bytes, res.peak_bytes
    longest = (f"; the longest prompt that fits is {format_tokens(res.max_prompt_len)} tokens" if res.max_prompt_len
               else "; no prompt fits with these settings")
    if res.fits:
        return (f"fits: peak {format_bytes(peak)} of {format_bytes(limit)} per device, {format_bytes(limit - peak)} "
                f"to spare{longest}")
    return (f"does NOT fit: peak {format_bytes(peak)} > {format_bytes(limit)} per device by "
            f"{format_bytes(peak - limit)}{longest}")


def _names(text: str, flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise ValueError(f"{flag}={text!r} must be comma-separated module names, like q_proj,v_proj")
    return names


def lora_from_args(args) -> dict | None:
    """The ``lora=`` of ``plan`` from the ``--lora-*`` options (None without ``--lora-rank``); a ValueError naming
    the option for a bad value."""
    given = [f"--lora-{k.replace('_', '-')}" for k in ("alpha", "targets", "modules_to_save", "dropout")
             if getattr(args, f"lora_{k}", None) is not None]
    if args.lora_rank is None:
        if given:
            raise ValueError(f"{given[0]} needs --lora-rank (the adapters' rank, e.g. --lora-rank 16)")
        return None
    try:
        rank = int(args.lora_rank)
    except ValueError:
        rank = 0
    if rank < 1:
        raise ValueError(f"--lora-rank={args.lora_rank!r} must be an integer >= 1")
    out = {"rank": rank}
    for flag, key, ok, what in (("--lora-alpha", "alpha", lambda v: v > 0, "a number > 0"),
                                ("--lora-dropout", "dropout", lambda v: 0 <= v < 1, "a number in [0, 1)")):
        text = getattr(args, "lora_" + key)
        if text is None:
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{flag}={text!r} must be {what}")
        out[key] = value
    if out.get("dropout", 0) > 0 and args.prompt_grad == "exact":
        raise ValueError(f"--lora-dropout={args.lora_dropout!r} needs --prompt-grad detached (the exact reverse pass "
                         "recomputes the prompt and would draw other dropout masks)")
    out.setdefault("alpha", 2 * rank)
    t = args.lora_targets
    out["target_modules"] = "all-linear" if t is None or t.strip() == "all-linear" else _names(t, "--lora-targets")
    if args.lora_modules_to_save is not None:
        out["modules_to_save"] = _names(args.lora_modules_to_save, "--lora-modules-to-save")
    return out


def plan_from_args(args) -> int:
    from longstraw.checkpoint.hf import read_config
    from longstraw.engine.config import GRPOConfig

    lora = lora_from_args(args)
    cfg = read_config(args.model)
    prompt_len = parse_tokens(args.prompt_len, "--prompt-len")
    response_len = parse_tokens(args.response_len, "--response-len")
    gcfg = GRPOConfig(prompt_grad=args.prompt_grad, prefill_chunk=args.prefill_chunk, branch_batch=args.branch_batch,
                      checkpoint_layers=args.checkpoint_layers)
    gpu_mem = parse_bytes(args.gpu_mem, "--gpu-mem") if args.gpu_mem is not None else None
    res = plan(cfg, prompt_len=prompt_len, response_len=response_len, group=args.group, cfg=gcfg, dtype=args.dtype,
               gpus=args.gpus, cp=args.cp, gpu_mem=gpu_mem, fsdp=False if args.no_fsdp else None,
               replicate=args.replicate, master_dtype=args.master_dtype, optimizer_offload=args.optimizer_offload,
               lora=lora)
    if args.json:
        print(json.dumps(res.to_json()))
        return 0
    lo = res.settings.get("lora")
    lora_text = ""
    if lo is not None:
        t = lo["target_modules"]
        lora_text = (f", LoRA r={lo['rank']} alpha={lo['alpha']:g} on {t if isinstance(t, str) else ','.join(t)} "
                     f"({lo['adapted_modules']:,} modules)")
    print(f"model {Path(args.model)} ({cfg.get('model_type')}): prompt {format_tokens(prompt_len)} tokens, response "
          f"{format_tokens(response_len)}, G={args.group}, {args.prompt_grad}, {args.dtype}, gpus={args.gpus}, "
          f"cp={args.cp}{', checkpointed layers' if args.checkpoint_layers else ''}{lora_text}")
    print("per device:")
    why = explain(res)
    for k in BREAKDOWN_KEYS:
        print(f"  {k:<18} {format_bytes(res.breakdown[k]):>12}   {why[k]}")
        if k == "weights" and lo is not None:
            for label, b, text in lora_lines(res):
                print(f"    {label:<16} {format_bytes(b):>12}   {text}")
    print(f"  {'peak':<18} {format_bytes(res.peak_bytes):>12}   weights + grads + optimizer + gathered + "
          "prompt_state + prompt_state_grad + max(prefill_chunk, branch_graph + logits)")
    print(f"verdict: {verdict(res)}")
    return 0
