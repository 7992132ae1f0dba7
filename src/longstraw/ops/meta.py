"""The dry-run seam: what ops do on the ``meta`` device, where tensors have shapes but no values.

The memory planner (``longstraw.planner``) runs the engine's real GRPO step on a model built on the meta device and
tracks the bytes of every tensor storage the ops create. Almost every op runs unchanged there. This module holds
the only places where an op takes another path on meta, each because the real path cannot run without values or
would repeat identical work thousands of times; each replacement allocates the same tensors (shapes, dtypes,
lifetimes) as the real path, and a test holds every tracked byte equal with the shortcuts on and off
(:data:`SHORTCUTS`):

``expert_slot_outputs``
    MoE routing is data (which expert gets how many tokens): the real dispatch needs the counts on the host.
    On meta all ``N * k`` token slots go through one expert's weights, which allocates what the real dispatch
    allocates in total; ``ops.moe.experts_forward`` then combines them as it combines real ones. With LoRA on the
    fused weights the grouped dispatch also makes contiguous copies of the adapters' factors, which its graph keeps
    (:func:`grouped_lora_copies`); under expert parallelism a rank copies only its experts' part
    (:func:`expert_split`).
``skip_delta_rule_block``
    The torch gated delta rule processes a long input in blocks of chunks; without autograd each block frees its
    intermediates, so on meta the blocks between the first and the last only add their output (prefill dry runs of
    a long prompt would otherwise run thousands of meta ops per layer). Its backward (``ops.deltanet``'s
    recomputing backward) re-runs one block at a time from the saved state entering it and writes the inputs'
    gradients into buffers allocated before the loop; there the blocks between the first and the second-to-last
    (full size, with the entering state's gradient, as every middle block) only hand on a state gradient.
``skip_repeated_block``
    Loops over blocks whose transients are freed before the next block and whose results go into buffers allocated
    before the loop: DeepSeek Sparse Attention's lightning indexer (``models/dsa.py``, always without autograd)
    scoring a chunk's queries against every stored key in blocks of queries and, within one, chunks of keys, and
    the sparse attention over the selected latents (``ops/sparse_attention.py``, forward and backward, blocked over
    queries). Over a long prefix that is hundreds of blocks per layer and chunk. On meta only the blocks that can
    set the peak run: the first and the last query blocks (the others repeat the first), and of the indexer's key
    chunks (whose partial scores accumulate until they are concatenated) the first, the last full-size one and the
    last two; a skipped key chunk only allocates its partial scores.
``skip_repeated_block`` for prefill steps, with ``layout`` and ``replicate``
    The prefill (``engine/prefill.py``) runs one step per chunk of the prompt, each over a longer prefix; a step
    frees its activations before the next and leaves only its state pieces. On meta only the steps that can set
    the peak run (the first two and the last two: the state grows and a step's transient grows with its prefix),
    and a skipped step of the same length as the last one run gets fresh pieces laid out as that step's were
    (:func:`layout`, :func:`replicate`: the same storages, shapes, strides and aliasing), which the state stores as
    it stores real ones. A million-token dry run is then four steps instead of hundreds, of which each would also
    walk every stored chunk of a DSA prefix.
``value``
    Where the engine turns a 0-d tensor into a Python number (the loss and statistics it reports), meta gives NaN.

What the planner itself samples (one branch batch of the G, the reverse-pass chunks that can set its peak) is
documented in ``longstraw.planner``: those are choices of what to run, not different op paths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from contextlib import contextmanager

import torch
from torch import Tensor

__all__ = ["SHORTCUTS", "is_meta", "value", "expert_slot_outputs", "grouped_lora_copies", "expert_split",
           "skip_delta_rule_block", "skip_repeated_block", "layout", "replicate"]

SHORTCUTS = True  # tests switch this off to check that the shortcuts change no tracked byte
_EXPERT_SPLIT = 1  # the ranks a dry run's routed experts are split over (:func:`expert_split`)


def is_meta(t: Tensor) -> bool:
    return t.device.type == "meta"


def value(t: Tensor) -> float:
    """``float(t)`` of a 0-d tensor; NaN on the meta device (no values there)."""
    return float("nan") if is_meta(t) else float(t)


def expert_slot_outputs(x: Tensor, weights: Tensor, rows: Callable[[Tensor, int], Tensor]) -> tuple[Tensor, Tensor]:
    """The routed experts' slot outputs on meta, ``(ys [N k, H], token_idx [N k])``: the same tensors, shapes and
    dtypes as the real dispatch of ``ops.moe.experts_forward`` (all ``N * k`` slots through expert 0: ``rows(xs,
    0)``, the dispatch's per-expert computation, LoRA adapters included), without data-dependent counts; the caller
    combines them (``ops.moe.combine_slots``) as the real path does."""
    n, k = weights.shape
    token_idx = torch.arange(n * k, device=x.device) // k
    return rows(x[token_idx], 0), token_idx


def grouped_lora_copies(factors: tuple[Tensor, Tensor, float]) -> tuple[Tensor, Tensor, float]:
    """The LoRA factors ``(A [E, r, in], B [E, out, r], s)`` of a fused expert weight as the grouped dispatch uses
    them on meta: backed by the contiguous copies it makes (``ops.moe._grouped_lowrank``: ``A^T [E, in, r]``,
    ``B^T [E, r, out]``, which its ``grouped_mm`` calls keep for their backward), of this rank's experts only under
    :func:`expert_split` (``E / split`` of them; the meta dispatch runs every slot through expert 0). Differentiable
    in the factors, as the real copies are."""
    a, b, s = factors
    m = max(1, a.shape[0] // _EXPERT_SPLIT)
    a_c = a[:m].transpose(1, 2).contiguous().transpose(1, 2)  # [m, r, in] over a [m, in, r] copy
    b_c = b[:m].transpose(1, 2).contiguous().transpose(1, 2)  # [m, out, r] over a [m, r, out] copy
    return a_c, b_c, s


@contextmanager
def expert_split(ranks: int):
    """Within: dry runs count the routed experts' per-rank copies (:func:`grouped_lora_copies`) as a rank of an
    expert-parallel group of ``ranks`` makes them (its ``1 / ranks`` of the experts); the planner's ``plan(ep=)``.
    The dry run itself still computes every expert's slots as one process does."""
    global _EXPERT_SPLIT
    if ranks < 1:
        raise ValueError(f"expert_split(ranks={ranks}): ranks must be >= 1")
    before, _EXPERT_SPLIT = _EXPERT_SPLIT, int(ranks)
    try:
        yield
    finally:
        _EXPERT_SPLIT = before


def skip_delta_rule_block(inputs: tuple[Tensor | None, ...], t0: int, last_start: int) -> bool:
    """Whether the torch gated delta rule may replace the block starting at ``t0`` by an empty output of the same
    shape: on meta, with the shortcuts on, without autograd on any input, and not the first or the last block
    (``last_start``: where the last block starts)."""
    x = inputs[0]
    if not (SHORTCUTS and x is not None and is_meta(x)) or not 0 < t0 < last_start:
        return False
    return not (torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in inputs))


