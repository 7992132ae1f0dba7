"""The segment-attention op against its concatenate-and-mask reference: outputs, LSE, gradients, sinks."""

import pytest
import torch

from longstraw.ops.attention import KVSegment, segment_attention, segment_attention_reference


def _rand(*shape, dtype=torch.float64, grad=True):
    return torch.randn(*shape, dtype=dtype).requires_grad_(grad)


CASES = [
    # B, Hq, Hkv, T, prefix lengths, Dk, Dv, prefix batch (1 = shared)
    (1, 4, 4, 7, [0], 16, 16, 1),
    (2, 4, 2, 13, [37], 16, 16, 1),
    (3, 8, 2, 5, [19, 3], 8, 8, 1),
    (2, 4, 1, 9, [21], 24, 16, 2),  # Dv < Dk (MLA absorbed form pads V)
    (2, 2, 1, 1, [30, 4], 16, 16, 2),  # decoding: one query, per-sequence segments
    (1, 6, 3, 33, [], 16, 24, 1),  # own segment only, Dv > Dk
]


@pytest.mark.parametrize("backend", ["flash_cpu", "math"])
@pytest.mark.parametrize("case", CASES)
def test_matches_reference_forward_and_backward(backend, case):
    torch.manual_seed(0)
    b, hq, hkv, t, prefixes, dk, dv, pb = case
    q = _rand(b, hq, t, dk)
    segs = [KVSegment(_rand(pb, hkv, p, dk), _rand(pb, hkv, p, dv)) for p in prefixes]
    segs.append(KVSegment(_rand(b, hkv, t, dk), _rand(b, hkv, t, dv), causal=True))
    scale = dk**-0.5
    out, lse = segment_attention(q, segs, scale, backend=backend, return_lse=True, max_segment=16)  # blocks too
    ref, ref_lse = segment_attention_reference(q, segs, scale, return_lse=True)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    do = torch.randn_like(out)
    inputs = [q] + [x for s in segs for x in (s.k, s.v) if s.length > 0]
    got = torch.autograd.grad(out, inputs, do)
    want = torch.autograd.grad(ref, inputs, do)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


@pytest.mark.parametrize("backend", ["flash_cpu", "math"])
def test_sinks_accumulate_prefix_grad_in_place(backend):
    torch.manual_seed(1)
    b, hq, hkv, t, p, d = 3, 4, 2, 6, 25, 8
    k, v = torch.randn(1, hkv, p, d, dtype=torch.float64), torch.randn(1, hkv, p, d, dtype=torch.float64)
    kg, vg = torch.ones_like(k), torch.ones_like(v)  # pre-existing content must be added to, not overwritten
    q = _rand(b, hq, t, d)
    own = KVSegment(_rand(b, hkv, t, d), _rand(b, hkv, t, d), causal=True)
    out = segment_attention(q, [KVSegment(k, v, k_grad=kg, v_grad=vg), own], d**-0.5, backend=backend,
                            max_segment=7)  # sinks split into views of the accumulators
    do = torch.randn_like(out)
    out.backward(do)
    kr, vr = k.clone().requires_grad_(), v.clone().requires_grad_()
    q2 = q.detach().clone().requires_grad_()
    ref = segment_attention_reference(q2, [KVSegment(kr, vr), own], d**-0.5)
    ref.backward(do)
    torch.testing.assert_close(kg - 1, kr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(vg - 1, vr.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(q.grad, q2.grad, rtol=0, atol=1e-12)


def test_float32_and_bfloat16_close_to_reference():
    torch.manual_seed(2)
    for dtype, tol in [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)]:
        q = torch.randn(2, 4, 11, 16, dtype=dtype)
        segs = [KVSegment(torch.randn(1, 2, 40, 16, dtype=dtype), torch.randn(1, 2, 40, 16, dtype=dtype)),
                KVSegment(torch.randn(2, 2, 11, 16, dtype=dtype), torch.randn(2, 2, 11, 16, dtype=dtype), causal=True)]
        out = segment_attention(q, segs, 0.25)
        ref = segment_attention_reference(q.double(), [KVSegment(s.k.double(), s.v.double(), s.causal) for s in segs], 0.25)
        assert out.dtype == dtype
        assert (out.double() - ref).abs().max().item() < tol


def test_empty_segments_rejected_with_clear_error():
    q = torch.randn(1, 2, 3, 4)
    with pytest.raises(ValueError, match="at least one non-empty"):
        segment_attention(q, [KVSegment(torch.randn(1, 2, 0, 4), torch.randn(1, 2, 0, 4))], 0.5)
    with pytest.raises(ValueError, match="unknown attention backend 'nope'"):
        segment_attention(q, [KVSegment(torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), causal=True)], 0.5,
                          backend="nope")


@pytest.mark.parametrize("meta", [False, True])
def test_detached_prefix_backward_memory_does_not_grow_with_prefix(meta):
    """Queries attend over a prefix that needs no gradient (detached mode), split into many blocks: the backward
    frees each block's dK/dV at once, so its peak does not grow with the prefix (the planner's long-prompt line
    rests on this)."""
    from longstraw.planner import LiveBytes

    dev = "meta" if meta else "cpu"

    def backward_peak(n_prefix: int) -> int:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(1, 2, 16, 8, generator=g).to(dev).requires_grad_()
        k = torch.randn(1, 2, n_prefix, 8, generator=g).to(dev)
        v = torch.randn(1, 2, n_prefix, 8, generator=g).to(dev)
        kn, vn = (torch.randn(1, 2, 16, 8, generator=g).to(dev).requires_grad_() for _ in range(2))
        out = segment_attention(q, [KVSegment(k, v), KVSegment(kn, vn, causal=True)], scale=0.3, max_segment=64)
        with LiveBytes() as lb:
            out.sum().backward()
        return lb.peak  # bytes of the storages the backward created, at their peak

    short, long = backward_peak(256), backward_peak(4096)  # 4 blocks against 64 blocks of 64 keys
    block_kv = 2 * 2 * 64 * 8 * 4  # one block's dK + dV, float32
    assert long <= short + block_kv, (short, long)


