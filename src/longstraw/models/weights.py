"""Checkpoint tensor names <-> LongStraw parameter names (pure name and layout mapping, no file I/O).

Our module tree mirrors the HF names, so the base map is the identity plus three kinds of rule:

* ``renames``: ``(regex, replacement)`` applied to checkpoint names on load (e.g. the ``model.language_model.``
  prefix of multimodal Qwen3.5 checkpoints); ``save_renames`` map back on save;
* ``ignore``: checkpoint names dropped silently (vision towers of multimodal checkpoints, rotary caches);
* ``skip_with_warning``: names dropped with one warning line per pattern (e.g. MTP layers).

Loading goes through :meth:`WeightMap.sources`: one :class:`WeightSource` per parameter, with the parameter's full
shape (from the checkpoint's headers, nothing read yet) and a reader of any range of its rows (dim 0) that reads
only those rows from the checkpoint. A sharded load (``longstraw.load_model`` under FSDP2) reads each rank's rows;
:meth:`WeightMap.load_tensors` is the same path with the full range. The files are behind a
:class:`CheckpointReader` (``shape`` and ``read`` of a row range); :class:`TensorDictReader` serves tensors already
in memory (a state dict).

Families whose in-memory layout differs from the checkpoint subclass and override ``sources`` /
``save_tensors`` (:class:`ExpertWeightMap`: fused MoE experts, whose rows are experts). ``hf_name`` gives the name
transformers' in-memory model uses for a parameter (what ``hf_grads`` returns).
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import Tensor

Rows = tuple[int, int] | None
"""Rows ``[a, b)`` of a tensor's dim 0; None: the whole tensor."""


class CheckpointReader(Protocol):
    """Tensors of a checkpoint by name: their shapes without reading them, and any range of their rows."""

    def shape(self, name: str) -> tuple[int, ...]: ...

    def read(self, name: str, rows: Rows = None) -> Tensor:
        """Rows ``[a, b)`` of dim 0 of tensor ``name`` (all of it for None), reading only those."""
        ...


class TensorDictReader:
    """A :class:`CheckpointReader` over tensors in memory (a state dict, or pickled weights)."""

    def __init__(self, tensors: Mapping[str, Tensor]):
        self.tensors = tensors

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.tensors[name].shape)

    def read(self, name: str, rows: Rows = None) -> Tensor:
        t = self.tensors[name]
        return t if rows is None else t[rows[0]:rows[1]]


def _into(t: Tensor, out: Tensor | None) -> Tensor:
    if out is None:
        return t
    out.copy_(t)
    return out


@dataclass(frozen=True)
class WeightSource:
    """Where parameter ``param`` comes from: its full ``shape`` as the checkpoint implies it (nothing read) and a
    reader of row ranges. ``read(rows, out)`` returns rows ``[a, b)`` of dim 0 (None: all), reading only those
    from the checkpoint; with ``out`` (shaped like those rows) they are written into it, converted to its dtype,
    and ``out`` is returned."""

    param: str
    shape: tuple[int, ...]
    _read: Callable[[Rows, Tensor | None], Tensor] = field(repr=False)

    def read(self, rows: Rows = None, out: Tensor | None = None) -> Tensor:
        if rows is not None:
            a, b = rows
            n = self.shape[0] if self.shape else 0
            if not self.shape or not 0 <= a <= b <= n:
                raise ValueError(f"rows {rows} of {self.param}: need 0 <= a <= b <= {n} (its shape is {self.shape})")
            if (a, b) == (0, self.shape[0]):
                rows = None
        want = self.shape if rows is None else (rows[1] - rows[0], *self.shape[1:])
        if out is not None and tuple(out.shape) != tuple(want):
            raise ValueError(f"rows {rows} of {self.param} have shape {tuple(want)}, but out has {tuple(out.shape)}")
        return self._read(rows, out)


