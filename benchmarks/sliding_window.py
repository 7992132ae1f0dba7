"""Sliding-window attention against full attention, side by side in one run: a GRPO step's time per phase and its
prompt-state bytes.

Two models with the same weights, built from one Mistral-style config: every layer attends a sliding window of
``--window`` positions (LongStraw's tiled op, ``ops/window.py``, and the trimmed state, ``state.SlidingKVState``),
or every layer attends everything (the same config with ``sliding_window`` null: what the engine ran before
windows were implemented, and the cost a window saves). For each prompt length and mode (exact, detached) one
``grpo_backward`` of G branches runs per model, the two alternating, ``--repeats`` rounds; the fastest round of
each is printed with its phase times (``GRPOStats.seconds``) and its prompt-state (and state-gradient) bytes, and
the ratios window / full.

What to expect: per prompt token, attention costs O(window) instead of O(position), so the prefill and exact mode's
reverse pass shrink towards the projections' and MLP's share as the prompt grows; a sliding layer keeps ``W - 1``
positions per prefill step in exact mode (the reverse pass reads each boundary again) and about ``W`` positions in
all in detached mode, instead of every position.

``--op-windows W1,W2,..``: instead, the attention op alone (``segment_attention``, forward + backward, float32):
``--op-queries`` queries over ``--op-stored`` stored keys (with gradient sinks, as the exact mode's state) and their
own, 8 query / 2 K/V heads of 32, full attention against each window; fastest of 2.

Usage:
  python benchmarks/sliding_window.py --prompt-lens 8192,16384 --window 1024 --repeats 2
  python benchmarks/sliding_window.py --op-windows 128,512,1024,2048,4096
"""

from __future__ import annotations

import argparse
import json
import platform
import time


def config(window: int | None, args) -> dict:
    return {"model_type": "mistral", "vocab_size": 1024, "hidden_size": args.hidden, "intermediate_size":
            2 * args.hidden, "num_hidden_layers": args.layers, "num_attention_heads": args.heads,
            "num_key_value_heads": max(1, args.heads // 4), "head_dim": args.hidden // args.heads,
            "max_position_embeddings": 1 << 22, "sliding_window": window, "tie_word_embeddings": False}


def op_bench(windows: list[int], t: int, p: int) -> dict:
    """Seconds (forward, forward + backward) of the op for full attention and each window (module docstring)."""
    import torch

    from longstraw.ops.attention import KVSegment, segment_attention

    torch.manual_seed(0)
    q = torch.randn(1, 8, t, 32, requires_grad=True)
    pk, pv = torch.randn(1, 2, p, 32), torch.randn(1, 2, p, 32)
    kg, vg = torch.zeros_like(pk), torch.zeros_like(pv)
    k, v = torch.randn(1, 2, t, 32, requires_grad=True), torch.randn(1, 2, t, 32, requires_grad=True)
    out = {}
    for w in [None, *windows]:
        best = (float("inf"), float("inf"))
        for _ in range(2):
            t0 = time.perf_counter()
            o = segment_attention(q, [KVSegment(pk, pv, k_grad=kg, v_grad=vg), KVSegment(k, v, causal=True)],
                                  32 ** -0.5, window=w)
            fwd = time.perf_counter() - t0
            o.sum().backward()
            best = min(best, (fwd, time.perf_counter() - t0))
        out["full" if w is None else str(w)] = {"forward_s": best[0], "forward_backward_s": best[1]}
        print(f"{'full' if w is None else f'window {w}'}: forward {best[0]:.3f} s, forward + backward "
              f"{best[1]:.3f} s")
    return out


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompt-lens", default="8192,16384", help="comma-separated prompt lengths")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--group", type=int, default=2, help="G, branches per group")
    ap.add_argument("--response-len", type=int, default=128)
    ap.add_argument("--chunk", type=int, default=4096, help="prefill chunk")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", default="exact,detached")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--op-windows", default=None, help="time the attention op alone for these windows (see above)")
    ap.add_argument("--op-queries", type=int, default=4096)
    ap.add_argument("--op-stored", type=int, default=12288)
    args = ap.parse_args(argv)

    import torch

    import longstraw

    if args.op_windows:
        print(f"segment_attention: {args.op_queries} queries over {args.op_stored} stored keys and their own")
        out = {"machine": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "op": op_bench([int(x) for x in args.op_windows.split(",")], args.op_queries, args.op_stored)}
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(out, fh, indent=2)
        return out

    torch.manual_seed(0)
    windowed = longstraw.build_model(config(args.window, args))
    full = longstraw.build_model(config(None, args))
    full.load_state_dict(windowed.state_dict())
    lens = [int(x) for x in args.prompt_lens.split(",")]
    g = torch.Generator().manual_seed(1)
    out = {"machine": platform.platform(), "torch": torch.__version__, "threads": torch.get_num_threads(),
           "args": vars(args), "runs": []}
    print(f"tiny Mistral-style model: {args.layers} layers, hidden {args.hidden}, {args.heads} heads, float32; "
          f"window {args.window}; G={args.group}, responses {args.response_len}, chunks {args.chunk}")
    for p in lens:
        prompt = torch.randint(0, 1024, (p,), generator=g)
        responses = [torch.randint(0, 1024, (args.response_len,), generator=g) for _ in range(args.group)]
        adv = torch.linspace(-1, 1, args.group)
        for mode in args.modes.split(","):
            cfg = longstraw.GRPOConfig(prompt_grad=mode, prefill_chunk=args.chunk)
            best = {}
            for _ in range(args.repeats):
                for name, model in (("window", windowed), ("full", full)):
                    model.zero_grad(set_to_none=True)
                    t0 = time.perf_counter()
                    st = longstraw.grpo_backward(model, prompt, responses, adv, cfg)
                    total = time.perf_counter() - t0
                    if name not in best or total < best[name]["seconds"]:
                        best[name] = {"seconds": total, "phases": dict(st.seconds),
                                      "state_bytes": st.prompt_state_bytes,
                                      "state_grad_bytes": st.prompt_state_grad_bytes}
            rec = {"prompt_len": p, "mode": mode, **best,
                   "time_ratio": best["window"]["seconds"] / best["full"]["seconds"],
                   "state_ratio": best["window"]["state_bytes"] / best["full"]["state_bytes"]}
            out["runs"].append(rec)
            w, f = best["window"], best["full"]
            phases = ", ".join(f"{k} {w['phases'].get(k, 0):.2f}/{f['phases'].get(k, 0):.2f}"
                               for k in sorted(set(w["phases"]) | set(f["phases"])))
            print(f"P={p:,} {mode}: step {w['seconds']:.2f} s window, {f['seconds']:.2f} s full "
                  f"(x{rec['time_ratio']:.2f}); phases window/full s: {phases}; state "
                  f"{w['state_bytes'] / 2**20:.1f} / {f['state_bytes'] / 2**20:.1f} MiB (x{rec['state_ratio']:.3f})"
                  + (f", state grad {w['state_grad_bytes'] / 2**20:.1f} / {f['state_grad_bytes'] / 2**20:.1f} MiB"
                     if mode == "exact" else ""))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(out, fh, indent=2)
    return out


if __name__ == "__main__":
    main()
