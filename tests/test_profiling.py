"""Peak-memory windows nest: an inner reset (a phase of a step) never hides the peak an outer window saw."""

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
