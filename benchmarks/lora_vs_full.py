"""Full fine-tune against LoRA on the same model and prompt: peak memory and step time side by side.

One training step per method: ``longstraw.grpo_backward`` then an AdamW step (``longstraw.rl.optim.make_optimizer``,
the trainer's optimiser, over the parameters that train). Methods (``--methods``):

  full           every parameter trains, exact gradients through the prompt (``prompt_grad="exact"``)
  lora           LoRA rank ``--rank`` on ``--targets`` (default all-linear), base frozen, exact mode
  lora-detached  the same adapters, prompt state detached (``prompt_grad="detached"``)
  full-detached  every parameter trains, detached (not run by default)

Each (method, repeat) runs in a fresh process, the methods interleaved and their order rotated from repeat to
repeat (a shared machine's noise then falls on all of them alike). In the process: the RSS at the start (torch and
LongStraw imported, and the torch modules ``load_model`` imports lazily, ~70 MiB alike for every method; nothing
loaded), ``longstraw.load_model(..., lora=...)``, gradients allocated as zeros (as in a
step accumulating several groups), one small warm-up step (prompt 256, G=2) that also creates AdamW's state, the
heap trimmed, then ``--steps`` measured steps of the full size. Reported per method:

  fixed      the model's memory counted from its tensors: weights (every parameter, adapters included), gradients
             (the trained parameters'), optimiser state (AdamW's moments)
  peak RSS   the process's peak resident set over the measured steps (``VmHWM``, reset after the warm-up), and
             that peak above the start (so: fixed + the step's transients + what loading left behind)
  step s     median over every measured step of every repeat: zero_grad + grpo_backward + AdamW step, wall
             time and this process's CPU time (all threads; with the default one torch thread the CPU time is
             what a shared machine's other processes disturb least), and the CPU time's backward (zero_grad +
             grpo_backward) and AdamW parts
  planned    ``longstraw.planner.plan``'s peak (weights + gradients + optimiser + the step), where the planner
             takes a ``lora=`` keyword for the LoRA rows ("n/a" where it does not)

and the ratios LoRA / full. Workers run with ``MALLOC_MMAP_THRESHOLD_=65536`` (glibc returns freed blocks at once,
the resident set follows the live tensors; see ``longstraw.profiling.tune_allocator``). On CUDA (``--device``)
"RSS" reads as allocated memory (``max_memory_allocated``).

Default model: a random Llama-style dense model of 60M parameters (hidden 512, 8 layers, 8 heads, SwiGLU 1536,
vocabulary 32000, untied head), float32. ``--family qwen3_5`` a random Qwen3.5-style hybrid (``qwen3_5_text``:
Gated DeltaNet layers, every 4th full attention) of the same width; ``--model DIR`` a real checkpoint.

  python benchmarks/lora_vs_full.py                       # defaults: P=1024, G=4, R=64, rank 16, 2 repeats
  python benchmarks/lora_vs_full.py --family qwen3_5 --json-out lora.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))  # uninstalled checkout

METHODS = {"full": ("full", "exact"), "lora": ("lora", "exact"), "lora-detached": ("lora", "detached"),
           "full-detached": ("full", "detached")}
DEFAULT_METHODS = "full,lora,lora-detached"
TIMES = ("step_seconds", "step_cpu_seconds", "backward_cpu_seconds", "optimizer_cpu_seconds")
WARM_PROMPT, WARM_G = 256, 2


# ------------------------------------------------------------------------------------------------- the model
def model_config(args) -> dict:
    """HF config dict of the built-in random model (``--family``)."""
    max_pos = args.prompt_len + args.response_len + 64
    if args.family == "llama":
        from transformers import LlamaConfig

        return LlamaConfig(hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, vocab_size=args.vocab, max_position_embeddings=max_pos,
                           rope_theta=500000.0, tie_word_embeddings=False).to_dict()
    if args.family == "qwen3_5":
        from longstraw.models.qwen_hybrid import tiny_config

        head_dim = args.hidden // args.heads
        return tiny_config(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.intermediate,
                           num_hidden_layers=args.layers, full_attention_interval=4, num_attention_heads=args.heads,
                           num_key_value_heads=args.kv_heads, head_dim=head_dim,
                           linear_num_key_heads=max(1, args.heads // 2), linear_num_value_heads=args.heads,
                           linear_key_head_dim=head_dim, linear_value_head_dim=head_dim, tie_word_embeddings=False,
                           max_position_embeddings=max_pos)
    raise SystemExit(f"unknown --family {args.family!r}; choose llama or qwen3_5")


def build_checkpoint(args) -> str:
    """A random checkpoint of :func:`model_config` in a temp dir (built once per run, read by every worker)."""
    import torch

    import longstraw

    cfg = model_config(args)
    torch.manual_seed(0)
    model = longstraw.build_model(cfg)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0, 0.02)
    d = tempfile.mkdtemp(prefix="longstraw-lora-bench-")
    longstraw.save_model(model, d)
    return d


def lora_spec(args) -> dict:
    targets = args.targets if args.targets == "all-linear" else [t for t in args.targets.split(",") if t]
    return {"rank": args.rank, "alpha": args.alpha if args.alpha is not None else 2 * args.rank,
            "target_modules": targets}


def _inputs(vocab: int, p: int, g: int, r: int):
    import torch

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, vocab, (p,), generator=gen)
    responses = [torch.randint(0, vocab, (r,), generator=gen) for _ in range(g)]
    adv = torch.randn(g, generator=gen)
    return prompt, responses, adv


# ------------------------------------------------------------------------------------------------ one method
def _tensor_bytes(ts) -> int:
    """Bytes of the distinct storages behind ``ts`` (a tied weight counts once)."""
    import torch

    seen, total = set(), 0
    for t in ts:
        if not isinstance(t, torch.Tensor) or t.device.type == "meta":
            continue
        key = (t.untyped_storage().data_ptr(), t.device)
        if key in seen:
            continue
        seen.add(key)
        total += t.untyped_storage().nbytes()
    return total


def worker(args) -> dict:
    """One method in this (fresh) process: fixed bytes, peak, step times (see the module docstring)."""
    import torch

    import longstraw
    from longstraw.profiling import current_bytes, peak_window, trim_heap
    from longstraw.rl.optim import make_optimizer

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    kind, mode = METHODS[args.worker_method]
    # imported lazily by load_model (~70 MiB, sympy among them): not the model's memory, so before the start
    import torch._dynamo
    import torch.distributed.tensor

    trim_heap()
    start = current_bytes(device)

    model = longstraw.load_model(args.ckpt, dtype=args.dtype, master_dtype=args.master_dtype, device=device,
                                 lora=lora_spec(args) if kind == "lora" else None, lora_seed=0)
    model.train()
    loaded = current_bytes(device)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = make_optimizer(params, lr=1e-5, betas=(0.9, 0.999), weight_decay=0.0, eps=1e-8)
    for p in params:
        p.grad = torch.zeros_like(p)
    vocab = model.head()[0].shape[0]
    gcfg = longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=args.chunk, clip_ratio_c=None)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    def step(prompt, responses, adv) -> dict:
        """Wall and CPU seconds (this process's, every thread) of zero_grad + grpo_backward + AdamW."""
        t0, c0 = time.perf_counter(), time.process_time()
        opt.zero_grad(set_to_none=False)
        st = longstraw.grpo_backward(model, prompt, responses, adv, gcfg)
        sync()
        c1 = time.process_time()
        opt.step()
        sync()
        t2, c2 = time.perf_counter(), time.process_time()
        return {"step_seconds": t2 - t0, "step_cpu_seconds": c2 - c0, "backward_cpu_seconds": c1 - c0,
                "optimizer_cpu_seconds": c2 - c1, "phases": st.seconds}

    warm = _inputs(vocab, min(args.prompt_len, WARM_PROMPT), WARM_G, args.response_len)
    step(*(x.to(device) if torch.is_tensor(x) else [r.to(device) for r in x] for x in warm))  # AdamW state made
    prompt, responses, adv = _inputs(vocab, args.prompt_len, args.worker_g, args.response_len)
    prompt, responses, adv = prompt.to(device), [r.to(device) for r in responses], adv.to(device)
    trim_heap()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    ready = current_bytes(device)
    with peak_window(device) as peak_of:
        steps = [step(prompt, responses, adv) for _ in range(args.steps)]
        peak = peak_of()
    phases = [s.pop("phases") for s in steps]

    state_tensors = [v for s in opt.state.values() for v in s.values() if torch.is_tensor(v)]
    fixed = {"weights": _tensor_bytes(model.parameters()), "grads": _tensor_bytes(p.grad for p in params),
             "optimizer": _tensor_bytes(state_tensors)}
    phase_med = {k: round(statistics.median(ph.get(k, 0.0) for ph in phases), 4) for k in phases[0]}
    return {"method": args.worker_method, "prompt_grad": mode, "lora": lora_spec(args) if kind == "lora" else None,
            "prompt_len": args.prompt_len, "G": args.worker_g, "response_len": args.response_len,
            "params": sum(p.numel() for p in model.parameters()), "trained_params": sum(p.numel() for p in params),
            "fixed_bytes": fixed, "fixed_total_bytes": sum(fixed.values()),
            "start_bytes": int(start), "loaded_bytes": int(loaded), "ready_bytes": int(ready),
            "peak_bytes": int(peak), "peak_above_start_bytes": int(peak - start),
            "peak_above_ready_bytes": int(peak - ready),
            **{k: [round(s[k], 4) for s in steps] for k in TIMES}, "phase_seconds_median": phase_med,
            "finite": all(bool(torch.isfinite(p.grad).all()) for p in params)}


# ----------------------------------------------------------------------------------------------- the planner
def planned(args, cfg: dict, method: str):
    """The planner's peak for ``method`` (bytes), "n/a" when ``plan`` takes no ``lora=`` keyword, or an error."""
    import longstraw
    from longstraw.planner import plan

    kind, mode = METHODS[method]
    kw = {"prompt_len": args.prompt_len, "response_len": args.response_len, "group": args.group,
          "dtype": args.dtype or "float32", "cfg": longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=args.chunk)}
    if args.master_dtype:
        kw["master_dtype"] = args.master_dtype
    if kind == "lora":
        kw["lora"] = lora_spec(args)
    try:
        return int(plan(cfg, **kw).peak_bytes)
    except TypeError as e:
        if "lora" in str(e):
            return "n/a"
        return f"error: {type(e).__name__}: {e}"[:200]
    except Exception as e:  # noqa: BLE001 - a planner failure must not lose the measurements
        return f"error: {type(e).__name__}: {e}"[:200]


