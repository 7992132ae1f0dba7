"""HF safetensors files written one whole tensor at a time, by one process or by every rank of a sharded model.

A standard HF checkpoint holds whole tensors, listed by ``model.safetensors.index.json`` when there are several
files. :func:`plan_export` decides, before any tensor is touched, every file's name, its tensors (with their names,
dtypes and shapes, through the model's weight map: fused MoE experts become per-expert tensors) and the rank that
writes it: the parameters are split into contiguous runs of about equal bytes, one run per rank, and each rank's run
into files of at most ``max_shard_size`` (one file when everything fits in one, named ``model.safetensors``).

:func:`write_export` then walks the parameters in the plan's order on every rank. A sharded parameter (an FSDP2
DTensor) is gathered whole with ``full_tensor()``, a collective of its shard group that every rank joins; only the
rank that owns it keeps it, writes its tensor(s) into the open file and frees it. Routed experts split over
expert-parallel ranks are planned as one item per EP slice (:class:`ExpertRows`), owned by a rank that holds it,
which writes those experts from its own rows: no gather at all. Since every header is known in
advance, a file is written as a stream: its header first, then each tensor's bytes as it arrives
(:class:`SafetensorsStream`); so peak extra memory is one full tensor per rank, and no rank ever holds the model.
A failed write (a full disk) stops that rank's writing but not its part in the gathers; the error is agreed on at the
end (:func:`longstraw.distributed.agree.agree`), so no rank is left waiting.

Safetensors layout: an 8-byte little-endian header length, the JSON header (``{name: {dtype, shape,
data_offsets}}`` plus ``__metadata__``, padded with spaces to 8 bytes), then the tensors' bytes back to back, in
header order. Tensors of larger elements come first in each file, so every tensor starts aligned to its element
size.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass, field
from pathlib import Path

import torch

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"

_ST_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
              torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
              torch.bool: "BOOL"}
for _name, _code in (("float8_e4m3fn", "F8_E4M3"), ("float8_e5m2", "F8_E5M2")):
    if hasattr(torch, _name):
        _ST_DTYPES[getattr(torch, _name)] = _code


@dataclass(frozen=True)
class Entry:
    """One tensor of the checkpoint: its HF name, dtype and shape."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()


@dataclass
class Item:
    """One parameter: its index in ``named``, the checkpoint tensors it becomes, and the rank that writes them."""

    index: int
    outs: list[Entry]
    owner: int = 0


@dataclass
class File:
    name: str
    owner: int
    tensors: list[Entry] = field(default_factory=list)


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


