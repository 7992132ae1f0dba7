"""One rank of the planner's sharded check: ``python sharded_probe.py SPEC.json`` under torchrun's environment.

Loads a checkpoint under ``init_distributed(cp, fsdp=True, ep=E)`` (with ``lora_rank``: LoRA adapters on every
linear projection, the base frozen), runs one ``grpo_backward`` and one AdamW step, and
writes this rank's peak resident bytes above the process's baseline before loading (``VmHWM`` reset just before
the step, so loading's own peak is not counted) and its local parameter bytes."""

import json
import os
import sys

import torch

torch.set_num_threads(1)

import longstraw  # noqa: E402
from longstraw.profiling import cpu_current_bytes, peak_window, trim_heap  # noqa: E402


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    ctx = longstraw.init_distributed(cp=spec["cp"], fsdp=True, ep=spec.get("ep", 1))
    trim_heap()
    base = cpu_current_bytes()
    lora = {"rank": spec["lora_rank"], "alpha": 2 * spec["lora_rank"], "target_modules": "all-linear"} \
        if spec.get("lora_rank") else None
    model = longstraw.load_model(spec["path"], dtype=spec["dtype"], lora=lora)
    g = torch.Generator().manual_seed(0)
    vocab = model.spec.vocab_size
    prompt = torch.randint(0, vocab, (spec["prompt_len"],), generator=g)
    responses = [torch.randint(0, vocab, (spec["response_len"],), generator=g) for _ in range(spec["group"])]
    cfg = longstraw.GRPOConfig(prompt_grad=spec["mode"], prefill_chunk=spec["chunk"])
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    trim_heap()
    with peak_window(torch.device("cpu")) as peak:
        longstraw.grpo_backward(model, prompt, responses, torch.randn(spec["group"], generator=g), cfg)
        opt.step()
        step_peak = peak()
    local = sum((p.to_local() if hasattr(p, "to_local") else p).numel() * p.element_size()  # EP experts: plain
                for p in model.parameters())
    out = {"peak_above_base": step_peak - base, "local_param_bytes": local}
    with open(os.path.join(spec["out"], f"rank{ctx.rank}.json"), "w") as f:
        json.dump(out, f)
    longstraw.shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
