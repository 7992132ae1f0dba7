"""``longstraw`` command line: demo, train, config, generate, score, plot, plan.

Every user error (a bad value, a missing file, a config key that does not exist) is one line on stderr and exit
code 2; nothing already written is touched.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def _fail(msg: str) -> int:
    print(f"longstraw: error: {msg}", file=sys.stderr)
    return 2


# ---------------------------------------------------------------------------------------------------- demo


def demo_steps(args) -> int:
    """300 steps at prompts up to 8K tokens (a few minutes on 2 cores); fewer for longer prompts, whose steps
    cost more (the O(P^2) attention layer), unless --steps says otherwise."""
    if args.steps is not None:
        return args.steps
    return 300 if args.prompt_len <= 8192 else max(10, 300 * 8192 // args.prompt_len)


def demo_config(args):
    from longstraw.rl.config import RunConfig, apply_overrides

    out = args.out or f"runs/demo-{time.strftime('%Y%m%d-%H%M%S')}"
    sets = [
        # tuned so that a random tiny model learns from GRPO alone in a few minutes on 2 CPU cores: a shaped
        # reward (digits first, then the right digits), short answers, a high learning rate, 2 prompts per step
        'reward.fn="digits_shaped"',
        "rollout.max_new_tokens=4",
        "optim.lr=1e-2",
        "algorithm.prompts_per_step=2",
        "algorithm.prefill_chunk=1024",
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


def cmd_demo(args) -> int:
    from longstraw.planner import naive_step_bytes
    from longstraw.rl.trainer import Trainer

    cfg = demo_config(args)
    print(f"LongStraw demo: GRPO on a built-in {cfg.model.builtin} model, synthetic '{cfg.data.task}' task, "
          f"{cfg.data.prompt_len}-token prompts, G={cfg.rollout.group_size}, {cfg.train.steps} steps, "
          f"prompt_grad={cfg.algorithm.grpo.prompt_grad.value} -> {cfg.train.out_dir}")
    t0 = time.time()
    trainer = Trainer(cfg, resume=False)
    s = trainer.train()
    naive = naive_step_bytes(trainer.model, s.prompt_len, cfg.rollout.sampling.max_new_tokens, cfg.rollout.group_size)
    if cfg.train.plots:  # redrawn with the naive step's estimate in the memory panel (RUN/naive_estimate.json)
        from longstraw.rl.plots import plot_run

        s.plots = plot_run(s.run_dir, naive_bytes=naive)
    print("\n=== LongStraw demo summary ===")
    print(f"prompt length      {s.prompt_len} tokens")
    print(f"group size G       {s.group_size}")
    print(f"steps              {s.steps} in {time.time() - t0:.0f} s")
    print(f"reward             first 10 steps {s.reward_first:.3f} -> last 10 steps {s.reward_last:.3f} "
          f"(reward '{cfg.reward.fn}'; exactly solved: {s.solved_first:.1%} -> {s.solved_last:.1%})")
    print(f"peak memory        {s.peak_above_start_bytes / 2**20:.0f} MiB above the post-load baseline measured "
          f"(process peak {s.peak_memory_bytes / 2**20:.0f} MiB), vs {naive / 2**20:.0f} MiB estimated for one naive "
          f"full-graph GRPO step on G x (P + R) tokens (planner dry run)")
    print(f"run directory      {s.run_dir}  (metrics.jsonl, config.toml, checkpoints/)")
    if s.plots:
        print(f"plots              {', '.join(str(p) for p in s.plots)}")
    return 0


# ---------------------------------------------------------------------------------------------------- train


def cmd_train(args) -> int:
    from longstraw.rl.config import RunConfig, apply_overrides, load_config
    from longstraw.rl.trainer import Trainer

    resume_dir = None
    if args.resume is not None:
        resume_dir = Path(args.resume) if args.resume != "" else None
    if args.config:
        cfg = load_config(args.config)
    elif resume_dir is not None:
        cfg = load_config(resume_dir / "config.toml") if (resume_dir / "config.toml").is_file() else None
        if cfg is None:
            return _fail(f"cannot resume {str(resume_dir)!r}: it has no config.toml (not a LongStraw run)")
    else:
        cfg = RunConfig()
    cfg = apply_overrides(cfg, args.set or [])
    run_dir = resume_dir or Path(cfg.train.out_dir)
    trainer = Trainer(cfg, run_dir, resume=args.resume is not None)
    s = trainer.train()
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
        text = p.read_text()
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise ValueError("give a prompt with --prompt TEXT or --prompt-file FILE")
    if args.chat:
        return [{"role": "user", "content": text}]
    return text


def cmd_generate(args) -> int:
    import longstraw
    from longstraw.tokenizer import load_tokenizer, render_prompt

    model = longstraw.load_model(args.model, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(args.model)
    ids = _encode(tok, render_prompt(tok, _read_prompt(args)))
    stops = (tok.eos_token_id,) if tok.eos_token_id is not None else ()
    sp = longstraw.SamplingConfig(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                  max_new_tokens=args.max_new_tokens, seed=args.seed, stop_token_ids=stops,
                                  stop_strings=tuple(args.stop or ()))
    ro = longstraw.generate(model, ids, args.n, sp, decode=tok.decode, prefill_chunk=args.prefill_chunk)
    for i, (r, lp, why) in enumerate(zip(ro.responses, ro.logprobs, ro.finish_reasons)):
        text = tok.decode([t for t in r.tolist() if t != tok.eos_token_id])
        if args.json:
            print(json.dumps({"index": i, "text": text, "token_ids": r.tolist(), "logprobs": lp.tolist(),
                              "finish_reason": why}))
        else:
            print(f"--- response {i} ({r.numel()} tokens, {why}, logprob {lp.sum().item():.3f})\n{text}")
    return 0


def _encode(tok, rendered):
    import torch

    ids = rendered if isinstance(rendered, list) else tok.encode(rendered)
    if not ids:
        raise ValueError("the prompt is empty after tokenisation")
    return torch.tensor(ids, dtype=torch.long)


# ---------------------------------------------------------------------------------------------------- score


def cmd_score(args) -> int:
    import torch

    import longstraw
    from longstraw.rl.data import load_rollouts
    from longstraw.tokenizer import load_tokenizer, render_prompt

    model = longstraw.load_model(args.model, dtype=args.dtype, device=args.device)
    tok = load_tokenizer(args.model)
    cfg = longstraw.GRPOConfig(prefill_chunk=args.prefill_chunk, temperature=args.temperature)
    out = open(args.out, "w") if args.out else sys.stdout
    try:
        for gi, group in enumerate(load_rollouts(args.data)):
            ids = _encode(tok, render_prompt(tok, group.prompt))
            responses = [torch.tensor(tok.encode(r) or [tok.eos_token_id], dtype=torch.long) for r in group.responses]
            logps = longstraw.score(model, ids, responses, cfg)
            for ri, lp in enumerate(logps):
                out.write(json.dumps({"group": gi, "response": ri, "tokens": lp.numel(), "logprob": lp.sum().item(),
                                      "mean_logprob": lp.mean().item(), "token_logprobs": lp.tolist()}) + "\n")
    finally:
        if args.out:
            out.close()
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="longstraw", description="GRPO post-training on million-token prompts.")
    sub = ap.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="train a built-in tiny hybrid model with GRPO on a synthetic long-context task")
    d.add_argument("--prompt-len", type=int, default=4096, help="prompt length in tokens (default 4096)")
    d.add_argument("--steps", type=int, default=None, help="default 300 (fewer above 8K-token prompts)")
    d.add_argument("--group-size", type=int, default=8)
    d.add_argument("--prompt-grad", default="exact", choices=["exact", "detached"])
    d.add_argument("--model", default="tiny-hybrid", choices=["tiny-hybrid", "tiny-dense"])
    d.add_argument("--out", default=None, help="run directory (default runs/demo-<time>)")
    d.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override any config value")
    d.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    d.set_defaults(fn=cmd_demo)

    t = sub.add_parser("train", help="train from a TOML config")
    t.add_argument("--config", default=None, help="run.toml (default: the built-in defaults)")
    t.add_argument("--set", action="append", metavar="SECTION.KEY=VALUE", help="override a config value")
    t.add_argument("--resume", nargs="?", const="", default=None, metavar="RUN_DIR",
                   help="continue the run in RUN_DIR (default: train.out_dir) from its last complete checkpoint")
    t.set_defaults(fn=cmd_train)
    add_config_parser(sub)

    for name, fn, helptext in (("generate", cmd_generate, "sample responses from a checkpoint"),
                               ("score", cmd_score, "log-probs of responses (a rollouts JSONL) under a checkpoint")):
        g = sub.add_parser(name, help=helptext)
        g.add_argument("--model", required=True, help="checkpoint directory (config.json + safetensors + tokenizer)")
        g.add_argument("--dtype", default=None)
        g.add_argument("--device", default=None)
        g.add_argument("--prefill-chunk", type=int, default=4096)
        g.add_argument("--temperature", type=float, default=1.0)
        g.set_defaults(fn=fn)
        if name == "generate":
            g.add_argument("--prompt", default=None)
            g.add_argument("--prompt-file", default=None)
            g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message (chat template)")
            g.add_argument("-n", type=int, default=1, help="number of responses")
            g.add_argument("--max-new-tokens", type=int, default=64)
            g.add_argument("--top-k", type=int, default=0)
            g.add_argument("--top-p", type=float, default=1.0)
            g.add_argument("--seed", type=int, default=None)
            g.add_argument("--stop", action="append", help="stop string (repeatable)")
            g.add_argument("--json", action="store_true", help="one JSON object per response")
        else:
            g.add_argument("--data", required=True, help="JSONL rows {prompt, responses, rewards}")
            g.add_argument("--out", default=None, help="write JSONL here instead of stdout")

    p = sub.add_parser("plot", help="PNG plots of a run's metrics")
    p.add_argument("run_dir")
    p.set_defaults(fn=cmd_plot)

    from longstraw.planner import add_plan_arguments

    add_plan_arguments(sub.add_parser("plan", help="predict peak memory of a run before starting it"))
    sub.choices["plan"].set_defaults(fn=cmd_plan)
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = build_parser()
    args = ap.parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:
        return _fail(str(e))
    except KeyboardInterrupt:
        print("\ninterrupted; the last complete checkpoint is intact", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
