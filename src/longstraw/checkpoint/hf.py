"""HF checkpoint directories in and out: ``load_model``, ``save_model``, ``hf_grads``.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or the shards listed by
``model.safetensors.index.json``), and usually the tokenizer's files. Only those weight files are read, as
transformers does: another ``*.safetensors`` beside them (gradients, an adapter) is never taken for weights.
Loading builds the model on the meta device (no random init of billions of parameters), applies the process's
parallelism there (FSDP2 makes the sharded parameters meta DTensors), checks that this rank's part fits the target
device's memory, allocates only that part and copies into each parameter the rows this rank holds, reading only
those rows (``get_slice``), so peak memory is about this rank's shard plus one tensor's rows. Pickled weights
(``pytorch_model.bin``) are refused unless the caller passes ``allow_pickle=True``; even then they are read with
``torch.load(weights_only=True)``, whole.

The loaded model remembers its directory (``model.source_dir``); :func:`save_model` copies the tokenizer files
from there, so a saved directory is a complete checkpoint that ``longstraw generate --model`` reads.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import torch
from safetensors import safe_open

from longstraw import distributed
from longstraw.devices import device_memory, resolve_device
from longstraw.distributed.fsdp import is_sharded, local_rows, reshard, shard_rows
from longstraw.models import registry
from longstraw.models.registry import family_for
from longstraw.models.transformer import CausalLM
from longstraw.models.weights import Rows, TensorDictReader
from longstraw.tokenizer import BYTE_TOKENIZER_FILE
from longstraw.units import format_bytes

WEIGHTS = "model.safetensors"
WEIGHTS_INDEX = "model.safetensors.index.json"
PICKLED_WEIGHTS = "pytorch_model.bin"
PICKLED_WEIGHTS_INDEX = "pytorch_model.bin.index.json"
# what a tokenizer leaves in a checkpoint directory (HF tokenizers, their chat templates, LongStraw's byte tokenizer)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
                   "tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "vocab.json", "vocab.txt",
                   "merges.txt", "chat_template.jinja", "chat_template.json", "tiktoken.model", BYTE_TOKENIZER_FILE)
TOKENIZER_DIRS = ("additional_chat_templates",)
_SHARD = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(dtype: str | torch.dtype | None, what: str = "dtype") -> torch.dtype | None:
    """``dtype`` by name (``"bfloat16"``) or as a torch dtype; None stays None; anything else a ValueError naming
    ``what`` and the dtypes allowed."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported {what} {dtype!r}; supported: {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def read_config(path: str | os.PathLike) -> dict:
    """The ``config.json`` of a checkpoint directory (or the file itself)."""
    p = Path(path)
    if p.is_file() and p.name.endswith(".json"):
        cfg_file = p
    else:
        if not p.is_dir():
            raise ValueError(f"checkpoint directory {str(p)!r} does not exist")
        cfg_file = p / "config.json"
        if not cfg_file.is_file():
            raise ValueError(f"{str(p)!r} has no config.json; a checkpoint directory needs config.json and "
                             "*.safetensors weights")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}: invalid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{cfg_file}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _index_files(p: Path, index: Path) -> tuple[list[Path], dict[str, str]]:
    """The shard files an index lists (and its tensor -> file map); ValueError for a broken or incomplete index."""
    try:
        wm = json.loads(index.read_text(encoding="utf-8")).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as e:
        raise ValueError(f"{index}: not a valid index ({type(e).__name__}: {e})") from None
    if not isinstance(wm, dict) or not wm or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
        raise ValueError(f"{index}: 'weight_map' must be a non-empty object of tensor name -> shard file name")
    bad = sorted({f for f in wm.values() if Path(f).name != f})
    if bad:
        raise ValueError(f"{index}: shard names must be file names in the same directory, got {bad[:3]}")
    files = sorted({p / f for f in wm.values()})
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise ValueError(f"{index.name} lists shards that are missing: {missing}")
    return files, wm


