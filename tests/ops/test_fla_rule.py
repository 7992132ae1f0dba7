"""fla's ``chunk_gated_delta_rule`` (forward and backward) as LongStraw calls it, run under Triton's interpreter on the
CPU (tests/fla_interpret.py; ``make test-fla``), against the float64 torch rule: the call's layout and head
repetition, initial and final states and their gradients, widths that are not powers of two, K > 64 (several state
tiles), and the context-parallel scan's transfer call (Dv + Dk value columns from an identity state); the same for
per-channel gates (Kimi Delta Attention), where the branch takes fla's ``chunk_kda``; and the dispatcher's
check of fla's backward (``fla_backward_check``) passing on the real kernels.

Tolerances are relative errors ``||x - ref|| / ||ref||`` against the rule in float64, for every output and every
input gradient: float32 within 1e-5 (measured 6e-8 .. 1.0e-6, the torch rule's float32 1e-7 .. 7e-7), float16
within 3e-3 (measured 1.3e-4 .. 1.5e-3; the torch rule on the same float16 inputs, which computes in float32 inside,
6e-5 .. 9e-4: fla's dg is up to 5x the torch rule's at Dk = 128). bfloat16 does not run under the
interpreter (module docstring of tests/fla_interpret.py)."""

import pytest
import torch
from deltanet_inputs import D64, make_inputs, run
from deltanet_inputs import grads as _grads
from fla_interpret import install, unavailable

from longstraw.ops import deltanet
from longstraw.ops.deltanet import chunk_gated_delta_rule

pytestmark = [pytest.mark.fla, pytest.mark.skipif(unavailable() is not None, reason=str(unavailable()))]

BOUND = {torch.float32: 1e-5, torch.float16: 3e-3}


@pytest.fixture(scope="module", autouse=True)
def _interpreter():
    install()


def fla(q, k, v, g, beta, initial_state=None, output_final_state=True):
    """The dispatcher's fla branch itself (``ops.deltanet._fla_call``), on CPU tensors."""
    return deltanet._fla_call(q, k, v, g, beta, scale=None, initial_state=initial_state,
                              output_final_state=output_final_state, use_qk_l2norm=True)


def grads(o, s, inputs):
    """Input gradients of one random functional of (output, state), the same in every dtype (drawn in float64)."""
    return _grads(o, s, inputs, draw_dtype=D64)


def rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-300)).item()


def errors(fn, inputs, ref_out, ref_grads) -> list[float]:
    """Relative errors of ``fn``'s output, final state and input gradients against the float64 ones."""
    o, s = run(fn, inputs)
    return [rel(o, ref_out[0]), rel(s, ref_out[1])] + [rel(a, b) for a, b in zip(grads(o, s, inputs), ref_grads)]


def check(inputs64, dtype):
    """fla on ``inputs64`` cast to ``dtype`` (g and the initial state in float32, as the model passes them) against
    the float64 torch rule."""
    ref = run(chunk_gated_delta_rule, inputs64)
    ref_grads = grads(*ref, inputs64)
    low = [x.detach().to(torch.float32 if i in (3, 5) else dtype).requires_grad_() for i, x in enumerate(inputs64)]
    got = errors(fla, low, ref, ref_grads)
    names = ["out", "state", "dq", "dk", "dv", "dg", "dbeta", "ds0"][:len(got)]
    bad = {n: e for n, e in zip(names, got) if not e <= BOUND[dtype]}
    assert not bad, f"fla vs float64 over {BOUND[dtype]:g} ({dtype}): {bad}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h0", [True, False])
