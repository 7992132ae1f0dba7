"""LoRA adapters on a LongStraw model, laid out as PEFT lays them out (pure modules: no files, no distribution).

A targeted projection ``y = x W^T + b`` (``W [out, in]``) becomes ``y = x W^T + b + s * B(A(dropout(x)))`` with
``A = lora_A.weight [r, in]``, ``B = lora_B.weight [out, r]`` and ``s = alpha / r`` (``alpha / sqrt(r)`` with
rsLoRA), exactly PEFT's ``lora.Linear`` forward. The projection keeps its own name and parameters (``q_proj.weight``
stays ``q_proj.weight``), the adapters sit beside it as ``q_proj.lora_A`` / ``q_proj.lora_B``: so a model's
parameter names, minus the ``.lora_A.weight`` / ``.lora_B.weight`` ones, are still its checkpoint's, and an adapter
tensor's name is PEFT's saved key without the ``base_model.model.`` prefix.

Initialisation is PEFT's default: ``A`` Kaiming-uniform (``a = sqrt(5)``, as ``nn.Linear``), ``B = 0``, so a fresh
adapter leaves the model's outputs unchanged. Every base parameter is frozen (``requires_grad = False``), except the
modules named in ``modules_to_save`` (PEFT's name for other modules trained whole, e.g. the embedding).

Layers that use a projection's weight other than by calling it (the absorbed MLA form reads ``kv_b_proj.weight``
per head) call :func:`linear_weight`, which returns ``W + s B A`` for an adapted projection.

Routed experts (``target_parameters``, PEFT's name for adapting a parameter rather than a module): the fused
``experts.gate_up_proj [E, 2I, H]`` / ``experts.down_proj [E, H, I]`` (``W [E, out, in]``) get an
:class:`ExpertLoRA` each, in the layout of PEFT's ``lora.ParamWrapper`` over a 3-D parameter (PEFT 0.21,
``tuners/lora/layer.py``): ``lora_A.weight [E*r, in]`` whose rows ``e*r .. e*r + r - 1`` are expert ``e``'s
``A_e [r, in]``, ``lora_B.weight [out, r*E]`` whose column ``j*E + e`` is column ``j`` of expert ``e``'s
``B_e [out, r]`` (PEFT reshapes B to ``[out, r, E]``), and expert ``e`` computes with ``W[e] + s B_e A_e``. PEFT
folds that into the weight before transformers' experts run; ``ops.moe.experts_forward`` instead adds
``s B_e (A_e x)`` on each expert's routed tokens, so no ``[E, out, in]`` delta is formed. ``gate_up_proj`` is one
fused parameter, so one adapter covers gate and up (as PEFT's). The adapters sit on the experts module as
``experts.lora_adapters.<parameter>``; PEFT's saved keys nest instead (one ``ParamWrapper`` per parameter, the first
parameter of transformers' module innermost: with both targeted, ``gate_up_proj``'s adapter is
``experts.base_layer.lora_A.weight`` and ``down_proj``'s ``experts.lora_A.weight``), which
:func:`expert_peft_names` maps.
"""

from __future__ import annotations

import contextlib
import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

ALL_LINEAR = "all-linear"
"""PEFT's shorthand: every linear layer but the output layer (the LM head)."""

_ADAPTER_PARAM = re.compile(r".*\.lora_[AB]\.weight$")

KNOWN_PROJECTIONS = frozenset({
    "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",  # attention, MLP, shared experts
    "in_proj_qkvz", "in_proj_ba", "in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "out_proj",  # Gated DeltaNet
    "f_a_proj", "f_b_proj", "b_proj", "g_a_proj", "g_b_proj",  # Kimi Delta Attention (and q/k/v/o_proj)
    "f_proj", "g_proj",  # Ling 3.0's KDA (full-rank gates) and its MLA's head gate
    "q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",  # MLA
    "wq_b", "wk", "weights_proj", "shared_expert_gate"})
"""Projection names of the supported families. A target list may name ones this model lacks (as PEFT allows: one
list for several architectures) as long as some target matches; any other name must match a module here."""


