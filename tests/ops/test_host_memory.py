"""``ops/host_memory.py``: the per-block copies of a prompt state in host memory, and the attention over such
segments (``KVSegment(host=True)``) against the same segments read in place, block by block."""

import pytest
import torch

from longstraw.ops import host_memory
from longstraw.ops.attention import KVSegment, segment_attention

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


@pytest.mark.parametrize("hkv,n", [(3, 5), (1, 5), (3, 9), (2, 0)])
def test_stage_copies_a_view_into_one_contiguous_tensor(hkv, n):
    state = torch.randn(1, hkv, 9, 4, dtype=torch.float64)
    view = state[:, :, 2:2 + n] if n < 9 else state
    out = host_memory.stage(view, torch.device("cpu"))
    assert out.is_contiguous() and torch.equal(out, view) and (n == 0 or out.data_ptr() != view.data_ptr())
    assert host_memory._slabs(view) == (0 if hkv == 1 or n in (0, 9) else 2)


def test_stage_on_meta_allocates_what_the_planner_counts():
    view = torch.empty(1, 2, 16, 8, device="meta")[:, :, :5]
    out = host_memory.stage(view, torch.device("meta"))
    assert out.device.type == "meta" and out.shape == (1, 2, 5, 8) and out.is_contiguous()
    assert host_memory.to_host(view).device.type == "meta"
    assert host_memory.offloads(view) and not host_memory.offloads(torch.zeros(1))


def test_to_host_copies():
    t = torch.randn(2, 3)
    h = host_memory.to_host(t)
    assert torch.equal(h, t) and h.data_ptr() != t.data_ptr()


@pytest.mark.parametrize("sinks", [False, True])
def test_host_segments_attend_as_segments_in_place(sinks):
    """A long prefix in host memory, split in blocks of ``max_segment`` keys, each copied in: the outputs and the
    gradients of q, the own segment and the prefix sinks equal the in-place run (float64)."""
    g = torch.Generator().manual_seed(0)
    k, v = (torch.randn(1, 2, 23, 6, generator=g, dtype=torch.float64) for _ in range(2))
    results = []
    for host in (False, True):
        q = torch.randn(2, 4, 3, 6, generator=torch.Generator().manual_seed(1), dtype=torch.float64,
                        requires_grad=True)
        own_k, own_v = (torch.randn(2, 2, 3, 6, generator=torch.Generator().manual_seed(s), dtype=torch.float64,
                                    requires_grad=True) for s in (2, 3))
        kg, vg = (torch.zeros_like(k), torch.zeros_like(v)) if sinks else (None, None)
        prefix = KVSegment(k[:, :, :19], v[:, :, :19], k_grad=None if kg is None else kg[:, :, :19],
                           v_grad=None if vg is None else vg[:, :, :19], host=host)
        out = segment_attention(q, [prefix, KVSegment(own_k, own_v, causal=True)], 0.4, max_segment=5)
        out.pow(2).sum().backward()
        results.append([out.detach(), q.grad, own_k.grad, own_v.grad] + ([kg, vg] if sinks else []))
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-13)


def _counting_stage(monkeypatch):
    """``host_memory.stage`` that records weak references to what it copies in: ``alive()`` counts the staged
    tensors still held anywhere."""
    import weakref

    made, real = [], host_memory.stage
    monkeypatch.setattr(host_memory, "stage", lambda t, d: (lambda o: made.append(weakref.ref(o)) or o)(real(t, d)))
    return lambda: sum(r() is not None for r in made)