@pytest.mark.parametrize("shape", [
    dict(B=2, T=70, Hk=2, H=2, Dk=16, Dv=16),   # two chunks, the second partial
    dict(B=1, T=130, Hk=2, H=4, Dk=16, Dv=24),  # value heads > key heads (repeated here), Dv != Dk, not a power of 2
    dict(B=1, T=5, Hk=1, H=1, Dk=32, Dv=32),    # a short branch: one partial chunk
    dict(B=1, T=100, Hk=1, H=1, Dk=128, Dv=256),  # Qwen3-Next's Dk; 256 = the scan's Dv + Dk there
])
def test_fla_matches_the_float64_rule(shape, h0, dtype):
    check(make_inputs(**shape, h0=h0, decay=0.5, seed=shape["T"]), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("shape", [
    dict(B=2, T=70, Hk=2, H=2, Dk=16, Dv=16),   # two chunks, the second partial
    dict(B=1, T=5, Hk=1, H=1, Dk=32, Dv=32),    # a short branch: one partial chunk
    dict(B=1, T=100, Hk=2, H=2, Dk=128, Dv=128),  # Kimi-Linear's head size
])
def test_fla_kda_matches_the_float64_rule(shape, dtype):
    """Per-channel gates (Kimi Delta Attention): the dispatcher's fla branch takes fla's ``chunk_kda``."""
    check(make_inputs(**shape, decay=0.5, seed=shape["T"] + 1, channels=True), dtype)


def test_fla_without_final_state():
    q, k, v, g, beta = [x.detach().float() for x in make_inputs(T=40, Dk=16, Dv=16, h0=False)]
    o, s = fla(q, k, v, g, beta, output_final_state=False)
    assert s is None
    ro, _ = chunk_gated_delta_rule(q, k, v, g, beta)
    assert rel(o, ro) < BOUND[torch.float32]


@pytest.mark.parametrize("channels", [False, True])
def test_fla_runs_the_scans_transfer_call(channels):
    """The CP scan's call (distributed/cp_recurrent.py) through fla (per-channel gates: ``chunk_kda``): two pieces
    each run once from the identity with Dk extra zero columns, composed with ``apply_initial``, equal fla and the
    float64 rule run from the true state: outputs, final state and every gradient (s0's included)."""
    inputs64 = make_inputs(B=1, T=90, Hk=2, H=2, Dk=16, Dv=16, decay=0.5, seed=5 + channels, channels=channels)
    ref = run(chunk_gated_delta_rule, inputs64)
    ref_grads = grads(*ref, inputs64)
    q, k, v, g, beta, s0 = [x.detach().float().requires_grad_() for x in inputs64]
    dk, dv = q.shape[-1], v.shape[-1]
    outs, state = [], s0
    for sl in (slice(0, 50), slice(50, 90)):
        v2, init = deltanet.transfer_inputs(v[:, sl], dk)
        o_full, s_full = fla(q[:, sl], k[:, sl], v2, g[:, sl], beta[:, sl], initial_state=init)
        assert o_full.shape[-1] == s_full.shape[-1] == dv + dk
        o, state = deltanet.apply_initial(o_full, s_full, state, dv)
        outs.append(o)
    o = torch.cat(outs, dim=1)
    got = [rel(o, ref[0]), rel(state, ref[1])] + [rel(a, b) for a, b in
                                                  zip(grads(o, state, [q, k, v, g, beta, s0]), ref_grads)]
    assert max(got) < BOUND[torch.float32], got


def test_fla_backward_refusal_reads_flags_that_fla_has():
    """``ops.deltanet.fla_backward_refusal`` mirrors fla's Hopper guard by reading fla's flags and returns None when
    they do not import (an fla without the guard): the installed fla must have them, so that a rename cannot switch
    the mirror off silently. Not Hopper here: no refusal."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1  # noqa: F401

    from fla.ops.common.backends.tilelang import CommonTileLangBackend

    assert callable(CommonTileLangBackend.can_use)
    assert not IS_NVIDIA_HOPPER
    deltanet.fla_backward_refusal.cache_clear()
    assert deltanet.fla_backward_refusal() is None



@pytest.mark.parametrize("channels", [False, True])
def test_fla_backward_check_passes_the_real_kernels(channels):
    """``ops.deltanet.fla_backward_check``, the check a GPU runs once per shape before a pass that needs a gradient
    trusts fla's backward, on fla's real kernels here (float16; one full chunk and a partial one, Dk = 32): every
    output and gradient within FLA_CHECK_TOL of the torch rule, so the check passes."""
    tol = deltanet.FLA_CHECK_TOL[torch.float16]
    # 70 tokens for the interpreter's time (a GPU checks FLA_CHECK_TOKENS = 150)
    errs = deltanet.fla_backward_errors(torch.device("cpu"), torch.float16, channels, 1, 32, 48, tokens=70)
    assert max(errs.values()) <= tol / 3, errs
