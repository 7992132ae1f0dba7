"""Helpers that build tiny random transformers models and run them as exact float64 references.

transformers casts to float32 inside float64 models (RMSNorm ``.to(torch.float32)``, routers ``.type(float32)`` and
``softmax(dtype=float)``, the DeltaNet kernels), which makes a "float64" HF model only float32-accurate and turns 1e-16 differences into random
6e-8 rounding flips. ``true_float64()`` makes those casts no-ops for float64 tensors while a reference runs, so the
reference is a genuine float64 computation of the same math. RoPE keeps its float32 angles as in real use:
``float32_rope`` puts the ``inv_freq`` buffers back to float32 after ``model.to(float64)`` (HF forms angles in
float32, and so do we).
"""

from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import torch

_orig_to = torch.Tensor.to
_orig_float = torch.Tensor.float
_orig_type = torch.Tensor.type
_orig_softmax = torch.nn.functional.softmax


def _to(self, *args, **kwargs):
    if self.dtype == torch.float64:
        if kwargs.get("dtype") is torch.float32:
            kwargs["dtype"] = torch.float64
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
    return _orig_to(self, *args, **kwargs)


def _float(self, *args, **kwargs):
    if self.dtype == torch.float64:
        return self
    return _orig_float(self, *args, **kwargs)


def _type(self, dtype=None, *args, **kwargs):  # DeepSeek/GLM routers: hidden.type(torch.float32)
    if self.dtype == torch.float64 and dtype in (torch.float32, "torch.FloatTensor"):
        return self
    return _orig_type(self, dtype, *args, **kwargs)


def _softmax(input, dim=None, _stacklevel=3, dtype=None):  # Qwen routers: softmax(..., dtype=torch.float)
    if input.dtype == torch.float64 and dtype == torch.float32:
        dtype = torch.float64
    return _orig_softmax(input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)


@contextlib.contextmanager
def float64_softmax():
    """Only ``softmax(..., dtype=torch.float)`` of float64 inputs kept in float64 (HF's MoE routers)."""
    torch.nn.functional.softmax = _softmax
    try:
        yield
    finally:
        torch.nn.functional.softmax = _orig_softmax


@contextlib.contextmanager
def true_float64():
    torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = _to, _float, _type
    try:
        with float64_softmax():
            yield
    finally:
        torch.Tensor.to, torch.Tensor.float, torch.Tensor.type = _orig_to, _orig_float, _orig_type


def float32_rope(model):
    """RoPE tables in float32, as transformers builds them (a model cast to float64 casts its ``inv_freq`` buffers
    too; Gemma 3 keeps one per layer type: ``full_attention_inv_freq``, ...)."""
    for mod in model.modules():
        for name, buf in list(mod.named_buffers(recurse=False)):
            if name.endswith("inv_freq") and buf.dtype == torch.float64:
                setattr(mod, name, buf.float())
    return model


def save_tiny(hf_model, dtype=torch.float64, **save_kwargs) -> Path:
    """Save an HF model in ``dtype`` to a fresh temp dir and return the path."""
    d = Path(tempfile.mkdtemp(prefix="longstraw-test-"))
    float32_rope(hf_model.to(dtype)).save_pretrained(d, **save_kwargs)
    return d


