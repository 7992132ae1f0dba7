"""HF checkpoint directories in and out: ``load_model``, ``save_model``, ``hf_grads``.

A checkpoint directory holds ``config.json`` and ``model.safetensors`` (or shards listed by
``model.safetensors.index.json``). Loading builds the model on the meta device (no random init of billions of
parameters), materialises it on the target device and copies each tensor in as it is read, so peak host memory is
about one model plus one tensor. Pickled weights (``pytorch_model.bin``) are refused unless the caller passes
``allow_pickle=True``; even then they are read with ``torch.load(weights_only=True)``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from longstraw import distributed
from longstraw.models import registry
from longstraw.models.registry import family_for
from longstraw.models.transformer import CausalLM

_DTYPES = {"float32": torch.float32, "float64": torch.float64, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def parse_dtype(dtype: str | torch.dtype | None) -> torch.dtype | None:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in _DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {', '.join(_DTYPES)}")
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


def _weight_files(p: Path, allow_pickle: bool) -> tuple[str, list[Path]]:
    index = p / "model.safetensors.index.json"
    if index.is_file():
        wm = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({p / f for f in wm.values()})
        missing = [str(f.name) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{index.name} lists shards that are missing: {missing}")
        return "safetensors", files
    files = sorted(p.glob("*.safetensors"))
    if files:
        return "safetensors", files
    pickled = sorted(list(p.glob("pytorch_model*.bin")) + list(p.glob("*.pt")) + list(p.glob("*.pth")))
    if pickled:
        if not allow_pickle:
            raise ValueError(f"{str(p)!r} holds only pickled weights ({pickled[0].name}); pickles can run code, so "
                             "they are not loaded unless you pass allow_pickle=True (or convert to safetensors)")
        return "pickle", pickled
    raise ValueError(f"{str(p)!r} has no weights: expected model.safetensors, sharded *.safetensors with "
                     "model.safetensors.index.json, or (with allow_pickle=True) pytorch_model.bin")


def _config_dtype(cfg: dict) -> torch.dtype | None:
    name = cfg.get("dtype") or cfg.get("torch_dtype")
    return _DTYPES.get(name) if isinstance(name, str) else None


def _list(names, limit=20) -> str:
    names = sorted(names)
    more = f" ... and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def load_model(path: str | os.PathLike, dtype: str | torch.dtype | None = None,
               device: str | torch.device | None = None, *, allow_pickle: bool = False) -> CausalLM:
    """Load an HF checkpoint directory into a LongStraw model.

    dtype: parameter dtype (default: the config's ``dtype``/``torch_dtype``, else float32).
    device: where to put the parameters (default CPU).
    """
    p = Path(path)
    cfg = read_config(p)
    family = family_for(cfg.get("model_type"))
    kind, files = _weight_files(p, allow_pickle)
    dtype = parse_dtype(dtype) or _config_dtype(cfg) or torch.float32
    device = torch.device(device or "cpu")

    with torch.device("meta"):
        model = family.build(cfg)
    model = model.to(dtype).to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters())

    handles, tensors = {}, {}
    try:
        if kind == "safetensors":
            for f in files:
                h = handles[f] = safe_open(str(f), framework="pt", device="cpu")
                for n in h.keys():
                    tensors[n] = h
            read = lambda n: tensors[n].get_tensor(n)  # noqa: E731
        else:
            for f in files:
                sd = torch.load(f, map_location="cpu", weights_only=True)
                tensors.update(sd)
            read = tensors.__getitem__
        names = sorted(tensors)
        if model.spec.tie_word_embeddings:
            names = [n for n in names if n != "lm_head.weight"]
        wmap = family.weights(cfg)
        loaded = set()
        unexpected = []
        for pname, t in wmap.load_tensors(names, read):
            if pname not in params:
                unexpected.append(pname)
                continue
            target = params[pname]
            if tuple(t.shape) != tuple(target.shape):
                raise ValueError(f"shape mismatch for {pname}: checkpoint has {tuple(t.shape)}, the config implies "
                                 f"{tuple(target.shape)}")
            with torch.no_grad():
                target.copy_(t.to(dtype))
            loaded.add(pname)
        missing = set(params) - loaded
        if unexpected:
            raise ValueError(f"unexpected weights in {str(p)!r} for model_type {cfg['model_type']!r}: "
                             f"{_list(unexpected)}")
        if missing:
            raise ValueError(f"weights missing from {str(p)!r}: {_list(missing)}")
    finally:
        handles.clear()
    model.eval()
    return distributed.parallelize(model)  # FSDP2 over the CP group after init_distributed(fsdp=True), else as is


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
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def save_model(model: CausalLM, path: str | os.PathLike, *, max_shard_size: int | str = "5GB") -> None:
    """Write ``model`` as an HF checkpoint directory (config.json + safetensors, sharded above max_shard_size)."""
    p = Path(path)
    p.mkdir(parents=True, exist_ok=True)
    limit = _parse_size(max_shard_size)
    family = family_for(model.spec.model_type)
    wmap = family.weights(model.hf_config)
    named = [(n, t) for n, t in model.named_parameters()]
    if model.spec.tie_word_embeddings:
        named = [(n, t) for n, t in named if n != "lm_head.weight"]
    out = [(n, t.detach().to("cpu").contiguous()) for n, t in wmap.save_tensors(named)]

    shards: list[dict] = [{}]
    size = 0
    for n, t in out:
        nb = t.numel() * t.element_size()
        if shards[-1] and size + nb > limit:
            shards.append({})
            size = 0
        shards[-1][n] = t
        size += nb
    for old in list(p.glob("model*.safetensors")) + [p / "model.safetensors.index.json"]:
        if old.exists():
            old.unlink()
    if len(shards) == 1:
        _save_shard(shards[0], p / "model.safetensors")
    else:
        weight_map = {}
        for i, sh in enumerate(shards):
            fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
            _save_shard(sh, p / fname)
            weight_map.update({n: fname for n in sh})
        total = sum(t.numel() * t.element_size() for _, t in out)
        _atomic_write_text(p / "model.safetensors.index.json",
                           json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2))
    cfg = dict(model.hf_config)
    cfg.pop("torch_dtype", None)
    cfg["dtype"] = _dtype_name(next(model.parameters()).dtype)
    _atomic_write_text(p / "config.json", json.dumps(cfg, indent=2, sort_keys=True) + "\n")


def _save_shard(tensors: dict, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, path)


def hf_grads(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Current gradients as full tensors under the names of transformers' in-memory model.

    Sharded (DTensor) gradients are gathered; parameters without a gradient are left out.
    """
    target = model
    spec = getattr(target, "spec", None)
    if spec is None:
        raise ValueError(f"hf_grads needs a LongStraw model, got {type(model).__name__}")
    wmap = family_for(spec.model_type).weights(target.hf_config)
    out = {}
    for name, prm in target.named_parameters():
        if prm.grad is None:
            continue
        g = prm.grad
        if hasattr(g, "full_tensor"):
            g = g.full_tensor()
        out[wmap.hf_name(name)] = g
    return out
