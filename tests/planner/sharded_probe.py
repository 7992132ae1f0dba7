"""One rank of the planner's sharded check: ``python sharded_probe.py SPEC.json`` under torchrun's environment.

Loads a checkpoint under ``init_distributed(cp, fsdp=True, ep=E)`` (with ``lora_rank``: LoRA adapters on every
linear projection, and on ``lora_target_parameters``, the routed experts' fused weights, the base frozen) and
measures a steady-state step: one ``grpo_backward`` and one AdamW step,
after a short warm-up step (a one-chunk prompt, two responses, an AdamW step) has created the optimiser's moments,
imported what the step imports and started what it starts (gloo's buffers, thread pools).

What is written: this rank's peak resident bytes during the step above a baseline that holds no tensor, i.e. the
resident set just before the step less the bytes of the tensors alive then (local parameter shards and optimiser
moments, which the step's peak holds as the planner counts them). Taking the baseline before loading instead would
count the libraries and Python objects that loading and the first step bring in (~80 MiB of file-backed pages and
heap in this process): host memory that a GPU's peak does not contain, which once hid a LoRA plan's true ratio.

With ``"census": true`` in the spec, each rank then runs the same step once more under :class:`Census` and writes
``rank{r}_census.json``: each phase's peak above the baseline (``GRPOStats.peak_memory``), the most bytes of FSDP
units gathered at once and which, and the tensor storages alive at the step's largest tracked moment, summed by
the op and the code that made them. It found two planner gaps on 2026-12-07 (docs/BENCHMARKS.md): the grouped
expert dispatch's copies of LoRA factors, and (with a ``LiveBytes`` census of the dry run beside it) that a
rehearsed MLA step allocates what a rank's does."""

import collections
import json
import os
import sys
import traceback
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

torch.set_num_threads(1)

import longstraw  # noqa: E402
from longstraw.profiling import cpu_current_bytes, peak_window, trim_heap  # noqa: E402


def _local_bytes(tensors) -> int:
    """Bytes of the storages holding this rank's part of ``tensors`` (a DTensor's local shard; expert-parallel
    experts are plain), each storage counted once."""
    storages = {}
    for t in tensors:
        st = (t.to_local() if hasattr(t, "to_local") else t).untyped_storage()
        storages[st.data_ptr()] = st.nbytes()
    return sum(storages.values())


class Census(TorchDispatchMode):
    """The tensor storages an op creates under the mode, alive until freed or resized to nothing (FSDP frees its
    gathered parameters so), and at the largest sum of them seen, that sum by ``(op, shape, code)``: the op's
    name, the output's shape and the last three ``longstraw`` / ``torch.distributed`` frames that made it."""

    def __init__(self):
        super().__init__()
        self.live, self.peak, self.top = {}, 0, []

    def _sum(self) -> int:
        return sum(st.nbytes() for st in (r() for r, _ in list(self.live.values())) if st is not None)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor) or t.is_meta:
                continue
            st = t.untyped_storage()
            key = id(st)  # one Python object per storage (its data pointer moves when FSDP resizes it)
            if st.nbytes() == 0 or key in self.live:
                continue
            frames = [f for f in traceback.extract_stack(limit=20)
                      if "longstraw" in f.filename or "torch/distributed" in f.filename][-3:]
            where = " <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno}:{f.name}" for f in frames[::-1])
            self.live[key] = (weakref.ref(st, lambda _, key=key: self.live.pop(key, None)),
                              (str(func), tuple(t.shape), where))
        total = self._sum()
        if total > self.peak:
            self.peak = total
            agg = collections.Counter()
            for r, w in list(self.live.values()):
                st = r()
                if st is not None and st.nbytes():
                    agg[w] += st.nbytes()
            self.top = [{"bytes": b, "op": w[0], "shape": list(w[1]), "code": w[2]} for w, b in agg.most_common(40)]
        return out


def _gathered_units():
    """Patches FSDP2's parameter groups to record the most bytes of unsharded parameters at once and which units."""
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup as Group

    live, rec = {}, {"max": 0, "units": []}
    unshard, reshard = Group.unshard, Group.reshard

    def on_unshard(self, *a, **k):
        out = unshard(self, *a, **k)
        live[id(self)] = (self._module_fqn, sum(p._orig_size.numel() * (p.param_dtype or p.sharded_param.dtype).itemsize
                                                for p in self.fsdp_params))
        total = sum(b for _, b in live.values())
        if total > rec["max"]:
            rec["max"], rec["units"] = total, sorted(live.values())
        return out

    def on_reshard(self, *a, **k):
        live.pop(id(self), None)
        return reshard(self, *a, **k)

    Group.unshard, Group.reshard = on_unshard, on_reshard
    return rec


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    ctx = longstraw.init_distributed(cp=spec["cp"], fsdp=True, ep=spec.get("ep", 1))
    lora = {"rank": spec["lora_rank"], "alpha": 2 * spec["lora_rank"], "target_modules": "all-linear",
            "target_parameters": spec.get("lora_target_parameters", [])} if spec.get("lora_rank") else None
    model = longstraw.load_model(spec["path"], dtype=spec["dtype"], lora=lora)
    g = torch.Generator().manual_seed(0)
    vocab = model.spec.vocab_size
    prompt = torch.randint(0, vocab, (spec["prompt_len"],), generator=g)
    responses = [torch.randint(0, vocab, (spec["response_len"],), generator=g) for _ in range(spec["group"])]
    cfg = longstraw.GRPOConfig(prompt_grad=spec["mode"], prefill_chunk=spec["chunk"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    short = prompt[: min(spec["chunk"], spec["prompt_len"] - 1)]
    longstraw.grpo_backward(model, short, responses[:2], torch.randn(2, generator=g), cfg)
    opt.step()
    opt.zero_grad(set_to_none=True)
    trim_heap()
    held = _local_bytes(list(model.parameters()) + [t for st in opt.state.values() for t in st.values()
                                                     if isinstance(t, torch.Tensor)])
    base = cpu_current_bytes() - held
    with peak_window(torch.device("cpu")) as peak:
        longstraw.grpo_backward(model, prompt, responses, torch.randn(spec["group"], generator=g), cfg)
        opt.step()
        step_peak = peak()
    out = {"peak_above_base": step_peak - base, "local_param_bytes": _local_bytes(model.parameters()),
           "held_bytes": held}
    with open(os.path.join(spec["out"], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(out, f)
    if spec.get("census"):  # the same step again, looked into (the measured one above is not slowed by it)
        opt.zero_grad(set_to_none=True)
        trim_heap()
        units, census = _gathered_units(), Census()
        with census:
            stats = longstraw.grpo_backward(model, prompt, responses, torch.randn(spec["group"], generator=g), cfg)
        report = {"phase_peaks_above_base": {k: v - base for k, v in stats.peak_memory.items()},
                  "fsdp_gathered_max": units["max"], "fsdp_gathered_units": units["units"],
                  "tracked_peak": census.peak, "alive_at_tracked_peak": census.top}
        with open(os.path.join(spec["out"], f"rank{ctx.rank}_census.json"), "w") as f:
            json.dump(report, f, indent=1)
    longstraw.shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
