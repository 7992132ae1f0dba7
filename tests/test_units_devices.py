"""Sizes, token counts and device names as users type them: parsed, or one ValueError naming the setting."""

import math

import pytest
import torch

from longstraw.devices import resolve_device
from longstraw.units import format_bytes, parse_bytes, parse_tokens


@pytest.mark.parametrize("text,want", [("80G", 80 * 2**30), ("141GiB", 141 * 2**30), ("512M", 512 * 2**20),
                                       ("1.5T", int(1.5 * 2**40)), ("4096", 4096), (1024, 1024), ("2k", 2048)])
def test_parse_bytes(text, want):
    assert parse_bytes(text, "--gpu-mem") == want


@pytest.mark.parametrize("text", ["inf", "nan", "-3G", "0", "lots", "", "1e400", "12X", True, math.inf])
def test_parse_bytes_rejects(text):
    with pytest.raises(ValueError, match=r"^--gpu-mem=.* must be a memory size like 80G"):
        parse_bytes(text, "--gpu-mem")


@pytest.mark.parametrize("text", ["1.5", 0.5, "2.25"])
def test_a_plain_number_of_bytes_or_tokens_must_be_whole(text):
    with pytest.raises(ValueError, match=r"^--graph-budget=.* must be a whole number of bytes"):
        parse_bytes(text, "--graph-budget")
    with pytest.raises(ValueError, match=r"^--response-len=.* must be a whole number of tokens"):
        parse_tokens(text, "--response-len")


@pytest.mark.parametrize("text,want", [("512K", 524288), ("1M", 1048576), ("2M", 2097152), ("2.1M", 2202010),
                                       ("4096", 4096), (300, 300), ("1G", 2**30)])
def test_parse_tokens(text, want):
    assert parse_tokens(text, "--prompt-len") == want


@pytest.mark.parametrize("text", ["inf", "-1", "0", "1T", "many", 0, -5, 2.5, False])
def test_parse_tokens_rejects(text):
    with pytest.raises(ValueError, match=r"^--prompt-len="):
        parse_tokens(text, "--prompt-len")


def test_format_bytes():
    assert format_bytes(3 * 2**30) == "3.00 GiB" and format_bytes(512) == "512 B" and format_bytes(2**41) == "2.00 TiB"


def test_resolve_device():
    assert resolve_device("cpu", "model.device") == torch.device("cpu")
    with pytest.raises(ValueError, match=r"^model.device='gpu' is not a device name; available here: cpu"):
        resolve_device("gpu", "model.device")
    with pytest.raises(ValueError, match=r"^model.device='meta': the meta device holds no data"):
        resolve_device("meta", "model.device")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^--device='cuda': (this torch build has no CUDA|no CUDA device)"):
            resolve_device("cuda", "--device")
