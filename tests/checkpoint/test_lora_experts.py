"""LoRA on the routed experts' fused weights (``target_parameters``) against stock PEFT 0.21 on transformers 5, in
float64: PEFT's ``lora.ParamWrapper`` layout (``lora_A [E*r, in]``, ``lora_B [out, r*E]``, nested wrappers keyed
``experts[.base_layer].lora_A.weight``) both ways, logits, ``grpo_backward``'s adapter gradients (exact and
detached) against the naive full-graph loss on the PEFT model, merging, the grouped_mm / loop / meta paths of
``ops.moe.experts_forward`` with adapters, bad input.

Unlike the dense-MLP parity tests in test_lora.py, the reference here is stock PEFT (no re-targeting switched off):
target_parameters adapters are what PEFT itself puts on these models.
"""

import json
import types

import pytest
import torch
from safetensors.torch import load_file
from test_lora import (FAMILIES, V, _edit_config, _edit_tensors, _no_adapters_and_nothing_trainable_changed,
                       compare_grads, hf_logits, load, max_err, our_logits, pair, peft_grads, peft_load, peft_new,
                       random_b, router64, tokens)

import longstraw
from longstraw.models.lora import ExpertLoRA, adapted_modules, all_adapters, expert_adapters
from longstraw.models.mla import set_mla_mode
from longstraw.ops.moe import experts_forward, experts_forward_reference
from longstraw.rl.optim import make_optimizer

from grpo_reference import random_group, run_against_reference  # noqa: E402  (test_lora put tests/engine on the path)

pytestmark = pytest.mark.usefixtures("one_thread")

BOTH = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
# family: the module targets beside the experts (none of PEFT's re-targeted MLP names)
OTHER = {"qwen3_next": ["q_proj", "in_proj_qkvz", "shared_expert_gate"], "qwen3_5_moe": ["q_proj", "out_proj"],
         "deepseek_v3": ["q_a_proj", "kv_b_proj"], "mixtral": ["q_proj", "o_proj"],
         "minimax_m2": ["k_proj"], "gpt_oss": ["q_proj", "o_proj"], "kimi_linear": ["q_proj", "f_a_proj", "kv_b_proj"]}
FAMS = sorted(OTHER)


def with_experts(name, params=BOTH, *, rank=3, alpha=5, targets=None, seed=1, **kw):
    """Our model with adapters on ``params`` (and ``targets``: OTHER[name] by default), every ``B`` random."""
    model = load(name)
    longstraw.add_lora(model, rank, alpha, OTHER[name] if targets is None else targets, seed=seed,
                       target_parameters=params, **kw)
    random_b({n: m.lora_B.weight for n, m in all_adapters(model).items()})
    return model


# --------------------------------------------------------------------------------------------- layout, logits
@pytest.mark.parametrize("params", [BOTH, ["down_proj"], ["gate_up_proj"]])
@pytest.mark.parametrize("name", FAMS)
def test_logits_equal_stock_peft(name, params, tmp_path):
    """save_adapter -> stock PeftModel.from_pretrained: PEFT wraps the same fused parameters (its ParamWrapper,
    nested when both are targeted), reads our tensors under its keys and shapes, and computes the same logits."""
    model = with_experts(name, params)
    longstraw.save_adapter(model, tmp_path / "a")
    cfg = json.loads((tmp_path / "a" / "adapter_config.json").read_text())
    assert cfg["target_parameters"] == sorted(params) and cfg["lora_dropout"] == 0.0
    sd = load_file(tmp_path / "a" / "adapter_model.safetensors")
    experts = expert_adapters(model)
    assert experts and {k.rsplit(".", 1)[-1] for k in experts} == {p.rsplit(".", 1)[-1] for p in params}
    pm = peft_load(name, tmp_path / "a", stock=True)
    theirs = {n.removeprefix("base_model.model."): m for n, m in pm.named_modules()
              if type(m).__name__ == "ParamWrapper"}
    for key, m in experts.items():
        module, _, pname = key.rpartition(".")
        w = [t for n, t in theirs.items() if n.removesuffix(".base_layer") == module and t.parameter_name == pname]
        assert len(w) == 1, key
        prefix = "base_model.model." + [n for n, t in theirs.items() if t is w[0]][0]
        for ab in ("lora_A", "lora_B"):  # our tensors under PEFT's key, in PEFT's shape
            assert torch.equal(sd[f"{prefix}.{ab}.weight"], getattr(m, ab).weight)
            assert tuple(getattr(w[0], ab)["default"].weight.shape) == tuple(getattr(m, ab).weight.shape)
        assert w[0].scaling["default"] == m.scaling and w[0].num_experts == m.num_experts
    x = tokens()
    want = hf_logits(pm, x)
    assert max_err(our_logits(model, x), want) <= 1e-12
    with torch.no_grad():  # the expert adapters matter on their own
        for m in experts.values():
            m.lora_B.weight.zero_()
    assert max_err(our_logits(model, x), want) > 1e-3


