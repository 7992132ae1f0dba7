"""MLA latent prompt state and DSA pieces at the layer level: both attention forms against a decompress-everything
reference (outputs, parameter gradients and the gradient collected in the state's sink), the decoder, the byte
formulas, the sparse attention op against a gather reference, the indexer's selection, the softmax scale."""

import math

import pytest
import torch

from longstraw.models import dsa
from longstraw.models.context import CallContext
from longstraw.models.dsa import Indexer, IndexedLatentState
from longstraw.models.mla import LatentDecoder, LatentState, MLAttention, mla_softmax_scale, set_mla_mode
from longstraw.models.rope import RopeParams, RotaryEmbedding, apply_rope_interleaved
from longstraw.ops.attention import KVSegment

F64 = torch.float64
H, R, DN, DR, DV, HID = 3, 10, 6, 4, 5, 16


pytestmark = pytest.mark.usefixtures("one_thread")  # tiny tensors: see conftest.py


def _layer(q_lora=7, seed=0, interleave=True):
    torch.manual_seed(seed)
    m = MLAttention(HID, H, q_lora_rank=q_lora, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=DR,
                    v_head_dim=DV, scale=(DN + DR) ** -0.5 * 1.3, bias=True, rope_interleave=interleave).to(F64)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.4) if p.dim() >= 2 else p.add_(torch.randn_like(p) * 0.1)
    return m


ROTARY = RotaryEmbedding(RopeParams("default", 1000.0, DR, {}))


def rope(start, n):
    """The per-call context a layer receives at positions ``start .. start + n - 1``."""
    return CallContext(start, n, *ROTARY(torch.arange(start, start + n), F64))


