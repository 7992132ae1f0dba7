"""TRL's ``GRPOTrainer`` with LongStraw computing the policy loss and its gradients.

``LongStrawGRPOTrainer`` is constructed exactly like ``trl.GRPOTrainer`` and keeps TRL's data loading, reward
functions, advantages, logging, callbacks, optimiser, scheduler and gradient clipping. What changes is the model
work, which TRL does on ``G x (prompt + completion)`` rows with autograd:

* ``trainer.model`` is a LongStraw model loaded from the same weights as TRL's (so ``longstraw.hf_grads`` and
  ``longstraw.save_model`` work on it); TRL's transformers model is dropped after construction.
* Sampling: the rows of a generation batch are grouped by prompt and each group is sampled with
  :func:`longstraw.generate` (the prompt evaluated once, the completions decoded from its state) instead of
  ``model.generate`` on the padded rows. A ``rollout_func`` still replaces sampling entirely, as in TRL.
* Log-probs TRL needs before the loss (the old policy's for ``num_iterations > 1``, the reference's for
  ``beta > 0``) come from :func:`longstraw.score`, one prompt evaluation per group.
* The loss: each training micro-batch is split into groups of rows sharing one prompt (left padding dropped with
  ``prompt_mask``, right padding with ``completion_mask``), and :func:`longstraw.grpo_backward` adds each group's
  share of TRL's loss into ``.grad``: the prompt evaluated once, the completions replayed one at a time against its
  state, exact gradients through the prompt by default. Every branch is weighted by the normaliser TRL uses for its
  ``loss_type`` over the whole micro-batch and accumulation window (:meth:`LongStrawGRPOTrainer.loss_normaliser`),
  so the gradient is TRL's. ``training_step`` returns the detached loss for TRL's logging; Trainer's own
  ``backward`` is not run.

LoRA (``peft_config=peft.LoraConfig(...)``, as stock TRL): TRL's transformers model is not wrapped in PEFT; the
config's adapters are added to the LongStraw model (:func:`longstraw.add_lora`, PEFT's initialisation, ``B = 0``,
base frozen), so the optimiser Trainer builds trains the adapters (and ``modules_to_save``) only. With
``beta != 0`` the reference log-probs are the policy's with the adapters off (the model's ``disable_adapter()``,
what TRL's PEFT branch calls; ``modules_to_save`` at their initial values, as PEFT's), no model copy. Checkpoints are
PEFT adapter directories (``adapter_config.json`` + ``adapter_model.safetensors``) that
``peft.PeftModel.from_pretrained`` loads onto the transformers model.

TRL settings map onto the engine's :class:`longstraw.GRPOConfig` (:func:`engine_config`); a setting whose effect
the engine cannot reproduce is refused at construction with one line naming it, its value and what is allowed.
See docs/INTEGRATIONS.md for the table.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import time
from pathlib import Path

import torch

import longstraw
from longstraw import GRPOConfig, LossAggMode, SamplingConfig
from longstraw.checkpoint.adapter import ADAPTER_CONFIG, ADAPTER_WEIGHTS, adapter_settings, lora_settings
from longstraw.checkpoint.hf import hf_parameters
from longstraw.models.lora import LoraSettings, adapted_modules, adapters_disabled, is_adapter_param
from longstraw.models.transformer import CausalLM

try:
    import trl
    from transformers import PreTrainedModel
except ImportError as e:  # pragma: no cover - the extra is missing
    raise ImportError("longstraw.integrations.trl needs TRL: pip install 'longstraw[trl]'") from e

__all__ = ["LongStrawGRPOTrainer", "engine_config", "LOSS_TYPES"]

# TRL loss_type -> the engine's aggregation. The normaliser (the engine's loss_scale) is set per micro-batch by
# LongStrawGRPOTrainer.loss_normaliser, as TRL's _compute_loss divides.
LOSS_TYPES = {
    "grpo": LossAggMode.SEQ_MEAN_TOKEN_MEAN,   # mean over rows of (row token sum / row length), / accumulation
    "bnpo": LossAggMode.TOKEN_MEAN,            # micro-batch token sum / micro-batch tokens, / accumulation
    "dr_grpo": LossAggMode.SEQ_MEAN_TOKEN_SUM,  # token sum / (rows * max_completion_length), / accumulation
    "dapo": LossAggMode.TOKEN_MEAN,            # token sum / tokens of the accumulation window (num_items_in_batch)
    "luspo": LossAggMode.SEQ_MEAN_TOKEN_SUM,   # mean over rows of the row token sum, / accumulation
}
_WHY_NOT = ("cispo, sapo and vespo weight the log-probs with detached or soft-clipped ratios the engine's PPO "
            "objective does not compute")


def _refuse(setting: str, value, allowed: str) -> ValueError:
    return ValueError(f"LongStrawGRPOTrainer cannot honour {setting}={value!r}: {allowed}")


def check_args(args) -> None:
    """Raise one ValueError for the first TRL setting in ``args`` whose effect the engine cannot reproduce."""
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    checks = [
        ("loss_type", args.loss_type, args.loss_type in LOSS_TYPES,
         f"allowed: {', '.join(map(repr, LOSS_TYPES))} ({_WHY_NOT})"),
        ("importance_sampling_level", args.importance_sampling_level,
         args.importance_sampling_level in ("token", "sequence"), "allowed: 'token', 'sequence'"),
        ("delta", args.delta, args.delta is None or args.delta > 1 + eps_high,
         f"allowed: None or > 1 + epsilon_high = {1 + eps_high} (then it is the engine's dual clip; below, TRL's "
         "two-sided clip also caps positive-advantage ratios, which the engine does not)"),
        ("top_entropy_quantile", args.top_entropy_quantile, args.top_entropy_quantile == 1.0,
         "allowed: 1.0 (entropy masking needs every token's entropy before the loss)"),
        ("entropy_coef", args.entropy_coef, args.entropy_coef == 0.0,
         "allowed: 0.0 (TRL's entropy bonus is a micro-batch token mean for every loss_type)"),
        ("use_adaptive_entropy", args.use_adaptive_entropy, not args.use_adaptive_entropy, "allowed: False"),
        ("off_policy_mask_threshold", args.off_policy_mask_threshold, args.off_policy_mask_threshold is None,
         "allowed: None (off-policy sequence masking is not implemented)"),
        ("use_vllm", args.use_vllm, not args.use_vllm,
         "allowed: False (sampling runs on the LongStraw model; or bring completions with rollout_func)"),
        ("use_transformers_continuous_batching", args.use_transformers_continuous_batching,
         not args.use_transformers_continuous_batching, "allowed: False (sampling runs on the LongStraw model)"),
        ("use_liger_kernel", getattr(args, "use_liger_kernel", False), not getattr(args, "use_liger_kernel", False),
         "allowed: False (the loss is LongStraw's)"),
        ("min_p", args.min_p, args.min_p is None, "allowed: None (longstraw.generate samples with top_k/top_p)"),
        ("repetition_penalty", args.repetition_penalty, args.repetition_penalty == 1.0,
         "allowed: 1.0 (longstraw.generate has no repetition penalty)"),
        ("generation_kwargs", args.generation_kwargs, not args.generation_kwargs,
         "allowed: None (set temperature, top_p, top_k and max_completion_length instead)"),
        ("sync_ref_model", args.sync_ref_model, not args.sync_ref_model, "allowed: False"),
        ("eval_strategy", str(getattr(args.eval_strategy, "value", args.eval_strategy)),
         str(getattr(args.eval_strategy, "value", args.eval_strategy)) == "no",
         "allowed: 'no' (evaluation is not implemented yet)"),
        ("world_size", args.world_size, args.world_size == 1,
         "allowed: 1 (one process; for many GPUs use longstraw's torchrun trainer)"),
        ("deepspeed", args.deepspeed, not args.deepspeed, "allowed: None"),
        ("fsdp", args.fsdp, not args.fsdp, "allowed: none (one process)"),
        ("neftune_noise_alpha", args.neftune_noise_alpha, args.neftune_noise_alpha is None,
         "allowed: None (NEFTune's embedding noise is a transformers forward hook; the engine has no such hook)"),
        ("torch_compile", args.torch_compile, not args.torch_compile,
         "allowed: False (the engine runs the LongStraw model, not Trainer's compiled wrapper)"),
        ("optim", str(getattr(args.optim, "value", args.optim)),
         "lomo" not in str(getattr(args.optim, "value", args.optim)).lower(),
         "allowed: an optimiser that steps on .grad (LOMO / AdaLomo update inside Trainer's backward, which the "
         "engine replaces)"),
    ]
    for setting, value, ok, allowed in checks:
        if not ok:
            raise _refuse(setting, value, allowed)


def engine_config(args, *, prompt_grad: str = "exact", prefill_chunk: int = 4096, branch_batch: int = 1,
                  logprob_chunk: int = 1024, offload_state_grad: bool = False,
                  graph_budget_bytes: int | None = None, offload_state: bool = False) -> GRPOConfig:
    """The engine's :class:`longstraw.GRPOConfig` for TRL's ``args`` (checked first with :func:`check_args`).

    epsilon / epsilon_high -> clip_ratio_low / clip_ratio_high; delta (TRL's two-sided clip, which caps the
    unclipped ratio at delta) -> the dual clip ``clip_ratio_c``: for delta > 1 + epsilon_high both cap a
    negative-advantage token's loss at ``-A * delta`` and leave positive advantages alone (None: no dual clip);
    importance_sampling_level -> ratio_level; beta -> kl_coef with TRL's k3 estimator (``k3``, unclamped),
    use_bias_correction_kl -> kl_ratio_weight; temperature; bf16 / fp16 -> autocast compute dtype; activation
    (gradient) checkpointing -> checkpoint_layers. The other keywords are the engine's own settings.
    """
    check_args(args)
    eps_high = args.epsilon_high if args.epsilon_high is not None else args.epsilon
    compute = "bfloat16" if args.bf16 else "float16" if args.fp16 else None
    ckpt = bool(getattr(args, "activation_checkpointing", False) or getattr(args, "gradient_checkpointing", False))
    return GRPOConfig(prompt_grad=prompt_grad, loss_agg_mode=LOSS_TYPES[args.loss_type],
                      clip_ratio_low=args.epsilon, clip_ratio_high=eps_high, clip_ratio_c=args.delta,
                      kl_coef=float(args.beta), kl_type="k3", entropy_coef=0.0,
                      ratio_level=args.importance_sampling_level,
                      kl_ratio_weight=bool(args.use_bias_correction_kl and args.beta),
                      temperature=float(args.temperature), compute_dtype=compute, checkpoint_layers=ckpt,
                      prefill_chunk=prefill_chunk, branch_batch=branch_batch, logprob_chunk=logprob_chunk,
                      offload_state_grad=offload_state_grad, graph_budget_bytes=graph_budget_bytes,
                      offload_state=offload_state)


_DROPOUT_KEYS = ("dropout", "pdrop")


def _active_dropout(config) -> list[str]:
    """The config's dropout probabilities above zero (``attention_dropout=0.1``, ...): transformers applies them in
    training, the engine has no dropout."""
    return [f"{k}={v}" for k, v in sorted(vars(config).items())
            if any(d in k for d in _DROPOUT_KEYS) and isinstance(v, float) and v > 0]


def _check_constructor(model, quantization_config, tools, environment_factory) -> None:
    if getattr(model, "peft_config", None) is not None:
        raise _refuse("model", type(model).__name__, "allowed: a model id, a directory or a transformers model "
                      "without PEFT adapters (LoRA: pass peft_config=LoraConfig(...); continuing a trained adapter: "
                      "longstraw's own trainer, [lora] adapter=...)")
    if quantization_config is not None:
        raise _refuse("quantization_config", type(quantization_config).__name__, "allowed: None")
    if tools:
        raise _refuse("tools", [getattr(t, "__name__", t) for t in tools],
                      "allowed: None (tool tokens are masked per token; the engine weights whole completions)")
    if environment_factory is not None:
        raise _refuse("environment_factory", environment_factory, "allowed: None (as tools)")


# LoraConfig fields a loaded adapter may carry (checkpoint.adapter accepts them) but a fresh one trained here may not:
# the adapters are initialised as PEFT's default (B = 0), and the LoRA variants below compute something else
_FRESH_ONLY = {"init_lora_weights": (True,), "inference_mode": (False,), "use_bdlora": (None, False),
               "velora_config": (None,), "monteclora_config": (None,), "kasa_config": (None,)}


def _peft_refusal(detail: str) -> ValueError:
    return ValueError(f"LongStrawGRPOTrainer cannot honour peft_config (LoraConfig): {detail}")


def lora_settings_of(peft_config) -> LoraSettings:
    """The :class:`longstraw.models.lora.LoraSettings` of a ``peft.LoraConfig`` TRL would apply, or one ValueError
    naming the first field the LongStraw model cannot train as PEFT would.

    The config is written as PEFT writes it (``adapter_config.json``) and read back with
    :func:`longstraw.checkpoint.adapter.adapter_settings`, so the rules are ``load_adapter``'s (no DoRA, biases,
    ``fan_in_fan_out``, layer selection, base-rewriting initialisations...); a fresh adapter also needs PEFT's default
    initialisation (``init_lora_weights=True``) and no other LoRA variant (:data:`_FRESH_ONLY`). Whether the targets
    exist is checked when the adapters are added."""
    try:
        from peft import LoraConfig
    except ImportError as e:  # pragma: no cover - TRL's peft extra is missing
        raise ImportError("peft_config needs PEFT: pip install peft") from e
    if not isinstance(peft_config, LoraConfig):
        raise _refuse("peft_config", type(peft_config).__name__, "allowed: None or a peft.LoraConfig (LoRA is the "
                      "adapter type LongStraw trains)")
    for key, ok in _FRESH_ONLY.items():
        v = getattr(peft_config, key, ok[0])
        if v not in ok:
            raise _peft_refusal(f"{key}={v!r} (allowed: {ok[0]!r}: adapters are initialised as PEFT's default, "
                                "B = 0, and trained as plain LoRA)")
    with tempfile.TemporaryDirectory(prefix="longstraw-trl-peft-") as d:
        peft_config.save_pretrained(d)
        try:
            return adapter_settings(d)
        except ValueError as e:
            raise _peft_refusal(str(e).split(f"{ADAPTER_CONFIG}: ", 1)[-1]) from None


def _check_lora_training(lora: LoraSettings, args, cfg: GRPOConfig, optimizers) -> None:
    """Refuse, before TRL loads anything, a LoRA run the engine cannot do as TRL + PEFT would."""
    if optimizers[0] is not None:
        raise _refuse("optimizers", f"({type(optimizers[0]).__name__}, ...) with peft_config", "allowed: (None, None) "
                      "with peft_config (an optimiser built before the adapters exist holds the transformers model's "
                      "parameters, none of them trained with LoRA; set args.optim, learning_rate, ... instead)")
    if lora.lora_dropout > 0 and not args.disable_dropout and cfg.exact:
        raise _peft_refusal(f"lora_dropout={lora.lora_dropout} with disable_dropout=False and prompt_grad='exact' "
                            "(allowed: lora_dropout=0; disable_dropout=True, which switches LoRA dropout off as TRL "
                            "does on its PEFT model; or prompt_grad='detached': the exact reverse pass replays the "
                            "prompt and cannot replay its dropout masks)")


def _move_optimizer(optimizer: torch.optim.Optimizer, hf_model: torch.nn.Module, model: CausalLM) -> None:
    """Point a user's optimiser, built over the transformers model's parameters, at the LongStraw model's
    parameters of the same names (in place: its class, hyper-parameters, state and any scheduler bound to it stay).

    Every parameter it holds must be one of the transformers model's with a LongStraw counterpart of the same shape
    (fused or renamed layouts such as routed experts are matched by transformers' in-memory names)."""
    hf_names = {id(p): n for n, p in hf_model.named_parameters()}
    ours = hf_parameters(model)
    swap: dict[int, torch.nn.Parameter] = {}
    for group in optimizer.param_groups:
        for p in group["params"]:
            name = hf_names.get(id(p))
            if name is None:
                raise _refuse("optimizers", f"(an optimiser over a {tuple(p.shape)} tensor that is not a parameter of "
                              "the model)", "allowed: an optimiser over the transformers model's parameters "
                              "(LongStrawGRPOTrainer moves it onto the LongStraw model's), or (None, scheduler)")
            new = ours.get(name)
            if new is None or new.shape != p.shape:
                raise _refuse("optimizers", f"(an optimiser holding {name})", "allowed: parameters the LongStraw model "
                              "holds whole under transformers' names" + ("" if new is None else
                                                                         f" (here {tuple(new.shape)})"))
            swap[id(p)] = new
    for group in optimizer.param_groups:
        group["params"] = [swap[id(p)] for p in group["params"]]
    for old in list(optimizer.state):
        optimizer.state[swap[id(old)]] = optimizer.state.pop(old)


def _prompt_groups(prompt_ids, prompt_mask, completion_mask):
    """Rows grouped by their prompt: ``[(prompt [P], [(row, completion length), ...]), ...]`` in first-seen order.

    Rows whose completion mask is all zero (e.g. truncated completions TRL masks out) carry no loss and are left
    out. A completion mask that is not ones followed by zeros is refused (the engine weights whole completions).
    """
    groups: dict[tuple, tuple] = {}
    lengths = completion_mask.sum(1).tolist()
    for i, n in enumerate(lengths):
        n = int(n)
        if n == 0:
            continue
        if not bool(completion_mask[i, :n].all()):
            raise ValueError(f"row {i}: completion_mask is not ones followed by padding zeros; LongStrawGRPOTrainer "
                             "cannot weight single tokens of a completion (tool or environment masks)")
        p = prompt_ids[i][prompt_mask[i].bool()]
        key = tuple(p.tolist())
        groups.setdefault(key, (p, []))[1].append((i, n))
    return list(groups.values())


class LongStrawGRPOTrainer(trl.GRPOTrainer):
    """``trl.GRPOTrainer`` whose sampling, scoring and policy gradient run on a LongStraw model (module docstring).

    Takes every argument ``trl.GRPOTrainer`` takes, plus the engine's own keyword-only settings: ``prompt_grad``
    (``"exact"``, the default: gradients through the prompt; ``"detached"``: the prompt state is a constant),
    ``prefill_chunk``, ``branch_batch``, ``logprob_chunk``, ``offload_state_grad`` (exact mode: the state's
    gradient in host memory), ``offload_state`` (the state's attention K/V in host memory for the backward passes)
    and ``graph_budget_bytes`` (exact mode: prompt-step graphs kept from the prefill); see
    :class:`longstraw.GRPOConfig`. An optimiser passed in ``optimizers`` (built over the transformers model's
    parameters, as for ``trl.GRPOTrainer``) is moved onto the LongStraw model's parameters of the same names.

    ``peft_config``: a ``peft.LoraConfig`` (checked by :func:`lora_settings_of`); its adapters go on the LongStraw
    model (A drawn from a generator seeded with ``args.seed``, B = 0), the reference for ``beta != 0`` is the model
    with them off, and checkpoints are PEFT adapter directories (module docstring). Not with ``optimizers``: that
    optimiser would hold the transformers model's parameters, which have no adapters.
    """

    def __init__(self, model, reward_funcs=None, args=None, train_dataset=None, eval_dataset=None,
                 processing_class=None, reward_processing_classes=None, callbacks=None, optimizers=(None, None),
                 quantization_config=None, peft_config=None, tools=None, rollout_func=None, environment_factory=None,
                 *, prompt_grad: str = "exact", prefill_chunk: int = 4096, branch_batch: int = 1,
                 logprob_chunk: int = 1024, offload_state_grad: bool = False, graph_budget_bytes: int | None = None,
                 offload_state: bool = False):
        if args is None:
            name = model if isinstance(model, str) else getattr(model.config, "_name_or_path", "model")
            args = trl.GRPOConfig(f"{Path(str(name)).name}-GRPO")
        _check_constructor(model, quantization_config, tools, environment_factory)
        self.engine_config = engine_config(args, prompt_grad=prompt_grad, prefill_chunk=prefill_chunk,
                                           branch_batch=branch_batch, logprob_chunk=logprob_chunk,
                                           offload_state_grad=offload_state_grad,
                                           graph_budget_bytes=graph_budget_bytes, offload_state=offload_state)
        lora = None if peft_config is None else lora_settings_of(peft_config)
        if lora is not None:
            _check_lora_training(lora, args, self.engine_config, optimizers)
        # TRL's transformers model stays unwrapped (peft_config=None): the adapters go on the LongStraw model below
        super().__init__(model=model, reward_funcs=reward_funcs, args=args, train_dataset=train_dataset,
                         eval_dataset=eval_dataset, processing_class=processing_class,
                         reward_processing_classes=reward_processing_classes, callbacks=callbacks,
                         optimizers=optimizers, quantization_config=quantization_config, peft_config=None,
                         tools=tools, rollout_func=rollout_func, environment_factory=environment_factory)
        if self.aux_loss_enabled:
            raise _refuse("router_aux_loss_coef", self.router_aux_loss_coef, "allowed: 0.0 (no MoE load-balancing "
                          "loss in the engine)")
        if self._is_vlm:
            raise _refuse("model", type(self.model).__name__, "allowed: a text-only causal LM")
        hf_model = self.model
        dropout = _active_dropout(hf_model.config)
        if dropout and not args.disable_dropout:
            raise _refuse("disable_dropout", args.disable_dropout, f"allowed: True for a model with dropout "
                          f"({', '.join(dropout)}): the engine has none, so training would differ from TRL's")
        self.model = self.model_wrapped = self._load_longstraw(model, hf_model)
        self._base_model_name = getattr(hf_model.config, "_name_or_path", None) or None
        if lora is not None:
            self._add_lora(lora, peft_config, args)
        if self.optimizer is not None:  # optimizers=(optimizer, scheduler) over the transformers model's parameters
            _move_optimizer(self.optimizer, hf_model, self.model)
        self.callback_handler.model = self.model
        if lora is not None:  # TRL's PEFT branch: the reference is the policy with its adapters off (disable_adapter)
            self.ref_model = None
        elif self.ref_model is not None:  # TRL built a transformers copy of the initial weights; ours replaces it
            self.ref_model = copy.deepcopy(self.model).requires_grad_(False).eval()
        del hf_model

    def _add_lora(self, lora: LoraSettings, peft_config, args) -> None:
        """Put ``lora``'s adapters on the LongStraw model as ``get_peft_model`` puts them on TRL's (PEFT's init,
        base frozen, ``modules_to_save`` trained whole), and give the model what TRL's PEFT branch reads:
        ``peft_config`` (``{"default": config}``, no ``"ref"`` adapter) and ``disable_adapter()`` for the reference
        log-probs (:meth:`adapters_off`). ``disable_dropout=True`` switches LoRA dropout off, as TRL's
        ``disable_dropout_in_model`` does on its PEFT model."""
        ls = self.model
        try:
            longstraw.add_lora(ls, lora.r, lora.lora_alpha, lora.target_modules, lora.lora_dropout,
                               use_rslora=lora.use_rslora, modules_to_save=lora.modules_to_save,
                               rank_pattern=lora.rank_pattern, alpha_pattern=lora.alpha_pattern, seed=args.seed,
                               target_parameters=lora.target_parameters)
        except ValueError as e:  # a target this model lacks, a modules_to_save entry that names nothing, ...
            raise _peft_refusal(str(e)) from None
        if args.disable_dropout:
            for m in adapted_modules(ls).values():
                if isinstance(m.lora_dropout, torch.nn.Dropout):
                    m.lora_dropout = torch.nn.Identity()
        # modules_to_save at their initial values: PEFT's disable_adapter() runs their original modules
        self._lora_initial = {} if self.beta == 0.0 else {
            n: p.detach().clone() for n, p in ls.named_parameters() if p.requires_grad and not is_adapter_param(n)}
        ls.peft_config = {"default": peft_config}
        ls.disable_adapter = self.adapters_off

    @contextlib.contextmanager
    def adapters_off(self):
        """Within it the LongStraw model computes as the base it was built from: every adapter skipped
        (:func:`longstraw.models.lora.adapters_disabled`) and the ``modules_to_save`` parameters at their initial
        values. PEFT's ``disable_adapter()``; TRL's PEFT branch scores the reference (``beta != 0``) inside it."""
        model = self.model
        params = dict(model.named_parameters())
        saved = {}
        try:
            with torch.no_grad():
                for n, initial in self._lora_initial.items():
                    saved[n] = params[n].data
                    params[n].data = initial
            with adapters_disabled(model):
                yield model
        finally:
            for n, data in saved.items():
                params[n].data = data

    def _load_longstraw(self, source, hf_model) -> CausalLM:
        """The LongStraw model with the weights of TRL's transformers model (read from its directory when TRL
        loaded it from one, else written to a temporary directory first)."""
        device = self.accelerator.device
        dtype = hf_model.dtype
        if isinstance(source, str) and os.path.isdir(source):
            ls = longstraw.load_model(source, dtype=dtype, device=device)
        else:
            if not isinstance(hf_model, PreTrainedModel):
                raise _refuse("model", type(hf_model).__name__, "allowed: a model id, a directory or a "
                              "transformers PreTrainedModel")
            with tempfile.TemporaryDirectory(prefix="longstraw-trl-") as d:
                hf_model.save_pretrained(d)
                ls = longstraw.load_model(d, dtype=dtype, device=device)
            ls.source_dir = None
        ls.is_gradient_checkpointing = False  # read by TRL's disable_gradient_checkpointing; the engine's is cfg's
        ls.train()
        return ls

    # ----------------------------------------------------------------------------------------------- training

    def train(self, *args, **kwargs):
        """TRL's ``train``, with activation checkpointing left to the engine (``checkpoint_layers``): Trainer would
        otherwise ask the LongStraw model for transformers' checkpointing hooks."""
        saved = {k: getattr(self.args, k) for k in ("activation_checkpointing", "gradient_checkpointing")
                 if hasattr(self.args, k)}
        for k in saved:
            setattr(self.args, k, False)
        try:
            return super().train(*args, **kwargs)
        finally:
            for k, v in saved.items():
                setattr(self.args, k, v)

    def training_step(self, model, inputs, num_items_in_batch=None):
        """One micro-batch: TRL's batch preparation (generation, rewards, advantages), then the loss's gradient
        added into ``.grad`` by the engine. Returns the detached loss (scaled as TRL's, for its logging)."""
        t0 = time.perf_counter()
        self.model.train()
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        loss = self.longstraw_backward(inputs)
        # GRPOTrainer.training_step's bookkeeping (its super().training_step would run backward again)
        self._step += 1
        self._current_train_step_time += time.perf_counter() - t0
        if self._step % self.current_gradient_accumulation_steps == 0:
            self._metrics["train"]["step_time"].append(self._current_train_step_time)
            self._current_train_step_time = 0.0
        return loss

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        raise NotImplementedError("LongStrawGRPOTrainer computes the loss and its gradient together in "
                                  "training_step (longstraw_backward); compute_loss is not used")

    def loss_normaliser(self, inputs) -> float:
        """The divisor TRL's ``_compute_loss`` applies to the micro-batch's token-loss sum for ``loss_type``
        (for ``grpo`` the divisor of the per-row means), including the gradient-accumulation factor."""
        ga = self.current_gradient_accumulation_steps
        rows = inputs["completion_ids"].size(0)
        if self.loss_type in ("grpo", "luspo"):
            return float(rows * ga)
        if self.loss_type == "bnpo":
            return max(float(inputs["completion_mask"].sum()), 1.0) * ga
        if self.loss_type == "dr_grpo":
            return float(rows * self.max_completion_length * ga)
        # dapo: num_items_in_batch spans the generation batch of every process
        items = max(float(inputs["num_items_in_batch"]), 1.0) / self.accelerator.num_processes
        return items * ga / self.args.steps_per_generation

    def longstraw_backward(self, inputs) -> torch.Tensor:
        """Add the gradient of TRL's loss on one prepared micro-batch into ``.grad`` (one
        :func:`longstraw.grpo_backward` per prompt of the batch) and return the loss, detached."""
        if "tool_mask" in inputs:
            raise ValueError("the batch has a tool_mask (tools, or rollout_func's env_mask): LongStrawGRPOTrainer "
                             "cannot weight single tokens of a completion")
        adv = inputs["advantages"]
        if adv.dim() != 1:
            raise ValueError(f"advantages of shape {tuple(adv.shape)}: LongStrawGRPOTrainer takes one advantage per "
                             "completion (shape [rows])")
        completion_ids = inputs["completion_ids"]
        old = inputs.get("old_per_token_logps")
        ref = inputs.get("ref_per_token_logps") if self.beta != 0.0 else None
        denom = self.loss_normaliser(inputs)
        scaler = getattr(self.accelerator, "scaler", None)
        if scaler is not None:  # fp16 on a GPU: Trainer's backward scales the loss by the GradScaler's factor, and the
            # optimiser step divides it out; scale() also starts the scaler (unscale_ refuses one never used)
            denom /= float(scaler.scale(torch.ones((), device=self.accelerator.device)))
        cfg = self.engine_config
        total, tokens, clipped, kl = 0.0, 0, 0.0, 0.0
        for prompt, rows in _prompt_groups(inputs["prompt_ids"], inputs["prompt_mask"], inputs["completion_mask"]):
            idx = [i for i, _ in rows]
            stats = longstraw.grpo_backward(
                self.model, prompt, [completion_ids[i, :n] for i, n in rows], adv[idx].float(), cfg,
                old_logprobs=None if old is None else [old[i, :n] for i, n in rows],
                ref_logprobs=None if ref is None else [ref[i, :n] for i, n in rows], loss_scale=denom)
            total += stats.loss
            tokens += stats.num_tokens
            clipped += stats.metrics.get("pg_clipfrac", 0.0) * stats.num_tokens
            kl += stats.metrics.get("kl", 0.0) * stats.num_tokens
        if tokens:  # TRL's names; token means over this micro-batch (TRL's are the same, over every process)
            self._metrics["train"]["clip_ratio/region_mean"].append(clipped / tokens)
            if self.beta != 0.0:
                self._metrics["train"]["kl"].append(kl / tokens)
        return torch.tensor(total, device=self.accelerator.device)

    # ------------------------------------------------------------------------------- sampling and scoring

    def _generate_single_turn(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
        """Completions for the rows' prompts (TRL's sampling step): one :func:`longstraw.generate` per distinct
        prompt, the prompt evaluated once and its completions decoded from the shared state."""
        if images is not None or multimodal_fields:
            raise ValueError("LongStrawGRPOTrainer samples text-only prompts; this batch has images")
        cfg = self.engine_config
        sampling = SamplingConfig(temperature=float(self.temperature), top_k=int(self.top_k or 0),
                                  top_p=float(self.top_p if self.top_p is not None else 1.0),
                                  max_new_tokens=int(self.max_completion_length),
                                  stop_token_ids=tuple(int(t) for t in self.eos_token_ids))
        groups: dict[tuple, list[int]] = {}
        for i, ids in enumerate(prompt_ids):
            groups.setdefault(tuple(int(t) for t in ids), []).append(i)
        device = self.accelerator.device
        out: list = [None] * len(prompt_ids)
        with torch.no_grad():
            for ids, rows in groups.items():
                ro = longstraw.generate(self.model, torch.tensor(ids, device=device), len(rows), sampling,
                                        prefill_chunk=cfg.prefill_chunk, compute_dtype=cfg.compute_dtype)
                for i, r in zip(rows, ro.responses):
                    out[i] = r.tolist()
        return out, None

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask, logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False, **multimodal):
        """Per-token log-probs (and entropies) of the completion part of TRL's ``[rows, prompt + completion]``
        batch, from :func:`longstraw.score` on each distinct prompt (the prompt once per group). Padding is 0."""
        if any(v is not None for v in multimodal.values()):
            raise ValueError("LongStrawGRPOTrainer scores text-only batches; this one has image inputs")
        model = self.accelerator.unwrap_model(model)
        if not isinstance(model, CausalLM):
            raise ValueError(f"expected a LongStraw model to score with, got {type(model).__name__}")
        k = int(logits_to_keep)
        comp = input_ids[:, -k:]
        dtype = torch.float64 if next(model.parameters()).dtype == torch.float64 else torch.float32
        logps = torch.zeros(comp.shape, dtype=dtype, device=input_ids.device)
        ents = torch.zeros_like(logps) if compute_entropy else None
        for prompt, rows in _prompt_groups(input_ids[:, :-k], attention_mask[:, :-k], attention_mask[:, -k:]):
            res = longstraw.score(model, prompt, [comp[i, :n] for i, n in rows], self.engine_config,
                                  with_entropy=compute_entropy)
            lps, es = res if compute_entropy else (res, None)
            for j, (i, n) in enumerate(rows):
                logps[i, :n] = lps[j]
                if es is not None:
                    ents[i, :n] = es[j]
        return logps, ents, None

    # -------------------------------------------------------------------------------------------- saving

    def _save(self, output_dir: str | None = None, state_dict=None) -> None:
        """A checkpoint directory with the tokenizer and the training arguments, and the model as stock TRL saves
        it: with LoRA the PEFT adapter (``adapter_config.json`` + ``adapter_model.safetensors``,
        :func:`longstraw.save_adapter`; ``base_model_name_or_path`` TRL's model id or directory), else an HF
        checkpoint (``longstraw.save_model``)."""
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return
        os.makedirs(output_dir, exist_ok=True)
        if lora_settings(self.model) is not None:
            self._save_adapter(Path(output_dir))
        else:
            longstraw.save_model(self.model, output_dir)
        if self.processing_class is not None:
            self.processing_class.save_pretrained(output_dir)
        torch.save(self.args, os.path.join(output_dir, "training_args.bin"))

    def _save_adapter(self, out: Path) -> None:
        """The adapter's two files into ``out`` (``save_adapter`` writes a directory of its own, replacing it whole:
        it is written beside them first, so the checkpoint's other files, or an output_dir holding checkpoints,
        stay)."""
        with tempfile.TemporaryDirectory(dir=out, prefix=".adapter-") as d:
            tmp = Path(d) / "adapter"
            longstraw.save_adapter(self.model, tmp)
            cfg = json.loads((tmp / ADAPTER_CONFIG).read_text())
            if cfg.get("base_model_name_or_path") is None and self._base_model_name:
                cfg["base_model_name_or_path"] = self._base_model_name  # as PEFT records it (the model's id)
                (tmp / ADAPTER_CONFIG).write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
            for name in (ADAPTER_WEIGHTS, ADAPTER_CONFIG):
                os.replace(tmp / name, out / name)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        """Resuming a LoRA run: the checkpoint's adapter into the LongStraw model's adapters
        (:func:`longstraw.load_adapter`; the same settings or a one-line error). Without LoRA, Trainer's."""
        if lora_settings(self.model) is None:
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        longstraw.load_adapter(self.model, resume_from_checkpoint)

    def create_model_card(self, *args, **kwargs) -> None:
        """No model card: TRL's reads a transformers config the LongStraw model does not have."""
        return None
