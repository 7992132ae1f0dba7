"""Context-parallel scaling on CPU: one GRPO group (exact mode) on 1, 2 and 4 gloo ranks, one thread per rank.

    python benchmarks/cp_scaling.py                      # runs torchrun for each rank count, prints a table
    python benchmarks/cp_scaling.py --ranks 1 2 --prompt 4096
    python benchmarks/cp_scaling.py --ranks 1 2 --window 1024   # sliding-window layers (distributed/cp_window.py)
    python benchmarks/cp_scaling.py --ranks 2 --fsdp on --graph-budget 1G   # kept graphs under FSDP
    python benchmarks/cp_scaling.py --ranks 2 --hybrid --graph-budget 1G    # the DeltaNet hybrid's kept graphs

For each rank count R the launcher starts ``torchrun --nproc_per_node R`` on this file in worker mode. Every rank
builds the same random float32 model (a small dense GQA transformer, weights from a fixed seed), runs one
untimed warm-up group, then ``--repeats`` timed ``grpo_backward`` calls; the table shows the slowest rank's
phase times (best repeat), the per-rank prompt-state bytes and the speed-up over R = 1. R = 1 runs the
single-process engine (``init_distributed(cp=1)`` leaves CP off).

It also times, per layer and prefill step, the two ways to give a piece the K/V of the step's earlier pieces: one
all-gather of every piece's K/V, or a ring of R-1 point-to-point hops; and the query shipping that serves the
stored prefix (all-gather of queries + all-to-all of partial outputs), against all-gathering the stored K/V.

What limits scaling here: the replay is redundant (every rank runs every branch; only its attention over the prompt
is split), the exact reverse pass and prefill split all their work but pay one round of collectives per layer per
step (gloo over loopback TCP: tens of microseconds each, more when ranks share cores), and a machine with C cores
cannot run more than C ranks at once: beyond that, ranks time-share cores and the extra ranks only add
communication and switching.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch


def model_config(args) -> dict:
    if args.hybrid:  # the Qwen3.5 hybrid: 3 Gated DeltaNet layers to 1 full-attention layer
        from longstraw.models.qwen_hybrid import tiny_config

        d = args.hidden // args.heads
        return tiny_config(hidden_size=args.hidden, intermediate_size=3 * args.hidden, num_hidden_layers=args.layers,
                           num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2), head_dim=d,
                           linear_num_key_heads=max(1, args.heads // 2), linear_num_value_heads=args.heads,
                           linear_key_head_dim=d, linear_value_head_dim=d, vocab_size=args.vocab,
                           max_position_embeddings=args.prompt + args.response + 8, tie_word_embeddings=False,
                           dtype="float32")
    kind = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]} if args.window is None else {
        "model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": args.window}
    return {
        **kind, "hidden_size": args.hidden,
        "intermediate_size": 3 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
        "num_key_value_heads": max(1, args.heads // 2), "head_dim": args.hidden // args.heads,
        "vocab_size": args.vocab, "max_position_embeddings": args.prompt + args.response + 8, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "tie_word_embeddings": False, "dtype": "float32",
    }


def build(args):
    import longstraw

    torch.manual_seed(0)
    model = longstraw.build_model(model_config(args))  # after init_distributed: context-parallel placement
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.05) if p.dim() >= 2 else p.fill_(1.0)
    return model.eval()


def group(args):
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=g)
    responses = [torch.randint(0, args.vocab, (args.response,), generator=g) for _ in range(args.group)]
    adv = torch.linspace(-1, 1, args.group)
    return prompt, responses, adv


def _time(fn, repeats: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def comm_costs(ctx, args) -> dict:
    """Per layer and step: K/V of the step's pieces by all-gather vs a ring; stored prefix by query shipping vs
    all-gathering the stored K/V (what one rank would need for the last step)."""
    import torch.distributed as dist

    comm, r = ctx.cp, ctx.cp.size
    hkv, d, hq = max(1, args.heads // 2), args.hidden // args.heads, args.heads
    t = args.chunk
    piece = torch.randn(2, hkv, t, d)
    out = {}
    out["step_kv_allgather_s"] = _time(lambda: comm.all_gather(piece))

    def ring():
        buf, nxt = piece.clone(), torch.empty_like(piece)
        for _ in range(r - 1):  # pass the blocks around: after R-1 hops every rank has seen every piece
            ops = [dist.P2POp(dist.isend, buf, group=comm.group, group_peer=(comm.rank + 1) % r),
                   dist.P2POp(dist.irecv, nxt, group=comm.group, group_peer=(comm.rank - 1) % r)]
            for w in dist.batch_isend_irecv(ops):
                w.wait()
            buf, nxt = nxt, buf

    out["step_kv_ring_s"] = _time(ring)
    q = torch.randn(hq, t, d)
    partial = torch.randn(r, hq, t, d + 1)
    out["stored_query_shipping_s"] = _time(lambda: (comm.all_gather(q), comm.all_to_all(partial)))
    stored = torch.randn(2, hkv, args.prompt // r, d)  # every rank's share of the whole prompt, one layer
    out["stored_kv_allgather_s"] = _time(lambda: comm.all_gather(stored), repeats=2)
    out["bytes"] = {"step_kv_piece": piece.numel() * 4, "queries": q.numel() * 4, "partials": partial.numel() * 4,
                    "stored_kv_share": stored.numel() * 4}
    return out


def worker(args) -> None:
    import torch.distributed as dist

    import longstraw
    from longstraw.units import parse_bytes

    torch.set_num_threads(args.threads)
    ctx = longstraw.init_distributed(cp=int(os.environ["WORLD_SIZE"]),
                                     fsdp=args.fsdp == "on" and int(os.environ["WORLD_SIZE"]) > 1)
    model = build(args)
    prompt, responses, adv = group(args)
    cfg = longstraw.GRPOConfig(prompt_grad=args.mode, prefill_chunk=args.chunk, clip_ratio_c=None,
                               graph_budget_bytes=parse_bytes(args.graph_budget) if args.graph_budget else None)
    warm = longstraw.GRPOConfig(prompt_grad=args.mode, prefill_chunk=64)
    longstraw.grpo_backward(model, prompt[: 64 * ctx.cp_size + 1], responses[:1], adv[:1], warm)
    model.zero_grad(set_to_none=True)
    best = None
    for _ in range(args.repeats):
        cpu0 = time.process_time()
        st = longstraw.grpo_backward(model, prompt, responses, adv, cfg)
        cpu = time.process_time() - cpu0  # this process's CPU seconds (all its threads), whatever else runs
        model.zero_grad(set_to_none=True)
        secs = torch.tensor([st.seconds.get(k, 0.0) for k in ("prefill", "replay", "prompt_backward", "total")],
                            dtype=torch.float64)
        if ctx.cp_size > 1:
            dist.all_reduce(secs, op=dist.ReduceOp.MAX, group=ctx.cp.group)  # the slowest rank sets the pace
        if best is None or secs[3] < best[3]:
            best, best_cpu = secs, cpu
    cpus = ctx.cp.all_gather(torch.tensor([best_cpu], dtype=torch.float64))[:, 0].tolist() if ctx.cp_size > 1 \
        else [best_cpu]
    sizes = torch.tensor([st.prompt_state_bytes, st.prompt_state_grad_bytes], dtype=torch.int64)
    if ctx.cp_size > 1:
        allsizes = ctx.cp.all_gather(sizes).tolist()
        comm = comm_costs(ctx, args)
    else:
        allsizes, comm = [sizes.tolist()], None
    if ctx.rank == 0:
        print("RESULT " + json.dumps({"ranks": ctx.cp_size, "seconds": best.tolist(), "state_bytes": allsizes,
                                      "comm": comm, "cpu": cpus, "kept": [st.kept_steps, st.kept_layers,
                                                                          st.kept_graph_bytes]}), flush=True)
    longstraw.shutdown_distributed()


def launch(args) -> None:
    here = Path(__file__).resolve()
    passthrough = [f"--{k.replace('_', '-')}" + ("" if v is True else f"={v}") for k, v in vars(args).items()
                   if k not in ("ranks", "worker") and v is not None and v is not False]
    results = []
    load = [os.getloadavg()[0]]
    for r in args.ranks:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={r}", str(here),
               "--worker", *passthrough]
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"R={r} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results.append(json.loads(line[len("RESULT "):]))
        load.append(os.getloadavg()[0])
    report(args, results, load)


def report(args, results, load) -> None:
    cores = os.cpu_count()
    print(f"cp_scaling  {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  {platform.processor() or platform.machine()}"
          f"  {cores} logical cores  torch {torch.__version__}  gloo, {args.threads} thread(s) per rank")
    print("1-minute load average before and after each rank count (other processes share the cores when it "
          "exceeds the ranks running): " + ", ".join(f"{x:.1f}" for x in load))
    kind = ("Qwen3.5-hybrid-like (3 DeltaNet : 1 full attention)" if args.hybrid else "llama-like"
            if args.window is None else f"mistral-like (every layer slides, window {args.window})")
    print(f"model: {kind}, {args.layers} layers, hidden {args.hidden}, {args.heads} heads "
          f"({max(1, args.heads // 2)} kv), vocab {args.vocab}, float32; group: prompt {args.prompt}, "
          f"{args.group} x {args.response} response tokens, prefill_chunk {args.chunk}, {args.mode} mode"
          f"{f', graph budget {args.graph_budget} per rank' if args.graph_budget else ''}"
          f"{', FSDP2 over the ranks' if args.fsdp == 'on' else ''}; best of {args.repeats}")
    print(f"{'ranks':>5} {'prefill s':>10} {'replay s':>9} {'reverse s':>10} {'total s':>8} {'speed-up':>9}"
          f" {'CPU s per rank':>22}  state MiB per rank (grad)")
    base = results[0]["seconds"][3]
    for res in results:
        p, rp, b, tot = res["seconds"]
        sizes = ", ".join(f"{s[0] / 2**20:.1f} ({s[1] / 2**20:.1f})" for s in res["state_bytes"])
        cpu = " ".join(f"{c:.2f}" for c in res["cpu"])
        k = res.get("kept") or [0, 0, 0]
        kept = f"  kept {k[0]} steps + {k[1]} layers ({k[2] / 2**20:.1f} MiB, rank 0)" if args.graph_budget else ""
        print(f"{res['ranks']:>5} {p:>10.3f} {rp:>9.3f} {b:>10.3f} {tot:>8.3f} {base / tot:>8.2f}x {cpu:>22}  {sizes}"
              f"{kept}")
    print("wall times are the slowest rank's, per phase, best of the repeats; CPU s: each rank's process CPU time "
          "for that call (compute + communication threads), unaffected by other load: with R ranks on C cores the "
          "wall time is at least max(max CPU s, sum CPU s / C)")
    for res in results:
        c = res["comm"]
        if c is None:
            continue
        kb = {k: v / 1024 for k, v in c["bytes"].items()}
        print(f"R={res['ranks']} per layer and step: step K/V all-gather {c['step_kv_allgather_s'] * 1e6:.0f} us vs "
              f"ring {c['step_kv_ring_s'] * 1e6:.0f} us ({kb['step_kv_piece']:.0f} KiB piece); stored prefix: "
              f"query shipping {c['stored_query_shipping_s'] * 1e6:.0f} us ({kb['queries']:.0f} KiB q + "
              f"{kb['partials']:.0f} KiB partials) vs K/V all-gather {c['stored_kv_allgather_s'] * 1e3:.1f} ms "
              f"({kb['stored_kv_share']:.0f} KiB share)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--response", type=int, default=64)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=2048)
    ap.add_argument("--mode", default="exact", choices=["exact", "detached"])
    ap.add_argument("--fsdp", choices=["on", "off"], default=None,
                    help="on: FSDP2 over the ranks too (every rank on the one prompt: cp = ranks); default off")
    ap.add_argument("--graph-budget", default=None, help="exact mode: keep prompt-step graphs up to this size per "
                    "rank (GRPOConfig.graph_budget_bytes, e.g. 1G); default: none")
    ap.add_argument("--hybrid", action="store_true", help="the Qwen3.5 hybrid (3 Gated DeltaNet layers to 1 full "
                    "attention; its CP state scan: distributed/cp_recurrent.py) instead of the dense model")
    ap.add_argument("--window", type=int, default=None, help="every layer slides with this window (a Mistral-like "
                    "model: the replicated tails and halo exchange of distributed/cp_window.py); default: full")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