@pytest.mark.parametrize("host", [[True] * 5, [True, False, True, True, False], [False, True]])
def test_kv_blocks_hold_two_host_blocks_at_a_time(host, monkeypatch):
    """The next host block is copied in before this one is handed over (two on the device at a time, the most);
    blocks already on the device and skipped ones (None) pass through; nothing is held after the last."""
    from longstraw.ops.attention import kv_blocks

    alive = _counting_stage(monkeypatch)
    pairs = [(torch.full((1, 1, 2, 3), float(i)), torch.full((1, 1, 2, 3), -float(i))) for i in range(len(host))]
    pairs[1] = None if host[1] else pairs[1]  # a skipped segment (the backward's detached prefix): None
    blocks = kv_blocks(pairs, host, torch.zeros(1))
    seen, most = [], 0
    for i in range(len(host)):
        pair = next(blocks)
        if pair is None:
            seen.append(None)
        else:
            k, v = pair
            del pair
            assert torch.equal(k, pairs[i][0]) and torch.equal(v, pairs[i][1])
            assert (k.data_ptr() != pairs[i][0].data_ptr()) == host[i]  # copied in, or the tensor itself
            staged = alive() // 2  # k and v per block
            nxt = i + 1 < len(host) and host[i + 1] and pairs[i + 1] is not None
            assert staged == int(host[i]) + int(nxt)  # this block and the next one's copy, already issued
            most = max(most, staged)
            seen.append(i)
            del k, v
    assert alive() == 0 and most <= 2 and seen == [None if p is None else i for i, p in enumerate(pairs)]
    with pytest.raises(StopIteration):
        next(blocks)


class _FakeCuda:
    """A stand-in for ``torch.cuda`` that logs the stream protocol of ``host_memory._SideStream``."""

    def __init__(self, log):
        self.log, self.events = log, 0
        fake = self

        class Stream:
            def __init__(self, name="copy", device=None):
                self.name = name

            def wait_stream(self, other):
                fake.log.append(("wait_stream", self.name, other.name))

            def wait_event(self, event):
                fake.log.append(("wait_event", self.name, event.n))

        class Event:
            def __init__(self):
                self.n, fake.events = fake.events, fake.events + 1

            def record(self, stream):
                fake.log.append(("record", self.n, stream.name))

        self.Stream, self.Event, self.main = Stream, Event, Stream("main")

    def current_stream(self, device=None):
        return self.main

    def current_device(self):
        return 0

    def stream(self, s):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.log.append(("enter", s.name))
            yield
            self.log.append(("exit", s.name))

        return ctx()


def test_side_stream_protocol(monkeypatch):
    """On a GPU each block is allocated and copied on the side stream after it waited for the main stream (so a
    freed block's memory is reused only after the kernels that read it), an event recorded after its copy; the main
    stream waits for that event only, after the next block's copy was issued (the overlap), before the block is
    handed over; never for the side stream as a whole."""
    log = []
    fake = _FakeCuda(log)
    monkeypatch.setattr(host_memory, "stage", lambda t, d: log.append(("stage", int(t.flatten()[0]))) or t.clone())
    streams = host_memory._SideStream(torch.device("cpu"), cuda=fake)
    blocks = [(torch.full((2,), float(i)),) for i in range(3)]
    for (got,), (want,) in zip(host_memory.prefetched(blocks, torch.device("cpu"), streams=streams), blocks):
        assert torch.equal(got, want)
        log.append(("use", int(got[0])))
    def issue(i):
        return [("wait_stream", "copy", "main"), ("enter", "copy"), ("stage", i), ("record", i, "copy"),
                ("exit", "copy")]

    assert log == (issue(0) + issue(1) + [("wait_event", "main", 0), ("use", 0)]
                   + issue(2) + [("wait_event", "main", 1), ("use", 1)] + [("wait_event", "main", 2), ("use", 2)])
    assert host_memory._SideStream(torch.device("cpu"), cuda=fake).copy is streams.copy  # one side stream per device


def test_nothing_in_host_memory_touches_no_stream(monkeypatch):
    """Segments on the device pass through without a side stream being made (the path that ran on the H200)."""
    monkeypatch.setattr(host_memory, "_SideStream", lambda *a, **k: pytest.fail("a side stream was made"))
    pairs = [(torch.ones(2), torch.zeros(2)), None]
    assert list(host_memory.prefetched([None, None], torch.device("cuda"))) == [None, None]
    from longstraw.ops.attention import kv_blocks

    got = list(kv_blocks(pairs, [False, False], torch.empty(0, device="meta")))
    assert got[0] is pairs[0] and got[1] is None