# ---------------------------------------------------------------------------------------------- the summary
def aggregate(results: list[dict], methods: list[str]) -> dict[str, dict]:
    """Per method over its repeats: medians of the step times (every step) and of the memory figures."""
    out = {}
    for m in methods:
        rs = [r for r in results if r["method"] == m and "error" not in r]
        if not rs:
            out[m] = {"method": m, "error": next((r["error"] for r in results if r["method"] == m), "not run")}
            continue
        steps = [t for r in rs for t in r["step_seconds"]]

        def med(key, rs=rs):
            return int(statistics.median(r[key] for r in rs))

        def med_all(key, rs=rs):  # over every measured step of every repeat
            return statistics.median(t for r in rs for t in r[key])

        out[m] = {"method": m, "runs": len(rs), "params": rs[0]["params"], "trained_params": rs[0]["trained_params"],
                  "fixed_bytes": rs[0]["fixed_bytes"], "fixed_total_bytes": rs[0]["fixed_total_bytes"],
                  "peak_bytes": med("peak_bytes"), "peak_above_start_bytes": med("peak_above_start_bytes"),
                  "peak_above_ready_bytes": med("peak_above_ready_bytes"),
                  "peak_above_start_range": [min(r["peak_above_start_bytes"] for r in rs),
                                             max(r["peak_above_start_bytes"] for r in rs)],
                  **{k: med_all(k) for k in TIMES}, "step_seconds_range": [min(steps), max(steps)],
                  "finite": all(r["finite"] for r in rs)}
        if "planned" in rs[0]:
            out[m]["planned"] = rs[0]["planned"]
    return out


