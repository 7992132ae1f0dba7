"""Input checks of the engine's entry points: every bad value is a ``ValueError`` naming it, raised before
anything is computed (so a call that raises leaves ``.grad`` as it was)."""

from __future__ import annotations

import torch
from torch import Tensor

from longstraw.engine.config import GRPOConfig
from longstraw.models.transformer import CausalLM


def check_ids_1d(name: str, t) -> None:
    if not isinstance(t, Tensor):
        raise ValueError(f"{name} must be a 1-D LongTensor, got {type(t).__name__}")
    if t.dim() != 1:
        raise ValueError(f"{name} must be 1-D, got shape {tuple(t.shape)}")
    if t.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"{name} must hold integer token ids, got dtype {t.dtype}")
    if t.numel() == 0:
        raise ValueError(f"{name} is empty")


def check_per_token(name: str, values, responses: list[Tensor]) -> list[Tensor] | None:
    if values is None:
        return None
    if len(values) != len(responses):
        raise ValueError(f"{name} has {len(values)} entries for {len(responses)} responses")
    out = []
    for i, (v, r) in enumerate(zip(values, responses)):
        v = torch.as_tensor(v)
        if v.shape != r.shape:
            raise ValueError(f"{name}[{i}] has shape {tuple(v.shape)}, response {i} has {r.numel()} tokens")
        if not torch.isfinite(v).all():
            raise ValueError(f"{name}[{i}] holds a non-finite value ({v[~torch.isfinite(v)][0].item()})")
        out.append(v)
    return out


def validate_group(model: CausalLM, prompt_ids, responses) -> None:
    """ValueError naming the first bad value among a prompt and its responses."""
    check_ids_1d("prompt_ids", prompt_ids)
    if not isinstance(responses, (list, tuple)) or len(responses) == 0:
        raise ValueError("responses must be a non-empty list of 1-D LongTensors")
    model.check_ids(prompt_ids)
    p = prompt_ids.numel()
    for i, r in enumerate(responses):
        check_ids_1d(f"responses[{i}]", r)
        model.check_ids(r)
        model.spec.check_length(p + r.numel(), f"prompt ({p} tokens) + responses[{i}] ({r.numel()} tokens)")
    model.placement.check_group(prompt_ids, responses)  # processes sharing the prompt state must agree on it


def check_state(state, prompt_ids) -> None:
    if state is not None and state.length != prompt_ids.numel() - 1:
        raise ValueError(f"prompt_state holds {state.length} positions, the prompt needs {prompt_ids.numel() - 1}")


def validate_step(model, prompt_ids, responses, advantages, old_logprobs, ref_logprobs, cfg: GRPOConfig):
    validate_group(model, prompt_ids, responses)
    adv = torch.as_tensor(advantages, dtype=torch.float64).flatten() if not isinstance(advantages, Tensor) \
        else advantages.detach().flatten()
    if adv.numel() != len(responses):
        raise ValueError(f"{adv.numel()} advantages for {len(responses)} responses")
    if not torch.isfinite(adv).all():
        raise ValueError(f"advantages must be finite, got {adv[~torch.isfinite(adv)][0].item()}")
    old = check_per_token("old_logprobs", old_logprobs, responses)
    ref = check_per_token("ref_logprobs", ref_logprobs, responses)
    if cfg.kl_coef != 0 and ref is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} needs ref_logprobs (log-probs of the responses under the reference "
                         "model, e.g. from longstraw.score)")
    return adv, old, ref