@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys")  # PEFT checks modules only (and
@pytest.mark.parametrize("name", FAMS)  # applies them to its parameter wrappers: the logits below)
def test_round_trip_and_merge(name, tmp_path):
    """save_adapter -> load_adapter / load_model(adapter=): the same tensors, bit for bit, and logits; lora_grads
    keys are the file's; save_model(merge_lora=True) folds W[e] + s B_e A_e into the fused weights."""
    model = with_experts(name, rank_pattern={r"layers\.2\.mlp\.experts\.down_proj": 5},
                         alpha_pattern={"gate_up_proj": 7})
    rs = {k: (m.r, m.scaling) for k, m in expert_adapters(model).items()}
    assert rs["model.layers.2.mlp.experts.down_proj"] == (5, 1.0)
    assert all(s == 7 / 3 for k, (_, s) in rs.items() if k.endswith("gate_up_proj"))
    longstraw.save_adapter(model, tmp_path / "a")
    sd = load_file(tmp_path / "a" / "adapter_model.safetensors")
    x = tokens(1)
    want = our_logits(model, x)
    for again in (longstraw.load_adapter(load(name), tmp_path / "a"), load(name, adapter=tmp_path / "a")):
        if FAMILIES[name][2] is not None:
            set_mla_mode(again, FAMILIES[name][2], decompress_chunk=4)
        mine, theirs = dict(model.named_parameters()), dict(again.named_parameters())
        assert set(mine) == set(theirs)
        assert all(torch.equal(mine[n], theirs[n]) for n in mine if ".lora_" in n)
        assert {n for n, p in again.named_parameters() if p.requires_grad} == {n for n in mine if ".lora_" in n}
        assert max_err(our_logits(again, x), want) == 0
    model(x).sum().backward()
    assert set(longstraw.lora_grads(model)) == set(sd)
    pm = peft_load(name, tmp_path / "a", stock=True)
    assert max_err(want, hf_logits(pm, x)) <= 1e-12
    longstraw.save_model(model, tmp_path / "merged", merge_lora=True)
    merged = longstraw.load_model(tmp_path / "merged", dtype="float64")
    assert not all_adapters(merged)
    if FAMILIES[name][2] is not None:
        set_mla_mode(merged, FAMILIES[name][2], decompress_chunk=4)
    assert max_err(our_logits(merged, x), want) <= 1e-12


# ----------------------------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("prompt_grad", ["exact", "detached"])
@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3", "gpt_oss", "kimi_linear"])
def test_grads_equal_peft_reference(name, prompt_grad, tmp_path):
    """grpo_backward's gradients of every expert's lora_A / lora_B (lora_grads, PEFT's keys) equal the naive
    full-graph GRPO loss's on stock PEFT's model (its adapters folded into the fused weights by parametrisation)."""
    model = with_experts(name)
    longstraw.save_adapter(model, tmp_path / "a")
    pm = peft_load(name, tmp_path / "a", stock=True)
    prompt, responses, adv = random_group(3, 14, [4, 1, 6], V)
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, kl_coef=0.05, entropy_coef=0.01, prefill_chunk=5,
                               branch_batch=2, checkpoint_layers=prompt_grad == "exact")
    run_against_reference(model, pm, prompt, responses, adv, cfg, hf_patch=router64)
    got = longstraw.lora_grads(model)
    experts = [k for k in got if ".experts." in k]
    assert len(experts) == 4 * sum(1 for k in expert_adapters(model) if k.endswith("down_proj"))
    assert all(got[k].abs().max() > 0 for k in experts)
    compare_grads(got, peft_grads(pm))
    assert all(p.grad is None for n, p in model.named_parameters() if ".lora_" not in n)
    opt = make_optimizer(model.parameters(), lr=1e-3, betas=(0.9, 0.99), weight_decay=0.01, eps=1e-8)
    held = {id(p) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for n, p in model.named_parameters() if ".lora_" in n}


