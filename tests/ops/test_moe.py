"""MoE ops against transformers' own router / MoE-block modules and against the per-token reference loop."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.nn.functional as F

from longstraw.ops import moe
from longstraw.ops.moe import (
    experts_forward,
    experts_forward_reference,
    router_logits,
    shared_expert_forward,
    sigmoid_grouped_route,
    softmax_topk_route,
)

# --------------------------------------------------------------------------------------------------------------
# HF modules built directly from tiny configs


@contextlib.contextmanager
def hf_router_float64():
    """Make HF's router-internal float32 casts no-ops for float64 tensors (``Tensor.type(torch.float32)`` in the
    DeepSeek/GLM routers, ``softmax(..., dtype=torch.float)`` in the Qwen routers), so a float64 HF block is a
    genuine float64 computation. ``hf_reference.true_float64`` covers ``.to`` / ``.float`` only."""
    orig_type, orig_softmax = torch.Tensor.type, F.softmax

    def _type(self, dtype=None, *args, **kwargs):
        if self.dtype == torch.float64 and dtype in (torch.float32, "torch.FloatTensor"):
            return self
        return orig_type(self, dtype, *args, **kwargs)

    def _softmax(input, dim=None, _stacklevel=3, dtype=None):
        if input.dtype == torch.float64 and dtype == torch.float32:
            dtype = torch.float64
        return orig_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)

    torch.Tensor.type, F.softmax = _type, _softmax
    try:
        yield
    finally:
        torch.Tensor.type, F.softmax = orig_type, orig_softmax


def _randomise(module, std=0.3, seed=0):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in list(module.parameters()) + list(module.buffers()):
            p.copy_(torch.randn(p.shape, generator=g, dtype=p.dtype) * std)
    return module


def _qwen_block(family, norm_topk_prob=True, e=8, k=2, dtype=torch.float64, seed=0):
    if family == "qwen3_next":
        from transformers import Qwen3NextConfig
        from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextSparseMoeBlock as Block

        cfg = Qwen3NextConfig(
            hidden_size=16, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=12,
            shared_expert_intermediate_size=20, norm_topk_prob=norm_topk_prob,
        )
    else:
        from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
        from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock as Block

        cfg = Qwen3_5MoeTextConfig(
            hidden_size=16, num_experts=e, num_experts_per_tok=k, moe_intermediate_size=12,
            shared_expert_intermediate_size=20,
        )
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    return _randomise(Block(cfg), seed=seed).to(dtype), cfg


DS_FAMILIES = ["deepseek_v3", "deepseek_v32", "glm4_moe", "glm_moe_dsa"]


def _ds_block(family, e=16, k=4, n_group=4, topk_group=2, norm_topk_prob=True, scale=2.5, dtype=torch.float64,
              seed=0):
    import transformers

    cls_cfg, cls_block = {
        "deepseek_v3": ("DeepseekV3Config", "deepseek_v3.modeling_deepseek_v3.DeepseekV3MoE"),
        "deepseek_v32": ("DeepseekV32Config", "deepseek_v32.modeling_deepseek_v32.DeepseekV32MoE"),
        "glm4_moe": ("Glm4MoeConfig", "glm4_moe.modeling_glm4_moe.Glm4MoeMoE"),
        "glm_moe_dsa": ("GlmMoeDsaConfig", "glm_moe_dsa.modeling_glm_moe_dsa.GlmMoeDsaMoE"),
    }[family]
    mod_path, cls_name = cls_block.rsplit(".", 1)
    import importlib

    Block = getattr(importlib.import_module(f"transformers.models.{mod_path}"), cls_name)
    cfg = getattr(transformers, cls_cfg)(
        hidden_size=16, n_routed_experts=e, num_experts_per_tok=k, n_group=n_group, topk_group=topk_group,
        moe_intermediate_size=12, n_shared_experts=1, norm_topk_prob=norm_topk_prob, routed_scaling_factor=scale,
    )
    cfg._experts_implementation = "eager"
    torch.manual_seed(seed)
    block = _randomise(Block(cfg), seed=seed).to(dtype)
    with torch.no_grad():  # bias on the scale of the score spread, so that it changes selections
        bias = torch.randn(e, generator=torch.Generator().manual_seed(seed + 7)) * 0.2
        block.gate.e_score_correction_bias.copy_(bias)
    return block, cfg


# --------------------------------------------------------------------------------------------------------------
# Our composition of each HF block, from the HF module's tensors: what model code does.


def ours_qwen_block(block, cfg, x, norm_topk_prob):
    """Qwen3-Next / Qwen3.5-MoE: softmax router on x-dtype logits + routed experts + sigmoid-gated shared expert."""
    logits = router_logits(x, block.gate.weight, upcast=False)
    w, ids = softmax_topk_route(logits, cfg.num_experts_per_tok, norm_topk_prob)
    routed = experts_forward(x, ids, w, block.experts.gate_up_proj, block.experts.down_proj, F.silu)
    se = block.shared_expert
    shared = shared_expert_forward(
        x, se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, F.silu,
        gate_weight=block.shared_expert_gate.weight,
    )
    return routed + shared


def ours_ds_block(block, cfg, x):
    """DeepSeek-V3/V3.2, GLM-4.5, GLM-5: float32 sigmoid router + routed experts + ungated shared experts."""
    logits = router_logits(x, block.gate.weight, upcast=True)
    w, ids = sigmoid_grouped_route(
        logits, block.gate.e_score_correction_bias, cfg.num_experts_per_tok, cfg.n_group, cfg.topk_group,
        cfg.norm_topk_prob, cfg.routed_scaling_factor,
    )
    routed = experts_forward(x, ids, w, block.experts.gate_up_proj, block.experts.down_proj, F.silu)
    se = block.shared_experts
    return routed + shared_expert_forward(x, se.gate_proj.weight, se.up_proj.weight, se.down_proj.weight, F.silu)


def _grads_match(out, ref, x, block, atol):
    params = [x] + [p for p in block.parameters()]
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, params, do, allow_unused=True)
    want = torch.autograd.grad(ref, params, do, allow_unused=True)
    names = ["x"] + [n for n, _ in block.named_parameters()]
    for name, g, w in zip(names, got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            torch.testing.assert_close(g, w, rtol=0, atol=atol, msg=lambda m: f"{name}: {m}")


def _same_routing(w, ids, w_ref, ids_ref, atol):
    """Compare routing slot sets independent of slot order (sorted=False topk order is unspecified)."""
    o, o_ref = ids.sort(dim=-1), ids_ref.sort(dim=-1)
    assert torch.equal(o.values, o_ref.values)
    torch.testing.assert_close(w.gather(1, o.indices), w_ref.gather(1, o_ref.indices), rtol=0, atol=atol)


# --------------------------------------------------------------------------------------------------------------
# routers and blocks vs HF, float64


@pytest.mark.parametrize("family,norm", [("qwen3_next", True), ("qwen3_next", False), ("qwen3_5_moe", True)])
def test_qwen_router_and_block_match_hf_float64(family, norm):
    block, cfg = _qwen_block(family, norm_topk_prob=norm)
    x = torch.randn(2, 37, 16, dtype=torch.float64, requires_grad=True)
    x2 = x.view(-1, 16)
    with hf_router_float64():
        _, w_ref, ids_ref = block.gate(x2)
        ref = block(x)
    w, ids = softmax_topk_route(router_logits(x2, block.gate.weight, upcast=False), cfg.num_experts_per_tok, norm)
    assert w.dtype == torch.float64 and ids.dtype == torch.int64
    assert torch.equal(ids, ids_ref)  # sorted topk: same slot order
    torch.testing.assert_close(w, w_ref, rtol=0, atol=1e-12)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.ones(74, dtype=torch.float64), rtol=0, atol=1e-12)
    out = ours_qwen_block(block, cfg, x2, norm).view_as(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    _grads_match(out, ref, x, block, atol=1e-11)


@pytest.mark.parametrize("family", DS_FAMILIES)
@pytest.mark.parametrize(
    "e,k,n_group,topk_group,norm,scale",
    [(16, 4, 4, 2, True, 2.5), (8, 2, 4, 2, False, 1.0), (16, 3, 8, 3, True, 1.5), (8, 2, 1, 1, True, 2.5)],
)
def test_sigmoid_router_and_block_match_hf_float64(family, e, k, n_group, topk_group, norm, scale):
    block, cfg = _ds_block(family, e=e, k=k, n_group=n_group, topk_group=topk_group, norm_topk_prob=norm, scale=scale)
    x = torch.randn(3, 29, 16, dtype=torch.float64, requires_grad=True)
    x2 = x.view(-1, 16)
    with hf_router_float64():
        _, w_ref, ids_ref = block.gate(x)
        ref = block(x)
    bias = block.gate.e_score_correction_bias
    logits = router_logits(x2, block.gate.weight, upcast=True)
    w, ids = sigmoid_grouped_route(logits, bias, k, n_group, topk_group, norm, scale)
    assert w.dtype == torch.float64
    _same_routing(w, ids, w_ref, ids_ref, atol=1e-12)
    if norm:
        torch.testing.assert_close(w.sum(-1), torch.full((87,), scale, dtype=torch.float64), rtol=0, atol=1e-12)
    # the bias and the group limit both matter in this data (otherwise the test would not test them)
    _, ids_nobias = sigmoid_grouped_route(logits, None, k, n_group, topk_group, norm, scale)
    assert not torch.equal(ids.sort(-1).values, ids_nobias.sort(-1).values)
    if topk_group < n_group:
        _, ids_nogroup = sigmoid_grouped_route(logits, bias, k, 1, 1, norm, scale)
        assert not torch.equal(ids.sort(-1).values, ids_nogroup.sort(-1).values)
    out = ours_ds_block(block, cfg, x2).view_as(x)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    _grads_match(out, ref, x, block, atol=1e-11)


def test_routers_reproduce_hf_float32_router_inside_float64_model():
    """Unpatched HF computes routers in float32 even in a float64 model; compute_dtype=float32 reproduces it."""
    block, cfg = _qwen_block("qwen3_next")
    x = torch.randn(50, 16, dtype=torch.float64)
    _, w_ref, ids_ref = block.gate(x)
    w, ids = softmax_topk_route(F.linear(x, block.gate.weight), 2, True, compute_dtype=torch.float32)
    assert torch.equal(ids, ids_ref) and torch.equal(w, w_ref)

    block, cfg = _ds_block("deepseek_v3")
    _, w_ref, ids_ref = block.gate(x)
    logits = F.linear(x.float(), block.gate.weight.float())
    w, ids = sigmoid_grouped_route(logits, block.gate.e_score_correction_bias, 4, 4, 2, True, 2.5)
    assert w.dtype == w_ref.dtype
    _same_routing(w, ids, w_ref, ids_ref, atol=0)


# --------------------------------------------------------------------------------------------------------------
# float32 and bf16 blocks vs HF (HF's own dtype handling, no patch)


@pytest.mark.parametrize("family", ["qwen3_next", "deepseek_v3"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_match_hf_low_precision(family, dtype):
    if family == "qwen3_next":
        block, cfg = _qwen_block(family, dtype=dtype)
        run = lambda x: ours_qwen_block(block, cfg, x, True)  # noqa: E731
    else:
        block, cfg = _ds_block(family, dtype=dtype)
        run = lambda x: ours_ds_block(block, cfg, x)  # noqa: E731
    x = torch.randn(1, 64, 16, dtype=dtype, requires_grad=True)
    ref = block(x)[0]
    out = run(x[0])
    assert out.dtype == dtype
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    _grads_match(out.float(), ref.float(), x, block, atol=tol * 10)


# --------------------------------------------------------------------------------------------------------------
# experts_forward vs the per-token reference


def _experts_case(n, h, i, e, k, dtype=torch.float64, seed=0, used=None):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, h, generator=g, dtype=dtype).requires_grad_()
    gu = (torch.randn(e, 2 * i, h, generator=g, dtype=dtype) * 0.3).requires_grad_()
    dn = (torch.randn(e, h, i, generator=g, dtype=dtype) * 0.3).requires_grad_()
    pool = torch.arange(e) if used is None else torch.tensor(used)
    ids = torch.stack([pool[torch.randperm(len(pool), generator=g)[:k]] for _ in range(n)]) if n else torch.zeros(
        0, k, dtype=torch.long
    )
    w = torch.rand(n, k, generator=g, dtype=dtype).requires_grad_()
    return x, ids, w, gu, dn


@pytest.mark.parametrize("impl", ["loop", "auto"])
@pytest.mark.parametrize(
    "n,h,i,e,k,used",
    [
        (1, 16, 12, 8, 2, None),  # a single token
        (57, 16, 12, 8, 2, None),
        (40, 8, 4, 16, 4, [0, 3, 4, 9, 15]),  # 11 of 16 experts receive no tokens
        (33, 16, 8, 6, 6, None),  # k == E: every token goes to every expert
        (20, 16, 8, 8, 3, [1, 2, 6]),  # experts 0 and 7 (the ends) empty
    ],
)
def test_experts_forward_matches_reference(impl, n, h, i, e, k, used):
    x, ids, w, gu, dn = _experts_case(n, h, i, e, k, used=used)
    out = experts_forward(x, ids, w, gu, dn, F.silu, impl=impl)
    ref = experts_forward_reference(x, ids, w, gu, dn, F.silu)
    assert out.shape == (n, h) and out.dtype == x.dtype
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-12)
    do = torch.randn_like(out)
    got = torch.autograd.grad(out, [x, w, gu, dn], do)
    want = torch.autograd.grad(ref, [x, w, gu, dn], do)
    for name, g, r in zip(["x", "weights", "gate_up_proj", "down_proj"], got, want):
        torch.testing.assert_close(g, r, rtol=0, atol=1e-11, msg=lambda m: f"{name}: {m}")
    if used is not None:  # experts without tokens get exactly zero gradient
        empty = [j for j in range(e) if j not in used]
        assert torch.all(got[2][empty] == 0) and torch.all(got[3][empty] == 0)


def test_experts_forward_gradcheck_and_custom_act():
    x, ids, w, gu, dn = _experts_case(5, 4, 3, 4, 2)
    act = lambda t: F.gelu(t, approximate="tanh")  # noqa: E731
    assert torch.autograd.gradcheck(lambda *a: experts_forward(a[0], ids, *a[1:], act), (x, w, gu, dn))
    torch.testing.assert_close(
        experts_forward(x, ids, w, gu, dn, act), experts_forward_reference(x, ids, w, gu, dn, act), rtol=0, atol=1e-12
    )


def test_experts_forward_empty_batch():
    x, ids, w, gu, dn = _experts_case(0, 16, 8, 4, 2)
    out = experts_forward(x, ids, w, gu, dn)
    assert out.shape == (0, 16)


@pytest.mark.parametrize("n", [1, 300])
@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_experts_forward_float32(impl, n):
    if impl == "grouped_mm" and not hasattr(F, "grouped_mm"):
        pytest.skip("no torch.nn.functional.grouped_mm")
    x, ids, w, gu, dn = _experts_case(n, 16, 8, 8, 2, dtype=torch.float32, used=[0, 1, 2, 5, 6, 7])
    x64, w64, gu64, dn64 = (t.detach().double().requires_grad_() for t in (x, w, gu, dn))
    out = experts_forward(x, ids, w, gu, dn, impl=impl)
    ref = experts_forward(x64, ids, w64, gu64, dn64)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    do = torch.randn_like(ref)
    got = torch.autograd.grad(out, [x, w, gu, dn], do.float())
    want = torch.autograd.grad(ref, [x64, w64, gu64, dn64], do)
    for g, r in zip(got, want):
        torch.testing.assert_close(g.double(), r, rtol=1e-4, atol=1e-4)


def test_mixed_dtype_weights_promote_like_hf():
    """float32 routing weights with bf16 experts: the weighting is formed in float32, output is bf16."""
    x, ids, w, gu, dn = _experts_case(10, 16, 8, 4, 2, dtype=torch.bfloat16)
    w32 = w.detach().float()
    out = experts_forward(x, ids, w32, gu, dn, impl="loop")
    ref = experts_forward_reference(x, ids, w32, gu, dn)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref, rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("ys_dtype,w_dtype", [(torch.bfloat16, torch.float32), (torch.float32, torch.float32),
                                              (torch.float64, torch.float64), (torch.bfloat16, torch.bfloat16)])
def test_combine_slots_equals_the_plain_expression_in_blocks(monkeypatch, ys_dtype, w_dtype):
    """The weighted combine in blocks (4 slot rows per block here) gives the plain expression's output and
    gradients: bit for bit (the same products, cast and scatter-added in the same order; the weights' gradient
    sums each product row the same way)."""
    monkeypatch.setattr(moe, "COMBINE_ELEMS", 4 * 24)
    g = torch.Generator().manual_seed(0)
    s, h, n = 30, 24, 11
    ys = torch.randn(s, h, generator=g).to(ys_dtype).requires_grad_(True)
    w = torch.rand(s, generator=g).to(w_dtype).requires_grad_(True)
    idx = torch.randint(0, n, (s,), generator=g)
    out_dtype = ys_dtype
    got = moe.combine_slots(ys, w, idx, n, out_dtype)
    want = moe.combine_slots_reference(ys, w, idx, n, out_dtype)
    assert got.dtype == want.dtype == out_dtype and torch.equal(got, want)
    do = torch.randn(n, h, generator=g).to(out_dtype)
    dg = torch.autograd.grad(got, [ys, w], do)
    dr = torch.autograd.grad(want, [ys, w], do)
    assert torch.equal(dg[0], dr[0]) and dg[0].dtype == ys_dtype
    torch.testing.assert_close(dg[1], dr[1], rtol=1e-6 if w_dtype != torch.bfloat16 else 1e-2, atol=0)
    assert dg[1].dtype == w_dtype
    if ys_dtype == torch.float64:
        assert torch.autograd.gradcheck(lambda a, b: moe.combine_slots(a, b, idx, n, torch.float64), (ys, w))


def test_combine_slots_holds_no_whole_float32_product():
    """On meta (the planner's tracked bytes), a bf16 combine with float32 weights over S x H slots holds at most a
    block's float32 products beside the bf16 ``ys`` gradient, not the three S x H float32 tensors of the plain
    expression's backward."""
    from longstraw.planner import LiveBytes

    s, h, n = 4096, 4096, 512

    def peak(fn) -> int:
        ys = torch.empty(s, h, dtype=torch.bfloat16, device="meta", requires_grad=True)
        w = torch.empty(s, device="meta", requires_grad=True)
        idx = torch.zeros(s, dtype=torch.long, device="meta")
        lb = LiveBytes()
        with lb:
            out = fn(ys, w, idx, n, torch.bfloat16)
            out.backward(torch.empty_like(out))
        return lb.peak

    whole = s * h * 4
    assert peak(moe.combine_slots_reference) >= 3 * whole
    assert peak(moe.combine_slots) <= whole // 2 + 4 * moe.COMBINE_ELEMS * 4


def test_meta_dispatch_keeps_what_the_grouped_dispatch_keeps_with_lora():
    """The planner's dry run of the routed experts (meta: every slot through one expert) holds, after the forward,
    the bytes the CPU grouped dispatch's graph holds (within its few index tensors), LoRA on both fused weights
    included: the grouped dispatch keeps contiguous copies of the adapters' factors, an adapter's size per layer
    (a 4-rank gloo step of a LoRA-on-experts model at ep = 2 measured 1.11x its plan before the dry run counted
    them, 2026-12-07). Under ``meta.expert_split(2)`` a rank copies half the experts' factors."""
    from longstraw.ops import meta
    from longstraw.planner import LiveBytes

    n, h, i, e, k, r = 64, 32, 48, 8, 2, 16

    def held(device: str, lora: bool, split: int = 1) -> int:
        g = torch.Generator().manual_seed(0)
        mk = lambda *s: (torch.randn(*s, generator=g) * 0.1).to(device)  # noqa: E731
        x, gu, dn = mk(n, h).requires_grad_(), mk(e, 2 * i, h), mk(e, h, i)
        ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)]).to(device)
        w = torch.rand(n, k, generator=g).to(device).requires_grad_()
        fac = {"gate_up_proj": (mk(e, r, h).requires_grad_(), mk(e, 2 * i, r).requires_grad_(), 0.5),
               "down_proj": (mk(e, r, i).requires_grad_(), mk(e, h, r).requires_grad_(), 0.5)} if lora else None
        lb = LiveBytes()
        with meta.expert_split(split), lb:
            y = moe.experts_forward(x, ids, w, gu, dn, impl="grouped_mm" if device == "cpu" else "auto", lora=fac)
        assert y.requires_grad
        return lb.live

    copies = e * r * (h + 2 * i + i + h) * 4  # A^T and B^T of both weights, float32
    index_bytes = 2 * n * k * 8 + e * (8 + 4)  # the real dispatch's order and slot tokens, counts and offsets
    for lora in (False, True):
        real, dry = held("cpu", lora), held("meta", lora)
        assert real - index_bytes <= dry <= real, (lora, real, dry)
    assert held("meta", True) - held("meta", True, split=2) == copies // 2
    with pytest.raises(ValueError, match="ranks must be >= 1"):
        with meta.expert_split(0):
            pass