def tiny_hf(config, seed: int = 0, dtype=torch.float64, init_std: float = 0.2, attn: str = "sdpa"):
    """A random HF causal LM for ``config`` with weights large enough that logits are not all near zero,
    and norm weights perturbed away from their init so a wrong norm variant would be caught. ``attn``: transformers'
    attention implementation (GPT-OSS has no SDPA one: ``"eager"``)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    config._attn_implementation = attn
    return _perturbed(AutoModelForCausalLM.from_config(config), init_std, dtype)


def _perturbed(model, std: float, dtype=torch.float64):
    """``model`` with its matrices drawn from N(0, ``std``) and its vectors (norms, biases) moved by N(0, 0.1), from
    the global generator, in ``dtype`` with float32 RoPE tables, eval mode."""
    with torch.no_grad():
        for _, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, std)
            else:
                p.add_(torch.randn_like(p) * 0.1)
    return float32_rope(model.to(dtype)).eval()


def prefill_states(model, ids, p: int, chunk: int, exact: bool = False) -> list:
    """The model-level prefill protocol by hand (what ``engine.prefill`` does): positions ``[0, p)`` of
    ``ids [1, T]`` run in chunks of ``chunk`` against the states so far, each piece written into fresh states."""
    states = model.new_prompt_states(p, exact)
    for s in range(0, p, chunk):
        e = min(p, s + chunk)
        _, pieces = model.run(ids[:, s:e], s, [st.prefix(s, False) for st in states], need_hidden=False)
        for st, pc in zip(states, pieces):
            st.write(pc, s, e)
    return states


def cached_pairs(make):
    """``pair(name) -> (HF model, its checkpoint directory)``: ``make(name)`` builds the model, saved with
    :func:`save_tiny`, once per process and name."""
    cache = {}

    def pair(name):
        if name not in cache:
            hf = make(name)
            cache[name] = (hf, save_tiny(hf))
        return cache[name]

    return pair


def moe_save_round_trip(model, source: Path, out: Path, vocab: int, **hf_kwargs) -> tuple[dict, object]:
    """``save_model(model, out)`` of an MoE model loaded from ``source``: the tensor names are those transformers
    wrote there (per-expert, none fused, unless transformers writes them fused), and transformers' model of ``out``
    (``from_pretrained(..., **hf_kwargs)``) gives ``model``'s float64 logits (<= 1e-10). Returns (the saved tensors
    by name, transformers' model)."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    import longstraw

    longstraw.save_model(model, out)
    saved = load_file(out / "model.safetensors")
    assert set(saved) == set(load_file(source / "model.safetensors"))  # the names transformers writes
    if not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in load_file(source / "model.safetensors")):
        assert not any(n.endswith(("gate_up_proj", "experts.down_proj")) for n in saved)
    back = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64, experts_implementation="eager",
                                                **hf_kwargs).eval()
    ids = torch.randint(0, vocab, (1, 23))
    with torch.no_grad(), true_float64():
        hf_logits = back(ids).logits
    with torch.no_grad():
        assert (hf_logits - model(ids)).abs().max().item() <= 1e-10
    return saved, back


def continuation_error(model, ids, p: int, chunk: int) -> tuple[float, list]:
    """Max |logits of positions ``p..`` of ``ids [1, T]`` run on a chunked prefill of ``[0, p)`` - a full forward's|
    (no autograd), and the prefilled states."""
    with torch.no_grad():
        full = model(ids)
        states = prefill_states(model, ids, p, chunk)
        hidden, _ = model.run(ids[:, p:], p, [st.prefix(p, False) for st in states])
        return (model.lm_head(hidden) - full[:, p:]).abs().max().item(), states


MLA_FORMS = ("auto", "absorbed", "decompressed")


def load_in_form(path, form: str | None = None, **kw):
    """``longstraw.load_model(path, **kw)`` with every MLA layer in ``form`` (None: as loaded), decompressing 5
    stored positions at a time (several chunks even on tiny prompts)."""
    import longstraw
    from longstraw.models.mla import set_mla_mode

    model = longstraw.load_model(path, **kw)
    if form is not None:
        set_mla_mode(model, form, decompress_chunk=5)
    return model


def check_logits_in_every_form(path, want, ids) -> None:
    """The model at ``path`` (float64) gives logits ``want`` of ``ids`` within 1e-10 in every MLA form."""
    for form in MLA_FORMS:
        model = load_in_form(path, form)
        assert next(model.parameters()).dtype == torch.float64
        with torch.no_grad():
            assert (model(ids) - want).abs().max().item() <= 1e-10, form


def check_continuation_in_every_form(path, ids, p: int, chunk: int) -> list:
    """A chunked prefill of ``[0, p)`` then the rest equals a full forward (float64, 1e-10) in every MLA form;
    returns the last form's prefilled states."""
    for form in MLA_FORMS:
        err, states = continuation_error(load_in_form(path, form), ids, p, chunk)
        assert err <= 1e-10, form
    return states


