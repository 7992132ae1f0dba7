"""One rank of the sharded-export test: ``python export_worker.py SPEC.json`` with torchrun's environment.

SPEC: ``{"models": {name: HF checkpoint dir}, "out": dir, "max_shard_size": bytes, "fail_rank": r}``. Each model is loaded with
FSDP2 over every rank (``init_distributed(fsdp=True)``; ``load_model`` shards it), its weights changed in place
(so the export cannot be a copy of the source files), its logits on a fixed batch computed by the sharded model
(every rank), and written with ``longstraw.save_model`` on every rank into ``out/<name>``. Rank 0 saves the logits
to ``out/<name>.logits.pt``; every rank saves the files it wrote to ``out/<name>.rank<R>.json``. Then the last model
is saved once more with rank ``fail_rank``'s writes failing (a full disk): each rank records what it raised in
``out/failed.rank<R>.txt``. Each model is also loaded with LoRA adapters (random ``B``) and written merged to
``out/<name>-merged`` and as a PEFT adapter to ``out/<name>-adapter`` (logits in ``out/<name>-lora.logits.pt``).
"""

import json
import os
import sys

import torch

torch.set_num_threads(1)

import longstraw  # noqa: E402
from longstraw.checkpoint import export  # noqa: E402
from longstraw.checkpoint.adapter import fill  # noqa: E402

WRITTEN: list[str] = []
_init = export.SafetensorsStream.__init__


def _recording_init(self, path, *args, **kwargs):
    WRITTEN.append(os.path.basename(str(path)))
    _init(self, path, *args, **kwargs)


export.SafetensorsStream.__init__ = _recording_init


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    ctx = longstraw.init_distributed(cp=1, fsdp=True, timeout_s=120)
    for name, path in spec["models"].items():
        model = longstraw.load_model(path, dtype="float64")
        with torch.no_grad():
            for i, p in enumerate(model.parameters()):
                p.mul_(1.0 + 0.01 * (i % 7))
        ids = torch.arange(3, 3 + 2 * 11).remainder(model.hf_config["vocab_size"]).view(2, 11)
        with torch.no_grad():
            logits = model(ids)
        out = os.path.join(spec["out"], name)
        WRITTEN.clear()
        longstraw.save_model(model, out, max_shard_size=spec["max_shard_size"])
        mine = list(WRITTEN)
        if ctx.rank == 0:
            torch.save({"ids": ids, "logits": logits}, out + ".logits.pt")
        with open(f"{out}.rank{ctx.rank}.json", "w") as f:
            json.dump({"files": sorted(mine)}, f)
        # the same model with LoRA adapters (added before sharding, by load_model): merged export and PEFT adapter,
        # both written from the shards
        lora = longstraw.load_model(path, dtype="float64", lora=dict(rank=4, alpha=8.0, target_modules="all-linear"),
                                    lora_seed=3)
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for n, p in sorted(lora.named_parameters()):
                if n.endswith("lora_B.weight"):
                    fill(p, 0.2 * torch.randn(tuple(p.shape), generator=gen, dtype=torch.float64))
            lora_logits = lora(ids)
        longstraw.save_model(lora, out + "-merged", max_shard_size=spec["max_shard_size"], merge_lora=True)
        longstraw.save_adapter(lora, out + "-adapter")
        if ctx.rank == 0:
            torch.save({"ids": ids, "logits": lora_logits}, out + "-lora.logits.pt")
    # a write that fails on one rank only (a full disk on its node): every rank raises the same error, none waits
    failing = spec["fail_rank"]

    def full_disk(self, name, t):
        raise OSError(28, "No space left on device", str(self.tmp))

    if ctx.rank == failing:
        export.SafetensorsStream.write = full_disk
    try:
        longstraw.save_model(model, os.path.join(spec["out"], "failed"), max_shard_size=spec["max_shard_size"])
        outcome = "no error"
    except ValueError as e:
        outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(spec["out"], f"failed.rank{ctx.rank}.txt"), "w") as f:
        f.write(outcome)
    longstraw.shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