# ------------------------------------------------------------------------------------- PEFT's own adapters
@pytest.mark.filterwarnings("ignore:The following (rank|alpha)_pattern keys")
@pytest.mark.parametrize("how", ["target_parameters", "retargeted"])
@pytest.mark.parametrize("name", ["qwen3_next", "deepseek_v3"])
def test_stock_peft_saved_adapter_loads(name, how, tmp_path):
    """An adapter stock PEFT saved with target_parameters loads here with PEFT's logits: named explicitly, or from
    PEFT's re-targeting of gate_proj/up_proj/down_proj (its saved config: target_parameters, gate_up_proj at twice
    the rank and alpha through rank_pattern / alpha_pattern)."""
    if how == "target_parameters":
        pm = peft_new(name, stock=True, r=2, lora_alpha=3, target_modules=OTHER[name], target_parameters=BOTH)
    else:
        pm = peft_new(name, stock=True, r=2, lora_alpha=3, target_modules=OTHER[name] + ["gate_proj", "up_proj",
                                                                                         "down_proj"])
    pm.save_pretrained(tmp_path / "p")
    cfg = json.loads((tmp_path / "p" / "adapter_config.json").read_text())
    assert set(cfg["target_parameters"]) in ({"down_proj", "gate_up_proj"}, set(BOTH))
    x = tokens(2)
    want = hf_logits(pm, x)
    model = longstraw.load_adapter(load(name), tmp_path / "p")
    assert set(adapted_modules(model)) == {n.removeprefix("base_model.model.") for n, m in pm.named_modules()
                                           if type(m).__name__ == "Linear" and hasattr(m, "lora_A")}
    ranks = {k.rsplit(".", 1)[-1]: m.r for k, m in expert_adapters(model).items()}
    assert ranks == {"gate_up_proj": 4 if how == "retargeted" else 2, "down_proj": 2}
    assert max_err(our_logits(model, x), want) <= 1e-12
    longstraw.save_adapter(model, tmp_path / "again")  # and back out: PEFT's tensors under PEFT's keys
    a, b = load_file(tmp_path / "p" / "adapter_model.safetensors"), load_file(tmp_path / "again" /
                                                                               "adapter_model.safetensors")
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)


# -------------------------------------------------------------------------------------------- the kernels
def _lora_case(dtype, e=4, h=16, i=8, r=4, n=11, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(s, generator=g, dtype=torch.float64).to(dtype)

    x, gu, dn = rnd(n, h), rnd(e, 2 * i, h) * 0.3, rnd(e, h, i) * 0.3
    ids = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(n)])
    ids[0] = ids[1]  # some experts get several rows, and (e=4, k=2, n=11) likely one none
    w = rnd(n, k).abs()
    lora = {"gate_up_proj": (rnd(e, r, h), rnd(e, 2 * i, r), 0.7), "down_proj": (rnd(e, r, i), rnd(e, h, r), 1.3)}
    for a, b, _ in lora.values():
        a.requires_grad_(True)
        b.requires_grad_(True)
    return x, ids, w, gu, dn, lora


def _folded(gu, dn, lora):
    """PEFT's form: the weights with ``s B_e A_e`` added."""
    out = []
    for wt, name in ((gu, "gate_up_proj"), (dn, "down_proj")):
        a, b, s = lora[name]
        out.append(wt + torch.bmm(b, a) * s)
    return out


