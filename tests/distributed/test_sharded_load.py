"""Sharded loading: each rank reads only the rows of each parameter it holds.

In the test process: which rows a placement gives a rank (``shard_rows`` against torch.chunk and DTensor's own
arithmetic), the weight maps' sliced reads (every row range, experts split anywhere, equal to the rows of the
whole-tensor load; only the rows' tensors read), and ``load_model`` without parallelism bit-identical to the
whole-tensor load it always did (float64, float32, bfloat16).

Under gloo (``load_scenarios.py`` on every rank of a job launched by ``cp_launcher.launch`` with
``load_worker.py``; slow): 2 ranks with ``cp=2`` and 4 with ``cp=1`` (``fsdp=True``): ``fully_shard`` on the meta
model leaves meta DTensors, each rank's local shards (every parameter, over all ranks) are the rows of the
single-process model, the reads were exactly those rows, ``grpo_backward`` gradients equal one process's (float64,
1e-10), the size check counts the rank's shard; 4 ranks with cp=2 and ``replicate=2`` (HSDP), and there with
FSDP2 swapped for other placements (only the layers over the ``(dp, cp)`` mesh; all 4 ranks on a mesh of its own):
the same rows, whatever the placement; and the per-rank peak resident memory of
``load_model`` on a 163 MiB float32 Llama is within the rank's shard plus its largest tensor plus 8 MiB (a
1-rank job gives the unsharded figure beside it). Print the figures with
``pytest -m slow -s -n 0 tests/distributed/test_sharded_load.py -k memory``.
"""

from __future__ import annotations

import re
from pathlib import Path

import load_scenarios
import pytest
import torch
from cp_launcher import launch
from load_scenarios import FAMILIES
from safetensors.torch import load_file
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import _StridedShard

import longstraw
from longstraw.checkpoint import hf
from longstraw.distributed.fsdp import shard_rows
from longstraw.models.registry import family_for

pytestmark = pytest.mark.timeout(600)

# ------------------------------------------------------------------------------------------------ in the process


def test_shard_rows_follow_torch_chunk_and_dtensor():
    for n in range(0, 23):
        for world in (1, 2, 3, 4, 5):
            got = [shard_rows(n, (world,), (r,), (Shard(0),)) for r in range(world)]
            chunks = [c.shape[0] for c in torch.chunk(torch.empty(n, 2), world)] if n else []
            chunks += [0] * (world - len(chunks))
            assert [b - a for a, b in got] == chunks, (n, world)  # torch.chunk's sizes, the empty ones last
            assert [r for a, b in got for r in range(a, b)] == list(range(n))  # in order, each row once
        for mesh, placements in [((2, 3), (Replicate(), Shard(0))), ((3, 2), (Shard(0), Replicate())),
                                 ((2, 2), (Shard(0), Shard(0))), ((2, 3), (Shard(0), Shard(0))),
                                 ((3,), (Replicate(),)), ((2, 2, 2), (Replicate(), Shard(0), Shard(0)))]:
            for coord in torch.cartesian_prod(*[torch.arange(s) for s in mesh]).reshape(-1, len(mesh)).tolist():
                a, b = shard_rows(n, mesh, tuple(coord), placements)
                shape, offset = _compute_local_shape_and_global_offset((n, 3), mesh, coord, placements)
                assert b - a == shape[0], (n, mesh, placements, coord)
                if b > a:
                    assert a == offset[0], (n, mesh, placements, coord)


def test_shard_rows_refuses_placements_that_are_not_row_splits():
    for bad in (Shard(1), _StridedShard(0, split_factor=2), Partial()):
        with pytest.raises(ValueError, match=r"only Replicate\(\) and Shard\(0\) split a tensor by rows"):
            shard_rows(8, (2,), (0,), (bad,))
    with pytest.raises(ValueError, match="one entry per mesh dim"):
        shard_rows(8, (2, 2), (0,), (Shard(0),))


@pytest.fixture(scope="module")
def paths():
    return load_scenarios.save_checkpoints()


_EXPERT = re.compile(r"(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")