def check_grads_in_every_form(hf, path, ids, w) -> dict:
    """The gradients of ``sum(logits * w)`` equal transformers' (``weighted_logit_grads``; rtol 1e-9, atol 1e-11)
    for every parameter, in every MLA form; returns transformers' gradients by name."""
    for form in MLA_FORMS:
        got, want = weighted_logit_grads(hf, load_in_form(path, form), ids, w)
        assert set(got) == set(want)
        for n in want:
            torch.testing.assert_close(got[n], want[n], rtol=1e-9, atol=1e-11, msg=f"{form} {n}")
    return want


def weighted_logit_grads(hf, model, ids, w) -> tuple[dict, dict]:
    """The gradients of ``sum(logits * w)``: ours (``hf_grads``, transformers' names) and transformers' in float64,
    by parameter name; the HF model's ``.grad`` is cleared after."""
    import longstraw

    hf.zero_grad()
    with true_float64():
        (hf(ids).logits * w).sum().backward()
    want = {n: p.grad.clone() for n, p in hf.named_parameters() if p.grad is not None}
    hf.zero_grad()
    (model(ids) * w).sum().backward()
    return longstraw.hf_grads(model), want


def tiny_moe_hf(config, seed: int, attn: str = "sdpa"):
    """``tiny_hf`` of an MoE config with eager experts and the DeepSeek/GLM routers' ``e_score_correction_bias``
    perturbed away from zero (so a wrong bias path is caught)."""
    config._experts_implementation = "eager"
    hf = tiny_hf(config, seed=seed, init_std=0.15, attn=attn)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, dtype=b.dtype) * 0.3)
    return hf


def check_float64_parity(hf, model, vocab: int, ids, grad_len: int = 23, rel: float = 1e-9) -> dict:
    """``model``'s float64 logits of ``ids [B, T]`` equal transformers' (<= 1e-10), and the gradients of a weighted
    sum of the logits of the first ``grad_len`` positions equal transformers' for every parameter (relative to
    ``rel``, under transformers' names). Returns our gradients."""
    with torch.no_grad(), true_float64():
        want = hf(ids).logits
    with torch.no_grad():
        got = model(ids)
    assert (got - want).abs().max().item() <= 1e-10
    b = ids.shape[0]
    got_g, want_g = weighted_logit_grads(hf, model, ids[:, :grad_len],
                                         torch.randn(b, grad_len, vocab, dtype=torch.float64))
    assert set(got_g) == set(want_g)
    for n, g in want_g.items():
        assert (got_g[n] - g).abs().max().item() <= rel * max(1.0, g.abs().max().item()), n
    return got_g


def check_low_precision(path: Path, vocab: int, hf64=None, bf16_inputs: int = 8, **hf_kwargs) -> None:
    """float32 logits within 1e-4 and bfloat16 within 5% (of the largest logit) of transformers' model loaded in the
    same dtype (``from_pretrained(..., **hf_kwargs)``). ``hf64`` (transformers' float64 model: MoE families): in
    bfloat16 a router's near-ties flip experts on either side, so ours is held to the float64 logits instead, no
    further from them than transformers' bfloat16 model is (mean over ``bf16_inputs`` seeded inputs, 25% and 0.01 of
    slack; a family whose flips cost more per input needs more inputs for a stable mean)."""
    from transformers import AutoModelForCausalLM

    import longstraw

    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.05)):
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **hf_kwargs).eval()
        model = longstraw.load_model(path, dtype=str(dtype).removeprefix("torch."))
        seeds = range(bf16_inputs) if hf64 is not None and dtype == torch.bfloat16 else range(1)
        ours, theirs = [], []
        for seed in seeds:
            ids = torch.randint(0, vocab, (2, 19), generator=torch.Generator().manual_seed(seed))
            with torch.no_grad():
                want, got = hf(ids).logits.float(), model(ids).float()
                if hf64 is None or dtype == torch.float32:
                    assert (got - want).abs().max().item() <= tol * want.abs().max().item(), dtype
                    continue
                with true_float64():
                    ref = hf64(ids).logits.float()
            scale = ref.abs().max().item()
            ours.append((got - ref).abs().max().item() / scale)
            theirs.append((want - ref).abs().max().item() / scale)
        if ours:
            assert sum(ours) / len(ours) <= 1.25 * sum(theirs) / len(theirs) + 0.01, (ours, theirs)


