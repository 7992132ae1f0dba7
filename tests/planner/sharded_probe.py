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
heap in this process): host memory that a GPU's peak does not contain, which once hid a LoRA plan's true ratio."""

import json
import os
import sys

import torch

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
    out = {"peak_above_base": step_peak - base, "local_param_bytes": _local_bytes(model.parameters())}
    with open(os.path.join(spec["out"], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(out, f)
    longstraw.shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
