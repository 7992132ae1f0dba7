"""MXFP4 dequantisation against the format as written and against transformers' own converter."""

import pytest
import torch

from longstraw.ops.mxfp4 import dequantize_mxfp4, dequantize_mxfp4_reference


def _packed(*lead, g=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    blocks = torch.randint(0, 256, (*lead, g, 16), generator=gen, dtype=torch.uint8)
    scales = torch.randint(100, 140, (*lead, g), generator=gen, dtype=torch.uint8)
    return blocks, scales


def test_matches_the_format_and_transformers():
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks, scales = _packed(2, 5)
    got = dequantize_mxfp4(blocks, scales)
    assert got.shape == (2, 5, 96)
    torch.testing.assert_close(got.double(), dequantize_mxfp4_reference(blocks, scales), rtol=0, atol=0)
    # transformers dequantises [E, R, G, 16] to its in-memory [E, 32 G, R]
    want = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    torch.testing.assert_close(got.transpose(1, 2), want, rtol=0, atol=0)
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.bfloat16).float(), got)  # exact in bfloat16


def test_bad_inputs():
    blocks, scales = _packed(2)
    with pytest.raises(ValueError, match="must be uint8"):
        dequantize_mxfp4(blocks.int(), scales)
    with pytest.raises(ValueError, match=r"must be \[\.\.\., G, 16\] with scales \[\.\.\., G\]"):
        dequantize_mxfp4(blocks, scales[:, :2])