def _mib(x) -> str:
    return f"{x / 2**20:,.1f}"


def _planned_cell(a: dict) -> str:
    p = a.get("planned")
    if isinstance(p, int):
        return f"{_mib(p)} ({p / max(1, a['peak_above_start_bytes']) - 1:+.0%})"
    return "n/a" if p in (None, "n/a") else "error"


def report(agg: dict[str, dict], args) -> str:
    """The markdown table and the LoRA / full ratios."""
    lines = [("| method | trained params | fixed MiB (weights + grads + AdamW) | peak RSS MiB | peak above start MiB "
              "| step transient MiB | planned peak MiB (vs above start) | step s wall | step s CPU | backward s CPU "
              "| AdamW s CPU |"),
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for m, a in agg.items():
        if "error" in a:
            lines.append(f"| {m} | failed: {a['error'][-120:]!r} |" + " |" * 9)
            continue
        f = a["fixed_bytes"]
        lines.append(
            f"| {m} | {a['trained_params']:,} of {a['params']:,} | {_mib(a['fixed_total_bytes'])} ({_mib(f['weights'])}"
            f" + {_mib(f['grads'])} + {_mib(f['optimizer'])}) | {_mib(a['peak_bytes'])} | "
            f"{_mib(a['peak_above_start_bytes'])} | {_mib(a['peak_above_ready_bytes'])} | {_planned_cell(a)} | "
            f"{a['step_seconds']:.2f} | {a['step_cpu_seconds']:.2f} | {a['backward_cpu_seconds']:.2f} | "
            f"{a['optimizer_cpu_seconds']:.3f} |")
    lines.append("")
    pairs = [("lora", "full"), ("lora-detached", "full"), ("lora-detached", "full-detached"),
             ("full-detached", "full")]
    for lo, fu in pairs:
        a, b = agg.get(lo), agg.get(fu)
        if not a or not b or "error" in a or "error" in b:
            continue

        def r(key, a=a, b=b):
            return f"{a[key] / max(1e-9, b[key]):.3f}"

        lines.append(f"- {lo} / {fu}: fixed {r('fixed_total_bytes')}, peak RSS {r('peak_bytes')}, peak above start "
                     f"{r('peak_above_start_bytes')}, step transient {r('peak_above_ready_bytes')}; step time wall "
                     f"{r('step_seconds')}, CPU {r('step_cpu_seconds')} (backward {r('backward_cpu_seconds')}, AdamW "
                     f"{r('optimizer_cpu_seconds')})")
    return "\n".join(lines) + "\n"


def _worker_argv(args) -> list[str]:
    keep = ["prompt_len", "response_len", "rank", "alpha", "targets", "chunk", "threads", "device", "dtype",
            "master_dtype", "steps", "ckpt"]
    out = []
    for k in keep:
        v = getattr(args, k)
        if v is not None:
            out.append(f"--{k.replace('_', '-')}={v}")
    return out


def run_worker(args, method: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *_worker_argv(args), f"--worker-method={method}",
           f"--worker-g={args.group}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
    if proc.returncode != 0:
        return {"method": method, "error": proc.stderr.strip()[-600:]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def run(args, methods: list[str], say=print) -> dict:
    """Every method ``args.repeats`` times in fresh processes, interleaved; returns the results and the summary."""
    own_ckpt = args.model is None
    args.ckpt = args.model or build_checkpoint(args)
    try:
        cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
        plans = {m: planned(args, cfg, m) for m in methods} if args.planner else {}
        results = []
        for rep in range(args.repeats):
            k = rep % len(methods)
            for m in methods[k:] + methods[:k]:
                res = run_worker(args, m)
                res["repeat"] = rep
                if m in plans:
                    res["planned"] = plans[m]
                results.append(res)
                say(json.dumps(res))
        agg = aggregate(results, methods)
    finally:
        if own_ckpt:
            shutil.rmtree(args.ckpt, ignore_errors=True)
    return {"results": results, "summary": agg, "model_config": cfg}


def _model_line(args, cfg: dict, agg: dict) -> str:
    n = next((a["params"] for a in agg.values() if "params" in a), None)
    what = (f"checkpoint {args.model}" if args.model else
            f"random {args.family} (hidden {cfg.get('hidden_size')}, {cfg.get('num_hidden_layers')} layers, "
            f"{cfg.get('num_attention_heads')} heads / {cfg.get('num_key_value_heads')} K/V, SwiGLU "
            f"{cfg.get('intermediate_size')}, vocab {cfg.get('vocab_size')}"
            + (f", layers {''.join('F' if t == 'full_attention' else 'L' for t in cfg['layer_types'])}"
               if "layer_types" in cfg else "") + ")")
    spec = lora_spec(args)
    return (f"model: {what}, {n:,} parameters, {args.dtype or 'config dtype'}; prompt {args.prompt_len}, G "
            f"{args.group}, response {args.response_len}, prefill chunk {args.chunk}; LoRA rank {spec['rank']}, alpha "
            f"{spec['alpha']}, targets {spec['target_modules']}; {args.steps} measured steps x {args.repeats} "
            f"repeats per method")


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--family", default="llama", choices=["llama", "qwen3_5"], help="the built-in random model")
    ap.add_argument("--model", default=None, metavar="DIR", help="a checkpoint directory instead of the random model")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--prompt-len", type=int, default=1024)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--group", type=int, default=4, help="G, responses per prompt")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--alpha", type=float, default=None, help="LoRA alpha (default 2 x rank)")
    ap.add_argument("--targets", default="all-linear", help="'all-linear' or comma-separated module names")
    ap.add_argument("--methods", default=DEFAULT_METHODS, help=f"comma-separated of {', '.join(METHODS)}")
    ap.add_argument("--chunk", type=int, default=512, help="prefill chunk")
    ap.add_argument("--steps", type=int, default=3, help="measured steps per process (after a warm-up)")
    ap.add_argument("--repeats", type=int, default=2, help="fresh processes per method, interleaved")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads (default 1: on a shared machine two OpenMP threads wait on each other at "
                         "every op's barrier whenever one is descheduled, which made steps 2-4x slower and noisy)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", help="compute dtype (a --model's own: pass it)")
    ap.add_argument("--master-dtype", default=None)
    ap.add_argument("--no-planner", dest="planner", action="store_false")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_arguments(ap)
    ap.add_argument("--json-out", default=None, help="write every result and the summary to this JSON file")
    ap.add_argument("--worker-method", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-g", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker_method:
        from longstraw.profiling import tune_allocator

        tune_allocator()  # a no-op when MALLOC_MMAP_THRESHOLD_ is set (run_worker sets it)
        print(json.dumps(worker(args)))
        return 0

    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    t0, load0 = time.time(), os.getloadavg()[0]
    out = run(args, methods)
    agg = out["summary"]
    out["load_average"] = [round(load0, 2), round(os.getloadavg()[0], 2)]
    print(f"\nstarted {started}, wall {time.time() - t0:.0f} s, load average {load0:.2f} at the start, "
          f"{out['load_average'][1]:.2f} at the end; machine: {platform.machine()} {platform.processor() or ''} "
          f"{os.cpu_count()} cores, threads={args.threads}, device={args.device}")
    print(_model_line(args, out["model_config"], agg))
    print(report(agg, args))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "started": started, **out}, indent=2))
    return 0 if all("error" not in a for a in agg.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
