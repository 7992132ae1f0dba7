"""Expert parallelism against FSDP-only sharding of the experts, on CPU gloo ranks, side by side in one run.

    python benchmarks/ep_vs_fsdp.py                      # 4 ranks: ep=1 (FSDP shards the experts) and ep=4
    python benchmarks/ep_vs_fsdp.py --ranks 2 --ep 1 2 --experts 32
    python benchmarks/ep_vs_fsdp.py --ep 1 2 4           # ep=2: each block FSDP-sharded over the 2 ranks holding it

For each ``ep`` the launcher starts ``--ranks`` worker processes (torchrun's environment, gloo, one thread each) on
this file. Every rank builds the same float32 MoE model (Qwen3.5-MoE-style hybrid: Gated DeltaNet + attention
layers, a routed-expert block in every layer) with ``init_distributed(cp=1, fsdp=True, ep=E)``, so the job is
``ranks`` data-parallel replicas, each with its own GRPO group (same shapes, different tokens); after an untimed
warm-up, ``--repeats`` timed ``grpo_backward`` calls (exact mode). Printed per ``ep``, for the slowest rank: the
step time (best repeat), the peak resident memory above the rank's baseline during the step (gradients
included; ``longstraw.profiling.measure_step`` with glibc's mmap threshold fixed), the rank's parameter bytes
(its FSDP shards + its experts under EP: its whole block with ``ep == ranks``, else
its FSDP shard of the block) and the planner's prediction for the same step
(``plan(..., gpus=ranks, ep=E)``: its transient terms plus gradients, which is what the measured window covers).

What to expect: with ep=1 FSDP all-gathers every MoE layer's experts (all of them) before the layer runs, so the
step's peak holds two layers' worth of experts (current + prefetched) and each step all-gathers every expert
weight and reduce-scatters every expert gradient; with ep=E each rank keeps its 1/E of the experts resident and
moves only the routed tokens (two all-to-alls per MoE layer call, forward and backward). On a CPU with fewer
cores than ranks the times mostly show the communication volume; the memory columns are the point.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import torch


def model_config(args) -> dict:
    from longstraw.models.qwen_hybrid import tiny_config

    return tiny_config(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                       hidden_size=args.hidden, num_hidden_layers=args.layers, num_experts=args.experts,
                       num_experts_per_tok=args.top_k, moe_intermediate_size=args.moe_intermediate,
                       shared_expert_intermediate_size=args.moe_intermediate, vocab_size=args.vocab,
                       max_position_embeddings=args.prompt + args.response + 8, tie_word_embeddings=False)


def worker(args) -> None:
    import torch.distributed as dist

    import longstraw
    from longstraw.profiling import measure_step, tune_allocator
    from longstraw.rl.trainer import init_weights

    tune_allocator()
    torch.set_num_threads(1)
    ctx = longstraw.init_distributed(cp=1, fsdp=True, ep=args.ep_size)
    from longstraw.distributed import parallelize
    from longstraw.models.registry import build_model

    torch.manual_seed(0)
    model = build_model(model_config(args))
    init_weights(model, seed=0, std=0.05)  # the same values on every rank, then each keeps its shards / experts
    parallelize(model)
    g = torch.Generator().manual_seed(100 + ctx.rank)  # each replica its own group
    prompt = torch.randint(0, args.vocab, (args.prompt,), generator=g)
    responses = [torch.randint(0, args.vocab, (args.response,), generator=g) for _ in range(args.group)]
    adv = torch.randn(args.group, generator=g)
    cfg = longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=args.chunk)
    params = [p for p in model.parameters() if p.requires_grad]

    def local_bytes(t) -> int:
        t = t.to_local() if hasattr(t, "to_local") else t
        return t.numel() * t.element_size()

    param_bytes = sum(local_bytes(p) for p in model.parameters())
    best = None
    for i in range(args.repeats):
        warm = (lambda: longstraw.grpo_backward(model, prompt[:args.chunk + 1], responses[:1], adv[:1], cfg)) \
            if i == 0 else None
        peak, secs = measure_step(lambda: longstraw.grpo_backward(model, prompt, responses, adv, cfg), params,
                                  torch.device("cpu"), warmup=warm)
        t = torch.tensor([secs, peak], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank sets the pace; the largest peak
        if best is None or t[0] < best[0]:
            best = t
        model.zero_grad(set_to_none=True)
    pb = torch.tensor([param_bytes], dtype=torch.float64)
    dist.all_reduce(pb, op=dist.ReduceOp.MAX)
    if ctx.rank == 0:
        print("RESULT " + json.dumps({"ep": args.ep_size, "seconds": best[0].item(), "peak": best[1].item(),
                                      "param_bytes": pb.item()}), flush=True)
    longstraw.shutdown_distributed()


def planned(args, ep: int) -> dict:
    from longstraw import GRPOConfig
    from longstraw.planner import plan

    pl = plan(model_config(args), prompt_len=args.prompt, response_len=args.response, group=args.group,
              cfg=GRPOConfig(prompt_grad="exact", prefill_chunk=args.chunk), dtype="float32", gpus=args.ranks,
              ep=ep)
    b = pl.breakdown
    # the measured window starts after the weights and optimiser state exist: everything else of the plan
    return {"window": pl.peak_bytes - b["weights"] - b["optimizer"], "params": b["weights"]}


def launch(args) -> None:
    here = Path(__file__).resolve()
    results = []
    for ep in args.ep:
        passthrough = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                       if k not in ("ep", "worker", "ep_size")]
        env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536",
                   PYTHONPATH=str(here.parents[1] / "src"))
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.ranks}",
               str(here), "--worker", f"--ep-size={ep}", *passthrough]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if proc.returncode != 0 or line is None:
            sys.exit(f"ep={ep} failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        results.append({**json.loads(line[len("RESULT "):]), "plan": planned(args, ep)})
    report(args, results)


def report(args, results) -> None:
    mib = 2**20
    print(f"ep_vs_fsdp  {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC  {platform.processor() or platform.machine()}"
          f"  {os.cpu_count()} logical cores  torch {torch.__version__}  gloo, {args.ranks} ranks x 1 thread, "
          f"load {os.getloadavg()[0]:.1f}")
    print(f"model: Qwen3.5-MoE-style hybrid, {args.layers} layers, hidden {args.hidden}, {args.experts} routed experts "
          f"(top-{args.top_k}, intermediate {args.moe_intermediate}) + a shared expert per layer, float32; each rank "
          f"a group of prompt {args.prompt}, G={args.group} x {args.response}, prefill_chunk {args.chunk}, exact; "
          f"best of {args.repeats}, slowest rank")
    print(f"{'ep':>3} {'step s':>8} {'peak MiB':>9} {'planned':>8} {'params MiB':>11} {'planned':>8}")
    for r in results:
        print(f"{r['ep']:>3} {r['seconds']:>8.2f} {r['peak'] / mib:>9.1f} {r['plan']['window'] / mib:>8.1f} "
              f"{r['param_bytes'] / mib:>11.1f} {r['plan']['params'] / mib:>8.1f}")
    base = results[0]
    for r in results[1:]:
        print(f"ep={r['ep']} vs ep={base['ep']}: step time {r['seconds'] / base['seconds']:.2f}x, step peak "
              f"{r['peak'] / base['peak']:.2f}x, parameter bytes per rank {r['param_bytes'] / base['param_bytes']:.2f}x")
    print("peak: resident memory above the rank's baseline (weights, optimiser state) during one step, gradients "
          "included; planned: the planner's peak less its weights and optimizer terms (the same window)")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--ep", type=int, nargs="+", default=[1, 4], help="expert-parallel sizes to compare (1: FSDP)")
    ap.add_argument("--prompt", type=int, default=2048)
    ap.add_argument("--response", type=int, default=32)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--chunk", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-intermediate", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--ep-size", type=int, default=1, help=argparse.SUPPRESS)
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
    else:
        launch(args)


if __name__ == "__main__":
    main()