@pytest.mark.parametrize("impl,dtype", [("loop", torch.float64), ("grouped_mm", torch.float32)])
def test_experts_forward_lora_equals_folded_weights(impl, dtype):
    """experts_forward with adapters (on the routed rows) equals the reference loop on W + s B A (PEFT's fold),
    forward and the adapters' gradients; grouped_mm (float32, aligned sizes) as the loop."""
    x, ids, w, gu, dn, lora = _lora_case(dtype)
    got = experts_forward(x, ids, w, gu, dn, impl=impl, lora=lora)
    grads = torch.autograd.grad(got.square().sum(), [t for ab in lora.values() for t in ab[:2]])
    want = experts_forward_reference(x, ids, w, *_folded(gu, dn, lora))
    ref = torch.autograd.grad(want.square().sum(), [t for ab in lora.values() for t in ab[:2]])
    tol = 1e-12 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * want.abs().max().item())
    for a, b in zip(grads, ref):
        torch.testing.assert_close(a, b, rtol=tol, atol=tol * max(1.0, b.abs().max().item()))


def test_experts_forward_lora_on_meta():
    """The planner's dry run (meta): with adapters the output has the real path's shape and dtype."""
    x, ids, w, gu, dn, lora = _lora_case(torch.float64)
    to_meta = {n: (a.detach().to("meta"), b.detach().to("meta"), s) for n, (a, b, s) in lora.items()}
    y = experts_forward(x.to("meta"), ids.to("meta"), w.to("meta"), gu.to("meta"), dn.to("meta"), lora=to_meta)
    assert y.device.type == "meta" and y.shape == x.shape and y.dtype == x.dtype


def test_expert_adapter_layout_is_peft_s():
    """ExpertLoRA.factors reads PEFT's layout: A's rows e*r + j, B's columns j*E + e (PEFT 0.21's
    ParamWrapper.get_delta_weight: B reshaped [out, r, E]); delta_weight equals PEFT's einsum."""
    m = ExpertLoRA(num_experts=3, in_features=5, out_features=4, r=2, alpha=6, scaling=3.0, dtype=torch.float64)
    random_b({"b": m.lora_B.weight})
    a, b = m.factors()
    wa, wb = m.lora_A.weight, m.lora_B.weight
    for e in range(3):
        for j in range(2):
            assert torch.equal(a[e, j], wa[e * 2 + j]) and torch.equal(b[e][:, j], wb[:, j * 3 + e])
    peft = torch.einsum("o r e, e r i -> e o i", wb.reshape(4, -1, 3), wa.reshape(3, -1, 5)) * 3.0
    torch.testing.assert_close(m.delta_weight(), peft, rtol=0, atol=1e-15)


# ------------------------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize("name,kw,msg", [
    ("deepseek_v3", dict(target_parameters=["mlp.experts.gate_proj"]),
     r"target_parameters entry 'mlp.experts.gate_proj' matches no parameter of this model; its routed experts' "
     r"fused parameters are mlp.experts.gate_up_proj and mlp.experts.down_proj"),
    ("deepseek_v3", dict(target_parameters=["q_a_proj.weight"]),
     r"'q_a_proj.weight' names 'model.layers.0.self_attn.q_a_proj.weight', which is not a routed expert's fused "
     r"weight"),
    ("llama", dict(target_parameters=["gate_up_proj"]), r"matches no parameter of this model; this model has no "
                                                        r"routed experts"),
    ("deepseek_v3", dict(target_parameters=BOTH, dropout=0.1),
     r"LoRA dropout=0.1 with target_parameters \(adapters on routed experts\): .* use dropout 0"),
    ("deepseek_v3", dict(target_parameters=BOTH, rank=0), r"LoRA rank=0 must be an integer >= 1"),
    ("deepseek_v3", dict(target_parameters=BOTH, rank_pattern={"gate_up_proj": 0}),
     r"rank_pattern\['gate_up_proj'\]=0 must be an integer >= 1"),
    ("deepseek_v3", dict(target_parameters=[""]), r"target_parameters=\[''\] must be a list of parameter names"),
    ("deepseek_v3", dict(target_modules=[]), r"target_modules=\[\] must be a non-empty list .* \(or empty, with "
                                             r"target_parameters\)"),
    ("deepseek_v3", dict(target_modules=["experts"]),
     r"LoRA target 'experts' names routed experts \(model.layers.1.mlp.experts\), fused 3-D parameters, not linear "
     r"layers: adapt them with target_parameters=\['mlp.experts.gate_up_proj', 'mlp.experts.down_proj'\]"),
])
def test_add_lora_bad_input(name, kw, msg):
    model = load(name)
    args = dict(rank=2, alpha=4, target_modules=["q_proj"] if name == "llama" else ["q_a_proj"])
    args.update(kw)
    with pytest.raises(ValueError, match=msg):
        longstraw.add_lora(model, **args)
    _no_adapters_and_nothing_trainable_changed(model)


