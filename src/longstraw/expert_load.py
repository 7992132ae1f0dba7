"""How many routed token slots each expert of each MoE layer computed: the load balance of a mixture-of-experts
model, which decides how fast expert parallelism runs (the slowest EP rank sets the pace of every all-to-all).

:class:`ExpertLoad` hooks every routed-experts module of a model from outside (a forward pre-hook on each
:class:`~longstraw.models.moe_block.Experts`, GPT-OSS's experts, the expert-parallel classes included: the models are
not changed)
and, while :meth:`ExpertLoad.recording` is open, adds ``bincount(expert_ids)`` of each call into an int64
``counts [moe layers, experts]`` on the host. What is counted is the work done: every call of the layer in the
window, so a token the engine runs twice (the exact reverse pass recomputes the prompt) counts twice, and under
context or expert parallelism each process counts the tokens it routed (sum over the job's processes for the job's
total: :meth:`ExpertLoad.take` with a ``reduce``). The planner's dry run (meta tensors) is not counted.

:func:`imbalance` summarises one step's counts the way EP cost reads them: per layer, the busiest expert's load
over the mean load (1.0 = perfectly balanced; ``E`` = every slot on one expert), and the fraction of experts that
received nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import Tensor, nn



class ExpertLoad:
    """Routed-slot counters for every MoE layer of ``model`` (module docstring). ``layers`` are the qualified
    names of the hooked modules, in model order; ``counts [len(layers), experts]`` int64 on the host."""

    def __init__(self, model: nn.Module):
        mods = [(n, m) for n, m in model.named_modules() if hasattr(m, "ep_tensor_names")]  # routed experts
        self.layers = [n for n, _ in mods]
        self.num_experts = max((m.num_experts for _, m in mods), default=0)
        self.counts = torch.zeros(len(mods), self.num_experts, dtype=torch.int64)
        self._on = False
        self._pending: list[tuple[int, Tensor]] = []  # device bincounts, summed on take(): no host sync per call
        self._hooks = [m.register_forward_pre_hook(self._hook(i)) for i, (_, m) in enumerate(mods)]

    def __bool__(self) -> bool:
        return bool(self.layers)

    def _hook(self, index: int) -> Callable:
        def count(module: nn.Module, args: tuple) -> None:
            if not self._on:
                return
            ids = args[1]  # forward(x [N, H], expert_ids [N, k], weights [N, k])
            if ids.device.type == "meta" or ids.numel() == 0:
                return
            self._pending.append((index, torch.bincount(ids.detach().reshape(-1), minlength=self.num_experts)))

        return count

    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Count the routed slots of every MoE layer call inside the block."""
        self._on = True
        try:
            yield
        finally:
            self._on = False

    def take(self, reduce: Callable[[Tensor], Tensor] | None = None) -> Tensor:
        """The counts since the last ``take`` (``[layers, experts]`` int64), and zero them. ``reduce``: e.g. a sum
        over the job's processes (every process must call it then)."""
        for i, c in self._pending:
            self.counts[i] += c.to("cpu", torch.int64)[: self.num_experts]
        self._pending.clear()
        out, self.counts = self.counts, torch.zeros_like(self.counts)
        return reduce(out) if reduce is not None else out

    def close(self) -> None:
        """Remove the hooks."""
        for h in self._hooks:
            h.remove()
        self._hooks.clear()


def imbalance(counts: Tensor) -> dict[str, float]:
    """Summary of one step's ``counts [layers, experts]``: ``expert_load_max_over_mean`` (the worst layer's busiest
    expert over that layer's mean; 1.0 = balanced), ``expert_load_mean_max_over_mean`` (the same averaged over the
    layers) and ``expert_idle_fraction`` (the share of (layer, expert) pairs that got no slot). Layers that routed
    nothing are left out; empty dict if none routed anything."""
    c = counts.to(torch.float64)
    used = c.sum(1) > 0
    if not bool(used.any()):
        return {}
    c = c[used]
    ratio = c.max(1).values / c.mean(1)
    return {"expert_load_max_over_mean": float(ratio.max()), "expert_load_mean_max_over_mean": float(ratio.mean()),
            "expert_idle_fraction": float((c == 0).to(torch.float64).mean())}
