"""Checkpoint tensor names <-> LongStraw parameter names (pure name and layout mapping, no file I/O).

Our module tree mirrors the HF names, so the base map is the identity plus three kinds of rule:

* ``renames``: ``(regex, replacement)`` applied to checkpoint names on load (e.g. the ``model.language_model.``
  prefix of multimodal Qwen3.5 checkpoints); ``save_renames`` map back on save;
* ``ignore``: checkpoint names dropped silently (vision towers of multimodal checkpoints, rotary caches);
* ``skip_with_warning``: names dropped with one warning line per pattern (e.g. MTP layers).

Families whose in-memory layout differs from the checkpoint (fused experts) subclass and override
``load_tensors`` / ``save_tensors``. ``hf_name`` gives the name transformers' in-memory model uses for a parameter
(what ``hf_grads`` returns).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from torch import Tensor


@dataclass
class WeightMap:
    renames: list[tuple[str, str]] = field(default_factory=list)
    save_renames: list[tuple[str, str]] = field(default_factory=list)
    ignore: list[str] = field(default_factory=lambda: [r".*rotary_emb\.inv_freq$"])
    skip_with_warning: list[tuple[str, str]] = field(default_factory=list)

    def param_name(self, ckpt_name: str) -> str | None:
        """The parameter a checkpoint tensor loads into, or None if it is skipped."""
        for pat in self.ignore:
            if re.fullmatch(pat, ckpt_name):
                return None
        for pat, _ in self.skip_with_warning:
            if re.fullmatch(pat, ckpt_name):
                return None
        name = ckpt_name
        for pat, repl in self.renames:
            name = re.sub(pat, repl, name)
        return name

    def warn_skipped(self, ckpt_names: Iterable[str]) -> None:
        names = list(ckpt_names)
        for pat, message in self.skip_with_warning:
            hits = [n for n in names if re.fullmatch(pat, n)]
            if hits:
                warnings.warn(f"{message} ({len(hits)} tensors skipped, e.g. {hits[0]})", stacklevel=3)

    def load_tensors(self, ckpt_names: list[str], read: Callable[[str], Tensor]) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(param_name, tensor)`` for every checkpoint tensor that is not skipped."""
        self.warn_skipped(ckpt_names)
        for n in ckpt_names:
            p = self.param_name(n)
            if p is not None:
                yield p, read(n)

    def save_tensors(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(checkpoint_name, tensor)`` for our parameters."""
        for name, t in named:
            for pat, repl in self.save_renames:
                name = re.sub(pat, repl, name)
            yield name, t

    def hf_name(self, param_name: str) -> str:
        return param_name
