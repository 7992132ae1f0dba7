"""Predict the peak memory of a LongStraw GRPO step before running it: a dry run on the meta device.

The model is built on the ``meta`` device (no memory, no compute) and the engine's own step runs on it: the
planner calls ``engine.prefill`` and ``engine.grpo_backward`` with an injected meter (:class:`LiveMeter`) instead of
restating them. A dispatch mode watches every tensor storage the ops create and its lifetime (storages are freed
when their last tensor dies), so the meter knows the bytes alive at every moment and their peak, phase by phase.
This is the program's own allocation pattern, not a formula, so it follows each family's code (attention K/V,
DeltaNet boundary states, MLA latents, MoE routing) without per-family bookkeeping. What it does not see:
allocator fragmentation and caching (CUDA caching allocator, glibc arenas), the framework's own context (CUDA
context ~0.5 GB, Python), and kernels' private workspaces.

What the dry run samples instead of running it all (its only shortcuts besides the meta paths that
``longstraw.ops.meta`` lists, the prefill's repeated steps among them): ONE branch batch of the G (every batch
allocates alike and frees its graph before the next: the replay's memory is flat in G), and in exact mode the
reverse-pass steps that can set its peak (:func:`peak_steps`: the first and the last two; every other step repeats
the second-to-last with a shorter prefix). Tests hold both to a full dry run. And not every layer: the first and
the last layer, the layers around a repeating period of layer kinds and 2 or 3 of its periods are dry-run
(:func:`layer_samples`) and the runs combined for the whole depth, each role's peak apart (:func:`_segments`: which
moment sets the peak may change with the depth), byte-exact against a dry run of every layer (tests; the real
Llama-3.1-8B, Qwen3.5-27B and GLM-5 configs checked too). Beyond two chunks and one attention block the prompt's
length enters only through the state (see below), so a plan at any length costs about the same: ~4 dry runs of
4-20 layers (more when ``max_prompt_len`` lies below those two lengths: an interpolation search over dry runs).
What a dry run costs is mostly torch's meta kernels, which
:class:`LiveBytes` memoises per op and argument layout (the same storages, fewer Python calls: :data:`MEMO_OPS`,
held byte-equal op by op in ``tests/planner/test_plan_speed.py``).

Breakdown (bytes per device):

``weights``, ``grads``, ``optimizer`` the parameters (master weights), their gradients and AdamW's two moments, in
                       the master dtype (float32 for a bf16/fp16 model, else its own dtype), sharded over the
                       FSDP group when ``gpus > 1``; ``optimizer`` is 0 on the device with ``optimizer_offload``
                       (``"masters"``: the float32 masters on the host too, the device's weights and gradients
                       in the compute dtype, as ``longstraw.offload.HostAdamW(master_on_host=True)`` runs it).
                       With LoRA (``lora=``) only the trained parameters (the adapters and ``modules_to_save``)
                       have a master copy, a gradient and moments; the frozen base counts in ``weights`` only, in
                       the compute dtype, sharded alike (``Plan.settings["lora"]`` splits ``weights``)
``gathered``           what FSDP2's units (``distributed.fsdp``) add to the dry run's peak, the largest of: the
                       all-gathered parameters (compute dtype) of the unit that runs and the one prefetched (two
                       decoder layers, or a layer and the embedding or the LM head, whichever is larger; with tied
                       embeddings the embedding + head unit stays gathered while the layers run forward: two layers
                       beside it); a layer's backward (two layers gathered, its unsharded gradients held until its
                       post-backward, the previous unit's reduce-scatter input in flight); the reduce-scatter input
                       (float32 for bf16/fp16, else the compute dtype; trained parameters only: with LoRA, the
                       adapters') of the largest unit. A unit's unsharded gradient itself is not added: the dry run
                       holds every gradient as autograd makes it (with tied embeddings the head's, kept until the
                       embedding's arrives, and their sum), and the unit's parameters are resharded before its
                       reduce-scatter input is filled (:func:`_gathered_bytes`). Checked with the per-rank peaks on
                       gloo (tests/planner), at a 32K vocabulary too
``prompt_state``       the stored state of the prompt (after prefill)
``prompt_state_grad``  its gradient buffers (exact mode)
``prefill_chunk``      transient peak above the state while one chunk is prefilled (and, in exact mode, while a
                       chunk is recomputed and back-propagated)
``branch_graph``       transient peak of one branch batch's forward + backward, excluding the LM-head chunk
``logits``             the float32 logits of one LM-head chunk (forward + backward buffers)
``kept_graphs``        exact mode with a graph budget (``GRPOConfig.graph_budget_bytes``, ``plan(graph_budget=)``):
                       the prompt-step graphs the prefill keeps for the reverse pass, ``min(budget, every step's)``,
                       one step's priced as the dry run's reverse-pass step (``prefill_chunk``: an upper bound)
``all_to_all``         expert parallelism (``ep > 1``) only: the token buffers its exchanges add (below)

``peak = weights + grads + optimizer + gathered + prompt_state + prompt_state_grad + max(prefill_chunk,
branch_graph + logits) + kept_graphs`` (the kept graphs live from the prefill through the replay; the reverse pass
frees each before it recomputes a step, so the sum is an upper bound). With ``gpus > 1`` (``fsdp``, the default there) FSDP2 shards every parameter over
``gpus / replicate`` ranks (``replicate`` > 1: HSDP); with context parallelism ``cp`` the prompt state and its
gradient are divided by ``cp`` (sharded by position). ``Plan.assumptions`` says what shards what, in which dtypes.

Expert parallelism (``ep = E > 1``, as ``init_distributed(ep=E)`` runs it): the routed experts of every MoE layer are
split over E ranks, each block FSDP-sharded again over the ``gpus / E`` ranks that hold it (its own FSDP unit, over
the expert-data-parallel group), so their weights, gradients and moments count ``1/gpus`` of the experts per device
(the largest of FSDP's chunks of a block), and a layer's gathered units hold the rest of the layer and its ``1/E``
block, not all its experts (with ``gpus == E`` the blocks stay whole and are not gathered); their LoRA adapters
(``target_parameters``) are split over the E ranks only, each rank holding its experts' part. ``all_to_all``: the
exchanges' buffers with balanced routing (every rank receives its share of the slots): in a no-grad prefill one MoE
layer's send and receive buffers of its inputs and outputs (``4 x tokens x top_k x hidden`` in the compute dtype),
and in a graph (a branch batch, a recomputed chunk) the received inputs and returned outputs that every MoE layer
keeps for its backward (``2 x tokens x top_k x hidden`` per MoE layer; one layer's with ``checkpoint_layers``),
whichever is largest; routing imbalance scales the receive side (``expert_load`` in a run's metrics measures it).
The dry run itself computes the experts as one process does, except that the contiguous copies of the adapters'
factors that the grouped dispatch keeps in a graph (LoRA on the experts) are a rank's ``1/E`` of them
(``ops.meta.expert_split``).

LoRA: the meta model gets its adapters exactly as a run's does (``models.lora.add_adapters``: the same targets,
shapes and frozen parameters for every family and target rule), and the dry run runs through them, so the
activations of the adapter path are counted where they live: the ``x A^T`` ``[tokens, r]`` each adapted layer
keeps for its backward, the adapter's ``[tokens, out]`` outputs while they are added (prefill and recomputed
chunks included), and, with dropout in detached mode, the dropped copy of each adapted layer's input; and what
it no longer allocates is gone too (no weight gradient of a frozen layer in the backward).

``max_prompt_len`` and long prompts: beyond two prefill chunks and one attention block, the transients stop growing
and the state grows linearly (K/V per position, recurrent states per chunk), so two dry runs give the line for
any longer prompt, solved for the memory limit; shorter prompts are dry-run directly.
"""

from __future__ import annotations

import argparse
import json
import math
import weakref
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from longstraw.ops import meta as meta_ops
from longstraw.state import Placement, PromptState, chunk_bounds
from longstraw.units import format_bytes, format_tokens, parse_bytes, parse_tokens

_ATTN_BLOCK = 32768  # ops.attention.segment_attention's default max_segment
PEAK_STEPS_ONLY = True  # the dry run's exact reverse pass walks only the steps that can set its peak

BREAKDOWN_KEYS = ("weights", "grads", "optimizer", "gathered", "prompt_state", "prompt_state_grad", "branch_graph",
                  "prefill_chunk", "logits", "kept_graphs")


# Usable memory of the GPUs the docs name: what ``torch.cuda.get_device_properties(d).total_memory`` (nvidia-smi's
# "Total") reports for the usual SKUs, in MiB. Datasheets' "80 GB", "96 GB", "141 GB" are close to GiB (binary): a
# plain ``--gpu-mem 141G`` is read as 141 GiB, which is what an H200 reports within 0.5 GiB.
DEVICES_MIB = {"H20": 97871, "H100": 81559, "H200": 143771, "B200": 183359, "A100": 81920}
CONTEXT_RESERVE = 1 << 30  # CUDA context (~0.5 GiB) + cuBLAS/cuDNN workspaces
NCCL_RESERVE = 1 << 30  # NCCL's communicator buffers and streams (gpus > 1)
FRAGMENTATION = 0.05  # the caching allocator's fragmentation, as a share of the device's memory


def device_reserve(capacity: int, gpus: int = 1) -> int:
    """Bytes of a device's ``capacity`` that a run's tensors cannot use: the CUDA context and workspaces
    (:data:`CONTEXT_RESERVE`), NCCL's buffers when there is more than one GPU (:data:`NCCL_RESERVE`) and the
    caching allocator's fragmentation (:data:`FRAGMENTATION` of the capacity). The planner compares its peak with
    ``capacity - reserve`` (the trainer's pre-run check on a GPU too)."""
    return int(CONTEXT_RESERVE + (NCCL_RESERVE if gpus > 1 else 0) + FRAGMENTATION * capacity)


def parse_gpu_mem(text: str, name: str = "--gpu-mem") -> int:
    """A device name (H20, H100, H200, B200, A100: its usable total, :data:`DEVICES_MIB`) or a memory size
    (``80G``, ``141G``: binary units, as vendors' GB nearly are) -> bytes."""
    key = str(text).strip().upper()
    if key in DEVICES_MIB:
        return DEVICES_MIB[key] << 20
    try:
        return parse_bytes(text, name)
    except ValueError:
        raise ValueError(f"{name}={text!r} must be a device ({', '.join(DEVICES_MIB)}) or a memory size like 80G, "
                         "141G or a number of bytes") from None


def _tensors(x):
    """The tensors in a nest of lists, tuples and dicts (an op's arguments or results); a plain recursion, as
    ``tree_flatten`` made a dry run 17% slower."""
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, (list, tuple)):
        for y in x:
            yield from _tensors(y)
    elif isinstance(x, dict):
        for y in x.values():
            yield from _tensors(y)


_SCALARS = frozenset({int, float, bool, complex, str, type(None), torch.dtype, torch.device, torch.layout,
                      torch.memory_format})


class _Unkeyed(Exception):
    """An op argument :func:`_op_key` cannot describe by its metadata (the op is then run, never memoised)."""


def _op_key(x):
    """A hashable description of an op argument by what a meta kernel reads: a tensor's shape, strides, storage
    offset, dtype, device and conjugate/negative bits; a scalar with its type (``1``, ``1.0`` and ``True`` promote
    differently); lists, tuples and dicts element by element. Anything else raises :class:`_Unkeyed`."""
    tx = type(x)
    if tx in _SCALARS:
        return (tx, x)
    if tx is tuple or tx is list:
        return (tx, tuple([_op_key(y) for y in x]))
    if isinstance(x, torch.Tensor):
        dt = x.dtype
        if dt.is_complex:  # (the conjugate bit: complex tensors only)
            return (x.shape, x.stride(), x.storage_offset(), dt, x.device, x.is_neg(), x.is_conj())
        return (x.shape, x.stride(), x.storage_offset(), dt, x.device, x.is_neg())
    if tx is dict:
        return (dict, tuple([(k, _op_key(v)) for k, v in x.items()]))
    raise _Unkeyed


_RELAYOUT = frozenset({"set_", "resize_", "resize_as_", "as_strided_"})  # in place, but they move the storage


def _memo_kind(func) -> str | None:
    """How ``func`` may be memoised: ``"fresh"`` (it writes no argument and returns no alias of one: its outputs
    are new storages), ``"inplace"`` (it writes its first argument only and returns it, like ``add_``, ``copy_``,
    ``index_add_``: on meta only a check of shapes and dtypes; those that change its layout, like ``unsqueeze_``, are
    found out on their first call), ``"alias"`` (views: they write nothing and every output aliases an argument,
    so they keep running but create no storage to track), or None (``out=`` ops, ``set_`` and ``resize_``,
    anything else: they keep running and are tracked)."""
    schema = func._schema
    if not schema.is_mutable and all(r.alias_info is None for r in schema.returns):
        return "fresh"
    args, rets = schema.arguments, schema.returns
    if not schema.is_mutable and rets and all(r.alias_info is not None for r in rets):
        return "alias"
    if schema.name.split("::")[-1] in _RELAYOUT:
        return None
    writes = [i for i, a in enumerate(args) if a.alias_info is not None and a.alias_info.is_write]
    if (writes == [0] and len(rets) == 1 and rets[0].alias_info is not None
            and rets[0].alias_info.before_set == args[0].alias_info.before_set):
        return "inplace"
    return None


_MEMO: dict = {}  # (op, argument metadata) -> its outputs' layout, "inplace", or False: not memoisable
_MEMO_KIND: dict = {}  # id(op) -> _memo_kind(op) (ops live as long as the process: ids hash faster)
MEMO_OPS = True  # LiveBytes memoises the meta kernels' output metadata; tests switch it off