def _weight_files(p: Path, allow_pickle: bool) -> tuple[str, list[Path], dict[str, str] | None]:
    """``(kind, files, weight_map)``: ``model.safetensors``, or the shards ``model.safetensors.index.json`` lists
    (weight_map: which tensor to take from which shard); the same for pickles with ``allow_pickle``."""
    if (p / WEIGHTS_INDEX).is_file():
        return "safetensors", *_index_files(p, p / WEIGHTS_INDEX)
    if (p / WEIGHTS).is_file():
        return "safetensors", [p / WEIGHTS], None
    others = sorted(f.name for f in p.glob("*.safetensors"))
    if others:
        raise ValueError(f"{str(p)!r} has no {WEIGHTS} and no {WEIGHTS_INDEX}; it holds only "
                         f"{_list(others, 5)}, which are not read as the model's weights (a checkpoint is "
                         f"{WEIGHTS}, or model-00001-of-0000N.safetensors shards listed by {WEIGHTS_INDEX})")
    pickled = (p / PICKLED_WEIGHTS_INDEX).is_file() or (p / PICKLED_WEIGHTS).is_file()
    if pickled:
        if not allow_pickle:
            name = PICKLED_WEIGHTS_INDEX if (p / PICKLED_WEIGHTS_INDEX).is_file() else PICKLED_WEIGHTS
            raise ValueError(f"{str(p)!r} holds only pickled weights ({name}); pickles can run code, so "
                             "they are not loaded unless you pass allow_pickle=True (or convert to safetensors)")
        if (p / PICKLED_WEIGHTS_INDEX).is_file():
            return "pickle", *_index_files(p, p / PICKLED_WEIGHTS_INDEX)
        return "pickle", [p / PICKLED_WEIGHTS], None
    raise ValueError(f"{str(p)!r} has no weights: expected {WEIGHTS}, shards listed by {WEIGHTS_INDEX}, or (with "
                     f"allow_pickle=True) {PICKLED_WEIGHTS}")


class ModelTooLargeError(ValueError):
    """The model's parameters do not fit the target device (checked before allocating, or the allocation failed)."""


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: the local shard of a DTensor (unpadded), else ``t`` itself."""
    if not is_sharded(t):
        return t
    with torch.no_grad():
        return t.to_local()


def _check_fits(model: CausalLM, device: torch.device, where: Path) -> str:
    """Check that this rank's part of ``model`` (on meta, its parallelism applied: the local shard of each
    sharded parameter, every other tensor whole) fits ``device``; ModelTooLargeError (a ValueError) with both
    sizes. Returns the size in words, for :func:`_materialise`'s error."""
    tensors = list(model.parameters()) + list(model.buffers())
    need = sum(_local(t).numel() * t.element_size() for t in tensors)
    total = sum(t.numel() * t.element_size() for t in tensors)
    mesh_types = {t.device_mesh.device_type for t in tensors if is_sharded(t)}
    if mesh_types - {device.type}:
        raise ValueError(f"device={str(device)!r}: this process shards the model over a device mesh of "
                         f"{', '.join(sorted(mesh_types))} devices (init_distributed); load it onto that device type")
    if mesh_types == {"cuda"} and device.index is not None and device.index != torch.cuda.current_device():
        raise ValueError(f"device={str(device)!r}: this rank's shards belong on cuda:{torch.cuda.current_device()} "
                         "(init_distributed set it from LOCAL_RANK); pass device='cuda'")
    share = f" for this rank's shard (of {format_bytes(total)} in all)" if need != total else ""
    have, what = device_memory(device)
    n = sum(t.numel() for t in model.parameters())
    if have is not None and need > have:
        raise ModelTooLargeError(f"{str(where)!r}: the model's {n:,} parameters need {format_bytes(need)} on "
                                 f"{device}{share}, more than its {what} of {format_bytes(have)} (check config.json's "
                                 "sizes)")
    return f"{format_bytes(need)}{share}"


def _materialise(model: CausalLM, device: torch.device, where: Path, size: str) -> CausalLM:
    """``model`` (on meta) allocated on ``device``: only this rank's shard of each sharded parameter
    (``to_empty`` allocates a DTensor's local tensor); an allocation failure is a ModelTooLargeError."""
    try:
        return model.to_empty(device=device)
    except RuntimeError as e:  # torch.OutOfMemoryError is a RuntimeError
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ModelTooLargeError(f"{str(where)!r}: cannot allocate the model's {size} on {device}: {first}") from None


