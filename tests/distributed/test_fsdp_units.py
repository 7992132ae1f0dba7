"""Which modules become FSDP2 units of their own (``distributed.fsdp.kept_dtype_modules``): those whose trained
parameters are kept in a dtype other than the rest of their layer's. The 2-rank runs are in
``tests/distributed/cp_scenarios.py`` (``master_weights``: a float16 DSA model under float16 masters)."""

import pytest
import torch
from torch import nn

from longstraw.distributed.fsdp import kept_dtype_modules
from longstraw.models.dsa import HeadWeights


def _layer() -> nn.Module:
    layer = nn.Module()
    layer.proj = nn.Linear(8, 8)
    layer.indexer = nn.Module()
    layer.indexer.wq = nn.Linear(8, 4)
    layer.indexer.weights_proj = HeadWeights(8, 2, bias=False)
    return layer.half()  # HeadWeights stays float32 in a float16 model, as transformers keeps it


def test_a_float32_module_in_a_float16_layer_is_a_unit_of_its_own():
    layer = _layer()
    assert layer.indexer.weights_proj.weight.dtype == torch.float32 and layer.proj.weight.dtype == torch.float16
    assert kept_dtype_modules(layer) == [layer.indexer.weights_proj]
    layer.indexer.weights_proj.weight.requires_grad_(False)  # frozen (a LoRA base): nothing to split off
    assert kept_dtype_modules(layer) == []
    layer = _layer().float()  # float32 masters: one dtype
    assert kept_dtype_modules(layer) == []


def test_a_module_holding_both_dtypes_itself_is_refused():
    layer = _layer()
    layer.indexer.scale = nn.Parameter(torch.ones(4))  # float32 beside the float16 wq below the same module
    with pytest.raises(ValueError, match=r"indexer: its trained parameters are in \['float16', 'float32'\]"):
        kept_dtype_modules(layer)