# --------------------------------------------------------------------------------------------------------------
# user errors


def test_bad_arguments_raise_value_error():
    logits = torch.randn(4, 8)
    with pytest.raises(ValueError, match="top_k"):
        softmax_topk_route(logits, 9, True)
    with pytest.raises(ValueError, match="n_group"):
        sigmoid_grouped_route(logits, None, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="topk_group"):
        sigmoid_grouped_route(logits, None, 2, 4, 5, True, 1.0)
    with pytest.raises(ValueError, match="exceeds"):
        sigmoid_grouped_route(logits, None, 5, 4, 2, True, 1.0)
    x, ids, w, gu, dn = _experts_case(3, 16, 8, 4, 2)
    with pytest.raises(ValueError, match="impl"):
        experts_forward(x, ids, w, gu, dn, impl="fast")
    with pytest.raises(ValueError, match=">= the number of experts"):
        experts_forward(x, ids + 4, w, gu, dn)
    with pytest.raises(ValueError, match="down_proj"):
        experts_forward(x, ids, w, gu, dn.transpose(1, 2))
    with pytest.raises(ValueError, match="grouped_mm"):
        experts_forward(x, ids, w, gu, dn, impl="grouped_mm")  # no float64 kernel
    assert moe.EXPERT_IMPLS == ("auto", "grouped_mm", "loop")