def skip_repeated_block(x: Tensor, i: int, keep: Iterable[int]) -> bool:
    """Whether block ``i`` of a loop of repeated blocks may be skipped (``skip_repeated_block`` in the module
    docstring): on meta, with the shortcuts on, and ``i`` not among the blocks to ``keep``."""
    return SHORTCUTS and is_meta(x) and i not in set(keep)


def layout(pieces) -> tuple | None:
    """The storage layout of a nest (tuples, lists, None) of meta tensors, for :func:`replicate`: per storage its
    bytes, per tensor its storage, dtype, shape, strides and offset (tensors sharing a storage share it in the
    copy). None when the nest holds anything else, a tensor off meta or one that requires grad (nothing to
    replicate then: the caller runs the step)."""
    storages: dict[int, int] = {}  # id(storage) -> its index in the layout

    def walk(x):
        if x is None:
            return None
        if isinstance(x, Tensor):
            if not is_meta(x) or x.requires_grad or x.is_conj() or x.is_neg():
                raise TypeError
            st = x.untyped_storage()
            k = storages.setdefault(id(st), len(storages))
            if k == len(sizes):
                sizes.append(st.nbytes())
            return (k, x.dtype, tuple(x.shape), x.stride(), x.storage_offset())
        if type(x) in (tuple, list):
            return (type(x), tuple(walk(y) for y in x))
        raise TypeError

    sizes: list[int] = []
    try:
        tree = walk(pieces)
    except TypeError:
        return None
    return tuple(sizes), tree


def replicate(spec: tuple):
    """Fresh meta tensors laid out as :func:`layout` recorded them: one new storage per recorded storage (a
    ``uint8`` buffer of its bytes), each tensor a view of its storage with the recorded dtype, shape, strides
    and offset."""
    sizes, tree = spec
    return _build(tree, [torch.empty(n, dtype=torch.uint8, device="meta") for n in sizes])


def _build(node, bufs: list[Tensor]):
    """:func:`replicate`'s walk (a module function: a recursive closure would be a reference cycle that keeps the
    buffers alive until the garbage collector runs)."""
    if node is None:
        return None
    if len(node) == 2:
        kind, items = node
        return kind(_build(y, bufs) for y in items)
    k, dtype, shape, stride, offset = node
    return bufs[k].view(dtype).as_strided(shape, stride, offset)
