"""The naive GRPO reference: an HF transformers model on the G concatenated prompt+response sequences, with
autograd, and the loss written in verl's batch form (``[G, T]`` matrices, a mask, ``agg_loss``).

``detached=True`` evaluates the prompt without autograd (HF KV/recurrent cache from a ``no_grad`` prompt pass,
then each branch with autograd on top of a copy of it): the reference for LongStraw's detached mode.
"""

from __future__ import annotations

import contextlib
import copy

import torch
from hf_reference import true_float64

import longstraw

ADVANTAGES = (1.3, -0.7, 0.4, -1.6, 0.9, -0.2)


def agg_loss(mat, mask, mode, scale_factor=None):
    if mode == "token-mean":
        return (mat * mask).sum() / mask.sum()
    if mode == "seq-mean-token-sum":
        return (mat * mask).sum(-1).mean()
    if mode == "seq-mean-token-mean":
        return ((mat * mask).sum(-1) / mask.sum(-1)).mean()
    if mode == "seq-mean-token-sum-norm":
        return (mat * mask).sum() / (scale_factor or mask.shape[-1])
    raise AssertionError(mode)


def _branch_logits_detached(hf, prompt, responses):
    with torch.no_grad():
        cache = hf(prompt[None, :-1], use_cache=True).past_key_values
    out = []
    p = prompt.numel()
    for r in responses:
        ids = torch.cat([prompt[-1:], r[:-1]])[None]
        pos = torch.arange(p - 1, p - 1 + ids.shape[1])[None]
        out.append(hf(ids, past_key_values=copy.deepcopy(cache), position_ids=pos, use_cache=True).logits[0])
    return out


def reference_loss(hf, prompt, responses, adv, *, mode="token-mean", clip_low=0.2, clip_high=0.2, clip_c=3.0,
                   kl_coef=0.0, kl_type="low_var_kl", entropy_coef=0.0, old=None, ref=None, detached=False,
                   temperature=1.0, scale_factor=None, ratio_level="token", kl_ratio_weight=False):
    """Returns (loss, per-branch log-probs [n_i]) computed the naive way, graph attached to hf's parameters."""
    g = len(responses)
    p = prompt.numel()
    lens = [r.numel() for r in responses]
    t = max(lens)
    with true_float64():
        if detached and p > 1:
            branch_logits = _branch_logits_detached(hf, prompt, responses)
        else:
            seqs = torch.zeros(g, p + t, dtype=torch.long)
            for i, r in enumerate(responses):
                seqs[i, :p] = prompt
                seqs[i, p : p + lens[i]] = r
            logits = hf(seqs).logits
            branch_logits = [logits[i, p - 1 : p - 1 + lens[i]] for i in range(g)]
        dtype = branch_logits[0].dtype
        logp = torch.zeros(g, t, dtype=dtype)
        ent = torch.zeros(g, t, dtype=dtype)
        mask = torch.zeros(g, t, dtype=dtype)
        for i, (lg, r) in enumerate(zip(branch_logits, responses)):
            ls = torch.log_softmax(lg / temperature, -1)
            logp[i, : lens[i]] = ls.gather(1, r[:, None])[:, 0]
            ent[i, : lens[i]] = -(ls.exp() * ls).sum(-1)
            mask[i, : lens[i]] = 1
        pad = lambda xs: torch.stack([torch.nn.functional.pad(torch.as_tensor(x, dtype=dtype), (0, t - len(x)))  # noqa
                                      for x in xs])
        old_m = pad(old) if old is not None else logp.detach()
        a = torch.as_tensor(adv, dtype=dtype)[:, None]
        if ratio_level == "sequence":  # GSPO: one ratio per response, exp of its mean log-ratio
            mean = ((logp - old_m) * mask).sum(1, keepdim=True) / mask.sum(1, keepdim=True)
            neg_kl = torch.clamp(mean, -20, 20).expand_as(logp)
        else:
            neg_kl = torch.clamp(logp - old_m, -20, 20)
        ratio = torch.exp(neg_kl)
        pg1, pg2 = -a * ratio, -a * torch.clamp(ratio, 1 - clip_low, 1 + clip_high)
        c1 = torch.maximum(pg1, pg2)
        pg = torch.where(a < 0, torch.minimum(-a * clip_c, c1), c1) if clip_c is not None else c1
        loss = agg_loss(pg, mask, mode, scale_factor)
        if kl_coef:
            ref_m = pad(ref)
            if kl_type == "k1":
                kl = logp - ref_m
            elif kl_type == "k2":
                kl = 0.5 * (logp - ref_m) ** 2
            elif kl_type == "k3":
                d = ref_m - logp
                kl = torch.exp(d) - d - 1
            else:
                d = torch.clamp(ref_m - logp, -20, 20)
                kl = torch.clamp(torch.exp(d) - d - 1, -10, 10)
            if kl_ratio_weight:
                kl = kl * ratio
            loss = loss + kl_coef * agg_loss(kl, mask, mode, scale_factor)
        if entropy_coef:
            loss = loss - entropy_coef * agg_loss(ent, mask, mode, scale_factor)
    return loss, [logp[i, : lens[i]].detach() for i in range(g)]


