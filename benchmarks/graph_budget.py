"""Exact mode with a graph budget against the real PrefixGrouper package, side by side in one run.

Three methods on the tiny Llama of ``grpo_step.py`` (same weights, same loss: on-policy GRPO, token-mean, no clip),
each in fresh processes (``grpo_step.py``'s worker protocol and ``profiling.measure_step``: peak RSS above the
post-load baseline with gradients allocated, time of a second identical step):

  prefix_grouper  the ``prefix-grouper`` package (``pip install longstraw[bench]``) on the HF model: prompt and the G
                  responses packed in one sequence, its grouped attention; the prompt's graph is kept whole. It
                  ships a CUDA flash-attention path only; :func:`cpu_attention` is the CPU adapter (PyTorch's
                  scaled_dot_product_attention: causal over the prompt, bottom-right causal for the responses).
  exact           LongStraw exact mode, no graph budget (every prompt step recomputed in the reverse pass).
  exact_budget    LongStraw exact mode with ``graph_budget_bytes`` = PrefixGrouper's measured peak in this run.

Usage:
  python benchmarks/graph_budget.py --prompt-lens 16384,32768 --repeats 3

``--repeats N`` runs every configuration in N fresh processes, the three methods interleaved round by round, and keeps
the fastest (and its peak): on a shared CPU the minimum is the least disturbed run. ``--check`` first compares the gradients of PrefixGrouper and exact mode on a
short prompt (float32).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from grpo_step import _inputs, add_model_arguments, measure_method, tiny_dense_dir  # noqa: E402

METHODS = ("prefix_grouper", "exact", "exact_budget")
ATTN = "longstraw_cpu_sdpa"


def cpu_attention(module, query, key, value, attention_mask, *args, dropout: float = 0.0, scaling=None, **kwargs):
    """PrefixGrouper's attention call on CPU: ``query [b, H, Lq, D]``, ``key/value [b, Hkv, Lk, D]``,
    ``attention_mask [b, Lk]`` (its key padding mask: True = a token). The prompt call has ``Lq = Lk`` (causal); the
    responses' call has ``Lk = prompt + Lq`` keys, the query ``i`` sees keys ``<= Lk - Lq + i`` (flash attention's
    bottom-right causal alignment, what the package's CUDA path computes). Returns ``([b, Lq, H, D], None)`` as
    transformers' attention functions do. Padded groups are not supported here (the benchmark has none)."""
    import torch
    import torch.nn.functional as F

    assert attention_mask is None or bool(attention_mask.all()), "the CPU adapter handles unpadded groups only"
    lq, lk = query.shape[2], key.shape[2]
    gqa = query.shape[1] != key.shape[1]
    if lq == lk:
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling, enable_gqa=gqa)
    else:
        allowed = torch.arange(lk, device=query.device)[None] <= torch.arange(lq, device=query.device)[:, None] + (lk - lq)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=allowed, scale=scaling, enable_gqa=gqa)
    return out.transpose(1, 2).contiguous(), None


def _register():
    from prefix_grouper.utils.register_transformers import register_attention
    from transformers import AttentionInterface

    register_attention()  # the package's "prefix_grouper_attention"
    AttentionInterface.register(ATTN, cpu_attention)


def _pg_model(ckpt, device):
    import torch
    from transformers import AutoModelForCausalLM

    _register()
    hf = AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).to(device)
    hf.config._attn_implementation = "prefix_grouper_attention"
    return hf


def _pg_step(hf, prompt, responses, adv):
    """One GRPO step with PrefixGrouper: the packed sequence ``[prompt, r_1 .. r_G]`` (responses at positions
    ``P..P+R-1`` each), its grouped attention, log-probs of the responses, the same loss as LongStraw's."""
    import torch
    from prefix_grouper import PrefixGrouper

    g, p, r = len(responses), prompt.numel(), responses[0].numel()
    pg = PrefixGrouper([[p] + [r] * g], device=prompt.device)
    ids = torch.cat([prompt, *responses])[None]
    pos = torch.cat([torch.arange(p), torch.arange(p, p + r).repeat(g)]).to(prompt.device)[None]
    hidden = hf.model(input_ids=ids, position_ids=pos, prefix_grouper=pg, prefix_grouper_attn_func=ATTN
                      ).last_hidden_state
    _, _, suffix, _ = pg.split_output(hidden, include_prefix_last=1)  # [G, R + 1, hidden]: prompt[-1], responses
    logits = hf.lm_head(suffix[:, :-1]).float()
    logp = torch.log_softmax(logits, -1).gather(2, torch.stack(responses)[:, :, None])[:, :, 0]
    ratio = torch.exp(logp - logp.detach())
    loss = (-adv[:, None] * ratio).sum() / (g * r)
    loss.backward()


