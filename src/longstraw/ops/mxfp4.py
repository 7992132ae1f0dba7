"""MXFP4 (OCP microscaling FP4) dequantisation: the format GPT-OSS's released checkpoints store their experts in.

A row of ``32 * G`` values is stored as ``G`` blocks of 32 FP4 (E2M1) codes, two per byte (``blocks [..., G, 16]``
uint8: the low nibble is the even element, the high nibble the odd one), and one E8M0 scale per block
(``scales [..., G]`` uint8: the block's values are multiplied by ``2 ** (scale - 127)``). The 16 E2M1 codes are
``0, 0.5, 1, 1.5, 2, 3, 4, 6`` and their negatives (code ``8 + i`` is ``-value[i]``). Every dequantised value is
exactly representable in float32 and bfloat16, so the result does not depend on the dtype it is formed in.

Used by the GPT-OSS weight map (``models/gpt_oss.py``): the experts are dequantised expert by expert as they are
loaded; LongStraw trains the dequantised model (no FP4 compute).
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["E2M1_VALUES", "dequantize_mxfp4", "dequantize_mxfp4_reference"]

E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype = torch.float32) -> Tensor:
    """``blocks [..., G, 16]`` uint8 and ``scales [..., G]`` uint8 -> ``[..., 32 G]`` in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks must be [..., G, 16] with scales [..., G], got {tuple(blocks.shape)} and "
                         f"{tuple(scales.shape)}")
    lut = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    vals = torch.stack((lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]), dim=-1)  # [..., G, 16, 2]
    vals = vals.flatten(-2)  # [..., G, 32]: low nibble first
    out = torch.ldexp(vals, (scales.to(torch.int32) - 127)[..., None].to(torch.float32))
    return out.flatten(-2).to(dtype)


def dequantize_mxfp4_reference(blocks: Tensor, scales: Tensor) -> Tensor:
    """The format as written, one value at a time (float64): for tests."""
    *lead, g, _ = blocks.shape
    flat_b, flat_s = blocks.reshape(-1, g, 16), scales.reshape(-1, g)
    out = torch.empty(flat_b.shape[0], g * 32, dtype=torch.float64)
    for r in range(flat_b.shape[0]):
        for j in range(g):
            for i in range(16):
                byte = int(flat_b[r, j, i])
                for half, code in enumerate((byte & 0x0F, byte >> 4)):
                    out[r, j * 32 + 2 * i + half] = E2M1_VALUES[code] * 2.0 ** (int(flat_s[r, j]) - 127)
    return out.reshape(*lead, g * 32)
