"""The torch gated delta rule's backward: plain autograd (every block's graph kept) against block recomputation (the
inputs and one state per block kept, one block's graph re-run at a time), measured side by side in one run.

Two measurements, each method in a fresh process (so the CPU's resident set is the method's own):

``op``   the op alone, forward + backward, at one prefill chunk of a DeltaNet layer's shape (default: the ~1.2B
         Qwen3.5-style hybrid of ``gpu_check.py``, 32 value / 16 key heads of 128, at 4,096 tokens; ``--gate
         channel``: a decay per key channel, Kimi Delta Attention, e.g. Kimi-Linear's 32 heads of 128 with
         ``--key-heads 32``): peak memory above
         the inputs (CPU: resident set with ``MALLOC_MMAP_THRESHOLD_=65536``; CUDA: ``max_memory_allocated``), the
         bytes the call holds for its backward (every storage saved for the backward, counted once), and time.
``step`` one exact-mode GRPO step of a small hybrid (4 layers, 3 of them Gated DeltaNet) on a long prompt: peak
         memory above the post-load baseline and time (``longstraw.profiling.measure_step``), and the phases.

The plain method is the op's ``recompute=False``; in the ``step`` worker it is set for every call by wrapping
``longstraw.ops.deltanet.chunk_gated_delta_rule`` (the models call it through ``gated_delta_rule``), which is what
the benchmark needs and nothing else should do. A gradient check runs first: both methods' gradients of the same
random inputs, max |difference| printed (the ops are the same, so it is expected to be 0 exactly).

Usage::

    MALLOC_MMAP_THRESHOLD_=65536 python benchmarks/delta_rule_recompute.py            # both parts, defaults
    python benchmarks/delta_rule_recompute.py --parts op --tokens 8192 --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

METHODS = ("plain", "recompute")


def _mib(n: float) -> str:
    return f"{n / 2**20:,.1f} MiB"


def _op_inputs(args, torch, dev, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dev, dtype)

    t, hk, hv = args.tokens, args.key_heads, args.heads
    xs = [rand(1, t, hk, args.dk), rand(1, t, hk, args.dk), rand(1, t, hv, args.dv),
          (-0.1 * torch.rand(1, t, hv, *((args.dk,) if args.gate == "channel" else ()), generator=g)).to(
              dev, torch.float32),  # g: log decay (per head or per key channel), fp32 as the models
          torch.rand(1, t, hv, generator=g).to(dev, dtype),  # beta
          torch.randn(1, hv, args.dk, args.dv, generator=g).to(dev, torch.float32)]  # the state entering the chunk
    return [x.requires_grad_() for x in xs]


def _op_call(xs, recompute, chunk=None):
    from longstraw.ops.deltanet import chunk_gated_delta_rule

    o, s = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], recompute=recompute, chunk_size=chunk)
    return (o.float().square().mean() + s.square().mean()), o, s


def op_worker(args) -> dict:
    import torch

    from longstraw import profiling

    dev, dtype = torch.device(args.device), getattr(torch, args.dtype)
    recompute = args.worker == "recompute"
    xs = _op_inputs(args, torch, dev, dtype)
    small = _op_inputs(argparse.Namespace(**{**vars(args), "tokens": 256}), torch, dev, dtype)

    held: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        held.setdefault(st.data_ptr(), st.nbytes())
        return t

    loss, o, s = _op_call(xs, recompute, args.chunk)  # forward once, counting what it keeps for the backward
    del loss, o, s
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss, o, s = _op_call(xs, recompute, args.chunk)
    inputs = {x.untyped_storage().data_ptr() for x in xs}
    held_bytes = sum(n for p, n in held.items() if p not in inputs)  # the inputs are the caller's anyway
    del loss, o, s

    def step():
        loss, _, _ = _op_call(xs, recompute, args.chunk)
        loss.backward()

    peak, secs = profiling.measure_step(step, xs, dev,
                                        warmup=lambda: _op_call(small, recompute, args.chunk)[0].backward())
    return {"method": args.worker, "peak_bytes": peak, "seconds": secs, "held_bytes": held_bytes}


def _hybrid(args, torch):
    import longstraw
    from longstraw.models.qwen_hybrid import tiny_config

    cfg = tiny_config(hidden_size=args.hidden, num_hidden_layers=4, full_attention_interval=4,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=32, intermediate_size=2 * args.hidden,
                      linear_num_key_heads=args.step_key_heads, linear_num_value_heads=args.step_heads,
                      linear_key_head_dim=args.step_dk, linear_value_head_dim=args.step_dk,
                      max_position_embeddings=args.prompt_len + args.response_len + 8)
    torch.manual_seed(0)
    model = longstraw.build_model(cfg).to(args.device)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0, 0.02)
    return cfg, model


def step_worker(args) -> dict:
    import functools

    import torch

    import longstraw
    from longstraw import profiling
    from longstraw.ops import deltanet

    if args.worker == "plain":
        deltanet.chunk_gated_delta_rule = functools.partial(deltanet.chunk_gated_delta_rule, recompute=False)
    dev = torch.device(args.device)
    cfg, model = _hybrid(args, torch)
    gen = torch.Generator().manual_seed(1)
    v = cfg["vocab_size"]
    prompt = torch.randint(0, v, (args.prompt_len,), generator=gen).to(dev)
    responses = [torch.randint(0, v, (args.response_len,), generator=gen).to(dev) for _ in range(args.group)]
    adv = torch.randn(args.group, generator=gen).to(dev)
    gcfg = longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=args.prefill_chunk, clip_ratio_c=None)
    wcfg = longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=64, clip_ratio_c=None)
    stats = {}

    def step():
        stats["s"] = longstraw.grpo_backward(model, prompt, responses, adv, gcfg)

    warm = lambda: longstraw.grpo_backward(model, prompt[:128], responses[:2], adv[:2], wcfg)  # noqa: E731
    peak, secs = profiling.measure_step(step, model.parameters(), dev, warmup=warm)
    s = stats["s"]
    return {"method": args.worker, "peak_bytes": peak, "seconds": secs, "phases": dict(s.seconds),
            "params": sum(p.numel() for p in model.parameters()), "layers": [la.mixer_name for la in model.layers]}


def grad_check(args) -> float:
    """Max |plain - recompute| over every input gradient, at 512 tokens of the op's shape in float64."""
    import torch

    a = argparse.Namespace(**{**vars(args), "tokens": 512})
    got = []
    for recompute in (False, True):
        xs = [x.detach().double().requires_grad_() for x in _op_inputs(a, torch, torch.device("cpu"), torch.float64,
                                                                         seed=3)]
        loss, _, _ = _op_call(xs, recompute, a.chunk)
        got.append(torch.autograd.grad(loss, xs))
    return max(float((p - r).abs().max()) for p, r in zip(*got))


