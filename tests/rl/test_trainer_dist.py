"""``longstraw train`` on several gloo ranks against one process, float64, the same global batch.

The runs (built-in tiny-dense model in float64, 2 prompts per step, 3 steps, a checkpoint after every step):

* one process (no torchrun environment);
* 4 ranks: 2 data-parallel replicas x 2 context-parallel ranks, FSDP2 over all 4 (``python -m longstraw train`` as
  plain processes with torchrun's environment, as ``tests/distributed/cp_launcher.py`` does).

Sampling seeds come from ``(train.seed, step, prompt index)``, so each prompt's responses are the same whichever
replica takes it; CP rank 0 samples for its group. Responses stop at any lowercase letter (their lengths differ, so
the token-mean loss is not zero), and the reward (``rw.py`` below) is constant for prompts with an odd answer: with
``data.seed = 1`` step 1 has one group with zero advantages (that replica back-propagates it anyway, so that both
make the same engine calls), step 2 two active groups, step 3 none (no optimiser step).

Checked: metrics (loss, rewards, gradient norm, ...) and final weights of the 4-rank run equal the one-process run's
to 1e-8 relative; a 4-rank run killed during its second checkpoint and resumed continues bit for bit; a 2-rank job
(with and without FSDP) and one process resume from the 4-rank sharded checkpoint within float precision; an FSDP model's HF export loads
in transformers with the sharded model's logits; an HSDP run (replicate = 2) equals one process and resumes, in its
layout bit for bit, in another within float precision; bad ``[parallel]`` values are one line; two "nodes" of two ranks
each under torchrun with a c10d rendezvous train and rank 0 writes the metrics; expert parallelism (the built-in MoE,
expert adapters, GPT-OSS's biased experts, query adapters on the DeltaNet + MoE hybrid under CP) and GPT-OSS under
context parallelism with kept prompt-step graphs equal one process.
"""

import fcntl
import json
import shutil
import sys
from pathlib import Path

import pytest
import torch
from dist_launch import free_port, launch, run_commands, train
from safetensors.torch import load_file

from longstraw.checkpoint.training import checkpoint_dirs
from longstraw.rl.runlog import read_metrics

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

REWARD = '''def fn(response, answer, **meta):
    if int(answer) % 2:
        return 0.5  # the same for every response: the group's advantages are all zero
    return (sum(response.encode("utf-8", "replace")) % 13) / 12.0
'''
LETTERS = "[" + ",".join(f'"{c}"' for c in "abcdefghijklmnopqrstuvwxyz") + "]"
SETS = ['model.builtin="tiny-dense"', 'model.dtype="float64"', "data.prompt_len=96", "data.max_prompt_len=128",
        "data.seed=1", "rollout.group_size=4", "rollout.max_new_tokens=6", f"rollout.stop_strings={LETTERS}",
        "algorithm.prefill_chunk=16", "algorithm.prompts_per_step=2", "optim.lr=1e-2", "optim.warmup_steps=1",
        "train.steps=3", "train.save_every=1", "train.keep_last=3", "train.progress=false", "train.plots=false",
        "train.tensorboard=false", 'train.memory_check="off"']
# what a run's layout changes without changing what it computes: wall times, memory, per-rank state bytes
VOLATILE = {"rollout_s", "train_s", "step_s", "peak_memory_bytes", "train_peak_bytes", "peak_above_start_bytes",
            "prompt_state_bytes"}


def _args(out: Path, *extra: str) -> list[str]:
    return [x for s in SETS + [f'reward.fn="{out.parent / "rw.py"}:fn"', f'train.out_dir="{out}"', *extra]
            for x in ("--set", s)]


def _ok(ranks, what):
    bad = [(i, r.returncode, r.stderr[-3000:]) for i, r in enumerate(ranks) if r.returncode != 0]
    assert not bad, f"{what}: {bad}"


def _weights(run: Path) -> dict:
    model = checkpoint_dirs(run)[-1] / "model"
    out = {}
    for f in model.glob("*.safetensors"):
        out.update(load_file(f))
    return out


