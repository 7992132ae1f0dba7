"""Before a run: the memory planner's peak for the run's settings against the memory there is, and what to change.

The trainer calls :func:`check_run_memory` before it writes anything. The planner (``longstraw.planner.plan``)
dry-runs one GRPO step of the run's model on the meta device at the run's longest prompt, longest response and
group size; the trainer adds what a run holds beyond one step: the frozen reference model (``kl_coef > 0``) and,
with ``reuse_rollout_state``, the rollout prompt states of the step's other groups, kept until their first
update. ``train.memory_check``: ``"warn"`` prints the verdict and goes on, ``"error"`` refuses a run that does not
fit (a ``ValueError``: the CLI's one-line error), ``"off"`` skips the dry run (seconds: the planner dry-runs a few
sampled layers, ``planner.layer_samples``). On a GPU the limit is the device's memory less the planner's reserve
(``planner.device_reserve``: CUDA context, NCCL buffers, fragmentation), as ``longstraw plan --gpu-mem`` has it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from longstraw.devices import device_memory
from longstraw.planner import device_reserve, plan
from longstraw.rl.config import RunConfig, grpo_config
from longstraw.units import format_bytes as _fmt
from longstraw.units import parse_bytes


@dataclass
class MemoryVerdict:
    peak_bytes: int  # planned peak of the run (one step + what the run holds besides)
    limit_bytes: int | None  # the memory it is compared with (None: unknown, nothing checked)
    fits: bool
    breakdown: dict[str, int]
    max_prompt_len: int | None  # longest prompt that fits the limit with the other settings unchanged
    message: str


def _advice(cfg: RunConfig, b: dict[str, int], extra: dict[str, int]) -> list[str]:
    """What would shrink the largest terms, most effective first."""
    g = grpo_config(cfg)
    out = []
    transient = max(b["prefill_chunk"], b["branch_graph"] + b["logits"])
    if b["prompt_state_grad"] and not g.offload_state_grad and not cfg.model.device.startswith("cpu"):
        out.append(f"algorithm.offload_state_grad = true (the state gradient, {_fmt(b['prompt_state_grad'])} less "
                   "its recurrent part, in host memory; the exact gradient unchanged, at the price of device-host "
                   "copies: `longstraw plan --offload-state-grad` gives the traffic)")
    if b["prompt_state"] and not g.offload_state and not g.graph_budget_bytes and not cfg.model.device.startswith(
            "cpu"):
        out.append(f"algorithm.offload_state = true (the state's attention K/V and exact mode's DeltaNet boundary "
                   f"states, up to {_fmt(b['prompt_state'])}, in host memory for the replay and the reverse pass; the "
                   "forward phases still hold the K/V, and each attention call copies its blocks in: "
                   "`longstraw plan --offload-state` gives both peaks)")
    if b["prompt_state_grad"]:
        out.append(f"algorithm.prompt_grad = 'detached' (drops the state gradient, {_fmt(b['prompt_state_grad'])}, "
                   "and the reverse pass; the gradient no longer flows through the prompt)")
    if b["prefill_chunk"] == transient:
        if b["prompt_state_grad"] and not g.checkpoint_layers:
            out.append(f"algorithm.checkpoint_layers = true (the reverse pass then keeps one layer's graph of a "
                       f"chunk, not all of them: the chunk transient is {_fmt(b['prefill_chunk'])})")
        if g.prefill_chunk > 256:
            out.append(f"a smaller algorithm.prefill_chunk (now {g.prefill_chunk}: one chunk's transient is "
                       f"{_fmt(b['prefill_chunk'])})")
    if b["branch_graph"] + b["logits"] == transient:
        if g.branch_batch > 1:
            out.append(f"algorithm.branch_batch = 1 (now {g.branch_batch})")
        if not g.checkpoint_layers:
            out.append(f"algorithm.checkpoint_layers = true (one branch's graph is {_fmt(b['branch_graph'])})")
    if extra.get("rollout_states"):
        out.append(f"algorithm.reuse_rollout_state = false (the other groups' rollout states, "
                   f"{_fmt(extra['rollout_states'])}, are then not kept)")
    if cfg.model.dtype in ("float32", "float64"):
        out.append(f"model.dtype = 'bfloat16' (now {cfg.model.dtype!r})")
    out.append("context parallelism over more devices divides the prompt state (docs/DISTRIBUTED.md)")
    return out


def _adapters_only(lora) -> bool:
    """Whether a LoRA run trains adapters only (no ``modules_to_save``): its KL reference is the policy with its
    adapters off (the trainer), so no second model."""
    if lora is None:
        return False
    from longstraw.checkpoint.adapter import settings_from

    return not settings_from(lora).modules_to_save


def check_run_memory(cfg: RunConfig, hf_config: dict, prompt_len: int, response_len: int, device: torch.device,
                     echo: Callable[[str], None] = print, *, shard: int = 1, cp: int = 1, replicas: int = 1,
                     ranks_per_host: int = 1, master_dtype: str = "auto", lora=None) -> MemoryVerdict | None:
    """Plan the run's peak memory and compare it with ``train.memory_limit`` (or the device's memory).

    ``prompt_len`` / ``response_len``: the longest the run will see. Returns None when ``train.memory_check`` is
    "off". Raises ValueError when it is "error" and the run does not fit; echoes one verdict line otherwise (and
    the advice when it does not fit). A torchrun job's layout: ``shard`` ranks share each parameter (FSDP), ``cp``
    each prompt, ``replicas`` split a step's prompts; ``ranks_per_host`` share a CPU host's memory (the limit per
    rank is its share). ``master_dtype``: what the trained parameters are held in (the planner's; ``optim.offload``
    is read from ``cfg``). Without FSDP the planner counts whole parameters and the whole prompt state (it has no
    context parallelism without sharded parameters): an upper bound. ``lora``: the run trains LoRA adapters (a
    ``models.lora.LoraSettings`` or a dict of ``add_lora``'s arguments, passed to the planner as ``plan(lora=)``:
    the frozen base then counts as weights only, the adapters with their gradients and moments). On a CPU device
    host memory is the device's: what ``optim.offload``, ``algorithm.offload_state_grad`` and
    ``algorithm.offload_state`` move there still counts.
    """
    t, a, g = cfg.train, cfg.algorithm, grpo_config(cfg)
    on_host = device.type == "cpu"  # offloading to host memory frees nothing of a CPU device's
    if on_host and (g.offload_state_grad or g.offload_state):
        g = replace(g, offload_state_grad=False, offload_state=False)
    if t.memory_check == "off":
        return None
    limit = parse_bytes(t.memory_limit, "train.memory_limit") if t.memory_limit else device_memory(device)[0]
    if limit is not None and not t.memory_limit and device.type == "cpu":
        limit //= max(1, ranks_per_host)
    if limit is not None and not t.memory_limit and device.type == "cuda":  # what `longstraw plan` holds back too
        limit -= device_reserve(limit, shard * cp * replicas)
    limit = int(limit) if limit is not None else None
    t0 = time.perf_counter()
    rep = cfg.parallel.replicate if shard > 1 else 1  # HSDP: the shard group is the job's ranks / replicate
    kw = dict(prompt_len=max(2, prompt_len), response_len=max(1, response_len), group=cfg.rollout.group_size,
              cfg=g, dtype=cfg.model.dtype, gpus=shard * rep, replicate=rep, cp=cp if shard > 1 else 1,
              master_dtype=master_dtype,
              optimizer_offload="none" if on_host else cfg.optim.offload, lora=lora,
              ep=cfg.parallel.ep if shard > 1 else 1, ep_shard=cfg.parallel.ep_shard)
    pl = plan(hf_config, **kw)
    b = dict(pl.breakdown)
    extra = {}
    if g.kl_coef > 0 and not _adapters_only(lora):  # a LoRA run's reference is its base, adapters off: no copy
        extra["reference_model"] = b["weights"]
    local_prompts = max(1, a.prompts_per_step // max(1, replicas))
    if a.reuse_rollout_state and local_prompts > 1:  # (offload_state: their device share, moved after the rollout)
        extra["rollout_states"] = (local_prompts - 1) * b["prompt_state"]
    peak = pl.peak_bytes + sum(extra.values())
    secs = time.perf_counter() - t0
    parts = ", ".join(f"{k} {_fmt(v)}" for k, v in {**b, **extra}.items() if v)
    if limit is None:
        msg = f"memory plan: peak {_fmt(peak)} per device ({parts}); the device's memory is unknown: not checked"
        echo(msg)
        return MemoryVerdict(peak, None, True, {**b, **extra}, None, msg)
    where = (f"train.memory_limit {t.memory_limit}" if t.memory_limit else
             f"{device.type} memory {_fmt(limit)}" + (" (after the planner's reserve for the CUDA context, NCCL and "
                                                      "fragmentation)" if device.type == "cuda" else ""))
    if peak <= limit:
        msg = (f"memory plan: peak {_fmt(peak)} per device of {where} ({peak / limit:.0%}; planned in "
               f"{secs:.1f} s)")
        echo(msg)
        return MemoryVerdict(peak, limit, True, {**b, **extra}, None, msg)
    # does not fit: the longest prompt that would, with the same settings. The reference model is fixed; the
    # kept rollout states grow with the prompt: one correction at the first estimate errs on the short side.
    budget = limit - extra.get("reference_model", 0)
    max_len = plan(hf_config, **kw, gpu_mem=budget).max_prompt_len if budget > 0 else 0
    if max_len and extra.get("rollout_states"):
        per_token = extra["rollout_states"] / max(1, prompt_len)
        max_len = plan(hf_config, **kw, gpu_mem=max(1, budget - per_token * max_len)).max_prompt_len
    fit = (f"the longest prompt that fits is {max_len:,} tokens" if max_len else
           "no prompt fits with these settings")
    msg = (f"the run will not fit: planned peak {_fmt(peak)} per device > {where} ({parts}), at prompts of "
           f"{prompt_len:,} tokens, responses of {response_len:,}, G={cfg.rollout.group_size}; {fit}. To fit, "
           "try: " + "; ".join(_advice(cfg, b, extra)) + ". (train.memory_check = 'off' skips this check.)")
    if t.memory_check == "error":
        raise ValueError(msg)
    echo("warning: " + msg)
    return MemoryVerdict(peak, limit, False, {**b, **extra}, max_len, msg)