def _damaged(f: Path, e: BaseException) -> ValueError:
    return ValueError(f"{f}: cannot read the weights, the file is damaged or truncated ({type(e).__name__}: "
                      f"{str(e).strip().splitlines()[0] if str(e).strip() else e!r})")


class _SafetensorsReader:
    """A :class:`~longstraw.models.weights.CheckpointReader` over safetensors files: shapes from the headers, rows
    with ``safe_open(...).get_slice(name)[a:b]`` (only those bytes are read), whole tensors with ``get_tensor``.
    Files are opened when first read and closed by :meth:`release`: safetensors memory-maps a file, and the pages
    a read touched stay in this process's resident memory until the file is closed, so ``load_model`` releases
    after every parameter (then at most one parameter's rows are mapped at a time)."""

    def __init__(self, where: dict[str, Path]):
        self.where = where  # tensor name -> its file
        self.handles: dict[Path, object] = {}

    def _call(self, name: str, fn):
        f = self.where[name]
        try:
            h = self.handles.get(f)
            if h is None:
                h = self.handles[f] = safe_open(str(f), framework="pt", device="cpu")
            return fn(h)
        except Exception as e:  # SafetensorError: a truncated file, garbage bytes
            raise _damaged(f, e) from None

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._call(name, lambda h: h.get_slice(name).get_shape()))

    def read(self, name: str, rows: Rows = None) -> torch.Tensor:
        if rows is None:
            return self._call(name, lambda h: h.get_tensor(name))
        return self._call(name, lambda h: h.get_slice(name)[rows[0]:rows[1]])

    def release(self) -> None:
        self.handles.clear()


def _open_weights(kind: str, files: list[Path], weight_map: dict[str, str] | None):
    """``(reader, tensor names)`` for the weight files; safetensors are only opened to list their tensors,
    pickles are read whole (``torch.load`` cannot read part of a tensor)."""
    if kind == "safetensors":
        where = {}
        for f in files:
            try:
                names = list(safe_open(str(f), framework="pt", device="cpu").keys())
            except Exception as e:  # SafetensorError: a truncated file, garbage bytes
                raise _damaged(f, e) from None
            where.update((n, f) for n in names if weight_map is None or weight_map.get(n) == f.name)
        return _SafetensorsReader(where), set(where)
    tensors = {}
    for f in files:
        try:
            sd = torch.load(f, map_location="cpu", weights_only=True)
        except Exception as e:  # truncated zip, not a pickle, a refused type
            raise _damaged(f, e) from None
        if not isinstance(sd, dict):
            raise ValueError(f"{f}: expected a state dict, got {type(sd).__name__}")
        tensors.update((n, t) for n, t in sd.items() if weight_map is None or weight_map.get(n) == f.name)
    return TensorDictReader(tensors), set(tensors)


def _config_dtype(cfg: dict) -> torch.dtype | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


def _list(names, limit=20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _master_dtype(dtype: torch.dtype, master_dtype: str | torch.dtype | None) -> torch.dtype | None:
    """``master_dtype`` checked against the compute ``dtype``: None, ``dtype`` itself, or float32 for a bf16/fp16
    model."""
    master = parse_dtype(master_dtype, "master_dtype")
    if master is None or master == dtype:
        return master
    if master != torch.float32 or dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"master_dtype={str(master).removeprefix('torch.')} is not allowed with "
                         f"dtype={str(dtype).removeprefix('torch.')}: master weights are float32 for a bfloat16 or "
                         "float16 model, or the model's own dtype (no master weights)")
    return master