def _stable(rows):
    return [{k: v for k, v in r.items() if k not in VOLATILE} for r in rows]


def _close(got: list[dict], want: list[dict], rel: float = 1e-8, abs_: float = 1e-13) -> None:
    assert len(got) == len(want)
    for g, w in zip(_stable(got), _stable(want)):
        assert g.keys() == w.keys()
        for k, v in w.items():
            if isinstance(v, float):
                assert abs(g[k] - v) <= rel * abs(v) + abs_, (w["step"], k, g[k], v)
            else:
                assert g[k] == v, (w["step"], k, g[k], v)


def _close_weights(got: dict, want: dict, rel: float = 1e-8) -> None:
    assert got.keys() == want.keys()
    for k in want:
        err = (got[k] - want[k]).abs().max().item()
        assert err <= rel * want[k].abs().max().item(), (k, err)


def _close_run(got: Path, want: Path) -> None:
    """Run ``got`` equals run ``want`` within float precision: metrics and final weights."""
    _close(read_metrics(got), read_metrics(want))
    _close_weights(_weights(got), _weights(want))


def _same_run(got: Path, want: Path) -> None:
    """Run ``got`` equals run ``want`` bit for bit: metrics (but wall times and memory) and final weights."""
    assert _stable(read_metrics(got)) == _stable(read_metrics(want))
    a, b = _weights(got), _weights(want)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _resumed(src: Path, dst: Path, world: int, sets: list[str], what: str) -> Path:
    """Run ``src`` copied to ``dst`` with only its first checkpoint kept, resumed there on ``world`` ranks (0: one
    process) with ``--set`` for each of ``sets``; returns ``dst``."""
    shutil.copytree(src, dst)
    for c in checkpoint_dirs(dst)[1:]:
        shutil.rmtree(c)
    _ok(train(world, ["--resume", str(dst), *[x for s in sets for x in ("--set", s)]]), what)
    return dst


