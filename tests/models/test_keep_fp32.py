"""What a half-precision model keeps in float32 (``models/keep_fp32.py``): the same tensors as transformers keeps
(``_keep_in_fp32_modules_strict`` / ``_keep_in_fp32_modules``) for every supported model type, through every cast;
Ling 3.0's loaded with the checkpoint's float32 values and exported in float32 as transformers saves them. The
FSDP2 units of the owners run on 2 gloo ranks in ``tests/distributed/cp_scenarios.py`` (``master_weights``)."""

import re

import pytest
import torch
from hf_reference import save_tiny, tiny_moe_hf
from safetensors import safe_open
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText, BailingHybridConfig

import longstraw
from longstraw.models.bailing import tiny_config
from longstraw.models.keep_fp32 import KeepsFloat32, float32_owners, keep_in_float32, kept_float32_names
from longstraw.models.registry import build_on_meta, supported_model_types

pytestmark = pytest.mark.usefixtures("one_thread")

# Where we keep more than transformers: the sigmoid routers' e_score_correction_bias, which transformers' ports of
# these two hold in the model's dtype (a bf16 copy of a float32 checkpoint's bias can change which experts win);
# DeepSeek-V3, GLM and Ling keep it float32 in transformers too
MORE_THAN_TRANSFORMERS = {"minimax_m2": r"\.mlp\.gate\.e_score_correction_bias$",
                          "kimi_linear": r"\.mlp\.gate\.e_score_correction_bias$"}
# our aliases transformers has no config class for, and the implementation they load as
ALIASES = {"kimi_k2": "deepseek_v3"}


class _Block(KeepsFloat32, nn.Module):
    keep_float32 = ("gate.rate", "scale", "absent.bias")

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(3, 3)
        self.gate = nn.Module()
        self.gate.rate = nn.Parameter(torch.tensor([1.0 + 2**-12, 3.0]))  # not a bf16 or fp16 value
        self.register_buffer("scale", torch.tensor([0.1, 0.2]))
        self.absent = nn.Linear(2, 2, bias=False)


def test_kept_tensors_stay_float32_through_half_casts_and_follow_the_others_otherwise():
    b = _Block()
    rate = b.gate.rate
    want = rate.detach().clone()
    b.gate.rate.grad = torch.ones(2)
    for cast in (lambda m: m.to(torch.bfloat16), lambda m: m.half(), lambda m: m.bfloat16()):
        m = cast(b)
        assert m.proj.weight.dtype in (torch.bfloat16, torch.float16)
        assert m.gate.rate.dtype == m.scale.dtype == torch.float32
        assert b.gate.rate is rate and torch.equal(b.gate.rate.detach(), want)  # the same Parameter, not rounded
        assert b.gate.rate.grad.dtype == torch.float32  # its gradient keeps its dtype too
    b.double()
    assert b.gate.rate.dtype == b.proj.weight.dtype == torch.float64  # a float64 model is all float64
    b.float().to("meta", torch.float16).to_empty(device="cpu")
    assert b.gate.rate.dtype == torch.float32 and b.proj.weight.dtype == torch.float16
    loose = keep_in_float32(_Block(), "gate.rate", strict=False)  # fp16 only
    assert loose.to(torch.bfloat16).gate.rate.dtype == torch.bfloat16
    assert loose.float().half().gate.rate.dtype == torch.float32
    with pytest.raises(TypeError, match="Linear cannot keep tensors in float32"):
        keep_in_float32(nn.Linear(2, 2), "weight")


def test_an_owner_holding_a_compute_dtype_parameter_itself_is_refused():
    b = _Block()
    b.gate.other = nn.Parameter(torch.zeros(2))  # beside the kept rate in the same module: no FSDP2 unit takes it
    with pytest.raises(ValueError, match=r"_Block.gate keeps \['rate'\] in float32 beside \['other'\]"):
        float32_owners(b, torch.bfloat16)
    owners = float32_owners(_Block(), torch.bfloat16)
    assert [type(o).__name__ for o in owners] == ["Module"]  # the gate (the buffer is no parameter)
    assert float32_owners(_Block(), torch.float32) == []