E0 = "base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight"


@pytest.mark.parametrize("edit,msg", [
    (lambda d: _edit_config(d, use_dora=True), r"use_dora=True is not supported, and not on routed experts"),
    (lambda d: _edit_config(d, target_parameters=["mlp.experts.up_proj"]),
     r"target_parameters entry 'mlp.experts.up_proj' matches no parameter"),
    (lambda d: _edit_tensors(d, lambda sd: sd.pop(E0)), rf"adapter tensors missing: {E0}"),
    (lambda d: _edit_tensors(d, lambda sd: sd.update({E0: sd[E0][:-1].contiguous()})),
     rf"{E0} has shape \(23, 32\), the model's adapter \(24, 32\) \(routed experts: \[E\*r, in\] / \[out, r\*E\]"),
    (lambda d: _edit_config(d, target_parameters=["down_proj"]),
     r"tensors the model's adapters do not have: .*experts.base_layer.lora_A.weight"),
])
def test_load_adapter_bad_files(edit, msg, tmp_path):
    model = with_experts("deepseek_v3")
    longstraw.save_adapter(model, tmp_path / "a")
    edit(tmp_path / "a")
    fresh = load("deepseek_v3")
    with pytest.raises(ValueError, match=msg):
        longstraw.load_adapter(fresh, tmp_path / "a")
    _no_adapters_and_nothing_trainable_changed(fresh)


def test_shard_experts_splits_the_adapters():
    """shard_experts (as parallelize calls it, before FSDP) keeps each rank's experts' part of every expert adapter:
    lora_A's contiguous rows, lora_B's columns of PEFT's interleaved layout, laid out again over the local experts;
    the parts of all ranks join back into the whole (join_expert_pieces); add_adapters on an already split model
    (seeded) draws the whole tensors and keeps the same part."""
    from longstraw.distributed.expert_parallel import shard_experts
    from longstraw.models.lora import join_expert_pieces

    whole = with_experts("deepseek_v3")
    want = {k: (a.lora_A.weight.detach().clone(), a.lora_B.weight.detach().clone(), a.factors())
            for k, a in expert_adapters(whole).items()}
    parts = []
    for rank in range(4):
        model = with_experts("deepseek_v3")
        ctx = types.SimpleNamespace(ep_size=4, world_size=4, ep_rank=rank, ep=None, edp=None, ep_mesh=None,
                                    ep_shard=True)
        shard_experts(model, ctx)
        got = expert_adapters(model)
        assert set(got) == set(want)
        for k, a in got.items():
            assert (a.first, a.num_experts, a.total) == (2 * rank, 2, 8) and a.lora_A.weight.requires_grad
            fa, fb = a.factors()
            assert torch.equal(fa, want[k][2][0][2 * rank:2 * rank + 2])
            assert torch.equal(fb, want[k][2][1][2 * rank:2 * rank + 2])
        parts.append(got)
        seeded = load("deepseek_v3")
        shard_experts(seeded, ctx)
        longstraw.add_lora(seeded, 3, 5, OTHER["deepseek_v3"], seed=1, target_parameters=BOTH)
        one = load("deepseek_v3")
        longstraw.add_lora(one, 3, 5, OTHER["deepseek_v3"], seed=1, target_parameters=BOTH)
        for k, a in expert_adapters(seeded).items():
            assert torch.equal(a.lora_A.weight, a.take("lora_A", expert_adapters(one)[k].lora_A.weight))
            assert a.lora_A.weight.abs().max() > 0 and not a.lora_B.weight.any()
    for k, (a_w, b_w, _) in want.items():
        for which, w in (("lora_A", a_w), ("lora_B", b_w)):
            pieces = torch.stack([getattr(p[k], which).weight for p in parts])
            assert torch.equal(join_expert_pieces(which, pieces, 3), w), (k, which)


