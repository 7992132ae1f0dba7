"""``[parallel]`` without torchrun, the layout checks in the config's terms, and the export plan (no processes
launched: the runs on several ranks are in test_trainer_dist.py, slow)."""

import pytest
import torch
from safetensors.torch import load_file

from longstraw.checkpoint.export import Entry, SafetensorsStream, plan_export
from longstraw.models.weights import WeightMap
from longstraw.rl.config import RunConfig, apply_overrides
from longstraw.rl.job import Job, check_parallel
from longstraw.rl.trainer import Trainer

TINY = ['model.builtin="tiny-dense"', "data.prompt_len=64", "data.max_prompt_len=128", "rollout.group_size=2",
        "rollout.max_new_tokens=2", "algorithm.prefill_chunk=32", "train.steps=1", "train.progress=false",
        "train.plots=false", "train.tensorboard=false", 'train.memory_check="off"']


@pytest.fixture
def no_torchrun(monkeypatch):
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(k, raising=False)


def test_without_torchrun_only_the_defaults_run(tmp_path, no_torchrun):
    for bad, names in ((["parallel.cp=2"], "parallel.cp=2"),
                       (["parallel.replicate=2"], "parallel.replicate=2"),
                       (["parallel.cp=4", "parallel.replicate=2"], "parallel.cp=4 and parallel.replicate=2")):
        cfg = apply_overrides(RunConfig(), TINY + [f'train.out_dir="{tmp_path / "run"}"'] + bad)
        with pytest.raises(ValueError, match=rf"^{names} need a job of several ranks, but there is no "
                                             r"torch.distributed environment \(RANK, WORLD_SIZE, MASTER_ADDR, "
                                             r"MASTER_PORT are not set\); launch with `torchrun --nproc_per_node N "
                                             r"-m longstraw train --config run.toml` \(N a multiple of parallel.cp\), "
                                             r"or set them to 1$"):
            Trainer(cfg)
        assert not (tmp_path / "run").exists()
    # fsdp = false is what one process does anyway; fsdp = true (the default) is simply off
    cfg = apply_overrides(RunConfig(), TINY + [f'train.out_dir="{tmp_path / "run"}"', "parallel.fsdp=false"])
    t = Trainer(cfg, echo=lambda *_: None)
    assert t.job.world == 1 and not t.job.sharded and t.job.ctx is None
    t.train()


def test_parallel_values_are_checked_in_the_configs_terms():
    for bad, msg in (("parallel.cp=0", "parallel.cp=0 must be >= 1"),
                     ("parallel.replicate=0", "parallel.replicate=0 must be >= 1"),
                     ("parallel.cp=true", "parallel.cp=True must be an integer")):
        with pytest.raises(ValueError, match=msg):
            apply_overrides(RunConfig(), [bad])
    with pytest.raises(ValueError, match=r"parallel.replicate=2 needs parallel.fsdp = true"):
        apply_overrides(RunConfig(), ["parallel.replicate=2", "parallel.fsdp=false"])
    with pytest.raises(ValueError, match=r"unknown key parallel.cpp; did you mean 'cp'\?"):
        apply_overrides(RunConfig(), ["parallel.cpp=2"])

    def cfg(*sets):
        return apply_overrides(RunConfig(), list(sets))

    check_parallel(cfg("parallel.cp=2", "algorithm.prompts_per_step=4"), 8, True)  # 4 replicas, 1 prompt each
    for c, world, msg in (
            (cfg("parallel.cp=3"), 4, r"^parallel.cp=3 does not divide the job's 4 ranks; allowed: 1, 2, 4$"),
            (cfg("parallel.cp=2", "parallel.replicate=3"), 8,
             r"^parallel.replicate=3 does not divide the 4 data-parallel replicas \(world 8 / parallel.cp=2\); "
             r"allowed: 1, 2, 4$"),
            (cfg("parallel.cp=1", "algorithm.prompts_per_step=3"), 2,
             r"^algorithm.prompts_per_step=3 does not split evenly over the 2 data-parallel replicas \(world 2 / "
             r"parallel.cp=1\); make it a multiple of 2 \(or raise parallel.cp\)$"),
            (cfg("parallel.cp=2"), 1, r"^parallel.cp=2 need a job of several ranks, but this job has one process"),
            (cfg("parallel.replicate=2"), 2,  # (a 4-rank HSDP run resumed on 2 ranks keeps its replicate)
             r"^parallel.replicate=2 leaves 1 rank per shard group \(world 2 / replicate\); HSDP shards over at "
             r"least 2: allowed 1$")):
        with pytest.raises(ValueError, match=msg):
            check_parallel(c, world, True)


def test_a_job_splits_a_steps_prompts_over_its_replicas():
    job = Job(rank=5, world=8, dp_rank=2, dp_size=4, cp_rank=1, cp_size=2)
    assert list(job.local_prompts(8)) == [4, 5] and not job.is_main and job.distributed
    assert list(Job().local_prompts(3)) == [0, 1, 2] and Job().gather("x") == ["x"] and Job().replicas(1) == [1]


def test_export_plan_gives_each_rank_a_contiguous_run_of_about_equal_bytes():
    named = [(f"w{i}", torch.empty(10, 10)) for i in range(9)] + [("b", torch.empty(10, dtype=torch.float64))]
    items, files = plan_export(named, WeightMap(), 3, 1000)
    assert items[0].index == 9  # larger elements first in the order: every tensor aligned in its file
    owners = [it.owner for it in items]
    assert owners == sorted(owners) and set(owners) == {0, 1, 2}
    sizes = [sum(o.nbytes for it in items if it.owner == r for o in it.outs) for r in range(3)]
    assert max(sizes) - min(sizes) <= 400 + 80
    assert all(sum(t.nbytes for t in f.tensors) <= 1000 or len(f.tensors) == 1 for f in files)
    assert [f.name for f in files] == [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    one_items, one_files = plan_export(named, WeightMap(), 1, 10**9)
    assert [f.name for f in one_files] == ["model.safetensors"] and {it.owner for it in one_items} == {0}


def test_safetensors_stream_writes_what_safetensors_reads(tmp_path):
    tensors = {"a": torch.randn(3, 5, dtype=torch.float64), "b": torch.randn(4, 2).to(torch.bfloat16),
               "c": torch.tensor(7), "d": torch.zeros(0, 3), "e": torch.tensor([True, False, True]),
               "f": torch.arange(6, dtype=torch.int32).view(2, 3).t()}  # non-contiguous: written row-major
    s = SafetensorsStream(tmp_path / "x.safetensors", [Entry(n, t.dtype, tuple(t.shape)) for n, t in tensors.items()])
    for n, t in tensors.items():
        s.write(n, t)
    s.close()
    got = load_file(tmp_path / "x.safetensors")
    assert got.keys() == tensors.keys() and all(torch.equal(got[n], t) for n, t in tensors.items())
    assert [p.name for p in tmp_path.iterdir()] == ["x.safetensors"]  # written under a temporary name, renamed
