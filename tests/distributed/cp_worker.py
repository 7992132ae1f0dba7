"""One rank of a CP test job: ``python cp_worker.py SPEC.json`` with RANK / WORLD_SIZE / MASTER_* set.

SPEC: ``{"cp": R, "fsdp": bool, "paths": {family: checkpoint dir}, "scenarios": [names], "out": dir}``.
Checks the init errors that need a process-group environment, runs the scenarios and saves
``{name: result or "error: ..."}`` to ``out/rank<R>.pt``.
"""

import json
import os
import sys
import traceback

import torch

torch.set_num_threads(1)
sys.path.insert(0, os.path.dirname(__file__))
sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))  # tests/: sink_guard

import cp_scenarios  # noqa: E402

import longstraw  # noqa: E402


def main(spec_path: str) -> None:
    spec = json.loads(open(spec_path).read())
    world = int(os.environ["WORLD_SIZE"])
    results = {"init_errors": {}}
    for bad in (0, 3 if world % 3 else 5):
        try:
            longstraw.init_distributed(cp=bad)
            results["init_errors"][bad] = "no error"
        except ValueError as e:
            results["init_errors"][bad] = str(e)
    if spec.get("ep", 1) > 1:
        results["init_errors"].update(cp_scenarios.ep_init_errors(spec["cp"], spec["ep"]))
    ctx = longstraw.init_distributed(cp=spec["cp"], fsdp=spec["fsdp"], replicate=spec.get("replicate", 1),
                                     ep=spec.get("ep", 1), ep_shard=spec.get("ep_shard", True),
                                     timeout_s=spec.get("timeout_s", 120))
    results["context"] = {"rank": ctx.rank, "cp_rank": ctx.cp_rank, "cp_size": ctx.cp_size, "dp_size": ctx.dp_size,
                          "replicate": ctx.replicate, "ep_size": ctx.ep_size, "ep_rank": ctx.ep_rank,
                          "longstraw": longstraw.__file__}
    for name in spec["scenarios"]:
        try:
            results[name] = cp_scenarios.SCENARIOS[name](spec["paths"])
        except Exception:  # reported to the test, which fails with the traceback
            results[name] = "error: " + traceback.format_exc()
            break  # the other ranks may be stuck in a collective: stop here
    torch.save(results, os.path.join(spec["out"], f"rank{ctx.rank}.pt"))
    longstraw.shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