def test_sharded_checkpoint_splits_lora_b_by_expert_and_reads_the_earlier_layout(tmp_path):
    """``save_sharded_checkpoint`` (here one process: DCP without a process group) writes each expert adapter's
    ``lora_B`` and its AdamW moments as ``[out, r, E]`` (an EP rank's experts are a block of its last dimension:
    tests/rl/test_trainer_dist.py runs that), and ``load_sharded_state`` reads them back exactly; a checkpoint of the
    earlier layout (``lora_B`` ``[out, r * E]``, written by DCP as the state dicts come) still loads."""
    import warnings

    from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter, save
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    from longstraw.checkpoint.training import SHARDED_DIR, load_sharded_state, save_sharded_checkpoint

    def stepped(seed):
        model = with_experts("qwen3_5_moe", seed=seed)
        opt = make_optimizer(model.parameters(), lr=1e-2, betas=(0.9, 0.99), weight_decay=0.01, eps=1e-8)
        gen = torch.Generator().manual_seed(seed)
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        opt.step()
        return model, opt

    def trained(model, opt):
        return {n: (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
                for n, p in model.named_parameters() if p.requires_grad}

    model, opt = stepped(1)
    want = trained(model, opt)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        ckpt = save_sharded_checkpoint(tmp_path / "run", 1, model, opt, {"step": 1, "opt_step": 1})
        meta = FileSystemReader(ckpt / SHARDED_DIR).read_metadata().state_dict_metadata
        b = [n for n in want if ".lora_adapters." in n and n.endswith("lora_B.weight")]
        assert b and all(tuple(meta[f"model.{n}"].size) == (want[n][0].shape[0], 3, 4) for n in b)  # r=3, E=4
        assert all(tuple(meta[f"optimizer.state.{n}.exp_avg"].size) == tuple(meta[f"model.{n}"].size) for n in b)
        # the earlier layout: the state dicts as they come
        opts = StateDictOptions(ignore_frozen_params=True)
        save({"model": get_model_state_dict(model, options=opts),
              "optimizer": get_optimizer_state_dict(model, opt, options=opts)},
             storage_writer=FileSystemWriter(tmp_path / "old" / SHARDED_DIR))
        assert len(FileSystemReader(tmp_path / "old" / SHARDED_DIR).read_metadata()
                   .state_dict_metadata[f"model.{b[0]}"].size) == 2
        for where in (ckpt, tmp_path / "old"):
            fresh, fresh_opt = stepped(2)  # other values everywhere
            load_sharded_state(where, fresh, fresh_opt)
            got = trained(fresh, fresh_opt)
            assert got.keys() == want.keys()
            for n, (w, st) in want.items():
                assert torch.equal(got[n][0], w) and st.keys() == got[n][1].keys(), (where, n)
                assert all(torch.equal(got[n][1][k], v) for k, v in st.items()), (where, n)


def test_disabled_adapters_give_the_base():
    model = with_experts("deepseek_v3")
    x = tokens(3)
    from longstraw.models.lora import adapters_disabled

    with adapters_disabled(model):
        base = our_logits(model, x)
    assert max_err(base, hf_logits(pair("deepseek_v3")[0], x)) <= 1e-10
    assert max_err(our_logits(model, x), base) > 1e-3


# ------------------------------------------------------------------------------------------- FSDP / EP (gloo)
WORKER = r'''
import sys, torch, longstraw
from longstraw.models.mla import set_mla_mode
from longstraw.distributed.expert_parallel import ep_modules
from longstraw.rl.optim import clip_grad_norm
torch.set_num_threads(1)
ckpt, adapter, out, ep, cp, mla, target = sys.argv[1:4] + [int(sys.argv[4]), int(sys.argv[5])] + sys.argv[6:8]
ctx = longstraw.init_distributed(cp=cp, fsdp=True, ep=ep, timeout_s=120)


def parts(model):  # this rank's expert adapters (its experts' part under EP)
    return {f"{n}.{p}": (a.first, a.lora_A.weight.detach().clone(), a.lora_B.weight.detach().clone())
            for n, m in model.named_modules() for p, a in (getattr(m, "lora_adapters", None) or {}).items()}


try:
    seeded = longstraw.load_model(ckpt, dtype="float64", lora=dict(rank=3, alpha=5, target_modules=[target],
                                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
                                  lora_seed=4)
    res = dict(seeded_parts=parts(seeded), ep_modules=len(ep_modules(seeded)))
    longstraw.save_adapter(seeded, out + "/seeded")  # a collective, gathering every tensor whole
    model = longstraw.load_model(ckpt, dtype="float64", adapter=adapter)
    res["loaded_parts"] = parts(model)
    if mla != "none":
        set_mla_mode(model, mla, decompress_chunk=4)
    g = torch.Generator().manual_seed(0)
    x = torch.randint(0, 53, (1, 17), generator=g)
    with torch.no_grad():
        res["logits"] = model(x)
    prompt = torch.randint(0, 53, (14,), generator=g)
    responses = [torch.randint(0, 53, (n,), generator=g) for n in (4, 1, 6)]
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    for grad in ("exact", "detached"):
        for p in model.parameters():
            p.grad = None
        cfg = longstraw.GRPOConfig(prompt_grad=grad, kl_coef=0.0, prefill_chunk=5)
        longstraw.grpo_backward(model, prompt, responses, adv, cfg)
        res[grad] = longstraw.lora_grads(model)  # every rank joins the gathers
        res[grad + "_hf"] = {k: v for k, v in longstraw.hf_grads(model).items() if ".lora_" in k}  # gathers too
        res[grad + "_norm"] = clip_grad_norm([p for p in model.parameters() if p.requires_grad], 0.0)
    longstraw.save_adapter(model, out + "/saved")
    longstraw.save_model(model, out + "/merged", merge_lora=True)  # each EP rank merges and writes its experts
    torch.save(res, out + f"/res{ctx.rank}.pt")
finally:
    longstraw.shutdown_distributed()
'''


_TARGET = {"deepseek_v3": "q_a_proj", "qwen3_5_moe": "q_proj", "qwen3_next": "q_proj",
           "gpt_oss": "q_proj"}  # beside the experts


def _one_process(name, x_seed=0):
    """What every rank of the job must reproduce: the logits, the exact and detached grpo_backward gradients of
    the adapters (lora_grads, PEFT's keys) and their global norm, for the model with_experts(name) saved."""
    from longstraw.rl.optim import clip_grad_norm

    model = with_experts(name, targets=[_TARGET[name]])
    g = torch.Generator().manual_seed(x_seed)
    x = torch.randint(0, 53, (1, 17), generator=g)
    out = {"logits": our_logits(model, x), "model": model}
    prompt = torch.randint(0, 53, (14,), generator=g)
    responses = [torch.randint(0, 53, (n,), generator=g) for n in (4, 1, 6)]
    adv = torch.tensor([1.0, -0.5, 0.3], dtype=torch.float64)
    for grad in ("exact", "detached"):
        for p in model.parameters():
            p.grad = None
        longstraw.grpo_backward(model, prompt, responses, adv,
                                longstraw.GRPOConfig(prompt_grad=grad, kl_coef=0.0, prefill_chunk=5))
        out[grad] = longstraw.lora_grads(model)
        out[grad + "_hf"] = {k: v for k, v in longstraw.hf_grads(model).items() if ".lora_" in k}
        out[grad + "_norm"] = clip_grad_norm([p for p in model.parameters() if p.requires_grad], 0.0)
    return out


def _all_tensors(directory) -> dict:
    """Every tensor of an HF checkpoint directory, by name (one file or several)."""
    out = {}
    for f in sorted(directory.glob("*.safetensors")):
        out.update(load_file(f))
    return out


def _same_file(a, b):
    a, b = load_file(a / "adapter_model.safetensors"), load_file(b / "adapter_model.safetensors")
    assert set(a) == set(b) and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a), \
        [k for k in a if k not in b or not torch.equal(a[k], b[k])]