def load_model(path: str | os.PathLike, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, *, allow_pickle: bool = False,
               master_dtype: str | torch.dtype | None = None, lora=None, adapter: str | os.PathLike | None = None,
               lora_seed: int | None = None, weights: bool = True) -> CausalLM:
    """Load an HF checkpoint directory into a LongStraw model, with the process's parallelism applied.

    dtype: the compute dtype (default: the config's ``dtype``/``torch_dtype``, else float32).
    master_dtype: the dtype the parameters are held and updated in (so their gradients and the optimiser's moments
    too). Under FSDP (``init_distributed(fsdp=True)``) a bf16/fp16 model gets float32 master shards by default
    (``distributed.apply_fsdp``); pass the model's own dtype to keep everything in it. In one process the default
    is the model's dtype; ``master_dtype=torch.float32`` with a bf16/fp16 ``dtype`` keeps float32 parameters and
    computes every pass in ``dtype`` under autocast (``CausalLM.use_master_weights``). The checkpoint's values are
    read straight into the master dtype. Anything else (float32 masters for a float32 model, a bf16 master for a
    float32 model) is a ValueError.
    device: where to put the parameters (default CPU); a device this machine lacks is a ValueError, and so is a
    device type other than that of the mesh the parameters are sharded over (on CUDA: a device other than the
    rank's own; pass ``"cuda"``).
    The model's ``source_dir`` is ``path`` (:func:`save_model` copies the tokenizer files from it).

    LoRA (:mod:`longstraw.checkpoint.adapter`): ``lora=dict(rank=..., alpha=..., target_modules=..., dropout=...,
    modules_to_save=...)`` adds fresh adapters (PEFT's initialisation; ``lora_seed`` seeds the ``A`` matrices, drawn
    whole so every rank and layout gets the same), ``adapter=DIR`` the adapters of a PEFT adapter directory with its
    values. Either way they are added on the meta device before the model is sharded, so FSDP2 shards them with
    their layers; the frozen base keeps ``dtype`` (no master copy, gradient or optimiser state), the adapters take
    ``master_dtype``.

    Sharded loading: the model is built on the meta device and :func:`longstraw.distributed.parallelize` applied
    to it there (after ``init_distributed(fsdp=True)`` FSDP2 turns the sharded parameters into meta DTensors);
    then only this rank's storage is allocated (each DTensor's local shard, every other tensor whole) and checked
    against the device's memory first (``ModelTooLargeError``, a ValueError, with the local and total sizes). Each
    parameter is then filled with the rows it holds (:func:`longstraw.distributed.fsdp.local_rows`, dim 0), read
    with ``safe_open(...).get_slice(name)[a:b]`` straight into the local tensor; fused MoE experts read only the
    experts in those rows. So no rank holds the whole model: its peak while loading is its shard plus about one
    tensor's rows (each file is closed after every parameter, so the memory-mapped pages read do not pile up;
    docs/DISTRIBUTED.md, "Loading", has the figures). Without parallelism every parameter is one whole-tensor
    read and the result is what it always was. Pickled weights (``pytorch_model.bin``, only with
    ``allow_pickle=True``) are read whole by ``torch.load``, every file of them, before the local rows are copied.

    Checked before anything is allocated or any tensor data read (the size first, then from the files' headers):
    tensors the model does not have, tensors it needs that are missing, shape mismatches (named), incomplete
    experts; multi-token-prediction and vision weights are skipped with a warning.

    ``weights=False`` does all of that but reads no tensor data: the weights are allocated (sharded as above) and
    left uninitialised, for a caller that fills every one of them itself (the trainer resuming from a sharded
    training checkpoint, whose DCP state holds them all: reading the HF export first would read the model twice).
    LoRA adapters are still created and filled as asked.
    """
    p = Path(path)
    cfg = read_config(p)
    family = family_for(cfg.get("model_type"))
    family.check_quantization(cfg)
    kind, files, weight_map = _weight_files(p, allow_pickle)
    dtype = parse_dtype(dtype) or _config_dtype(cfg) or torch.float32
    master = _master_dtype(dtype, master_dtype)
    device = resolve_device(device if device is not None else "cpu", "device")

    settings = _lora_settings(lora, adapter)

    model = registry.build_on_meta(cfg)  # family_for above: an unknown model_type is refused first
    model.to(dtype)
    if settings is not None:
        from longstraw.models.lora import add_adapters

        add_adapters(model, settings)  # on meta: nothing drawn yet; the base is frozen
    ctx = distributed.get_context()
    if master is not None and master != dtype and not (ctx is not None and ctx.fsdp):
        model.use_master_weights(dtype, master)  # on meta: free; FSDP's own policy does it under FSDP
    # FSDP2 over the whole job after init_distributed(fsdp=True), else as is; on meta, before anything is allocated
    model = distributed.parallelize(model, master_dtype=master)
    size = _check_fits(model, device, p)
    reader, present = _open_weights(kind, files, weight_map)
    if weight_map is not None:
        absent = sorted(set(weight_map) - present)
        if absent:
            raise ValueError(f"{str(p)!r}: the index lists tensors its shards do not hold: {_list(absent)}")
    model.tie_weights()
    shapes = {n: tuple(t.shape) for n, t in model.named_weights()}  # full shapes (a DTensor's are global)
    ep_rows = distributed.expert_parallel.ep_param_rows(model)  # expert-parallel experts: this rank's rows only
    for n, (full, _, _) in ep_rows.items():
        shapes[n] = (full, *shapes[n][1:])

    names = sorted(present)
    if model.spec.tie_word_embeddings:
        names = [n for n in names if n != "lm_head.weight"]
    sources = {}
    unexpected = []
    for src in family.weights(cfg).sources(names, reader):  # from the headers: no tensor data read yet
        if src.param not in shapes:
            unexpected.append(src.param)
            continue
        if src.shape != shapes[src.param]:
            raise ValueError(f"shape mismatch for {src.param}: checkpoint has {src.shape}, the config implies "
                             f"{shapes[src.param]}")
        sources[src.param] = src
    if unexpected:
        raise ValueError(f"unexpected weights in {str(p)!r} for model_type {cfg['model_type']!r}: "
                         f"{_list(unexpected)}")
    missing = set(shapes) - set(sources)
    if missing:
        raise ValueError(f"weights missing from {str(p)!r}: {_list(missing)}")

    model = _materialise(model, device, p, size)
    model.tie_weights()
    distributed.expert_parallel.mark_params(model)  # the allocated tensors are new Parameters
    params = dict(model.named_weights())
    assert set(params) == set(sources), set(params) ^ set(sources)
    try:
        with torch.no_grad():
            for pname, src in sources.items() if weights else ():
                target = params[pname]
                rows, local = local_rows(target), _local(target)
                if pname in ep_rows:  # this rank's EP block, or (FSDP over edp) its rows of the block
                    first, end = ep_rows[pname][1:]
                    rows = (first + rows[0], first + rows[1]) if rows is not None else (first, end)
                if local.numel():
                    src.read(rows, out=local)  # converted to the model's dtype as it is copied in
                if isinstance(reader, _SafetensorsReader):
                    reader.release()
    finally:
        if isinstance(reader, _SafetensorsReader):
            reader.release()
    if settings is not None:
        from longstraw.checkpoint.adapter import fill_adapter, init_adapters

        if adapter is not None:
            fill_adapter(model, Path(adapter))
        else:
            init_adapters(model, lora_seed if lora_seed is not None else _shared_seed(model))
    model.eval()
    model.source_dir = p
    # a multimodal checkpoint (Qwen3.5's: text_config + vision_config): transformers' model of it holds the text
    # model under model.language_model., where PEFT keys its adapters (checkpoint.adapter)
    model.source_multimodal = isinstance(cfg.get("text_config"), dict) and "vision_config" in cfg
    return model


