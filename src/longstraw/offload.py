"""AdamW whose state lives in host memory: the optimiser-state offload of ``longstraw plan --optimizer-offload``.

AdamW keeps two moments per parameter, in the master dtype: 8 bytes per parameter in float32, twice the fp32 master
weights themselves. :class:`HostAdamW` keeps them in host memory (pinned when CUDA is present, so the copies are
asynchronous DMA) and the device holds only the parameters (FSDP shards included: it works on each rank's local
shard) and their gradients. Each step, one parameter at a time: its gradient is copied to the host, the moments are
updated there, and the update is applied to the parameter on its device (a host-to-device copy of one parameter's
update: device memory never holds more than that). With ``master_on_host=True`` the float32 master weights live on
the host too, the update is applied there, and the device parameter is overwritten from it (for parameters kept in a
lower precision on the device).

The arithmetic is torch's AdamW (decoupled weight decay, bias-corrected moments), op for op: on a CPU run it gives
the same numbers as ``torch.optim.AdamW(foreach=False)`` (tested bit for bit). What it costs on a GPU: per step, a
device-to-host copy of the gradients and a host-to-device copy of the updates (2 x 4 bytes per parameter shard over
PCIe) and the moment update on the CPU; what it saves: the moments' 8 bytes per parameter shard on the device.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["HostAdamW"]


def _local(t: Tensor) -> Tensor:
    """This rank's shard of a DTensor (FSDP), the tensor itself otherwise."""
    return t.to_local() if hasattr(t, "to_local") else t


def _host_zeros(shape: torch.Size, dtype: torch.dtype) -> Tensor:
    out = torch.zeros(shape, dtype=dtype, device="cpu")
    return out.pin_memory() if torch.cuda.is_available() else out


class HostAdamW(torch.optim.Optimizer):
    """AdamW with its moments (and optionally the master weights) in host memory; see the module docstring.

    ``lr``, ``betas``, ``eps``, ``weight_decay``: as ``torch.optim.AdamW``. ``master_on_host``: keep a float32 copy of
    each parameter on the host, update it there and copy it back (the device parameter may then be lower precision).
    """

    def __init__(self, params, lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, *, master_on_host: bool = False):
        if not lr >= 0:
            raise ValueError(f"lr={lr!r} must be >= 0")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas={betas!r} must be two numbers in [0, 1)")
        if not eps >= 0 or not weight_decay >= 0:
            raise ValueError(f"eps={eps!r} and weight_decay={weight_decay!r} must be >= 0")
        super().__init__(params, dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay))
        self.master_on_host = master_on_host

    def _init_state(self, p: Tensor, local: Tensor) -> dict:
        state = self.state[p]
        if not state:
            dtype = torch.float32 if self.master_on_host else local.dtype
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = _host_zeros(local.shape, dtype)
            state["exp_avg_sq"] = _host_zeros(local.shape, dtype)
            if self.master_on_host:
                state["master"] = _host_zeros(local.shape, torch.float32)
                state["master"].copy_(local.detach())
        return state

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                local = _local(p)
                state = self._init_state(p, local)
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                grad = _local(p.grad).to("cpu", dtype=exp_avg.dtype, non_blocking=True)
                if local.device.type != "cpu" and torch.cuda.is_available():
                    torch.cuda.current_stream(local.device).synchronize()
                state["step"] += 1
                step = float(state["step"])
                target = state["master"] if self.master_on_host else local if local.device.type == "cpu" else None
                if target is not None:  # the update in place where the weights live (torch's AdamW, op for op)
                    target.mul_(1 - lr * wd)
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
                step_size = lr / (1 - beta1**step)
                denom = (exp_avg_sq.sqrt() / (1 - beta2**step) ** 0.5).add_(eps)
                if target is not None:
                    target.addcdiv_(exp_avg, denom, value=-step_size)
                    if self.master_on_host:
                        local.copy_(target, non_blocking=True)
                else:  # weights on a device: decay there, the update computed here and copied over
                    local.mul_(1 - lr * wd)
                    local.add_((exp_avg / denom).mul_(-step_size).to(local.device, dtype=local.dtype,
                                                                    non_blocking=True))
        return loss

    # ------------------------------------------------------------------ checkpoints
    def _params(self) -> list[Tensor]:
        return [p for g in self.param_groups for p in g["params"]]

    def state_dict(self) -> dict:
        """``torch.optim.Optimizer.state_dict()`` with the host tensors of an FSDP-sharded parameter presented as
        DTensors of the parameter's mesh and placements (their local tensors stay the host tensors, nothing is
        copied): ``torch.distributed.checkpoint`` then writes each rank's shard and reshards on load, as it does for
        torch's AdamW; a plain host tensor would be taken for a replicated one and written by one rank only."""
        from torch.distributed.tensor import DTensor

        sd = super().state_dict()
        params = self._params()
        for i, st in list(sd["state"].items()):
            p = params[i]
            if isinstance(p, DTensor):
                sd["state"][i] = {k: v if k == "step" else DTensor.from_local(
                    v, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())
                    for k, v in st.items()}
        return sd

    def load_state_dict(self, state_dict: dict) -> None:
        """Load what :meth:`state_dict` gave (or ``torch.optim.AdamW``'s state of the same parameters): the moments
        and masters go into host memory (pinned with CUDA), in the dtypes :meth:`step` keeps them in (torch's own
        load would move them to the parameters' devices and dtypes); a DTensor's local shard is taken."""
        groups = state_dict["param_groups"]
        if len(groups) != len(self.param_groups) or any(len(a["params"]) != len(b["params"])
                                                        for a, b in zip(groups, self.param_groups)):
            raise ValueError("the optimiser state does not match this optimiser's parameter groups: "
                             f"{[len(g['params']) for g in groups]} parameters saved, "
                             f"{[len(g['params']) for g in self.param_groups]} here")
        index = {}
        for saved, group in zip(groups, self.param_groups):
            group.update({k: v for k, v in saved.items() if k != "params"})
            index.update(zip(saved["params"], group["params"]))
        self.state.clear()
        for key, st in state_dict["state"].items():
            p = index[key]
            local = _local(p)
            new = {}
            for name, v in st.items():
                v = _local(v)
                if name == "step":
                    new[name] = v.detach().to("cpu", torch.float32).clone()
                    continue
                if tuple(v.shape) != tuple(local.shape):
                    raise ValueError(f"optimiser state {name!r} has shape {tuple(v.shape)}, this rank's parameter "
                                     f"{tuple(local.shape)}")
                dtype = torch.float32 if (self.master_on_host or name == "master") else local.dtype
                new[name] = _host_zeros(local.shape, dtype)
                new[name].copy_(v.detach())
            if self.master_on_host and "master" not in new:  # an on-device optimiser's state: masters from here
                new["master"] = _host_zeros(local.shape, torch.float32)
                new["master"].copy_(local.detach())
            self.state[p] = new
