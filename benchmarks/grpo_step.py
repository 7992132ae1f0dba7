"""One GRPO step on a tiny dense model, side by side: naive HF, shared-prefix with autograd, LongStraw.

Every configuration runs in a fresh process: a small warm-up step, then the measured step. Peak memory is the
process's peak RSS above its baseline after loading and warm-up on CPU (glibc's mmap threshold fixed so freed
blocks go back to the OS), ``max_memory_allocated`` above the allocation after warm-up on CUDA; it includes the
gradients (allocated up front, as in a step accumulating several groups). Time: a second identical step.

Methods:
  naive     the HF transformers model on the G concatenated prompt+response sequences with autograd (what TRL and
            verl do without sequence parallelism): G x (P + R) tokens through autograd.
  prefix    shared prefix with autograd (the Prefix Grouper / DualKV idea, written here on LongStraw's model): the
            prompt runs once WITH its graph kept, every branch attends to its K/V (a Gated DeltaNet layer: starts
            from its final state), one backward at the end.
  detached  LongStraw, prompt state detached (the published system's mode).
  exact     LongStraw, exact gradients through the prompt.

Usage:
  python benchmarks/grpo_step.py --prompt-len 8192 --response-len 64 --groups 2,4,8
  python benchmarks/grpo_step.py ... --markdown   # also print a markdown table

Prints one JSON line per configuration and a summary with the ratios measured in this run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

METHODS = ("naive", "prefix", "detached", "exact")


def tiny_dense_dir(args) -> str:
    """A random Llama-style checkpoint in a temp dir (built once per run, shared by the workers)."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    import torch

    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=args.prompt_len + args.response_len + 8, rope_theta=500000.0)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    d = tempfile.mkdtemp(prefix="longstraw-bench-")
    model.save_pretrained(d)
    return d


def _inputs(args, g):
    import torch

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (args.prompt_len,), generator=gen)
    responses = [torch.randint(0, args.vocab, (args.response_len,), generator=gen) for _ in range(g)]
    adv = torch.randn(g, generator=gen)
    return prompt, responses, adv


def _naive_step(hf, prompt, responses, adv):
    import torch

    g, p, r = len(responses), prompt.numel(), responses[0].numel()
    seqs = torch.stack([torch.cat([prompt, x]) for x in responses])
    logits = hf(seqs).logits[:, p - 1 : p - 1 + r].float()
    logp = torch.log_softmax(logits, -1).gather(2, torch.stack(responses)[:, :, None])[:, :, 0]
    ratio = torch.exp(logp - logp.detach())
    loss = (-adv[:, None] * ratio).sum() / (g * r)
    loss.backward()


def _prefix_step(model, prompt, responses, adv):
    """Shared prefix with autograd: prompt graph kept, branches attend to its K/V (attention layers) or start from its
    final conv window and recurrent matrix (Gated DeltaNet layers, shared by the batch), one backward."""
    import torch

    from longstraw.models.deltanet import GatedDeltaNet, RecurrentPrefix
    from longstraw.ops.attention import KVSegment
    from longstraw.ops.logprobs import token_logprobs

    p = prompt.numel()
    _, pieces = model.run(prompt[None, :-1], 0, None, need_hidden=False)
    prefix = [RecurrentPrefix(*piece) if isinstance(layer.mixer, GatedDeltaNet) else [KVSegment(*piece)]
              for layer, piece in zip(model.layers, pieces)]
    ids = torch.stack([torch.cat([prompt[-1:], x[:-1]]) for x in responses])
    hidden, _ = model.run(ids, p - 1, prefix)
    w, b = model.head()
    logp, _ = token_logprobs(hidden.reshape(-1, hidden.shape[-1]), w, torch.cat(responses), bias=b)
    ratio = torch.exp(logp - logp.detach()).view(len(responses), -1)
    loss = (-adv[:, None] * ratio).sum() / ratio.numel()
    loss.backward()


def _step_fn(method, model, args, prompt, responses, adv, device):
    import longstraw

    prompt, responses, adv = prompt.to(device), [r.to(device) for r in responses], adv.to(device)
    if method == "naive":
        return lambda: _naive_step(model, prompt, responses, adv)
    if method == "prefix":
        return lambda: _prefix_step(model, prompt, responses, adv)
    cfg = longstraw.GRPOConfig(prompt_grad=method, prefill_chunk=args.chunk, clip_ratio_c=None)
    return lambda: longstraw.grpo_backward(model, prompt, responses, adv, cfg)


def measure_method(step_fn, model, args, prompt, responses, adv, device):
    """``(peak bytes, first step s, second step s, the step)`` of ``args.worker_method``'s step made by ``step_fn``
    (same signature as :func:`_step_fn`): warmed up on a small group (256 prompt tokens, 2 responses), then measured
    twice with :func:`longstraw.profiling.measure_step`; the peak is the first measured step's. The step itself is
    returned for what it recorded (e.g. its engine stats)."""
    from longstraw.profiling import measure_step

    small = min(args.prompt_len, 256)
    warm = step_fn(args.worker_method, model, args, prompt[:small], responses[:2], adv[:2], device)
    step = step_fn(args.worker_method, model, args, prompt, responses, adv, device)
    peak, first = measure_step(step, model.parameters(), device, warmup=warm)
    _, secs = measure_step(step, model.parameters(), device)
    return peak, first, secs, step