def _gpt_oss_form(e, h, i, dtype, limit=0.8):
    g = torch.Generator().manual_seed(7)
    gate_up = torch.randn(e, h, 2 * i, generator=g, dtype=dtype) * 0.5
    down = torch.randn(e, i, h, generator=g, dtype=dtype) * 0.5
    form = moe.ExpertForm(transposed=True, interleaved=True,
                          gate_up_bias=torch.randn(e, 2 * i, generator=g, dtype=dtype) * 0.3,
                          down_bias=torch.randn(e, h, generator=g, dtype=dtype) * 0.3,
                          glu=moe.clamped_swiglu(1.702, limit))
    return gate_up, down, form


@pytest.mark.parametrize("impl,dtype", [("loop", torch.float64), ("grouped_mm", torch.float32),
                                        ("loop", torch.float32)])
def test_gpt_oss_experts_match_transformers_and_the_reference(impl, dtype):
    """GPT-OSS's experts (transposed, interleaved gate/up, biases, clamped SwiGLU; the limit is low enough to clamp)
    and router (top-k logits, then their softmax) against transformers' GptOssMLP module, and the fast paths
    against the per-token reference, forward and gradients (biases included)."""
    from transformers import GptOssConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP

    e, h, i, k, n = 5, 16, 8, 2, 23
    gate_up, down, form = _gpt_oss_form(e, h, i, dtype)
    cfg = GptOssConfig(hidden_size=h, intermediate_size=i, num_local_experts=e, num_experts_per_tok=k,
                       swiglu_limit=0.8)
    cfg._experts_implementation = "eager"
    ref = GptOssMLP(cfg).to(dtype)
    rw = torch.randn(e, h, dtype=dtype, generator=torch.Generator().manual_seed(3))
    rb = torch.randn(e, dtype=dtype, generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        for p, v in ((ref.router.weight, rw), (ref.router.bias, rb), (ref.experts.gate_up_proj, gate_up),
                     (ref.experts.down_proj, down), (ref.experts.gate_up_proj_bias, form.gate_up_bias),
                     (ref.experts.down_proj_bias, form.down_bias)):
            p.copy_(v)
    x = torch.randn(n, h, dtype=dtype, generator=torch.Generator().manual_seed(5))
    weights, ids = moe.topk_softmax_route(F.linear(x, rw, rb), k)
    got = experts_forward(x, ids, weights, gate_up, down, impl=impl, form=form)
    with torch.no_grad():
        want = ref(x[None])[0][0]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(got, want, rtol=0, atol=tol)
    leaves = [t.detach().clone().requires_grad_() for t in (x, gate_up, down, form.gate_up_bias, form.down_bias)]
    outs = []
    for fn in (lambda *a, **kw: experts_forward(*a, impl=impl, **kw), experts_forward_reference):
        xs, gu, dn, gb, db = (t.detach().clone().requires_grad_() for t in leaves)
        f = moe.ExpertForm(transposed=True, interleaved=True, gate_up_bias=gb, down_bias=db, glu=form.glu)
        y = fn(xs, ids, weights, gu, dn, form=f)
        y.backward(torch.ones_like(y))
        outs.append([y] + [t.grad for t in (xs, gu, dn, gb, db)])
    for a, b in zip(*outs):
        torch.testing.assert_close(a, b, rtol=0, atol=tol * 10)


def test_expert_form_checks_shapes_and_lora_factors_of_transposed_experts():
    gate_up, down, form = _gpt_oss_form(3, 8, 2, torch.float64)
    x = torch.randn(5, 8, dtype=torch.float64)
    ids, w = torch.zeros(5, 1, dtype=torch.int64), torch.ones(5, 1, dtype=torch.float64)
    with pytest.raises(ValueError, match=r"gate_up_proj must be \[E, H, 2\*I\] with H=8"):
        experts_forward(x, ids, w, gate_up.transpose(1, 2), down, form=form)
    with pytest.raises(ValueError, match=r"down_bias must be \[E=3, 8\]"):
        experts_forward(x, ids, w, gate_up, down,
                        form=moe.ExpertForm(transposed=True, down_bias=torch.zeros(3, 4, dtype=torch.float64)))
    lora = {"down_proj": (torch.zeros(3, 2, 8, dtype=torch.float64), torch.zeros(3, 8, 2, dtype=torch.float64), 1.0)}
    with pytest.raises(ValueError, match=r"expert LoRA on down_proj \(3, 2, 8\): A must be \[E, r, 2\] and B "
                                         r"\[E, 8, r\]"):  # x @ W: down_proj's in is I = 2
        experts_forward(x, ids, w, gate_up, down, form=form, lora=lora)
    values, chosen = moe.topk_softmax_route(torch.tensor([[0.0, 2.0, 1.0]]), 2)
    assert chosen.tolist() == [[1, 2]] and torch.allclose(values, torch.softmax(torch.tensor([[2.0, 1.0]]), -1))


@pytest.mark.parametrize("impl", ["loop", "grouped_mm"])
def test_gpt_oss_experts_with_lora_equal_folded_weights(impl):
    """LoRA on transposed experts (GPT-OSS, ``W [E, in, out]``): ``x W[e] + s (x A[e]^T) B[e]^T`` on the routed rows
    equals the reference on the folded weights ``W[e] + s (B[e] A[e])^T`` (PEFT's fold for ``is_transposed``
    experts), forward and the adapters' gradients; float32 (grouped_mm has a kernel)."""
    e, h, i, k, n, r = 4, 16, 8, 2, 21, 4  # rank 4: 16-byte rows, as grouped_mm needs
    gate_up, down, form = _gpt_oss_form(e, h, i, torch.float32)
    g = torch.Generator().manual_seed(9)
    lora = {name: (torch.randn(e, r, w.shape[1], generator=g).requires_grad_(),
                   torch.randn(e, w.shape[2], r, generator=g).requires_grad_(), 0.7)
            for name, w in (("gate_up_proj", gate_up), ("down_proj", down))}
    x = torch.randn(n, h, generator=g)
    weights, ids = moe.topk_softmax_route(torch.randn(n, e, generator=g), k)
    got = experts_forward(x, ids, weights, gate_up, down, impl=impl, form=form, lora=lora)
    factors = [t for ab in lora.values() for t in ab[:2]]
    grads = torch.autograd.grad(got.square().sum(), factors)
    fold = {name: w + s * torch.bmm(b, a).transpose(1, 2) for (name, (a, b, s)), w in
            zip(lora.items(), (gate_up, down))}
    want = experts_forward_reference(x, ids, weights, fold["gate_up_proj"], fold["down_proj"], form=form)
    ref = torch.autograd.grad(want.square().sum(), factors)
    torch.testing.assert_close(got, want, rtol=2e-5, atol=2e-5 * want.abs().max().item())
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5 * max(1.0, b.abs().max().item()))