def _spawn(argv: list[str], part: str, method: str) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *argv, "--worker", method, "--worker-part", part]
    out = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if out.returncode != 0:
        return {"method": method, "error": (out.stderr or out.stdout).strip().splitlines()[-1:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="op,step", help="comma list of: op, step")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float64"],
                    help="the op's q/k/v/beta dtype (the step's model is float32)")
    ap.add_argument("--tokens", type=int, default=4096, help="op: tokens in the call (one prefill chunk)")
    ap.add_argument("--heads", type=int, default=32, help="op: value heads")
    ap.add_argument("--key-heads", type=int, default=16, help="op: query/key heads")
    ap.add_argument("--dk", type=int, default=128)
    ap.add_argument("--dv", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=None,
                    help="op: the rule's chunk (default: its own, 64; 16 per key channel is the rule before "
                         "sub-chunks, 2026-12-07)")
    ap.add_argument("--gate", choices=("head", "channel"), default="head",
                    help="op: a log decay per head (Gated DeltaNet) or per key channel (Kimi Delta Attention)")
    ap.add_argument("--prompt-len", type=int, default=16384, help="step: prompt tokens")
    ap.add_argument("--prefill-chunk", type=int, default=4096, help="step: prefill / reverse-pass chunk")
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256, help="step: the hybrid's hidden size")
    ap.add_argument("--step-heads", type=int, default=8, help="step: DeltaNet value heads")
    ap.add_argument("--step-key-heads", type=int, default=4, help="step: DeltaNet query/key heads")
    ap.add_argument("--step-dk", type=int, default=64, help="step: DeltaNet key = value head size")
    ap.add_argument("--repeats", type=int, default=1, help="rounds, methods interleaved; the fastest kept")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--worker", choices=METHODS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-part", choices=("op", "step"), default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    bad = [p for p in parts if p not in ("op", "step")]
    if bad or args.repeats < 1:
        ap.error(f"--parts takes op and/or step (got {bad}); --repeats >= 1 (got {args.repeats})")

    if args.worker is not None:
        import torch

        torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
        res = (op_worker if args.worker_part == "op" else step_worker)(args)
        print(json.dumps(res))
        return 0

    import torch

    own = [a for a in (sys.argv[1:] if argv is None else argv)]
    env = [f"{k}={os.environ[k]}" for k in ("MALLOC_MMAP_THRESHOLD_",) if k in os.environ]
    print("command:", " ".join([*env, "python", "benchmarks/delta_rule_recompute.py", *own]))
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; machine: {platform.machine()} {os.cpu_count()} cpus, "
          f"torch {torch.__version__}, device {args.device}; load average {os.getloadavg()[0]:.2f}")
    diff = grad_check(args)
    print(f"gradient check (float64, 512 tokens, every input): max |plain - recompute| = {diff:.3g}")
    results: dict = {"gradient_max_abs_diff": diff, "args": vars(args)}
    for part in parts:
        rounds = {m: [] for m in METHODS}
        for _ in range(args.repeats):
            for m in METHODS:
                rounds[m].append(_spawn(own, part, m))
        best = {}
        for m in METHODS:
            ok = [r for r in rounds[m] if "error" not in r]
            best[m] = min(ok, key=lambda r: r["seconds"]) if ok else rounds[m][0]
        results[part] = {"rounds": rounds, "best": best}
        if part == "op":
            print(f"op: {args.tokens:,} tokens, {args.heads} value / {args.key_heads} key heads, Dk {args.dk}, "
                  f"Dv {args.dv}, {args.dtype}, a decay per {args.gate}, chunk {args.chunk or 'default'}, "
                  "forward + backward")
        else:
            r0 = best["plain"]
            print(f"step: exact GRPO step, hybrid {r0.get('params', 0):,} parameters {r0.get('layers')}, P "
                  f"{args.prompt_len:,}, chunk {args.prefill_chunk:,}, G {args.group}, R {args.response_len}")
        for m in METHODS:
            r = best[m]
            if "error" in r:
                print(f"  {m:9s} failed: {r['error']}")
                continue
            extra = f", held for backward {_mib(r['held_bytes'])}" if "held_bytes" in r else ""
            if "phases" in r:
                extra += ", phases " + ", ".join(f"{k} {v:.2f} s" for k, v in r["phases"].items())
            print(f"  {m:9s} peak {_mib(r['peak_bytes'])}, {r['seconds']:.2f} s{extra}")
        p, q = best["plain"], best["recompute"]
        if "error" not in p and "error" not in q:
            print(f"  recompute / plain: peak {q['peak_bytes'] / p['peak_bytes']:.3f}x, "
                  f"time {q['seconds'] / p['seconds']:.3f}x")
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(results, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
