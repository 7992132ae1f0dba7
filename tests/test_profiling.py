"""Peak-memory windows nest: an inner reset (a phase of a step) never hides the peak an outer window saw."""

import pytest
import torch

from longstraw.profiling import peak_window, trim_heap


def test_inner_window_does_not_hide_outer_peak():
    cpu = torch.device("cpu")
    trim_heap()
    with peak_window(cpu) as outer:
        big = torch.ones(64 * 2**20 // 4)  # 64 MiB, touched
        high = outer()
        del big
        trim_heap()
        with peak_window(cpu) as inner:
            small = torch.ones(2**20 // 4)
            assert inner() < high - 32 * 2**20  # the inner window started after the big tensor was freed
            del small
        assert outer() >= high - 2**20  # ... but the outer one still reports it (to the kernel's page accounting)


_ALLOCATOR_PROBE = r"""
import sys
import pytest
import torch
from longstraw.profiling import cpu_current_bytes, tune_allocator

tuned = tune_allocator() if sys.argv[1] == "tune" else False
# freeing an mmapped block raises glibc's dynamic mmap threshold to its size; glibc does that only for blocks up
# to 32 MiB (DEFAULT_MMAP_THRESHOLD_MAX on 64-bit), so a 64 MiB tensor would not, and 16 MiB is used
big = torch.ones(16 * 2**20, dtype=torch.uint8)
del big
base = cpu_current_bytes()
blocks, small = [], []
for _ in range(100):
    blocks.append(torch.ones(2**20, dtype=torch.uint8))  # 1 MiB: heap when the threshold is 16 MiB, else mmap
    # survivors between them pin the freed heap below them; 32 KiB (under both thresholds) is larger than the
    # holes the imports left, so they land above the blocks instead of filling those holes
    small.append(torch.ones(32 * 2**10, dtype=torch.uint8))
del blocks
print(tuned, cpu_current_bytes() - base)
"""


def _rss_left(mode: str) -> tuple[bool, int]:
    import os
    import subprocess
    import sys
    from pathlib import Path

    env = {k: v for k, v in os.environ.items() if k != "MALLOC_MMAP_THRESHOLD_"}
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1] / "src")
    r = subprocess.run([sys.executable, "-c", _ALLOCATOR_PROBE, mode], capture_output=True, text=True, env=env,
                       timeout=120)
    assert r.returncode == 0, r.stderr
    tuned, left = r.stdout.split()
    return tuned == "True", int(left)


@pytest.mark.slow  # fresh processes
def test_tune_allocator_returns_freed_blocks_to_the_os():
    import platform

    import pytest

    if platform.libc_ver()[0] != "glibc":
        pytest.skip("tune_allocator tunes glibc's malloc only")
    tuned, left_tuned = _rss_left("tune")
    plain, left_plain = _rss_left("plain")
    assert tuned and not plain
    # 100 MiB were allocated and freed: glibc's dynamic threshold keeps them resident, the fixed one does not
    assert left_plain - left_tuned > 64 * 2**20, (left_plain, left_tuned)


def test_tune_allocator_leaves_a_user_setting_alone(monkeypatch):
    from longstraw.profiling import tune_allocator

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert tune_allocator() is False


class _Sink:
    def __init__(self, log, name):
        self.log, self.name = log, name

    def update(self, done, total):
        self.log.append((self.name, done, total))

    def close(self):
        self.log.append((self.name, "closed"))


def test_long_phases_report_their_progress():
    """The engine reports each unit of work of each phase to the caller's meter: prefill steps, branch batches,
    reverse-pass steps, decoding steps (what the CLI and the trainer turn into delayed progress bars)."""
    import longstraw
    from longstraw.models.qwen_hybrid import tiny_config
    from longstraw.profiling import PhaseMeter

    model = longstraw.build_model(tiny_config(vocab_size=50, max_position_embeddings=200))
    log = []
    meter = PhaseMeter(torch.device("cpu"), progress=lambda name: _Sink(log, name))
    prompt, responses = torch.randint(0, 50, (41,)), [torch.randint(0, 50, (3,)) for _ in range(3)]
    cfg = longstraw.GRPOConfig(prefill_chunk=16, branch_batch=2)
    longstraw.grpo_backward(model, prompt, responses, torch.tensor([1.0, -1.0, 0.5]), cfg, meter=meter)
    assert [x for x in log if x[0] == "prefill"] == [("prefill", 1, 3), ("prefill", 2, 3), ("prefill", 3, 3),
                                                      ("prefill", "closed")]  # 40 positions in chunks of 16
    assert [x for x in log if x[0] == "replay"] == [("replay", 1, 2), ("replay", 2, 2), ("replay", "closed")]
    assert [x for x in log if x[0] == "prompt_backward"][:-1] == [("prompt_backward", i, 3) for i in (1, 2, 3)]
    assert set(meter.seconds) >= {"prefill", "replay", "prompt_backward", "total"}
    log.clear()
    longstraw.generate(model, prompt, 2, longstraw.SamplingConfig(max_new_tokens=4), meter=meter)
    assert [x for x in log if x[0] == "decode"][:-1] == [("decode", i, 4) for i in (1, 2, 3, 4)]


def test_delayed_bar_appears_only_for_long_phases():
    import io

    from longstraw.profiling import delayed_bar

    quick, slow = io.StringIO(), io.StringIO()
    for stream, delay in ((quick, 3600.0), (slow, 0.0)):
        bar = delayed_bar(delay, stream)("prefill")
        for i in range(1, 6):
            bar.update(i, 5)
        bar.close()
    assert quick.getvalue() == "" and "prefill" in slow.getvalue() and "/5" in slow.getvalue()
