"""Checkpoint tensor names <-> LongStraw parameter names (pure name and layout mapping, no file I/O).

Our module tree mirrors the HF names, so the base map is the identity plus three kinds of rule:

* ``renames``: ``(regex, replacement)`` applied to checkpoint names on load (e.g. the ``model.language_model.``
  prefix of multimodal Qwen3.5 checkpoints); ``save_renames`` map back on save;
* ``ignore``: checkpoint names dropped silently (vision towers of multimodal checkpoints, rotary caches);
* ``skip_with_warning``: names dropped with one warning line per pattern (e.g. MTP layers).

Families whose in-memory layout differs from the checkpoint subclass and override ``load_tensors`` /
``save_tensors`` (:class:`ExpertWeightMap`: fused MoE experts). ``hf_name`` gives the name transformers' in-memory
model uses for a parameter (what ``hf_grads`` returns).
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


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
_FUSED = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


class ExpertWeightMap(WeightMap):
    """MoE checkpoints store each routed expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` separately
    (``...mlp.experts.E.gate_proj.weight``); our layers hold them fused per layer (``mlp.experts.gate_up_proj
    [E, 2I, H]``, ``mlp.experts.down_proj [E, H, I]``, as transformers' in-memory models do). Loading fuses one
    layer's experts at a time; saving splits them again."""

    def load_tensors(self, ckpt_names: list[str], read: Callable[[str], Tensor]) -> Iterator[tuple[str, Tensor]]:
        import torch

        self.warn_skipped(ckpt_names)
        experts: dict[str, dict[tuple[int, str], str]] = {}
        for n in ckpt_names:
            p = self.param_name(n)
            if p is None:
                continue
            m = _EXPERT.fullmatch(p)
            if m:
                experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = n
                continue
            yield p, read(n)
        for prefix, parts in experts.items():  # one layer's experts at a time
            count = 1 + max(e for e, _ in parts)
            missing = [f"{prefix}.{e}.{w}.weight" for e in range(count) for w in ("gate_proj", "up_proj", "down_proj")
                       if (e, w) not in parts]
            if missing:
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise ValueError(f"incomplete experts in the checkpoint: missing {', '.join(missing[:5])}{more}")
            gate = torch.stack([read(parts[(e, "gate_proj")]) for e in range(count)])
            up = torch.stack([read(parts[(e, "up_proj")]) for e in range(count)])
            yield f"{prefix}.gate_up_proj", torch.cat([gate, up], dim=1)
            del gate, up
            yield f"{prefix}.down_proj", torch.stack([read(parts[(e, "down_proj")]) for e in range(count)])

    def save_tensors(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, t in super().save_tensors(named):
            m = _FUSED.fullmatch(name)
            if not m:
                yield name, t
            elif m.group(2) == "gate_up_proj":
                inter = t.shape[1] // 2
                for e in range(t.shape[0]):
                    yield f"{m.group(1)}.{e}.gate_proj.weight", t[e, :inter].clone()
                    yield f"{m.group(1)}.{e}.up_proj.weight", t[e, inter:].clone()
            else:
                for e in range(t.shape[0]):
                    yield f"{m.group(1)}.{e}.down_proj.weight", t[e].clone()