def _old_load(path: Path, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """What load_model computed before sharded loading: whole tensors, renamed, experts stacked and concatenated
    (``torch.cat([stack(gate), stack(up)], 1)``, ``stack(down)``), then converted to ``dtype``."""
    out, experts = {}, {}
    for n, t in load_file(path / "model.safetensors").items():
        n = re.sub(r"^model\.language_model\.", "model.", n)
        if n.startswith(("mtp.", "model.visual.")):
            continue
        m = _EXPERT.fullmatch(n)
        if m:
            experts.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
            continue
        out[n] = t
    for prefix, parts in experts.items():
        count = 1 + max(e for e, _ in parts)
        gate = torch.stack([parts[(e, "gate_proj")] for e in range(count)])
        up = torch.stack([parts[(e, "up_proj")] for e in range(count)])
        out[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(count)])
    keep32 = dtype in (torch.bfloat16, torch.float16)  # the router bias stays float32, as transformers keeps it
    return {n: t.to(torch.float32 if keep32 and n.endswith("e_score_correction_bias") else dtype)
            for n, t in out.items()}


class _Recorder:
    """A CheckpointReader that records every read (name, rows)."""

    def __init__(self, inner):
        self.inner, self.reads = inner, []

    def shape(self, name):
        return self.inner.shape(name)

    def read(self, name, rows=None):
        self.reads.append((name, rows))
        return self.inner.read(name, rows)