def _transformers_keeps(model_type: str) -> tuple[dict, set, set]:
    """transformers' default config (as a dict) for ``model_type`` and its model classes' strict and fp16-only
    keep lists (the text model's too, where a composite model registers them from its submodel)."""
    cfg = AutoConfig.for_model(ALIASES.get(model_type, model_type))
    strict, loose = set(), set()
    for c in (cfg, getattr(cfg, "text_config", None)):
        if c is None:
            continue
        for auto in (AutoModelForCausalLM, AutoModelForImageTextToText):
            cls = auto._model_mapping.get(type(c), None)
            if cls is not None:
                strict |= set(cls._keep_in_fp32_modules_strict or ())
                loose |= set(cls._keep_in_fp32_modules or ())
    d = cfg.to_dict()
    d["model_type"] = model_type
    return d, strict, loose


@pytest.mark.parametrize("model_type", supported_model_types())
def test_every_family_keeps_in_float32_what_transformers_keeps(model_type):
    """For bf16 and fp16: the tensors of our model (built on meta from transformers' default config) that stay
    float32 are those whose names match transformers' keep lists (its loader's rule: a search for the module name
    in the tensor's name), and the owners of kept parameters can be FSDP2 units."""
    cfg, strict, loose = _transformers_keeps(model_type)
    model = build_on_meta(cfg)
    for dtype in (torch.bfloat16, torch.float16):
        model.to(dtype)
        keep = strict | (loose if dtype == torch.float16 else set())
        tensors = {n: t for n, t in [*model.named_parameters(), *model.named_buffers()]
                   if t.is_floating_point() and not n.endswith("inv_freq")}
        pattern = "|".join(re.escape(k) for k in keep)
        want = {n for n in tensors if keep and re.search(pattern, n)}
        extra = MORE_THAN_TRANSFORMERS.get(model_type)
        want |= {n for n in tensors if extra and re.search(extra, n)}
        got = {n for n, t in tensors.items() if t.dtype == torch.float32}
        assert got == want, (dtype, sorted(got - want)[:3], sorted(want - got)[:3])
        named = kept_float32_names(model, dtype)
        assert {n for n in named if n in dict(model.named_parameters())} == \
            {n for n in want if n in dict(model.named_parameters())}
        float32_owners(model, dtype)  # no owner mixes dtypes


def _ling_with_float32_values(tmp_path):
    """A tiny transformers Ling 3.0 model whose convs and forget-gate rates hold values bf16 cannot, saved in
    float32; returns it and the checkpoint."""
    cfg = BailingHybridConfig(**{k: v for k, v in tiny_config().items() if k not in ("model_type", "architectures")})
    hf = tiny_moe_hf(cfg, seed=3).float()
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if re.search(r"conv1d|dt_bias|A_log", n):
                p.add_(2**-12 * torch.rand(p.shape, generator=torch.Generator().manual_seed(7)))
    return hf, save_tiny(hf, dtype=torch.float32)


def test_ling_loads_its_float32_tensors_unrounded_and_exports_them_as_transformers_saves(tmp_path):
    """bf16 loads (ours, transformers') keep the short convs and forget-gate rates in float32 with the checkpoint's
    values, which bf16 would have rounded; ``save_model(dtype=bfloat16)`` of a float32 (master-weight) model writes
    every tensor in the dtype transformers' ``save_pretrained`` of its bf16 model writes it."""
    _, path = _ling_with_float32_values(tmp_path)
    ours = longstraw.load_model(path, dtype=torch.bfloat16)
    theirs = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, experts_implementation="eager")
    mine = dict(ours.named_parameters())
    kept = [n for n in mine if re.search(r"conv1d|dt_bias|A_log", n)]
    assert len(kept) == 6
    hf_params = dict(theirs.named_parameters())
    for n in kept:
        ref = hf_params[n]
        assert mine[n].dtype == ref.dtype == torch.float32, n
        assert torch.equal(mine[n].detach(), ref.detach()), n
        assert not torch.equal(ref.detach().bfloat16().float(), ref.detach()), n  # bf16 would have rounded
    assert ours.model.layers[0].self_attn.forget_gate.f_proj.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 61, (1, 12))
    with torch.no_grad():
        assert ours(ids).isfinite().all()

    theirs.save_pretrained(tmp_path / "theirs")
    longstraw.save_model(longstraw.load_model(path, dtype=torch.float32), tmp_path / "ours", dtype="bfloat16")

    def dtypes(d):
        with safe_open(d / "model.safetensors", "pt") as f:
            return {k: f.get_slice(k).get_dtype() for k in f.keys()}

    a, b = dtypes(tmp_path / "ours"), dtypes(tmp_path / "theirs")
    assert a == b and sorted(set(a.values())) == ["BF16", "F32"]
