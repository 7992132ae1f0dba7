"""Gated delta rule: chunked form vs the token-by-token reference vs transformers' Qwen3-Next (per-head gates) and
Kimi-Linear (per-channel gates, KDA), values and gradients."""

import types

import pytest
import torch
from deltanet_inputs import D64, HalfGradient, assert_all_close, grads, make_inputs, run

from longstraw.ops import deltanet
from longstraw.ops.deltanet import chunk_gated_delta_rule, gated_delta_rule, recurrent_gated_delta_rule

TOL = dict(rtol=1e-12, atol=1e-12)
GTOL = dict(rtol=1e-10, atol=1e-11)


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 130, 200])
@pytest.mark.parametrize("chunk_size", [16, 64])
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize("l2norm", [True, False])
def test_chunked_matches_recurrent(T, chunk_size, h0, l2norm):
    inputs = make_inputs(T=T, h0=h0, l2norm=l2norm, seed=T)
    o, s = run(chunk_gated_delta_rule, inputs, chunk_size=chunk_size, use_qk_l2norm=l2norm)
    ro, rs = run(recurrent_gated_delta_rule, inputs, use_qk_l2norm=l2norm)
    assert o.shape == ro.shape == inputs[2].shape and s.shape == (2, 2, 8, 6)
    assert o.dtype == s.dtype == D64
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    assert_all_close(grads(o, s, inputs), grads(ro, rs, inputs), **GTOL)


@pytest.mark.parametrize("chunk_size,block_tokens", [(1, None), (7, None), (8, 16), (16, 1), (64, 64)])
def test_odd_chunk_and_block_sizes(chunk_size, block_tokens):
    inputs = make_inputs(T=45, seed=3)
    o, s = run(chunk_gated_delta_rule, inputs, chunk_size=chunk_size, block_tokens=block_tokens)
    ro, rs = run(recurrent_gated_delta_rule, inputs)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    assert_all_close(grads(o, s, inputs), grads(ro, rs, inputs), **GTOL)


def test_grouped_value_heads_and_explicit_scale():
    """Hk < H: q/k head i serves value heads i*r .. i*r+r-1 (repeat_interleave, as transformers)."""
    inputs = make_inputs(T=70, Hk=2, H=4, seed=4)
    o, s = run(chunk_gated_delta_rule, inputs, chunk_size=16, scale=0.3)
    ro, rs = run(recurrent_gated_delta_rule, inputs, scale=0.3)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    assert_all_close(grads(o, s, inputs), grads(ro, rs, inputs), **GTOL)
    q, k, *rest = inputs  # the same as repeating by hand
    eo, es = run(recurrent_gated_delta_rule, [q.repeat_interleave(2, 2), k.repeat_interleave(2, 2), *rest], scale=0.3)
    torch.testing.assert_close(o, eo, **TOL)


@pytest.mark.parametrize("channels", [False, True])
def test_strong_decay_is_finite(channels):
    """g as low as -60 per token (per head, or per key channel: the pairwise decays): the chunk-internal decay
    products underflow instead of overflowing."""
    inputs = make_inputs(T=100, decay=60.0, seed=5, channels=channels)
    o, s = run(chunk_gated_delta_rule, inputs, chunk_size=64)
    ro, rs = run(recurrent_gated_delta_rule, inputs)
    assert torch.isfinite(o).all() and torch.isfinite(s).all()
    torch.testing.assert_close(o, ro, **TOL)
    gs = grads(o, s, inputs)
    assert all(torch.isfinite(x).all() for x in gs)
    assert_all_close(gs, grads(ro, rs, inputs), **GTOL)


@pytest.mark.parametrize("pieces", [[150], [1, 149], [40, 64, 46], [3, 5, 1, 77, 64], [16] * 9 + [6]])
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_composition_across_pieces(pieces, fn):
    """Running T tokens in pieces, final_state -> initial_state, equals one call, forward and gradients."""
    inputs = make_inputs(T=150, seed=6)
    q, k, v, g, beta, s0 = inputs
    kw = dict(chunk_size=16) if fn is chunk_gated_delta_rule else {}
    o, s = fn(q, k, v, g, beta, initial_state=s0, **kw)
    outs, state, t0 = [], s0, 0
    for n in pieces:
        sl = slice(t0, t0 + n)
        oi, state = fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state, **kw)
        outs.append(oi)
        t0 += n
    assert t0 == 150
    po = torch.cat(outs, dim=1)
    torch.testing.assert_close(po, o, **TOL)
    torch.testing.assert_close(state, s, **TOL)
    assert_all_close(grads(po, state, inputs), grads(o, s, inputs), **GTOL)