def reference(layer, x, detach=0):
    """Decompress every position, dense causal softmax, plain autograd. The latents of the first ``detach``
    positions are a leaf (as the prefilled prompt state is); returns (y, that leaf)."""
    b, s, _ = x.shape
    q_nope, q_pe, lat, _ = layer.project(x, rope(0, s))
    leaf = lat[:, :, :detach].detach().requires_grad_(True)
    lat = torch.cat((leaf, lat[:, :, detach:]), dim=2)
    kv = layer.kv_b_proj(lat[:, 0, :, :R]).view(b, s, H, DN + DV).transpose(1, 2)
    k = torch.cat((kv[..., :DN], lat[:, :, :, R:].expand(b, H, s, DR)), dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    scores = (q @ k.transpose(-1, -2)) * layer.scale
    scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    o = torch.softmax(scores, -1) @ kv[..., DN:]
    return layer.o_proj(o.transpose(1, 2).reshape(b, s, H * DV)), leaf


def prefill(layer, x_prompt, chunk):
    st = layer.new_state(x_prompt.shape[1])
    with torch.no_grad():
        for s in range(0, x_prompt.shape[1], chunk):
            e = min(x_prompt.shape[1], s + chunk)
            _, piece = layer(x_prompt[:, s:e], rope(s, e - s), st.prefix(s, False))
            st.write(piece, s, e)
    return st


@pytest.mark.parametrize("mode,chunk,rows", [("absorbed", None, None), ("decompressed", None, None),
                                             ("decompressed", 2, None), ("decompressed", 2, 1), ("auto", 3, None)])
@pytest.mark.parametrize("q_lora,interleave,threads", [(7, True, 1), (None, False, 3)])
def test_forms_equal_decompressed_reference_with_sink(mode, chunk, rows, q_lora, interleave, threads, monkeypatch):
    """Two branches over a shared 9-position prompt prefilled in chunks of 4: outputs, parameter and input
    gradients, and the gradient the sink collects for the prompt latents equal a full decompressed graph.
    ``threads=3``: the absorbed backward spreads the latent key head over 3 stride-0 views. ``rows=1``: the
    decompressed form runs one query row per kernel call (its query blocks, as a context-parallel step's many
    queries run), merging each chunk's partials block by block."""
    monkeypatch.setattr(torch, "get_num_threads", lambda: threads)
    if rows is not None:
        from longstraw.models import mla

        monkeypatch.setattr(mla, "_QUERY_ELEMS", 2 * H * max(DN + DR, DV) * rows)  # 2 branches x rows x H x D
    layer = _layer(q_lora, interleave=interleave)
    layer.set_mode(mode)
    layer.decompress_chunk = chunk
    g = torch.Generator().manual_seed(1)
    xp = torch.randn(1, 9, HID, generator=g, dtype=F64)
    xb = torch.randn(2, 4, HID, generator=g, dtype=F64, requires_grad=True)
    w = torch.randn(2, 4, HID, generator=g, dtype=F64)

    full = torch.cat((xp.expand(2, -1, -1), xb), dim=1)
    y_ref, leaf = reference(layer, full, detach=9)
    (y_ref[:, 9:] * w).sum().backward()
    want = {n: p.grad.clone() for n, p in layer.named_parameters()}
    want_x, want_sink = xb.grad.clone(), leaf.grad.sum(0, keepdim=True)
    layer.zero_grad()
    xb.grad = None

    st = prefill(layer, xp, 4)
    st.enable_grad()
    y, piece = layer(xb, rope(9, 4), st.prefix(9, grad=True))
    assert piece.shape == (2, 1, 4, R + DR)
    torch.testing.assert_close(y, y_ref[:, 9:], rtol=0, atol=1e-12)
    (y * w).sum().backward()
    for n, p in layer.named_parameters():
        torch.testing.assert_close(p.grad, want[n], rtol=0, atol=1e-11, msg=n)
    torch.testing.assert_close(xb.grad, want_x, rtol=0, atol=1e-11)
    torch.testing.assert_close(st.grad, want_sink, rtol=0, atol=1e-11)
    assert st.lat.grad is None and not st.lat.requires_grad  # the stored latents never enter a graph


@pytest.mark.parametrize("mode", ["absorbed", "decompressed", "auto"])
def test_chunked_prefill_and_decoder_equal_the_full_forward(mode):
    layer = _layer()
    layer.set_mode(mode)
    g = torch.Generator().manual_seed(2)
    xp = torch.randn(1, 11, HID, generator=g, dtype=F64)
    xg = torch.randn(3, 4, HID, generator=g, dtype=F64)  # 3 branches, 4 decoded tokens each
    with torch.no_grad():
        want, _ = reference(layer, torch.cat((xp.expand(3, -1, -1), xg), dim=1))
        st = prefill(layer, xp, 3)
        assert st.length == 11
        dec = st.decoder(3, 4)
        assert isinstance(dec, LatentDecoder)
        outs = []
        for step in range(4):
            y, piece = layer(xg[:, step : step + 1], rope(11 + step, 1), dec.prefix(step))
            dec.append(piece, step)
            outs.append(y)
        torch.testing.assert_close(torch.cat(outs, 1), want[:, 11:], rtol=0, atol=1e-12)
        dec.select(torch.tensor([2, 0]))  # finished branch 1 dropped
        assert dec.lat.shape[0] == 2 and torch.equal(dec.prefix(4)[0].k, st.lat)  # prompt read in place


def test_state_bytes_per_position_and_grad_dtype():
    layer = _layer()
    for dtype in (torch.float64, torch.bfloat16):
        layer = layer.to(dtype)
        st = LatentState(13)
        with torch.no_grad():
            _, piece = layer(torch.randn(1, 13, HID, dtype=dtype), CallContext(0, 13, *ROTARY(torch.arange(13), dtype)), None)
        st.write(piece, 0, 13)
        es = torch.empty(0, dtype=dtype).element_size()
        assert st.nbytes() == 13 * (R + DR) * es == 13 * layer.state_bytes_per_position(dtype)
        st.enable_grad()
        assert st.grad.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
        assert st.grad_nbytes() == 13 * (R + DR) * st.grad.element_size()
        st.release_grad()
        assert st.grad_nbytes() == 0
    ist = IndexedLatentState(5)
    ist.write((torch.zeros(1, 1, 5, R + DR), torch.zeros(1, 5, 8)), 0, 5)
    assert ist.nbytes() == 5 * (R + DR + 8) * 4
    assert LatentState(4).prefix(0, True) == [] and LatentState(4).nbytes() == 0


# ---------------------------------------------------------------------------------------------------- DSA pieces


@pytest.mark.parametrize("interleaved,score_elems", [(False, 1 << 24), (True, 1 << 24), (False, 50)])
def test_indexer_selects_the_causal_top_scores(interleaved, score_elems, monkeypatch):
    monkeypatch.setattr(dsa, "SCORE_ELEMS", score_elems)  # 50: blocks of 2 queries, one key at a time
    torch.manual_seed(4)
    ix = Indexer(HID, 7, num_heads=32, head_dim=8, rope_dim=DR, topk=5, interleaved=interleaved).to(F64)
    with torch.no_grad():
        for p in ix.parameters():
            p.normal_(0, 0.5)
    x = torch.randn(2, 12, HID, dtype=F64)
    x[1, :5] = x[0, :5]  # a shared 5-position prompt, then per-branch tokens
    qr = torch.randn(2, 12, 7, dtype=F64)
    keys = ix.keys(x, rope(0, 12))
    # brute force over the whole sequence, the formula as written
    q = ix._rope(ix.wq_b(qr).view(2, 12, 32, 8), rope(0, 12).cos[:, None], rope(0, 12).sin[:, None])
    w = ix.weights_proj(x) * 32**-0.5
    score = torch.einsum("bth,bths->bts", w, torch.relu(torch.einsum("bthd,bsd->bths", q, keys) * 8**-0.5))
    score = score.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
    want = score.topk(5, -1)
    # the last 4 queries as a continuation of 8 prefix positions held in two segments (prompt batch 1, generated)
    sel = ix.select(x[:, 8:], qr[:, 8:], rope(8, 4), [keys[:1, :5], keys[:, 5:8]], keys[:, 8:])
    assert sel.valid.all()
    got = torch.gather(score[:, 8:], 2, sel.idx)
    torch.testing.assert_close(got.sort(-1).values, want.values[:, 8:].sort(-1).values, rtol=0, atol=1e-13)
    assert torch.equal(sel.idx.sort(-1).values, want.indices[:, 8:].sort(-1).values)  # no ties with 32 heads
    # early queries see fewer than topk keys: all causal keys valid, the rest invalid
    early = ix.select(x[:, :3], qr[:, :3], rope(0, 3), [], keys[:, :3])
    assert early.idx.shape == (2, 3, 3) and early.valid.sum(-1).tolist() == [[1, 2, 3], [1, 2, 3]]


def test_interleaved_rope_is_bit_identical_to_transformers():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    x = torch.randn(2, 3, 7, DR, dtype=torch.float32)
    k = torch.randn(2, 1, 7, DR, dtype=torch.float32)
    cos, sin = ROTARY(torch.arange(5, 12), torch.float32)
    want_q, want_k = apply_rotary_pos_emb_interleave(x, k, cos[None], sin[None])
    assert torch.equal(apply_rope_interleaved(x, cos, sin), want_q)
    assert torch.equal(apply_rope_interleaved(k, cos, sin), want_k)


def test_softmax_scale_includes_yarn_mscale_squared():
    assert mla_softmax_scale(RopeParams("default", 1e4, 64, {"mscale_all_dim": 1.0, "factor": 40}), 192) == 192**-0.5
    yarn = RopeParams("yarn", 1e4, 64, {"factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707})
    m = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert mla_softmax_scale(yarn, 192) == pytest.approx(192**-0.5 * m * m, rel=1e-15)
    assert mla_softmax_scale(RopeParams("yarn", 1e4, 64, {"factor": 40.0}), 192) == 192**-0.5  # no mscale_all_dim


def test_auto_form_follows_the_flop_count():
    """DeepSeek-V3 dims: decoding and short replays stay absorbed, long prefill chunks decompress."""
    v3 = MLAttention(64, 128, q_lora_rank=None, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64,
                     v_head_dim=128, scale=1.0, mode="auto").to("meta")
    prompt = [KVSegment(torch.empty(1, 1, 65536, 576, device="meta"), torch.empty(0))]
    prompt[0].v = prompt[0].k
    assert v3.choose_form(16, 1, prompt) == "absorbed"  # 16 branches decoding
    assert v3.choose_form(1, 64, prompt) == "absorbed"
    assert v3.choose_form(1, 4096, prompt) == "decompressed"  # a prefill chunk
    v3.set_mode("absorbed")
    assert v3.choose_form(1, 4096, prompt) == "absorbed"
    f = v3.attention_flops(1, 4096, [(1, 65536)])
    assert 0.28 < f["decompressed"] / f["absorbed"] < 0.32  # (dn+dr+dv) / 2(r+dr) = 0.28 plus the expansion


def test_bad_arguments_name_the_value():
    layer = _layer()
    with pytest.raises(ValueError, match="MLA mode 'fast' is not supported; allowed: auto, absorbed, decompressed"):
        layer.set_mode("fast")
    with pytest.raises(ValueError, match="qk_rope_head_dim=3 must be even"):
        MLAttention(HID, H, q_lora_rank=None, kv_lora_rank=R, qk_nope_head_dim=DN, qk_rope_head_dim=3,
                    v_head_dim=DV, scale=1.0)
    with pytest.raises(ValueError, match="kv_lora_rank=0 must be an integer >= 1"):
        MLAttention(HID, H, q_lora_rank=None, kv_lora_rank=0, qk_nope_head_dim=DN, qk_rope_head_dim=DR,
                    v_head_dim=DV, scale=1.0)
    with pytest.raises(ValueError, match="has no MLA layers"):
        set_mla_mode(torch.nn.Linear(2, 2), "absorbed")
    with pytest.raises(ValueError, match="decompress_chunk=0 must be an integer >= 1"):
        set_mla_mode(layer, "decompressed", decompress_chunk=0)
    assert set_mla_mode(torch.nn.Sequential(layer, _layer()), "decompressed", 8) == 2 and layer.decompress_chunk == 8