def assert_grads_close(ours: dict, hf_model, rel=1e-8):
    want = {n: p.grad for n, p in hf_model.named_parameters() if p.grad is not None}
    assert set(ours) == set(want), (set(ours) ^ set(want))
    worst = 0.0
    for n, w in want.items():
        scale = w.abs().max().item()
        err = (ours[n] - w).abs().max().item()
        r = err / scale if scale > 0 else err
        worst = max(worst, r)
        assert r <= rel, f"{n}: relative error {r:.3e} > {rel:.0e} (max |grad| {scale:.3e})"
    return worst


def check_group(model, hf, prompt, responses, adv, cfg, *, seed=0, rel=1e-8):
    """:func:`run_against_reference` on one group, then every parameter's gradient (``hf_grads``) against the
    reference's to ``rel``; the reference's ``.grad`` is cleared after. Returns the step's stats."""
    stats = run_against_reference(model, hf, prompt, responses, adv, cfg, seed=seed)
    assert_grads_close(longstraw.hf_grads(model), hf, rel=rel)
    hf.zero_grad()
    return stats


def check_score_and_generate(model, hf, prompt, responses, adv, sampling, *, g=3):
    """``score`` equals the naive reference's log-probs (1e-10); ``generate`` samples ``g`` branches with
    ``sampling`` and its log-probs equal a ``score`` of what it sampled (at the sampling temperature). Returns the
    rollout."""
    got = longstraw.score(model, prompt, responses, longstraw.GRPOConfig(prefill_chunk=6, branch_batch=2))
    with torch.no_grad():
        _, want = reference_loss(hf, prompt, responses, adv)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    ro = longstraw.generate(model, prompt, g, sampling, prefill_chunk=4)
    again = longstraw.score(model, prompt, ro.responses,
                            longstraw.GRPOConfig(prefill_chunk=5, temperature=sampling.temperature))
    for a, b in zip(ro.logprobs, again):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    return ro


def _value(x):
    return getattr(x, "value", x)  # a config enum's string


def random_group(seed: int, p: int, lens: list[int], vocab: int):
    """A seeded group: prompt ``[p]``, responses of lengths ``lens``, mixed-sign advantages (at most six)."""
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, vocab, (p,), generator=g)
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in lens]
    return prompt, responses, torch.tensor(ADVANTAGES[: len(lens)])


def run_against_reference(model, hf, prompt, responses, adv, cfg, *, seed=0, off_policy=True,
                          hf_patch=contextlib.nullcontext):
    """``grpo_backward`` of ``model`` and the naive reference loss + backward of ``hf`` on one group; returns stats.

    Old log-probs (``off_policy``) are the true ones perturbed, and on negative-advantage branches the first token's
    ratio is e^2 > ``clip_ratio_c`` (dual clip active); reference log-probs are perturbed too when ``kl_coef > 0``.
    Checks the per-token log-probs (1e-10) and the loss; the caller compares the gradients. ``hf_patch``: a context
    the reference runs in (a family's float64 patches)."""
    true_lp = longstraw.score(model, prompt, responses, cfg)
    g = torch.Generator().manual_seed(seed + 1)
    old = [lp + torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in true_lp] if off_policy else None
    if old is not None:
        for i in range(len(old)):
            if adv[i] < 0:
                old[i][0] = true_lp[i][0] - 2.0
    ref = [lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in true_lp] if cfg.kl_coef else None
    stats = longstraw.grpo_backward(model, prompt, responses, adv, cfg, old_logprobs=old, ref_logprobs=ref)
    hf.zero_grad()
    with hf_patch():
        loss, ref_lp = reference_loss(hf, prompt, responses, adv, mode=_value(cfg.loss_agg_mode),
                                      clip_c=cfg.clip_ratio_c, kl_coef=cfg.kl_coef, kl_type=_value(cfg.kl_type),
                                      entropy_coef=cfg.entropy_coef, old=old, ref=ref, detached=not cfg.exact,
                                      ratio_level=_value(cfg.ratio_level), kl_ratio_weight=cfg.kl_ratio_weight)
        loss.backward()
    for a, b in zip(stats.logprobs, ref_lp):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    assert abs(stats.loss - loss.item()) <= 1e-10 * max(1.0, abs(loss.item()))
    return stats