def _ranges(n: int) -> list[tuple[int, int]]:
    """Every range of up to 8 rows; for longer tensors each rank's rows for 2..5 ranks and a few uneven ones."""
    if n <= 8:
        return [(a, b) for a in range(n + 1) for b in range(a, n + 1)]
    out = {shard_rows(n, (w,), (r,), (Shard(0),)) for w in (2, 3, 4, 5) for r in range(w)}
    return sorted(out | {(0, n), (1, n - 1), (n // 3, n // 3 + 1), (n - 1, n)})


@pytest.mark.parametrize("fam", FAMILIES)
def test_sliced_reads_are_the_rows_of_the_whole_load(paths, fam):
    import warnings

    cfg = hf.read_config(paths[fam])
    kind, files, index = hf._weight_files(paths[fam], False)
    reader, names = hf._open_weights(kind, files, index)
    rec = _Recorder(reader)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        sources = family_for(cfg["model_type"]).weights(cfg).sources(sorted(names), rec)
    if fam == "hybrid":  # vision tower and MTP: skipped with one warning each
        assert len([w for w in caught if "vision tower" in str(w.message)]) == 1
        assert len([w for w in caught if "multi-token-prediction" in str(w.message)]) == 1
    assert not rec.reads  # the sources know their shapes from the headers: nothing read yet
    want = _old_load(paths[fam], torch.float64)
    assert {s.param for s in sources} == set(want)
    fused = 0
    for src in sources:
        whole = want[src.param]
        assert src.shape == tuple(whole.shape)
        assert torch.equal(src.read(), whole)
        for a, b in _ranges(whole.shape[0]):
            rec.reads.clear()
            got = src.read((a, b))
            assert got.dtype == whole.dtype and torch.equal(got, whole[a:b]), (src.param, a, b)
            out = torch.full((b - a, *whole.shape[1:]), float("nan"), dtype=torch.float32)
            rec.reads.clear()
            assert src.read((a, b), out=out) is out and torch.equal(out, whole[a:b].float()), (src.param, a, b)
            reads = rec.reads
            if src.param.endswith((".gate_up_proj", ".down_proj")) and ".experts." in src.param:
                # only the experts a..b-1, each tensor whole, once
                experts = sorted(int(_EXPERT.fullmatch(n.replace("language_model.", "")).group(2)) for n, r in reads)
                per = 2 if src.param.endswith("gate_up_proj") else 1
                assert experts == sorted(list(range(a, b)) * per) and all(r is None for _, r in reads)
                fused += 1
            elif b > a or (a, b) == (0, whole.shape[0]):
                assert reads == [(reads[0][0], None if (a, b) == (0, whole.shape[0]) else (a, b))], reads
    reader.release()
    assert fused > 0 if fam == "deepseek_v3" else fused == 0


def test_source_refuses_bad_rows_and_outputs(paths):
    cfg = hf.read_config(paths["deepseek_v3"])
    reader, names = hf._open_weights(*hf._weight_files(paths["deepseek_v3"], False))
    src = {s.param: s for s in family_for(cfg["model_type"]).weights(cfg).sources(sorted(names), reader)}
    up = src["model.layers.1.mlp.experts.gate_up_proj"]
    for bad in ((2, 1), (-1, 2), (0, 7)):
        with pytest.raises(ValueError, match=rf"rows \({bad[0]}, {bad[1]}\) of model.layers.1.mlp.experts."
                                             r"gate_up_proj: need 0 <= a <= b <= 6"):
            up.read(bad)
    with pytest.raises(ValueError, match=r"rows \(1, 3\) of .* have shape \(2, 16, 32\), but out has \(3, 16, 32\)"):
        up.read((1, 3), out=torch.empty(3, 16, 32))
    assert up.read((4, 4)).shape == (0, 16, 32)
    reader.release()


@pytest.mark.filterwarnings("ignore:(multi-token-prediction|vision tower)")
@pytest.mark.parametrize("fam", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_load_model_without_parallelism_is_bit_identical_to_the_whole_tensor_load(paths, fam, dtype):
    model = longstraw.load_model(paths[fam], dtype=dtype)
    want = _old_load(paths[fam], dtype)
    params = dict(model.named_weights())
    assert set(params) == set(want)
    for n, p in params.items():
        assert p.dtype == want[n].dtype and not hasattr(p, "full_tensor") and torch.equal(p.detach(), want[n]), n
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == (fam == "llama_tied")
    assert model.source_dir == paths[fam]


# ------------------------------------------------------------------------------------------------ under gloo

ALL = ["memory", "shards", "too_large", "masters", "grads_llama_tied", "grads_hybrid", "grads_deepseek_v3"]
# job: (world, cp, fsdp, scenarios, replicate). load4 is cp=1: FSDP over 4 data-parallel replicas; load2x2 is HSDP
# (replicate=2: each parameter sharded over 2 ranks, replicated over the 2 pairs) with cp=2.
JOBS = {"load1": (1, 1, False, ["memory"], 1), "load2": (2, 2, True, ALL, 1), "load4": (4, 1, True, ALL, 1),
        "load2x2": (4, 2, True, ["shards", "meshes"], 2)}
MiB = 2**20


@pytest.fixture(scope="module")
def launched(paths, tmp_path_factory, monkeypatch_module):
    import cp_launcher

    monkeypatch_module.setattr(cp_launcher, "WORKER", Path(__file__).with_name("load_worker.py"))
    # glibc: allocations above 64 KiB are mmapped and go back to the OS when freed, so VmHWM is what was live
    monkeypatch_module.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    all_paths = dict(paths, big=load_scenarios.save_big(tmp_path_factory.mktemp("big") / "model"))
    cache = {}

    def get(job):
        if job not in cache:
            world, cp, fsdp, names, replicate = JOBS[job]
            try:
                cache[job] = launch(world, cp=cp, paths=all_paths, scenarios=names, fsdp=fsdp, replicate=replicate)
            except AssertionError as e:
                cache[job] = e
        if isinstance(cache[job], AssertionError):
            raise cache[job]
        return cache[job]

    return get


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def _result(ranks, name):
    for r, res in enumerate(ranks):
        got = res.get(name, "not run: an earlier scenario failed on this rank (see its test)")
        assert not isinstance(got, str) or not got.startswith(("error: ", "not run")), f"rank {r}, {name}:\n{got}"
    return [res[name] for res in ranks]


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=pytest.mark.xdist_group(f"load-{j}")) for j in JOBS
                                 if "memory" in JOBS[j][3]])
def test_memory(job, launched):
    """Peak resident memory of load_model per rank: within its shard + its largest tensor + 8 MiB."""
    world = JOBS[job][0]
    got = _result(launched(job), "memory")
    lines = [f"\n{job}: load_model of a {got[0]['checkpoint'] / MiB:.1f} MiB float32 checkpoint on {world} rank(s)"
             f" (MALLOC_MMAP_THRESHOLD_=65536; peak = VmHWM after - VmRSS before, VmHWM reset first)",
             "rank  peak MiB  shard MiB  largest MiB  peak/checkpoint  peak/(shard+largest)  RssFile after MiB"]
    for r, m in enumerate(got):
        assert m["reset"], "could not reset VmHWM (/proc/self/clear_refs)"
        lines.append(f"{r:4d}  {m['peak'] / MiB:8.1f}  {m['shard'] / MiB:9.1f}  {m['largest'] / MiB:11.1f}  "
                     f"{m['peak'] / m['checkpoint']:15.3f}  {m['peak'] / (m['shard'] + m['largest']):20.3f}  "
                     f"{m['rss_file_after'] / MiB:17.1f}")
    print("\n".join(lines))
    for r, m in enumerate(got):
        assert (m["sharded"] > 0) == (world > 1)
        assert m["peak"] <= m["shard"] + m["largest"] + 8 * MiB, (job, r, m)
        if world > 1:
            assert m["peak"] < 0.75 * m["checkpoint"], (job, r, m)


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=pytest.mark.xdist_group(f"load-{j}")) for j in JOBS
                                 if "shards" in JOBS[j][3]])
