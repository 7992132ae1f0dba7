"""Stress run: one GRPO step of a tiny Qwen3.5-style hybrid (Gated DeltaNet + one small full-attention layer) on a
very long prompt, on CPU (or any device), in one fresh process.

The model is ``longstraw.models.qwen_hybrid.tiny_config`` resized so the one O(P^2) attention layer stays
affordable at 1M tokens: hidden 64, 4 layers (3 DeltaNet layers with 2 key / 4 value heads of dim 16, then 1
full-attention layer with 1 query head and 1 K/V head of dim 16), SwiGLU 128, vocabulary 259, float32, random
weights. The prompt and the G responses are random token ids.

Prints the command, the machine, the date, wall time per phase (prefill, replay, prompt_backward, total), the peak
resident set size per phase and for the whole process (Linux ``VmHWM``; per phase via ``/proc/self/clear_refs``),
the RSS after the model is built (the baseline), the stored prompt-state bytes and its gradient buffers' bytes,
and the load average at start and end (other processes sharing the cores slow a run down; the figure says how
much competition there was). glibc keeps freed heap memory resident, so by default the RSS peaks include memory
the allocator retained; run with ``MALLOC_MMAP_THRESHOLD_=65536`` for an RSS that follows the live tensors.

Usage::

    python benchmarks/hybrid_stress.py --mode detached --prompt-len 1048576 --group 8
    python benchmarks/hybrid_stress.py --mode exact --prompt-len 524288 --group 8
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import sys
import time


def _rss_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return 0


def _mib(n_bytes: float) -> str:
    return f"{n_bytes / 2**20:,.1f} MiB"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", choices=["detached", "exact"], required=True)
    ap.add_argument("--prompt-len", type=int, required=True)
    ap.add_argument("--group", type=int, default=8, help="G: responses per prompt")
    ap.add_argument("--response-len", type=int, default=32)
    ap.add_argument("--prefill-chunk", type=int, default=8192)
    ap.add_argument("--branch-batch", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json", default=None, help="also write the result as JSON to this file")
    args = ap.parse_args(argv)

    import torch

    import longstraw
    from longstraw.models.qwen_hybrid import tiny_config

    if args.threads:
        torch.set_num_threads(args.threads)
    env = [f"{k}={os.environ[k]}" for k in ("MALLOC_MMAP_THRESHOLD_", "OMP_NUM_THREADS") if k in os.environ]
    cmd = " ".join(shlex.quote(a) for a in [*env, sys.executable, *sys.argv])
    print(f"command: {cmd}")
    print(f"date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}")
    print(f"machine: {platform.node()} {platform.machine()} {os.cpu_count()} cpus, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads, python {platform.python_version()}")
    load0 = os.getloadavg()
    print(f"load average at start: {load0[0]:.2f} {load0[1]:.2f} {load0[2]:.2f}")

    p, g, r = args.prompt_len, args.group, args.response_len
    cfg = tiny_config(num_attention_heads=1, num_key_value_heads=1, head_dim=16,
                      max_position_embeddings=p + r + 8)
    torch.manual_seed(0)
    model = longstraw.build_model(cfg).to(args.device)
    with torch.no_grad():  # HF-style init: normal(0, 0.02) for projections and embeddings
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding)):
                m.weight.normal_(0, 0.02)
    n_params = sum(q.numel() for q in model.parameters())
    types = [layer.mixer_name for layer in model.layers]
    print(f"model: {n_params:,} parameters, layers {types}")

    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, cfg["vocab_size"], (p,), generator=gen)
    responses = [torch.randint(0, cfg["vocab_size"], (r,), generator=gen) for _ in range(g)]
    adv = torch.randn(g, generator=gen)
    gcfg = longstraw.GRPOConfig(prompt_grad=args.mode, prefill_chunk=args.prefill_chunk,
                                branch_batch=args.branch_batch, clip_ratio_c=None)
    base_kb = _rss_kb("VmRSS")
    print(f"P={p:,} G={g} R={r} prefill_chunk={args.prefill_chunk} mode={args.mode}; "
          f"baseline RSS {_mib(base_kb * 1024)}", flush=True)

    t0 = time.perf_counter()
    stats = longstraw.grpo_backward(model, prompt, responses, adv, gcfg)
    wall = time.perf_counter() - t0
    # each phase resets VmHWM at its start (PhaseMeter), so the process peak is the largest phase peak
    peak_kb = max([_rss_kb("VmHWM")] + [v // 1024 for v in stats.peak_memory.values()])
    load1 = os.getloadavg()

    assert all(torch.isfinite(q.grad).all() for q in model.parameters() if q.grad is not None)
    print(f"loss {stats.loss:.6g}; gradients finite")
    for phase in ("prefill", "replay", "prompt_backward"):
        if phase in stats.seconds:
            print(f"  {phase:16s} {stats.seconds[phase]:9.1f} s   peak RSS {_mib(stats.peak_memory[phase])}")
    print(f"  {'total':16s} {wall:9.1f} s")
    print(f"process peak RSS {_mib(peak_kb * 1024)} (baseline after build {_mib(base_kb * 1024)}, "
          f"peak above baseline {_mib((peak_kb - base_kb) * 1024)})")
    print(f"prompt state {_mib(stats.prompt_state_bytes)}, its gradient buffers {_mib(stats.prompt_state_grad_bytes)}")
    print(f"load average at end: {load1[0]:.2f} {load1[1]:.2f} {load1[2]:.2f}")
    if args.json:
        out = {"command": cmd, "mode": args.mode, "prompt_len": p, "group": g, "response_len": r,
               "prefill_chunk": args.prefill_chunk, "seconds": {**stats.seconds, "wall": wall},
               "peak_rss_bytes": {k: int(v) for k, v in stats.peak_memory.items()},
               "process_peak_rss_bytes": peak_kb * 1024, "baseline_rss_bytes": base_kb * 1024,
               "prompt_state_bytes": stats.prompt_state_bytes, "prompt_state_grad_bytes": stats.prompt_state_grad_bytes,
               "load_average": [load0, load1], "threads": torch.get_num_threads(), "cpus": os.cpu_count()}
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