def worker(args) -> dict:
    """Peak memory above the post-load baseline and time of one step, in this (fresh) process.

    See :func:`longstraw.profiling.measure_step` (warm-up, gradients allocated up front, heap trimmed); main()
    runs workers with MALLOC_MMAP_THRESHOLD_ fixed so that the resident set follows the live tensors.
    """
    import torch

    import longstraw

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    g = args.worker_g
    prompt, responses, adv = _inputs(args, g)
    if args.worker_method == "naive":
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).to(device)
        model.config._attn_implementation = "sdpa"
    else:
        model = longstraw.load_model(args.ckpt, dtype="float32", device=device)
    model.train()

    peak, first, secs, _ = measure_method(_step_fn, model, args, prompt, responses, adv, device)
    return {"method": args.worker_method, "G": g, "prompt_len": args.prompt_len, "response_len": args.response_len,
            "seconds": round(secs, 4), "first_step_seconds": round(first, 4), "peak_bytes": int(peak)}


def add_model_arguments(ap: argparse.ArgumentParser) -> None:
    """The tiny model, prefill chunk and threads: the flags a worker process is started with (sweep.py too)."""
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=max(1, min(2, os.cpu_count() or 1)))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--groups", default="2,4,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    add_model_arguments(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json-out", default=None, help="write all results to this JSON file")
    ap.add_argument("--markdown", action="store_true")
    ap.add_argument("--worker-method", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-g", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.worker_method:
        print(json.dumps(worker(args)))
        return 0

    args.ckpt = tiny_dense_dir(args)
    results = []
    groups = [int(x) for x in args.groups.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    for m in methods:
        if m not in METHODS:
            raise SystemExit(f"unknown method {m!r}; choose from {', '.join(METHODS)}")
    passthrough = [f"--prompt-len={args.prompt_len}", f"--response-len={args.response_len}", f"--hidden={args.hidden}",
                   f"--layers={args.layers}", f"--heads={args.heads}", f"--kv-heads={args.kv_heads}",
                   f"--vocab={args.vocab}", f"--chunk={args.chunk}", f"--threads={args.threads}",
                   f"--device={args.device}", f"--ckpt={args.ckpt}"]
    for g in groups:
        for m in methods:
            cmd = [sys.executable, __file__, *passthrough, f"--worker-method={m}", f"--worker-g={g}"]
            env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                res = {"method": m, "G": g, "prompt_len": args.prompt_len, "error": proc.stderr.strip()[-300:]}
            else:
                res = json.loads(proc.stdout.strip().splitlines()[-1])
            pred = planned_bytes(m, g, args)
            if pred is not None:
                res["planned_bytes"] = pred
            results.append(res)
            print(json.dumps(res), flush=True)

    summary(results, groups, methods, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


def planned_bytes(method: str, g: int, args) -> int | None:
    """The memory planner's prediction of what the worker measures (gradients + everything above the weights)."""
    import json as _json

    from longstraw.planner import naive_step_bytes, plan

    cfg = _json.loads((Path(args.ckpt) / "config.json").read_text())
    if method == "naive":
        return naive_step_bytes(cfg, args.prompt_len, args.response_len, g, dtype="float32")
    if method in ("detached", "exact"):
        from longstraw import GRPOConfig

        p = plan(cfg, prompt_len=args.prompt_len, response_len=args.response_len, group=g, dtype="float32",
                 cfg=GRPOConfig(prompt_grad=method, prefill_chunk=args.chunk))
        return p.peak_bytes - p.breakdown["weights"] - p.breakdown["optimizer"]
    return None


def summary(results, groups, methods, args):
    by = {(r["method"], r["G"]): r for r in results if "error" not in r}
    print(f"\nmachine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, "
          f"threads={args.threads}, device={args.device}")
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, vocab "
          f"{args.vocab}; prompt {args.prompt_len}, response {args.response_len}, prefill chunk {args.chunk}")
    hdr = "| method | " + " | ".join(f"G={g} peak MiB | G={g} step s" for g in groups) + " |"
    print(hdr)
    print("|" + "---|" * (1 + 2 * len(groups)))
    for m in methods:
        cells = []
        for g in groups:
            r = by.get((m, g))
            cells += [f"{r['peak_bytes'] / 2**20:.1f}", f"{r['seconds']:.3f}"] if r else ["failed", "failed"]
        print(f"| {m} | " + " | ".join(cells) + " |")
    lo, hi = min(groups), max(groups)
    for m in methods:
        a, b = by.get((m, lo)), by.get((m, hi))
        if a and b:
            print(f"{m}: peak(G={hi})/peak(G={lo}) = {b['peak_bytes'] / max(1, a['peak_bytes']):.3f}")
    for r in results:
        if "planned_bytes" in r and "peak_bytes" in r:
            print(f"planner {r['method']} G={r['G']}: planned {r['planned_bytes'] / 2**20:.1f} MiB, measured "
                  f"{r['peak_bytes'] / 2**20:.1f} MiB (ratio {r['planned_bytes'] / max(1, r['peak_bytes']):.3f})")
    for m in ("detached", "exact"):
        n, r = by.get(("naive", hi)), by.get((m, hi))
        if n and r:
            print(f"{m} vs naive at G={hi}: {n['seconds'] / r['seconds']:.2f}x faster, "
                  f"{n['peak_bytes'] / max(1, r['peak_bytes']):.2f}x less peak memory")


if __name__ == "__main__":
    sys.exit(main())