@pytest.mark.parametrize("pieces", [[37], [1, 36], [5, 17, 15], [3, 1, 33]])
@pytest.mark.parametrize("Hk, H", [(2, 2), (1, 3)])
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_transfer_form_composes_pieces_from_unknown_states(pieces, Hk, H, fn):
    """Every piece run once from an unknown state (the transfer call: Dk extra zero-valued columns from the
    identity), then composed (``compose_transfer`` over the pieces, ``apply_initial`` per piece), equals the rule
    run through the pieces from the true states: outputs, final state and every gradient (s0 included)."""
    inputs = make_inputs(T=37, Hk=Hk, H=H, seed=11)
    q, k, v, g, beta, s0 = inputs
    dk, dv = q.shape[-1], v.shape[-1]
    kw = dict(chunk_size=8) if fn is chunk_gated_delta_rule else {}
    o, s = fn(q, k, v, g, beta, initial_state=s0, **kw)
    fulls, t0 = [], 0
    for n in pieces:
        sl = slice(t0, t0 + n)
        v2, init = deltanet.transfer_inputs(v[:, sl], dk)
        assert v2.shape[-1] == dv + dk and init.shape == (v.shape[0], H, dk, dv + dk)
        fulls.append(fn(q[:, sl], k[:, sl], v2, g[:, sl], beta[:, sl], initial_state=init, **kw))
        t0 += n
    outs, state = [], s0
    for o_full, S_full in fulls:
        oi, state_next = deltanet.apply_initial(o_full, S_full, state, dv)
        torch.testing.assert_close(state_next, deltanet.compose_transfer(S_full, state, dv), **TOL)
        outs.append(oi)
        state = state_next
    po = torch.cat(outs, dim=1)
    torch.testing.assert_close(po, o, **TOL)
    torch.testing.assert_close(state, s, **TOL)
    assert_all_close(grads(po, state, inputs), grads(o, s, inputs), **GTOL)
    o1, s1 = deltanet.apply_initial(*fulls[0], None, dv)  # from a zero state: the plain columns
    ref_o, ref_s = fn(q[:, :pieces[0]], k[:, :pieces[0]], v[:, :pieces[0]], g[:, :pieces[0]],
                      beta[:, :pieces[0]], **kw)
    torch.testing.assert_close(o1, ref_o, **TOL)
    torch.testing.assert_close(s1, ref_s, **TOL)


def test_transfer_form_in_float32_keeps_a_float32_state():
    """bf16 values: the extra columns in bf16, the identity initial state and the transfer in float32."""
    q, k, v, g, beta = make_inputs(T=9, h0=False, dtype=torch.bfloat16)
    v2, init = deltanet.transfer_inputs(v, q.shape[-1])
    assert v2.dtype == torch.bfloat16 and init.dtype == torch.float32
    torch.testing.assert_close(init[0, 0, :, v.shape[-1]:], torch.eye(q.shape[-1]))


def test_output_final_state_false_and_no_initial_state():
    q, k, v, g, beta = make_inputs(T=20, h0=False)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=False)
    assert s is None
    o2, _ = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros(2, 2, 8, 6, dtype=D64))
    torch.testing.assert_close(o, o2, **TOL)


def test_bf16_inputs_give_fp32_state():
    fp = make_inputs(T=70, dtype=torch.float32, seed=7)
    bf = [x.detach().to(torch.bfloat16).requires_grad_() for x in fp[:5]]
    s0 = fp[5].detach().requires_grad_()  # the carried state is fp32
    o, s = chunk_gated_delta_rule(*bf, initial_state=s0, chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.isfinite(o.float()).all()
    # close to the fp32 computation on the same (rounded) inputs
    ro, rs = recurrent_gated_delta_rule(*[x.detach().float() for x in bf], initial_state=s0.detach())
    torch.testing.assert_close(o.float(), ro, rtol=0, atol=5e-2)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)
    (o.float().sum() + s.sum()).backward()
    assert all(x.grad is not None and x.grad.dtype == torch.bfloat16 for x in bf)
    assert s0.grad.dtype == torch.float32
    # the reference and the dispatcher (torch on CPU) follow the same dtype rules
    ro2, rs2 = recurrent_gated_delta_rule(*bf, initial_state=s0)
    assert ro2.dtype == torch.bfloat16 and rs2.dtype == torch.float32
    do, ds = gated_delta_rule(*bf, initial_state=s0)
    assert do.dtype == torch.bfloat16 and ds.dtype == torch.float32


def test_fp32_state_with_float64_inputs_is_promoted():
    q, k, v, g, beta, s0 = make_inputs(T=10)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0.detach().float())
    assert o.dtype == s.dtype == D64


def test_dispatcher_on_cpu_never_touches_fla(monkeypatch):
    def boom(*_):
        raise AssertionError("fla must not be imported for CPU tensors")

    monkeypatch.setattr(deltanet, "_load_fla", boom)
    inputs = make_inputs(T=30)
    o, s = run(gated_delta_rule, inputs)
    co, cs = run(chunk_gated_delta_rule, inputs)
    torch.testing.assert_close(o, co, rtol=0, atol=0)
    torch.testing.assert_close(s, cs, rtol=0, atol=0)
    with pytest.raises(ValueError, match="fla"):
        run(gated_delta_rule, inputs, backend="fla")
    with pytest.raises(ValueError, match="'triton'"):
        run(gated_delta_rule, inputs, backend="triton")