def randomised(model, seed: int):
    """``model`` (a multimodal transformers model built from its config) with random weights large enough to
    matter (matrices N(0, 0.2), vectors perturbed by N(0, 0.1)), in float64 with float32 RoPE tables, eval mode."""
    torch.manual_seed(seed)
    return _perturbed(model, 0.2)


def qwen3_vl_config(config_cls, vocab: int, text: dict, **top):
    """A tiny Qwen3-VL / Qwen3-VL-MoE config (``config_cls``): the text model ``text`` with interleaved M-RoPE (theta
    5e6, sections for head_dim 8), a one-block vision tower, the special tokens at the top of the vocabulary; SDPA."""
    text = {**text, "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [2, 1, 1],
                                        "mrope_interleaved": True}}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=text["hidden_size"],
                  deepstack_visual_indexes=[0], patch_size=4, spatial_merge_size=2, temporal_patch_size=2,
                  num_position_embeddings=16)
    cfg = config_cls(text_config=text, vision_config=vision, image_token_id=vocab - 1, video_token_id=vocab - 2,
                     vision_start_token_id=vocab - 3, vision_end_token_id=vocab - 4, **top)
    cfg._attn_implementation = "sdpa"
    return cfg


def check_multimodal_text_model(hf, tmp: Path, text_type: str, ids, **hf_kwargs):
    """A multimodal checkpoint saved by transformers from ``hf``: LongStraw loads its text model (``text_type``) with
    one warning about the vision tower and transformers' logits of ``ids`` (float64, <= 1e-10); ``save_model``
    writes a text-only checkpoint (``model_type`` ``text_type``, no ``vision_config``) that transformers loads
    (``from_pretrained(..., **hf_kwargs)``) with the same logits. Returns LongStraw's model."""
    import json
    import warnings

    from transformers import AutoModelForCausalLM

    import longstraw

    hf.save_pretrained(tmp / "mm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = longstraw.load_model(tmp / "mm")
    assert len([w for w in caught if "vision tower" in str(w.message)]) == 1
    assert model.spec.model_type == text_type and model.hf_config["model_type"] == text_type
    with torch.no_grad(), true_float64():
        want = hf(input_ids=ids).logits
    with torch.no_grad():
        assert (model(ids) - want).abs().max().item() <= 1e-10
    longstraw.save_model(model, tmp / "text")
    cfg = json.loads((tmp / "text" / "config.json").read_text())
    assert cfg["model_type"] == text_type and "vision_config" not in cfg
    back = float32_rope(AutoModelForCausalLM.from_pretrained(tmp / "text", dtype=torch.float64, **hf_kwargs).eval())
    with torch.no_grad(), true_float64():
        assert (back(ids).logits - want).abs().max().item() <= 1e-10
    return model


def check_windowed_continuation(path: Path, vocab: int, chunk: int, total: int = 40, p: int = 27) -> None:
    """A chunked prefill of ``p`` of ``total`` random positions and the continuation equal a full forward (float64,
    <= 1e-10); a full-attention layer's state holds every position (``KVState``), a sliding one's only its tails
    (``SlidingKVState``: fewer than ``window + chunk`` positions in detached mode)."""
    import longstraw
    from longstraw.state import KVState, SlidingKVState

    model = longstraw.load_model(path)
    err, states = continuation_error(model, torch.randint(0, vocab, (1, total)), p, chunk)
    assert err <= 1e-10 and all(st.length == p for st in states)
    for st, layer in zip(states, model.model.layers):
        w = layer.self_attn.window
        assert isinstance(st, KVState if w is None else SlidingKVState)
        assert w is None or sum(t.k.shape[2] for t in st.tails) < w + chunk
