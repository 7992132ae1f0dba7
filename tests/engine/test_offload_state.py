"""The prompt state's K/V in host memory for the backward phases (``GRPOConfig(offload_state=True)``).

On a CPU the engine does not offload (host and device memory are one), so ``tests/host_guard.py`` forces it and
checks the contract that makes it work on a GPU: once moved, the K/V are read only through
``ops/host_memory.stage`` (the per-block copy to the device), and the gradients equal the naive float64 reference,
for the K/V families (dense, the DeltaNet hybrid whose recurrent state stays), an MLA model (nothing to move: its
latents stay), with the state gradient offloaded too, in exact and detached mode. The copies' device side runs in
``benchmarks/gpu_check.py``.
"""

import contextlib
import dataclasses

import pytest
import torch
from grpo_reference import assert_grads_close, random_group, reference_loss
from host_guard import guarded_host
from test_graph_budget import V, _pair, _patch

import longstraw
from longstraw.models.mla import set_mla_mode

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py

CASES = {"llama-exact": True, "llama-detached": False, "qwen3_next-exact": True, "qwen3_next-detached": False,
         "deepseek_v3-exact": True}


@pytest.mark.parametrize("case", list(CASES))
def test_offloaded_state_gives_the_reference_gradients(case):
    name, exact = case.split("-")[0], CASES[case]
    hf, path = _pair(name)
    prompt, responses, adv = random_group(3, 30, [5, 1, 7], V)
    model = longstraw.load_model(path)
    if name == "deepseek_v3":
        set_mla_mode(model, "decompressed", decompress_chunk=4)
    hf.zero_grad()
    with _patch(name):
        loss, _ = reference_loss(hf, prompt, responses, adv, mode="token-mean", clip_c=3.0, kl_coef=0.0,
                                 kl_type="low_var_kl", entropy_coef=0.01, old=None, ref=None, detached=not exact)
        loss.backward()
    cfg = longstraw.GRPOConfig(entropy_coef=0.01, prefill_chunk=8, offload_state=True,
                               prompt_grad="exact" if exact else "detached")
    for grad_offload in ((False, True) if exact else (False,)):
        model.zero_grad(set_to_none=True)
        with guarded_host() as touched:
            stats = longstraw.grpo_backward(model, prompt, responses, adv,
                                            dataclasses.replace(cfg, offload_state_grad=grad_offload))
        assert_grads_close(longstraw.hf_grads(model), hf, rel=1e-8)
        kv = sum(isinstance(layer.mixer, longstraw.models.attention.Attention) for layer in model.layers)
        if kv:
            assert "copy_" in touched, "no block of the moved state was copied in"
            assert 0 < stats.prompt_state_host_bytes < stats.prompt_state_bytes or (
                stats.prompt_state_host_bytes == stats.prompt_state_bytes and name == "llama")
        else:  # MLA latents stay where they are
            assert not touched and stats.prompt_state_host_bytes == 0


def test_a_state_on_the_cpu_stays_where_it_is():
    """Unforced, a CPU run moves nothing (and reports nothing in host memory apart)."""
    _, path = _pair("llama")
    model = longstraw.load_model(path)
    prompt, responses, adv = random_group(3, 20, [4, 2], V)
    stats = longstraw.grpo_backward(model, prompt, responses, adv,
                                    longstraw.GRPOConfig(prefill_chunk=8, offload_state=True))
    assert stats.prompt_state_host_bytes == 0 and stats.prompt_state_bytes > 0


def test_the_guard_sees_a_direct_read():
    """The check has teeth: a kernel fed the moved state directly raises; a staged copy passes."""
    from longstraw.ops import host_memory
    from longstraw.state import KVState

    st = KVState(capacity=6)
    st.write((torch.randn(1, 2, 6, 4, dtype=torch.float64), torch.randn(1, 2, 6, 4, dtype=torch.float64)), 0, 6)
    with guarded_host() as touched:
        st.offload()
        seg = st.prefix(4, False)[0]
        assert seg.host and st.home == torch.device("cpu") and st.host_nbytes() == st.nbytes()
        with pytest.raises(AssertionError, match="outside longstraw/ops/host_memory.py"):
            seg.k.sum()
        with pytest.raises(AssertionError, match="outside longstraw/ops/host_memory.py"):
            torch.cat([seg.k, seg.k], dim=2)
        k = host_memory.stage(seg.k, torch.device("cpu"))
        assert type(k) is torch.Tensor and k.is_contiguous() and touched
    with pytest.raises(AssertionError, match="prefill is over"):
        st.write((torch.zeros(1, 2, 1, 4, dtype=torch.float64),) * 2, 5, 6)


