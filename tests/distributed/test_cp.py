"""Context parallelism (and FSDP2) on 2 and 4 gloo ranks against the single-process run, float64.

Three jobs, each one launch of plain processes with torchrun's environment (cp_launcher.py), running many
scenarios per launch (cp_scenarios.py) to keep start-up cost low:

* 2 ranks, cp=2: every scenario (dense Llama and Qwen3 with tied embeddings, the Qwen3.5 DeltaNet hybrid; exact
  and detached; FSDP2 applied explicitly; checkpointed layers and batched branches; score; generate);
* 4 ranks, cp=4: the same on an oversubscribed machine (one thread per rank);
* 4 ranks, cp=2, ``init_distributed(fsdp=True)`` (FSDP2 applied by load_model, the user path): two data-parallel
  replicas of a 2-rank CP group (dense exact, hybrid exact and detached), their gradients summed.

One test per launch (so ``pytest -n 2`` never launches a job twice); each checks every scenario of its job and names
the scenario and rank in its failure message.
"""

import pytest
import torch
from cp_launcher import launch
from cp_scenarios import SCENARIOS, V
from hf_reference import save_tiny, tiny_hf
from transformers import LlamaConfig, Qwen3Config
from transformers.models.qwen3_5 import Qwen3_5TextConfig

import longstraw

pytestmark = pytest.mark.timeout(600)

ALL = ["exact", "detached", "exact_fsdp", "detached_fsdp", "qwen3_exact_ckpt", "qwen3_exact_fsdp",
       "hybrid_exact", "hybrid_detached", "hybrid_exact_fsdp_ckpt", "hybrid_generate", "score", "generate",
       "generate_fsdp", "state_bytes", "bad_inputs", "op_blocks", "low_precision"]
FOUR = ["exact", "detached", "exact_fsdp", "qwen3_exact_ckpt", "hybrid_exact", "hybrid_detached",
        "hybrid_exact_fsdp_ckpt", "score", "generate", "state_bytes", "bad_inputs", "op_blocks"]
DP = ["exact", "hybrid_exact", "dp_sum", "hybrid_dp_sum_detached"]
JOBS = {"cp2": (2, 2, False, ALL), "cp4": (4, 4, False, FOUR), "dp2xcp2_fsdp": (4, 2, True, DP)}
GRAD_SCENARIOS = [s for s in ALL + DP
                  if s not in ("score", "state_bytes", "bad_inputs", "op_blocks", "low_precision")]


@pytest.fixture(scope="module")
def paths():
    llama = LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=V, max_position_embeddings=512, rope_theta=1000.0)
    qwen3 = Qwen3Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=1, head_dim=12, vocab_size=V, max_position_embeddings=512,
                        tie_word_embeddings=True)
    hybrid = Qwen3_5TextConfig(hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
                               linear_value_head_dim=8, vocab_size=V, max_position_embeddings=512,
                               num_hidden_layers=3, intermediate_size=48, full_attention_interval=2)
    return {"llama": save_tiny(tiny_hf(llama, seed=11, init_std=0.15)),
            "qwen3": save_tiny(tiny_hf(qwen3, seed=12, init_std=0.15)),
            "hybrid": save_tiny(tiny_hf(hybrid, seed=31, init_std=0.15))}


@pytest.fixture(scope="module")
def single(paths):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = SCENARIOS[name](paths)
        return cache[name]

    return get


def _result(ranks, name):
    for r, res in enumerate(ranks):
        got = res[name]
        assert not isinstance(got, str), f"rank {r}, scenario {name}:\n{got}"
    return [res[name] for res in ranks]


def _assert_grads(got: dict, want: dict, where: str, rel: float = 1e-8) -> None:
    assert set(got) == set(want), f"{where}: {set(got) ^ set(want)}"
    for n, w in want.items():
        scale = w.abs().max().item()
        err = (got[n] - w).abs().max().item()
        r = err / scale if scale > 0 else err
        assert r <= rel, f"{where}: {n} relative error {r:.2e} > {rel:.0e}"


