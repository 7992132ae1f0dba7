"""Chunked log-probs/entropy against the all-logits reference, values and gradients."""

import pytest
import torch

from longstraw.ops.logprobs import token_logprobs, token_logprobs_reference


@pytest.mark.parametrize("chunk", [1, 7, 64, 1000])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_reference(chunk, temperature, bias):
    torch.manual_seed(0)
    n, h, v = 37, 12, 53
    hid = torch.randn(n, h, dtype=torch.float64, requires_grad=True)
    w = torch.randn(v, h, dtype=torch.float64, requires_grad=True)
    b = torch.randn(v, dtype=torch.float64, requires_grad=True) if bias else None
    y = torch.randint(0, v, (n,))
    lp, ent = token_logprobs(hid, w, y, bias=b, temperature=temperature, chunk_size=chunk, with_entropy=True)
    rlp, rent = token_logprobs_reference(hid, w, y, bias=b, temperature=temperature, with_entropy=True)
    torch.testing.assert_close(lp, rlp, rtol=0, atol=1e-12)
    torch.testing.assert_close(ent, rent, rtol=0, atol=1e-12)
    g1, g2 = torch.randn(n, dtype=torch.float64), torch.randn(n, dtype=torch.float64)
    inputs = [hid, w] + ([b] if bias else [])
    got = torch.autograd.grad((lp * g1).sum() + (ent * g2).sum(), inputs)
    want = torch.autograd.grad((rlp * g1).sum() + (rent * g2).sum(), inputs)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c, rtol=0, atol=1e-11)


def test_without_entropy_and_bf16_gives_float32():
    torch.manual_seed(1)
    hid = torch.randn(10, 8, dtype=torch.bfloat16, requires_grad=True)
    w = torch.randn(30, 8, dtype=torch.bfloat16, requires_grad=True)
    y = torch.randint(0, 30, (10,))
    lp, ent = token_logprobs(hid, w, y, chunk_size=3)
    assert ent is None and lp.dtype == torch.float32
    rlp, _ = token_logprobs_reference(hid, w, y)
    torch.testing.assert_close(lp, rlp)
    lp.sum().backward()
    assert hid.grad.dtype == torch.bfloat16 and w.grad.dtype == torch.bfloat16


def test_bad_arguments():
    h, w, y = torch.randn(2, 3), torch.randn(4, 3), torch.tensor([0, 1])
    with pytest.raises(ValueError, match="temperature must be > 0, got 0"):
        token_logprobs(h, w, y, temperature=0)
    with pytest.raises(ValueError, match="chunk_size must be >= 1, got 0"):
        token_logprobs(h, w, y, chunk_size=0)


def test_low_precision_head_gradient_accumulates_in_float32():
    """The LM head's gradient sums over every token; with bf16 weights the running sum is float32 (one rounding at
    the end): over many chunks it stays within bf16's rounding of the exact sum, where a bf16 running sum drifts."""
    torch.manual_seed(0)
    n, h, v = 512, 16, 40
    hidden = torch.randn(n, h, dtype=torch.bfloat16)
    weight = (torch.randn(v, h) * 0.1).to(torch.bfloat16).requires_grad_()
    targets = torch.randint(0, v, (n,))
    logp, _ = token_logprobs(hidden, weight, targets, chunk_size=4)  # 128 chunks
    logp.sum().backward()
    w64 = weight.detach().double().requires_grad_()
    ref, _ = token_logprobs_reference(hidden.double(), w64, targets)
    ref.sum().backward()
    err = (weight.grad.double() - w64.grad).abs().max() / w64.grad.abs().max()
    naive = torch.zeros(v, h, dtype=torch.bfloat16)  # what a bf16 running sum gives
    for i in range(0, n, 4):
        z = (hidden[i:i + 4].float() @ weight.detach().float().t())
        p = torch.softmax(z, -1)
        dz = -p
        dz[torch.arange(len(z)), targets[i:i + 4]] += 1
        naive += dz.to(torch.bfloat16).t() @ hidden[i:i + 4]
    naive_err = (naive.double() - w64.grad).abs().max() / w64.grad.abs().max()
    assert err <= 2 ** -8 and err < naive_err / 2, (float(err), float(naive_err))