def _step_fn(method, model, args, prompt, responses, adv, device):
    import longstraw
    from longstraw.profiling import PhaseMeter

    prompt, responses, adv = prompt.to(device), [r.to(device) for r in responses], adv.to(device)
    if method == "prefix_grouper":
        return lambda: _pg_step(model, prompt, responses, adv)
    budget = args.budget if method == "exact_budget" else None
    cfg = longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=args.chunk, clip_ratio_c=None,
                               graph_budget_bytes=budget)
    out = {}

    def step():
        meter = PhaseMeter(device)
        s = longstraw.grpo_backward(model, prompt, responses, adv, cfg, meter=meter)
        out.update(phases={k: round(v, 3) for k, v in s.seconds.items()}, kept_graph_bytes=s.kept_graph_bytes,
                   kept_steps=s.kept_steps, kept_layers=s.kept_layers, step_graph_bytes=s.step_graph_bytes)
    step.out = out
    return step


def worker(args) -> dict:
    import torch

    import longstraw

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    prompt, responses, adv = _inputs(args, args.group)
    if args.worker_method == "prefix_grouper":
        model = _pg_model(args.ckpt, device)
    else:
        model = longstraw.load_model(args.ckpt, dtype="float32", device=device)
    model.train()
    peak, first, secs, step = measure_method(_step_fn, model, args, prompt, responses, adv, device)
    res = {"method": args.worker_method, "prompt_len": args.prompt_len, "G": args.group, "R": args.response_len,
           "seconds": round(secs, 3), "first_step_seconds": round(first, 3), "peak_bytes": int(peak)}
    if args.worker_method == "exact_budget":
        res["budget"] = args.budget
    res.update(getattr(step, "out", {}))
    return res


def check_gradients(args) -> float:
    """Max |PG - exact| / max |exact| over all parameter gradients on a short prompt (float32)."""
    import torch

    import longstraw

    p0 = args.prompt_len
    args.prompt_len = args.check_prompt_len
    prompt, responses, adv = _inputs(args, args.group)
    args.prompt_len = p0
    hf = _pg_model(args.ckpt, torch.device("cpu"))
    _pg_step(hf, prompt, responses, adv)
    model = longstraw.load_model(args.ckpt, dtype="float32")
    cfg = longstraw.GRPOConfig(prompt_grad="exact", prefill_chunk=args.chunk, clip_ratio_c=None)
    longstraw.grpo_backward(model, prompt, responses, adv, cfg)
    ours = dict(longstraw.hf_grads(model))
    worst = 0.0
    for name, p in hf.named_parameters():
        if name in ours:
            worst = max(worst, float((p.grad - ours[name]).abs().max() / ours[name].abs().max().clamp_min(1e-30)))
    return worst