def _tensor_source(param: str, name: str, reader: CheckpointReader) -> WeightSource:
    """Parameter ``param`` is checkpoint tensor ``name`` as it is (the same rows)."""
    return WeightSource(param, tuple(reader.shape(name)), lambda rows, out: _into(reader.read(name, rows), out))


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
        return self.renamed(ckpt_name)

    def renamed(self, ckpt_name: str) -> str:
        """``ckpt_name`` after ``renames`` (in order), whether or not it is skipped."""
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

    def sources(self, ckpt_names: list[str], reader: CheckpointReader) -> list[WeightSource]:
        """One :class:`WeightSource` per parameter the checkpoint tensors ``ckpt_names`` load into (skipped names
        left out, with one warning per ``skip_with_warning`` pattern). Reads only the tensors' shapes."""
        return self.partition(ckpt_names, reader)[0]

    def partition(self, ckpt_names: list[str], reader: CheckpointReader, pattern: re.Pattern | None = None
                  ) -> tuple[list[WeightSource], list[tuple[re.Match, str]]]:
        """The skipped names warned about; a source for each tensor that loads as it is, and ``(match, checkpoint
        name)`` of those whose parameter name ``pattern`` matches: pieces a subclass assembles (fused or
        dequantised experts)."""
        self.warn_skipped(ckpt_names)
        out, matched = [], []
        for n in ckpt_names:
            p = self.param_name(n)
            if p is None:
                continue
            m = pattern.fullmatch(p) if pattern is not None else None
            if m:
                matched.append((m, n))
            else:
                out.append(_tensor_source(p, n, reader))
        return out, matched

    def load_tensors(self, ckpt_names: list[str], reader: CheckpointReader | Mapping[str, Tensor]
                     ) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(param_name, whole tensor)`` for every parameter of :meth:`sources` (``reader``: a
        :class:`CheckpointReader` or a state dict)."""
        if isinstance(reader, Mapping):
            reader = TensorDictReader(reader)
        for src in self.sources(ckpt_names, reader):
            yield src.param, src.read()

    def save_tensors(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        """Yield ``(checkpoint_name, tensor)`` for our parameters."""
        for name, t in named:
            for pat, repl in self.save_renames:
                name = re.sub(pat, repl, name)
            yield name, t

    def hf_name(self, param_name: str) -> str:
        return param_name


_VISION_SKIPPED = "vision tower weights are not used: LongStraw trains the text model of this multimodal checkpoint"


def skip_vision_tower(wm: WeightMap, projector: str = "multi_modal_projector") -> WeightMap:
    """``wm`` for a multimodal checkpoint of the llava layout (Gemma 3, Mistral 3; Kimi-K2.5's with ``projector``
    ``mm_projector``): the text weights under ``model.language_model.`` (transformers 5) or
    ``language_model.model.`` / ``language_model.lm_head.`` (the released files) renamed to the text model's
    names, the vision tower and projector skipped with one warning."""
    wm.renames += [(r"^model\.language_model\.", "model."), (r"^language_model\.model\.", "model."),
                   (r"^language_model\.lm_head\.", "lm_head.")]
    wm.skip_with_warning.append((rf"(model\.)?(vision_tower|{projector})\..*", _VISION_SKIPPED))
    return wm


def skip_kimi_vision(wm: WeightMap) -> WeightMap:
    """``wm`` for a Kimi-K2.5 / K2.6 checkpoint (``kimi_k25``): the text weights under ``language_model.model.`` /
    ``language_model.lm_head.`` (the released files) or ``model.language_model.`` (transformers' in-memory names)
    renamed to the text model's; transformers 5's ``save_pretrained`` writes the released prefixes with every
    ``layers`` as ``blocks`` (its load mapping turns the vision tower's ``blocks`` into ``layers`` and its save
    reverses that everywhere), read back as ``layers``. The vision tower and ``mm_projector`` are skipped with one
    warning."""
    skip_vision_tower(wm, projector="mm_projector").renames.append((r"^model\.blocks\.", "model.layers."))
    return wm


def skip_qwen_visual(wm: WeightMap) -> WeightMap:
    """``wm`` for a Qwen multimodal checkpoint (Qwen3.5, Qwen3-VL): the text weights under ``model.language_model.``
    renamed to the text model's names (``lm_head`` is at the top already), the vision tower ``model.visual.``
    skipped with one warning."""
    wm.renames.append((r"^model\.language_model\.", "model."))
    wm.skip_with_warning.append((r"model\.visual\..*", _VISION_SKIPPED))
    return wm


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
FUSED_EXPERTS = re.compile(r"(.*\.mlp\.experts)\.(gate_up_proj|down_proj)")


def _experts_source(param: str, names: list[list[str]], reader: CheckpointReader) -> WeightSource:
    """A fused expert parameter: row ``e`` is ``cat([reader(n) for n in names[e]], dim 0)``. Rows ``[a, b)`` read
    only experts ``a .. b-1``, one checkpoint tensor at a time, into one buffer (or ``out``)."""
    shapes = [[tuple(reader.shape(n)) for n in parts] for parts in names]
    if any(len(s) != 2 or s[1] != shapes[0][0][1] for s in shapes[0]):
        raise ValueError(f"{param}: the expert tensors it fuses must be 2-D with one column count, got "
                         + ", ".join(f"{n} {s}" for n, s in zip(names[0], shapes[0])))
    for e, got in enumerate(shapes):
        if got != shapes[0]:
            raise ValueError(f"{param}: experts differ in shape: expert {e} has "
                             + ", ".join(f"{n} {s}" for n, s in zip(names[e], got)) + f", expert 0 {shapes[0]}")
    sizes = [s[0] for s in shapes[0]]
    shape = (len(names), sum(sizes), shapes[0][0][1])

    def read(rows: Rows, out: Tensor | None) -> Tensor:
        a, b = rows if rows is not None else (0, len(names))
        for e in range(a, b):
            at = 0
            for n, size in zip(names[e], sizes):
                t = reader.read(n)
                if out is None:  # the checkpoint's dtype, known from the first tensor read
                    out = torch.empty((b - a, *shape[1:]), dtype=t.dtype)
                out[e - a, at:at + size].copy_(t)
                at += size
                del t
        if out is None:  # no rows: nothing to read
            out = reader.read(names[0][0], (0, 0)).new_empty((0, *shape[1:]))
        return out

    return WeightSource(param, shape, read)


class ExpertWeightMap(WeightMap):
    """MoE checkpoints store each routed expert's ``gate_proj`` / ``up_proj`` / ``down_proj`` separately
    (``...mlp.experts.E.gate_proj.weight``); our layers hold them fused per layer (``mlp.experts.gate_up_proj
    [E, 2I, H]`` = per expert ``cat([gate_proj, up_proj], dim 0)``, ``mlp.experts.down_proj [E, H, I]``, as
    transformers' in-memory models do). Their rows are experts: rows ``[a, b)`` read only the tensors of experts
    ``a .. b-1``, copied one at a time into the fused buffer. Saving splits them again."""

    def sources(self, ckpt_names: list[str], reader: CheckpointReader) -> list[WeightSource]:
        out, matched = self.partition(ckpt_names, reader, _EXPERT)
        experts: dict[str, dict[tuple[int, str], str]] = {}
        for m, n in matched:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = n
        for prefix, parts in experts.items():
            count = 1 + max(e for e, _ in parts)
            missing = [f"{prefix}.{e}.{w}.weight" for e in range(count) for w in ("gate_proj", "up_proj", "down_proj")
                       if (e, w) not in parts]
            if missing:
                more = f" and {len(missing) - 5} more" if len(missing) > 5 else ""
                raise ValueError(f"incomplete experts in the checkpoint: missing {', '.join(missing[:5])}{more}")
            out.append(_experts_source(f"{prefix}.gate_up_proj", [[parts[(e, "gate_proj")], parts[(e, "up_proj")]]
                                                                   for e in range(count)], reader))
            out.append(_experts_source(f"{prefix}.down_proj", [[parts[(e, "down_proj")]] for e in range(count)],
                                       reader))
        return out

    def save_tensors(self, named: Iterable[tuple[str, Tensor]]) -> Iterator[tuple[str, Tensor]]:
        for name, t in super().save_tensors(named):
            if FUSED_EXPERTS.fullmatch(name):
                yield from self._split(name, t, 0)
            else:
                yield name, t

    def save_rows(self, name: str, rows: Tensor, first: int) -> Iterator[tuple[str, Tensor]]:
        """The checkpoint tensors of experts ``first .. first + rows.shape[0] - 1`` of the fused expert parameter
        ``name``, from its rows ``rows`` only (an expert-parallel rank's share, written without a gather)."""
        for renamed, t in super().save_tensors([(name, rows)]):
            if not FUSED_EXPERTS.fullmatch(renamed):
                raise ValueError(f"{name} is not a fused expert parameter")
            yield from self._split(renamed, t, first)

    @staticmethod
    def _split(name: str, t: Tensor, first: int) -> Iterator[tuple[str, Tensor]]:
        m = FUSED_EXPERTS.fullmatch(name)
        if m.group(2) == "gate_up_proj":
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{m.group(1)}.{first + e}.gate_proj.weight", t[e, :inter].clone()
                yield f"{m.group(1)}.{first + e}.up_proj.weight", t[e, inter:].clone()
        else:
            for e in range(t.shape[0]):
                yield f"{m.group(1)}.{first + e}.down_proj.weight", t[e].clone()
