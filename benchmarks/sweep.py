"""Sweep prompt length and G for the four GRPO step methods; the longest prompt each fits under a memory cap.

Every (method, prompt length, G) runs in a fresh process through ``grpo_step.py``'s worker (peak memory above the
post-load baseline, gradients included; time of a second step). Configurations whose naive-step estimate by the
planner exceeds ``--skip-above`` are not run (they would not fit this machine) and are marked so.

Longest prompt under ``--cap`` (G = the largest in ``--groups``): for each method, prompt lengths double from
``--fit-start`` while the measured peak stays under the cap (and the step under ``--fit-max-seconds``, and the
length under ``--fit-max-len``); the last that fit is reported as measured. Where time or length, not memory, ends
the doubling (LongStraw on this CPU), the memory planner's ``max_prompt_len`` for the cap is reported beside it,
marked as predicted.

Writes a markdown table to stdout (and ``--md``), plots to ``--plots`` (PNG), all numbers to ``--json``.

  python benchmarks/sweep.py --prompt-lens 2048,8192,32768 --groups 2,8 --cap 2G --md docs/sweep.md \\
      --plots docs/plots --json docs/sweep.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import grpo_step  # noqa: E402

METHODS = grpo_step.METHODS


def run_one(args, ckpt, method, p, g) -> dict:
    cmd = [sys.executable, str(HERE / "grpo_step.py"), f"--prompt-len={p}", f"--response-len={args.response_len}",
           f"--hidden={args.hidden}", f"--layers={args.layers}", f"--heads={args.heads}",
           f"--kv-heads={args.kv_heads}", f"--vocab={args.vocab}", f"--chunk={args.chunk}",
           f"--threads={args.threads}", f"--ckpt={ckpt}", f"--worker-method={method}", f"--worker-g={g}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    t0 = time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"method": method, "G": g, "prompt_len": p, "error": proc.stderr.strip()[-400:]}
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["wall_s"] = round(time.time() - t0, 1)
    return res


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lens", default="2048,8192,32768")
    ap.add_argument("--groups", default="2,8")
    ap.add_argument("--methods", default=",".join(METHODS))
    ap.add_argument("--response-len", type=int, default=64)
    grpo_step.add_model_arguments(ap)
    ap.add_argument("--cap", default="2G", help="memory cap for the longest-prompt search")
    ap.add_argument("--fit-start", type=int, default=2048)
    ap.add_argument("--fit-max-seconds", type=float, default=60.0)
    ap.add_argument("--fit-max-len", default=None,
                    help="stop the doubling at this prompt length: N for every method, or method=N,method=N")
    ap.add_argument("--skip-above", default="12G", help="do not run configurations the planner puts above this")
    ap.add_argument("--fit-methods", default=None, help="methods for the longest-prompt search (default: --methods)")
    ap.add_argument("--no-sweep", action="store_true", help="only the longest-prompt search")
    ap.add_argument("--reuse", default=None, metavar="LOG",
                    help="a previous run's stdout (JSON lines): configurations measured there are not rerun")
    ap.add_argument("--md", default=None)
    ap.add_argument("--plots", default=None)
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    from longstraw import GRPOConfig
    from longstraw.planner import naive_step_bytes, plan
    from longstraw.units import parse_bytes

    cap = parse_bytes(args.cap, "--cap")
    skip = parse_bytes(args.skip_above, "--skip-above") if args.skip_above is not None else None
    lens = [int(x) for x in args.prompt_lens.split(",")]
    groups = [int(x) for x in args.groups.split(",")]
    methods = args.methods.split(",")
    args.prompt_len = max(lens) * 64  # the checkpoint's max_position_embeddings must cover the fit search
    ckpt = grpo_step.tiny_dense_dir(args)
    cfg = json.loads((Path(ckpt) / "config.json").read_text())
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())

    def estimate(method, p, g):
        if method == "prefix":
            return 0  # no model of it here: always measured
        if method == "naive":
            return naive_step_bytes(cfg, p, args.response_len, g, dtype="float32")
        pl = plan(cfg, prompt_len=p, response_len=args.response_len, group=g, dtype="float32",
                  cfg=GRPOConfig(prompt_grad=method, prefill_chunk=args.chunk))
        return pl.peak_bytes - pl.breakdown["weights"] - pl.breakdown["optimizer"]

    reused = {}
    if args.reuse:
        for line in Path(args.reuse).read_text().splitlines():
            if line.startswith("{") and '"peak_bytes"' in line:
                r = json.loads(line)
                r.pop("fit", None)
                r.pop("planned_bytes", None)
                reused[(r["method"], r["prompt_len"], r["G"])] = r

    def measure(m, p, g):
        r = reused.get((m, p, g))
        if r is None:
            r = run_one(args, ckpt, m, p, g)
        else:
            r = {**r, "reused": args.reuse}
        if m in ("detached", "exact") and "peak_bytes" in r:
            r["planned_bytes"] = estimate(m, p, g)
        return r

    results = []
    for p in ([] if args.no_sweep else lens):
        for g in groups:
            for m in methods:
                est = estimate(m, p, g)
                if est > skip:
                    r = {"method": m, "G": g, "prompt_len": p, "skipped": f"planner estimate {est / 2**30:.1f} GiB"}
                else:
                    r = measure(m, p, g)
                results.append(r)
                print(json.dumps(r), flush=True)

    gmax = max(groups)
    fits, fit_runs = {}, []
    max_len = {}
    for item in (args.fit_max_len or "").split(","):
        if item:
            name, _, n = item.rpartition("=")
            for m in ([name] if name else methods):
                max_len[m] = int(n)
    for m in (args.fit_methods.split(",") if args.fit_methods else methods):
        p, last_ok, stop = args.fit_start, None, "memory"
        while True:
            if estimate(m, p, gmax) > 2 * cap:
                stop = "memory (planner: far over the cap)"
                break
            r = measure(m, p, gmax)
            fit_runs.append(r)
            print(json.dumps({"fit": True, **r}), flush=True)
            if "error" in r or r["peak_bytes"] > cap:
                stop = "memory" if "error" not in r else "error"
                break
            last_ok = r
            if r["seconds"] > args.fit_max_seconds:
                stop = "time"
                break
            if m in max_len and 2 * p > max_len[m]:
                stop = f"--fit-max-len {max_len[m]}"
                break
            p *= 2
        entry = {"measured_max": last_ok["prompt_len"] if last_ok else 0, "stopped_by": stop}
        if m in ("detached", "exact") and stop != "memory":
            kw = dict(response_len=args.response_len, group=gmax, dtype="float32",
                      cfg=GRPOConfig(prompt_grad=m, prefill_chunk=args.chunk))
            b = plan(cfg, prompt_len=args.fit_start, **kw).breakdown
            # the worker measures above the weights and steps no optimiser: the cap applies to the rest
            entry["planned_max"] = plan(cfg, prompt_len=args.fit_start, gpu_mem=cap + b["weights"] + b["optimizer"],
                                        **kw).max_prompt_len
        fits[m] = entry

    text = report(results, fits, fit_runs, lens, groups, methods, args, started)
    print(text)
    if args.md:
        Path(args.md).write_text(text)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "started": started, "results": results,
                                               "fits": fits, "fit_runs": fit_runs}, indent=2))
    if args.plots:
        plot(results, lens, groups, methods, Path(args.plots))
        plot_fit(fit_runs, cap, gmax, Path(args.plots))
    return 0


def _mib(x):
    return f"{x / 2**20:.1f}"


def report(results, fits, fit_runs, lens, groups, methods, args, started) -> str:
    by = {(r["method"], r["prompt_len"], r["G"]): r for r in results}
    out = [f"Machine: {platform.machine()}, {os.cpu_count()} cores, torch threads {args.threads}; started {started}.",
           f"Model: random Llama-style, hidden {args.hidden}, {args.layers} layers, {args.heads} heads / "
           f"{args.kv_heads} K/V heads, vocab {args.vocab}, float32; responses of {args.response_len} tokens; "
           f"prefill chunk {args.chunk}. Peak = MiB above the post-load baseline (gradients included).", ""]
    hdr = "| prompt | G | " + " | ".join(f"{m} peak MiB | {m} s" for m in methods) + " |"
    out += [hdr, "|" + "---|" * (2 + 2 * len(methods))]
    for p in lens:
        for g in groups:
            cells = []
            for m in methods:
                r = by.get((m, p, g), {})
                if "peak_bytes" in r:
                    cells += [_mib(r["peak_bytes"]), f"{r['seconds']:.2f}"]
                else:
                    cells += ["skipped" if "skipped" in r else "failed", "-"]
            out.append(f"| {p} | {g} | " + " | ".join(cells) + " |")
    out += ["", f"Longest prompt under a {args.cap} cap at G={max(groups)}:", "",
            "| method | longest measured | stopped by | planner max |", "|---|---|---|---|"]
    for m in fits:
        f = fits[m]
        out.append(f"| {m} | {f['measured_max']} | {f['stopped_by']} | {f.get('planned_max', '-')} |")
    base = {m: fits[m]["measured_max"] for m in ("naive", "prefix") if m in fits}
    for m in ("detached", "exact"):
        if m not in fits:
            continue
        ours, planned = fits[m]["measured_max"], fits[m].get("planned_max")
        for b, v in base.items():
            if v:
                extra = f"; planner's max under the cap {planned}: {planned / v:.1f}x" if planned else ""
                out.append(f"- {m} / {b}: measured {ours} / {v} = **{ours / v:.0f}x** longer prompt{extra}")
    planner = {(r["method"], r["prompt_len"], r["G"]): r for r in results + fit_runs
               if "planned_bytes" in r and "peak_bytes" in r}
    if planner:
        out += ["", "Planner vs measured (LongStraw rows, sweep and longest-prompt search):", "",
                "| method | prompt | G | measured MiB | planned MiB | error |", "|---|---|---|---|---|---|"]
        for (m, p, g), r in sorted(planner.items(), key=lambda kv: (kv[0][0], kv[0][1], kv[0][2])):
            out.append(f"| {m} | {p} | {g} | {_mib(r['peak_bytes'])} | {_mib(r['planned_bytes'])} | "
                       f"{r['planned_bytes'] / r['peak_bytes'] - 1:+.1%} |")
        worst = max(abs(r["planned_bytes"] / r["peak_bytes"] - 1) for r in planner.values())
        out += ["", f"Worst relative error {worst:.1%} over {len(planner)} configurations."]
    return "\n".join(out) + "\n"


def plot(results, lens, groups, methods, out_dir: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    by = {(r["method"], r["prompt_len"], r["G"]): r for r in results if "peak_bytes" in r}
    g = max(groups)
    for key, label, fname in (("peak_bytes", "peak memory above baseline (MiB)", "sweep_memory.png"),
                              ("seconds", "step time (s)", "sweep_time.png")):
        fig, ax = plt.subplots(figsize=(6, 3.8), dpi=100)
        for m in methods:
            xs = [p for p in lens if (m, p, g) in by]
            ys = [by[(m, p, g)][key] / (2**20 if key == "peak_bytes" else 1) for p in xs]
            if xs:
                ax.plot(xs, ys, marker="o", label=m)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens")
        ax.set_ylabel(label)
        ax.set_title(f"GRPO step, G={g}")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_dir / fname)
        plt.close(fig)


def plot_fit(fit_runs, cap, g, out_dir: Path) -> None:
    """Peak memory against prompt length along the longest-prompt search, with the cap drawn in."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(6, 3.8), dpi=100)
    for m in dict.fromkeys(r["method"] for r in fit_runs):
        rs = sorted((r for r in fit_runs if r["method"] == m and "peak_bytes" in r), key=lambda r: r["prompt_len"])
        if rs:
            ax.plot([r["prompt_len"] for r in rs], [r["peak_bytes"] / 2**20 for r in rs], marker="o", label=m)
    ax.axhline(cap / 2**20, color="k", linestyle="--", linewidth=1, label="cap")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("prompt tokens")
    ax.set_ylabel("peak memory above baseline (MiB)")
    ax.set_title(f"Longest prompt under the cap, G={g}")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out_dir / "sweep_fit.png")
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
