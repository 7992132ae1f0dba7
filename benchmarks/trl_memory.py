"""One TRL training step, stock ``trl.GRPOTrainer`` against ``LongStrawGRPOTrainer``: peak memory side by side.

Each measurement runs in a fresh process: a tiny random Llama checkpoint and a word-level tokenizer (no downloads)
are written once; the worker builds the trainer (TRL's defaults, except bf16 off on CPU), then runs
``trainer.train()`` for one optimiser step (``max_steps=1``: batch preparation, rewards, advantages, the loss and
its gradient, clipping, AdamW) and reports its peak resident memory above the baseline after construction
(``longstraw.profiling``: VmHWM reset through /proc/self/clear_refs, heap trimmed first, glibc's mmap threshold
fixed so the resident set follows the live tensors). The weights, which both hold once, are in the baseline.

Sampling: ``--sampling rollout`` (default) hands both trainers the same prompt and completions through TRL's
``rollout_func`` (random token ids, so the step is the model work alone); ``--sampling model`` lets each sample
itself (stock: ``model.generate`` on G padded copies of the prompt; LongStraw: ``longstraw.generate`` from one
prompt state), which adds generation to the step.

Usage:
  python benchmarks/trl_memory.py                              # 8,192-token prompt, G = 8: stock vs LongStraw
  python benchmarks/trl_memory.py --cap 1G                     # also the longest prompt each fits under 1 GiB

Prints one JSON line per run and a summary with the ratio and, with --cap, the longest prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from grpo_step import add_model_arguments  # noqa: E402  the tiny model's flags, as the other benchmarks

METHODS = ("stock", "longstraw")


def build_checkpoint(args) -> str:
    """A random Llama-style checkpoint with a word-level tokenizer of exactly ``--vocab`` tokens, in a temp dir."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "<pad>": 1, "<eos>": 2, **{f"w{i}": i for i in range(3, args.vocab)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>")
    cfg = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 2, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads, vocab_size=args.vocab,
                      max_position_embeddings=args.max_positions, rope_theta=500000.0, eos_token_id=2,
                      pad_token_id=1, bos_token_id=None)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg)
    d = tempfile.mkdtemp(prefix="longstraw-trl-bench-")
    model.save_pretrained(d)
    hf_tok.save_pretrained(d)
    return d


def worker(args) -> dict:
    """Peak memory above the post-construction baseline of one ``trainer.train()`` step, in this fresh process."""
    import torch
    import datasets
    import transformers
    import trl

    from longstraw.profiling import current_bytes, peak_window, trim_heap, tune_allocator

    tune_allocator()
    torch.set_num_threads(args.threads)
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    transformers.logging.set_verbosity_error()
    p, g, r = args.worker_prompt_len, args.group, args.response_len
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(3, args.vocab, (p,), generator=gen).tolist()
    completions = [torch.randint(3, args.vocab, (r,), generator=gen).tolist() for _ in range(g)]
    text = " ".join(f"w{t}" for t in prompt)  # the word-level tokenizer maps it back to exactly these ids

    def rollout(prompts, trainer):
        return {"prompt_ids": [prompt for _ in prompts], "completion_ids": [completions[i % g] for i in
                range(len(prompts))], "logprobs": None}

    def reward(completions, **kw):  # differs within the group, so the advantages are not all zero
        return [float(i % 3) for i in range(len(completions))]

    tok = transformers.AutoTokenizer.from_pretrained(args.ckpt)
    targs = trl.GRPOConfig(output_dir=tempfile.mkdtemp(prefix="trl-bench-out-"), per_device_train_batch_size=g,
                           num_generations=g, max_completion_length=r, max_steps=1, bf16=False, report_to="none",
                           save_strategy="no", use_cpu=True, disable_tqdm=True, logging_steps=1,
                           gradient_checkpointing=not args.no_checkpointing)
    common = dict(model=args.ckpt, reward_funcs=reward, args=targs,
                  train_dataset=datasets.Dataset.from_dict({"prompt": [text] * 2}), processing_class=tok,
                  rollout_func=rollout if args.sampling == "rollout" else None)
    if args.worker_method == "stock":
        trainer = trl.GRPOTrainer(**common)
    else:
        from longstraw.integrations.trl import LongStrawGRPOTrainer

        trainer = LongStrawGRPOTrainer(**common, prompt_grad=args.prompt_grad, prefill_chunk=args.chunk)
    device = torch.device("cpu")
    trim_heap()
    base = current_bytes(device)
    t0 = time.perf_counter()
    with peak_window(device) as peak_of:
        out = trainer.train()
        peak = peak_of()
    return {"method": args.worker_method, "prompt_len": p, "G": g, "response_len": r, "sampling": args.sampling,
            "prompt_grad": args.prompt_grad if args.worker_method == "longstraw" else None,
            "peak_bytes": int(peak - base), "seconds": round(time.perf_counter() - t0, 2),
            "loss": float(out.training_loss)}