def test_bad_shapes_raise():
    q, k, v, g, beta, s0 = make_inputs(T=10)
    with pytest.raises(ValueError, match="initial_state"):
        chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0[:, :, :4])
    with pytest.raises(ValueError, match="beta"):
        chunk_gated_delta_rule(q, k, v, g, beta[:, :5])
    with pytest.raises(ValueError, match="multiple"):
        chunk_gated_delta_rule(q, k, torch.randn(2, 10, 3, 6, dtype=D64), g, beta)
    with pytest.raises(ValueError, match="chunk_size"):
        chunk_gated_delta_rule(q, k, v, g, beta, chunk_size=0)


# --- per-channel gates (Kimi Delta Attention) ------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 5, 64, 65, 130])
@pytest.mark.parametrize("chunk_size", [16, 48, 64])  # 48, 64: sub-chunks of 16 (3 and 4), matmuls across them
@pytest.mark.parametrize("h0", [False, True])
def test_per_channel_chunked_matches_recurrent(T, chunk_size, h0):
    inputs = make_inputs(T=T, h0=h0, seed=T, channels=True)
    o, s = run(chunk_gated_delta_rule, inputs, chunk_size=chunk_size)
    ro, rs = run(recurrent_gated_delta_rule, inputs)
    assert o.shape == ro.shape == inputs[2].shape and s.shape == (2, 2, 8, 6)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    assert_all_close(grads(o, s, inputs), grads(ro, rs, inputs), **GTOL)


def test_per_channel_gate_equal_across_channels_is_the_per_head_rule():
    """A per-channel gate that is the same on every key channel is the per-head rule: outputs, state, gradients
    (g's summed over the channels)."""
    inputs = make_inputs(T=70, Hk=1, H=2, seed=8)
    q, k, v, g, beta, s0 = inputs
    gc = g.detach()[..., None].expand(*g.shape, q.shape[-1]).contiguous().requires_grad_()
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, chunk_size=16)
    oc, sc = chunk_gated_delta_rule(q, k, v, gc, beta, initial_state=s0, chunk_size=16)
    torch.testing.assert_close(oc, o, **TOL)
    torch.testing.assert_close(sc, s, **TOL)
    want = grads(o, s, inputs)
    got = grads(oc, sc, [q, k, v, gc, beta, s0])
    assert_all_close([*got[:3], got[3].sum(-1), *got[4:]], want, **GTOL)


@pytest.mark.parametrize("chunk_size,block_tokens", [(1, None), (7, None), (8, 16), (16, 1)])
def test_per_channel_odd_chunk_and_block_sizes_and_grouped_heads(chunk_size, block_tokens):
    inputs = make_inputs(T=45, Hk=1, H=3, seed=3, channels=True)
    o, s = run(chunk_gated_delta_rule, inputs, chunk_size=chunk_size, block_tokens=block_tokens, scale=0.3)
    ro, rs = run(recurrent_gated_delta_rule, inputs, scale=0.3)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    assert_all_close(grads(o, s, inputs), grads(ro, rs, inputs), **GTOL)


@pytest.mark.parametrize("pieces", [[1, 36], [5, 17, 15]])
@pytest.mark.parametrize("fn", [chunk_gated_delta_rule, recurrent_gated_delta_rule])
def test_per_channel_transfer_form_and_pieces(pieces, fn):
    """Pieces carried final_state -> initial_state, and pieces run from unknown states in transfer form and composed,
    equal one call with per-channel gates: outputs, final state and every gradient."""
    inputs = make_inputs(T=37, Hk=1, H=2, seed=12, channels=True)
    q, k, v, g, beta, s0 = inputs
    dk, dv = q.shape[-1], v.shape[-1]
    kw = dict(chunk_size=8) if fn is chunk_gated_delta_rule else {}
    o, s = fn(q, k, v, g, beta, initial_state=s0, **kw)
    carried, composed, state, state2, t0 = [], [], s0, s0, 0
    for n in pieces:
        sl = slice(t0, t0 + n)
        oi, state = fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=state, **kw)
        carried.append(oi)
        v2, init = deltanet.transfer_inputs(v[:, sl], dk)
        o_full, S_full = fn(q[:, sl], k[:, sl], v2, g[:, sl], beta[:, sl], initial_state=init, **kw)
        oi2, state2 = deltanet.apply_initial(o_full, S_full, state2, dv)
        composed.append(oi2)
        t0 += n
    want = grads(o, s, inputs)
    for outs, final in ((carried, state), (composed, state2)):
        po = torch.cat(outs, dim=1)
        torch.testing.assert_close(po, o, **TOL)
        torch.testing.assert_close(final, s, **TOL)
        assert_all_close(grads(po, final, inputs), want, **GTOL)


