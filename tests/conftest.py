import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/hf_reference.py is importable as a helper module
# one thread per xdist worker (``make test`` runs 2 workers on 2 cores), both cores otherwise
torch.set_num_threads(1 if os.environ.get("PYTEST_XDIST_WORKER") else max(1, min(2, os.cpu_count() or 1)))


@pytest.fixture(scope="module")
def one_thread():
    """One torch thread for a module of tiny models: thread-pool overhead dominates their kernels (and a shared
    machine's other processes make it worse). Modules opt in with ``pytest.mark.usefixtures("one_thread")``."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