@dataclass(frozen=True)
class LoraSettings:
    """What PEFT's ``LoraConfig`` says about the adapters (the fields LongStraw reads and writes).

    ``target_modules``: a list of module names, each matching a module whose name is it or ends with ``.`` + it
    (PEFT's rule), or one string: a regular expression a whole module name must match, or ``"all-linear"``.
    ``rank_pattern`` / ``alpha_pattern``: per-module ranks / alphas (a key matches a module name as PEFT matches it:
    the name ends with the key, a regular expression; for an expert adapter the parameter's name,
    ``...mlp.experts.gate_up_proj``). ``target_parameters``: routed experts' fused parameters, each matching a
    parameter whose name is it or ends with ``.`` + it (PEFT's rule), e.g. ``"mlp.experts.gate_up_proj"``; then
    ``target_modules`` may be empty."""

    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str
    lora_dropout: float = 0.0
    use_rslora: bool = False
    modules_to_save: tuple[str, ...] = ()
    rank_pattern: dict[str, int] = field(default_factory=dict)
    alpha_pattern: dict[str, float] = field(default_factory=dict)
    target_parameters: tuple[str, ...] = ()

    def __post_init__(self):
        if isinstance(self.r, bool) or not isinstance(self.r, int) or self.r < 1:
            raise ValueError(f"LoRA rank={self.r!r} must be an integer >= 1")
        if not _positive_number(self.lora_alpha):
            raise ValueError(f"LoRA alpha={self.lora_alpha!r} must be a finite number > 0")
        if not isinstance(self.lora_dropout, (int, float)) or not 0.0 <= self.lora_dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.lora_dropout!r} must be in [0, 1)")
        tp = self.target_parameters
        params = (tp,) if isinstance(tp, str) else tuple(tp or ())  # PEFT takes one name as a string too
        if not all(isinstance(n, str) and n for n in params):
            raise ValueError(f"LoRA target_parameters={tp!r} must be a list of parameter names (e.g. "
                             "'mlp.experts.gate_up_proj', 'mlp.experts.down_proj')")
        object.__setattr__(self, "target_parameters", params)
        if params and self.lora_dropout > 0:
            raise ValueError(f"LoRA dropout={self.lora_dropout} with target_parameters (adapters on routed experts): "
                             "a fused expert weight's low-rank update has no per-input dropout (PEFT refuses it too); "
                             "use dropout 0")
        t = self.target_modules
        if isinstance(t, str):
            if not t:
                raise ValueError("LoRA target_modules='' names no module; give a list of names, a regular "
                                 "expression or 'all-linear'")
            if t != ALL_LINEAR:
                try:
                    re.compile(t)
                except re.error as e:
                    raise ValueError(f"LoRA target_modules={t!r} is not a regular expression: {e}") from None
        else:
            names = tuple(t) if t is not None else ()
            if not (names or params) or not all(isinstance(n, str) and n for n in names):
                raise ValueError(f"LoRA target_modules={t!r} must be a non-empty list of module names, a regular "
                                 "expression or 'all-linear' (or empty, with target_parameters)")
            object.__setattr__(self, "target_modules", names)
        keep = self.modules_to_save
        keep = (keep,) if isinstance(keep, str) else tuple(keep or ())  # PEFT takes one name as a string too
        if not all(isinstance(k, str) and k for k in keep):
            raise ValueError(f"LoRA modules_to_save={self.modules_to_save!r} must be module names")
        object.__setattr__(self, "modules_to_save", keep)
        for name, pattern in (("rank_pattern", self.rank_pattern), ("alpha_pattern", self.alpha_pattern)):
            if not isinstance(pattern, dict):
                raise ValueError(f"LoRA {name}={pattern!r} must be a mapping of module-name patterns to values")
            for k in pattern:
                try:
                    re.compile(rf"(.*\.)?({k})$")
                except (re.error, TypeError) as e:
                    raise ValueError(f"LoRA {name} key {k!r} is not a regular expression: {e}") from None
        for k, v in self.rank_pattern.items():
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"LoRA rank_pattern[{k!r}]={v!r} must be an integer >= 1")
        for k, v in self.alpha_pattern.items():
            if not _positive_number(v):
                raise ValueError(f"LoRA alpha_pattern[{k!r}]={v!r} must be a finite number > 0")

    def rank_alpha(self, name: str) -> tuple[int, float]:
        """The rank and alpha of the adapter on module ``name`` (the patterns first, as PEFT resolves them)."""
        r = _pattern_value(self.rank_pattern, name, self.r)
        a = _pattern_value(self.alpha_pattern, name, self.lora_alpha)
        return r, a

    def scaling(self, r: int, alpha: float) -> float:
        return alpha / math.sqrt(r) if self.use_rslora else alpha / r