def check_gradients(ranks, single, job, name):
    """grpo_backward on every rank: .grad (after two accumulated groups), loss and log-probs as one process."""
    want = single(name)
    for r, got in enumerate(_result(ranks, name)):
        _assert_grads(got["grads"], want["grads"], f"{job} rank {r} {name}")
        for a, b in zip(got.get("loss", []), want.get("loss", [])):
            assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), (job, r, name, a, b)
        for a, b in zip(got.get("logprobs", []), want.get("logprobs", [])):
            a, b = (torch.cat(x) if isinstance(x, list) else x for x in (a, b))
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10, msg=f"{job} rank {r} {name}")
        sharded = got.get("sharded_params")
        if sharded is not None:  # FSDP2 really sharded the decoder layers (and only where asked)
            assert (sharded > 0) == ("fsdp" in name or JOBS[job][2]), (job, name, sharded)


def check_generate(ranks, single, name):
    """Sampled log-probs equal score of the samples; every rank and one process sample the same tokens."""
    want = single(name)
    ranks = _result(ranks, name)
    for got in ranks:
        for a, b in zip(got["logprobs"], got["score"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
        assert all(torch.equal(a, b) for a, b in zip(got["responses"], ranks[0]["responses"]))
        assert all(torch.equal(a, b) for a, b in zip(got["responses"], want["responses"]))
        for a, b in zip(got["logprobs"], want["logprobs"]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def check_score(ranks, single):
    want = single("score")
    for got in _result(ranks, "score"):
        for key in ("logprobs", "entropy"):
            for a, b in zip(got[key], want[key]):
                assert a.dtype == torch.float64 and a.shape == b.shape
                torch.testing.assert_close(a, b, rtol=0, atol=1e-10)


def check_state_bytes(ranks, single, job):
    """Each rank holds ~1/R of the single-process prompt state (PromptState.nbytes()); nothing twice."""
    world = JOBS[job][1]
    want = single("state_bytes")
    got = _result(ranks, "state_bytes")
    nbytes = [g["nbytes"] for g in got]
    assert sum(nbytes) == want["nbytes"]
    for r, b in enumerate(nbytes):
        assert abs(b - want["nbytes"] / world) <= 0.05 * want["nbytes"] / world, (r, b, want["nbytes"])
    print(f"\n{job}: single-process prompt state {want['nbytes']} B; per rank {nbytes} "
          f"(positions {[g['positions'] for g in got]} of {want['positions']})")


def check_op_blocks(ranks, single):
    """The attention op over a sharded K/V in blocks: output and dq on every rank, dK/dV of each rank's positions
    in its own sinks, the causal segment's dK/dV through autograd."""
    want = single("op_blocks")
    for got in _result(ranks, "op_blocks"):
        for key in ("out", "dq", "dkc", "dvc"):
            torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-12)
        pos = got["positions"]
        torch.testing.assert_close(got["dk"], want["dk"][:, :, pos], rtol=0, atol=1e-12)
        torch.testing.assert_close(got["dv"], want["dv"][:, :, pos], rtol=0, atol=1e-12)


def check_low_precision(ranks, single):
    """bf16: CP and one process round differently; their gradients agree to bf16 accuracy (measured ~1e-2)."""
    want = single("low_precision")
    for got in _result(ranks, "low_precision"):
        for dtype, w in want.items():
            num = sum(((got[dtype][n] - w[n]) ** 2).sum() for n in w)
            den = sum((w[n] ** 2).sum() for n in w)
            assert (num / den).sqrt() < 0.05, f"{dtype}: relative gradient difference {(num / den).sqrt():.3f}"


def check_bad_inputs(ranks, job):
    world = JOBS[job][1]
    for got in _result(ranks, "bad_inputs"):
        short = (f"the prompt is too short to shard: {world - 1} prefilled positions (the prompt without its last "
                 f"token) over cp={world} ranks")
        assert got["too_short_grpo"].startswith(short) and got["too_short_generate"].startswith(short)
        assert got["init_twice"].startswith(f"init_distributed was already called in this process (cp={world}")
        assert "must pass the same prompt and responses" in got["mismatch"]
    for res in ranks:
        errs = res["init_errors"]
        assert errs[0].startswith("cp=0 must be an integer >= 1")
        bad = 3 if world % 3 else 5
        allowed = ", ".join(str(d) for d in range(1, world + 1) if world % d == 0)
        assert errs[bad] == f"cp={bad} does not divide the world size {world}; allowed: {allowed}"


def _run_job(job, paths, single):
    world, cp, fsdp, names = JOBS[job]
    ranks = launch(world, cp=cp, paths=paths, scenarios=names, fsdp=fsdp)
    assert [r["context"]["cp_size"] for r in ranks] == [cp] * world
    for name in names:
        if name in GRAD_SCENARIOS:
            check_gradients(ranks, single, job, name)
        if "generate" in name:
            check_generate(ranks, single, name)
    checks = {"score": lambda: check_score(ranks, single), "state_bytes": lambda: check_state_bytes(ranks, single, job),
              "op_blocks": lambda: check_op_blocks(ranks, single), "bad_inputs": lambda: check_bad_inputs(ranks, job),
              "low_precision": lambda: check_low_precision(ranks, single)}
    for name, check in checks.items():
        if name in names:
            check()
    return ranks


def test_two_ranks(paths, single):
    _run_job("cp2", paths, single)


def test_four_ranks(paths, single):
    _run_job("cp4", paths, single)


def test_two_replicas_of_two_ranks_with_fsdp_from_init(paths, single):
    ranks = _run_job("dp2xcp2_fsdp", paths, single)
    assert [r["context"]["cp_rank"] for r in ranks] == [0, 1, 0, 1]
    assert [r["context"]["dp_size"] for r in ranks] == [2] * 4
    for r in _result(ranks, "exact"):
        assert r["sharded_params"] > 0  # load_model applied FSDP2 after init_distributed(fsdp=True)


def test_init_without_process_group_environment(monkeypatch):
    for var in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(var, raising=False)
    with pytest.raises(ValueError, match=r"init_distributed needs a torch.distributed environment, but RANK, "
                                         r"WORLD_SIZE, MASTER_ADDR, MASTER_PORT are not set; launch with `torchrun"):
        longstraw.init_distributed(cp=2)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="MASTER_ADDR, MASTER_PORT are not set"):
        longstraw.init_distributed(cp=2)
    for bad in (0, -1, 2.0, True, "2"):
        with pytest.raises(ValueError, match=rf"cp={bad!r} must be an integer >= 1"):
            longstraw.init_distributed(cp=bad)
    with pytest.raises(ValueError, match=r"backend='mpi' is not supported; allowed: None, 'gloo', 'nccl'"):
        longstraw.init_distributed(cp=1, backend="mpi")
    assert longstraw.distributed.get_context() is None


def test_layout_partitions_positions():
    from longstraw.distributed import shard_layout

    for n, world, chunk in [(97, 4, 8), (5, 4, 1), (4, 4, 100), (1000, 2, 7), (33, 3, 2)]:
        lay = shard_layout(n, world, chunk)
        seen = [p for st in lay.steps for s, e in st for p in range(s, e)]
        assert seen == list(range(n))  # steps and pieces in position order, each position once
        for st in lay.steps:
            assert all(e > s for s, e in st) and max(e - s for s, e in st) <= max(chunk, 2)
        sizes = [lay.local_size(r) for r in range(world)]
        assert max(sizes) - min(sizes) <= lay.num_steps
    with pytest.raises(ValueError, match="the prompt is too short to shard: 3 prefilled positions"):
        shard_layout(3, 4, 8)