@pytest.fixture(scope="module")
def runs(tmp_path_factory, worker_id):
    """The one-process and the 4-rank run, made once per session even when the tests of this module land on
    several xdist workers (``--dist loadgroup`` does not keep them together with pytest 9: xdist 3.8 renames
    ``item._nodeid``, which pytest 9 no longer reads): the first worker runs them under a lock, the others reuse."""
    base = tmp_path_factory.getbasetemp()
    shared = base.parent if worker_id != "master" else base
    root = shared / "train-dist"
    with open(shared / "train-dist.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (root / "done.json").exists():
            shutil.rmtree(root, ignore_errors=True)
            root.mkdir()
            (root / "rw.py").write_text(REWARD)
            _ok(train(0, _args(root / "one")), "one process")
            four_ranks = train(4, _args(root / "four", "parallel.cp=2"))
            _ok(four_ranks, "4 ranks")
            (root / "done.json").write_text(json.dumps([r.stdout for r in four_ranks]))
    return root, root / "one", root / "four", json.loads((root / "done.json").read_text())


def test_four_ranks_give_the_one_process_metrics_and_weights(runs):
    _, one, four, stdouts = runs
    a, b = read_metrics(one), read_metrics(four)
    assert [r["active_groups"] for r in a] == [1, 2, 0]  # step 1: one replica runs a zero-advantage group
    assert all(r["reward_std"] > 0 for r in a[:2]) and a[0]["loss"] != 0 and a[0]["grad_norm"] > 0
    _close(b, a)
    _close_weights(_weights(four), _weights(one))
    # rank 0 speaks for the job; every checkpoint is sharded, with the HF export beside it
    assert "done: 3 steps" in stdouts[0] and not any("done" in out for out in stdouts[1:])
    ckpt = checkpoint_dirs(four)[-1]
    assert sorted(f.name for f in (ckpt / "sharded").iterdir()) == [".metadata"] + [f"__{r}_0.distcp" for r in
                                                                                    range(4)]
    st = torch.load(ckpt / "trainer.pt", weights_only=True)
    assert st["format"] == "sharded" and len(st["rng_ranks"]) == 4 and "optimizer" not in st
    index = json.loads((ckpt / "model" / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) == 4  # one file per rank here (a tiny model)
    import longstraw

    model = longstraw.load_model(ckpt / "model")  # what `longstraw generate --model` reads
    assert model.hf_config["model_type"] == "llama"


def test_killed_mid_checkpoint_then_resumed_on_four_ranks_continues_bit_for_bit(runs, tmp_path):
    root, _, four, _ = runs
    shutil.copy(root / "rw.py", tmp_path / "rw.py")
    run = tmp_path / "killed"
    killed = train(4, _args(run, "parallel.cp=2"), env={"LONGSTRAW_FAULT": "kill-during-save:2"})
    assert [r.returncode for r in killed] == [-9] * 4, [r.stderr[-2000:] for r in killed]
    assert [c.name for c in checkpoint_dirs(run)] == ["step-00000001"]  # the last complete one survives
    assert list((run / "checkpoints").glob(".tmp-*"))  # the torn one stays a temp dir
    _ok(launch(4, ["-m", "longstraw", "train", "--resume", str(run)]), "resume on 4 ranks")
    _same_run(run, four)
    assert not list((run / "checkpoints").glob(".tmp-*"))


def test_resume_from_a_four_rank_checkpoint_on_two_ranks_and_in_one_process(runs, tmp_path):
    _, _, four, _ = runs
    # 2 ranks: 2 replicas of one rank each, FSDP over 2; the same without FSDP (every rank holds the whole model,
    # the replicas' gradients averaged; its checkpoints in the one-process format); one process
    for name, world, extra in (("two", 2, []), ("two-whole", 2, ["parallel.fsdp=false"]), ("single", 0, [])):
        run = _resumed(four, tmp_path / f"from-four-{name}", world, ["parallel.cp=1", *extra], f"resume {name}")
        _close_run(run, four)


def test_host_optimizer_state_on_two_ranks_gives_the_one_process_run(runs, tmp_path):
    """optim.offload = "moments": AdamW's moments of each rank's FSDP shards in host memory, checkpointed sharded."""
    root, one, _, _ = runs
    shutil.copy(root / "rw.py", tmp_path / "rw.py")
    run = tmp_path / "offload"
    _ok(train(2, _args(run, "parallel.cp=1", 'optim.offload="moments"')), "offload on 2 ranks")
    _close_run(run, one)
    assert (checkpoint_dirs(run)[-1] / "sharded" / ".metadata").exists()


def test_lora_on_four_ranks_gives_the_one_process_run(runs, tmp_path):
    """[lora] under torchrun (2 replicas x 2 CP, FSDP2 sharding the frozen base and the adapters): the metrics and
    the adapters equal a one-process LoRA run; checkpoints hold the sharded adapter state and adapter/ (PEFT)."""
    root = runs[0]
    shutil.copy(root / "rw.py", tmp_path / "rw.py")
    lora = ["lora.rank=4", "lora.alpha=8", 'lora.modules_to_save=["norm"]']
    _ok(train(0, _args(tmp_path / "one", *lora)), "LoRA, one process")
    _ok(train(4, _args(tmp_path / "four", "parallel.cp=2", *lora)), "LoRA, 4 ranks")
    _close(read_metrics(tmp_path / "four"), read_metrics(tmp_path / "one"))
    adapters = []
    for run in ("one", "four"):
        ckpt = checkpoint_dirs(tmp_path / run)[-1]
        assert not (ckpt / "model").exists()
        adapters.append(load_file(ckpt / "adapter" / "adapter_model.safetensors"))
    _close_weights(adapters[1], adapters[0])
    assert any(k.endswith("lora_B.weight") and v.abs().max() > 0 for k, v in adapters[0].items())
    assert "base_model.model.model.norm.weight" in adapters[0]
    # resumed from the 4-rank checkpoint of step 2 on 2 ranks (DCP reshards the adapters and their AdamW state)
    run = tmp_path / "resumed"
    shutil.copytree(tmp_path / "four", run)
    shutil.rmtree(checkpoint_dirs(run)[-1])
    _ok(train(2, ["--resume", str(run), "--set", "parallel.cp=1"]), "LoRA resumed on 2 ranks")
    _close(read_metrics(run), read_metrics(tmp_path / "one"))
    _close_weights(load_file(checkpoint_dirs(run)[-1] / "adapter" / "adapter_model.safetensors"), adapters[0])


def test_hsdp_run_gives_the_one_process_run_and_resumes(runs, tmp_path):
    """parallel.replicate = 2 (HSDP: the parameters sharded over each half of the job, replicated across the
    halves) x cp = 2 on 4 ranks: the one-process metrics and weights; resumed from its step-1 checkpoint in the same
    layout, bit for bit; and in another (2 ranks, FSDP over both), within float precision."""
    root, one, _, _ = runs
    shutil.copy(root / "rw.py", tmp_path / "rw.py")
    hsdp = tmp_path / "hsdp"
    _ok(train(4, _args(hsdp, "parallel.cp=2", "parallel.replicate=2")), "HSDP on 4 ranks")
    _close_run(hsdp, one)
    same = _resumed(hsdp, tmp_path / "resumed-same", 4, ["parallel.cp=2", "parallel.replicate=2"], "HSDP resumed")
    _same_run(same, hsdp)
    two = _resumed(hsdp, tmp_path / "resumed-two", 2, ["parallel.cp=1", "parallel.replicate=1"], "HSDP on 2 ranks")
    _close_run(two, one)


def test_bf16_sharded_checkpoint_exports_bf16_and_resumes_from_its_masters(tmp_path):
    """A bf16 run on 2 ranks (float32 master shards): the checkpoint's HF export (model/, for serving) is bf16, its
    DCP state keeps the float32 masters, and a resume from step 1 reaches step 2's checkpoint bit for bit."""
    (tmp_path / "rw.py").write_text(REWARD)
    run = tmp_path / "bf16"
    args = _args(run, "parallel.cp=1", 'model.dtype="bfloat16"', "train.steps=2")
    _ok(train(2, args), "bf16 on 2 ranks")
    export = checkpoint_dirs(run)[-1] / "model"
    assert json.loads((export / "config.json").read_text())["dtype"] == "bfloat16"
    assert {t.dtype for t in _weights(run).values()} == {torch.bfloat16}
    _same_run(_resumed(run, tmp_path / "resumed", 2, [], "bf16 resumed"), run)


def test_bad_parallel_values_are_one_line_from_rank_zero(tmp_path):
    (tmp_path / "rw.py").write_text(REWARD)
    for extra, want in ((["parallel.cp=3"], "parallel.cp=3 does not divide the job's 2 ranks; allowed: 1, 2"),
                        (["parallel.cp=1", "algorithm.prompts_per_step=3"],
                         "algorithm.prompts_per_step=3 does not split evenly over the 2 data-parallel replicas "
                         "(world 2 / parallel.cp=1); make it a multiple of 2 (or raise parallel.cp)")):
        ranks = train(2, _args(tmp_path / "run", *extra))
        assert [r.returncode for r in ranks] == [2, 2]
        assert ranks[0].stderr.strip() == f"longstraw: error: {want}"
        assert "error" not in ranks[1].stderr
        assert not (tmp_path / "run").exists()


def test_two_nodes_under_torchrun(tmp_path):
    """Two torchrun invocations as two "nodes" of two ranks on 127.0.0.1, a c10d rendezvous; replicate = 2 nodes
    (HSDP: parameters sharded within a node, replicated across them), cp = 2."""
    (tmp_path / "rw.py").write_text(REWARD)
    run = tmp_path / "run"
    port = free_port()
    args = _args(run, "parallel.cp=2", "parallel.replicate=2", "train.steps=2")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc_per_node", "2",
           "--rdzv_backend", "c10d", "--rdzv_endpoint", f"127.0.0.1:{port}", "--rdzv_id", "two-nodes",
           "-m", "longstraw", "train", *args]
    nodes = run_commands([cmd[:5] + ["--node_rank", str(n)] + cmd[5:] for n in (0, 1)], timeout_s=400)
    _ok(nodes, "two nodes")
    assert sum("done: 2 steps" in n.stdout for n in nodes) == 1  # rank 0 (on whichever node) reports
    assert [r["step"] for r in read_metrics(run)] == [1, 2]
    assert [c.name for c in checkpoint_dirs(run)] == ["step-00000001", "step-00000002"]


def test_expert_parallel_run_gives_the_one_process_run_and_resumes_in_other_layouts(tmp_path):
    """parallel.ep: the built-in MoE model (8 routed experts per layer) on 4 ranks, 2 replicas x 2 CP, experts split
    over 2 (4 per EP rank, tokens moved by all-to-all) and each block FSDP-sharded over the 2 ranks holding it: the
    metrics (expert load included: summed over the ranks, it is the work of the job) and weights equal a one-process
    run; its sharded checkpoint stores each expert once (DTensors on the (ep, edp) mesh) and resumes on 2 ranks with
    ep=2 (blocks whole), on 4 with ep=4 and with ep=2 and ep_shard = false (blocks replicated over their 2 ranks),
    and in one process; the one-process run's checkpoint (its full optimiser
    state, cut to each rank's experts and to its shard of them) resumes on 4 ranks with ep=2."""
    (tmp_path / "rw.py").write_text(REWARD)
    moe = ['model.builtin="tiny-moe"']
    _ok(train(0, _args(tmp_path / "one", *moe)), "MoE, one process")
    _ok(train(4, _args(tmp_path / "four", *moe, "parallel.cp=2", "parallel.ep=2")), "MoE, 4 ranks, ep=2")
    one, four = read_metrics(tmp_path / "one"), read_metrics(tmp_path / "four")
    # the expert load counts the routed slots each process computed: CP splits the prompt, not the work
    assert all(r["expert_load_max_over_mean"] > 1 for r in one)
    _close([{k: v for k, v in r.items() if not k.startswith("expert_")} for r in four],
           [{k: v for k, v in r.items() if not k.startswith("expert_")} for r in one])
    _close_weights(_weights(tmp_path / "four"), _weights(tmp_path / "one"))
    for src, name, world, extra in (("four", "two-ep2", 2, ["parallel.cp=1", "parallel.ep=2"]),
                                    ("four", "four-ep4", 4, ["parallel.cp=2", "parallel.ep=4"]),
                                    ("four", "four-ep2-replicated", 4, ["parallel.cp=2", "parallel.ep=2",
                                                                        "parallel.ep_shard=false"]),
                                    ("four", "single", 0, ["parallel.cp=1", "parallel.ep=1"]),
                                    ("one", "one-ep2", 4, ["parallel.cp=2", "parallel.ep=2"])):  # its full state cut
        # to each rank's block, then to its FSDP shard of it
        run = _resumed(tmp_path / src, tmp_path / f"from-{src}-{name}", world, extra, f"MoE resume {name}")
        _close([{k: v for k, v in r.items() if not k.startswith("expert_")} for r in read_metrics(run)],
               [{k: v for k, v in r.items() if not k.startswith("expert_")} for r in one])
        _close_weights(_weights(run), _weights(tmp_path / "one"))


def test_expert_adapters_under_expert_parallelism_give_the_one_process_run_and_resume_in_other_layouts(tmp_path):
    """lora.target_parameters (adapters on every routed expert's fused weights, and on q_proj) with parallel.ep = 2
    on 2 ranks (2 replicas, the experts split over both): metrics and adapters equal a one-process run. Its sharded
    checkpoints hold each expert's adapter and AdamW moments once (``lora_B`` as [out, r, experts]: a rank's experts
    are a block of that layout only), and resume on 2 ranks with ep = 2 (bit for bit), in one process, and on 2 ranks
    without EP; the one-process run's checkpoint (full optimiser state) resumes on 2 ranks with ep = 2."""
    (tmp_path / "rw.py").write_text(REWARD)
    lora = ['model.builtin="tiny-moe"', "lora.rank=4", "lora.alpha=8", 'lora.target_modules=["q_proj"]',
            'lora.target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]']
    ep2 = ["parallel.cp=1", "parallel.ep=2"]
    _ok(train(0, _args(tmp_path / "one", *lora)), "expert LoRA, one process")
    _ok(train(2, _args(tmp_path / "ep2", *lora, *ep2)), "expert LoRA, 2 ranks, ep=2")

    def same_as_one(run: Path) -> None:
        strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith("expert_")} for r in rows]  # noqa
        _close(strip(read_metrics(run)), strip(read_metrics(tmp_path / "one")))
        got, want = (load_file(checkpoint_dirs(r)[-1] / "adapter" / "adapter_model.safetensors")
                     for r in (run, tmp_path / "one"))
        _close_weights(got, want)

    same_as_one(tmp_path / "ep2")
    adapters = load_file(checkpoint_dirs(tmp_path / "one")[-1] / "adapter" / "adapter_model.safetensors")
    assert any(".experts.base_layer.lora_B" in k or "experts.lora_B" in k for k in adapters), sorted(adapters)[:4]
    assert all(v.abs().max() > 0 for k, v in adapters.items() if "lora_B" in k)  # every adapter was trained
    ckpt = checkpoint_dirs(tmp_path / "ep2")[0] / "sharded"
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(ckpt).read_metadata().state_dict_metadata
    b = [k for k in meta if k.startswith("model.") and "lora_adapters" in k and k.endswith("lora_B.weight")]
    assert b and all(len(meta[k].size) == 3 and meta[k].size[2] == 8 for k in b), b  # [out, r, all 8 experts]
    assert all(f"optimizer.state.{k[len('model.'):]}.exp_avg" in meta for k in b)
    same = _resumed(tmp_path / "ep2", tmp_path / "ep2-again", 2, ep2, "resumed with ep=2")
    assert _stable(read_metrics(same)) == _stable(read_metrics(tmp_path / "ep2"))
    assert all(torch.equal(v, load_file(checkpoint_dirs(tmp_path / "ep2")[-1] / "adapter" /
                                        "adapter_model.safetensors")[k])
               for k, v in load_file(checkpoint_dirs(same)[-1] / "adapter" / "adapter_model.safetensors").items())
    for name, world, extra in (("single", 0, ["parallel.ep=1"]), ("fsdp", 2, ["parallel.ep=1"])):
        same_as_one(_resumed(tmp_path / "ep2", tmp_path / f"ep2-{name}", world, extra, f"resumed: {name}"))
    same_as_one(_resumed(tmp_path / "one", tmp_path / "one-ep2", 2, ep2, "one-process checkpoint, ep=2"))


