"""Section d of ``gpu_check.py``: the trainer on the device, the product path a user runs (``longstraw train``).

Three short runs of the built-in random Qwen3.5-style hybrid (``tiny-hybrid``: 3 Gated DeltaNet layers + 1
attention layer, byte tokenizer) on the passkey task (2 digits, the shaped reward, so that a random model's
groups differ and the steps move the weights), in the device's own dtype (bf16 on CUDA, float32 on the CPU),
exact prompt gradients, G = 8, each part recording its own failure:

* ``full``: 4 steps, a checkpoint every 2; the last checkpoint's ``model/`` loads in transformers.
* ``resume``: 2 steps, then the same run extended to 4 from its checkpoint: the metrics of steps 3-4 against
  ``full``'s. On the CPU the trainer resumes bit for bit (the suite holds it to that); on a GPU ``resume_equal``
  is reported, not required (CUDA scatter-adds and atomics need not repeat bit for bit).
* ``lora``: 2 steps with rank-8 adapters: only adapters train; the checkpoint holds a PEFT ``adapter/``.

Reported per run: seconds, steps, the last loss and reward, the kernels the Gated DeltaNet layers took, the peak
memory the trainer recorded. Sizes: prompts of ``--d-prompt`` tokens (default 4,096; smoke 256).
"""

from __future__ import annotations

import os
import tempfile
import time

VOLATILE = {"rollout_s", "train_s", "step_s", "peak_memory_bytes", "train_peak_bytes", "peak_above_start_bytes"}


def _sets(dev, dtype: str, prompt: int, out: str, steps: int, *extra: str) -> list[str]:
    return ['model.builtin="tiny-hybrid"', f'model.device="{dev}"', f'model.dtype="{dtype}"',
            f"data.prompt_len={prompt}", f"data.max_prompt_len={prompt}", "rollout.group_size=8",
            "rollout.max_new_tokens=8", 'reward.fn="digits_shaped"', "data.answer_digits=2",
            'algorithm.prompt_grad="exact"', f"algorithm.prefill_chunk={prompt // 4}",
            f"train.steps={steps}", "train.save_every=2", "train.progress=false", "train.plots=false",
            "train.tensorboard=false", f'train.out_dir="{out}"', *extra]


def _summary(run_dir, seconds: float) -> dict:
    from longstraw.rl.runlog import read_metrics

    rows = read_metrics(run_dir)
    last = rows[-1] if rows else {}
    return {"ok": bool(rows) and all(r["loss"] == r["loss"] and abs(r["loss"]) != float("inf") for r in rows),
            "seconds": seconds, "steps": len(rows), "loss": last.get("loss"), "reward_mean": last.get("reward_mean"),
            "delta_rule_kernel": last.get("delta_rule_kernel"), "peak_memory_bytes": last.get("peak_memory_bytes")}


def section_d(args, dev, res: dict, deadline: float, say, flush) -> None:
    import torch

    from longstraw.checkpoint.training import checkpoint_dirs
    from longstraw.rl.config import RunConfig, apply_overrides
    from longstraw.rl.runlog import read_metrics
    from longstraw.rl.trainer import Trainer

    from gpu_check import _error  # one record of a failure for every section

    dtype = "bfloat16" if dev.type == "cuda" else "float32"
    prompt = args.d_prompt or (256 if args.smoke else 4096)
    res.update(model="tiny-hybrid", dtype=dtype, prompt_len=prompt, G=8)
    quiet = lambda *_: None  # noqa: E731

    def run(name, out, steps, *extra, resume=False):
        cfg = apply_overrides(RunConfig(), _sets(dev, dtype, prompt, out, steps, *extra))
        t0 = time.perf_counter()
        Trainer(cfg, resume=resume, echo=quiet).train()
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return time.perf_counter() - t0

    with tempfile.TemporaryDirectory(prefix="gpu-check-train-") as tmp:
        parts = {}

        def part(name, fn):
            if time.perf_counter() > deadline:
                parts[name] = {"ok": False, "error": "section budget spent before this part"}
            else:
                try:
                    parts[name] = fn()
                except Exception as e:  # recorded; the next part runs
                    parts[name] = _error(e)
            res["runs"] = parts
            r = parts[name]
            say(f"  d {name:7s} " + (f"{r.get('steps')} steps in {r.get('seconds', 0):.1f} s, loss {r.get('loss')}, "
                                     f"reward {r.get('reward_mean')}, kernel {r.get('delta_rule_kernel')!r}"
                                     f"{', ' + r['note'] if r.get('note') else ''} -> "
                                     f"{'ok' if r.get('ok') else 'FAIL'}" if "error" not in r else r["error"]))
            flush()

        def full():
            out = os.path.join(tmp, "full")
            r = _summary(out, run("full", out, 4))
            from transformers import AutoModelForCausalLM

            AutoModelForCausalLM.from_pretrained(checkpoint_dirs(out)[-1] / "model")  # the export serves in HF
            r["note"] = "export loads in transformers"
            return r

        def resume():
            out = os.path.join(tmp, "resumed")
            secs = run("resume", out, 2) + run("resume", out, 4, resume=True)
            r = _summary(out, secs)
            ref = os.path.join(tmp, "full")
            if os.path.isdir(ref):
                a = [{k: v for k, v in x.items() if k not in VOLATILE} for x in read_metrics(out)]
                b = [{k: v for k, v in x.items() if k not in VOLATILE} for x in read_metrics(ref)]
                r["resume_equal"] = a == b
                r["note"] = f"steps 1-4 equal to the uninterrupted run: {a == b}"
                if dev.type == "cpu" and a != b:  # bit for bit on the CPU (the suite's rule)
                    r["ok"] = False
            r["ok"] = r["ok"] and r["steps"] == 4
            return r

        def lora():
            out = os.path.join(tmp, "lora")
            r = _summary(out, run("lora", out, 2, "lora.rank=8", "lora.alpha=16"))
            has = (checkpoint_dirs(out)[-1] / "adapter" / "adapter_model.safetensors").exists()
            r["ok"] = r["ok"] and has
            r["note"] = f"PEFT adapter checkpoint: {has}"
            return r

        part("full", full)
        part("resume", resume)
        part("lora", lora)
    res["ok"] = all(p.get("ok") for p in parts.values())