class LiveBytes(TorchDispatchMode):
    """Tracks bytes of tensor storages created under the mode that are still alive, and their peak.

    On the meta device an op's outputs are a pure function of its arguments' metadata, and a dry run repeats the
    same ops on the same shapes thousands of times (every delta-rule block, layer and step alike), while torch's
    meta kernels (Python reference implementations for most pointwise ops) cost ~0.1-7 ms each. So with
    :data:`MEMO_OPS` the mode remembers, per op and argument metadata (:func:`_op_key`), the outputs' shapes,
    strides and dtypes, and the next time allocates fresh tensors of exactly that layout instead of running the
    kernel; an in-place op that only writes (on meta: checks) its first argument and returns it is answered with
    that argument. Only ops whose outputs are fresh storages laid out as ``empty_strided`` lays them out, or, in
    place, the unchanged first argument, are memoised (checked on the first call, :func:`_memo_kind`): the
    storages and bytes tracked are the ones the kernel would have created. Tests hold every tracked byte equal with
    and without it, op by op."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        """No ``torch._disable_dynamo`` wrapper around :meth:`__torch_dispatch__` (recent torch adds one to every
        mode's, ~5-10 us on each of a dry run's million ops): a dry run never runs under ``torch.compile``."""
        return False

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0  # the current segment's peak (one segment unless :meth:`set_segment` is called)
        self.segment = LAYERS
        self._peaks: dict[tuple, int] = {}  # the other segments' peaks since :meth:`reset_peak`
        self._ids: dict[int, weakref.ref] = {}  # the tracked storages' ids -> a weak reference that frees them
        self._memo = _MEMO  # shared by every dry run of the process (what it holds is true of any)

    def reset_peak(self) -> None:
        self._peaks = {}
        self.peak = self.live

    def set_segment(self, name: tuple) -> None:
        """Count the peak from now on under segment ``name`` (:func:`_segments`): each segment keeps its own peak
        since :meth:`reset_peak`, and ``peak`` is the current one's (the op hot path is unchanged)."""
        if name != self.segment:
            self._peaks[self.segment] = self.peak
            self.segment = name
            self.peak = max(self._peaks.get(name, 0), self.live)

    def segment_peaks(self) -> dict[tuple, int]:
        """``{segment: its peak since reset_peak}`` of every segment that ran (the current one included)."""
        return {**self._peaks, self.segment: max(self.peak, self._peaks.get(self.segment, 0))}

    def _free(self, key: int, nbytes: int) -> None:
        self._ids.pop(key, None)
        self.live -= nbytes

    def _track(self, st) -> None:
        """Count a new storage as alive until it is freed (a weak reference's callback: cheaper than
        ``weakref.finalize``, which the mode would pay on every op's output)."""
        key, n = id(st), st.nbytes()
        self._ids[key] = weakref.ref(st, lambda _, key=key, n=n: self._free(key, n))
        self.live += n

    def _replay(self, func, args, kwargs):
        """``(key, out)``: the memoised result of ``func`` on these arguments (fresh meta tensors, or the first
        argument of an in-place op) with its key, ``(key, None)`` when it is memoisable but not seen yet (the
        caller then records it), or ``(None, None)``."""
        if not MEMO_OPS:
            return None, None
        kind = _MEMO_KIND.get(id(func), 0)
        if kind == 0:
            kind = _MEMO_KIND[id(func)] = _memo_kind(func)
        if kind is None or kind == "alias":
            return None, None
        try:
            key = (id(func), _op_key(args), _op_key(kwargs) if kwargs else None)
            spec = self._memo.get(key)
        except (_Unkeyed, TypeError):  # (TypeError: an unhashable value inside a scalar type)
            return None, None
        if spec is None:
            return key, None
        if spec is False:
            return None, None
        if spec == "inplace":
            return key, args[0]
        many, metas = spec
        outs = [torch.empty_strided(shape, stride, dtype=dtype, device=device) for shape, stride, dtype, device in metas]
        return key, (many(outs) if many is not None else outs[0])

    def _record(self, key, func, args, kwargs, out) -> None:
        """Remember ``out`` under ``key``: its layout when every output is a fresh meta tensor that ``empty_strided``
        reproduces storage for storage, ``"inplace"`` when an in-place op returned its first argument with its
        metadata unchanged; else mark the key as not memoisable."""
        spec = False
        kind = _MEMO_KIND.get(id(func))
        if kind == "inplace":
            if out is args[0] and out.device.type == "meta" and _op_key(out) == key[1][1][0]:
                spec = "inplace"
        elif kind == "fresh":
            many = type(out) if isinstance(out, (list, tuple)) else None
            outs = list(out) if many is not None else [out]
            if outs and all(type(t) is torch.Tensor and t.device.type == "meta" and not t.is_conj()
                            and not t.is_neg() and t.storage_offset() == 0 for t in outs):
                inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
                storages = [t.untyped_storage() for t in outs]
                ids = {id(st) for st in storages}
                fresh = len(ids) == len(outs) and not ids & inputs and not ids & self._ids.keys()
                if fresh and all(st.nbytes() == torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                                     device="meta").untyped_storage().nbytes()
                                 for t, st in zip(outs, storages)):
                    spec = (many, [(tuple(t.shape), t.stride(), t.dtype, t.device) for t in outs])
        self._memo[key] = spec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        key, out = self._replay(func, args, kwargs)
        if out is not None:
            if out is args[0]:  # an in-place op: no new storage
                return out
            for t in (out if isinstance(out, (list, tuple)) else (out,)):  # fresh storages (``_record``)
                self._track(t.untyped_storage())
            self.peak = max(self.peak, self.live)
            return out
        out = func(*args, **(kwargs or {}))
        if key is not None:
            self._record(key, func, args, kwargs, out)
        elif MEMO_OPS and _MEMO_KIND.get(id(func)) == "alias":  # a view: no new storage
            return out
        outs = list(_tensors(out))
        if not outs:
            return out
        inputs = {id(t.untyped_storage()) for t in _tensors((args, kwargs))}
        for t in outs:
            st = t.untyped_storage()
            key = id(st)
            if key in inputs or key in self._ids:
                continue
            self._track(st)
        self.peak = max(self.peak, self.live)
        return out


class LiveMeter:
    """The engine's meter (``profiling.PhaseMeter``'s interface) for a dry run: per phase, the bytes alive when it
    starts (``start``) and ends (``end``) and the peak while it runs (``peak``), from a :class:`LiveBytes`."""

    def __init__(self, lb: LiveBytes):
        self.lb = lb
        self.start: dict[str, int] = {}
        self.end: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.segment_peak: dict[str, dict[tuple, int]] = {}  # phase -> {segment: its peak} (:func:`_segments`)
        self.seconds: dict[str, float] = {}
        self.peak_bytes = self.peak
        self.on_start = None  # called with each phase's name as it starts

    @contextmanager
    def phase(self, name: str):
        if self.on_start is not None:
            self.on_start(name)
        self.lb.reset_peak()
        self.start[name] = self.lb.live
        try:
            yield lambda done, total: None
        finally:
            peaks = self.segment_peak[name] = self.lb.segment_peaks()
            self.end[name], self.peak[name] = self.lb.live, max(peaks.values())

    def transient(self, name: str, segment: tuple) -> int:
        """The peak of ``segment`` in phase ``name`` above what the phase left alive at its end (what it needed only
        while it ran; negative for a segment that ran while less was alive: still linear in the layers)."""
        return self.segment_peak[name][segment] - self.end[name]

    def above_start(self, name: str, segment: tuple) -> int:
        """The peak of ``segment`` in phase ``name`` above what was alive when the phase started."""
        return self.segment_peak[name][segment] - self.start[name]


@dataclass
class Plan:
    peak_bytes: int
    breakdown: dict[str, int]
    max_prompt_len: int | None
    settings: dict = field(default_factory=dict)
    limit_bytes: int | None = None  # the memory per device it was planned against (gpu_mem - reserve), or None

    @property
    def fits(self) -> bool | None:
        """Whether the peak fits ``limit_bytes`` (None when no limit was given)."""
        return None if self.limit_bytes is None else self.peak_bytes <= self.limit_bytes

    def to_json(self) -> dict:
        out = {"peak_bytes": int(self.peak_bytes), "breakdown": {k: int(self.breakdown[k]) for k in BREAKDOWN_KEYS
                                                                 + (("all_to_all",) if "all_to_all" in self.breakdown
                                                                    else ())},
               "max_prompt_len": self.max_prompt_len, "fits": self.fits,
               "prompt_len": self.settings.get("prompt_len"), "response_len": self.settings.get("response_len"),
               "assumptions": self.settings.get("assumptions", {})}
        if "memory" in self.settings:  # the device's memory, the reserve, what is left for the run
            out["memory"] = dict(self.settings["memory"])
        if "graph_budget" in self.settings:  # exact mode with a graph budget: what it keeps, the predicted saving
            out["graph_budget"] = dict(self.settings["graph_budget"])
        if "lora" in self.settings:  # a LoRA plan: what was adapted, and how ``weights`` splits
            out["lora"] = dict(self.settings["lora"])
        if "host" in self.settings:  # offloads: host memory per device and the state's and its gradient's traffic
            out["host"] = dict(self.settings["host"])
        if "phase_peaks" in self.settings:  # the two phases' peaks (offload_state, or where the forward ones bind)
            out["phase_peaks"] = dict(self.settings["phase_peaks"])
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _meta_model(hf_config: dict, dtype: torch.dtype):
    from longstraw.models.registry import build_on_meta

    return build_on_meta(hf_config).to(dtype)


def _rehearses(mla) -> bool:
    """Whether a ``cp > 1`` dry run runs this MLA layer's CP step (:class:`_CPRehearsal`): plain MLA, not DSA's
    (an indexer's ``index_topk``; counted by formula in :func:`_mla_cp_step`)."""
    return getattr(mla, "index_topk", None) is None


class _CPRehearsal(Placement):
    """A ``cp > 1`` plan's placement: the single-process prompt state (whose bytes the plan divides by ``cp``),
    except that the prompt steps (prefill and reverse pass) run some layers as the group's last rank does, over a
    stand-in group (``distributed.rehearsal.RehearsalComm``), so that the dry run counts what a rank allocates there;
    the replay and decoding read the plain state, as on a CP rank.

    * Gated DeltaNet layers: through ``cp_recurrent.rehearsal_prefix``, the scan of the group's last rank (the
      widened rule, the gathered transfers of ``cp`` pieces, the fold, the output correction).
    * MLA layers (``models.mla.LatentState``; not DSA's, counted by formula in ``_mla_cp_step``): a rank's share of
      the stored latents as a ``cp_latent.ShardedLatentSegment`` (``rehearsal.latent_share``), so the layer takes
      the group's form (``MLAttention.choose_form`` over the step's ``cp`` pieces and every rank's share) and runs
      its CP attention: the step's latents gathered, the pieces' queries and partials exchanged one at a time,
      the earlier pieces' latent gradients sent back. Before (2026-12-07) the dry run ran one process's chunk in the
      group's form and a formula (``cp_latent.mla_step_bytes``) added the exchange on top, which the run does not
      hold together with that chunk's transient: a DeepSeek-V3-style model at a 2,048-token prompt in chunks of 512
      planned 1.61x the measured peak at cp = 2 (1.71x while the dry run took one chunk's form)."""

    def __init__(self, cp: int):
        self.cp = cp

    def prompt_state(self, model, ids, chunk_size, exact):
        from longstraw.models.mla import MLAttention

        n = int(ids.shape[0])
        plain_mla = [isinstance(layer.mixer, MLAttention) and _rehearses(layer.mixer) for layer in model.layers]
        return _RehearsedPromptState(model.new_prompt_states(n, exact), ids, chunk_bounds(n, chunk_size), self.cp,
                                     chunk_size, plain_mla)


class _RehearsedPromptState(PromptState):
    def __init__(self, layers, token_ids, chunks, cp: int, chunk_size: int, plain_mla: list[bool]):
        from longstraw.distributed.cp_state import shard_layout

        super().__init__(layers, token_ids, chunks)
        self.cp, self.plain_mla = cp, plain_mla  # per layer: a plain MLA layer (not DSA's), rehearsed
        n = int(token_ids.shape[0])
        self.layout = shard_layout(n, cp, chunk_size) if n >= cp else None
        self.cp_steps = self.layout.step_bounds() if self.layout is not None else [(0, n)]

    def stored_before(self, start: int) -> int:
        """The prompt positions stored before the CP step that prompt position ``start`` falls in."""
        return next((s for s, e in self.cp_steps if s <= start < e), self.cp_steps[-1][0])

    def step_prefix(self, step: int, grad: bool) -> list:
        from longstraw.distributed.cp_recurrent import rehearsal_prefix
        from longstraw.distributed.rehearsal import latent_share
        from longstraw.models.deltanet import RecurrentState
        from longstraw.models.mla import LatentState

        s, e = self.chunks[step]
        out = []
        for ls, p, mla in zip(self.layers, super().step_prefix(step, grad), self.plain_mla, strict=True):
            if isinstance(ls, RecurrentState):
                p = rehearsal_prefix(p, self.cp, e - s)
            elif mla and type(ls) is LatentState and self.layout is not None:
                p = latent_share(ls, self.layout, self.cp, self.stored_before(s), e - s, grad)
            out.append(p)
        return out


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _layer_bytes(model) -> int:
    return max((sum(p.numel() * p.element_size() for p in layer.parameters()) for layer in model.layers), default=0)


