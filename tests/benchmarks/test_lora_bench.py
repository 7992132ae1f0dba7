"""benchmarks/lora_vs_full.py runs end to end on a tiny model: its worker (in this process), the summary and the
markdown table, and (slow) the whole script with its fresh processes. Structure only: timings are not checked."""

import argparse
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "lora_vs_full.py"
TINY = ["--hidden=32", "--intermediate=64", "--layers=4", "--heads=2", "--kv-heads=1", "--vocab=128",
        "--prompt-len=64", "--response-len=8", "--group=2", "--rank=4", "--chunk=32", "--steps=2", "--repeats=1"]


def _bench():
    spec = importlib.util.spec_from_file_location("lora_vs_full", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _args(bench, *extra):
    ap = argparse.ArgumentParser()
    bench.add_arguments(ap)
    args = ap.parse_args([*TINY, "--threads=1", *extra])  # the worker sets it: one_thread restores it
    args.worker_g = args.group
    return args


@pytest.mark.usefixtures("one_thread")
@pytest.mark.parametrize("family,methods", [("llama", ["full", "lora", "lora-detached"]),
                                            ("qwen3_5", ["full", "lora"])])
def test_worker_and_report(family, methods):
    bench = _bench()
    args = _args(bench, f"--family={family}")
    args.ckpt = bench.build_checkpoint(args)
    try:
        cfg = json.loads((Path(args.ckpt) / "config.json").read_text())
        results = []
        for m in methods:
            args.worker_method = m
            r = bench.worker(args)
            r["planned"] = bench.planned(args, cfg, m)
            results.append(r)
    finally:
        shutil.rmtree(args.ckpt, ignore_errors=True)

    by = {r["method"]: r for r in results}
    for r in results:
        assert r["finite"]
        assert all(len(r[k]) == args.steps for k in bench.TIMES)
        assert r["peak_bytes"] >= r["ready_bytes"] > 0 and r["peak_above_start_bytes"] > 0
        assert set(r["fixed_bytes"]) == {"weights", "grads", "optimizer"}
        assert r["fixed_total_bytes"] == sum(r["fixed_bytes"].values())
        # AdamW: two float32 moments per trained element (+ a step counter per tensor)
        assert 2 * r["fixed_bytes"]["grads"] <= r["fixed_bytes"]["optimizer"] <= 2 * r["fixed_bytes"]["grads"] + 4096
        assert r["prompt_grad"] == bench.METHODS[r["method"]][1]
        if r["method"] == "full":
            assert isinstance(r["planned"], int) and r["planned"] > 0
        else:
            assert r["planned"] == "n/a" or isinstance(r["planned"], int)
    full, lora = by["full"], by["lora"]
    assert full["trained_params"] == full["params"] and full["lora"] is None
    assert 0 < lora["trained_params"] < full["trained_params"]
    assert lora["params"] == full["params"] + lora["trained_params"]  # the adapters come on top of the frozen base
    assert lora["fixed_bytes"]["weights"] == full["fixed_bytes"]["weights"] + lora["fixed_bytes"]["grads"]
    assert lora["fixed_bytes"]["grads"] < full["fixed_bytes"]["grads"]
    assert lora["lora"] == {"rank": 4, "alpha": 8, "target_modules": "all-linear"}

    agg = bench.aggregate(results, methods)
    assert set(agg) == set(methods) and all("error" not in a for a in agg.values())
    text = bench.report(agg, args)
    rows = [line for line in text.splitlines() if line.startswith("| ")]
    assert len(rows) == 1 + len(methods)  # the header and one row per method
    assert all(len(row.split(" | ")) == len(rows[0].split(" | ")) for row in rows)
    assert "- lora / full: fixed " in text and "step time" in text
    assert ("- lora-detached / full: " in text) == ("lora-detached" in methods)


def test_failed_worker_is_reported():
    bench = _bench()
    agg = bench.aggregate([{"method": "full", "error": "Traceback ... boom"}], ["full"])
    assert "failed" in bench.report(agg, _args(bench))


def test_planner_lora_keyword(monkeypatch):
    """The LoRA rows get the planner's figure where ``plan`` takes ``lora=``, "n/a" where it does not."""
    from longstraw import planner

    bench = _bench()
    args = _args(bench)
    cfg = bench.model_config(args)
    real, seen = planner.plan, []

    def with_lora(hf_config, *, lora=None, **kw):
        seen.append(lora)
        return real(hf_config, **kw)

    def without_lora(hf_config, **kw):
        if "lora" in kw:
            raise TypeError("plan() got an unexpected keyword argument 'lora'")
        return real(hf_config, **kw)

    monkeypatch.setattr(planner, "plan", with_lora)
    assert isinstance(bench.planned(args, cfg, "lora"), int) and isinstance(bench.planned(args, cfg, "full"), int)
    assert seen == [{"rank": 4, "alpha": 8, "target_modules": "all-linear"}, None]
    monkeypatch.setattr(planner, "plan", without_lora)
    assert bench.planned(args, cfg, "lora-detached") == "n/a" and isinstance(bench.planned(args, cfg, "full"), int)


@pytest.mark.slow  # the whole script: a checkpoint and one fresh process per method
def test_script_end_to_end(tmp_path):
    out = tmp_path / "lora.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), *TINY, "--json-out", str(out)], capture_output=True,
                          text=True, timeout=300, check=False)
    assert proc.returncode == 0, proc.stderr[-2000:]
    res = json.loads(out.read_text())
    assert [r["method"] for r in res["results"]] == ["full", "lora", "lora-detached"]
    assert set(res["summary"]) == {"full", "lora", "lora-detached"}
    assert "| method | trained params |" in proc.stdout and "- lora / full: fixed" in proc.stdout