def test_local_shards_are_the_rows_of_the_single_process_model(job, launched, paths):
    """Every parameter (embedding, final norm and LM head included) is sharded over the job's FSDP mesh: all ranks,
    or with HSDP the ``W / replicate`` ranks of a replica group (each group holding the same rows)."""
    world, _, _, _, replicate = JOBS[job]
    shard = world // replicate
    ranks = _result(launched(job), "shards")
    for got in ranks:  # fully_shard on a meta model: every parameter a meta DTensor
        assert got["__meta__"][0] > 0 and got["__meta__"][0] == got["__meta__"][1], got["__meta__"]
    for fam in FAMILIES:
        single = longstraw.load_model(paths[fam])
        for name, want in single.named_parameters():
            seen = []
            for r, got in enumerate(ranks):
                rows, local, shape = got[fam][name]
                assert shape == tuple(want.shape)
                assert rows == shard_rows(want.shape[0], (shard,), (r % shard,), (Shard(0),)), (fam, name, r)
                assert torch.equal(local, want.detach()[rows[0]:rows[1]]), (fam, name, r, rows)
                if r < shard:
                    seen += range(*rows)
            assert seen == list(range(want.shape[0])), (fam, name)
        assert all(got[fam]["__tied__"] == (fam == "llama_tied") for got in ranks)
    v3 = [got["deepseek_v3"]["model.layers.2.mlp.experts.gate_up_proj"][0] for got in ranks]
    assert v3 == ([(0, 3), (3, 6)] * replicate if shard == 2 else [(0, 2), (2, 4), (4, 6), (6, 6)])  # one has none


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["hsdp", "world"])
@pytest.mark.xdist_group("load-load2x2")
def test_other_placements_load_the_same_rows(variant, launched, paths):
    """Placements other than the job's own (apply_fsdp swapped in the scenario): ``hsdp``, only the decoder layers,
    over the 2-D ``(dp, cp)`` mesh (the embedding, norm and head whole); ``world``, FSDP over all 4 ranks on a mesh
    of its own: load_model reads each rank's rows, whatever the placement."""
    ranks = [got[variant] for got in _result(launched("load2x2"), "meshes")]
    for fam in FAMILIES:
        single = longstraw.load_model(paths[fam])
        for name, want in single.named_parameters():
            for r, got in enumerate(ranks):
                rows, placements, local, full = got[fam][name]
                assert torch.equal(full, want.detach()), (variant, fam, name, r)
                if variant == "hsdp":
                    if name.startswith("model.layers."):
                        assert placements == (str(Replicate()), str(Shard(0))), placements
                        assert rows == shard_rows(want.shape[0], (2,), (r % 2,), (Shard(0),)), (fam, name, r)
                    else:
                        assert rows is None
                else:
                    assert placements == (str(Shard(0)),), (fam, name, placements)
                    assert rows == shard_rows(want.shape[0], (4,), (r,), (Shard(0),)), (fam, name, r)
                assert torch.equal(local, want.detach() if rows is None else want.detach()[rows[0]:rows[1]])
        assert all(got[fam]["__tied__"] == (fam == "llama_tied") for got in ranks), (variant, fam)


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=pytest.mark.xdist_group(f"load-{j}")) for j in JOBS
                                 if "shards" in JOBS[j][3]])