def test_query_adapters_on_the_hybrid_moe_under_context_and_expert_parallelism_give_the_one_process_run(tmp_path):
    """LoRA on q_proj alone (the full-attention layer on top) of the built-in DeltaNet + MoE hybrid, 2 ranks with
    cp = 2 and ep = 2: the frozen DeltaNet and MoE layers below have no gradient to compute on the rank holding the
    prompt's first piece, but the DeltaNet scan's gathers and the experts' exchanges need it in every backward (a
    regression: this run hung in the first update's reverse pass). Metrics and adapters equal one process's, also
    when the updates prefill again keeping prompt-step graphs (the DeltaNet scan's kept steps under CP)."""
    (tmp_path / "rw.py").write_text(REWARD)
    lora = ['model.builtin="tiny-moe"', "lora.rank=4", "lora.alpha=8", 'lora.target_modules=["q_proj"]']
    par = ["parallel.cp=2", "parallel.ep=2"]
    kept = ['algorithm.graph_budget="1G"', "algorithm.reuse_rollout_state=false"]
    _ok(train(0, _args(tmp_path / "one", *lora)), "query LoRA, one process")
    _ok(train(2, _args(tmp_path / "two", *lora, *par), timeout_s=300), "query LoRA, cp=2, ep=2")
    _ok(train(2, _args(tmp_path / "kept", *lora, *par, *kept), timeout_s=300), "query LoRA, cp=2, ep=2, kept")
    assert any(r.get("kept_steps", 0) > 0 for r in read_metrics(tmp_path / "kept"))
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("expert_", "kept_", "step_graph"))}  # noqa
                          for r in rows]
    assert any(r.get("grad_norm", 0) > 0 for r in read_metrics(tmp_path / "one"))
    for run in ("two", "kept"):
        _close(strip(read_metrics(tmp_path / run)), strip(read_metrics(tmp_path / "one")))
        got, want = (load_file(checkpoint_dirs(r)[-1] / "adapter" / "adapter_model.safetensors")
                     for r in (tmp_path / run, tmp_path / "one"))
        _close_weights(got, want)