def _run_once(passthrough, method, p, budget=None) -> dict:
    cmd = [sys.executable, __file__, *passthrough, f"--prompt-len={p}", f"--worker-method={method}"]
    if budget is not None:
        cmd.append(f"--budget={budget}")
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"method": method, "prompt_len": p, "error": proc.stderr.strip()[-400:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _run_side_by_side(args, passthrough, p) -> list[dict]:
    """The three methods at prompt length ``p``, interleaved (round r runs each method once, so that other load on
    the machine falls on all of them alike); the budget is PrefixGrouper's peak in round 1; per method the fastest
    round is kept, and every round's seconds are listed."""
    best: dict[str, dict] = {}
    budget = None
    for r in range(args.repeats):
        for m in METHODS:
            if m == "exact_budget" and budget is None:
                continue
            res = _run_once(passthrough, m, p, budget if m == "exact_budget" else None)
            print(json.dumps({"round": r + 1, **res}), flush=True)
            if "error" in res:
                best.setdefault(m, res)
                continue
            if m == "prefix_grouper" and budget is None:
                budget = res["peak_bytes"]
            prev = best.get(m)
            rounds = ([] if prev is None or "error" in prev else prev["rounds"]) + [res["seconds"]]
            if prev is None or "error" in prev or res["seconds"] < prev["seconds"]:
                best[m] = res
            best[m]["rounds"] = rounds
    return [best[m] for m in METHODS if m in best]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-lens", default="16384,32768")
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=1, help="fresh processes per configuration; the fastest is kept")
    ap.add_argument("--check", action="store_true", help="compare PrefixGrouper's and exact mode's gradients first")
    ap.add_argument("--check-prompt-len", type=int, default=1024)
    add_model_arguments(ap)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--json-out", default=None)
    ap.add_argument("--prompt-len", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-method", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_method:
        print(json.dumps(worker(args)))
        return 0

    lens = [int(x) for x in args.prompt_lens.split(",")]
    args.prompt_len = max(lens)
    args.ckpt = tiny_dense_dir(args)
    if args.check:
        print(f"gradient check (P={args.check_prompt_len}, float32): max |PG - exact| / max |exact| = "
              f"{check_gradients(args):.2e}", flush=True)
    passthrough = [f"--response-len={args.response_len}", f"--group={args.group}", f"--hidden={args.hidden}",
                   f"--layers={args.layers}", f"--heads={args.heads}", f"--kv-heads={args.kv_heads}",
                   f"--vocab={args.vocab}", f"--chunk={args.chunk}", f"--threads={args.threads}",
                   f"--device={args.device}", f"--ckpt={args.ckpt}"]
    results = []
    for p in lens:
        results += _run_side_by_side(args, passthrough, p)
    summary(results, lens, args)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps({"args": vars(args), "results": results}, indent=2))
    return 0


def summary(results, lens, args):
    by = {(r["method"], r["prompt_len"]): r for r in results if "error" not in r}
    print(f"\nmachine: {platform.machine()} {platform.processor() or ''} {os.cpu_count()} cores, threads={args.threads}, "
          f"device={args.device}, repeats={args.repeats} (interleaved rounds, fastest kept)")
    print(f"model: hidden {args.hidden}, {args.layers} layers, {args.heads} heads / {args.kv_heads} kv, vocab "
          f"{args.vocab}; G={args.group}, R={args.response_len}, prefill chunk {args.chunk}")
    print("| P | method | step s | peak MiB | prefill s | replay s | reverse s | kept graphs MiB | steps kept |")
    print("|---|---|---|---|---|---|---|---|---|")
    for p in lens:
        for m in METHODS:
            r = by.get((m, p))
            if r is None:
                print(f"| {p} | {m} | failed | | | | | | |")
                continue
            ph = r.get("phases", {})
            kept = f"{r['kept_graph_bytes'] / 2**20:.1f}" if "kept_graph_bytes" in r else ""
            steps = f"{r['kept_steps']} + {r['kept_layers']} layers" if "kept_steps" in r else ""
            print(f"| {p} | {m} | {r['seconds']:.2f} | {r['peak_bytes'] / 2**20:.1f} | {ph.get('prefill', 0):.2f} | "
                  f"{ph.get('replay', 0):.2f} | {ph.get('prompt_backward', 0):.2f} | {kept} | {steps} |")
    for p in lens:
        pg, ex, eb = (by.get((m, p)) for m in METHODS)
        if ex and eb:
            print(f"P={p}: exact with budget = PG peak is {ex['seconds'] / eb['seconds']:.2f}x faster than exact "
                  "without one")
        if pg and eb:
            print(f"P={p}: exact with budget vs PrefixGrouper: step time {eb['seconds'] / pg['seconds']:.2f}x, peak "
                  f"{eb['peak_bytes'] / max(1, pg['peak_bytes']):.2f}x")
        if pg and ex:
            print(f"P={p}: exact without budget vs PrefixGrouper: step time {ex['seconds'] / pg['seconds']:.2f}x, "
                  f"peak {ex['peak_bytes'] / max(1, pg['peak_bytes']):.2f}x")


if __name__ == "__main__":
    sys.exit(main())