def _lora_settings(lora, adapter):
    if lora is None and adapter is None:
        return None
    from longstraw.checkpoint.adapter import adapter_settings, settings_from

    if lora is not None and adapter is not None:
        raise ValueError("load_model: give lora= (fresh adapters) or adapter= (a PEFT adapter directory), not both")
    return adapter_settings(adapter) if adapter is not None else settings_from(lora)


def _shared_seed(model: CausalLM) -> int | None:
    """None in one process (the global generator draws the adapters); on a sharded model rank 0's draw of a seed
    from the global generator, broadcast, so every rank initialises the same adapters."""
    if not any(is_sharded(t) for t in model.parameters()):
        return None
    seed = [int(torch.randint(0, 2**62, (1,)).item())]
    torch.distributed.broadcast_object_list(seed, src=0)
    return seed[0]


def build_model(cfg: dict) -> CausalLM:
    """A randomly initialised model for an HF config dict, with the process's parallelism applied as
    :func:`load_model` applies it (nothing without ``init_distributed``)."""
    return distributed.parallelize(registry.build_model(cfg))


def _parse_size(size: int | str) -> int:
    if isinstance(size, int):
        return size
    s = size.strip().upper()
    for unit, mult in (("GB", 10**9), ("MB", 10**6), ("KB", 10**3), ("B", 1)):
        if s.endswith(unit):
            return int(float(s[: -len(unit)]) * mult)
    raise ValueError(f"max_shard_size {size!r} must be an int (bytes) or like '5GB', '500MB'")


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def tokenizer_files(directory: str | os.PathLike) -> dict[str, Path]:
    """The tokenizer files in a checkpoint directory (name -> path; empty if it has none): the known names, and the
    Python modules of a tokenizer that is the checkpoint's own code (``tokenizer.custom_tokenizer_modules``: Kimi's
    ``tokenization_kimi.py`` beside its ``tiktoken.model``), so an exported checkpoint keeps a working tokenizer."""
    from longstraw.tokenizer import custom_tokenizer_modules

    d = Path(directory)
    names = [*TOKENIZER_FILES, *(m + ".py" for m in custom_tokenizer_modules(d) if "." not in m)]
    return {n: d / n for n in names if (d / n).is_file()}