def peak_steps(steps: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """The prefill steps whose recomputation can set the exact reverse pass's peak: the last two (the longest
    prefixes; the last one may be short) and the first (no prefix: fresh zero states); every other step repeats the
    second-to-last with a shorter prefix. The first step may then run beside a recurrent boundary's gradient that
    the skipped steps would have consumed: a slight over-estimate, never under."""
    return [steps[0]] + steps[-2:] if len(steps) > 3 else list(steps)


LAYERS, ENDS = ("layers",), ("ends",)  # a dry run's peak segments besides the layers' roles (:func:`_segments`)


@contextmanager
def _segments(model, lb: LiveBytes, roles: list[tuple] | None = None):
    """Count a dry run's peaks in segments (``lb.set_segment``): ``ENDS`` while the embedding runs (forward, and
    backward from the moment its output's gradient arrives until the next layer starts) and while the final norm
    and the LM head run, and after the last layer (until a layer's backward starts), and while a layer runs (forward, a
    checkpointed layer's recomputation, and backward from the moment the first autograd node of its outputs runs,
    its state pieces' included) its role in the sampled model (``roles``, from :func:`layer_samples`; None: one
    segment for every layer), forward apart from backward (a moment in a layer's forward counts the layers below
    it, one in its backward also what every layer's backward needs from the start: the state gradient's seeds).

    Why: layer sampling (:func:`layer_samples`) combines dry runs of a few layers linearly, which holds for each
    moment's bytes (a sum over the layers plus the ends) but not for a maximum over moments whose winner changes
    with the depth. Seen before the peaks were split: a full-FT step whose embedding's dense ``[V, H]`` gradient set
    the reverse pass's peak in runs of 4-6 layers while, at 64 layers, the checkpointed inputs of every layer plus
    one layer's graph set it (27B hybrid: 3.2 GiB planned where a dry run of every layer has 5.1); a LoRA step whose
    first layer (no input gradient: the embedding is frozen) set the peak of a 2-layer run (Llama-3.1-8B: 1.6x); a
    layer's forward transient against its backward's (0.5% low). Within a segment the winner does not depend on the
    depth; the segments' peaks are combined apart, then the largest taken (:func:`_finish`)."""
    backbone = model.model
    roles = [LAYERS] * len(backbone.layers) if roles is None else roles
    seg = lambda name: (lambda *_: lb.set_segment(name))  # noqa: E731

    def embed_out(_m, _args, out):
        if out.requires_grad:
            out.register_hook(seg(ENDS))  # the embedding's backward follows

    def layer_out(role):
        def hook(_m, _args, out):
            if torch._C._current_graph_task_id() == -1:  # a forward (not a checkpointed layer's recomputation):
                lb.set_segment(ENDS)  # what runs after the last layer is the ends' (the next layer's hook follows)
            nodes = {id(t.grad_fn): t.grad_fn for t in _tensors(out) if t.grad_fn is not None}
            for node in nodes.values():  # the first of them to run in a backward starts this layer's
                node.register_prehook(seg(role + ("backward",)))
        return hook

    def layer_in(role):
        def hook(*_):  # a forward, or a checkpointed layer's recomputation within its backward
            lb.set_segment(role + (("backward",) if torch._C._current_graph_task_id() != -1 else ("forward",)))
        return hook

    handles = [backbone.embed_tokens.register_forward_pre_hook(seg(ENDS)),
               backbone.embed_tokens.register_forward_hook(embed_out),
               backbone.norm.register_forward_pre_hook(seg(ENDS))]
    for layer, role in zip(backbone.layers, roles):
        handles += [layer.register_forward_pre_hook(layer_in(role)), layer.register_forward_hook(layer_out(role))]
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        lb.set_segment(LAYERS)


def _dry_run_raw(model, prompt_len: int, response_len: int, group: int, cfg, state_only: bool = False,
                 roles: list[tuple] | None = None) -> dict:
    """The tracked bytes of one dry run before they are combined into breakdown terms (:func:`_finish`): every
    value is a sum over the layers plus what the ends add, so dry runs of sampled layers combine linearly.
    ``grad_at_replay``: the state gradient's bytes when the replay starts (after ``enable_grad``). ``state_only``:
    stop there (the prefill and the state's gradient buffers only: what the long-prompt line needs at its first
    point)."""
    from longstraw.engine.grpo import build_prompt_state, grpo_backward

    prompt = torch.zeros(prompt_len, dtype=torch.long)  # host ids, checked like a real call's; moved to meta
    n = min(group, cfg.branch_batch)
    responses = [torch.zeros(response_len, dtype=torch.long) for _ in range(n)]
    ref = [torch.zeros(response_len) for _ in range(n)] if cfg.kl_coef else None
    w, _ = model.head()
    vocab = w.shape[0]
    meter = LiveMeter(LiveBytes())
    if state_only:
        with meter.lb:
            state = build_prompt_state(model, prompt.to(w.device), cfg, cfg.exact)
            host_fwd = state.host_nbytes()  # offload_state: moved during the prefill already
            if cfg.offload_state:  # as grpo_backward does before the replay
                state.offload()
            if cfg.exact:
                state.enable_grad(offload=cfg.offload_state_grad)
            out = {"prompt_state": state.nbytes(), "grad_at_replay": state.grad_nbytes(),
                   "grad_host": state.grad_host_nbytes(), "state_host": state.host_nbytes(),
                   "state_host_fwd": host_fwd}
            state.release_grad()
            del state
        return out
    for p in model.parameters():
        if p.requires_grad:  # (a LoRA model's frozen base has none)
            p.grad = torch.zeros_like(p)  # an accumulating step holds them throughout
    marks: dict[str, int] = {}
    with meter.lb, _segments(model, meter.lb, roles):
        with meter.phase("prompt_state"):
            state = build_prompt_state(model, prompt.to(w.device), cfg, cfg.exact)
        state_bytes, host_fwd = state.nbytes(), state.host_nbytes()
        with meter.phase("decode"):
            _decode_step(model, state, group, response_len, cfg)
        if cfg.exact and PEAK_STEPS_ONLY:
            state.chunks = peak_steps(state.chunks)
        meter.on_start = lambda name, st=state: marks.setdefault(name, st.grad_nbytes())
        stats = grpo_backward(model, prompt, responses, torch.zeros(n), cfg, ref_logprobs=ref, prompt_state=state,
                              meter=meter)
        meter.on_start = None
        del state
    tokens = min(cfg.logprob_chunk, cfg.branch_batch * response_len)
    acc = 8 if w.dtype == torch.float64 else 4
    for p in model.parameters():
        p.grad = None
    return {"prompt_state": state_bytes, "prompt_state_grad": stats.prompt_state_grad_bytes,
            "grad_at_replay": marks.get("replay", 0), "grad_host": stats.prompt_state_grad_host_bytes,
            "state_host": stats.prompt_state_host_bytes, "state_host_fwd": host_fwd,
            # each phase's peak per segment (:func:`_segments`), keyed (phase, segment), not clipped at 0: combined
            # apart over layer samples, the largest taken by :func:`_finish`
            **{("prefill", sg): meter.transient("prompt_state", sg) for sg in meter.segment_peak["prompt_state"]},
            **({("recompute", sg): meter.above_start("prompt_backward", sg)
                for sg in meter.segment_peak["prompt_backward"]} if cfg.exact else {}),
            **{("replay", sg): meter.above_start("replay", sg) for sg in meter.segment_peak["replay"]},
            # the rollout: the G branches' decode buffers and one decode step (:func:`_decode_step`)
            **{("decode", sg): meter.above_start("decode", sg) for sg in meter.segment_peak["decode"]},
            "sampling": 3 * group * vocab * acc,
            # forward logits, softmax/grad buffer, grad in the weights' dtype (upper bound): no layer in it
            "logits": 3 * tokens * vocab * acc}


def _decode_step(model, state, group: int, response_len: int, cfg) -> None:
    """A rollout's memory on the meta ``state`` (the forward phases' peak): the ``group`` branches' decoders, sized
    for ``response_len`` new tokens as ``generate`` sizes them, and one decode step through the model, as
    ``engine.rollout.generate`` runs it; sampling's ``[G, V]`` float32 buffers are added by formula (``_finish``).
    Everything is freed before it returns."""
    from longstraw.engine.config import autocast_context

    w, _ = model.head()
    decoders = [ls.decoder(group, response_len) for ls in state.layers]
    tokens = torch.zeros(group, 1, dtype=torch.long, device=w.device)
    with torch.no_grad(), autocast_context(cfg, w.device):
        hidden, pieces = model.run(tokens, state.length, [d.prefix(0) for d in decoders])
        for d, piece in zip(decoders, pieces):
            d.append(piece, 0)
        del pieces
    logits = model.lm_head(hidden[:, -1])  # noqa: F841 - [G, V], outside autocast as generate computes it
    del hidden, logits, decoders


def _finish(raw: dict[str, int]) -> dict[str, int]:
    if "logits" not in raw:  # a state-only run
        return dict(raw)
    logits = raw["logits"]
    phase = lambda *names: max([0] + [v for k, v in raw.items() if isinstance(k, tuple) and k[0] in names])  # noqa
    replay, prefill = phase("replay"), phase("prefill", "recompute")
    return {"grad_at_replay": raw["grad_at_replay"], "grad_host": raw["grad_host"], "prompt_state": raw["prompt_state"],
            "state_host": raw["state_host"], "state_host_fwd": raw["state_host_fwd"],
            "forward_chunk": phase("prefill"), "decode": phase("decode") + raw["sampling"],
            "prompt_state_grad": raw["prompt_state_grad"], "prefill_chunk": prefill,
            "branch_graph": max(0, replay - logits), "logits": min(logits, replay)}


def dry_run(model, prompt_len: int, response_len: int, group: int, cfg, state_only: bool = False
            ) -> dict[str, int]:
    """Run the engine's GRPO step (``prefill`` then ``grpo_backward``) on the meta ``model`` under ``cfg`` (a
    ``GRPOConfig``) and return the tracked bytes per phase (module docstring: one branch batch, the peak steps)."""
    out = _finish(_dry_run_raw(model, prompt_len, response_len, group, cfg, state_only))
    return out if state_only else {k: v for k, v in out.items() if k not in _PRIVATE}


# what a dry run tracks besides the breakdown: the state gradient's bytes at the replay and in host memory, the
# state's bytes in host memory in the backward and in the forward phases (offload_state), the no-grad prefill's
# transient and the rollout's bytes (the forward phases' peak terms)
_PRIVATE = ("grad_at_replay", "grad_host", "state_host", "state_host_fwd", "forward_chunk", "decode")

_INDEX_ATTRS = frozenset({"layer_index", "source_index", "layer_idx"})


def _layer_kind(layer) -> tuple:
    """What makes two decoder layers allocate alike in a dry run: their modules' classes and plain settings (every
    int/float/bool/str attribute but the layer's own index), their parameters' and buffers' names, shapes, dtypes
    and ``requires_grad`` (full attention, DeltaNet, MLA, DSA, MoE or dense FFN, sliding window, adapters, ...).
    A shared DSA layer (it reads another layer's selection) is its own kind."""
    key: list = []
    for name, m in layer.named_modules():
        attrs = tuple(sorted((k, v) for k, v in vars(m).items() if not k.startswith("_") and k not in _INDEX_ATTRS
                             and isinstance(v, (int, float, bool, str, type(None)))))
        key.append((name, type(m).__qualname__, attrs, getattr(m, "source_index", None) is None))
    key += [(n, tuple(p.shape), p.dtype, p.requires_grad) for n, p in layer.named_parameters()]
    key += [(n, tuple(b.shape), b.dtype) for n, b in layer.named_buffers()]
    return tuple(key)


def _periods(keys: list) -> list[tuple[int, int, int]]:
    """Every ``(p, a, k)`` such that the layers between the first and the last hold ``k >= 4`` whole periods of ``p``
    layers from layer ``a`` (their kinds repeat), the most layers covered first (then the shortest period)."""
    n = len(keys)
    found = []
    for p in range(1, (n - 2) // 4 + 1):
        for a in range(1, n - 1):
            k = 0
            while a + (k + 1) * p <= n - 1 and keys[a + k * p:a + (k + 1) * p] == keys[a:a + p]:
                k += 1
            if k >= 4:
                found.append((p, a, k))
    return sorted(found, key=lambda f: (-f[0] * f[2], f[0], f[1]))


def layer_samples(model) -> tuple[list[list[int]], list, list[list[tuple]]] | None:
    """Which layers to dry-run instead of all of them, and how to combine the runs: ``(subsets, weights, roles)``
    with ``full = sum(w * dry_run(subset))`` for every tracked quantity, each run's peaks counted per segment by the
    layers' ``roles`` (:func:`_segments`); None when sampling saves nothing.

    The layers between the first and the last are seen as a prefix, ``k`` repeats of a period of layer kinds
    (:func:`_layer_kind`; a dense or MoE stack: one layer, a 3:1 hybrid: four) and a suffix. The runs hold the first
    and the last layer, the prefix, the suffix and 2 or 3 periods: ``full = (3 - k) run_2 + (k - 2) run_3``. Why it
    is exact: a moment's bytes are a sum over the layers (each layer's state, saved activations, gradients, what its
    backward left) plus what the ends add, and a transient is the largest of such moments. Which moment is the
    largest may change with the depth (an embedding's dense gradient in a few layers, the checkpointed inputs of 64;
    a frozen first layer that computes no input gradient), so the peaks are counted apart per role: the first and
    the last layer, each prefix and suffix layer, each position of the first period, each position of the later
    periods. Within a role the largest moment is at the same place whatever the number of periods (the topmost of
    the later periods, or the lowest, by what its moment counts of the layers below and above it), so each role's
    peak is linear in ``k`` and the roles' peaks combine linearly, apart (then the largest is taken). Tests hold the
    combination equal to a full dry run."""
    n = len(model.layers)
    keys = [_layer_kind(layer) for layer in model.layers]
    sources = [getattr(layer.mixer, "source_index", None) for layer in model.layers]
    for p, a, k in _periods(keys):  # the first whose runs hold the source layer of every shared DSA layer in them
        end = a + k * p
        outer = list(range(1, a)) + list(range(end, n - 1))
        subsets = [sorted({0, n - 1, *outer, *range(a, a + m * p)}) for m in (2, 3)]
        if all(sources[i] is None or sources[i] in idx for idx in subsets for i in idx):
            break
    else:
        return None

    def roles(idx: list[int]) -> list[tuple]:
        out = []
        for i in idx:
            if i in (0, n - 1):
                out.append(("first",) if i == 0 else ("final",))
            elif i < a or i >= end:
                out.append(("outer", i))
            else:
                out.append(("period" if i < a + p else "periods", (i - a) % p))
        return out

    if sum(len(x) for x in subsets) >= n:
        return None
    return subsets, [3 - k, k - 2], [roles(x) for x in subsets]


@contextmanager
def _only_layers(model, idx: list[int]):
    """The model with only the layers ``idx`` (in order) for the duration (a dry run of sampled layers)."""
    full = model.model.layers
    model.model.layers = torch.nn.ModuleList([full[i] for i in idx])
    try:
        yield model
    finally:
        model.model.layers = full


SAMPLE_LAYERS = True  # dry-run sampled layers (:func:`layer_samples`) instead of all; tests switch it off


def sampled_dry_run(model, prompt_len: int, response_len: int, group: int, cfg, samples=None,
                    state_only: bool = False) -> dict[str, int]:
    """:func:`dry_run` of the whole model, from dry runs of the layer samples (``layer_samples(model)``; None:
    all the layers), with ``grad_at_replay`` (see :func:`_dry_run_raw`)."""
    if samples is None or not SAMPLE_LAYERS:
        return _finish(_dry_run_raw(model, prompt_len, response_len, group, cfg, state_only))
    subsets, weights, roles = samples
    total: dict = {}
    for idx, w, r in zip(subsets, weights, roles):
        with _only_layers(model, idx):
            raw = _dry_run_raw(model, prompt_len, response_len, group, cfg, state_only, roles=r)
        for k, v in raw.items():
            total[k] = total.get(k, 0) + w * v
    return _finish({k: int(round(v)) for k, v in total.items()})  # (the weights sum to 1: logits stay as they are)


def naive_step_bytes(model_or_config, prompt_len: int, response_len: int, group: int, dtype=None) -> int:
    """Peak bytes above the weights of a naive full-graph GRPO step (G x (P + R) tokens through autograd with
    logits for every position, as an HF model computes them), from a meta-device dry run of our model."""
    from longstraw.ops.logprobs import token_logprobs_reference

    hf_cfg = model_or_config if isinstance(model_or_config, dict) else model_or_config.hf_config
    if dtype is None:
        dtype = next(model_or_config.parameters()).dtype if not isinstance(model_or_config, dict) else torch.float32
    from longstraw.checkpoint.hf import parse_dtype

    model = _meta_model(hf_cfg, parse_dtype(dtype))
    ids = torch.zeros(group, prompt_len + response_len, dtype=torch.long, device="meta")
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    with LiveBytes() as lb:
        with torch.enable_grad():
            hidden, _ = model.run(ids)
            w, b = model.head()
            lp, _ = token_logprobs_reference(hidden.reshape(-1, hidden.shape[-1]), w, ids.reshape(-1), bias=b)
            lp.sum().backward()
        peak = lb.peak
    return int(peak + _param_bytes(model))  # + the gradients


def _dtype_bytes(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def _expert_params(module) -> list:
    """The routed experts' fused weights under ``module`` (``Experts.gate_up_proj`` / ``down_proj``) and their LoRA
    adapters' (``target_parameters``): what expert parallelism splits over its ranks, outside FSDP."""
    from longstraw.distributed.expert_parallel import expert_params

    return [p for m in module.modules() if hasattr(m, "ep_tensor_names") for p in expert_params(m)]


def _fixed_bytes(model, compute: torch.dtype, *, gpus: int, cp: int, fsdp: bool | None, replicate: int,
                 master_dtype: str, optimizer_states: int, optimizer_offload: str, ep: int = 1,
                 ep_shard: bool = True) -> tuple[dict, dict, dict, int]:
    """Per-device bytes of the parameters, gradients, optimiser state and FSDP's gathered buffers, what was assumed
    (which group shards what, in which dtype), how ``weights`` splits (frozen / adapters / other trained) and the
    optimiser state's bytes in host memory per device (``optimizer_offload``; 0 without). The
    trained parameters (``requires_grad``: every one, or a LoRA model's adapters and ``modules_to_save``) are held
    in the master dtype with a gradient and the moments; the frozen ones (a LoRA model's base) in the compute
    dtype, weights only. ``ep > 1``: the routed experts split over ``ep`` ranks instead of FSDP-sharded (module
    docstring)."""
    from longstraw.checkpoint.hf import parse_dtype
    from longstraw.models.lora import is_adapter_param

    fsdp = gpus > 1 if fsdp is None else fsdp
    if fsdp and gpus // replicate < 2:
        raise ValueError(f"fsdp with gpus={gpus} and replicate={replicate} leaves one GPU per shard group")
    if optimizer_offload == "masters":  # the masters live on the host: the device holds the compute dtype
        master = compute
    elif master_dtype == "auto":
        master = torch.float32 if compute in (torch.bfloat16, torch.float16) else compute
    else:
        master = parse_dtype(master_dtype)

    def count(params, trained: bool) -> int:
        return sum(p.numel() for p in params if p.requires_grad == trained)

    experts = {id(p) for p in _expert_params(model)} if ep > 1 else set()
    # ranks FSDP shards each EP block over: its holders (ep_shard=False: none, each holds all of it)
    edp = gpus // ep if ep > 1 and ep_shard else 1
    from longstraw.distributed.expert_parallel import expert_tensors

    blocks = {id(p) for m in model.modules() if hasattr(m, "ep_tensor_names") for p in expert_tensors(m)} \
        if edp > 1 else set()  # the expert tensors FSDP shards over edp (their adapters stay whole)

    def share(p) -> int:
        """This device's elements of expert parameter ``p``: its EP block, or FSDP's largest chunk of it."""
        if id(p) in blocks:
            return -(-(p.shape[0] // ep) // edp) * (p.numel() // p.shape[0])
        return p.numel() // ep

    params = [p for p in model.parameters() if id(p) not in experts]  # experts under EP: counted apart, below
    n, frozen = count(params, True), count(params, False)  # n: trained parameters
    layer_params = [[p for p in layer.parameters() if id(p) not in experts] for layer in model.layers]
    layer_all = max((sum(p.numel() for p in lp) for lp in layer_params), default=0)
    layer_n = max((count(lp, True) for lp in layer_params), default=0)
    # with FSDP over edp, a layer's experts are a unit of their own: its EP block, gathered inside the layer's
    block_params = [[p for p in layer.parameters() if id(p) in blocks] for layer in model.layers]
    block_all = max((sum(p.numel() // ep for p in bp) for bp in block_params), default=0)
    block_n = max((sum(p.numel() // ep for p in bp if p.requires_grad) for bp in block_params), default=0)
    from longstraw.distributed.fsdp import end_units

    units = [list({id(p): p for m in unit for p in m.parameters()}.values()) for unit in end_units(model)]
    ends_all = max(sum(p.numel() for p in u) for u in units)  # the larger of the embedding and the head units
    ends_n = max(count(u, True) for u in units)
    shard = gpus // replicate if fsdp else 1
    mb, cb = _dtype_bytes(master), _dtype_bytes(compute)
    offload = optimizer_offload != "none"
    adapter_ids = {id(p) for name, p in model.named_parameters() if is_adapter_param(name)}
    adapter_n = sum(p.numel() for p in params if id(p) in adapter_ids)  # (under EP, the experts' apart: below)
    split = {"frozen_params": frozen, "adapter_params": adapter_n, "saved_params": n - adapter_n,
             "frozen_weight_bytes": frozen * cb // shard, "adapter_weight_bytes": adapter_n * mb // shard,
             "saved_weight_bytes": (n - adapter_n) * mb // shard}
    weights = split["frozen_weight_bytes"] + split["adapter_weight_bytes"] + split["saved_weight_bytes"]
    fixed = {"weights": weights, "grads": n * mb // shard,
             "optimizer": 0 if offload else optimizer_states * n * mb // shard, "gathered": 0}
    ex = [p for p in _expert_params(model) if id(p) in experts]
    # this rank's experts (and their adapters)
    ex_n, ex_frozen = (sum(share(p) for p in ex if p.requires_grad == t) for t in (True, False))
    ex_adapters = sum(share(p) for p in ex if id(p) in adapter_ids)
    all_adapters = sum(p.numel() for p in ex if id(p) in adapter_ids)
    fixed["weights"] += ex_n * mb + ex_frozen * cb
    fixed["grads"] += ex_n * mb
    fixed["optimizer"] += 0 if offload else optimizer_states * ex_n * mb
    n_dense = n  # the trained parameters outside the experts (FSDP-sharded)
    if ep > 1:  # the split of ``weights`` (LoRA lines) and the counts below include the experts
        split["frozen_params"] += count(ex, False)
        split["frozen_weight_bytes"] += ex_frozen * cb
        split["adapter_params"] += all_adapters
        split["adapter_weight_bytes"] += ex_adapters * mb
        split["saved_params"] += count(ex, True) - all_adapters
        split["saved_weight_bytes"] += (ex_n - ex_adapters) * mb
        n, frozen = n + count(ex, True), frozen + count(ex, False)
    split.update(expert_params_per_device=ex_n + ex_frozen)
    # host: the moments in the master dtype; "masters": float32 masters and moments (HostAdamW(master_on_host=True))
    host_per = {"none": 0, "moments": optimizer_states * mb, "masters": (optimizer_states + 1) * 4}[optimizer_offload]
    optimizer_host = host_per * n_dense // shard + host_per * ex_n
    if fsdp:
        fixed["gathered"] = _gathered_bytes(model.spec.tie_word_embeddings, layer_all, layer_n, ends_all, ends_n,
                                            cb, 4 if compute in (torch.bfloat16, torch.float16) else cb,
                                            block_all, block_n)
    elif master != compute:  # one process with master weights: autocast's compute-dtype copies of one layer
        fixed["gathered"] = layer_n * cb
    m, c = str(master).removeprefix("torch."), str(compute).removeprefix("torch.")
    held = "float32 masters on the host" if optimizer_offload == "masters" else "master"
    where = (f"sharded over {shard} GPUs (FSDP2" + (f", HSDP x{replicate})" if replicate > 1 else ")")
             if fsdp else "whole on every GPU") + (f"; routed experts split over ep={ep}" if ep > 1 else "")
    of = f"of the {n:,} trained parameters only, " if frozen else ""
    assumptions = {
        "parameters": (f"{n:,} in {m} ({held}) " + where if not frozen else
                       f"{frozen:,} frozen in {c} (weights only) + {n:,} trained in {m} ({held}), {where}"),
        "compute_dtype": c,
        "gradients": f"{m}, {of}" + (f"reduce-scattered over {shard} GPUs" if fsdp else "whole"),
        "optimizer": (f"AdamW, {optimizer_states} moments and float32 master weights, {of}in host memory"
                      if optimizer_offload == "masters" else
                      f"AdamW, {optimizer_states} moments in {m}, {of}"
                      + ("in host memory" if offload else f"sharded over {shard} GPUs" if fsdp else "whole")),
        "prompt_state": f"split by position over cp={cp} ranks" if cp > 1 else "whole on each data-parallel replica",
        "data_parallel_replicas": gpus // cp,
    }
    if ep > 1:
        held = (f"FSDP-sharded over the {edp} ranks holding the same experts (gathered with their layer)"
                if edp > 1 else "each held by one rank" if gpus == ep else
                f"replicated over the {gpus // ep} ranks holding the same experts (ep_shard=False)")
        assumptions["experts"] = (f"routed experts split over ep={ep} ranks ({count(ex, True) + count(ex, False):,} "
                                  f"parameters, {ex_n + ex_frozen:,} per device), {held}; their LoRA adapters "
                                  "split over ep only; token exchanges with balanced routing")
    return fixed, assumptions, split, optimizer_host


def _gathered_bytes(tied: bool, layer_all: int, layer_n: int, ends_all: int, ends_n: int, cb: int, rb: int,
                    block_all: int = 0, block_n: int = 0) -> int:
    """FSDP2's bytes per device above what the dry run (one process, whole parameters) holds at its peak: the
    largest of the moments below (module docstring, ``gathered``). ``layer_all`` / ``layer_n``: the largest decoder
    layer's parameters / trained parameters, ``ends_all`` / ``ends_n``: the larger end unit's (the embedding, the
    LM head, or with tied embeddings the one unit of both); ``cb``: compute dtype bytes, ``rb``: the reduce dtype's
    (float32 for bf16/fp16 compute, as ``distributed.fsdp`` sets it, else the compute dtype).

    What the dry run already holds is not counted again: every gradient autograd produces, when it produces it (the
    LM head's float32 ``dw`` beside its logits chunks, the embedding's dense gradient, and with tied embeddings the
    head's gradient kept in autograd's input buffer from the head's backward until the embedding's arrives and their
    sum: three vocab x hidden buffers). FSDP2 adds: the gathered parameters of the running unit and the prefetched one
    (tied: the end unit stays gathered while the layers run forward); a layer's unsharded gradients, held together
    until its post-backward (the dry run adds each into ``.grad`` as it comes); and each unit's reduce-scatter input in
    the reduce dtype, which lives from its post-backward (the unit's parameters are resharded before it is filled)
    until the next unit's. A unit's gradient and its gathered parameters thus never both add to the dry run's peak:
    the earlier formula added both (and a tied unit's gradient twice), 1.18-1.34x the measured per-rank peaks at a
    32K vocabulary (tests/planner/test_planner.py::test_vocab_32k_per_rank_plan_within_fifteen_percent).

    ``block_all`` / ``block_n``: under expert parallelism with FSDP over edp, a layer's experts unit (its EP block),
    gathered while its layer's unit is: beside the running layer in the forward, and in the backward beside two
    layers' units (its own and the prefetched one) with its unsharded gradient. (Counting it as part of the layer,
    prefetched twice, planned 1.15x the measured peak of a full fine-tune on 4 gloo ranks with ep = 2.)"""
    rs_prev = max(layer_n, block_n, ends_n) * rb  # the previous unit's reduce-scatter input, in flight
    backward = 2 * layer_all * cb + layer_n * cb + (layer_n * rb if tied else rs_prev)  # a layer's backward
    if block_all:  # the experts unit's backward
        backward = max(backward, (2 * layer_all + block_all + block_n) * cb + rs_prev)
    embedding = ends_all * cb + layer_n * rb  # the embedding's backward, layer 0's reduce-scatter input in flight
    post = max(layer_n * (cb + rb), block_n * (cb + rb), ends_n * rb)  # a post-backward: the reduce-scatter input
    # (and a unit's grads)
    running = (2 * layer_all + ends_all) * cb if tied else (layer_all + max(layer_all, ends_all)) * cb
    return max(running + block_all * cb, backward, embedding, post)


def _all_to_all_bytes(model, compute: torch.dtype, cfg, response_len: int) -> int:
    """The expert-parallel exchanges' buffers at their largest (module docstring), with balanced routing."""
    # MoE blocks: a router (``gate``; GPT-OSS's ``router``) with ``top_k`` and routed experts of width ``hidden``
    blocks = [(m.gate if hasattr(m, "gate") else m.router).top_k * m.experts.hidden for m in model.modules()
              if hasattr(getattr(m, "experts", None), "ep_tensor_names")]
    if not blocks:
        return 0
    slot = max(blocks) * _dtype_bytes(compute)
    branch = cfg.branch_batch * response_len
    graph_tokens = max(branch, cfg.prefill_chunk if cfg.exact else 0)
    kept = 1 if cfg.checkpoint_layers else len(blocks)  # checkpointed layers: one layer's graph at a time
    return max(4 * cfg.prefill_chunk * slot, 2 * graph_tokens * slot * kept)


def plan(hf_config: dict, *, prompt_len: int, response_len: int, group: int, cfg=None,
         dtype: str | torch.dtype = "bfloat16", gpus: int = 1, cp: int = 1, gpu_mem: float | None = None,
         optimizer_states: int = 2, fsdp: bool | None = None, replicate: int = 1, master_dtype: str = "auto",
         optimizer_offload: bool | str = False, lora=None, reserve: int = 0, ep: int = 1, ep_shard: bool = True,
         max_positions: int | None = None, graph_budget: int | str | None = None) -> Plan:
    """Peak memory per device of one GRPO step of ``cfg`` (a ``GRPOConfig``; default: its defaults) on a model of
    ``hf_config``, computing in ``dtype`` (see module docstring). ``gpu_mem`` in bytes gives the verdict
    (``Plan.fits``) and ``max_prompt_len``. ``fsdp`` (default: ``gpus > 1``), ``replicate``: FSDP2 over the GPUs as
    ``init_distributed`` sets it up; ``master_dtype``: ``"auto"`` (float32 master weights, gradients and moments for
    a bf16/fp16 model, as FSDP runs it and as the trainer does), or ``"float32"``, ``"bfloat16"``, ...;
    ``optimizer_offload``: AdamW's state in host memory: ``True`` / ``"moments"`` (the moments), ``"masters"`` (the
    float32 master weights too: the device's weights and gradients in the compute dtype), ``False`` / ``"none"``.
    ``lora``: plan a LoRA run (a
    ``models.lora.LoraSettings``, or a dict of ``add_lora``'s arguments: ``rank``, ``alpha``, ``target_modules``,
    ``dropout``, ``modules_to_save``, ...): the adapters are added to the meta model as a run adds them, the frozen
    base counts as weights only (compute dtype), the adapters and ``modules_to_save`` as trained parameters (master
    dtype, gradients, moments), and the dry run goes through the adapters (module docstring);
    ``Plan.settings["lora"]`` says what was adapted and splits ``weights``. ValueError for a prompt + response
    longer than the model takes, or a LoRA setting the model refuses (a target that matches none of its linear
    layers, with the names it has). ``reserve``: bytes of ``gpu_mem`` the run's tensors cannot use
    (:func:`device_reserve`; the verdict compares the peak with ``gpu_mem - reserve``). ``ep``: expert parallelism over
    ``ep`` ranks (needs FSDP over ``gpus > 1`` (HSDP too), and ``ep`` dividing ``gpus`` and every MoE layer's experts;
    module docstring); ``ep_shard=False``: each EP block replicated over the ``gpus / ep`` ranks holding it instead of
    FSDP-sharded there (``init_distributed(ep_shard=)``). ``max_positions``: the positions the run extends the model to
    (RoPE scaling such as YaRN), instead of the config's ``max_position_embeddings``. ``graph_budget``: exact mode's
    bytes for kept prompt-step graphs (default ``cfg.graph_budget_bytes``), or ``"auto"``: what ``gpu_mem`` less the
    reserve leaves after the peak without them (0 without ``gpu_mem``); ``Plan.settings["graph_budget"]`` then has the
    budget, the bytes and tokens kept and the predicted saving (:func:`kept_graph_plan`)."""
    from longstraw.checkpoint.hf import parse_dtype
    from longstraw.engine.config import GRPOConfig

    cfg = cfg if cfg is not None else GRPOConfig()
    if not isinstance(cfg, GRPOConfig):
        raise ValueError(f"cfg must be a longstraw.GRPOConfig, got {type(cfg).__name__}")
    _check_positive(prompt_len=prompt_len, response_len=response_len, group=group, gpus=gpus, cp=cp)
    if prompt_len < 2:
        raise ValueError(f"prompt_len={prompt_len} must be >= 2")
    if gpus % cp:
        raise ValueError(f"cp={cp} must divide gpus={gpus}: allowed {', '.join(map(str, _divisors(gpus)))}")
    _check_positive(replicate=replicate)
    if (gpus // cp) % replicate:
        raise ValueError(f"replicate={replicate} must divide the {gpus // cp} data-parallel replicas (gpus={gpus} / "
                         f"cp={cp})")
    if gpu_mem is not None and not (isinstance(gpu_mem, (int, float)) and math.isfinite(gpu_mem) and gpu_mem > 0):
        raise ValueError(f"gpu_mem={gpu_mem!r} must be a finite number of bytes > 0")
    _check_positive(ep=ep)
    if ep > 1:
        if fsdp is False or gpus < 2:
            raise ValueError(f"ep={ep} needs FSDP over several GPUs (expert parallelism runs with the rest of the "
                             f"model FSDP-sharded); got gpus={gpus}" + (", fsdp=False" if fsdp is False else ""))
        if gpus % ep:
            allowed = ", ".join(str(d) for d in _divisors(gpus) if d > 1)
            raise ValueError(f"ep={ep} must divide gpus={gpus}: allowed {allowed} (or 1: none)")
    if not (isinstance(reserve, int) and reserve >= 0):
        raise ValueError(f"reserve={reserve!r} must be a number of bytes >= 0")
    if gpu_mem is not None and reserve >= gpu_mem:
        raise ValueError(f"reserve={format_bytes(reserve)} (--reserve; auto: the CUDA context, NCCL and 5% for "
                         f"fragmentation) leaves nothing of gpu_mem={format_bytes(gpu_mem)}: give a larger --gpu-mem "
                         "or --reserve 0")
    if max_positions is not None:
        _check_positive(max_positions=max_positions)
        hf_config = {**hf_config, "max_position_embeddings": max_positions}
        if isinstance(hf_config.get("text_config"), dict):  # a multimodal checkpoint: its text model's positions
            hf_config["text_config"] = {**hf_config["text_config"], "max_position_embeddings": max_positions}
    dt = parse_dtype(dtype)
    lora_settings = None
    if lora is not None:
        from longstraw.checkpoint.adapter import settings_from

        lora_settings = settings_from(lora)
        if lora_settings.lora_dropout > 0 and cfg.exact:  # as grpo_backward refuses it, before any dry run
            raise ValueError(f"LoRA dropout={lora_settings.lora_dropout:g} with prompt_grad='exact': the reverse "
                             "pass recomputes the prompt and would draw other dropout masks; plan LoRA dropout 0 "
                             "or prompt_grad='detached'")
    model = _meta_model(hf_config, dt)
    pbytes = _param_bytes(model)  # the model's own parameters, without adapters, in the compute dtype
    layer = _layer_bytes(model)
    adapted: list[str] = []
    if lora_settings is not None:
        from longstraw.models.lora import add_adapters

        adapted = add_adapters(model, lora_settings)  # on meta: the run's targets, shapes and frozen parameters
    from longstraw.models.deltanet import DeltaRuleMixer

    deltanet = any(isinstance(layer.mixer, DeltaRuleMixer) for layer in model.layers)
    if cp > 1:  # the DeltaNet and MLA layers' prompt steps as a CP rank runs them
        model.placement = _CPRehearsal(cp)
    if gpus > 1 and fsdp is not False:  # as apply_fsdp: the first layer's input needs a gradient (a frozen model's
        from longstraw.distributed.fsdp import input_needs_grad  # layers all compute their input gradients)

        model.layers[0].register_forward_pre_hook(input_needs_grad)
    model.spec.check_length(prompt_len + response_len, f"a prompt of {prompt_len} tokens and a response of "
                                                        f"{response_len}")
    longest = model.spec.max_position_embeddings - response_len
    if ep > 1:
        counts = sorted({m.num_experts for m in model.modules() if hasattr(m, "ep_tensor_names")})
        if not counts:
            raise ValueError(f"ep={ep}: the model ({hf_config.get('model_type')}) has no routed experts; plan ep=1")
        if any(c % ep for c in counts):
            ok = [d for d in _divisors(gpus) if all(c % d == 0 for c in counts)]
            raise ValueError(f"ep={ep} does not divide the {'/'.join(map(str, counts))} routed experts of a layer; "
                             f"allowed with gpus={gpus}: {', '.join(map(str, ok))}")
    fixed, assumptions, split, optimizer_host = _fixed_bytes(
        model, dt, gpus=gpus, cp=cp, fsdp=fsdp, replicate=replicate, master_dtype=master_dtype,
        optimizer_states=optimizer_states, optimizer_offload=_offload_mode(optimizer_offload), ep=ep,
        ep_shard=ep_shard)
    if ep > 1:
        fixed["all_to_all"] = _all_to_all_bytes(model, dt, cfg, response_len)

    cache: dict[int, dict[str, int]] = {}
    samples = layer_samples(model) if SAMPLE_LAYERS else None
    kinds: dict[str, int] = {}
    for layer in model.layers:
        k = f"{type(layer.mixer).__name__} + {type(layer.ffn).__name__}"
        kinds[k] = kinds.get(k, 0) + 1
    assumptions["layers"] = ", ".join(f"{n} x {k}" for k, n in kinds.items())
    assumptions["dry_run"] = (f"{sum(len(x) for x in samples[0])} layer runs ({len(samples[0])} dry runs of "
                              f"{'/'.join(str(len(x)) for x in samples[0])} layers) combined for "
                              f"{len(model.layers)} layers" if samples else f"all {len(model.layers)} layers")
    if deltanet:
        assumptions["delta_rule_kernel"] = (
            "torch (the chunked torch path, what a CPU run or a run without fla uses: a call that records a graph "
            "keeps its inputs and one state per block, and its backward recomputes one block's graph at a time); a "
            "CUDA bf16/fp16 run with fla installed runs fla's Triton kernel instead, whose saved tensors and "
            "backward transients differ (not modelled; except where fla's backward refuses the GPU, Hopper with "
            "Triton 3.4-3.7.0 and no tilelang: passes that need a gradient run the torch rule)")
        if cp > 1:
            assumptions["deltanet_cp"] = (
                f"state scan over cp={cp} ranks (distributed/cp_recurrent.py): each prompt step's DeltaNet layers run "
                f"as the group's last rank does, rehearsed in the dry run: the rule on Dv + Dk value columns, the "
                f"{cp} ranks' gathered transfers and their fold")
    assumptions["checkpoint_layers"] = bool(cfg.checkpoint_layers)

    mla_step = _mla_cp_step(model, dt, cfg, cp, prompt_len, assumptions)

    def at(p: int, state_only: bool = False) -> dict[str, int]:
        if (p, state_only) not in cache:
            with meta_ops.expert_split(ep):
                d = sampled_dry_run(model, p, response_len, group, cfg, samples, state_only)
            for k in ("prompt_state", "prompt_state_grad", "grad_at_replay", "grad_host", "state_host",
                      "state_host_fwd"):
                if k in d:
                    d[k] //= cp
            if cp > 1:  # sliding layers keep replicated tails under CP, not a 1/cp share (distributed/cp_window.py)
                state, grad = _sliding_cp_bytes(model, p, cfg, cp, dt)
                d["prompt_state"] += state
                if cfg.offload_state:  # the tails move to host memory with the rest of the K/V
                    d["state_host"] += state
                for k in ("prompt_state_grad", "grad_at_replay") + (("grad_host",) if cfg.offload_state_grad else ()):
                    if k in d:  # their sinks (exact mode), where the state's gradient lives
                        d[k] += grad
            if "prefill_chunk" in d:  # the CP step's MLA term at this length (the search plans shorter prompts)
                d["prefill_chunk"] += mla_step if p == prompt_len else _mla_cp_step(model, dt, cfg, cp, p, {})
            cache[p, state_only] = {**fixed, **d}
        return cache[p, state_only]

    def phase_peaks(b: dict[str, int]) -> dict[str, int]:
        """The backward phases' peak (replay, reverse pass: the state's device share there) and the forward
        phases' (prefill, rollout: the state less what the prefill moved already, the DeltaNet boundaries under
        offload_state, beside the larger of one no-grad prefill chunk and the rollout's decode buffers and step)."""
        common = b["weights"] + b["grads"] + b["optimizer"] + b["gathered"] + b.get("all_to_all", 0)
        return {"backward": common + b["prompt_state"] + b["prompt_state_grad"] + b.get("kept_graphs", 0)
                + max(b["prefill_chunk"], b["branch_graph"] + b["logits"]),
                "forward": (common + b["prompt_state"] + b["state_host"] - b["state_host_fwd"]
                            + max(b["forward_chunk"], b["decode"]))}

    def peak_of(b: dict[str, int]) -> int:
        return max(phase_peaks(b).values())

    requested = graph_budget if graph_budget is not None else cfg.graph_budget_bytes
    if requested is not None and requested != "auto" and not (isinstance(requested, int) and requested >= 0):
        raise ValueError(f"graph_budget={requested!r} must be a number of bytes >= 0 or 'auto'")
    fixed_budget = int(requested) if cfg.exact and requested not in (None, "auto") else 0
    if cfg.offload_state and requested not in (None, 0):
        raise ValueError(f"graph_budget={requested!r} with offload_state: the kept prompt-step graphs hold the "
                         "state's K/V on the device; plan one of the two")

    # Beyond T positions (two prefill chunks and one attention block) the transients no longer grow and the state
    # grows linearly (K/V per position, recurrent states per chunk), so a dry run at 2T and the state at T give
    # every longer prompt; shorter ones are dry-run directly. (Dry runs at a million positions would spend minutes
    # in the per-chunk loops of recurrent layers.) The state's gradient: its buffers (allocated before the replay)
    # grow on the line; what the replay and the reverse pass add on top (a recurrent layer's one or two gradient
    # leaves) does not grow with the prompt.
    chunk = cfg.prefill_chunk
    t = -(-max(2 * chunk, _ATTN_BLOCK + chunk) // chunk) * chunk

    def line(p: int) -> dict[str, int]:
        b1, b2 = at(t, state_only=True), at(2 * t)
        out = dict(b2)
        out["prompt_state"] = int(b1["prompt_state"] + (b2["prompt_state"] - b1["prompt_state"]) * (p - t) / t)
        g1, g2 = b1["grad_at_replay"], b2["grad_at_replay"]
        out["prompt_state_grad"] = int(g1 + (g2 - g1) * (p - t) / t) + b2["prompt_state_grad"] - g2
        h1, h2 = b1["grad_host"], b2["grad_host"]  # the offloaded buffers: a part of the line's (allocated first)
        out["grad_host"] = int(h1 + (h2 - h1) * (p - t) / t)
        for k in ("state_host", "state_host_fwd"):  # the moved K/V and boundaries: parts of the state, linear alike
            s1, s2 = b1[k], b2[k]
            out[k] = int(s1 + (s2 - s1) * (p - t) / t)
        return device_share(out)

    def device_share(b: dict[str, int]) -> dict[str, int]:
        """``b`` with ``prompt_state_grad`` and ``prompt_state`` the device's shares in the backward phases
        (offload_state_grad, offload_state: the rest in host memory)."""
        return {**b, "prompt_state_grad": b["prompt_state_grad"] - b["grad_host"],
                "prompt_state": b["prompt_state"] - b["state_host"]}

    def own(p: int) -> int:
        """The prompt length whose steps are one rank's: under CP a rank keeps its pieces' graphs (``1 / cp`` of
        the positions, in pieces of ``chunk``)."""
        return p if cp == 1 else -(-(p - 1) // cp) + 1

    def linear(p: int) -> dict[str, int]:
        out = device_share(at(p)) if p <= 2 * t else line(p)
        out["kept_graphs"] = min(fixed_budget, kept_graph_plan(model, own(p), chunk, out["prefill_chunk"],
                                                               fixed_budget)["kept_bytes"]) if fixed_budget else 0
        return out

    at_len = linear(prompt_len)
    breakdown = {k: v for k, v in at_len.items() if k not in _PRIVATE}
    peaks = phase_peaks(at_len)
    peak = max(peaks.values())
    if cfg.exact and requested == "auto":
        usable_ = None if gpu_mem is None else int(gpu_mem) - reserve
        left = max(0, usable_ - peak) if usable_ is not None else 0
        gp = kept_graph_plan(model, own(prompt_len), chunk, breakdown["prefill_chunk"], left)
        breakdown["kept_graphs"] = gp["kept_bytes"]
        peak += gp["kept_bytes"]
    elif fixed_budget:
        gp = kept_graph_plan(model, own(prompt_len), chunk, breakdown["prefill_chunk"], fixed_budget)
    else:
        gp = None
    max_len = None
    usable = None if gpu_mem is None else int(gpu_mem) - reserve
    if usable is not None:
        max_len = _solve_max_len(lambda x: peak_of(linear(x)), usable, t, longest, known=(prompt_len, peak),
                                 line_at=lambda x: [v + fixed_budget for v in phase_peaks(line(x)).values()])
        # (with the whole budget: an upper bound)
    settings = dict(prompt_len=prompt_len, response_len=response_len, group=group, prompt_grad=cfg.prompt_grad.value,
                    dtype=str(dt).removeprefix("torch."), gpus=gpus, cp=cp, gpu_mem=gpu_mem,
                    prefill_chunk=cfg.prefill_chunk, branch_batch=cfg.branch_batch,
                    checkpoint_layers=cfg.checkpoint_layers, param_bytes=pbytes, layer_bytes=layer, ep=ep,
                    ep_shard=ep_shard, assumptions=assumptions)
    if at_len["state_host"] or peaks["forward"] > peaks["backward"]:  # shown where the forward phases matter
        settings["phase_peaks"] = peaks
        # the forward phases' two transients (a step measured without a rollout compares with the prefill's)
        settings["forward_terms"] = {"prefill_chunk": at_len["forward_chunk"], "rollout": at_len["decode"]}
    if at_len["state_host"]:
        early = at_len["state_host_fwd"]
        assumptions["prompt_state"] = (
            f"{format_bytes(at_len['state_host'])} of the state (its attention K/V"
            + (", the DeltaNet layers' chunk-boundary states" if early else "") + ") in host memory during the "
            f"replay and the reverse pass (offload_state), {format_bytes(breakdown['prompt_state'])} on the device; "
            "the forward phases (prefill, rollouts) hold the rest there"
            + (f" (the boundary states, {format_bytes(early)}, leave as the prefill supersedes them)" if early else "")
            + f", beside the larger of one no-grad prefill chunk ({format_bytes(at_len['forward_chunk'])}) and the "
            f"rollout ({format_bytes(at_len['decode'])}: decode buffers and one step): their peak "
            f"{format_bytes(peaks['forward'])}, the backward phases' {format_bytes(peaks['backward'])}")
    elif cfg.offload_state:
        assumptions["prompt_state"] = ("offload_state moves nothing of this model's state (attention K/V and "
                                       "DeltaNet chunk-boundary states move; MLA latents stay on the device)")
    host = _host_plan(at_len["grad_host"], optimizer_host, cfg, prompt_len, group, cp, at_len["state_host"],
                      at_len["state_host_fwd"])
    if host is not None:
        settings["host"] = host
        if host["prompt_state_grad_bytes"]:
            on_device = breakdown["prompt_state_grad"]
            assumptions["prompt_state_grad"] = (
                f"float32, {format_bytes(host['prompt_state_grad_bytes'])} of it in host memory (offload_state_grad:"
                " the attention K/V and MLA latent buffers" + (f"; {format_bytes(on_device)} of recurrent-state "
                                                                "gradients stay on the device)" if on_device else ")"))
    if lora_settings is not None:
        t = lora_settings.target_modules
        settings["lora"] = {"rank": lora_settings.r, "alpha": lora_settings.lora_alpha,
                            "target_modules": t if isinstance(t, str) else list(t),
                            "modules_to_save": list(lora_settings.modules_to_save),
                            "target_parameters": list(lora_settings.target_parameters), "adapted_modules": len(adapted),
                            **split}
    if gpu_mem is not None:
        settings["memory"] = {"gpu_mem_bytes": int(gpu_mem), "reserve_bytes": reserve, "usable_bytes": usable}
    if gp is not None:
        settings["graph_budget"] = gp
    return Plan(int(peak), breakdown, max_len, settings, usable)


OPTIMIZER_OFFLOADS = ("none", "moments", "masters")


def _offload_mode(value) -> str:
    """``plan(optimizer_offload=)`` as one of :data:`OPTIMIZER_OFFLOADS` (True: "moments", False: "none")."""
    value = getattr(value, "value", value)  # the run config's OptimOffload enum
    if isinstance(value, bool):
        return "moments" if value else "none"
    if value not in OPTIMIZER_OFFLOADS:
        raise ValueError(f"optimizer_offload={value!r} is not supported; allowed: True, False, "
                         + ", ".join(map(repr, OPTIMIZER_OFFLOADS)))
    return value


def _host_plan(grad_host: int, optimizer_host: int, cfg, prompt_len: int, group: int, cp: int,
               state_host: int = 0, state_host_fwd: int = 0) -> dict | None:
    """Host memory per device (per GPU process) of the offloaded state gradient, state K/V and optimiser moments,
    and the state's and its gradient's device <-> host traffic per GRPO step (None: nothing offloaded).

    Gradient: every branch batch's backward adds the whole gradient in host memory (device -> host); each
    reverse-pass step adds the gradient of the prefix before it (on average half the state: ``(steps - 1) / 2``
    gradients over the walk) and reads its own slice back (host -> device: one gradient over the walk). DSA layers
    on their sparse path add the selected rows only: there it is an upper bound.

    State (offload_state): everything moved goes to host memory once (device -> host), ``state_host_fwd`` of it
    during the prefill (the DeltaNet layers' chunk boundaries, each read back once by the reverse pass); every
    attention call reads its prefix of the K/V from host memory, block by block: a branch batch reads the whole K/V
    in its forward and again in its backward (and once more where ``checkpoint_layers`` recomputes the layers);
    each reverse-pass step reads the prefix before it in its recomputed forward and in its backward (once more
    with ``checkpoint_layers``, which runs the step's layers without a graph first)."""
    if not grad_host and not optimizer_host and not state_host:
        return None
    steps = -(-(prompt_len - 1) // (cp * cfg.prefill_chunk))
    batches = -(-group // cfg.branch_batch)
    replay = batches * grad_host
    reverse_d2h = grad_host * max(0, steps - 1) // 2
    reads = 3 if cfg.checkpoint_layers else 2
    out = {"prompt_state_grad_bytes": int(grad_host), "optimizer_bytes": int(optimizer_host),
           "prompt_state_bytes": int(state_host), "prompt_state_prefill_bytes": int(state_host_fwd),
           "total_bytes": int(grad_host + optimizer_host + state_host),
           "state_grad_traffic_bytes": {"replay_device_to_host": int(replay),
                                        "reverse_device_to_host": int(reverse_d2h),
                                        "reverse_host_to_device": int(grad_host)}}
    kv = state_host - state_host_fwd
    out["state_traffic_bytes"] = {"device_to_host": int(state_host),
                                  "replay_host_to_device": int(batches * reads * kv),
                                  "reverse_host_to_device": int(reads * kv * max(0, steps - 1) // 2 + state_host_fwd)
                                  if cfg.exact else 0}
    return out


def _cp_piece(prompt_len: int, cp: int, chunk: int) -> int:
    """The longest piece a rank processes in one CP prefill step of a ``prompt_len``-token prompt: the run's layout
    (``distributed.cp_state.shard_layout``: balanced steps of about ``cp x chunk`` positions, each cut into ``cp``
    pieces), so ``chunk`` for a long prompt and ``ceil((prompt_len - 1) / cp)`` for one shorter than a step."""
    from longstraw.distributed.cp_state import shard_layout

    layout = shard_layout(max(prompt_len - 1, cp), cp, chunk)
    return max(e - s for step in layout.steps for s, e in step)


def _sliding_cp_bytes(model, prompt_len: int, cfg, cp: int, dtype: torch.dtype) -> tuple[int, int]:
    """What the sliding-window layers' state (and its gradient, exact mode) holds per rank under ``cp > 1`` beyond
    the ``1 / cp`` of one process's that the dry run's share gives: every rank keeps the same tails, one per layout
    step of ``cp x chunk`` positions (``state.sliding_kept`` over the layout's steps, against one process's over
    its chunks). Exact mode with ``chunk >= W - 1``: 0 (``K / cp`` steps of ``W - 1``); detached: about ``W - 1``
    positions less a ``1 / cp`` share of them."""
    from longstraw.distributed.cp_state import shard_layout
    from longstraw.state import chunk_bounds, grad_dtype_for, sliding_kept

    n = prompt_len - 1
    windows = [(m.window, m.num_kv_heads * m.head_dim * 2) for m in (layer.mixer for layer in model.layers)
               if getattr(m, "window", None) is not None and hasattr(m, "num_kv_heads")]
    if not windows or n < cp:
        return 0, 0
    steps = shard_layout(n, cp, cfg.prefill_chunk).step_bounds()
    single = chunk_bounds(n, cfg.prefill_chunk)
    extra = sum(width * (sliding_kept(steps, w, cfg.exact) - sliding_kept(single, w, cfg.exact) / cp)
                for w, width in windows)
    return int(extra * dtype.itemsize), int(extra * grad_dtype_for(dtype).itemsize) if cfg.exact else 0


def _mla_cp_step(model, dtype: torch.dtype, cfg, cp: int, prompt_len: int, assumptions: dict) -> int:
    """Bytes a CP step's MLA attention adds per rank beyond what the dry run counts: 0 for plain MLA layers, whose
    CP step the dry run runs as a rank does (:class:`_CPRehearsal`); for DSA layers on their dense path (steps that
    see at most ``index_topk`` keys) the shipped queries and partials of one layer by formula
    (``distributed.cp_latent.mla_step_bytes``), and where their steps see more, their sparse path's
    (``dsa_step_bytes``: one layer's peak, plus what the other layers' graphs keep in an exact step without layer
    checkpointing). Writes the form and the per-block transient into ``assumptions["mla_attention"]``; 0 without
    MLA layers."""
    from longstraw.models.mla import MLAttention

    mixers = [m.mixer for m in model.layers if isinstance(m.mixer, MLAttention)]
    if not mixers:
        return 0
    layer, chunk = mixers[0], cfg.prefill_chunk
    dense = [m for m in mixers if getattr(m, "index_topk", None) is None or prompt_len <= m.index_topk]
    if cp > 1:  # a rank's piece of a step: the chunk, or less where the prompt is shorter than cp x chunk
        chunk = _cp_piece(prompt_len, cp, chunk)
    if cp == 1:
        f = layer.attention_flops(1, chunk, [(1, prompt_len)])
        form = layer._pick(f, cfg.exact)
        kv = layer.chunk_positions() * layer.num_heads * (layer.dn + layer.dr + layer.dv) * dtype.itemsize
        assumptions["mla_attention"] = f"{form} form for prefill chunks (FLOP rule)" + (
            f"; {layer.chunk_positions():,} stored positions expanded per chunk ({format_bytes(kv)} of K/V; in the "
            "dry run)" if form == "decompressed" else "")
        return 0
    from longstraw.distributed.cp_latent import dsa_step_bytes, mla_step_bytes

    if not dense:  # every DSA layer (full and shared) on its sparse path
        per = [dsa_step_bytes(m, cp, chunk, dtype, cfg.exact, prompt_len) for m in mixers]
        peak = max(p for p, _ in per)
        kept = 0 if cfg.checkpoint_layers else sum(sv for _, sv in per) - max(sv for _, sv in per)
        assumptions["mla_attention"] = (
            f"cp={cp}: DSA layers run the sparse path at this length (absorbed latents); per rank a step of "
            f"{cp} x {chunk:,} tokens (a rank's piece) adds {format_bytes(peak)} in one layer (the sparse attention exchanged one "
            f"piece at a time, the indexer's top-k merged around the ring)"
            + (f", and the other layers' graphs keep {format_bytes(kept)}" if kept else "")
            + " (by formula, in prefill_chunk)")
        return peak + kept
    form, step, block = mla_step_bytes(layer, cp, chunk, prompt_len, dtype, cfg.exact)
    rehearsed = all(_rehearses(m) for m in dense)  # DSA layers on their dense path are not: the formula
    assumptions["mla_attention"] = (
        f"cp={cp}: {form} form for a step of {cp} x {chunk:,} tokens (FLOP rule); per rank and MLA layer the "
        + ("step's exchange (the shipped queries and partials, one piece at a time) rehearsed in the dry run"
           if rehearsed else f"shipped queries and partials add {format_bytes(step)} (by formula, in prefill_chunk)")
        + (f"; per block {format_bytes(block)} ({layer.chunk_positions():,} stored positions expanded per chunk, "
           f"one piece's queries per call)" if form == "decompressed" else ""))
    return 0 if rehearsed else step


def _forward_flops(model, start: int, end: int, chunk: int | None = None) -> float | None:
    """Forward FLOPs of prompt positions ``[start, end)`` (attention at their mean context), from the modules'
    ``flops_per_token``; None when a module does not give its own. MLA layers count the form their FLOP rule picks
    for prefill chunks of ``chunk`` tokens (``MLAttention.flops_per_token``), as the run does."""
    from longstraw.models.mla import MLAttention

    ctx = (start + end) / 2
    total = 0.0
    for layer in model.layers:
        mixer, ffn = layer.mixer, layer.ffn
        if not hasattr(mixer, "flops_per_token") or not hasattr(ffn, "flops_per_token"):
            return None
        f = mixer.flops_per_token(int(ctx), chunk) if isinstance(mixer, MLAttention) else mixer.flops_per_token(
            int(ctx))
        total += f + ffn.flops_per_token()
    return total * (end - start)


def kept_graph_plan(model, prompt_len: int, chunk: int, step_graph: int, budget: int) -> dict:
    """What a graph budget buys at ``prompt_len``: the prefill keeps the latest steps' graphs, ``step_graph`` bytes
    per step of ``chunk`` tokens (priced per token, as the engine does), while they fit in ``budget``.

    Returns ``budget``, ``kept_bytes``, ``kept_tokens`` (prompt positions whose step is not recomputed),
    ``steps`` (prefill steps), ``recompute_saved`` (the share of the reverse pass's recomputation not done: forward
    FLOPs of the kept positions over all, attention at each position's context; the token share where a module
    gives no FLOPs) and ``step_time_saved``: the predicted share of the exact step's prompt time saved, counting
    the prefill as one forward and the reverse pass as three (recomputation one, backward two), so
    ``recompute_saved / 4`` of the prompt's time: the replay's time is not in it."""
    n = max(0, prompt_len - 1)
    steps = -(-n // chunk) if n else 0
    per_token = step_graph / chunk if chunk else 0.0
    kept_tokens = n if per_token <= 0 else min(n, int(budget // per_token))
    kept_bytes = math.ceil(kept_tokens * per_token)
    f_all = _forward_flops(model, 0, n, chunk) if n else None
    f_kept = _forward_flops(model, n - kept_tokens, n, chunk) if kept_tokens else 0.0
    share = (f_kept / f_all if f_all and f_kept is not None else kept_tokens / n if n else 0.0)
    return {"budget": int(budget), "kept_bytes": int(kept_bytes), "kept_tokens": int(kept_tokens), "steps": steps,
            "recompute_saved": round(share, 4), "step_time_saved": round(share / 4, 4)}


def _solve_max_len(peak_at, limit: float, t: int, longest: int, known: tuple[int, int] | None = None,
                   line_at=None) -> int:
    """Largest prompt length ``<= longest`` (the model's positions) whose peak fits ``limit``: exact on the line
    beyond ``2t`` (see ``plan``; ``line_at``: the line's peak, default ``peak_at``, or a list of peaks, one per
    phase, each linear in the length there, whose largest is the peak: each phase crosses the limit on its own
    line), below it by a safeguarded
    interpolation search over dry runs to 1% (the answer fits, 1% more does not or is ``longest``); 0 if none
    fits. ``known = (p, peak(p))``, the plan's own length: when it is already over the limit, the answer lies below
    it and no dry run longer than ``p`` is needed."""
    line_at = line_at or peak_at
    if known is not None and known[1] > limit:
        longest = min(longest, known[0])
    if longest <= 2 * t:
        if peak_at(longest) <= limit:
            return longest
        lo, hi = 2, longest
    else:
        lines = list(zip(*(v if isinstance(v, (list, tuple)) else [v] for v in (line_at(t), line_at(2 * t)))))
        if all(y2 <= limit for _, y2 in lines):
            # a phase whose peak does not grow with the prompt sets no limit; the model's positions may
            return min([longest] + [int(2 * t + (limit - y2) * t / (y2 - y1)) for y1, y2 in lines if y2 > y1])
        lo, hi = 2, 2 * t  # peak(lo) <= limit < peak(hi), or no prompt fits
    if known is not None and known[1] <= limit:
        lo = max(lo, known[0])
    f_lo = peak_at(lo)
    if f_lo > limit:
        return 0
    f_hi = peak_at(hi)  # 2t: the line's own dry run (cached); or ``longest``, just run
    # While the bracket spans more than a factor 2, probe its geometric middle: the peak may step there (GLM-5's
    # jumps by 11 GiB between 842 and 3,944 tokens, where DSA's sparse path begins), and short dry runs are the
    # cheap ones. Within a factor 2 the peak is nearly linear (chunk boundaries aside), so each round interpolates
    # where it crosses the limit (Illinois' regula falsi: an end kept twice in a row has its weight halved, so a
    # curved peak does not pin the search to one side; a probe 1% beside an end once the crossing is that close to
    # it), twice, then, unless that halved the bracket's log-width, probes its geometric middle. A bisection from
    # [2, 2t] to 1% needs ~13 dry runs, many of them long.
    g_lo, g_hi = f_lo - limit, f_hi - limit  # <= 0 < g_hi
    kept = 0  # the end the last probe left in place: -1 lo, +1 hi

    def probe(x: int) -> None:
        nonlocal lo, hi, g_lo, g_hi, kept
        g = peak_at(x) - limit
        if g <= 0:
            lo, g_lo = x, g
            if kept == 1:
                g_hi /= 2
            kept = 1
        else:
            hi, g_hi = x, g
            if kept == -1:
                g_lo /= 2
            kept = -1

    def done() -> bool:
        return hi - lo <= max(1, lo // 100)  # 1% resolution

    while not done():
        if hi > 2 * lo:  # a wide bracket: halve its log-width first (dry runs cost more the longer they are)
            probe(int(math.sqrt(lo * hi)))
            continue
        span = math.log(hi / lo)
        for _ in range(2):
            tol = max(1, lo // 100)
            x = lo + int(-g_lo * (hi - lo) / (g_hi - g_lo))
            x = lo + tol if x - lo <= tol else hi - tol if hi - x <= tol else x
            probe(min(hi - 1, max(lo + 1, x)))
            if done():
                return lo
        if math.log(hi / lo) > span / 2:
            probe(min(hi - 1, max(lo + 1, int(math.sqrt(lo * hi)))))
    return lo


def _check_positive(**kw) -> None:
    for k, v in kw.items():
        if not isinstance(v, int) or v < 1:
            raise ValueError(f"{k}={v!r} must be an integer >= 1")


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="checkpoint directory or config.json (nothing is loaded)")
    p.add_argument("--prompt-len", required=True,
                   help="prompt tokens: 4096, 512K, 1M, 2.1M (K, M = 1024, 1024^2)")
    p.add_argument("--response-len", default="1024", help="response tokens")
    p.add_argument("--group", type=int, default=8, help="G, responses per prompt")
    p.add_argument("--prompt-grad", default="exact", choices=["exact", "detached"],
                   help="gradient through the prompt (exact) or not (detached)")
    p.add_argument("--dtype", default="bfloat16", help="parameter dtype")
    p.add_argument("--gpus", type=int, default=1,
                   help="devices; > 1: parameters, gradients and optimizer state sharded over them")
    p.add_argument("--cp", type=int, default=1,
                   help="context-parallel ranks sharing one prompt state")
    p.add_argument("--gpu-mem", default=None,
                   help="memory per device: a GPU (H20, H100, H200, B200, A100: its usable total) or a size, e.g. "
                        "80G, 141G (binary units, as vendors' GB nearly are): gives the verdict and the longest "
                        "prompt that fits")
    p.add_argument("--reserve", default="auto",
                   help="memory per device the run's tensors cannot use: auto (1 GiB CUDA context and workspaces, "
                        "1 GiB NCCL buffers with --gpus > 1, 5%% of --gpu-mem for fragmentation) or a size (0: none)")
    p.add_argument("--max-positions", default=None, metavar="N",
                   help="positions the run extends the model to (RoPE scaling, e.g. YaRN), instead of the config's "
                        "max_position_embeddings: 4M, 8M")
    p.add_argument("--ep", type=int, default=1, metavar="E",
                   help="expert parallelism: the routed experts split over E ranks (tokens exchanged all-to-all), "
                        "each block FSDP-sharded again over the gpus/E ranks holding it; must divide --gpus and each "
                        "layer's experts")
    p.add_argument("--ep-replicate", action="store_true",
                   help="with --ep: replicate each block of experts over the gpus/E ranks holding it instead of "
                        "sharding it (1/E of the experts per GPU, no gathers; parallel.ep_shard = false)")
    p.add_argument("--prefill-chunk", type=int, default=4096, help="prompt tokens per prefill chunk")
    p.add_argument("--graph-budget", default=None, metavar="SIZE",
                   help="exact mode: memory for prompt-step graphs kept from the prefill (the reverse pass does not "
                        "recompute them): a size (8G), or auto: what --gpu-mem leaves after the peak without them")
    p.add_argument("--branch-batch", type=int, default=1, help="branches replayed together")
    p.add_argument("--checkpoint-layers", action="store_true",
                   help="recompute each layer in backward (smaller branch and reverse-pass graphs)")
    p.add_argument("--replicate", type=int, default=1,
                   help="HSDP: shard over gpus/replicate GPUs, replicate over the groups (multi-node)")
    p.add_argument("--no-fsdp", action="store_true", help="parameters whole on every GPU (no FSDP2 sharding)")
    p.add_argument("--master-dtype", default="auto",
                   help="dtype of the parameters the optimiser updates: auto (float32 for a bf16/fp16 model)")
    p.add_argument("--optimizer-offload", nargs="?", const="moments", default="none", metavar="WHAT",
                   help="AdamW's state in host memory: moments (the default when given), or masters (the float32 "
                        "master weights too; the device keeps the weights and gradients in --dtype), as "
                        "optim.offload")
    p.add_argument("--offload-state-grad", action="store_true",
                   help="exact mode: the prompt state's float32 gradient (attention K/V, MLA latents) in host memory "
                        "(GRPOConfig.offload_state_grad); the plan gives the host bytes and the traffic per step")
    p.add_argument("--offload-state", action="store_true",
                   help="the prompt state's attention K/V in host memory for the replay and the reverse pass, copied "
                        "to the device one block at a time, and exact mode's DeltaNet chunk-boundary states from the "
                        "prefill on (GRPOConfig.offload_state; MLA latents stay); the forward phases still hold the "
                        "K/V; the plan gives both phases' peaks, the host bytes and the traffic per step")
    p.add_argument("--lora-rank", default=None, metavar="R",
                   help="plan a LoRA run: adapters of rank R, the base frozen (weights only, in --dtype)")
    p.add_argument("--lora-alpha", default=None, metavar="A",
                   help="LoRA alpha (default 2 x rank; it does not change memory)")
    p.add_argument("--lora-targets", default=None, metavar="NAMES",
                   help="modules that get adapters: comma-separated names (q_proj,k_proj,v_proj,o_proj,gate_proj,"
                        "up_proj,down_proj, ...), all-linear (the default), or none (with --lora-target-parameters)")
    p.add_argument("--lora-modules-to-save", default=None, metavar="NAMES",
                   help="modules trained whole besides the adapters, comma-separated (e.g. embed_tokens,lm_head)")
    p.add_argument("--lora-target-parameters", default=None, metavar="NAMES",
                   help="routed experts' fused weights that get adapters, comma-separated (PEFT's target_parameters: "
                        "mlp.experts.gate_up_proj,mlp.experts.down_proj); with --lora-targets none for experts only")
    p.add_argument("--lora-dropout", default=None, metavar="P",
                   help="LoRA dropout (default 0; > 0 keeps a dropped copy of each adapted input, detached only)")
    p.add_argument("--json", action="store_true", help="print one JSON object")


def explain(res: Plan) -> dict[str, str]:
    """What each per-device figure of ``res`` is: which total it divides by what."""
    st, a = res.settings, res.settings["assumptions"]
    cp = st["cp"]
    out = {
        "weights": a["parameters"],
        "grads": a["gradients"],
        "optimizer": a["optimizer"],
        "gathered": "FSDP's all-gathered units (the one running and the one prefetched) and one unit's "
                    "gradient before its reduction"
                    if "FSDP" in a["parameters"] else "autocast's compute-dtype copy of one layer"
                    if res.breakdown["gathered"] else "none (no FSDP, no master weights)",
        "prompt_state": (f"the prompt's state / cp={cp}" if cp > 1 else "the prompt's state")
                        + ("; on the device in the replay and the reverse pass (offload_state: the attention K/V and "
                           "DeltaNet boundary states in host memory then)"
                           if st.get("host", {}).get("prompt_state_bytes") else ""),
        "prompt_state_grad": (f"its gradient / cp={cp}" if cp > 1 else "its gradient") + " (exact mode)"
                             + (" on the device; the rest in host memory (offload_state_grad)"
                                if st.get("host", {}).get("prompt_state_grad_bytes") else ""),
        "prefill_chunk": f"one prefill chunk of {st['prefill_chunk']:,} tokens (exact: its recomputed graph)"
                         + (f"; MLA: {a['mla_attention']}" if "mla_attention" in a else ""),
        "branch_graph": f"one batch of {st['branch_batch']} branch(es) of {st['response_len']:,} tokens",
        "logits": "one LM-head chunk of float32 logits",
        "kept_graphs": "prompt-step graphs kept for the reverse pass (graph budget)" if res.breakdown.get(
            "kept_graphs") else "none (no graph budget)",
        "all_to_all": f"expert parallelism's token exchanges (ep={st.get('ep', 1)}, balanced routing)",
    }
    return out


def lora_lines(res: Plan) -> list[tuple[str, int, str]]:
    """A LoRA plan's ``weights``, split: (label, bytes per device, what) for the frozen base, the adapters and the
    ``modules_to_save`` (when any)."""
    lo, a = res.settings["lora"], res.settings["assumptions"]
    master = a["gradients"].split(",")[0]
    out = [("frozen base", lo["frozen_weight_bytes"], f"{lo['frozen_params']:,} parameters in "
            f"{a['compute_dtype']}: weights only (no gradient, master copy or optimizer state)"),
           ("LoRA adapters", lo["adapter_weight_bytes"], f"{lo['adapter_params']:,} parameters (rank {lo['rank']} "
            f"on {lo['adapted_modules']:,} modules"
            + (f" and parameters, the routed experts' {', '.join(lo['target_parameters'])}"
               if lo.get("target_parameters") else "") + f") in {master}, trained: gradients and optimizer below")]
    if lo["modules_to_save"]:
        out.append(("modules_to_save", lo["saved_weight_bytes"], f"{lo['saved_params']:,} parameters "
                    f"({', '.join(lo['modules_to_save'])}) in {master}, trained whole"))
    return out


def verdict(res: Plan) -> str:
    """One line: fits or not, by how much, and the longest prompt that fits."""
    if res.limit_bytes is None:
        return "no --gpu-mem given: no verdict (pass e.g. --gpu-mem 80G)"
    limit, peak = res.limit_bytes, res.peak_bytes
    mem = res.settings.get("memory", {})
    if mem.get("reserve_bytes"):
        usable = (f"{format_bytes(limit)} usable ({format_bytes(mem['gpu_mem_bytes'])} less a "
                  f"{format_bytes(mem['reserve_bytes'])} reserve)")
    else:
        usable = format_bytes(limit)
    longest = (f"; the longest prompt that fits is {format_tokens(res.max_prompt_len)} tokens" if res.max_prompt_len
               else "; no prompt fits with these settings")
    if res.fits:
        return (f"fits: peak {format_bytes(peak)} of {usable} per device, {format_bytes(limit - peak)} "
                f"to spare{longest}")
    return (f"does NOT fit: peak {format_bytes(peak)} > {usable} per device by "
            f"{format_bytes(peak - limit)}{longest}")


def _names(text: str, flag: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise ValueError(f"{flag}={text!r} must be comma-separated module names, like q_proj,v_proj")
    return names


def lora_from_args(args) -> dict | None:
    """The ``lora=`` of ``plan`` from the ``--lora-*`` options (None without ``--lora-rank``); a ValueError naming
    the option for a bad value."""
    given = [f"--lora-{k.replace('_', '-')}" for k in ("alpha", "targets", "modules_to_save", "target_parameters",
                                                        "dropout")
             if getattr(args, f"lora_{k}", None) is not None]
    if args.lora_rank is None:
        if given:
            raise ValueError(f"{given[0]} needs --lora-rank (the adapters' rank, e.g. --lora-rank 16)")
        return None
    try:
        rank = int(args.lora_rank)
    except ValueError:
        rank = 0
    if rank < 1:
        raise ValueError(f"--lora-rank={args.lora_rank!r} must be an integer >= 1")
    out = {"rank": rank}
    for flag, key, ok, what in (("--lora-alpha", "alpha", lambda v: v > 0, "a number > 0"),
                                ("--lora-dropout", "dropout", lambda v: 0 <= v < 1, "a number in [0, 1)")):
        text = getattr(args, "lora_" + key)
        if text is None:
            continue
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{flag}={text!r} must be {what}")
        out[key] = value
    if out.get("dropout", 0) > 0 and args.prompt_grad == "exact":
        raise ValueError(f"--lora-dropout={args.lora_dropout!r} needs --prompt-grad detached (the exact reverse pass "
                         "recomputes the prompt and would draw other dropout masks)")
    out.setdefault("alpha", 2 * rank)
    t = args.lora_targets
    tp = getattr(args, "lora_target_parameters", None)
    if tp is not None:
        out["target_parameters"] = _names(tp, "--lora-target-parameters")
    if t is not None and t.strip() == "none":
        if tp is None:
            raise ValueError("--lora-targets=none needs --lora-target-parameters (adapters on the routed experts "
                             "only); else name modules or all-linear")
        out["target_modules"] = ()
    else:
        out["target_modules"] = ("all-linear" if t is None or t.strip() == "all-linear"
                                 else _names(t, "--lora-targets"))
    if args.lora_modules_to_save is not None:
        out["modules_to_save"] = _names(args.lora_modules_to_save, "--lora-modules-to-save")
    return out


def plan_from_args(args) -> int:
    from longstraw.checkpoint.hf import read_config
    from longstraw.engine.config import GRPOConfig

    lora = lora_from_args(args)
    cfg = read_config(args.model)
    prompt_len = parse_tokens(args.prompt_len, "--prompt-len")
    response_len = parse_tokens(args.response_len, "--response-len")
    if args.optimizer_offload not in OPTIMIZER_OFFLOADS:
        raise ValueError(f"--optimizer-offload={args.optimizer_offload!r} is not supported; allowed: moments, masters "
                         "(none: leave the flag out)")
    if args.offload_state_grad and args.prompt_grad != "exact":
        raise ValueError("--offload-state-grad moves the exact mode's state gradient to host memory: it needs "
                         "--prompt-grad exact")
    gcfg = GRPOConfig(prompt_grad=args.prompt_grad, prefill_chunk=args.prefill_chunk, branch_batch=args.branch_batch,
                      checkpoint_layers=args.checkpoint_layers, offload_state_grad=args.offload_state_grad,
                      offload_state=args.offload_state)
    gpu_mem = parse_gpu_mem(args.gpu_mem, "--gpu-mem") if args.gpu_mem is not None else None
    reserve = 0
    if gpu_mem is not None:
        text = str(args.reserve).strip().lower()
        reserve = (device_reserve(gpu_mem, args.gpus) if text == "auto" else 0 if text in ("0", "none")
                   else parse_bytes(args.reserve, "--reserve"))
    max_positions = (parse_tokens(args.max_positions, "--max-positions") if args.max_positions is not None
                     else None)
    budget = None
    if args.graph_budget is not None:
        text = str(args.graph_budget).strip().lower()
        budget = "auto" if text == "auto" else 0 if text in ("0", "none") else parse_bytes(args.graph_budget,
                                                                                             "--graph-budget")
        if budget and args.prompt_grad != "exact":
            raise ValueError(f"--graph-budget={args.graph_budget} keeps prompt-step graphs for the exact reverse "
                             "pass: it needs --prompt-grad exact")
    res = plan(cfg, prompt_len=prompt_len, response_len=response_len, group=args.group, cfg=gcfg, dtype=args.dtype,
               gpus=args.gpus, cp=args.cp, gpu_mem=gpu_mem, fsdp=False if args.no_fsdp else None,
               replicate=args.replicate, master_dtype=args.master_dtype, optimizer_offload=args.optimizer_offload,
               lora=lora, reserve=reserve, max_positions=max_positions, graph_budget=budget, ep=args.ep,
               ep_shard=not args.ep_replicate)
    if args.json:
        print(json.dumps(res.to_json()))
        return 0
    lo = res.settings.get("lora")
    lora_text = ""
    if lo is not None:
        t = lo["target_modules"]
        on = [t] if isinstance(t, str) else list(t)
        lora_text = (f", LoRA r={lo['rank']} alpha={lo['alpha']:g} on {','.join(on + lo['target_parameters'])} "
                     f"({lo['adapted_modules']:,} modules" + (" and expert parameters)" if lo["target_parameters"]
                                                              else ")"))
    print(f"model {Path(args.model)} ({cfg.get('model_type')}): prompt {format_tokens(prompt_len)} tokens, response "
          f"{format_tokens(response_len)}, G={args.group}, {args.prompt_grad}, {args.dtype}, gpus={args.gpus}, "
          f"cp={args.cp}{f', ep={args.ep}' if args.ep > 1 else ''}"
          f"{', checkpointed layers' if args.checkpoint_layers else ''}{lora_text}")
    print("per device:")
    why = explain(res)
    for k in BREAKDOWN_KEYS + (("all_to_all",) if "all_to_all" in res.breakdown else ()):
        print(f"  {k:<18} {format_bytes(res.breakdown[k]):>12}   {why[k]}")
        if k == "weights" and lo is not None:
            for label, b, text in lora_lines(res):
                print(f"    {label:<16} {format_bytes(b):>12}   {text}")
    a2a = " + all_to_all" if "all_to_all" in res.breakdown else ""
    backward = ("weights + grads + optimizer + gathered + prompt_state + prompt_state_grad + max(prefill_chunk, "
                f"branch_graph + logits) + kept_graphs{a2a}")
    peaks = res.settings.get("phase_peaks")
    if peaks is None:
        print(f"  {'peak':<18} {format_bytes(res.peak_bytes):>12}   {backward}")
    else:
        print(f"  {'peak':<18} {format_bytes(res.peak_bytes):>12}   the larger of the backward phases' "
              f"{format_bytes(peaks['backward'])} ({backward}) and the forward phases' "
              f"{format_bytes(peaks['forward'])} (weights + grads + optimizer + gathered{a2a} + the prompt state "
              "less what the prefill moved + one no-grad prefill chunk)")
    host = res.settings.get("host")
    if host is not None:
        tr, ts = host["state_grad_traffic_bytes"], host["state_traffic_bytes"]
        parts = [f"{label} {format_bytes(host[k])}" for k, label in (("prompt_state_bytes", "prompt state"),
                                                                      ("prompt_state_grad_bytes", "state gradient"),
                                                                      ("optimizer_bytes", "AdamW state")) if host[k]]
        if host["prompt_state_prefill_bytes"]:
            parts[0] += (f" ({format_bytes(host['prompt_state_prefill_bytes'])} of it DeltaNet boundary states, "
                         "moved during the prefill)")
        print(f"host memory per device: {format_bytes(host['total_bytes'])} ({', '.join(parts)})"
              + (f"; prompt state traffic per step: {format_bytes(ts['device_to_host'])} device->host, "
                 f"{format_bytes(ts['replay_host_to_device'])} host->device in the replay, "
                 f"{format_bytes(ts['reverse_host_to_device'])} in the reverse pass"
                 if host["prompt_state_bytes"] else "")
              + (f"; state gradient traffic per step: {format_bytes(tr['replay_device_to_host'])} device->host in "
                 f"the replay, {format_bytes(tr['reverse_device_to_host'])} device->host and "
                 f"{format_bytes(tr['reverse_host_to_device'])} host->device in the reverse pass"
                 if host["prompt_state_grad_bytes"] else ""))
    gb = res.settings.get("graph_budget")
    if gb is not None:
        print(f"graph budget {format_bytes(gb['budget'])}: keeps {format_bytes(gb['kept_bytes'])} of prompt-step "
              f"graphs ({format_tokens(gb['kept_tokens'])} of the prompt's positions, {gb['steps']} steps), so the "
              f"reverse pass skips {gb['recompute_saved']:.0%} of its recomputation (predicted: "
              f"{gb['step_time_saved']:.0%} of the prompt's time)")
    print(f"verdict: {verdict(res)}")
    return 0
