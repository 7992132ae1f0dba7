"""One prepared GPU run (H200, under 8 minutes): a ~1B random hybrid, prefill throughput and MFU, GRPO step peaks
at G=2 and G=8, and the longest prompt reached in detached and exact mode.

Model: a Qwen3.5-style hybrid (``qwen3_5_text``) built from ``longstraw.models.qwen_hybrid.tiny_config`` with
hidden 2048, 16 layers (every 4th full attention: 16 query heads with output gate, 2 K/V heads, head dim 128;
the other 12 Gated DeltaNet with 16 key / 32 value heads of dim 128), SwiGLU 6144, vocabulary 32768, untied head,
bfloat16, random normal(0, 0.02) weights: about 1.1B parameters. Prompt and responses are random token ids.

What it measures, in this order, in one process (``torch.cuda.empty_cache`` between configurations):

1. Prefill throughput: ``longstraw.engine.prefill.prefill`` of a ``--prefill-len`` prompt under ``no_grad``
   (one warm-up, then timed), tokens/s and model FLOP utilisation. FLOPs counted: ``2 x`` the parameters of every
   linear layer but the LM head per token (prefill computes no logits), plus ``4 x heads x head_dim`` per causal
   (query, key) pair of each full-attention layer (``P^2 / 2`` pairs). The DeltaNet kernels' own FLOPs (a few
   percent at these shapes) are not counted, so the MFU is a lower bound. Peak: ``--peak-tflops`` (default: 989
   for an H100/H200 SXM's dense bf16, read from the device name; none on other devices).
2. One GRPO step (``longstraw.grpo_backward``) at ``--step-len`` for each mode in detached, exact and each G in
   ``--groups``: peak memory above the post-load baseline (gradients included, no optimiser state), seconds and
   per-phase seconds; with ``--planner``, the memory planner's prediction beside it (off by default: the planner's
   meta-device dry run of a 1B hybrid at these lengths costs minutes of CPU time per configuration, and it models
   the torch delta-rule path, not fla's kernels, so on a GPU with fla it overestimates exact mode).
3. Longest prompt at G = max(``--groups``) per mode: the prompt length doubles from ``--step-len`` while the step
   fits in memory, the previous step took under a quarter of ``--max-step-s`` (attention makes the next one about
   4x slower) and the run's total stays under ``--budget-s``. Reports the longest measured and what stopped it
   (with ``--planner``, also the planner's ``max_prompt_len`` for the device's memory).

Everything printed also goes to ``--json``. ``--smoke`` shrinks the model and lengths so the script's logic runs
on a CPU in seconds (the test suite does this); its figures mean nothing.

  python benchmarks/gpu_h200.py --json gpu_h200.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))  # uninstalled checkout

PEAK_TFLOPS = {"H200": 989.0, "H100": 989.0, "A100": 312.0}


def model_config(smoke: bool, max_len: int) -> dict:
    from longstraw.models.qwen_hybrid import tiny_config

    if smoke:
        return tiny_config(max_position_embeddings=max_len + 4096)
    return tiny_config(
        vocab_size=32768, hidden_size=2048, intermediate_size=6144, num_hidden_layers=16, full_attention_interval=4,
        num_attention_heads=16, num_key_value_heads=2, head_dim=128, linear_num_key_heads=16,
        linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128, tie_word_embeddings=False,
        max_position_embeddings=max_len + 4096,
    )


def prefill_flops(model, cfg: dict, p: int) -> float:
    """Matmul FLOPs of a prefill of ``p`` tokens (see module docstring for what is counted)."""
    import torch

    head = getattr(model, "lm_head", None)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    n_attn = sum(1 for t in cfg["layer_types"] if t == "full_attention")
    attn = n_attn * 4 * cfg["num_attention_heads"] * cfg["head_dim"] * p * p / 2
    return 2.0 * linear * p + attn


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    ap.add_argument("--smoke", action="store_true", help="tiny model and lengths: checks the script on a CPU")
    ap.add_argument("--prefill-len", type=int, default=None, help="default 131072 (smoke 1024)")
    ap.add_argument("--step-len", type=int, default=None, help="default 65536 (smoke 512)")
    ap.add_argument("--max-len", type=int, default=None, help="default 4194304 (smoke 1024)")
    ap.add_argument("--groups", default="2,8")
    ap.add_argument("--response-len", type=int, default=None, help="default 256 (smoke 32)")
    ap.add_argument("--chunk", type=int, default=None, help="prefill chunk; default 8192 (smoke 256)")
    ap.add_argument("--planner", action="store_true", help="also print the planner's prediction per step")
    ap.add_argument("--max-step-s", type=float, default=120.0)
    ap.add_argument("--budget-s", type=float, default=420.0, help="wall-clock budget for the whole run")
    ap.add_argument("--peak-tflops", type=float, default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    t_start = time.perf_counter()

    import torch

    import longstraw
    from longstraw.engine.prefill import prefill
    from longstraw.planner import plan
    from longstraw.profiling import measure_step

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    smoke = args.smoke
    prefill_len = args.prefill_len or (1024 if smoke else 131072)
    step_len = args.step_len or (512 if smoke else 65536)
    max_len = args.max_len or (1024 if smoke else 4194304)
    chunk = args.chunk or (256 if smoke else 8192)
    args.response_len = args.response_len or (32 if smoke else 256)
    groups = [int(g) for g in args.groups.split(",")]
    dtype = torch.float32 if dev.type == "cpu" else torch.bfloat16
    dtype_name = str(dtype).removeprefix("torch.")
    out: dict = {"command": " ".join(shlex.quote(a) for a in [sys.executable, *sys.argv]),
                 "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()), "smoke": smoke}

    def say(msg: str) -> None:
        print(msg, flush=True)

    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else platform.processor() or platform.machine()
    total_mem = torch.cuda.get_device_properties(dev).total_memory if dev.type == "cuda" else None
    peak_tflops = args.peak_tflops
    if peak_tflops is None and dev.type == "cuda":
        peak_tflops = next((v for k, v in PEAK_TFLOPS.items() if k in name), None)
    out["device"] = {"name": name, "total_memory": total_mem, "peak_tflops": peak_tflops, "torch": torch.__version__}
    try:
        import fla  # noqa: F401

        out["device"]["fla"] = getattr(fla, "__version__", "yes")
    except Exception as e:  # the DeltaNet layers then run the torch chunked op
        out["device"]["fla"] = f"not importable ({type(e).__name__})"
    say(f"command: {out['command']}\ndate: {out['date']}\ndevice: {out['device']}")

    cfg = model_config(smoke, max_len)
    torch.manual_seed(0)
    with torch.device(dev):
        model = longstraw.build_model(cfg)
    model.to(dtype)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0, 0.02)
    n_params = sum(q.numel() for q in model.parameters())
    out["model"] = {"parameters": n_params, "dtype": dtype_name, "config": {k: cfg[k] for k in (
        "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
        "linear_num_key_heads", "linear_num_value_heads", "intermediate_size", "vocab_size")}}
    say(f"model: {n_params / 1e9:.3f}B parameters, {dtype_name}, layers {cfg['layer_types']}")
    gen = torch.Generator().manual_seed(1)

    def ids(n):
        return torch.randint(0, cfg["vocab_size"], (n,), generator=gen).to(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    def free():
        import gc

        gc.collect()
        if dev.type == "cuda":
            torch.cuda.empty_cache()

    # ---- 1. prefill throughput
    prompt = ids(prefill_len)
    with torch.no_grad():
        prefill(model, prompt[: min(prefill_len, 2 * chunk)], chunk)  # warm-up: kernels, autotuning
        sync()
        t0 = time.perf_counter()
        state = prefill(model, prompt, chunk)
        sync()
        secs = time.perf_counter() - t0
    flops = prefill_flops(model, cfg, prefill_len)
    out["prefill"] = {"prompt_len": prefill_len, "chunk": chunk, "seconds": secs, "tokens_per_s": prefill_len / secs,
                      "flops": flops, "tflops_per_s": flops / secs / 1e12,
                      "mfu": flops / secs / (peak_tflops * 1e12) if peak_tflops else None,
                      "state_bytes": state.nbytes() if hasattr(state, "nbytes") else None}
    del state
    free()
    mfu = f", MFU {out['prefill']['mfu']:.1%}" if out["prefill"]["mfu"] is not None else ""
    say(f"prefill {prefill_len:,} tokens in {secs:.2f} s: {prefill_len / secs:,.0f} tokens/s, "
        f"{flops / secs / 1e12:.1f} TFLOP/s{mfu}")

    # ---- 2. and 3. GRPO steps
    params = [q for q in model.parameters() if q.requires_grad]

    def planned(mode, p, g):
        pl = plan(cfg, prompt_len=p, response_len=args.response_len, group=g, dtype=dtype_name,
                  cfg=longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=chunk))
        return pl.peak_bytes - pl.breakdown["weights"] - pl.breakdown["optimizer"]

    def step(mode, p, g) -> dict:
        gcfg = longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=chunk, clip_ratio_c=None)
        prompt, responses = ids(p), [ids(args.response_len) for _ in range(g)]
        adv = torch.randn(g, generator=gen)
        box = {}

        def run():
            box["stats"] = longstraw.grpo_backward(model, prompt, responses, adv, gcfg)

        rec = {"mode": mode, "prompt_len": p, "G": g, "response_len": args.response_len}
        try:
            peak, secs = measure_step(run, params, dev)
        except getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError) as e:
            rec["error"] = f"out of memory: {str(e).splitlines()[0][:200]}"
        else:
            st = box["stats"]
            rec.update(peak_bytes=peak, seconds=secs, phase_seconds=st.seconds, prompt_state_bytes=st.prompt_state_bytes,
                       prompt_state_grad_bytes=st.prompt_state_grad_bytes,
                       finite=all(bool(torch.isfinite(q.grad).all()) for q in params if q.grad is not None))
            if args.planner:
                try:
                    rec["planned_bytes"] = planned(mode, p, g)
                except Exception as e:  # the planner's dry run failing must not lose the measurement
                    rec["planned_error"] = repr(e)[:200]
        for q in params:
            q.grad = None
        box.clear()
        free()
        if "peak_bytes" in rec:
            pb = rec.get("planned_bytes")
            pl = f", planned {pb / 2**30:.2f} GiB ({pb / rec['peak_bytes'] - 1:+.1%})" if pb else ""
            say(f"  {mode:8s} P={p:>9,} G={g}: peak {rec['peak_bytes'] / 2**30:7.2f} GiB{pl}, {secs:7.2f} s "
                f"{ {k: round(v, 2) for k, v in rec['phase_seconds'].items()} }")
        else:
            say(f"  {mode:8s} P={p:>9,} G={g}: {rec['error']}")
        return rec

    out["steps"], out["longest"] = [], {}
    # warm-up at a short prompt so the first measured step carries no one-time costs
    for mode in ("detached", "exact"):
        step(mode, min(step_len, 2 * chunk), min(groups))
    say(f"GRPO steps at P={step_len:,}, R={args.response_len}, chunk {chunk}:")
    for mode in ("detached", "exact"):
        for g in groups:
            out["steps"].append(step(mode, step_len, g))
    gmax = max(groups)
    for mode in ("detached", "exact"):
        say(f"longest prompt, {mode}, G={gmax}:")
        prev = next(r for r in out["steps"] if r["mode"] == mode and r["G"] == gmax)
        runs, stop = [prev], None
        p = step_len
        while stop is None:
            if "error" in prev:
                stop = "memory"
            elif prev["seconds"] > args.max_step_s / 4:
                stop = f"time (next step over {args.max_step_s:.0f} s)"
            elif 2 * p > max_len:
                stop = f"--max-len {max_len}"
            elif time.perf_counter() - t_start + 4 * prev["seconds"] > args.budget_s:
                stop = f"run budget {args.budget_s:.0f} s"
            else:
                p *= 2
                prev = step(mode, p, gmax)
                runs.append(prev)
        ok = [r for r in runs if "peak_bytes" in r]
        entry = {"measured_max": max((r["prompt_len"] for r in ok), default=0), "stopped_by": stop,
                 "runs": runs[1:]}
        if total_mem and args.planner:
            entry["planner_max_for_device"] = plan(
                cfg, prompt_len=step_len, response_len=args.response_len, group=gmax, dtype=dtype_name,
                cfg=longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=chunk), gpu_mem=total_mem).max_prompt_len
        out["longest"][mode] = entry
        say(f"  {mode}: longest measured {entry['measured_max']:,} (stopped by {stop}); planner max for the "
            f"device's memory: {entry.get('planner_max_for_device')}")

    # ---- summary
    def peak(mode, g):
        return next((r.get("peak_bytes") for r in out["steps"] if r["mode"] == mode and r["G"] == g), None)

    for mode in ("detached", "exact"):
        a, b = peak(mode, min(groups)), peak(mode, gmax)
        if a and b:
            say(f"{mode}: peak G={gmax} / G={min(groups)} at P={step_len:,}: {b / a:.3f}")
    measured = [r for r in out["steps"] + [x for e in out["longest"].values() for x in e["runs"]]
                if r.get("planned_bytes") and r.get("peak_bytes")]
    if measured:
        worst = max(abs(r["planned_bytes"] / r["peak_bytes"] - 1) for r in measured)
        say(f"planner vs measured: worst relative error {worst:.1%} over {len(measured)} steps")
    out["wall_s"] = time.perf_counter() - t_start
    say(f"wall {out['wall_s']:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=str)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    raise SystemExit(main())