def _copy_tokenizer(src: Path, dst: Path) -> None:
    """Copy the tokenizer files of checkpoint ``src`` into ``dst`` (best effort: ``src`` may be gone by now, e.g. a
    checkpoint the trainer rotated out; then nothing is copied)."""
    try:
        if not src.is_dir() or src.resolve() == dst.resolve():
            return
    except OSError:
        return
    for name, f in tokenizer_files(src).items():
        tmp = dst / (name + ".tmp")
        try:
            shutil.copyfile(f, tmp)
        except FileNotFoundError:  # removed since it was listed
            continue
        os.replace(tmp, dst / name)
    for name in TOKENIZER_DIRS:
        if (src / name).is_dir():
            shutil.rmtree(dst / name, ignore_errors=True)
            shutil.copytree(src / name, dst / name)


def _export_dtypes(model: CausalLM, named: list, dtype: torch.dtype) -> list[torch.dtype | None]:
    """Per entry of ``named`` (in-memory names; EP slices share their parameter's name): ``dtype`` for a floating
    parameter, None (as held) for buffers and for what transformers keeps float32 in a ``dtype`` model
    (:func:`~longstraw.models.keep_fp32.kept_float32_names`)."""
    from longstraw.models.keep_fp32 import kept_float32_names

    buffers = {n for n, _ in model.named_buffers()}
    fp32 = kept_float32_names(model, dtype)
    return [None if n in buffers or n in fp32 or not t.dtype.is_floating_point else dtype for n, t in named]


