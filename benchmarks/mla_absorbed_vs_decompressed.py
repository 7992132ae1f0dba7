"""MLA over stored latents: the absorbed form against decompressing one chunk of latents at a time, side by side.

One MLA layer (DeepSeek-V3 head dims by default: r = 512, dr = 64, dn = 128, dv = 128; fewer heads and a smaller
hidden size so that it runs on a laptop CPU) attends with new tokens to ``P`` stored prompt latents, in the three
situations the engine creates:

  decode    B branches x 1 new token each (rollout step), forward only
  replay    1 branch x T response tokens, forward + backward, the prompt gradient collected in the state's sink
            (exact mode); detached mode is the same minus the sink writes
  prefill   1 x T prompt tokens (one prefill chunk), forward only (no_grad)

Both forms run the same layer, inputs and state in one process, alternately, after a warm-up; the median of
``--repeat`` timings is reported with the FLOP-model ratio:

  absorbed      per (query, key, head): (r + dr) for the scores + (r + dr) for the output (K = V = latent)
  decompressed  per (query, key, head): (dn + dr) + dv, plus per stored key: H r (dn + dv) for the expansion
  -> decompression pays off once B*T > H r (dn + dv) / (H (2 (r + dr) - (dn + dr + dv)))  (~ 160 at V3 dims)

Usage:
  python benchmarks/mla_absorbed_vs_decompressed.py                   # default sizes (~1-2 min on 2 cores)
  python benchmarks/mla_absorbed_vs_decompressed.py --quick           # smaller, for a smoke test
  python benchmarks/mla_absorbed_vs_decompressed.py --heads 32 --prompt 16384 --json out.json

Prints one line per scenario (ms per call for each form, speed-up of absorbed, FLOP ratio) and the machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import time

import torch

from longstraw.models.context import CallContext
from longstraw.models.mla import LatentState, MLAttention
from longstraw.models.rope import RopeParams, RotaryEmbedding


def build(args, dtype) -> MLAttention:
    torch.manual_seed(0)
    layer = MLAttention(args.hidden, args.heads, q_lora_rank=args.q_lora, kv_lora_rank=args.r,
                        qk_nope_head_dim=args.dn, qk_rope_head_dim=args.dr, v_head_dim=args.dv,
                        scale=(args.dn + args.dr) ** -0.5)
    return layer.to(dtype)


def latent_state(args, dtype) -> LatentState:
    st = LatentState(args.prompt)
    g = torch.Generator().manual_seed(1)
    st.write(torch.randn(1, 1, args.prompt, args.r + args.dr, generator=g).to(dtype), 0, args.prompt)
    return st


def flops(args, b, t, p, backward):
    """(absorbed, decompressed) attention FLOPs of one call over ``p`` stored keys (projections excluded: they are
    the same except the absorbed query/output maps, counted)."""
    h, r, dr, dn, dv = args.heads, args.r, args.dr, args.dn, args.dv
    q = b * t
    absorbed = 2 * q * p * h * 2 * (r + dr) + 2 * q * h * (dn * r + r * dv)
    decompressed = 2 * q * p * h * (dn + dr + dv) + 2 * p * h * r * (dn + dv)
    if backward:  # attention backward ~2.5x forward; the expansion is recomputed and transposed twice
        absorbed *= 3.5
        decompressed = 2 * q * p * h * (dn + dr + dv) * 3.5 + 2 * p * h * r * (dn + dv) * 4
    return absorbed, decompressed


def run_once(layer, st, rope, x, backward):
    if backward:
        st.enable_grad()
        y, _ = layer(x, rope, st.prefix(st.length, grad=True))
        y.sum().backward()
        st.release_grad()
    else:
        with torch.no_grad():
            layer(x, rope, st.prefix(st.length, grad=False))


def scenario(args, layer, st, name, b, t, backward, dtype):
    cos, sin = RotaryEmbedding(RopeParams("default", 10000.0, args.dr, {}))(torch.arange(args.prompt, args.prompt + t),
                                                                            dtype)
    rope = CallContext(args.prompt, t, cos, sin)  # what every layer of one model.run receives
    x = torch.randn(b, t, args.hidden, dtype=dtype, requires_grad=backward)
    times = {"absorbed": [], "decompressed": []}
    for mode in times:  # warm-up
        layer.set_mode(mode)
        run_once(layer, st, rope, x, backward)
    for _ in range(args.repeat):
        for mode in times:
            layer.set_mode(mode)
            layer.zero_grad(set_to_none=True)
            t0 = time.perf_counter()
            run_once(layer, st, rope, x, backward)
            times[mode].append(time.perf_counter() - t0)
    a, d = (statistics.median(times[m]) for m in ("absorbed", "decompressed"))
    fa, fd = flops(args, b, t, args.prompt, backward)
    layer.set_mode("auto")
    pick = layer.choose_form(b, t, st.prefix(st.length, grad=False), grad=backward)
    return {"scenario": name, "B": b, "T": t, "P": args.prompt, "backward": backward,
            "absorbed_ms": round(a * 1e3, 2), "decompressed_ms": round(d * 1e3, 2),
            "absorbed_speedup": round(d / a, 2), "flop_ratio_decomp_over_absorbed": round(fd / fa, 2),
            "absorbed_gflops": round(fa / a / 1e9, 1), "decompressed_gflops": round(fd / d / 1e9, 1),
            "auto_picks": pick, "auto_is_fastest": pick == ("absorbed" if a <= d else "decompressed"),
            "auto_loss": round(max(a, d) / min(a, d), 2) if pick != ("absorbed" if a <= d else "decompressed")
            else 1.0}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--q-lora", type=int, default=384)
    ap.add_argument("--r", type=int, default=512, help="kv_lora_rank")
    ap.add_argument("--dr", type=int, default=64, help="qk_rope_head_dim")
    ap.add_argument("--dn", type=int, default=128, help="qk_nope_head_dim")
    ap.add_argument("--dv", type=int, default=128, help="v_head_dim")
    ap.add_argument("--prompt", type=int, default=8192, help="stored prompt positions P")
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--replay", default="16,128,512", help="response lengths T of the replay scenario")
    ap.add_argument("--prefill", default="512,2048", help="chunk sizes T of the prefill scenario")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    ap.add_argument("--quick", action="store_true", help="P=2048, fewer scenarios")
    ap.add_argument("--json", help="also write the results here")
    args = ap.parse_args(argv)
    if args.quick:
        args.prompt, args.replay, args.prefill, args.repeat = 2048, "16,256", "1024", 2
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    layer, st = build(args, dtype), latent_state(args, dtype)
    plan = [("decode", args.decode_batch, 1, False)]
    plan += [("replay", 1, int(t), True) for t in args.replay.split(",") if t]
    plan += [("prefill", 1, int(t), False) for t in args.prefill.split(",") if t]
    machine = {"date": datetime.date.today().isoformat(), "cpu": platform.processor() or platform.machine(),
               "threads": torch.get_num_threads(), "torch": torch.__version__, "dtype": args.dtype,
               "dims": dict(H=args.heads, hidden=args.hidden, r=args.r, dr=args.dr, dn=args.dn, dv=args.dv)}
    try:
        with open("/proc/cpuinfo") as f:
            machine["cpu"] = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    print(json.dumps(machine))
    results = []
    for name, b, t, bwd in plan:
        res = scenario(args, layer, st, name, b, t, bwd, dtype)
        results.append(res)
        print(json.dumps(res), flush=True)
    print("\n| scenario | B x T over P | absorbed ms | decompressed ms | absorbed speed-up | FLOP ratio (dec/abs) "
          "| auto picks |")
    print("|---|---|---|---|---|---|---|")
    for r in results:
        kind = r["scenario"] + (" fwd+bwd" if r["backward"] else " fwd")
        print(f"| {kind} | {r['B']} x {r['T']} over {r['P']} | {r['absorbed_ms']} | {r['decompressed_ms']} | "
              f"{r['absorbed_speedup']}x | {r['flop_ratio_decomp_over_absorbed']} | {r['auto_picks']}"
              f"{'' if r['auto_is_fastest'] else ' (slower by %.2fx)' % r['auto_loss']} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine, "results": results}, f, indent=2)
    return results


if __name__ == "__main__":
    main()