def _positive_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _pattern_value(pattern: dict, name: str, default):
    for key, value in pattern.items():  # PEFT: re.match(rf"(.*\.)?({key})$", name)
        if re.match(rf"(.*\.)?({key})$", name):
            return value
    return default


class LoRALinear(nn.Linear):
    """An ``nn.Linear`` with a LoRA adapter: ``forward(x [..., in]) -> [..., out]``. It shares the base layer's
    ``weight`` / ``bias`` parameters (their names stay the layer's) and adds ``lora_A [r, in]``, ``lora_B [out, r]``
    (``nn.Linear`` modules, as PEFT names them), ``scaling`` and ``lora_dropout``."""

    def __init__(self, base: nn.Linear, r: int, alpha: float, scaling: float, dropout: float = 0.0):
        nn.Module.__init__(self)  # no fresh weight: the base layer's parameters are taken over as they are
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.r, self.lora_alpha, self.scaling = r, alpha, scaling
        dd = dict(device=base.weight.device, dtype=base.weight.dtype)
        self.lora_A = nn.Linear(self.in_features, r, bias=False, **dd)
        self.lora_B = nn.Linear(r, self.out_features, bias=False, **dd)
        self.lora_dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        if base.weight.device.type != "meta":
            self.reset_lora_parameters()

    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's default initialisation: ``A`` Kaiming-uniform with ``a = sqrt(5)``, ``B = 0`` (``generator``:
        draw ``A`` from it, on the CPU, instead of the global generator)."""
        with torch.no_grad():
            a = self.lora_A.weight
            if generator is None:
                nn.init.kaiming_uniform_(a, a=math.sqrt(5))
            else:
                bound = 1.0 / math.sqrt(a.shape[1])  # kaiming_uniform_ with a = sqrt(5): gain sqrt(1/3)
                a.copy_(torch.empty(a.shape, dtype=torch.float64).uniform_(-bound, bound, generator=generator))
            self.lora_B.weight.zero_()

    disabled = False  # adapters_disabled(): the base layer alone (a LoRA run's reference model)

    def forward(self, x: Tensor) -> Tensor:
        out = nn.functional.linear(x, self.weight, self.bias)
        if self.disabled:
            return out
        return out + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def delta_weight(self) -> Tensor:
        """``s B A`` ``[out, in]``: what merging adds to ``weight``."""
        return (self.lora_B.weight @ self.lora_A.weight) * self.scaling

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, r={self.r}, lora_alpha={self.lora_alpha}"


def linear_weight(layer: nn.Linear) -> Tensor:
    """The weight ``[out, in]`` that ``layer(x)`` applies: ``W + s B A`` for an adapted layer (differentiable in the
    adapters), ``W`` otherwise. For layers that read a projection's weight instead of calling it.

    Refused for an adapted layer with an active dropout: its forward has no single weight."""
    if isinstance(layer, LoRALinear) and not layer.disabled:
        if layer.training and isinstance(layer.lora_dropout, nn.Dropout):
            raise ValueError(f"a LoRA adapter with dropout={layer.lora_dropout.p} has no single weight to absorb; "
                             "use lora dropout 0 on this projection (or evaluate in eval mode)")
        return layer.weight + layer.delta_weight().to(layer.weight.dtype)
    return layer.weight


EXPERT_PARAMS = ("gate_up_proj", "down_proj")
"""The routed experts' fused parameters, in the order of transformers' experts module (PEFT nests its wrappers in
that order: the first targeted parameter innermost)."""


class ExpertLoRA(nn.Module):
    """LoRA on one fused expert parameter ``W [E, out, in]`` in PEFT's ``ParamWrapper`` layout (module docstring):
    ``lora_A.weight [E*r, in]``, ``lora_B.weight [out, r*E]``; expert ``e`` computes with ``W[e] + s B_e A_e``.
    Holds only the adapter (the experts module keeps ``W``); ``ops.moe.experts_forward`` applies it.

    Under expert parallelism (``distributed.expert_parallel``) an adapter holds experts ``[first, first + E)`` of
    ``total`` only: ``lora_A`` the rows of those experts, ``lora_B`` their columns of PEFT's interleaved layout, laid
    out again as PEFT's layout over the local experts (:meth:`take`; :func:`join_expert_pieces` rebuilds the whole);
    ``num_experts`` is the local count. A whole adapter has ``first = 0``, ``total = num_experts``."""

    def __init__(self, num_experts: int, in_features: int, out_features: int, r: int, alpha: float, scaling: float,
                 device=None, dtype=None, *, first: int = 0, total: int | None = None):
        super().__init__()
        self.num_experts, self.in_features, self.out_features = num_experts, in_features, out_features
        self.r, self.lora_alpha, self.scaling = r, alpha, scaling
        self.first, self.total = first, num_experts if total is None else total  # experts [first, first + E) of total
        dd = dict(device=device, dtype=dtype)
        self.lora_A = nn.Linear(in_features, r * num_experts, bias=False, **dd)  # PEFT's modules, PEFT's names
        self.lora_B = nn.Linear(r * num_experts, out_features, bias=False, **dd)
        if self.lora_A.weight.device.type != "meta":
            self.reset_lora_parameters()

    disabled = False  # adapters_disabled()

    def reset_lora_parameters(self, generator: torch.Generator | None = None) -> None:
        """PEFT's default initialisation (as :meth:`LoRALinear.reset_lora_parameters`: ``A`` Kaiming-uniform over
        its ``in`` columns, ``B = 0``). A part of the experts (expert parallelism) draws the whole ``[total*r, in]``
        and keeps its rows, so every layout starts from the values one process draws."""
        if self.total == self.num_experts:
            LoRALinear.reset_lora_parameters(self, generator)
            return
        with torch.no_grad():
            a = self.lora_A.weight
            if generator is None:
                full = torch.empty(self.full_shape("lora_A"), dtype=a.dtype, device=a.device)
                nn.init.kaiming_uniform_(full, a=math.sqrt(5))
            else:  # as LoRALinear: float64 on the CPU, from the generator
                bound = 1.0 / math.sqrt(self.in_features)
                full = torch.empty(self.full_shape("lora_A"), dtype=torch.float64).uniform_(-bound, bound,
                                                                                            generator=generator)
            a.copy_(self.take("lora_A", full))
            self.lora_B.weight.zero_()

    def full_shape(self, which: str) -> tuple[int, int]:
        """The whole adapter's shape of ``which``: ``"lora_A"`` ``[total*r, in]``, ``"lora_B"`` ``[out, r*total]``."""
        if which == "lora_A":
            return self.total * self.r, self.in_features
        return self.out_features, self.r * self.total

    def take(self, which: str, full: Tensor) -> Tensor:
        """This adapter's part of the whole tensor ``full`` of ``which`` (:meth:`full_shape`; a view where it can be):
        ``lora_A`` rows ``[first*r, (first+E)*r)``; ``lora_B`` ``[out, r, total]`` columns ``first..first+E-1``
        of each ``j``, as ``[out, r*E]`` (column ``j*E + e``: PEFT's layout over the local experts)."""
        a, e, r = self.first, self.num_experts, self.r
        if which == "lora_A":
            return full[a * r:(a + e) * r]
        return full.reshape(self.out_features, r, self.total)[:, :, a:a + e].reshape(self.out_features, r * e)

    def keep_experts(self, first: int, count: int) -> None:
        """In place: keep only experts ``[first, first + count)`` of this whole adapter (its values as they are, on
        meta or real tensors; ``requires_grad`` kept), as :func:`distributed.expert_parallel.shard_experts` keeps the
        fused weights' rows."""
        if self.total != self.num_experts or self.first != 0:
            raise ValueError(f"expert adapter already holds experts {self.first}..{self.first + self.num_experts - 1} "
                             f"of {self.total}; only a whole adapter is split")
        if first < 0 or count < 1 or first + count > self.total:
            raise ValueError(f"experts [{first}, {first + count}) are not within the adapter's {self.total}")
        self.first, self.num_experts = first, count
        with torch.no_grad():
            for which in ("lora_A", "lora_B"):
                lin = getattr(self, which)
                w = lin.weight
                lin.weight = nn.Parameter(self.take(which, w).clone(), requires_grad=w.requires_grad)
                lin.in_features, lin.out_features = lin.weight.shape[1], lin.weight.shape[0]

    def factors(self, a_weight: Tensor | None = None, b_weight: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """Per-expert views ``(A [E, r, in], B [E, out, r])`` of the two weights (differentiable, no copy);
        ``a_weight`` / ``b_weight``: views of them to use instead (the EP module's gradient-reducing identity)."""
        e = self.num_experts
        a_w = self.lora_A.weight if a_weight is None else a_weight  # [E*r, in]
        b_w = self.lora_B.weight if b_weight is None else b_weight  # [out, r*E]
        a = a_w.view(e, self.r, self.in_features)  # rows e*r + j
        b = b_w.view(self.out_features, self.r, e).permute(2, 0, 1)  # columns j*E + e
        return a, b

    def delta_weight(self) -> Tensor:
        """``s B_e A_e`` for every expert, ``[E, out, in]``: what merging adds to the fused weight (export only)."""
        a, b = self.factors()
        return torch.bmm(b, a) * self.scaling

    def extra_repr(self) -> str:
        part = f" ({self.first}..{self.first + self.num_experts - 1} of {self.total})" \
            if self.total != self.num_experts else ""
        return f"experts={self.num_experts}{part}, in={self.in_features}, out={self.out_features}, r={self.r}, " \
               f"lora_alpha={self.lora_alpha}"


def join_expert_pieces(which: str, pieces: Tensor, r: int) -> Tensor:
    """The whole adapter tensor of ``which`` from every part's, ``pieces [P, ...]`` (part ``p`` holds the ``p``-th
    contiguous run of experts, equal runs, as expert parallelism splits them; :meth:`ExpertLoRA.take` inverted):
    ``lora_A`` ``[P, n*r, in] -> [P*n*r, in]``; ``lora_B`` ``[P, out, r*n] -> [out, r*P*n]`` in PEFT's interleaved
    layout (column ``j*P*n + p*n + l`` is part ``p``'s column ``j*n + l``)."""
    size = pieces.shape[0]
    if which == "lora_A":
        return pieces.reshape(-1, pieces.shape[-1])
    out, rn = pieces.shape[1], pieces.shape[2]
    n = rn // r
    return pieces.reshape(size, out, r, n).permute(1, 2, 0, 3).reshape(out, r * size * n)


def expert_lora(experts: nn.Module) -> dict[str, tuple[Tensor, Tensor, float]] | None:
    """What ``ops.moe.experts_forward`` applies for an experts module: ``{parameter: (A [E, r, in], B [E, out, r],
    scaling)}`` of its active adapters, None when it has none (or they are disabled)."""
    adapters = getattr(experts, "lora_adapters", None)
    if not adapters:
        return None
    out = {p: (*m.factors(), m.scaling) for p, m in adapters.items() if not m.disabled}
    return out or None


def _expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The routed-experts modules of ``model`` (those holding the fused ``gate_up_proj`` / ``down_proj``)."""
    return {n: m for n, m in model.named_modules()
            if all(isinstance(getattr(m, p, None), nn.Parameter) and getattr(m, p).dim() == 3 for p in EXPERT_PARAMS)}


def expert_targets(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The fused expert parameters ``settings.target_parameters`` names (``...mlp.experts.gate_up_proj``), by PEFT's
    rule (the parameter's name is the target or ends with ``.`` + it), in the model's order (modules, then
    ``gate_up_proj`` before ``down_proj``). ValueError for a target that matches no
    parameter, or one that is not a routed expert's fused weight."""
    if not settings.target_parameters:
        return []
    experts = _expert_modules(model)
    fused = [f"{n}.{p}" for n in experts for p in EXPERT_PARAMS]
    hits = []
    for target in settings.target_parameters:
        mine = [k for k in fused if k == target or k.endswith("." + target)]
        if mine:
            hits += [k for k in mine if k not in hits]
            continue
        other = [n for n, _ in model.named_parameters() if n == target or n.endswith("." + target)]
        allowed = ("its routed experts' fused parameters are mlp.experts.gate_up_proj and mlp.experts.down_proj"
                   if experts else "this model has no routed experts")
        if other:
            raise ValueError(f"LoRA target_parameters entry {target!r} names {other[0]!r}, which is not a routed "
                             f"expert's fused weight; only those take target_parameters here (adapt a linear layer "
                             f"through target_modules); {allowed}")
        raise ValueError(f"LoRA target_parameters entry {target!r} matches no parameter of this model; {allowed}")
    hit = set(hits)
    return [k for k in fused if k in hit]  # the model's order, whatever the targets' order: the adapters (and an
    # optimizer's state, which follows parameter order) come out the same for a run and its resumption


def expert_peft_names(targets: Iterable[str]) -> dict[str, str]:
    """``{our adapter parameter name: PEFT's}`` for the expert adapters on the fused parameters ``targets``: ours are
    ``<experts>.lora_adapters.<parameter>.lora_A.weight``; PEFT nests one ``ParamWrapper`` per targeted parameter,
    the first of :data:`EXPERT_PARAMS` innermost, so its adapter is ``<experts>`` + ``.base_layer`` once per targeted
    parameter after it, + ``.lora_A.weight``."""
    per_module: dict[str, list[str]] = {}
    for key in targets:
        module, _, pname = key.rpartition(".")
        per_module.setdefault(module, []).append(pname)
    out = {}
    for module, pnames in per_module.items():
        ordered = [p for p in EXPERT_PARAMS if p in pnames]
        for i, pname in enumerate(ordered):
            theirs = module + ".base_layer" * (len(ordered) - 1 - i)
            for w in ("lora_A", "lora_B"):
                out[f"{module}.lora_adapters.{pname}.{w}.weight"] = f"{theirs}.{w}.weight"
    return out


def expert_in_out(experts: nn.Module, w: Tensor) -> tuple[int, int]:
    """``(in_features, out_features)`` of an adapter on the fused expert weight ``w``: ``[E, out, in]``
    (transformers 5's fused experts) or, for experts applied as ``x @ W`` (``experts.transposed``: GPT-OSS; PEFT
    reads transformers' ``is_transposed`` alike), ``[E, in, out]``."""
    return (w.shape[1], w.shape[2]) if getattr(experts, "transposed", False) else (w.shape[2], w.shape[1])


def expert_adapter_shapes(model: nn.Module, settings: LoraSettings) -> dict[str, tuple[int, ...]]:
    """The shapes of the expert adapters ``settings`` puts on ``model``, by our parameter name: the whole adapters'
    (PEFT's file), also on an expert-parallel model, whose modules hold part of the experts."""
    shapes = {}
    for key in expert_targets(model, settings):
        experts = model.get_submodule(key.rpartition(".")[0])
        in_f, out_f = expert_in_out(experts, model.get_parameter(key))
        e = experts.num_experts  # the model's, not this rank's share
        r, _ = settings.rank_alpha(key)
        module, _, pname = key.rpartition(".")
        shapes[f"{module}.lora_adapters.{pname}.lora_A.weight"] = (e * r, in_f)
        shapes[f"{module}.lora_adapters.{pname}.lora_B.weight"] = (out_f, r * e)
    return shapes


def expert_adapters(model: nn.Module) -> dict[str, ExpertLoRA]:
    """``{fused parameter name (...mlp.experts.gate_up_proj): its adapter}``."""
    out = {}
    for n, m in model.named_modules():
        for pname, a in (getattr(m, "lora_adapters", None) or {}).items():
            out[f"{n}.{pname}" if n else pname] = a
    return out


def is_adapter_param(name: str) -> bool:
    """Whether parameter ``name`` is an adapter's (``...lora_A.weight`` / ``...lora_B.weight``)."""
    return bool(_ADAPTER_PARAM.fullmatch(name))


def linear_modules(model: nn.Module) -> list[str]:
    """Names of the linear layers an adapter can go on: every plain ``nn.Linear``, and a subclass that says it is one
    (``plain_linear = True``: DSA's ``HeadWeights``, an ``nn.Linear`` with a dtype rule); the LM head is not one;
    routed experts are fused 3-D tensors, not linear layers."""
    return [n for n, m in model.named_modules()
            if type(m) is nn.Linear or type(m) is LoRALinear or getattr(type(m), "plain_linear", False)]


def _matches(target: tuple[str, ...] | str, name: str) -> bool:
    if isinstance(target, str):
        return target == ALL_LINEAR or re.fullmatch(target, name) is not None
    return any(name == t or name.endswith("." + t) for t in target)


def lora_targets(model: nn.Module, settings: LoraSettings) -> list[str]:
    """The names of the modules ``settings.target_modules`` puts adapters on (ValueError naming a listed target
    that matches no linear layer, or a non-linear module that a target names, with what can be targeted)."""
    linear = linear_modules(model)
    linear_set = set(linear)
    t = settings.target_modules
    if isinstance(t, str) and t == ALL_LINEAR:
        return linear
    if isinstance(t, str):
        other = [n for n, _ in model.named_modules() if n and n not in linear_set and re.fullmatch(t, n)]
        hits = [n for n in linear if _matches(t, n)]
        if other and not hits:
            raise ValueError(f"LoRA target_modules={t!r} matches only modules that are not linear layers (e.g. "
                             f"{other[0]!r}); {_allowed(linear)}")
        if not hits:
            raise ValueError(f"LoRA target_modules={t!r} matches no module of this model; {_allowed(linear)}")
        return hits
    hits = [n for n in linear if _matches(t, n)]
    for target in t:
        if any(n == target or n.endswith("." + target) for n in linear):
            continue
        if hits and target in KNOWN_PROJECTIONS:
            continue  # another family's projection (one target list for hybrids and dense models), as PEFT allows
        other = [n for n, _ in model.named_modules() if n and (n == target or n.endswith("." + target))]
        if target in ("lm_head", "embed_tokens"):
            raise ValueError(f"LoRA target {target!r}: adapters on the {target} are not supported; train it whole "
                             f"with modules_to_save=[{target!r}]")
        if other and "experts" in other[0].rsplit(".", 1)[-1]:
            raise ValueError(f"LoRA target {target!r} names routed experts ({other[0]}), fused 3-D parameters, not "
                             "linear layers: adapt them with target_parameters=['mlp.experts.gate_up_proj', "
                             "'mlp.experts.down_proj'] (PEFT's names; the shared expert's gate_proj/up_proj/down_proj "
                             "are linear layers, targeted by target_modules)")
        if other:
            raise ValueError(f"LoRA target {target!r} names {other[0]!r}, a {type(dict(model.named_modules())[other[0]]).__name__}"
                             f", not a linear layer; {_allowed(linear)}")
        raise ValueError(f"LoRA target {target!r} matches no module of this model; {_allowed(linear)}")
    return hits


def _allowed(linear: Sequence[str]) -> str:
    kinds = sorted({n.rsplit(".", 1)[-1] for n in linear})
    return f"its linear layers are named {', '.join(kinds)} (or give 'all-linear')"


def kept_modules(model: nn.Module, keep: Iterable[str]) -> list[str]:
    """The names of the modules ``keep`` (``modules_to_save``) names (PEFT's rule: a module whose name ends with it,
    so ``"norm"`` is every norm, ``"head"`` the LM head; the adapters' own modules excepted); ValueError for an entry
    that names none."""
    modules = dict(model.named_modules())
    kept = []
    for k in tuple(keep):
        names = [n for n in modules if n.endswith(k) and not any(part.startswith("lora_") for part in n.split("."))]
        if not names:
            raise ValueError(f"modules_to_save entry {k!r} matches no module of this model (e.g. 'embed_tokens', "
                             "'lm_head', 'norm')")
        kept += names
    return kept


def _frozen_except(model: nn.Module, keep: Iterable[str]) -> list[str]:
    """Freeze every parameter but the adapters and those of the modules named in ``keep`` (:func:`kept_modules`).
    Returns the kept module names."""
    kept = kept_modules(model, keep)
    ids = trained_ids(model, kept)
    for p in model.parameters():
        p.requires_grad_(id(p) in ids)
    return kept


def trained_ids(model: nn.Module, kept: Sequence[str]) -> set[int]:
    """``id()`` of the adapters and of the parameters of the modules ``kept``, under any of their names (a tied
    parameter is trained when either of its modules is kept)."""
    return {id(p) for n, p in model.named_parameters(remove_duplicate=False)
            if is_adapter_param(n) or any(n.startswith(m + ".") for m in kept)}


def add_adapters(model: nn.Module, settings: LoraSettings, generator: torch.Generator | None = None) -> list[str]:
    """Replace every targeted ``nn.Linear`` of ``model`` by a :class:`LoRALinear` around its parameters, put an
    :class:`ExpertLoRA` beside every targeted fused expert parameter, and freeze the base (see the module docstring).
    Returns the adapted module names, then the adapted expert parameters' names. ``generator``: draw the ``A`` matrices
    from it (module by module, in name order) instead of the global generator. The adapters take the base layer's
    dtype and device (on the meta device nothing is drawn: call :func:`reset_adapters` once materialised)."""
    if any(isinstance(m, (LoRALinear, ExpertLoRA)) for m in model.modules()):
        raise ValueError("this model already has LoRA adapters (one adapter per model is supported)")
    targets = lora_targets(model, settings)
    params = expert_targets(model, settings)
    kept_modules(model, settings.modules_to_save)  # checked before anything changes
    for name in targets:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, child)
        r, alpha = settings.rank_alpha(name)
        layer = LoRALinear(base, r, alpha, settings.scaling(r, alpha), settings.lora_dropout)
        layer.train(base.training)
        setattr(parent, child, layer)
    for key in params:  # routed experts: an ExpertLoRA per fused parameter, beside it
        module_name, _, pname = key.rpartition(".")
        experts = model.get_submodule(module_name)
        w = getattr(experts, pname)
        r, alpha = settings.rank_alpha(key)  # PEFT matches the patterns against the parameter's name
        if getattr(experts, "lora_adapters", None) is None:
            experts.lora_adapters = nn.ModuleDict()
        # an expert-parallel module (distributed.expert_parallel) holds experts [first, first + local) of
        # num_experts: the adapter holds those (drawn whole, then sliced: the values of one process)
        in_f, out_f = expert_in_out(experts, w)
        experts.lora_adapters[pname] = ExpertLoRA(w.shape[0], in_f, out_f, r, alpha,
                                                  settings.scaling(r, alpha), device=w.device, dtype=w.dtype,
                                                  first=getattr(experts, "first", 0),
                                                  total=getattr(experts, "num_experts", w.shape[0]))
    if generator is not None and next(model.parameters()).device.type != "meta":
        reset_adapters(model, generator)  # in name order, as checkpoint.adapter.init_adapters draws them
    _frozen_except(model, settings.modules_to_save)
    model.lora_settings = settings
    return targets + params