def plan_export(named: list[tuple[str, torch.Tensor]], wmap, world: int, max_shard_bytes: int,
                dtypes: list[torch.dtype | None] | None = None) -> tuple[list[Item], list[File]]:
    """The export of parameters ``named`` (their global shapes) by ``world`` ranks: items in gather order (the
    same on every rank) and the files (see the module doc). ``dtypes[i]``: the dtype ``named[i]`` is written in
    (None: its own)."""
    items = []
    for i, (name, t) in enumerate(named):
        dt = dtypes[i] if dtypes is not None and dtypes[i] is not None else t.dtype
        meta = torch.empty(tuple(t.shape), dtype=dt, device="meta")
        pairs = wmap.save_rows(name, meta, t.first) if isinstance(t, ExpertRows) else wmap.save_tensors([(name, meta)])
        outs = [Entry(n, o.dtype, tuple(o.shape)) for n, o in pairs]
        items.append(Item(i, outs))
    items.sort(key=lambda it: -max((_element_size(o.dtype) for o in it.outs), default=1))  # stable: aligned data
    sizes = [sum(o.nbytes for o in it.outs) for it in items]
    total = max(1, sum(sizes))
    start = 0
    for it, nb in zip(items, sizes):  # contiguous runs of about total / world bytes
        it.owner = min(world - 1, int((start + nb / 2) * world // total))
        t = named[it.index][1]
        if isinstance(t, ExpertRows) and it.owner not in t.holders:  # a rank that holds these experts: the nearest
            it.owner = min(t.holders, key=lambda r: (abs(r - it.owner), r))
        start += nb
    files: list[File] = []
    for r in range(world):
        size, current = 0, None
        for it in items:
            if it.owner != r:
                continue
            for o in it.outs:
                if current is None or (current.tensors and size + o.nbytes > max_shard_bytes):
                    current = File("", r)
                    files.append(current)
                    size = 0
                current.tensors.append(o)
                size += o.nbytes
    if len(files) == 1:
        files[0].name = WEIGHTS
    for i, f in enumerate(files if len(files) > 1 else []):
        f.name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
    return items, files


def index_json(files: list[File]) -> str:
    """``model.safetensors.index.json`` of a multi-file plan."""
    weight_map = {t.name: f.name for f in files for t in f.tensors}
    total = sum(t.nbytes for f in files for t in f.tensors)
    return json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2)


class SafetensorsStream:
    """A safetensors file written as a stream: the header of ``tensors`` at once, then :meth:`write` each tensor in
    header order, then :meth:`close` (fsync, then renamed from a temporary name into place)."""

    def __init__(self, path: Path, tensors: list[Entry], metadata: dict[str, str] | None = None):
        self.path = Path(path)
        self.pending = list(tensors)
        header: dict = {"__metadata__": dict(metadata or {"format": "pt"})}
        off = 0
        for t in tensors:
            if t.dtype not in _ST_DTYPES:
                raise ValueError(f"cannot write {t.name}: dtype {t.dtype} has no safetensors code")
            header[t.name] = {"dtype": _ST_DTYPES[t.dtype], "shape": list(t.shape), "data_offsets": [off, off + t.nbytes]}
            off += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self.tmp = self.path.with_name(f"{self.path.name}.tmp-{os.getpid()}")
        self.f = open(self.tmp, "wb")
        try:
            self.f.write(struct.pack("<Q", len(raw)))
            self.f.write(raw)
        except BaseException:
            self.abort()
            raise

    def write(self, name: str, t: torch.Tensor) -> None:
        want = self.pending.pop(0)
        assert (want.name, want.dtype, want.shape) == (name, t.dtype, tuple(t.shape)), (want, name, t.dtype, t.shape)
        t = t.detach().to("cpu").contiguous()
        if t.numel():
            self.f.write(t.reshape(-1).view(torch.uint8).numpy().data)

    def close(self) -> None:
        assert not self.pending, [t.name for t in self.pending]
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
        os.replace(self.tmp, self.path)

    def abort(self) -> None:
        try:
            self.f.close()
        finally:
            self.tmp.unlink(missing_ok=True)


def _is_sharded(t: torch.Tensor) -> bool:
    return hasattr(t, "full_tensor") and hasattr(t, "device_mesh")


@dataclass(frozen=True)
class ExpertRows:
    """Rows ``[first, first + shape[0])`` of a fused expert parameter split over expert-parallel ranks: written by a
    rank that holds them (``local``: this rank's tensor of those rows, None elsewhere), without a gather. ``holders``:
    the ranks that hold them (the same EP coordinate in every expert-data-parallel group). ``make``: a function
    returning the rows to write instead of ``local`` (``save_model(merge_lora=True)``: its experts' LoRA merged in,
    made when the rows' turn comes, one slice at a time)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    first: int
    holders: tuple[int, ...]
    local: torch.Tensor | None = field(default=None, repr=False)
    make: object = field(default=None, repr=False)  # local rows made when written (a LoRA merge), else ``local``


@dataclass(frozen=True)
class Computed:
    """A tensor of the export made when its turn comes (a LoRA-merged weight): ``shape`` and ``dtype`` for the
    plan, ``make()`` for the full tensor (a collective on a sharded model, called on every rank in plan order)."""

    shape: tuple[int, ...]
    dtype: torch.dtype
    make: object = field(repr=False)


def _cast(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    return t if dtype is None or t.dtype == dtype else t.to(dtype)


def _whole(t) -> torch.Tensor:
    if isinstance(t, Computed):
        return t.make()
    return t.full_tensor() if _is_sharded(t) else t  # a collective of the shard group: every rank joins


def write_export(named: list[tuple[str, torch.Tensor]], wmap, items: list[Item], files: list[File], rank: int,
                 directory: Path, dtypes: list[torch.dtype | None] | None = None) -> BaseException | None:
    """Write this rank's files of the plan into ``directory``; every rank calls it (the gathers are collectives).
    Returns this rank's first write error (None if all went well); it never raises one mid-way, so the gathers stay
    in step on every rank. ``dtypes`` as :func:`plan_export` was given them: each tensor is cast as it is written
    (one tensor's copy at a time)."""
    file_of = {t.name: f for f in files for t in f.tensors}
    open_streams: dict[str, SafetensorsStream] = {}
    err: BaseException | None = None
    for it in items:
        name, t = named[it.index]
        dt = dtypes[it.index] if dtypes is not None else None
        if isinstance(t, ExpertRows):  # this rank's own experts, if it writes them: no collective, no gather
            if it.owner != rank or err is not None:
                continue
            rows = t.local if t.make is None else t.make()
            full, pairs = None, wmap.save_rows(name, _cast(rows.detach(), dt), t.first)
        else:
            full = _whole(t)
            if it.owner != rank or err is not None:
                del full
                continue
            full = _cast(full.detach(), dt)
            pairs = wmap.save_tensors([(name, full)])
        try:
            for hf_name, out in pairs:
                f = file_of[hf_name]
                s = open_streams.get(f.name)
                if s is None:
                    s = open_streams[f.name] = SafetensorsStream(directory / f.name, f.tensors)
                s.write(hf_name, out)
                if not s.pending:
                    open_streams.pop(f.name).close()
        except Exception as e:  # noqa: BLE001 - reported after the gathers (see the docstring)
            err = e
        del full
    for s in open_streams.values():
        s.abort()
    if err is None and open_streams:
        err = RuntimeError(f"export left files incomplete: {sorted(open_streams)}")
    return err