@pytest.mark.parametrize("T,chunk_size,block_tokens", [(37, 8, 16), (130, 16, 32), (150, 32, 64)])
def test_per_channel_recomputed_backward_equals_plain_autograd(T, chunk_size, block_tokens):
    inputs = make_inputs(T=T, Hk=1, H=2, seed=T, channels=True)
    kw = dict(chunk_size=chunk_size, block_tokens=block_tokens)
    o, s = run(chunk_gated_delta_rule, inputs, recompute=False, **kw)
    o2, s2 = run(chunk_gated_delta_rule, inputs, **kw)
    assert type(o2.grad_fn).__name__ == "_RecomputedBlocksBackward"
    assert torch.equal(o, o2) and torch.equal(s, s2)
    for a, b in zip(grads(o, s, inputs), grads(o2, s2, inputs)):
        assert torch.equal(a, b)


def test_per_channel_bad_gate_shape_raises():
    q, k, v, g, beta, s0 = make_inputs(T=10, channels=True)
    with pytest.raises(ValueError, match=r"g must be \[B, T, H\].*\[B, T, H, Dk\]"):
        chunk_gated_delta_rule(q, k, v, g[..., :3], beta)


def test_per_channel_bf16_gives_fp32_state():
    fp = make_inputs(T=70, dtype=torch.float32, seed=7, channels=True)
    bf = [x.detach().to(torch.bfloat16) if i != 3 else x.detach() for i, x in enumerate(fp[:5])]
    o, s = chunk_gated_delta_rule(*bf, initial_state=fp[5].detach(), chunk_size=16)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    ro, rs = recurrent_gated_delta_rule(*[x.float() for x in bf], initial_state=fp[5].detach())
    torch.testing.assert_close(o.float(), ro, rtol=0, atol=5e-2)
    torch.testing.assert_close(s, rs, rtol=1e-4, atol=1e-4)


# --- parity with transformers' Qwen3-Next ------------------------------------------------------------------------

hf = pytest.importorskip("transformers.models.qwen3_next.modeling_qwen3_next")


def _hf_float64(fn):
    """transformers' torch fallback with its hard-coded float32 cast turned into float64, for exact comparison.

    It is the same code object run against a `torch` whose `float32` is float64; everything else is torch.
    """
    fn = getattr(fn, "__wrapped__", fn)  # the plain torch function under the hub-kernel decorator

    class _Torch64:
        float32 = torch.float64

        def __getattr__(self, name):
            return getattr(torch, name)

    glb = dict(fn.__globals__)
    glb["torch"] = _Torch64()
    return types.FunctionType(fn.__code__, glb, fn.__name__, fn.__defaults__, fn.__closure__)


HF_CHUNK = _hf_float64(hf.torch_chunk_gated_delta_rule)
HF_RECURRENT = _hf_float64(hf.torch_recurrent_gated_delta_rule)


def _hf_run(fn, inputs, l2norm, **kw):
    q, k, v, g, beta, *s0 = inputs  # transformers: positional q, k, v, g, beta; same [B, T, H, D] layout
    return fn(
        q, k, v, g, beta, initial_state=s0[0] if s0 else None, output_final_state=True,
        use_qk_l2norm_in_kernel=l2norm, **kw,
    )


@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("Hk,H", [(2, 2), (1, 3)])
@pytest.mark.parametrize("h0", [False, True])
@pytest.mark.parametrize("l2norm", [True, False])
def test_matches_transformers_float64(T, Hk, H, h0, l2norm):
    inputs = make_inputs(T=T, Hk=Hk, H=H, h0=h0, l2norm=l2norm, seed=10 + T)
    o, s = run(chunk_gated_delta_rule, inputs, use_qk_l2norm=l2norm)
    ho, hs = _hf_run(HF_CHUNK, inputs, l2norm, chunk_size=64)
    assert ho.dtype == hs.dtype == D64  # the shim really computed in float64
    torch.testing.assert_close(o, ho, **TOL)
    torch.testing.assert_close(s, hs, **TOL)
    ro, rs = _hf_run(HF_RECURRENT, inputs, l2norm)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    assert_all_close(grads(o, s, inputs), grads(ho, hs, inputs), **GTOL)


