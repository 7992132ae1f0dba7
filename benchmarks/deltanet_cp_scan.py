"""What the DeltaNet state scan costs and saves under context parallelism, per layer, on this machine.

    python benchmarks/deltanet_cp_scan.py                       # a Qwen3.5-27B DeltaNet layer, pieces of 512 tokens
    python benchmarks/deltanet_cp_scan.py --hidden 256 --key-heads 2 --value-heads 4 --head-dim 64 --piece 1024
                                                                # the layer of cp_scaling.py --hybrid

Under CP each rank runs its piece of a prefill (or reverse-pass) step through a DeltaNet layer. The hand-off that
the scan replaced (2026-12-05) ran the pieces one rank after the other: rank ``r`` started its mixer when rank
``r - 1``'s had finished, so each run of ``L`` consecutive DeltaNet layers between two full-attention layers (whose
collectives line the ranks up again) finished ``(R - 1) t_mix`` after the first rank (the lag; the FFNs overlap).
The scan runs every piece at once but widens the rule by ``Dk`` value columns (distributed/cp_recurrent.py): each
mixer costs ``t_scan - t_mix`` more, on every rank. Per run of ``L`` layers the scan saves
``(R - 1) t_mix - L (t_scan - t_mix)``.

This script measures ``t_mix`` (the mixer with the plain prefix, the single-process code) and ``t_scan`` (the same
mixer, weights and piece through the scan prefix of the last rank of an ``R``-rank group, rehearsed in this process:
``cp_recurrent.rehearsal_prefix``, the planner's model of a CP rank; the gathers are local copies, no transport),
forward alone (the prefill) and forward + backward (the reverse pass), alternating, best of ``--repeats``; then prints
the saving for ``R`` = 2 .. 32 from the measured times. The saving is a model on measured inputs: the transport of
the gathers (``R (Hv Dk (Dv + Dk) x 4 + (K - 1) C x b)`` bytes per layer and step) and the hand-off's own sends are
left out.
"""

from __future__ import annotations

import argparse
import platform
import time
from datetime import datetime, timezone

import torch

from longstraw.distributed.cp_recurrent import rehearsal_prefix
from longstraw.models.deltanet import GatedDeltaNet, RecurrentPrefix


def main(argv: list[str] | None = None) -> dict:
    """Run, print the tables; returns ``{"times": {phase: {"plain", "scan"}}, "saved": {R: {phase: in t_mix}}}``."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=5120)
    ap.add_argument("--key-heads", type=int, default=16)
    ap.add_argument("--value-heads", type=int, default=48)
    ap.add_argument("--head-dim", type=int, default=128, help="Dk (and Dv unless --value-head-dim)")
    ap.add_argument("--value-head-dim", type=int, default=None)
    ap.add_argument("--piece", type=int, default=512, help="tokens of one rank's piece of a step")
    ap.add_argument("--ranks", type=int, default=8, help="the rehearsed group (the fold's length; small cost)")
    ap.add_argument("--run", type=int, default=3, help="consecutive DeltaNet layers between full-attention layers")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=None, help="torch threads while it runs (default: as set)")
    ap.add_argument("--device", default="cpu", help="e.g. cuda (gpu_check's section b runs it there)")
    args = ap.parse_args(argv)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(args.threads or threads)
        return _run(args)
    finally:
        torch.set_num_threads(threads)  # (gpu_check calls this in its own process)


def _run(args) -> dict:
    dev, dt = torch.device(args.device), getattr(torch, args.dtype)
    dk, dv = args.head_dim, args.value_head_dim or args.head_dim
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    m = GatedDeltaNet(args.hidden, args.key_heads, args.value_heads, dk, dv).to(device=dev, dtype=dt)
    x = torch.randn(1, args.piece, args.hidden, device=dev, dtype=dt) * 0.5
    state = RecurrentPrefix(torch.randn(1, m.conv_dim, m.conv_kernel - 1, device=dev, dtype=dt),
                            torch.randn(1, args.value_heads, dk, dv, device=dev) * 0.1)
    prefixes = {"plain": lambda: state,
                "scan": lambda: rehearsal_prefix(state, args.ranks, args.piece)}

    def forward(kind):
        with torch.no_grad():
            m(x, None, prefixes[kind]())

    def both(kind):
        xg = x.detach().requires_grad_()
        y, (c, s) = m(xg, None, prefixes[kind]())
        torch.autograd.backward([y, s], [torch.ones_like(y), torch.ones_like(s)])
        m.zero_grad(set_to_none=True)

    times = {}
    for kind in ("plain", "scan"):  # warm-up
        forward(kind)
        both(kind)
    for phase, fn in (("forward", forward), ("forward+backward", both)):
        best = {"plain": float("inf"), "scan": float("inf")}
        for _ in range(args.repeats):  # alternate, so that load changes hit both alike
            for kind in ("plain", "scan"):
                sync()
                t0 = time.perf_counter()
                fn(kind)
                sync()
                best[kind] = min(best[kind], time.perf_counter() - t0)
        times[phase] = best
    now = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    where = torch.cuda.get_device_name(dev) if dev.type == "cuda" else f"{torch.get_num_threads()} thread(s)"
    print(f"deltanet_cp_scan  {now}  {platform.machine()}  torch {torch.__version__}  {where}")
    print(f"layer: hidden {args.hidden}, {args.key_heads} key / {args.value_heads} value heads of {dk} / {dv}, "
          f"{args.dtype}; piece {args.piece} tokens; scan rehearsed as the last of {args.ranks} ranks; "
          f"best of {args.repeats}")
    print(f"{'phase':<18}{'t_mix s':>10}{'t_scan s':>10}{'scan/mix':>10}")
    for phase, best in times.items():
        print(f"{phase:<18}{best['plain']:>10.4f}{best['scan']:>10.4f}{best['scan'] / best['plain']:>9.3f}x")
    print(f"per run of {args.run} DeltaNet layers, saved by the scan against the hand-off "
          "((R-1) t_mix - L (t_scan - t_mix), in mixer times t_mix; > 0: the scan is faster):")
    print(f"{'R':>4}" + "".join(f"{phase:>20}" for phase in times))
    saved = {}
    for r in (2, 4, 8, 16, 32):
        saved[r] = {phase: ((r - 1) * best["plain"] - args.run * (best["scan"] - best["plain"])) / best["plain"]
                    for phase, best in times.items()}
        print(f"{r:>4}" + "".join(f"{x:>+14.2f} t_mix" for x in saved[r].values()))
    return {"times": times, "saved": saved}


if __name__ == "__main__":
    main()
