"""AdamW with linear warm-up then cosine decay, and global-norm gradient clipping."""

from __future__ import annotations

import math

import torch


def lr_factor(step: int, warmup: int, total: int, min_ratio: float) -> float:
    """Multiplier of the base learning rate at optimiser step ``step`` (0-based)."""
    if warmup > 0 and step < warmup:
        return (step + 1) / warmup
    span = max(1, total - warmup)
    progress = min(1.0, (step - warmup) / span)
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def make_optimizer(params, lr: float, betas, weight_decay: float, eps: float,
                   offload: str = "none") -> torch.optim.Optimizer:
    """AdamW over the trainable ``params`` (matrices decayed, norms and biases not). ``offload``: ``"none"``
    (torch's AdamW, its state beside the parameters), ``"moments"`` (:class:`~longstraw.offload.HostAdamW`: the
    moments in host memory) or ``"masters"`` (also float32 master weights on the host)."""
    params = [p for p in params if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]  # norms and biases are not decayed
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    groups = [g for g in groups if g["params"]]
    offload = getattr(offload, "value", offload)
    if offload == "none":
        return torch.optim.AdamW(groups, lr=lr, betas=tuple(betas), eps=eps)
    if offload not in ("moments", "masters"):
        raise ValueError(f"offload={offload!r}; allowed: 'none', 'moments', 'masters'")
    from longstraw.offload import HostAdamW

    return HostAdamW(groups, lr=lr, betas=tuple(betas), eps=eps, master_on_host=offload == "masters")


def set_lr(opt: torch.optim.Optimizer, lr: float) -> None:
    for g in opt.param_groups:
        g["lr"] = lr


def _full_norm(g: torch.Tensor) -> torch.Tensor:
    """The L2 norm of ``g`` in float64 (of the whole tensor for a DTensor: a collective of its mesh)."""
    n = torch.linalg.vector_norm(g.double())
    return n.full_tensor() if hasattr(n, "full_tensor") else n


def clip_grad_norm(params, max_norm: float) -> float:
    """Global L2 norm of the gradients (before clipping); clips in place when ``max_norm > 0``.

    FSDP2-sharded gradients (DTensors) give the norm of the FULL gradient: each rank's shard norms are combined over
    the shard group by the DTensor norm (a collective: every rank calls this), and the clipping factor is the same
    on every rank. Whole gradients are as in one process."""
    grads = [p for p in params if p.grad is not None]
    if not grads:
        return 0.0
    # expert-parallel experts (longstraw.distributed.expert_parallel): each rank holds its own experts' gradients
    ep = [p for p in grads if getattr(p, "_longstraw_ep", None) is not None]
    if ep or any(hasattr(p.grad, "full_tensor") for p in grads):
        rest = [p for p in grads if getattr(p, "_longstraw_ep", None) is None]
        total = torch.nn.utils.get_total_norm([p.grad for p in rest], 2.0) if rest else torch.zeros(())
        if hasattr(total, "full_tensor"):
            total = total.full_tensor()
        if ep:  # squares summed over the EP group: every expert once (the edp replicas hold the same ones, or
            # with FSDP over edp each its shard: a DTensor norm, gathered over edp first)
            sq = torch.stack([_full_norm(p.grad) ** 2 for p in ep]).sum()
            ep[0]._longstraw_ep.all_reduce(sq.to(ep[0].grad.device))
            total = torch.sqrt(total.double() ** 2 + sq.to(total.device)).to(total.dtype)
        if max_norm > 0:
            for part in (rest, ep):
                if part:
                    torch.nn.utils.clip_grads_with_norm_(part, max_norm, total)
        return float(total)
    if max_norm > 0:
        return float(torch.nn.utils.clip_grad_norm_(grads, max_norm))
    return float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad) for p in grads])))