def test_cuda_flash_calls_match_the_ops_schemas_on_meta(monkeypatch):
    """The CUDA flash kernels' calls (not runnable here) checked against the ops' real schemas on the meta device:
    padded head dims, output shapes, and the dense backward called with cum_seq_q/k = None (a defined tensor, even an
    empty one, would take the varlen path on CUDA)."""
    from longstraw.ops.attention import kernels

    fwd, bwd = kernels("flash_cuda")
    q = torch.empty(2, 4, 9, 12, device="meta", dtype=torch.bfloat16)  # head dim 12 (padded to 16), values 10
    k = torch.empty(2, 4, 7, 12, device="meta", dtype=torch.bfloat16)
    v = torch.empty(2, 4, 7, 10, device="meta", dtype=torch.bfloat16)
    o, lse = fwd(q, k, v, True, 0.3)
    assert o.shape == (2, 4, 9, 10) and lse.shape == (2, 4, 9) and lse.dtype == torch.float32
    seen = {}
    real = torch.ops.aten._scaled_dot_product_flash_attention_backward

    def record(*args, **kw):
        seen["cum"] = args[6:8]
        seen["head"] = args[1].shape[-1]
        return real(*args, **kw)

    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", record)
    dq, dk, dv = bwd(torch.empty_like(o), q, k, v, o, lse, True, 0.3)
    assert seen["cum"] == (None, None) and seen["head"] == 16
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape


def test_bf16_query_gradient_accumulates_over_segments_in_float32():
    """dq sums one term per key block (a 1M-token prompt: 32+ blocks); summed in bf16 its error grew with the number
    of blocks (measured: 64 blocks 1.1e-2 vs one block 5.7e-3 relative to float64); accumulated in float32 and
    rounded once, many blocks are no worse than one."""
    torch.manual_seed(0)
    b, h, t, d, s = 1, 2, 16, 32, 2048
    q = torch.randn(b, h, t, d, dtype=torch.float64)
    k, v = torch.randn(1, h, s, d, dtype=torch.float64), torch.randn(1, h, s, d, dtype=torch.float64)
    ko, vo = torch.randn(b, h, t, d, dtype=torch.float64), torch.randn(b, h, t, d, dtype=torch.float64)
    do = torch.randn(b, h, t, d, dtype=torch.float64)

    def dq(dtype, fn, **kw):
        qq = q.to(dtype).detach().requires_grad_()
        segs = [KVSegment(k.to(dtype), v.to(dtype)), KVSegment(ko.to(dtype), vo.to(dtype), causal=True)]
        (fn(qq, segs, d**-0.5, **kw).double() * do).sum().backward()
        assert qq.grad.dtype == dtype
        return qq.grad.double()

    want = dq(torch.float64, segment_attention_reference)
    err = {ms: float((dq(torch.bfloat16, segment_attention, max_segment=ms) - want).norm() / want.norm())
           for ms in (32, s)}
    assert err[32] <= 1.2 * err[s] and err[s] < 1e-2, err


@pytest.mark.parametrize("backend", ["flash_cpu", "math"])
@pytest.mark.parametrize("window", [None, 6])
def test_attention_sinks_match_reference_with_their_gradient(backend, window):
    """GPT-OSS's sinks: one logit per head joins every softmax with a zero value; the op's output, LSE and the
    gradients of q, K/V, the prefix's sinks and the sink logits equal the reference's (with and without a window,
    shared prefix in blocks)."""
    torch.manual_seed(5)
    b, hq, hkv, t, p, d = 2, 4, 2, 11, 23, 8
    q = _rand(b, hq, t, d)
    k, v = torch.randn(1, hkv, p, d, dtype=torch.float64), torch.randn(1, hkv, p, d, dtype=torch.float64)
    kg, vg = torch.zeros_like(k), torch.zeros_like(v)
    own = KVSegment(_rand(b, hkv, t, d), _rand(b, hkv, t, d), causal=True)
    sinks = _rand(hq)
    out, lse = segment_attention(q, [KVSegment(k, v, k_grad=kg, v_grad=vg), own], 0.4, backend=backend,
                                 return_lse=True, max_segment=5, window=window, sinks=sinks)
    kr, vr = k.clone().requires_grad_(), v.clone().requires_grad_()
    ref, ref_lse = segment_attention_reference(q, [KVSegment(kr, vr), own], 0.4, return_lse=True, window=window,
                                               sinks=sinks)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-12)
    do = torch.randn_like(out)
    inputs = [q, own.k, own.v, sinks]
    got = torch.autograd.grad(out, inputs, do)
    want = torch.autograd.grad(ref, inputs + [kr, vr], do)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)
    torch.testing.assert_close(kg, want[4], rtol=0, atol=1e-11)
    torch.testing.assert_close(vg, want[5], rtol=0, atol=1e-11)
    assert (out - segment_attention_reference(q, [KVSegment(k, v), own], 0.4, window=window)).abs().max() > 1e-3
    with pytest.raises(ValueError, match=r"sinks must be \[Hq=4\]"):
        segment_attention(q, [own], 0.4, sinks=sinks[:2])