def run_worker(args, method: str, prompt_len: int) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), *args.passthrough, f"--worker-method={method}",
           f"--worker-prompt-len={prompt_len}"]
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "TRL_EXPERIMENTAL_SILENCE": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.worker_timeout)
    if proc.returncode != 0:
        res = {"method": method, "prompt_len": prompt_len, "error": proc.stderr.strip()[-400:]}
    else:
        res = json.loads(proc.stdout.strip().splitlines()[-1])
    print(json.dumps(res), flush=True)
    return res


def longest_under(args, method: str, cap: int) -> tuple[int, dict | None, bool]:
    """The longest prompt (a multiple of --step) whose measured step peak stays <= cap: doubling from
    --cap-start, then bisection between the last fit and the first miss; stopped at --max-prompt-len (a lower
    bound then, said so in the summary)."""
    fits = lambda res: "error" not in res and res["peak_bytes"] <= cap  # noqa: E731
    lo, lo_res, hi = 0, None, args.cap_start
    while True:
        res = run_worker(args, method, hi)
        if not fits(res):
            break
        lo, lo_res, hi = hi, res, hi * 2
        if hi > args.max_prompt_len:
            return lo, lo_res, True
    while hi - lo > args.step:
        mid = (lo + hi) // 2 // args.step * args.step
        if mid <= lo:
            break
        res = run_worker(args, method, mid)
        if fits(res):
            lo, lo_res = mid, res
        else:
            hi = mid
    return lo, lo_res, False


def parse_size(s: str) -> int:
    units = {"K": 2**10, "M": 2**20, "G": 2**30}
    s = s.strip().upper().removesuffix("IB").removesuffix("B")
    return int(float(s[:-1]) * units[s[-1]]) if s[-1] in units else int(s)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=8192)
    ap.add_argument("--group", type=int, default=8, help="completions per prompt (TRL's num_generations)")
    ap.add_argument("--response-len", type=int, default=64)
    ap.add_argument("--sampling", choices=("rollout", "model"), default="rollout")
    ap.add_argument("--prompt-grad", choices=("exact", "detached"), default="exact")
    ap.add_argument("--no-checkpointing", action="store_true",
                    help="gradient_checkpointing=False (TRL's default is True; both trainers honour it)")
    add_model_arguments(ap)
    ap.add_argument("--max-positions", type=int, default=1 << 20)
    ap.add_argument("--cap", default=None, help="also search the longest prompt each fits under this peak, e.g. 1G")
    ap.add_argument("--cap-start", type=int, default=1024, help="first prompt length of the longest-prompt search")
    ap.add_argument("--step", type=int, default=512, help="resolution of the longest-prompt search (tokens)")
    ap.add_argument("--max-prompt-len", type=int, default=32768,
                    help="stop doubling beyond this (CPU time: an exact step at 32K tokens takes minutes here)")
    ap.add_argument("--worker-timeout", type=int, default=900)
    ap.add_argument("--worker-method", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--worker-prompt-len", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--ckpt", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker_method:
        print(json.dumps(worker(args)))
        return 0

    args.ckpt = build_checkpoint(args)
    args.passthrough = [f"--group={args.group}", f"--response-len={args.response_len}", f"--sampling={args.sampling}",
                        f"--prompt-grad={args.prompt_grad}", f"--hidden={args.hidden}", f"--layers={args.layers}",
                        f"--heads={args.heads}", f"--kv-heads={args.kv_heads}", f"--vocab={args.vocab}",
                        f"--chunk={args.chunk}", f"--threads={args.threads}", f"--ckpt={args.ckpt}",
                        *(["--no-checkpointing"] if args.no_checkpointing else [])]
    mib = lambda b: b / 2**20  # noqa: E731
    side = {m: run_worker(args, m, args.prompt_len) for m in METHODS}
    print(f"\nmodel: Llama hidden {args.hidden}, {args.layers} layers, {args.heads} heads ({args.kv_heads} K/V), vocab "
          f"{args.vocab}, float32; prompt {args.prompt_len:,} tokens, G={args.group}, completions {args.response_len} "
          f"tokens, sampling={args.sampling}, gradient_checkpointing={not args.no_checkpointing}, LongStraw "
          f"prompt_grad={args.prompt_grad}, prefill chunk {args.chunk}")
    if all("error" not in side[m] for m in METHODS):
        s, ls = side["stock"], side["longstraw"]
        print(f"one training step: stock TRL {mib(s['peak_bytes']):.1f} MiB ({s['seconds']} s), LongStraw "
              f"{mib(ls['peak_bytes']):.1f} MiB ({ls['seconds']} s); ratio LongStraw / stock = "
              f"{ls['peak_bytes'] / s['peak_bytes']:.3f}")
    if args.cap:
        cap = parse_size(args.cap)
        for m in METHODS:
            n, res, stopped = longest_under(args, m, cap)
            where = f"{mib(res['peak_bytes']):.1f} MiB, {res['seconds']} s" if res else "none fits"
            bound = " (stopped by --max-prompt-len: a lower bound)" if stopped else ""
            print(f"longest prompt under {args.cap} ({mib(cap):.0f} MiB): {m}: {n:,} tokens ({where}){bound}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
