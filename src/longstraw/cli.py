"""``longstraw`` command line: demo, train, config, generate, score, plot, plan.

Every user error (a bad value, a missing file, a config key that does not exist, an option the subcommand does not
have) is one line on stderr and exit code 2 (argparse's own errors add the subcommand's usage line); everything is
checked before anything is written, so nothing already written is touched. An ``OSError`` that reaches ``main``
(a full disk, a read-only directory) is reported the same way, as ``<file>: <reason>``. Under ``torchrun``
(``torchrun --nproc_per_node N -m longstraw train ...``) an error every rank raises alike is printed by rank 0 only.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path


def _job_rank() -> int:
    """This process's rank in a torchrun job (``RANK``), 0 otherwise."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _fail(msg: str) -> int:
    print(f"longstraw: error: {msg}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------- demo


DEMO_WARMUP_LR = 3e-3  # the supervised warm-up's AdamW learning rate (1e-2 stalled below 75% copying in trials)
DEMO_EVAL_MAX_LEN = 65536  # held-out evaluation lengths above this are skipped (dense attention: O(P^2) prefill)


def demo_steps(args) -> int:
    """150 GRPO steps at prompts up to 8K tokens (a few minutes on 2 cores); fewer for longer prompts, whose steps
    cost more (the O(P^2) attention), unless --steps says otherwise."""
    if args.steps is not None:
        return args.steps
    return 150 if args.prompt_len <= 8192 else max(2, 150 * 2048 // args.prompt_len)


def demo_eval_lengths(prompt_len: int, prompts: int | None = None) -> list[tuple[int, int]]:
    """(length, held-out prompts) of the demo's evaluation: the training length and 4x and 16x it, up to
    ``DEMO_EVAL_MAX_LEN`` tokens (the training length always); ``prompts`` at each, or by default fewer at longer
    lengths (32 at 4K tokens and below, 8 at 16K, 2 at 64K)."""
    out = []
    for k in (1, 4, 16):
        n = prompt_len * k
        if k == 1 or n <= DEMO_EVAL_MAX_LEN:
            out.append((n, prompts or max(2, min(32, 131072 // n))))
    return out


def demo_config(args):
    from longstraw.rl.config import RunConfig, apply_overrides

    out = args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    sets = [
        # the GRPO phase at the long prompt, after a supervised warm-up on short prompts (longstraw.rl.warmup):
        # a one-digit pass key (exact match), 4 prompts of G responses per step
        'data.task="passkey"',
        "data.answer_digits=1",
        'reward.fn="exact_match"',
        "rollout.max_new_tokens=2",
        "optim.lr=3e-3",
        "algorithm.prompts_per_step=4",
        "algorithm.prefill_chunk=4096",
        f"model.builtin={json.dumps(args.model)}",
        f"data.prompt_len={args.prompt_len}",
        f"data.max_prompt_len={max(args.prompt_len, 16)}",
        f"rollout.group_size={args.group_size}",
        f"algorithm.prompt_grad={json.dumps(args.prompt_grad)}",
        f"train.steps={demo_steps(args)}",
        f"train.out_dir={json.dumps(out)}",
        f"train.progress={'true' if not args.no_progress else 'false'}",
    ]
    return apply_overrides(RunConfig(), sets + list(args.set or []))


def _demo_warm_model(cfg, args, run_dir: Path, max_len: int) -> tuple[Path, object]:
    """The built-in model, warmed up on short prompts (``--warmup-steps``), saved as ``RUN/warmup_model``; returns
    its directory and the :class:`~longstraw.rl.warmup.WarmupResult` (None without a warm-up)."""
    import torch

    from longstraw.checkpoint.hf import save_model
    from longstraw.models.registry import build_model
    from longstraw.rl.trainer import builtin_model_config, init_weights
    from longstraw.rl.warmup import supervised_warmup
    from longstraw.tokenizer import ByteTokenizer

    tok = ByteTokenizer()
    hf = builtin_model_config(cfg.model.builtin, tok.vocab_size, max_len + cfg.rollout.sampling.max_new_tokens + 1)
    torch.manual_seed(cfg.train.seed)
    model = build_model(hf)
    init_weights(model, cfg.train.seed)
    res = None
    if args.warmup_steps:
        res = supervised_warmup(model, tok, task=cfg.data.task, steps=args.warmup_steps, seed=cfg.train.seed,
                                lr=DEMO_WARMUP_LR, until_solved=args.warmup_until or None,
                                on_check=lambda step, solved, loss: print(
                                    f"warm-up step {step}/{args.warmup_steps}: answer loss {loss:.2f}, greedy solved "
                                    f"{solved:.0%} of the check prompts (stops at {args.warmup_until:.0%})",
                                    flush=True),
                                answer_digits=cfg.data.answer_digits)
    d = run_dir / "warmup_model"
    save_model(model, d)
    tok.save(d)
    return d, res


def cmd_demo(args) -> int:
    from longstraw.checkpoint.hf import load_model
    from longstraw.planner import naive_step_bytes
    from longstraw.rl.config import apply_overrides
    from longstraw.rl.trainer import Trainer
    from longstraw.rl.warmup import length_table, solved_rate
    from longstraw.tokenizer import ByteTokenizer

    if args.warmup_steps < 0:
        return _fail(f"--warmup-steps={args.warmup_steps} must be >= 0")
    if not 0 <= args.warmup_until <= 1:
        return _fail(f"--warmup-until={args.warmup_until} must be a fraction in [0, 1] (0: no stopping check)")
    if args.eval_prompts is not None and args.eval_prompts < 1:
        return _fail(f"--eval-prompts={args.eval_prompts} must be >= 1")
    cfg = demo_config(args)
    run_dir = Path(cfg.train.out_dir)
    if (run_dir / "metrics.jsonl").exists() or (run_dir / "warmup_model").exists():
        return _fail(f"run directory {str(run_dir)!r} already holds a run; choose another --out")
    evals = demo_eval_lengths(cfg.data.prompt_len, args.eval_prompts)
    print(f"LongStraw demo: a built-in {cfg.model.builtin} model, synthetic '{cfg.data.task}' task "
          f"({cfg.data.answer_digits}-digit key); up to {args.warmup_steps} supervised warm-up steps on short "
          f"prompts, then "
          f"GRPO at {cfg.data.prompt_len}-token prompts, G={cfg.rollout.group_size}, {cfg.train.steps} steps, "
          f"prompt_grad={cfg.algorithm.grpo.prompt_grad.value} -> {run_dir}", flush=True)
    t0 = time.time()
    model_dir, warm = _demo_warm_model(cfg, args, run_dir, max(n for n, _ in evals))
    warm_s = time.time() - t0
    tok = ByteTokenizer()
    opts = {"answer_digits": cfg.data.answer_digits}
    task = cfg.data.task

    def measure(model) -> list[float]:
        return [solved_rate(model, tok, task, n, k, seed=cfg.train.seed, **opts) for n, k in evals]

    te = time.time()
    before = measure(load_model(model_dir))
    eval_s = time.time() - te
    print(f"before GRPO: greedy solved {before[0]:.1%} of {evals[0][1]} held-out {evals[0][0]}-token prompts "
          f"({eval_s:.0f} s of evaluation)", flush=True)
    cfg = apply_overrides(cfg, [f"model.path={json.dumps(str(model_dir))}"])
    tg = time.time()
    trainer = Trainer(cfg, resume=False)
    s = trainer.train()
    grpo_s = time.time() - tg
    te = time.time()
    after = measure(trainer.model)
    eval_s += time.time() - te
    naive = naive_step_bytes(trainer.model, s.prompt_len, cfg.rollout.sampling.max_new_tokens, cfg.rollout.group_size)
    rows = [{"length": n, "prompts": k, "before": b, "after": a} for (n, k), b, a in zip(evals, before, after)]
    summary = {"prompt_len": s.prompt_len, "group_size": s.group_size, "model": cfg.model.builtin,
               "warmup_steps": warm.steps if warm else 0, "warmup_seconds": warm_s,
               "warmup_until": args.warmup_until, "warmup_stopped_early": warm.stopped_early if warm else None,
               "warmup_short_len": warm.short_len if warm else None,
               "warmup_short_solved": warm.short_solved if warm else None,
               "warmup_loss_first": warm.loss_first if warm else None,
               "warmup_loss_last": warm.loss_last if warm else None,
               "grpo_steps": s.steps, "grpo_seconds": grpo_s, "signal_steps": s.signal_steps,
               "eval_prompts": evals[0][1], "solved_before": before[0], "solved_after": after[0],
               "sampled_solved_first10": s.solved_first, "sampled_solved_last10": s.solved_last,
               "reward_first10": s.reward_first, "reward_last10": s.reward_last, "eval": rows,
               "eval_seconds": eval_s, "total_seconds": time.time() - t0,
               "peak_above_start_bytes": s.peak_above_start_bytes, "peak_memory_bytes": s.peak_memory_bytes,
               "naive_step_bytes": naive}
    from longstraw.rl.plots import DEMO_SUMMARY

    (run_dir / DEMO_SUMMARY).write_text(json.dumps(summary, indent=1) + "\n")
    if cfg.train.plots:  # redrawn with the naive step's estimate and the before/after evaluation
        from longstraw.rl.plots import plot_run

        s.plots = plot_run(s.run_dir, naive_bytes=naive)
    print("\n=== LongStraw demo summary ===")
    print(f"prompt length      {s.prompt_len} tokens")
    print(f"group size G       {s.group_size}")
    if warm:
        why = (f"stopped when greedy decoding solved >= {args.warmup_until:.0%} of the check prompts"
               if warm.stopped_early else
               f"all of --warmup-steps; {args.warmup_until:.0%} of the check prompts never solved"
               if args.warmup_until else "all of --warmup-steps")
        print(f"warm-up            {warm.steps} supervised steps on {warm.short_len}-token-or-shorter prompts in "
              f"{warm_s:.0f} s ({why}; answer loss {warm.loss_first:.2f} -> {warm.loss_last:.2f}; greedy solved "
              f"{warm.short_solved:.0%} of held-out prompts at {warm.short_len} tokens)")
    else:
        print("warm-up            none (--warmup-steps 0)")
    print(f"steps              {s.steps} in {grpo_s:.0f} s (the GRPO phase; {time.time() - t0:.0f} s in all, "
          f"{eval_s:.0f} s of it evaluation)")
    print(f"steps with a learning signal: {s.signal_steps} of {s.steps} (a group's rewards not all equal)")
    print(f"exactly solved: {before[0]:.0%} -> {after[0]:.0%} (greedy, {evals[0][1]} held-out {s.prompt_len}-token "
          f"prompts: after the warm-up, before GRPO -> after GRPO)")
    print(f"reward             first 10 steps {s.reward_first:.3f} -> last 10 steps {s.reward_last:.3f} "
          f"(reward '{cfg.reward.fn}'; sampled responses solved: {s.solved_first:.1%} -> {s.solved_last:.1%})")
    print("held-out evaluation (greedy, exactly solved):")
    for line in length_table(rows):
        print(line)
    print(f"peak memory        {s.peak_above_start_bytes / 2**20:.0f} MiB above the post-load baseline measured "
          f"(process peak {s.peak_memory_bytes / 2**20:.0f} MiB), vs {naive / 2**20:.0f} MiB estimated for one naive "
          f"full-graph GRPO step on G x (P + R) tokens (planner dry run)")
    print(f"run directory      {s.run_dir}  (metrics.jsonl, {DEMO_SUMMARY}, config.toml, warmup_model/, "
          "checkpoints/)")
    if s.plots:
        print(f"plots              {', '.join(str(p) for p in s.plots)}")
    return 0


# ---------------------------------------------------------------------------------------------------- train


def cmd_train(args) -> int:
    """Under torchrun every rank runs this; rank 0 reports (a config error, the same on every rank, is printed once).
    """
    from longstraw.distributed.agree import JobError
    from longstraw.rl.config import RunConfig, apply_overrides, load_config
    from longstraw.rl.trainer import Trainer

    resume_dir = None
    if args.resume is not None:
        resume_dir = Path(args.resume) if args.resume != "" else None
    try:
        if args.config:
            cfg = load_config(args.config)
        elif resume_dir is not None:
            if not (resume_dir / "config.toml").is_file():
                raise ValueError(f"cannot resume {str(resume_dir)!r}: it has no config.toml (not a LongStraw run)")
            cfg = load_config(resume_dir / "config.toml")
        else:
            cfg = RunConfig()
        cfg = apply_overrides(cfg, args.set or [])
    except ValueError as e:
        raise JobError(str(e)) from None
    run_dir = resume_dir or Path(cfg.train.out_dir)
    trainer = Trainer(cfg, run_dir, resume=args.resume is not None)
    s = trainer.train()
    if trainer.job.is_main:
        print(f"done: {s.steps} steps, reward {s.reward_first:.3f} (first 10) -> {s.reward_last:.3f} (last 10), "
              f"peak {s.peak_memory_bytes / 2**20:.0f} MiB; run in {s.run_dir}")
    return 0


# ---------------------------------------------------------------------------------------------------- generate


def _read_prompt(args) -> str | list:
    if args.prompt is not None and args.prompt_file is not None:
        raise ValueError("give --prompt or --prompt-file, not both")
    if args.prompt_file is not None:
        p = Path(args.prompt_file)
        if not p.is_file():
            raise ValueError(f"prompt file {str(p)!r} does not exist")
        data = p.read_bytes()
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError as e:
            line = data.count(b"\n", 0, e.start) + 1
            raise ValueError(f"prompt file {str(p)!r} is not UTF-8 text (byte 0x{data[e.start]:02x} on line "
                             f"{line}); save it as UTF-8") from None
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise ValueError("give a prompt with --prompt TEXT or --prompt-file FILE")
    if args.chat:
        return [{"role": "user", "content": text}]
    return text


def cmd_generate(args) -> int:
    import longstraw
    from longstraw.devices import resolve_device
    from longstraw.tokenizer import load_tokenizer, render_prompt

    prompt = _read_prompt(args)
    device = resolve_device(args.device, "--device")
    model = longstraw.load_model(args.model, dtype=args.dtype, device=device, adapter=args.adapter)
    tok = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    ids = _encode(tok, render_prompt(tok, prompt))
    stops = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    sp = longstraw.SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  max_new_tokens=args.max_new_tokens, seed=args.seed, stop_token_ids=stops,
                                  stop_strings=tuple(args.stop or ()))
    ro = longstraw.generate(model, ids, args.n, sp, decode=tok.decode, prefill_chunk=args.prefill_chunk,
                            meter=_meter(device))
    for i, (r, lp, why) in enumerate(zip(ro.responses, ro.logprobs, ro.finish_reasons)):
        text = tok.decode([t for t in r.tolist() if t != tok.eos_token_id])
        if args.json:
            print(json.dumps({"index": i, "text": text, "token_ids": r.tolist(), "logprobs": lp.tolist(),
                              "finish_reason": why}))
        else:
            print(f"--- response {i} ({r.numel()} tokens, {why}, logprob {lp.sum().item():.3f})\n{text}")
    return 0


def _meter(device):
    """A phase that runs longer than a few seconds (a long prompt's prefill, decoding) shows a progress bar on
    stderr (stdout stays the results)."""
    from longstraw.profiling import PhaseMeter, delayed_bar

    return PhaseMeter(device, progress=delayed_bar())


def _encode(tok, rendered, where: str = ""):
    import torch

    ids = rendered if isinstance(rendered, list) else tok.encode(rendered)
    if not ids:
        raise ValueError(f"{where}the prompt is empty after tokenisation")
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------- score


def _out_path(out: str) -> Path:
    p = Path(out)
    if p.is_dir():
        raise ValueError(f"--out {out!r} is a directory; give a file name")
    if not p.parent.is_dir():
        raise ValueError(f"--out {out!r}: directory {str(p.parent)!r} does not exist")
    return p


def cmd_score(args) -> int:
    """Everything is read and tokenised before the first line is written; ``--out`` is written to a temporary file
    beside it and renamed into place when complete, so an existing file is replaced whole or not at all."""
    import torch

    import longstraw
    from longstraw.devices import resolve_device
    from longstraw.rl.data import load_rollouts
    from longstraw.tokenizer import load_tokenizer, render_prompt

    out = _out_path(args.out) if args.out else None
    device = resolve_device(args.device, "--device")
    groups = load_rollouts(args.data)
    model = longstraw.load_model(args.model, dtype=args.dtype, device=device, adapter=args.adapter)
    tok = load_tokenizer(args.model, trust_remote_code=args.trust_remote_code)
    cfg = longstraw.GRPOConfig(prefill_chunk=args.prefill_chunk, temperature=args.temperature)
    work = []
    for g in groups:
        ids = _encode(tok, render_prompt(tok, g.prompt), f"{g.where}: ")
        responses = []
        for ri, r in enumerate(g.responses):
            rids = tok.encode(r) or ([tok.eos_token_id] if tok.eos_token_id is not None else [])
            if not rids:
                raise ValueError(f"{g.where}: response {ri} is empty after tokenisation (and the tokenizer has no "
                                 "EOS token to stand for it)")
            responses.append(torch.tensor(rids, dtype=torch.long))
        work.append((ids, responses))

    def write_all(f) -> None:
        for gi, (ids, responses) in enumerate(work):
            logps = longstraw.score(model, ids, responses, cfg, meter=_meter(device))
            for ri, lp in enumerate(logps):
                f.write(json.dumps({"group": gi, "response": ri, "tokens": lp.numel(), "logprob": lp.sum().item(),
                                    "mean_logprob": lp.mean().item(), "token_logprobs": lp.tolist()}) + "\n")

    if out is None:
        write_all(sys.stdout)
        return 0
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w") as f:
            write_all(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except OSError as e:
        raise ValueError(f"--out {args.out!r}: cannot write: {e.strerror or e}") from None
    finally:
        try:
            tmp.unlink(missing_ok=True)
        except OSError:
            pass
    return 0


# ---------------------------------------------------------------------------------------------------- plot, plan


def cmd_plot(args) -> int:
    from longstraw.rl.plots import plot_run

    run = Path(args.run_dir)
    if not run.is_dir():
        return _fail(f"run directory {str(run)!r} does not exist")
    paths = plot_run(run)
    for p in paths:
        print(p)
    return 0


def cmd_plan(args) -> int:
    from longstraw.planner import plan_from_args

    return plan_from_args(args)


# ---------------------------------------------------------------------------------------------------- config


def cmd_config(args) -> int:
    from longstraw.rl.config import config_reference, default_config_toml

    sys.stdout.write(config_reference() if args.markdown else default_config_toml())
    return 0


def add_config_parser(sub) -> None:
    c = sub.add_parser("config", help="print the default run config as commented TOML: every key with its default "
                                      "and meaning, a file to copy, edit and pass to `longstraw train --config`")
    c.add_argument("--markdown", action="store_true",
                   help="print the reference of every key as Markdown instead (docs/CONFIG.md) (default: off, TOML)")
    c.set_defaults(fn=cmd_config)


# ---------------------------------------------------------------------------------------------------- parser


class _HelpFormatter(argparse.HelpFormatter):
    """Every option's help ends with its default, unless the text states it already (``--help`` is a newcomer's
    map: what each option does and what happens without it)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if not action.option_strings or action.required or action.default is argparse.SUPPRESS or "default" in text:
            return text
        shown = "none" if action.default is None else "off" if action.default is False else "%(default)s"
        return f"{text} (default: {shown})"


class _Parser(argparse.ArgumentParser):
    """The top-level parser and (through ``add_subparsers``) every subcommand's: one help format for all."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", _HelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser() -> argparse.ArgumentParser:
    from longstraw.rl.config import BUILTIN_MODELS

    ap = _Parser(prog="longstraw", description="GRPO post-training on million-token prompts.")
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="warm up a built-in tiny model on short prompts, then train it with GRPO on a "
                                    "synthetic long-context task and evaluate it at 1x, 4x and 16x the length")
    d.add_argument("--prompt-len", type=int, default=4096, help="prompt length in tokens")
    d.add_argument("--steps", type=int, default=None,
                   help="GRPO steps (default: 150, fewer above 8K-token prompts)")
    d.add_argument("--warmup-steps", type=int, default=1500,
                   help="the most supervised warm-up steps on short prompts before GRPO (0: no warm-up)")
    d.add_argument("--warmup-until", type=float, default=0.9,
                   help="stop the warm-up once greedy decoding solves this fraction of 32 check prompts at its longest "
                        "length (checked every 25 steps; 0: run all --warmup-steps)")
    d.add_argument("--eval-prompts", type=int, default=None,
                   help="held-out prompts per evaluation length (default: 32 up to 4K tokens, fewer above)")
    d.add_argument("--group-size", type=int, default=8, help="G, responses sampled per prompt")
    d.add_argument("--prompt-grad", default="exact", choices=["exact", "detached"],
                   help="exact: the gradient flows back through the prompt; detached: it stops at the prompt state")
    d.add_argument("--model", default="tiny-dense", choices=list(BUILTIN_MODELS),
                   help="the built-in random model (tiny-hybrid does not learn the copy in the warm-up's budget)")
    d.add_argument("--out", default=None, help="run directory (default: runs/demo-<date>-<time>)")
    d.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override any config value (repeatable; default: the demo's settings)")
    d.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    d.set_defaults(fn=cmd_demo)

    t = sub.add_parser("train", help="train from a TOML config")
    t.add_argument("--config", default=None, help="run.toml (default: the built-in defaults)")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE",
                   help="override a config value, e.g. --set train.steps=100 (repeatable; default: none)")
    t.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (without RUN_DIR: train.out_dir) from its last complete "
                        "checkpoint (default: start a new run)")
    t.set_defaults(fn=cmd_train)
    add_config_parser(sub)

    for name, fn, helptext in (("generate", cmd_generate, "sample responses from a checkpoint"),
                               ("score", cmd_score, "log-probs of responses (a rollouts JSONL) under a checkpoint")):
        g = sub.add_parser(name, help=helptext)
        g.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors + tokenizer)")
        g.add_argument("--adapter", default=None, help="a PEFT LoRA adapter directory to apply to --model (a LoRA "
                                                       "run's RUN/checkpoints/step-N/adapter)")
        g.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16", "float64"],
                       help="parameter dtype (default: the checkpoint's dtype, else float32)")
        g.add_argument("--device", default="cpu", help="where to run: cpu, cuda, cuda:N or mps")
        g.add_argument("--trust-remote-code", action="store_true",
                       help="import a tokenizer that is the checkpoint's own Python code (tokenizer_config.json's "
                            "auto_map, e.g. Kimi's tokenization_kimi.py); without it such a tokenizer is refused")
        g.add_argument("--prefill-chunk", type=int, default=4096, help="prompt tokens per prefill chunk")
        g.add_argument("--temperature", type=float, default=1.0,
                       help="sampling temperature" if name == "generate" else
                       "the temperature the responses were sampled at (log-probs of logits / T)")
        g.set_defaults(fn=fn)
        if name == "generate":
            g.add_argument("--prompt", default=None, help="the prompt text (give --prompt or --prompt-file)")
            g.add_argument("--prompt-file", default=None, help="read the prompt from this UTF-8 file")
            g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
            g.add_argument("-n", type=int, default=1, help="number of responses")
            g.add_argument("--max-new-tokens", type=int, default=64, help="most tokens per response")
            g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely tokens; 0: all")
            g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling probability mass; 1.0: off")
            g.add_argument("--seed", type=int, default=None, help="sampling seed (default: a random one)")
            g.add_argument("--stop", action="append",
                           help="stop string, repeatable (default: none; the tokenizer's EOS token always stops)")
            g.add_argument("--json", action="store_true", help="one JSON object per response")
        else:
            g.add_argument("--data", required=True, help="JSONL rows {prompt, responses, rewards}")
            g.add_argument("--out", default=None,
                           help="write JSONL to this file, replaced whole when complete (default: stdout)")

    p = sub.add_parser("plot", help="PNG plots of a run's metrics")
    p.add_argument("run_dir", help="the run directory (its metrics.jsonl; the plots go to RUN_DIR/plots/)")
    p.set_defaults(fn=cmd_plot)

    from longstraw.planner import add_plan_arguments

    plan = sub.add_parser("plan", help="predict peak memory of a run before starting it")
    add_plan_arguments(plan)
    plan.set_defaults(fn=cmd_plan)
    return ap


def _subparser(ap: argparse.ArgumentParser, command: str | None) -> argparse.ArgumentParser:
    for a in ap._actions:
        if isinstance(a, argparse._SubParsersAction) and command in a.choices:
            return a.choices[command]
    return ap


def main(argv: list[str] | None = None) -> int:
    from longstraw.profiling import tune_allocator

    tune_allocator()  # glibc: freed tensors leave the resident set (see longstraw.profiling.tune_allocator)
    ap = build_parser()
    args, extra = ap.parse_known_args(argv)
    if extra:  # an option the subcommand does not have: its usage, not the top-level one
        hint = " (config values are set with --set SECTION.KEY=VALUE)" if args.command == "train" else ""
        _subparser(ap, args.command).error(f"unrecognized arguments: {' '.join(extra)}{hint}")
    try:
        return args.fn(args)
    except ValueError as e:
        if getattr(e, "shared", False) and _job_rank() != 0:
            return 2  # every rank of the torchrun job has it: rank 0 prints it
        return _fail(str(e))
    except OSError as e:  # last resort: a write that failed where no caller turned it into a ValueError
        what = e.filename if e.filename else type(e).__name__
        return _fail(f"{what}: {e.strerror or e}")
    except KeyboardInterrupt:
        print("\ninterrupted; the last complete checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