def test_reads_are_only_the_local_rows(job, launched):
    """Every checkpoint read a rank made: a sharded parameter's own rows, or (fused experts) only its experts."""
    for r, got in enumerate(_result(launched(job), "shards")):
        for fam in FAMILIES:
            rows_of = {n: v[0] for n, v in got[fam].items() if n != "__tied__"}
            reads = got["__reads__"][fam]
            for name, rows in reads:
                pname = re.sub(r"^model\.language_model\.", "model.", name)
                m = _EXPERT.fullmatch(pname)
                if m:
                    want = rows_of[f"{m.group(1)}.{'down_proj' if m.group(3) == 'down_proj' else 'gate_up_proj'}"]
                    assert rows is None and want[0] <= int(m.group(2)) < want[1], (r, fam, name, want)
                else:
                    assert rows == rows_of[pname], (r, fam, name, rows)


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=pytest.mark.xdist_group(f"load-{j}")) for j in JOBS
                                 if "too_large" in JOBS[j][3]])
def test_size_check_counts_this_ranks_shard(job, launched):
    for msg in _result(launched(job), "too_large"):
        assert re.search(r"the model's [\d,]+ parameters need .* on cpu for this rank's shard \(of .* in all\), "
                         r"more than its available memory \(patched\) of 1\.00 KiB", msg), msg


@pytest.mark.slow
@pytest.mark.parametrize("job", [pytest.param(j, marks=pytest.mark.xdist_group(f"load-{j}")) for j in JOBS
                                 if "masters" in JOBS[j][3]])
def test_bf16_model_loads_into_float32_master_shards(job, launched, paths):
    want = {n: p.detach() for n, p in longstraw.load_model(paths["llama_tied"], dtype="float32").named_parameters()}
    for got in _result(launched(job), "masters"):
        assert got["default"]["dtypes"] == ["torch.float32"] and got["bf16"]["dtypes"] == ["torch.bfloat16"]
        assert got["default"]["compute_dtype"] == got["bf16"]["compute_dtype"] == "None"  # FSDP casts, not autocast
        for n, w in want.items():
            assert torch.equal(got["default"]["full"][n], w), n  # read straight into float32, never via bf16
            assert torch.equal(got["bf16"]["full"][n], w.bfloat16()), n


@pytest.fixture(scope="module")
def single(paths):
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = load_scenarios.SCENARIOS[name](paths)
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("job,fam", [pytest.param(j, f, id=f"{j}-{f}", marks=pytest.mark.xdist_group(f"load-{j}"))
                                     for j in JOBS if f"grads_{FAMILIES[0]}" in JOBS[j][3] for f in FAMILIES])
def test_gradients_equal_the_single_process_ones(job, fam, launched, single):
    name = f"grads_{fam}"
    want = single(name)
    worst = 0.0
    for r, got in enumerate(_result(launched(job), name)):
        assert got["sharded_params"] > 0, (job, r)  # load_model applied FSDP2 (sharded from the start)
        assert set(got["grads"]) == set(want["grads"])
        for n, w in want["grads"].items():
            err = (got["grads"][n] - w).abs().max().item() / max(w.abs().max().item(), 1e-300)
            assert err <= 1e-10, f"{job} rank {r} {fam} {n}: relative error {err:.2e}"
            worst = max(worst, err)
        for a, b in zip(got["loss"], want["loss"]):
            assert abs(a - b) <= 1e-10 * max(1.0, abs(b)), (job, r, fam, a, b)
    print(f"\n{job} {fam}: largest relative gradient difference to one process {worst:.1e}")
