"""One rank of a sharded-loading job (cp_launcher.launch with this worker): ``python load_worker.py SPEC.json``
with RANK / WORLD_SIZE / MASTER_* set. SPEC as cp_worker.py's; runs ``load_scenarios.SCENARIOS`` in order (the
memory scenario first, so that nothing loaded before it) and saves ``{name: result or "error: ..."}`` to
``out/rank<R>.pt``."""

import json
import os
import sys
import traceback

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: hf_reference

import load_scenarios  # noqa: E402

import longstraw  # noqa: E402


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    ctx = longstraw.init_distributed(cp=spec["cp"], fsdp=spec["fsdp"], replicate=spec.get("replicate", 1),
                                     timeout_s=spec.get("timeout_s", 120))
    results = {"context": {"rank": ctx.rank, "world": ctx.world_size, "fsdp": ctx.fsdp}}
    for name in spec["scenarios"]:
        try:
            results[name] = load_scenarios.SCENARIOS[name](spec["paths"])
        except Exception:  # reported to the test, which fails with the traceback
            results[name] = "error: " + traceback.format_exc()
            break  # the other ranks may be stuck in a collective: stop here
    torch.save(results, os.path.join(spec["out"], f"rank{ctx.rank}.pt"))
    longstraw.shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
