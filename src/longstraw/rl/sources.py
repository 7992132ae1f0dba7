"""Where a run's prompts come from: a built-in synthetic task, a prompt file, or offline rollouts.

``PromptSource.get(index)`` returns the ``index``-th item of the run's prompt stream, deterministically (the data
position in a checkpoint is just the next index). Built-in tasks generate prompt ``index`` from seed
``(data.seed, index)`` (``data.num_prompts > 0`` cycles through that many distinct prompts); files are cycled in
order. Prompts are rendered (chat messages through the tokenizer's chat template) and tokenised here; a prompt
longer than ``data.max_prompt_len`` is an error naming its index and length.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import Tensor

from longstraw.rl.config import RunConfig


@dataclass
class PromptItem:
    prompt_ids: Tensor
    answer: str
    meta: dict
    responses: list[Tensor] | None = None  # offline rollouts only
    response_texts: list[str] | None = None
    rewards: list[float] | None = None
    old_logprobs: list[Tensor] | None = None


def check_model_path(cfg: RunConfig) -> None:
    """``model.path`` names a checkpoint directory with a readable config.json (checked before its tokenizer, so a
    wrong path is reported as ``model.path``, not as a missing tokenizer)."""
    from longstraw.checkpoint.hf import read_config

    path = cfg.model.path
    if not Path(path).is_dir():
        raise ValueError(f"model.path={path!r} is not a directory (it must be an HF checkpoint directory: "
                         "config.json, model.safetensors, tokenizer files)")
    try:
        read_config(path)
    except ValueError as e:
        raise ValueError(f"model.path={path!r}: {e}") from None


def build_tokenizer(cfg: RunConfig):
    """The checkpoint's tokenizer, or the built-in byte tokenizer for built-in models."""
    from longstraw.tokenizer import ByteTokenizer, load_tokenizer

    if cfg.model.path:
        check_model_path(cfg)
        return load_tokenizer(cfg.model.path, trust_remote_code=cfg.model.trust_remote_code)
    return ByteTokenizer()


class PromptSource:
    def __init__(self, cfg: RunConfig, tokenizer):
        self.cfg, self.tok = cfg, tokenizer
        d = cfg.data
        self.rows = None
        self.groups = None
        if d.path and d.offline:
            from longstraw.rl.data import load_rollouts

            self.groups = load_rollouts(d.path)
            if not self.groups:
                raise ValueError(f"data.path={d.path!r} holds no rollout rows")
        elif d.path:
            from longstraw.rl.data import load_prompts

            self.rows = load_prompts(d.path, prompt_key=d.prompt_key, answer_key=d.answer_key,
                                     require_answer=bool(d.answer_key))
            if not self.rows:
                raise ValueError(f"data.path={d.path!r} holds no prompt rows")
        else:
            from longstraw.rl.tasks import check_task

            check_task(d.task, **self._task_options())  # validates the name and options before any work

    def check(self) -> None:
        """Reject bad data before a run starts: every file row (or rollout group) is rendered and tokenised once
        (a prompt over ``data.max_prompt_len`` names its index); a built-in task generates its first prompt.
        Records ``longest_prompt`` and ``longest_response`` (offline rollouts) in tokens for the memory check."""
        n = len(self.rows) if self.rows is not None else len(self.groups) if self.groups is not None else 1
        self.longest_prompt = self.longest_response = 0
        for i in range(n):
            item = self.get(i)
            self.longest_prompt = max(self.longest_prompt, item.prompt_ids.numel())
            self.longest_response = max([self.longest_response] + [r.numel() for r in item.responses or []])

    def _task_options(self) -> dict:
        return {"answer_digits": self.cfg.data.answer_digits}

    def _ids(self, prompt, index: int) -> Tensor:
        from longstraw.tokenizer import render_prompt

        ids = self.tok.encode(render_prompt(self.tok, prompt))
        limit = self.cfg.data.max_prompt_len
        if len(ids) > limit:
            raise ValueError(f"prompt {index} has {len(ids)} tokens, more than data.max_prompt_len={limit}")
        if len(ids) < 1:
            raise ValueError(f"prompt {index} is empty after tokenisation")
        return torch.tensor(ids, dtype=torch.long)

    def get(self, index: int) -> PromptItem:
        d = self.cfg.data
        if self.groups is not None:
            g = self.groups[index % len(self.groups)]
            eos = self.tok.eos_token_id
            responses = []
            for text in g.responses:
                ids = self.tok.encode(text) + ([eos] if eos is not None and self.cfg.rollout.stop_at_eos else [])
                responses.append(torch.tensor(ids or [eos], dtype=torch.long))
            old = None
            if g.old_logprobs is not None:
                old = [torch.tensor(x, dtype=torch.float32) for x in g.old_logprobs]
                for i, (o, r) in enumerate(zip(old, responses)):
                    if o.numel() != r.numel():
                        raise ValueError(f"rollout group {index % len(self.groups)} response {i}: {o.numel()} "
                                         f"old_logprobs for {r.numel()} tokens under this tokenizer")
            return PromptItem(self._ids(g.prompt, index), g.answer or "", dict(g.meta or {}), responses,
                              list(g.responses), list(g.rewards), old)
        if self.rows is not None:
            row = self.rows[index % len(self.rows)]
            return PromptItem(self._ids(row.prompt, index), row.answer or "", dict(row.meta or {}))
        from longstraw.rl.tasks import make_task

        k = index % d.num_prompts if d.num_prompts else index
        sample = make_task(d.task, d.prompt_len, d.seed * 1_000_003 + k, self.tok, **self._task_options())
        return PromptItem(self._ids(sample.prompt, index), sample.answer, dict(sample.meta))