def _expert_slices(t: torch.Tensor, m, make=None) -> list:
    """The EP slices of a split expert parameter ``t`` (this rank's rows) of module ``m``, as export items: every
    rank lists all of them (the same plan everywhere), holding the tensor of its own (``make``: its rows with the
    experts' LoRA merged, made when written)."""
    from longstraw.checkpoint.export import ExpertRows

    local, size, world = t.shape[0], m.ep.size, torch.distributed.get_world_size()
    if not is_sharded(t):  # the block is whole on its holders (W == E, or replicated over edp: ep_shard=False)
        return [ExpertRows((local, *t.shape[1:]), t.dtype, j * local, tuple(range(j, world, size)),
                           t if j == m.ep.rank else None, make if j == m.ep.rank else None) for j in range(size)]
    # FSDP over edp: each block's rows split again over the W / E ranks holding it; each rank writes its own rows
    own, out = (m.ep.rank, m.edp.rank), []
    for j in range(size):
        for d in range(world // size):
            a, b = shard_rows(local, (world // size,), (d,), tuple(t.placements))
            if b > a:
                mine = (j, d) == own
                out.append(ExpertRows((b - a, *t.shape[1:]), t.dtype, j * local + a, (d * size + j,),
                                      t.to_local() if mine else None, make if mine else None))
    return out


def save_model(model: CausalLM, path: str | os.PathLike, *, max_shard_size: int | str = "5GB",
               merge_lora: bool = False, dtype: str | torch.dtype | None = None) -> None:
    """Write ``model`` as an HF checkpoint directory (config.json + safetensors, sharded above max_shard_size),
    with the tokenizer files of the directory the model was loaded from (``model.source_dir``), if any.

    A model with LoRA adapters: ``merge_lora=True`` writes each adapted weight merged (``W + s B A``, computed in
    float32, written in the weight's dtype), a plain checkpoint any HF loader reads; by default the base weights are
    written as they are (with any ``modules_to_save`` modules as trained) and the adapters are left out
    (``longstraw.save_adapter`` writes them).

    ``dtype`` (e.g. ``"bfloat16"``): the floating-point parameters are written in it, each cast as it is written
    (a model trained with float32 master weights exported for serving in its compute dtype); what transformers keeps
    in float32 stays as it is held (``models/keep_fp32.py``): persistent buffers (the router's
    ``e_score_correction_bias``), Ling 3.0's short conv and forget-gate ``dt_bias`` / ``A_log`` and, in a float16
    export, the DSA indexer's ``weights_proj``. ``config.json`` then names ``dtype``. Default: every tensor as it
    is held.

    Tensors are written one at a time as streams (:mod:`longstraw.checkpoint.export`): besides the model, one
    tensor's copy in host memory. On an FSDP-sharded model (``init_distributed(fsdp=True)``) this is a collective:
    call it on every rank with the same ``path``. The model is never gathered on one rank: each parameter is gathered
    whole in turn (every rank joins), written by the rank that owns it (the parameters are split over the ranks in
    contiguous runs of about equal bytes, each rank writing its own files) and freed, so the peak extra memory per
    rank is one full tensor; rank 0 writes the index, ``config.json`` and the tokenizer files once every rank's files
    are complete. A failed write on any rank is a ``ValueError`` on every rank (no rank is left waiting).
    """
    from longstraw.checkpoint.export import WEIGHTS_INDEX as INDEX
    from longstraw.checkpoint.export import index_json, plan_export, write_export
    from longstraw.distributed.agree import agree, together
    from longstraw.checkpoint.export import Computed
    from longstraw.distributed.expert_parallel import ep_modules, expert_tensors, gather_experts
    from longstraw.distributed.fsdp import is_sharded

    p = Path(path)
    limit = _parse_size(max_shard_size)
    out_dtype = parse_dtype(dtype, "save_model dtype")
    if out_dtype is not None and not out_dtype.is_floating_point:
        raise ValueError(f"save_model dtype={dtype!r} must be a floating-point dtype (float32, bfloat16, float16, "
                         "float64)")
    family = family_for(model.spec.model_type)
    wmap = family.weights(model.hf_config)
    reshard(model)
    named = model.named_weights()
    if model.spec.tie_word_embeddings:
        named = [(n, t) for n, t in named if n != "lm_head.weight"]
    sharded = any(is_sharded(t) for _, t in named)
    ep = {id(p): m for _, m in ep_modules(model) for p in expert_tensors(m)}
    merged = {}
    if merge_lora:
        from longstraw.checkpoint.adapter import merged_weights

        merged = merged_weights(model)  # {name: (shape, dtype, make)}; an expert-parallel one merges this rank's rows
        if not merged:
            raise ValueError("save_model(merge_lora=True): the model has no LoRA adapters to merge")

    def ep_items(n: str, t: torch.Tensor) -> list:
        """The EP slices of expert weight ``n``; its merge (if any) becomes this rank's slice's, not an item. A
        checkpoint that stores the experts fused (GPT-OSS: the weight map has no per-expert ``save_rows``) gets the
        whole tensor instead, gathered over the EP group when its turn comes (a collective every rank joins, in
        plan order, as an FSDP parameter's ``full_tensor``)."""
        merge = merged.pop(n, None)
        m = ep[id(t)]
        if hasattr(wmap, "save_rows"):
            return _expert_slices(t, m, merge[2] if merge is not None else None)
        def rows() -> torch.Tensor:  # this rank's block (or its FSDP shard over edp), merged if asked
            if merge is None:
                return t
            if not is_sharded(t):
                return merge[2]()
            from torch.distributed.tensor import DTensor  # the merge gives this rank's rows: FSDP's layout

            return DTensor.from_local(merge[2](), t.device_mesh, t.placements, run_check=False, shape=t.shape,
                                      stride=t.stride())

        return [Computed((m.num_experts, *t.shape[1:]), merge[1] if merge is not None else t.dtype,
                         lambda: gather_experts(m, rows()))]

    if ep:  # expert-parallel experts: one item per EP slice, written by a rank that holds it (no gather)
        named = [(n, s) for n, t in named for s in (ep_items(n, t) if id(t) in ep else [t])]
    named = [(n, Computed(*merged[n]) if n in merged else t) for n, t in named]
    rank, world = (torch.distributed.get_rank(), torch.distributed.get_world_size()) if sharded else (0, 1)
    dtypes = _export_dtypes(model, named, out_dtype) if out_dtype is not None else None
    items, files = plan_export(named, wmap, world, limit, dtypes)
    with together(main_only=True, collective=sharded) as mine:
        if mine:  # the weights this function writes, from an earlier save (other files, e.g. gradients, stay)
            p.mkdir(parents=True, exist_ok=True)
            for old in [f for f in p.glob("model-*.safetensors") if _SHARD.match(f.name)] + [p / WEIGHTS, p / INDEX]:
                if old.exists():
                    old.unlink()
    with torch.no_grad():
        err = write_export(named, wmap, items, files, rank, p, dtypes)
    if sharded:
        agree(err)  # every rank learns whether any rank's files failed
    elif err is not None:
        raise err
    with together(main_only=True, collective=sharded) as mine:
        if mine:
            if len(files) > 1:
                _atomic_write_text(p / INDEX, index_json(files))
            cfg = dict(model.hf_config)
            cfg.pop("torch_dtype", None)
            cfg.pop("quantization_config", None)  # a quantised checkpoint (GPT-OSS's MXFP4) was dequantised on load
            cfg["dtype"] = _dtype_name(out_dtype or (named[0][1].dtype if named else torch.float32))
            _atomic_write_text(p / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            source = getattr(model, "source_dir", None)
            if source is not None:
                _copy_tokenizer(Path(source), p)


def _hf_named(model: torch.nn.Module, caller: str) -> dict[str, torch.nn.Parameter]:
    spec = getattr(model, "spec", None)
    if spec is None:
        raise ValueError(f"{caller} needs a LongStraw model, got {type(model).__name__}")
    wmap = family_for(spec.model_type).weights(model.hf_config)
    return {wmap.hf_name(name): prm for name, prm in model.named_parameters()}


def hf_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """The model's parameters keyed by the names of transformers' in-memory model (the keys of :func:`hf_grads`)."""
    return _hf_named(model, "hf_parameters")


def hf_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Current gradients as full tensors under the names of transformers' in-memory model.

    Sharded (DTensor) gradients are gathered; parameters without a gradient are left out.
    """
    named = _hf_named(model, "hf_grads")
    from longstraw.distributed.expert_parallel import ep_modules, expert_tensors, gather_adapter, gather_experts

    ep = {id(p): m for _, m in ep_modules(model) for p in expert_tensors(m)}
    # LoRA on expert-parallel experts: each rank holds its experts' part of lora_A / lora_B
    parts = {id(w): (m, a, which) for _, m in ep_modules(model)
             for a in (getattr(m, "lora_adapters", None) or {}).values()
             for which, w in (("lora_A", a.lora_A.weight), ("lora_B", a.lora_B.weight))}
    out = {}
    for name, prm in named.items():
        if prm.grad is None:
            continue
        g = prm.grad
        if id(prm) in ep:  # expert-parallel: every EP rank's experts (a collective of the EP group, and of edp)
            g = gather_experts(ep[id(prm)], g)
        elif hasattr(g, "full_tensor"):
            g = g.full_tensor()
        elif id(prm) in parts:  # an expert adapter's part: the whole tensor in PEFT's layout (a collective)
            m, a, which = parts[id(prm)]
            g = gather_adapter(m, a, which, g)
        out[name] = g
    return out