def _run_job(tmp_path, name, world, cp, ep):
    """Launch WORKER on ``world`` gloo ranks (FSDP over all, ``cp``, ``ep``) and check everything against one
    process: lora_seed's adapters (each rank's part and the gathered file), load_model(adapter=)'s parts, logits,
    the adapters' exact and detached gradients and their norm, save_adapter's file (byte-equal tensors)."""
    from dist_launch import launch

    want = _one_process(name)
    model = want.pop("model")
    longstraw.save_adapter(model, tmp_path / "a")
    (tmp_path / "w.py").write_text(WORKER)
    mla = FAMILIES[name][2] or "none"
    ranks = launch(world, [str(tmp_path / "w.py"), str(pair(name)[1]), str(tmp_path / "a"), str(tmp_path), str(ep),
                           str(cp), mla, _TARGET[name]], timeout_s=600)
    assert all(r.returncode == 0 for r in ranks), "".join(r.stderr[-3000:] for r in ranks)
    seeded = load(name)
    longstraw.add_lora(seeded, 3, 5, [_TARGET[name]], seed=4, target_parameters=BOTH)
    longstraw.save_adapter(seeded, tmp_path / "seeded1")
    _same_file(tmp_path / "seeded", tmp_path / "seeded1")
    _same_file(tmp_path / "saved", tmp_path / "a")
    longstraw.save_model(model, tmp_path / "merged1", merge_lora=True)
    got, ref = _all_tensors(tmp_path / "merged"), _all_tensors(tmp_path / "merged1")
    assert set(got) == set(ref) and any(".experts." in k for k in ref)
    for k in ref:  # the merged experts (per expert B_e A_e, on each EP rank's rows) as one process merges them
        assert got[k].dtype == ref[k].dtype and torch.allclose(got[k], ref[k], rtol=1e-13, atol=1e-13), k
    whole = {"seeded_parts": expert_adapters(seeded), "loaded_parts": expert_adapters(model)}
    for rank in range(world):
        res = torch.load(tmp_path / f"res{rank}.pt")
        assert res["ep_modules"] == (0 if ep == 1 else len(whole["seeded_parts"]) // 2)
        for what, adapters in whole.items() if ep > 1 else ():  # each rank's part: a slice of one process's
            assert set(res[what]) == set(adapters)
            for k, (first, a_w, b_w) in res[what].items():
                full = adapters[k]
                local = full.num_experts // ep
                assert first == (rank % ep) * local, (what, k, first)
                a, b = full.factors()
                assert torch.equal(a_w.view(local, 3, -1), a[first:first + local]), (what, k)
                assert torch.equal(b_w.view(b_w.shape[0], 3, local).permute(2, 0, 1), b[first:first + local])
        assert max_err(res["logits"], want["logits"]) <= 1e-12
        for grad in ("exact", "detached"):
            assert any(".experts." in k for k in want[grad])
            assert all(want[grad][k].abs().max() > 0 for k in want[grad] if ".experts." in k)
            compare_grads(res[grad], want[grad], rel=1e-10)
            assert any(".experts." in k for k in want[grad + "_hf"])  # hf_grads: whole expert adapters too
            compare_grads(res[grad + "_hf"], want[grad + "_hf"], rel=1e-10)
            assert abs(res[grad + "_norm"] - want[grad + "_norm"]) <= 1e-10 * want[grad + "_norm"]


def test_fsdp_two_ranks(tmp_path):
    """FSDP2 over 2 gloo ranks (ep=1): the expert adapters are sharded as any parameter; load_model(adapter=) gives
    one process's logits and grpo_backward gradients (both ranks pass the same group: the one-process gradient),
    save_adapter writes the same file, and load_model(lora=, lora_seed=) draws add_lora(seed=)'s A."""
    _run_job(tmp_path, "deepseek_v3", 2, 1, 1)


@pytest.mark.parametrize("name,world,cp,ep", [("deepseek_v3", 2, 1, 2), ("qwen3_5_moe", 2, 1, 2),
                                              ("deepseek_v3", 4, 2, 2), ("qwen3_next", 4, 1, 4),
                                              ("gpt_oss", 2, 1, 2), ("gpt_oss", 4, 1, 2)])
def test_expert_parallel(name, world, cp, ep, tmp_path):
    """Expert adapters under expert parallelism (FSDP over the job, ep ranks per EP group; with world 4, cp=2: two
    data-parallel replicas, each EP group one CP group, the adapters' gradients reduced over edp; with world 4 and
    ep=2 the base experts' blocks are FSDP-sharded over edp, and GPT-OSS's merged export gathers them): each rank holds
    its experts' part of every expert adapter, as lora_seed draws it and as load_model(adapter=) reads it; logits,
    the exact and detached gradients (gathered by lora_grads) and their global norm equal one process's;
    save_adapter writes the same tensors."""
    _run_job(tmp_path, name, world, cp, ep)
