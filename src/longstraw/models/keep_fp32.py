"""Tensors a model keeps in float32 when it is cast to a half dtype, as transformers keeps them.

transformers lists, per model class, modules whose tensors stay float32 whatever dtype the model is loaded in:
``_keep_in_fp32_modules_strict`` for bf16 and fp16 alike (DeepSeek-V3 / GLM's router ``e_score_correction_bias``;
Ling 3.0's short conv ``conv1d`` and forget gate ``dt_bias`` / ``A_log``) and ``_keep_in_fp32_modules`` for fp16 only
(GLM-5's DSA ``indexer.weights_proj``, whose bf16 values would leave fp16's range). A checkpoint stores them in
float32 where it was saved from such a model, and a bf16 copy would round them: a router bias that decides which
experts are chosen, or a decay rate ``exp(A_log)`` off by up to 0.4% at every token of a million-token prompt.

:class:`KeepsFloat32` is the one mechanism: a module names the tensors below it (``keep_float32``, dotted names) and
whether the rule is strict (``keep_float32_strict``: every floating dtype under 4 bytes) or fp16-only; its
``_apply`` (``to``, ``half``, ``bfloat16``, ``to_empty``, ...) moves those tensors with the others but casts them to
float32 instead of the narrower dtype. float32 and float64 casts apply as usual (a float64 reference model is all
float64). Compute follows from the dtype held: the short conv promotes to float32 (``ops.conv``), the forget gate
computes in float32 anyway; under FSDP2 each module owning kept parameters is a unit of its own whose parameters are
all-gathered in float32 (:func:`float32_owners`, ``distributed.fsdp.apply_fsdp``); ``save_model(dtype=...)`` writes
them in float32 (:func:`kept_float32_names`), as transformers' ``save_pretrained`` of a bf16 model does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn


def keeps(strict: bool, dtype: torch.dtype) -> bool:
    """Whether a cast to ``dtype`` keeps the tensors float32: strict, any floating dtype narrower than float32;
    otherwise float16 only (transformers' non-strict list)."""
    if not dtype.is_floating_point:
        return False
    return dtype.itemsize < 4 if strict else dtype == torch.float16


class KeepsFloat32:
    """Mixin for an ``nn.Module`` (listed before it in the bases): ``keep_float32`` names tensors below the module
    (parameters or buffers, dotted; absent ones are skipped, e.g. a bias that is None) that stay float32 under a cast
    to a half dtype (module docstring). Class attributes, overridable per instance (a family that keeps them sets them
    on the modules it builds)."""

    keep_float32: tuple[str, ...] = ()
    keep_float32_strict: bool = True

    def kept_tensors(self) -> list[tuple[str, Tensor]]:
        """``(name, tensor)`` of every kept tensor that exists, names relative to this module."""
        out = []
        for name in self.keep_float32:
            owner, _, leaf = name.rpartition(".")
            mod = self.get_submodule(owner) if owner else self
            t = mod._parameters.get(leaf, mod._buffers.get(leaf))
            if t is not None:
                out.append((name, t))
        return out

    def _apply(self, fn: Callable, recurse: bool = True):
        tensors = [t for _, t in self.kept_tensors()]
        kept = {id(t) for t in tensors} | {id(t.grad) for t in tensors if t.grad is not None}
        if not kept:
            return super()._apply(fn, recurse)
        strict = self.keep_float32_strict

        def cast(t: Tensor) -> Tensor:
            """``fn``, but a kept floating tensor that ``fn`` would narrow goes to float32 on ``fn``'s device (``fn`` is
            probed on an empty tensor for the device and dtype it gives)."""
            if id(t) in kept and t.is_floating_point():
                probe = fn(torch.empty(0, dtype=t.dtype, device=t.device))
                if keeps(strict, probe.dtype):
                    return t.to(device=probe.device, dtype=torch.float32)
            return fn(t)

        return super()._apply(cast, recurse)


def keep_in_float32(module: KeepsFloat32, *names: str, strict: bool = True) -> KeepsFloat32:
    """``module`` (a :class:`KeepsFloat32`) set to keep ``names`` (below it, dotted) in float32: strict (bf16 and
    fp16 models) or fp16 only; returns it, for a family's builder."""
    if not isinstance(module, KeepsFloat32):
        raise TypeError(f"{type(module).__name__} cannot keep tensors in float32 (not a KeepsFloat32)")
    module.keep_float32, module.keep_float32_strict = names, strict
    return module


def _kept_by_module(root: nn.Module, dtype: torch.dtype) -> dict[int, list[str]]:
    """``{id(owner module): [its own kept parameter names]}`` for a model computing in ``dtype``."""
    out: dict[int, list[str]] = {}
    for m in root.modules():
        if isinstance(m, KeepsFloat32) and keeps(m.keep_float32_strict, dtype):
            for name, t in m.kept_tensors():
                if isinstance(t, nn.Parameter):
                    owner, _, leaf = name.rpartition(".")
                    out.setdefault(id(m.get_submodule(owner) if owner else m), []).append(leaf)
    return out


def float32_owners(root: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """The modules under ``root`` (itself included) that own parameters kept in float32 for a model computing in
    ``dtype``, in ``root.modules()`` order: under FSDP2 each is a unit of its own, all-gathered in float32 (a unit
    takes one dtype). Every parameter an owner holds itself must be kept (ValueError otherwise: no unit could take
    it); its children are not (they become units of their own, in the compute dtype)."""
    kept = _kept_by_module(root, dtype)
    out = []
    for name, m in root.named_modules():
        if id(m) not in kept:
            continue
        other = sorted(n for n, _ in m.named_parameters(recurse=False) if n not in kept[id(m)])
        if other:
            raise ValueError(f"{type(root).__name__}.{name} keeps {sorted(kept[id(m)])} in float32 beside {other} in "
                             "the compute dtype: an FSDP2 unit takes one dtype")
        out.append(m)
    return out


def kept_float32_names(root: nn.Module, dtype: torch.dtype) -> set[str]:
    """The names (``root``'s ``named_parameters`` / ``named_buffers`` spelling) of the tensors kept in float32 for a
    model cast to ``dtype``: what ``save_model(dtype=...)`` writes in float32."""
    out = set()
    for prefix, m in root.named_modules():
        if isinstance(m, KeepsFloat32) and keeps(m.keep_float32_strict, dtype):
            out |= {f"{prefix}.{n}" if prefix else n for n, _ in m.kept_tensors()}
    return out