def test_matches_transformers_as_shipped_float32():
    """The unpatched transformers functions (they compute in float32) on float32 inputs."""
    inputs = make_inputs(T=100, Hk=1, H=2, dtype=torch.float32, seed=20)
    o, s = run(chunk_gated_delta_rule, inputs)
    for fn in (hf.torch_chunk_gated_delta_rule.__wrapped__, hf.torch_recurrent_gated_delta_rule.__wrapped__):
        ho, hs = _hf_run(fn, inputs, True)
        assert ho.dtype == hs.dtype == torch.float32
        torch.testing.assert_close(o, ho, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(s, hs, rtol=1e-5, atol=1e-5)


def test_meta_shortcut_changes_no_tracked_byte(monkeypatch):
    """On the meta device without autograd the chunked op skips the middle blocks' arithmetic (the planner's
    prefill dry runs); the live bytes it leaves and their peak are those of the full computation, for the op and
    for a whole plan of a hybrid model whose DeltaNet layer runs several blocks per prefill chunk."""
    import longstraw.ops.deltanet as dn
    from longstraw.ops import meta
    from longstraw.models.qwen_hybrid import tiny_config
    from longstraw.planner import LiveBytes, plan

    def op_bytes():
        q, k = (torch.empty(1, 1000, 4, 16, device="meta") for _ in range(2))
        v = torch.empty(1, 1000, 4, 24, device="meta")
        g, beta = (torch.empty(1, 1000, 4, device="meta") for _ in range(2))
        with torch.no_grad(), LiveBytes() as lb:
            o, s = dn.chunk_gated_delta_rule(q, k, v, g, beta, block_tokens=128)
            live = lb.live
        return lb.peak, live, tuple(o.shape), tuple(s.shape)

    cfg = tiny_config(num_hidden_layers=2, full_attention_interval=2, linear_num_key_heads=8,
                      linear_num_value_heads=8, linear_key_head_dim=64, linear_value_head_dim=64)
    from longstraw import GRPOConfig

    kw = dict(prompt_len=9000, response_len=16, group=2, dtype="float32")
    fast = [op_bytes()] + [plan(cfg, cfg=GRPOConfig(prompt_grad=m, prefill_chunk=4096), **kw).breakdown
                           for m in ("detached", "exact")]
    monkeypatch.setattr(meta, "SHORTCUTS", False)
    slow = [op_bytes()] + [plan(cfg, cfg=GRPOConfig(prompt_grad=m, prefill_chunk=4096), **kw).breakdown
                           for m in ("detached", "exact")]
    assert fast == slow


@pytest.mark.parametrize("T,chunk_size,block_tokens", [(1, 16, 16), (37, 8, 16), (130, 16, 32), (200, 64, None),
                                                       (513, 16, 64)])
@pytest.mark.parametrize("Hk,H", [(2, 2), (1, 3)])
def test_recomputed_backward_equals_plain_autograd(T, chunk_size, block_tokens, Hk, H):
    """The recomputing backward runs the plain path's ops block by block: the same outputs and the same gradients,
    bit for bit, over padding, one or many blocks and grouped value heads."""
    inputs = make_inputs(T=T, Hk=Hk, H=H, seed=T + H)
    kw = dict(chunk_size=chunk_size, block_tokens=block_tokens)
    o, s = run(chunk_gated_delta_rule, inputs, recompute=False, **kw)
    o2, s2 = run(chunk_gated_delta_rule, inputs, **kw)  # the default when a graph is recorded
    assert type(o2.grad_fn).__name__ == "_RecomputedBlocksBackward" and o.grad_fn is not None
    assert torch.equal(o, o2) and torch.equal(s, s2)
    for a, b in zip(grads(o, s, inputs), grads(o2, s2, inputs)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("which", ["o", "state", "both"])
@pytest.mark.parametrize("grad_of", ["all", "v", "initial_state", "q_and_g", "no_initial_state"])
def test_recomputed_backward_partial_uses_and_partial_grads(which, grad_of):
    """Only the output, only the final state or both reach the loss; only some inputs require a gradient (the
    others get none), with and without a carried state; bf16 inputs with an fp32 carried state."""
    names = ["q", "k", "v", "g", "beta", "initial_state"]
    fp = make_inputs(T=90, seed=11, dtype=torch.float32)
    want = {"all": names, "v": ["v"], "initial_state": ["initial_state"], "q_and_g": ["q", "g"],
            "no_initial_state": names[:5]}[grad_of]
    xs = [x.detach().to(torch.bfloat16) if i < 5 else x.detach() for i, x in enumerate(fp)]
    xs = [x.requires_grad_(n in want) for n, x in zip(names, xs)]
    if grad_of == "no_initial_state":
        xs[5] = None
    results = []
    for recompute in (False, True):
        o, s = chunk_gated_delta_rule(*xs[:5], initial_state=xs[5], chunk_size=16, block_tokens=32,
                                      recompute=recompute)
        loss = {"o": o.float().square().sum(), "state": s.square().sum(),
                "both": o.float().square().sum() + s.square().sum()}[which]
        leaves = [x for x in xs if x is not None and x.requires_grad]
        got = torch.autograd.grad(loss, leaves, allow_unused=True)
        # an input the used outputs do not depend on (q without the output): None in plain autograd, zeros here
        results.append([torch.zeros_like(x) if gx is None else gx for x, gx in zip(leaves, got)])
    for a, b in zip(*results):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)


def test_recomputed_backward_holds_inputs_and_block_states_only():
    """What a recorded call keeps for its backward: the inputs and one compute-dtype state per block (plain
    autograd keeps every block's intermediates, many times more)."""
    B, T, Hk, H, Dk, Dv, blk = 1, 512, 2, 4, 16, 16, 64
    inputs = make_inputs(B=B, T=T, Hk=Hk, H=H, Dk=Dk, Dv=Dv, dtype=torch.float32, seed=2)

    def held(recompute):
        seen = {}

        def pack(t):
            seen.setdefault(t.untyped_storage().data_ptr(), t.untyped_storage().nbytes())
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run(chunk_gated_delta_rule, inputs, chunk_size=16, block_tokens=blk, recompute=recompute)
        own = {x.untyped_storage().data_ptr() for x in inputs}
        return sum(n for p, n in seen.items() if p not in own)

    states = (T // blk - 1) * B * H * Dk * Dv * 4  # the first block's entering state is the given one
    assert held(True) == states
    assert held(False) > 20 * states


def test_recomputed_backward_is_first_order_only():
    inputs = make_inputs(T=20)
    o, s = run(chunk_gated_delta_rule, inputs)
    (gq,) = torch.autograd.grad(o.sum() + s.sum(), inputs[:1], create_graph=True)
    assert not gq.requires_grad  # no graph of the backward: a second derivative raises instead of being wrong
    with pytest.raises(RuntimeError):
        torch.autograd.grad(gq.sum(), inputs[:1])
    o, s = run(chunk_gated_delta_rule, inputs, recompute=False)  # plain autograd: second derivatives too
    (gq,) = torch.autograd.grad(o.sum() + s.sum(), inputs[:1], create_graph=True)
    torch.autograd.grad(gq.sum(), inputs[:1])


def test_kernel_choice_rule():
    """"auto": fla for CUDA bf16/fp16 when it imports, else torch (on CUDA with a warning, see the dispatcher);
    "fla" refuses what fla cannot take; an unknown backend is named."""
    from longstraw.ops.deltanet import choose_kernel, delta_rule_kernel

    bf16, fp32 = torch.bfloat16, torch.float32
    assert choose_kernel("auto", "cuda", bf16, True) == "fla"
    assert choose_kernel("auto", "cuda", bf16, False) == "torch"
    assert choose_kernel("auto", "cuda", fp32, True) == "torch"
    assert choose_kernel("auto", "cpu", bf16, True) == "torch"
    assert choose_kernel("torch", "cuda", bf16, True) == "torch"
    assert choose_kernel("fla", "cuda", torch.float16, True) == "fla"
    with pytest.raises(ValueError, match="backend='fla' needs CUDA bf16/fp16"):
        choose_kernel("fla", "cuda", fp32, True)
    with pytest.raises(ValueError, match="backend must be one of"):
        choose_kernel("triton", "cuda", bf16, True)
    assert delta_rule_kernel("cpu", bf16) == "torch"  # never imports fla for a CPU device


def _fake_fla(monkeypatch, hopper: bool, triton_version: str, tilelang: bool | None):
    """fla's flags, its TileLang backend (None: not importable) and triton as modules, for fla_backward_refusal."""
    import sys
    import types

    from longstraw.ops import deltanet as ops_dn

    v = tuple(int(x) for x in triton_version.split("."))
    utils = types.SimpleNamespace(IS_NVIDIA_HOPPER=hopper, TRITON_ABOVE_3_4_0=v >= (3, 4, 0),
                                  TRITON_ABOVE_3_7_1=v >= (3, 7, 1))
    mods = {"fla": types.ModuleType("fla"), "fla.utils": types.ModuleType("fla.utils"),
            "triton": types.ModuleType("triton")}
    mods["fla.utils"].__dict__.update(vars(utils))
    mods["triton"].__version__ = triton_version
    if tilelang is not None:
        mod = types.ModuleType("fla.ops.common.backends.tilelang")
        mod.CommonTileLangBackend = types.SimpleNamespace(can_use=lambda: tilelang)
        mods["fla.ops.common.backends.tilelang"] = mod
    else:
        mods["fla.ops.common.backends.tilelang"] = None  # import raises ImportError
    for name, m in mods.items():
        monkeypatch.setitem(sys.modules, name, m)
    ops_dn.fla_backward_refusal.cache_clear()
    monkeypatch.setattr(ops_dn, "fla_available", lambda channels=False: True)
    return ops_dn


@pytest.mark.parametrize("hopper,version,tilelang,refuses", [
    (True, "3.6.0", None, True),     # the H200 of 2026-12-04: torch 2.11's Triton 3.6, no tilelang
    (True, "3.6.0", False, True),    # tilelang present but unusable (no nvcc)
    (True, "3.6.0", True, False),    # fla dispatches the gated backward to TileLang
    (True, "3.7.1", None, False),    # the fixed Triton
    (True, "3.3.1", None, False),    # before the regression
    (False, "3.6.0", None, False),   # not a Hopper GPU
])
def test_fla_backward_refusal_mirrors_flas_guard(monkeypatch, hopper, version, tilelang, refuses):
    """fla-core 0.6 raises in its gated backward on Hopper with Triton 3.4-3.7.0 unless TileLang takes it: the
    dispatcher reads the same flags, and a pass that needs a gradient takes the torch rule (forward-only calls keep
    fla)."""
    ops_dn = _fake_fla(monkeypatch, hopper, version, tilelang)
    try:
        why = ops_dn.fla_backward_refusal()
        assert (why is not None) == refuses
        if refuses:
            assert f"Triton {version}" in why and "#640" in why
        bf16 = torch.bfloat16
        assert ops_dn.delta_rule_kernel("cuda", bf16) == "fla"
        assert ops_dn.delta_rule_kernel("cuda", bf16, needs_grad=True) == ("torch" if refuses else "fla")
        assert ops_dn.delta_rule_kernel("cuda", torch.float32, needs_grad=True) == "torch"
    finally:
        ops_dn.fla_backward_refusal.cache_clear()


def test_fla_backward_refusal_without_the_flags(monkeypatch):
    """An fla without the guard's flags (older or newer releases) has no refusal."""
    import sys
    import types

    from longstraw.ops import deltanet as ops_dn

    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.utils", types.ModuleType("fla.utils"))
    ops_dn.fla_backward_refusal.cache_clear()
    try:
        assert ops_dn.fla_backward_refusal() is None
    finally:
        ops_dn.fla_backward_refusal.cache_clear()


def test_backend_from_the_environment(monkeypatch):
    """LONGSTRAW_DELTA_RULE picks the chunked rule's backend of the models' calls ("torch" rules fla out on a GPU
    where it misbehaves); anything else is one error naming the variable and the allowed values."""
    ops_dn = _fake_fla(monkeypatch, False, "3.7.1", None)  # an importable fla whose backward runs
    bf16 = torch.bfloat16
    monkeypatch.delenv("LONGSTRAW_DELTA_RULE", raising=False)
    assert ops_dn.default_backend() == "auto" and ops_dn.delta_rule_kernel("cuda", bf16) == "fla"
    monkeypatch.setenv("LONGSTRAW_DELTA_RULE", "torch")
    assert ops_dn.default_backend() == "torch" and ops_dn.delta_rule_kernel("cuda", bf16) == "torch"
    monkeypatch.setenv("LONGSTRAW_DELTA_RULE", " FLA ")
    assert ops_dn.delta_rule_kernel("cuda", bf16) == "fla"
    with pytest.raises(ValueError, match="backend='fla' needs CUDA bf16/fp16"):
        ops_dn.delta_rule_kernel("cpu", bf16)
    monkeypatch.setenv("LONGSTRAW_DELTA_RULE", "triton")
    with pytest.raises(ValueError, match=r"LONGSTRAW_DELTA_RULE='triton' is not a delta-rule backend; allowed: "
                                         r"auto, torch, fla"):
        ops_dn.default_backend()


def test_fla_backward_check_sends_a_failing_shape_to_the_torch_rule(monkeypatch):
    """fla's backward is checked once per (device, dtype, gate kind, heads, Dk, Dv) before a pass that needs a
    gradient takes it: a failed check sends "auto" to the torch rule (forward-only calls keep fla) and makes "fla"
    raise, naming the tensor and the shape; a shape that passes keeps fla; a call without a shape (the planner's
    question) is not checked; an exception in fla's kernels is a failed check."""
    ops_dn = _fake_fla(monkeypatch, False, "3.7.1", None)  # an importable fla without a guard that fires
    seen = []

    def errors(device, dtype, channels, heads, dk, dv):
        seen.append((device.type, dtype, channels, heads, dk, dv))
        return {"out": 1e-3, "dk": 0.6 if dk == 128 else 1e-3, "dg": 2e-3}

    monkeypatch.setattr(ops_dn, "fla_backward_errors", errors)
    monkeypatch.setattr(ops_dn, "_on_own_thread", lambda device, fn: fn())  # no CUDA device to make current here
    ops_dn.fla_backward_check.cache_clear()
    try:
        bf16, big = torch.bfloat16, (32, 128, 128)
        assert ops_dn.delta_rule_kernel("cuda", bf16, True, shape=big) == "torch"
        assert ops_dn.delta_rule_kernel("cuda", bf16, True, channels=True, shape=big) == "torch"
        assert ops_dn.delta_rule_kernel("cuda", bf16, True, shape=(4, 64, 64)) == "fla"
        assert ops_dn.delta_rule_kernel("cuda", bf16, False, shape=big) == "fla"  # forward-only: not checked
        assert ops_dn.delta_rule_kernel("cuda", bf16, True) == "fla"  # no shape: not checked
        assert ops_dn.delta_rule_kernel("cuda:0", bf16, True, shape=big) == "torch"
        assert ops_dn.delta_rule_kernel("cuda", torch.float32, True, shape=big) == "torch"  # fla never takes fp32
        assert seen == [("cuda", bf16, False, *big), ("cuda", bf16, True, *big), ("cuda", bf16, False, 4, 64, 64),
                        ("cuda", bf16, False, *big)]  # cached per device ("cuda" and "cuda:0" are two)
        why = ops_dn.fla_backward_check(torch.device("cuda"), bf16, True, *big)
        assert why.startswith("fla's chunk_kda at 32 heads, Dk=128, Dv=128 in bfloat16 on cuda disagrees") and \
            "dk 0.6 off" in why and "bound 0.05" in why and "dg" not in why
        with pytest.raises(RuntimeError, match="cannot take a pass that needs a gradient here: fla's "
                                               "chunk_gated_delta_rule at 32 heads, Dk=128"):
            ops_dn.delta_rule_kernel("cuda", bf16, True, backend="fla", shape=big)
        assert ops_dn.delta_rule_kernel("cuda", bf16, True, backend="fla", shape=(4, 64, 64)) == "fla"

        def broken(*args):
            raise RuntimeError("PTX assembly failed")

        monkeypatch.setattr(ops_dn, "fla_backward_errors", broken)
        ops_dn.fla_backward_check.cache_clear()
        assert ops_dn.fla_backward_check(torch.device("cuda"), torch.float16, False, 2, 16, 16) == (
            "fla's chunk_gated_delta_rule at 2 heads, Dk=16, Dv=16 in float16 on cuda raised RuntimeError in its "
            "check: PTX assembly failed")
    finally:
        ops_dn.fla_backward_check.cache_clear()


def test_fla_backward_check_runs_apart_from_the_calling_context(monkeypatch):
    """The check runs inside whatever model call first needs it: none of that call's thread-local state reaches it
    (saved-tensor hooks that refuse every tensor, no_grad, autocast to bfloat16 here), and it still measures and
    passes."""
    from longstraw.ops import deltanet as ops_dn

    monkeypatch.setattr(ops_dn, "_fla_call", lambda q, k, v, g, beta, **kw: chunk_gated_delta_rule(q, k, v, g, beta,
                                                                                                    **kw))
    monkeypatch.setattr(ops_dn, "FLA_CHECK_TOKENS", 40)

    def refuse(t):
        raise AssertionError("the check's tensors reached the caller's saved-tensor hooks")

    ops_dn.fla_backward_check.cache_clear()
    try:
        with torch.autograd.graph.saved_tensors_hooks(refuse, refuse), torch.no_grad(), \
                torch.autocast("cpu", dtype=torch.bfloat16):
            assert ops_dn.fla_backward_check(torch.device("cpu"), torch.float16, True, 2, 16, 8) is None
    finally:
        ops_dn.fla_backward_check.cache_clear()


@pytest.mark.parametrize("channels", [False, True])
def test_fla_backward_errors_see_a_wrong_gradient(monkeypatch, channels):
    """The check's measurement on this CPU, with the torch rule standing in for fla (float16 inputs, the rule
    computing in float32): every output and gradient within the bound; the same with k's gradient halved in the
    "kernel": dk off by 0.5, the others still within it."""
    from longstraw.ops import deltanet as ops_dn

    def as_fla(q, k, v, g, beta, *, scale, initial_state, output_final_state, use_qk_l2norm, halve_dk=False):
        assert g.dtype == torch.float32 and g.dim() == (4 if channels else 3) and initial_state.dtype == torch.float32
        return chunk_gated_delta_rule(q, HalfGradient.apply(k) if halve_dk else k, v, g, beta, scale=scale,
                                      initial_state=initial_state, output_final_state=output_final_state,
                                      use_qk_l2norm=use_qk_l2norm)

    tol = ops_dn.FLA_CHECK_TOL[torch.float16]
    monkeypatch.setattr(ops_dn, "_fla_call", as_fla)
    errs = ops_dn.fla_backward_errors(torch.device("cpu"), torch.float16, channels, 2, 16, 8)
    assert set(errs) == {"out", "state", "dq", "dk", "dv", "dg", "dbeta", "dstate"}
    assert max(errs.values()) <= tol / 3, errs
    monkeypatch.setattr(ops_dn, "_fla_call", lambda *a, **kw: as_fla(*a, **kw, halve_dk=True))
    errs = ops_dn.fla_backward_errors(torch.device("cpu"), torch.float16, channels, 2, 16, 8)
    assert errs["dk"] == pytest.approx(0.5, abs=0.01) and max(v for n, v in errs.items() if n != "dk") <= tol / 3


# --- parity with transformers' Kimi-Linear (per-channel gates) ------------------------------------------------------

kimi = pytest.importorskip("transformers.models.kimi_linear.modeling_kimi_linear")
KIMI_CHUNK = _hf_float64(kimi.chunk_kimi_delta_attention)
KIMI_RECURRENT = _hf_float64(kimi.recurrent_kimi_delta_attention)


@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("h0", [False, True])
def test_per_channel_matches_transformers_kimi_float64(T, h0):
    """transformers' Kimi Delta Attention (its torch chunked and recurrent forms, run in float64) equals ours with
    per-channel gates: outputs, final state, gradients."""
    from hf_reference import true_float64  # its chunked form also casts with Tensor.float()

    inputs = make_inputs(T=T, Hk=2, H=2, h0=h0, seed=30 + T, channels=True)
    o, s = run(chunk_gated_delta_rule, inputs)
    with true_float64():
        ho, hs = _hf_run(KIMI_CHUNK, inputs, True)
    assert ho.dtype == hs.dtype == D64
    torch.testing.assert_close(o, ho, **TOL)
    torch.testing.assert_close(s, hs, **TOL)
    ro, rs = _hf_run(KIMI_RECURRENT, inputs, True)
    torch.testing.assert_close(o, ro, **TOL)
    torch.testing.assert_close(s, rs, **TOL)
    assert_all_close(grads(o, s, inputs), grads(ho, hs, inputs), **GTOL)
