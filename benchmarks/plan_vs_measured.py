"""The memory planner against a gpu_check run: plans every GRPO step that section b of a ``gpu_check.py`` JSON
measured (same model, prompt, G, mode, chunk, dtype) on this machine's CPU and prints planned / measured peaks.

  python benchmarks/plan_vs_measured.py docs/gpu/h200_2026-12-04_run2.json

The planner reads nothing of the run: it dry-runs the engine's step on the meta device from the model's config, so
planning after the fact gives what it would have said before. Section b measures the peak above the loaded weights
(CUDA ``max_memory_allocated``) with the model held in its compute dtype alone, so the plan is taken with
``master_dtype`` = that dtype and without weights and optimiser (``gpu_check._plan_step``). Steps the JSON has
without ``checkpoint_layers`` (runs before it was recorded) were run without it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)


def main(argv=None) -> int:
    import gpu_check

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("run", help="a gpu_check.py JSON")
    ap.add_argument("--json", default=None, help="write the rows here too")
    args = ap.parse_args(argv)
    with open(args.run) as f:
        run = json.load(f)
    b = run["sections"]["b"]
    smoke = bool(run.get("smoke"))
    # the model of section b: its config is fixed by gpu_check (only max_position_embeddings follows the run's
    # lengths, which does not change the plan of a prompt that fits)
    cfg = gpu_check.hybrid_config(smoke, 4194304 + 256 if not smoke else 1024 + 32)
    dtype = b["model"]["dtype"]
    chunk = b.get("prefill", {}).get("chunk") or (256 if smoke else 8192)
    rows = list(b.get("steps", {}).get("runs", []))
    rows += [r for m in ("detached", "exact") for r in b.get("longest", {}).get(m, {}).get("runs", [])]
    rows = [r for r in rows if r.get("peak_bytes")]
    cmp_ = b.get("compare", {})
    for method in ("detached", "exact"):
        m = cmp_.get("methods", {}).get(method, {})
        if m.get("peak_bytes"):
            rows.append({"mode": method, "prompt_len": cmp_["prompt_len"], "G": cmp_["G"],
                         "response_len": cmp_["response_len"], "peak_bytes": m["peak_bytes"]})
    out = []
    print(f"{run.get('device', {}).get('name')}, {run.get('date')}: {len(rows)} measured steps, {dtype}, chunk {chunk}")
    for r in rows:
        t0 = time.perf_counter()
        ckpt = bool(r.get("checkpoint_layers", False))
        offload = bool(r.get("offload_state_grad", False))
        kv = bool(r.get("offload_state", False))
        planned = gpu_check._plan_step(cfg, r["mode"], r["prompt_len"], r.get("response_len", 256), r["G"], chunk,
                                       dtype, checkpoint_layers=ckpt, offload=offload, state_offload=kv)
        row = {"mode": r["mode"], "checkpoint_layers": ckpt, "offload_state_grad": offload, "offload_state": kv,
               "prompt_len": r["prompt_len"], "G": r["G"], "measured_bytes": r["peak_bytes"],
               "planned_bytes": planned, "ratio": planned / r["peak_bytes"]}
        out.append(row)
        tag = r["mode"] + ("+ckpt" if ckpt else "") + ("+offload" if offload else "") + ("+kv" if kv else "")
        print(f"{tag:13s} P={r['prompt_len']:>9,} G={r['G']}: measured "
              f"{r['peak_bytes'] / 2**30:7.2f} GiB, planned {planned / 2**30:7.2f} GiB "
              f"({planned - r['peak_bytes']:+,} bytes, {planned / r['peak_bytes']:.4f}x; planned in "
              f"{time.perf_counter() - t0:.1f} s)", flush=True)
    if out:
        ratios = [x["ratio"] for x in out]
        print(f"planned / measured: {min(ratios):.4f}x to {max(ratios):.4f}x over {len(out)} steps")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