def reset_adapters(model: nn.Module, generator: torch.Generator | None = None) -> None:
    """Initialise every adapter of ``model`` as PEFT does (module by module, in name order)."""
    for _, m in sorted(all_adapters(model).items()):
        m.reset_lora_parameters(generator)


def all_adapters(model: nn.Module) -> dict[str, LoRALinear | ExpertLoRA]:
    """Every adapter module of ``model`` (projections' and experts'), by module name."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoRALinear, ExpertLoRA))}


def adapted_modules(model: nn.Module) -> dict[str, LoRALinear]:
    return {n: m for n, m in model.named_modules() if isinstance(m, LoRALinear)}


def active_dropout(model: nn.Module) -> list[str]:
    """Adapted modules whose dropout is active now (``p > 0`` in training mode)."""
    return [n for n, m in adapted_modules(model).items() if m.training and isinstance(m.lora_dropout, nn.Dropout)]


@contextlib.contextmanager
def adapters_disabled(model: nn.Module):
    """Within it ``model`` computes as its base (every adapter skipped; PEFT's ``disable_adapter()``): a LoRA run's
    reference model without a second copy of the weights. Not the base when ``modules_to_save`` modules were trained."""
    mods = list(all_adapters(model).values())
    for m in mods:
        m.disabled = True
    try:
        yield model
    finally:
        for m in mods:
            m.disabled = False