def _tiny_gpt_oss(directory: Path) -> Path:
    """A float64 GPT-OSS checkpoint (attention sinks on every layer, sliding windows of 8 on the even layers, 4
    biased experts) with the built-in byte tokenizer."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    try:
        from hf_reference import tiny_moe_hf
    finally:
        sys.path.pop(0)
    from transformers import GptOssConfig

    from longstraw.tokenizer import ByteTokenizer

    hf = tiny_moe_hf(GptOssConfig(vocab_size=259, hidden_size=32, intermediate_size=16, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_local_experts=4,
                                  num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
                                  pad_token_id=258, eos_token_id=257, bos_token_id=256), seed=5, attn="eager")
    hf.to(torch.float64).save_pretrained(directory)
    ByteTokenizer().save(directory)
    return directory


def test_gpt_oss_under_context_and_expert_parallelism_gives_the_one_process_run(tmp_path):
    """GPT-OSS on 2 ranks, its 96-token prompts several windows long: cp = 2 under FSDP keeping prompt-step graphs
    (``algorithm.graph_budget``: every rank on one prompt; the sliding layers' replicated tails, the halo exchange,
    the sinks merged over the group), and ep = 2 under FSDP (its biased experts split, 2 replicas): metrics and
    weights equal one process's, and the ep = 2 checkpoint resumes in one process."""
    (tmp_path / "rw.py").write_text(REWARD)
    ckpt = _tiny_gpt_oss(tmp_path / "gpt-oss")
    g = ['model.builtin=""', f'model.path="{ckpt}"', 'algorithm.graph_budget="1G"',
         "algorithm.reuse_rollout_state=false"]
    _ok(train(0, _args(tmp_path / "one", *g)), "GPT-OSS, one process")
    _ok(train(2, _args(tmp_path / "cp2", *g, "parallel.cp=2")), "GPT-OSS, cp=2 under FSDP")
    _ok(train(2, _args(tmp_path / "ep2", *g[:2], "parallel.cp=1", "parallel.ep=2")), "GPT-OSS, ep=2")
    one = read_metrics(tmp_path / "one")
    for run in ("one", "cp2"):  # the budget kept graphs (in the steps with active groups), under CP too
        assert any(r.get("kept_steps", 0) > 0 for r in read_metrics(tmp_path / run)), run
    strip = lambda rows: [{k: v for k, v in r.items() if not k.startswith(("expert_", "kept_", "step_graph"))}  # noqa
                          for r in rows]
    for run in ("cp2", "ep2"):
        _close(strip(read_metrics(tmp_path / run)), strip(one))
        _close_weights(_weights(tmp_path / run), _weights(tmp_path / "one"))
    run = _resumed(tmp_path / "ep2", tmp_path / "ep2-single", 0, ["parallel.ep=1"], "GPT-OSS ep=2 resumed alone")
    _close(strip(read_metrics(run)), strip(one))
    _close_weights(_weights(run), _weights(tmp_path / "one"))