@pytest.mark.parametrize("kwargs,msg", [
    (dict(offload_state=True, graph_budget_bytes=1 << 20), "the kept prompt-step graphs hold the state's K/V"),
    (dict(offload_state="yes"), "offload_state='yes' must be true or false"),
])
def test_config_validation(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        longstraw.GRPOConfig(**kwargs)


def test_recurrent_boundaries_leave_as_the_prefill_supersedes_them():
    """A DeltaNet layer's exact state keeps its state at every chunk boundary for the reverse pass: with
    ``offload_history`` each boundary goes to host memory once the next chunk's state supersedes it (the latest
    stays on the device: the next chunk and every branch read it), ``offload`` moves nothing more, and reading a
    moved boundary copies it back through ``ops/host_memory.py``."""
    from longstraw.models.deltanet import RecurrentState

    st = RecurrentState(capacity=12, exact=True)
    states = [(torch.randn(1, 6, 3, dtype=torch.float64), torch.randn(1, 2, 4, 4, dtype=torch.float64))
              for _ in range(3)]
    with guarded_host() as touched:
        st.offload_history()
        for i, piece in enumerate(states):
            st.write(piece, 4 * i, 4 * i + 4)
        assert st._on_host == {4, 8} and type(st.S) is torch.Tensor and st.home == torch.device("cpu")
        assert st.host_nbytes() == 2 * sum(t.numel() * 8 for t in states[0]) and st.nbytes() > st.host_nbytes()
        st.offload()
        assert st._on_host == {4, 8}
        first = st.prefix(4, False)
        assert type(first.S) is torch.Tensor and torch.equal(first.S, states[0][1]) and "copy_" in touched
        assert st.prefix(12, False).S is st.S  # the latest is read in place
        with pytest.raises(AssertionError, match="outside longstraw/ops/host_memory.py"):
            st.boundaries[8][1].sum()


def test_a_rollout_state_moved_as_it_is_built_trains_alike():
    """The trainer's path: ``generate(keep_state=True, exact_state=True, offload_state=True)`` moves the DeltaNet
    boundaries during its prefill, decodes from the state on the device, and ``grpo_backward`` on that state moves
    the K/V: the sampled tokens and the gradients equal those of the same calls without offload."""
    _, path = _pair("qwen3_next")
    model = longstraw.load_model(path)
    prompt = torch.randint(0, V, (26,), generator=torch.Generator().manual_seed(5))
    sp = longstraw.SamplingConfig(temperature=1.0, max_new_tokens=5, seed=3)
    out = []
    for offload in (False, True):
        model.zero_grad(set_to_none=True)
        with guarded_host() if offload else contextlib.nullcontext([]) as touched:
            ro = longstraw.generate(model, prompt, 3, sp, keep_state=True, exact_state=True, prefill_chunk=8,
                                    offload_state=offload)
            if offload:
                assert ro.prompt_state.host_nbytes() > 0  # the boundaries left during the prefill
            cfg = longstraw.GRPOConfig(prefill_chunk=8, offload_state=offload)
            longstraw.grpo_backward(model, prompt, ro.responses, torch.tensor([1.0, -0.5, 0.2]), cfg,
                                    old_logprobs=ro.logprobs, prompt_state=ro.prompt_state)
        assert bool(touched) == offload
        out.append(([r.tolist() for r in ro.responses], {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert out[0][0] == out[1][0]
    for n, g in out[0][1].items():
        torch.testing.assert_close(out[1][1][n], g, rtol=0, atol=1e-12)
