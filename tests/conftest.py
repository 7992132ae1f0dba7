import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))  # tests/hf_reference.py is importable as a helper module
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
