"""The GRPO trainer: rollouts from the shared prompt state, rewards, advantages, LongStraw updates, checkpoints.

One step:

1. for each of ``prompts_per_step`` prompts: prefill once and sample G responses from that prompt state
   (:func:`longstraw.generate`), score them with the reward function (timeouts and errors recorded, not fatal),
   compute group advantages; with ``kl_coef > 0`` the frozen reference model scores them too;
2. for each of ``ppo_epochs``: zero the gradients, ``grpo_backward`` every group with the step-global normaliser
   (fixed before the first branch: the loss is exactly the mean over the whole step), clip, AdamW step with warm-up
   and cosine decay. The first epoch reuses each group's rollout prompt state (``reuse_rollout_state``: the
   weights have not moved yet, so one prefill per group is saved); later epochs re-prefill under the updated
   weights, with the rollout's log-probs as ``old_logprobs`` (the PPO ratio);
3. log ``metrics.jsonl`` (and TensorBoard, W&B: :mod:`longstraw.rl.tracking`), update the progress bar,
   checkpoint atomically.

Nothing is written before everything the user gave has been checked: the config, the tokenizer, the reward (its
import, in its worker), every data row, the memory plan and, on resume, the checkpoint (its ``trainer.pt`` and
weights are read first; a damaged one is refused with the earlier checkpoint to resume from; a run that has done
all its steps says so). Then the run directory is created, probed for writing and locked (one trainer per
directory; see :class:`longstraw.checkpoint.training.RunDirLock`). A write that fails later (a full disk) is one
``ValueError`` naming what was being written and the last complete checkpoint.

Randomness is derived from ``(train.seed, step, prompt index)`` (sampling seeds) and the data index (task prompts),
so a resumed run repeats exactly what an uninterrupted one does.

Under ``torchrun`` (``[parallel]``, :mod:`longstraw.rl.job`) every rank runs this same program: the model is loaded
through ``load_model`` after ``init_distributed``, so FSDP2 shards it over the job; the step's prompts are split over
the ``D`` data-parallel replicas (replica ``d`` takes prompts ``[d L, (d + 1) L)``, ``L = prompts_per_step / D``;
a prompt's sampling seed does not depend on the replica that takes it); each replica samples, scores (on its CP rank
0, broadcast to the others) and back-propagates its own groups with ``loss_scale = D_step / D``, ``D_step`` the
normaliser over ALL the step's responses (their lengths gathered first), so that the mean over replicas that FSDP's
reductions give is the step's loss gradient. Every replica makes the same engine calls: one whose groups have all
zero advantages where another's do not back-propagates one of them anyway (an exactly zero gradient) instead of
skipping it. Gradient clipping uses the global norm. Metrics are gathered from every replica; rank 0 writes the run
directory (metrics, TensorBoard, W&B, plots, progress) and holds its lock. Checkpoints of a sharded model are
sharded (:func:`~longstraw.checkpoint.training.save_sharded_checkpoint`).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from contextlib import contextmanager
import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from longstraw.checkpoint.hf import ModelTooLargeError, load_model, parse_dtype, save_model, tokenizer_files
from longstraw.checkpoint.training import ADAPTER_DIR, RunDirLock, check_writable, damaged_checkpoint, \
    latest_checkpoint, load_full_optimizer_state, load_sharded_state, load_trainer_state, rng_state, save_checkpoint, \
    save_sharded_checkpoint, set_rng_state
from longstraw.devices import resolve_device
from longstraw.models.deltanet import delta_rule_calls, kernels_since
from longstraw.models.lora import adapters_disabled
from longstraw.engine.grpo import grpo_backward, score
from longstraw.engine.rollout import SamplingConfig, generate
from longstraw.expert_load import ExpertLoad, imbalance
from longstraw.profiling import PhaseMeter, current_bytes, delayed_bar, tune_allocator
from longstraw.rl.config import RunConfig, diff_configs, dump_config, grpo_config, load_config, lora_key_names, \
    sampling_config
from longstraw.losses import group_advantages, loss_denominator
from longstraw.rl.job import Job, JobError
from longstraw.rl.optim import clip_grad_norm, lr_factor, make_optimizer, set_lr
from longstraw.rl.runlog import EXPERT_LOAD, append_metrics, read_metrics, truncate_metrics, write_atomic
from longstraw.rl.tracking import check_tracking, close_writers, log_metrics, make_writers
from longstraw.units import format_bytes

# keys that may differ between a run and its resumption (they do not change what is computed)
RESUMABLE_CHANGES = ("train.steps", "train.progress", "train.tensorboard", "train.plots", "train.log_every",
                     "train.save_every", "train.keep_last", "train.memory_check", "train.memory_limit",
                     "train.wandb", "train.wandb_project", "train.wandb_mode",
                     # the job's layout: a run resumes on another number of ranks (docs/DISTRIBUTED.md)
                     "parallel.cp", "parallel.fsdp", "parallel.replicate", "parallel.ep", "parallel.ep_shard")


@dataclass
class Group:
    prompt_ids: Tensor
    responses: list[Tensor]
    texts: list[str]
    rewards: list[float]
    advantages: Tensor
    old_logprobs: list[Tensor] | None
    ref_logprobs: list[Tensor] | None = None
    prompt_state: object | None = None
    reward_errors: int = 0
    finish_reasons: list[str] = field(default_factory=list)


@dataclass
class RunSummary:
    run_dir: Path
    steps: int
    prompt_len: int
    group_size: int
    reward_first: float
    reward_last: float
    solved_first: float
    solved_last: float
    peak_memory_bytes: int
    peak_above_start_bytes: int
    plots: list[Path]
    last_checkpoint: Path | None
    signal_steps: int = 0  # steps in which at least one group's rewards were not all equal (a learning signal)


def _quiet(*_args) -> None:
    """The echo of ranks other than 0 (rank 0 speaks for the job)."""


def _derive_seed(*parts: int) -> int:
    h = 0x9E3779B97F4A7C15
    for p in parts:
        h = (h ^ (int(p) + 0x9E3779B97F4A7C15 + (h << 6) + (h >> 2))) & 0xFFFFFFFFFFFFFFFF
    return h & 0x7FFFFFFF


def lora_settings(lo) -> dict:
    """``load_model(lora=...)``'s dict (add_lora's names) for the run's ``[lora]`` section. A checkpoint's adapter
    directory (``adapter_config.json``) records the same settings, so a resumed run rebuilds the same adapters from
    it. ``target_parameters`` are sorted, as ``adapter_config.json`` lists them: the expert adapters are created in
    that order on each experts module, and the optimiser state a checkpoint holds follows the parameters' order, so
    a fresh run and its resumption must create them alike."""
    t = lo.target_modules
    return {"rank": lo.rank, "alpha": lo.alpha if lo.alpha is not None else 2.0 * lo.rank,
            "target_modules": "all-linear" if tuple(t) == ("all-linear",) else tuple(t),
            "dropout": lo.dropout, "use_rslora": lo.use_rslora, "modules_to_save": tuple(lo.modules_to_save),
            "target_parameters": tuple(sorted(lo.target_parameters))}


def builtin_model_config(name: str, vocab_size: int, max_positions: int) -> dict:
    """HF config dicts of the built-in random models (saved as real checkpoints, then loaded)."""
    if name == "tiny-dense":
        return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 64,
                "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
                "head_dim": 16, "vocab_size": vocab_size, "max_position_embeddings": max_positions,
                "rms_norm_eps": 1e-6, "rope_parameters": {"rope_type": "default", "rope_theta": 500000.0},
                "tie_word_embeddings": True, "hidden_act": "silu"}
    if name == "tiny-hybrid":
        from longstraw.models.qwen_hybrid import tiny_config

        return tiny_config(vocab_size=vocab_size, max_position_embeddings=max_positions)
    if name == "tiny-moe":  # the hybrid with a routed-expert MoE block in every layer (expert parallelism, load)
        from longstraw.models.qwen_hybrid import tiny_config

        return tiny_config(model_type="qwen3_5_moe_text", architectures=["Qwen3_5MoeForCausalLM"],
                           vocab_size=vocab_size, max_position_embeddings=max_positions, num_experts=8,
                           num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32)
    if name == "tiny-kimi":  # Kimi Delta Attention (a decay per key channel), NoPE MLA, sigmoid-routed MoE
        from longstraw.models.kimi import tiny_config as kimi_config

        return kimi_config(vocab_size=vocab_size, model_max_length=max_positions, hidden_size=64,
                           intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_attention_heads=4,
                           num_key_value_heads=4,  # transformers' MLA attention wants as many as query heads
                           kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                           linear_attn_config={"num_heads": 4, "head_dim": 16, "short_conv_kernel_size": 4,
                                               "kda_layers": [1, 2, 4], "full_attn_layers": [3]})
    raise ValueError(f"unknown built-in model {name!r}; allowed: 'tiny-hybrid', 'tiny-dense', 'tiny-moe', "
                     "'tiny-kimi'")


def init_weights(model: torch.nn.Module, seed: int, std: float = 0.02) -> None:
    """HF-style init of Linear/Embedding weights, MoE routers and routed experts (normal(0, std), zero biases), from
    ``seed``; other parameters keep the values their modules set (norms, DeltaNet decay parameters). A router left
    at zero would send every token to the same experts (all logits tie)."""
    from longstraw.models.deepseek import SigmoidGroupedRouter
    from longstraw.models.moe_block import Experts, SoftmaxTopKRouter

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (torch.nn.Linear, torch.nn.Embedding, SoftmaxTopKRouter, SigmoidGroupedRouter)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=gen) * std)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
            elif isinstance(m, Experts):
                for p in (m.gate_up_proj, m.down_proj):
                    p.copy_(torch.randn(p.shape, generator=gen) * std)


class Trainer:
    """Wires model, tokenizer, data, rewards, optimiser and checkpoints for one run directory."""

    def __init__(self, cfg: RunConfig, run_dir: str | Path | None = None, *, resume: bool = False,
                 echo: Callable[[str], None] = print):
        tune_allocator()  # glibc: freed tensors leave the resident set (see longstraw.profiling.tune_allocator)
        self.cfg = cfg
        self.run_dir = Path(run_dir or cfg.train.out_dir)
        self.gcfg = grpo_config(cfg)
        # one process, or one rank of a torchrun job ([parallel]; a bad layout is refused here, before anything)
        self.job = Job.start(cfg, resolve_device(cfg.model.device, "model.device"))
        self.device = self.job.device
        self.echo = echo if self.job.is_main else _quiet
        self.start_step = 0
        self.opt_step = 0
        self._kernel_said = False  # the delta-rule kernel named once (_update)
        self._lock = RunDirLock(self.run_dir)
        self.reward_fn = None
        try:
            self._setup(resume)
        except BaseException as e:
            self.close(ok=isinstance(e, JobError))  # an error every rank raises alike: the job ends cleanly
            raise

    def _setup(self, resume: bool) -> None:
        from longstraw.rl.rewards import make_reward
        from longstraw.rl.sources import PromptSource, build_tokenizer

        cfg, job = self.cfg, self.job
        # everything that can reject the user's input runs before anything is written (every rank checks what it
        # reads; an error on any rank is an error on all)
        with job.together():
            if job.is_main:
                self._lock.check()  # another trainer writing this directory: refused, naming its pid
            self._check_run_dir(resume)
            self.tokenizer = build_tokenizer(cfg)
            self.reward_fn = make_reward(cfg.reward.fn, **cfg.reward.options)
            check_tracking(cfg)  # train.wandb without the wandb package
            self.source = PromptSource(cfg, self.tokenizer)
            self.source.check()
            self._check_lora()
            # the planner's verdict (cfg.train.memory_check = "error": may refuse); rank 0 plans for every rank
            self.memory = self._check_memory() if job.is_main else None
            self.gcfg = dataclasses.replace(self.gcfg, graph_budget_bytes=self._graph_budget() or None)
            ckpt = latest_checkpoint(self.run_dir) if resume else None
            st = self._resume_state(ckpt) if ckpt is not None else None  # damaged or finished: refused here
        if ckpt is not None or cfg.model.path:  # weights to read: read (and so checked) before anything is written
            with job.together():
                self._load_models(ckpt, st)
        with job.together(main_only=True) as mine:
            if mine:
                self._open_run_dir(resume, ckpt)  # created, probed for writing, locked
        with job.together(main_only=True) as mine:
            if mine:
                with self._writing("config.toml"):
                    write_atomic(self.run_dir / "config.toml", dump_config(cfg))  # on resume: e.g. more train.steps
                if not resume and not cfg.model.path:
                    with self._writing("the tokenizer"):
                        self.tokenizer.save(self.run_dir / "tokenizer")
                if ckpt is None and not cfg.model.path:
                    with self._writing("the initial model"):
                        self._initial_model_dir()  # a built-in model: written into the run once, then loaded
                if st is not None:
                    with self._writing("metrics.jsonl"):
                        truncate_metrics(self.run_dir, self.start_step)
                        truncate_metrics(self.run_dir, self.start_step, EXPERT_LOAD)
        if ckpt is None and not cfg.model.path:
            with job.together():
                self._load_models(None, None)
        if st is not None:
            self.echo(f"resuming {self.run_dir} from {ckpt.name} (step {self.start_step})")
        else:
            torch.manual_seed(cfg.train.seed)
        self.sampling = self._sampling()
        # MoE models: routed slots per expert of every pass of a step (rollout, scoring, update), in expert_load.jsonl
        self.expert_load = ExpertLoad(self.model)
        self.baseline_bytes = current_bytes(self.device)  # after loading: weights, tokenizer, framework

    # ------------------------------------------------------------------ setup
    def close(self, ok: bool = True) -> None:
        """Release the run directory's lock and stop the reward worker (``train`` does this when it ends); end the
        process group if this trainer started it (``ok``: every rank gets here alike, so it ends with a barrier)."""
        self._lock.release()
        if self.reward_fn is not None:
            self.reward_fn.close()
        self.job.close(ok)

    def _open_run_dir(self, resume: bool, ckpt: Path | None) -> None:
        """Create the run directory, check that it can be written, lock it; the first write comes after this."""
        check_writable(self.run_dir)
        self._lock.acquire()
        try:  # again, under the lock: another trainer may have started (and ended) since the first look
            self._check_run_dir(resume)
            if resume and latest_checkpoint(self.run_dir) != ckpt:
                raise ValueError(f"run directory {str(self.run_dir)!r} changed while this trainer was starting (its "
                                 f"latest checkpoint is now {latest_checkpoint(self.run_dir)}); start it again")
        except BaseException:
            self._lock.release()
            raise

    def _write_error(self, what: str, e: OSError) -> ValueError:
        """A failed write (full disk, read-only remount) as one ValueError naming it and the last checkpoint."""
        where = f" ({e.filename})" if e.filename else ""
        last = latest_checkpoint(self.run_dir)
        then = (f"; the last complete checkpoint, {last.name}, is intact: fix the cause and continue with --resume"
                if last is not None else "")
        return ValueError(f"cannot write {what}in run directory {str(self.run_dir)!r}: {e.strerror or e}{where}{then}")

    @contextmanager
    def _writing(self, what: str):
        try:
            yield
        except OSError as e:
            raise self._write_error(what + " ", e) from None

    def _resume_state(self, ckpt: Path) -> dict:
        """The checkpoint's ``trainer.pt`` (a damaged one is refused); a run that has done its steps is refused."""
        st = load_trainer_state(ckpt)
        done = int(st["step"])
        if done >= self.cfg.train.steps:
            raise ValueError(f"run {str(self.run_dir)!r} finished its {done} steps; raise train.steps (e.g. --set "
                             f"train.steps={2 * done}) to continue")
        return st

    def _load_models(self, ckpt: Path | None, st: dict | None) -> None:
        """Model, reference model and optimiser; with a checkpoint, its weights, optimiser and RNG state (a sharded
        checkpoint's through DCP, whatever this run's layout)."""
        try:
            self.model = self._build_model(ckpt, sharded=st is not None and st.get("format") == "sharded")
        except ModelTooLargeError:
            raise
        except ValueError as e:
            if ckpt is None:
                raise
            raise damaged_checkpoint(ckpt, f"model/: {e}") from None
        # the KL reference: a frozen copy of the initial model; a LoRA run whose only trained modules are adapters
        # scores with its adapters off instead (the same model, no second copy of the weights)
        own_ref = self.cfg.lora.enabled and not self.cfg.lora.modules_to_save
        self.ref_model = self._reference_model() if self.gcfg.kl_coef > 0 and not own_ref else None
        o = self.cfg.optim
        self.opt = make_optimizer(self.model.parameters(), o.lr, o.betas, o.weight_decay, o.eps, o.offload)
        if st is None:
            return
        if st.get("format") == "sharded":  # the model's and optimiser's shards: read into this layout
            load_sharded_state(ckpt, self.model, self.opt, optimizer_state=bool(st.get("optimizer_state", True)))
        try:
            if st.get("format") != "sharded":
                if self.job.sharded:  # a one-process checkpoint: its full optimiser state, sharded here
                    load_full_optimizer_state(self.model, self.opt, st["optimizer"])
                else:
                    self.opt.load_state_dict(st["optimizer"])
            set_rng_state(self._rng_of_rank(st))
            self.start_step, self.opt_step = int(st["step"]), int(st["opt_step"])
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as e:
            raise damaged_checkpoint(ckpt, f"trainer.pt does not fit this run: {type(e).__name__}: {e}") from None

    def _rng_of_rank(self, st: dict) -> dict:
        """This rank's RNG state: the one its rank saved when the job has the same number of ranks, else rank 0's
        (the trainer's own randomness comes from derived seeds, not these generators: docs/DISTRIBUTED.md)."""
        ranks = st.get("rng_ranks")
        if isinstance(ranks, list) and len(ranks) == self.job.world:
            return ranks[self.job.rank]
        return st["rng"]

    def _check_run_dir(self, resume: bool) -> None:
        if resume:
            saved = self.run_dir / "config.toml"
            if not saved.is_file():
                raise ValueError(f"cannot resume {str(self.run_dir)!r}: it has no config.toml (not a LongStraw run)")
            diffs = diff_configs(load_config(saved), self.cfg, ignore=RESUMABLE_CHANGES)
            if diffs:
                raise ValueError(f"resume directory {str(self.run_dir)!r} was written by a different config: "
                                 + "; ".join(diffs))
            if latest_checkpoint(self.run_dir) is None:
                raise ValueError(f"cannot resume {str(self.run_dir)!r}: no complete checkpoint in it")
        elif (self.run_dir / "metrics.jsonl").exists() or latest_checkpoint(self.run_dir) is not None:
            raise ValueError(f"run directory {str(self.run_dir)!r} already holds a run; resume it with --resume or "
                             "choose another train.out_dir")

    def _check_lora(self) -> None:
        """The ``[lora]`` section against the model, before anything is written: its adapters put on the model built
        on the meta device (no memory, nothing read), so a ``target_modules`` / ``target_parameters`` /
        ``modules_to_save`` name the model does not have (e.g. a ``target_parameters`` entry that is not a routed
        expert's fused weight) is one ValueError naming the key, not an error after the run directory is written."""
        if not self.cfg.lora.enabled:
            return
        from longstraw.checkpoint.adapter import settings_from
        from longstraw.models.lora import add_adapters
        from longstraw.models.registry import build_on_meta

        try:
            add_adapters(build_on_meta(self._model_hf_config()), settings_from(lora_settings(self.cfg.lora)))
        except ValueError as e:
            raise ValueError(lora_key_names(str(e))) from None

    def _model_hf_config(self) -> dict:
        m = self.cfg.model
        if m.path:
            from longstraw.checkpoint.hf import read_config

            return read_config(m.path)
        return builtin_model_config(m.builtin, self.tokenizer.vocab_size,
                                    self.cfg.data.max_prompt_len + self.cfg.rollout.sampling.max_new_tokens + 1)

    def _graph_budget(self) -> int:
        """``algorithm.graph_budget`` in bytes: a fixed size as configured; ``"auto"``: what the memory check leaves
        of the limit after the run's planned peak (0, said once, when no limit is known). Under FSDP kept graphs need
        every rank on one prompt (parallel.cp = the world size): a job with data-parallel replicas gets 0 for "auto"
        and a ValueError for a size (under context parallelism each rank keeps its pieces' graphs, the ranks planning
        alike: engine/prefill.py; distributed/placement.py)."""
        a, g = self.cfg.algorithm, self.gcfg
        if not g.exact:
            return 0
        if self.job.sharded and self.job.dp_size > 1:
            if a.graph_budget == "auto" or not g.graph_budget_bytes:
                return 0
            raise ValueError(f"algorithm.graph_budget={a.graph_budget!r}: kept prompt-step graphs under FSDP need "
                             f"every rank on one prompt (parallel.cp = the world size {self.job.world}), but this "
                             f"job has {self.job.dp_size} data-parallel replicas; use algorithm.graph_budget = 0")
        if a.reuse_rollout_state and a.ppo_epochs == 1 and not self.cfg.data.offline:
            if a.graph_budget == "auto" or g.graph_budget_bytes:  # every update reuses its rollout's prompt state
                self.echo(f"algorithm.graph_budget = {a.graph_budget!r} has no effect: with "
                          "algorithm.reuse_rollout_state = true and ppo_epochs = 1 every update reuses the rollout's "
                          "prompt state and runs no prefill that could keep graphs (reusing it saves that prefill, "
                          "which is about what kept graphs would save); set reuse_rollout_state = false to keep them")
            return 0
        if a.graph_budget != "auto":
            return g.graph_budget_bytes or 0
        if g.offload_state:
            self.echo("algorithm.graph_budget = \"auto\": no prompt-step graphs kept with algorithm.offload_state = "
                      "true (kept graphs would hold the state's K/V on the device)")
            return 0
        m = self.memory
        if m is None or m.limit_bytes is None:
            self.echo("algorithm.graph_budget = \"auto\": no memory limit known (train.memory_check = \"off\" or "
                      "the device's memory unknown): no prompt-step graphs kept")
            return 0
        budget = max(0, m.limit_bytes - m.peak_bytes)
        which = ("the updates that prefill themselves: epochs after the first, as reuse_rollout_state = true"
                 if a.reuse_rollout_state and not self.cfg.data.offline else "every update")
        self.echo(f"algorithm.graph_budget = \"auto\": up to {format_bytes(budget)} for prompt-step graphs (the "
                  f"memory plan's limit less its peak), in {which}")
        return budget

    def _check_memory(self):
        from longstraw.rl.memory_check import check_run_memory

        d = self.cfg.data
        prompt_len = max(self.source.longest_prompt, d.prompt_len if d.task else 0)
        response_len = self.source.longest_response if d.offline else self.cfg.rollout.sampling.max_new_tokens
        job = self.job
        return check_run_memory(self.cfg, self._model_hf_config(), prompt_len, response_len, self.device,
                                echo=self.echo, master_dtype=self._master_dtype(),
                                lora=lora_settings(self.cfg.lora) if self.cfg.lora.enabled else None,
                                shard=job.world // self.cfg.parallel.replicate if job.sharded else 1,
                                cp=job.cp_size, replicas=job.dp_size,
                                ranks_per_host=int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))

    def _initial_model_dir(self) -> Path:
        """The checkpoint the run starts from (for built-in models: written once into the run directory)."""
        m = self.cfg.model
        if m.path:
            return Path(m.path)
        d = self.run_dir / "initial_model"
        if not (d / "config.json").exists():
            from longstraw.models.registry import build_model

            hf_cfg = self._model_hf_config()
            torch.manual_seed(self.cfg.train.seed)
            model = build_model(hf_cfg)
            init_weights(model, self.cfg.train.seed)
            save_model(model.to(parse_dtype(m.dtype)), d)
            self.tokenizer.save(d)
        return d

    def _master_dtype(self) -> str:
        """What the trained parameters are held in: float32 master weights for a bfloat16/float16 model.dtype
        (unless model.master_weights = false, or optim.offload = "masters" keeps them on the host), else
        model.dtype."""
        m = self.cfg.model
        if m.dtype in ("bfloat16", "float16") and m.master_weights and self.cfg.optim.offload != "masters":
            return "float32"
        return m.dtype

    def _build_model(self, ckpt: Path | None, sharded: bool = False):
        """The model to train: from the initial checkpoint, or ``ckpt``'s. ``sharded``: ``ckpt`` is a sharded
        checkpoint whose DCP state the caller reads into every trained weight next, so a full fine-tune's weights
        are allocated, not read (``load_model(weights=False)``); a LoRA run reads its frozen base, which the DCP
        state does not hold."""
        kw = dict(dtype=self.cfg.model.dtype, device=self.device, master_dtype=self._master_dtype())
        if self.cfg.lora.enabled:  # the frozen base from where the run started, the adapters from the checkpoint
            if ckpt is not None:
                kw["adapter"] = ckpt / ADAPTER_DIR
            else:
                kw.update(lora=lora_settings(self.cfg.lora), lora_seed=_derive_seed(self.cfg.train.seed, 0x10A))
            model = load_model(self._initial_model_dir(), **kw)
        else:
            model = load_model(ckpt / "model" if ckpt is not None else self._initial_model_dir(), **kw,
                               weights=not sharded)
        model.train()
        return model

    def _reference_model(self):
        ref = load_model(self._initial_model_dir(), dtype=self.cfg.model.dtype, device=self.device)
        for p in ref.parameters():
            p.requires_grad_(False)
        return ref.eval()

    def _sampling(self) -> SamplingConfig:
        eos = self.tokenizer.eos_token_id
        return sampling_config(self.cfg, (eos,) if self.cfg.rollout.stop_at_eos and eos is not None else ())

    def _meter(self) -> PhaseMeter:
        """A fresh meter for one engine call: with train.progress, a phase (a long prompt's prefill, the reverse
        pass, decoding) that runs longer than a few seconds shows a progress bar under the step bar."""
        show = self.cfg.train.progress and self.job.is_main
        return PhaseMeter(self.device, progress=delayed_bar() if show else None)

    # ------------------------------------------------------------------ one step
    def _text_of(self, ids: Tensor) -> str:
        ids = ids.tolist()
        eos = self.tokenizer.eos_token_id
        if ids and eos is not None and ids[-1] == eos:
            ids = ids[:-1]
        return self.tokenizer.decode(ids)

    def _collect(self, step: int, k: int) -> Group:
        from longstraw.rl.rewards import score_rewards

        item = self.source.get(step * self.cfg.algorithm.prompts_per_step + k)
        keep = self.cfg.algorithm.reuse_rollout_state
        if item.responses is not None:  # offline rollouts
            responses, old, state, reasons = item.responses, item.old_logprobs, None, []
            texts, rewards, errors = item.response_texts, list(item.rewards), 0
        else:
            sp = SamplingConfig(**{**self.sampling.__dict__, "seed": _derive_seed(self.cfg.train.seed, step, k)})
            ro = generate(self.model, item.prompt_ids, self.cfg.rollout.group_size, sp, keep_state=keep,
                          exact_state=self.gcfg.exact, prefill_chunk=self.gcfg.prefill_chunk,
                          decode=self.tokenizer.decode, compute_dtype=self.gcfg.compute_dtype,
                          meter=self._meter(), offload_state=keep and self.gcfg.offload_state)
            responses, old, state, reasons = ro.responses, ro.logprobs, ro.prompt_state, ro.finish_reasons
            if state is not None and self.gcfg.offload_state:  # its forward phases are over: the K/V to host
                state.offload()  # memory now, not in the update (a reference's prefill and other groups run first)
            texts = [self._text_of(r) for r in responses]
            # the CP ranks of a replica hold the same responses: its CP rank 0 scores them for all (a user reward
            # that times out or is not deterministic cannot make the ranks' advantages differ)
            results = self.job.from_cp_rank0(
                score_rewards(self.reward_fn, texts, [item.answer] * len(texts), [item.meta] * len(texts),
                              timeout_s=self.cfg.reward.timeout_s) if self.job.cp_rank == 0 else None)
            rewards = [r.value for r in results]
            errors = sum(r.error is not None for r in results)
        adv = group_advantages(rewards, norm_by_std=self.cfg.algorithm.norm_adv_by_std)
        ref = None
        if self.ref_model is not None:
            ref = score(self.ref_model, item.prompt_ids, responses, self.gcfg, meter=self._meter())
        elif self.gcfg.kl_coef > 0:  # LoRA: the reference is the frozen base, the policy with its adapters off
            with adapters_disabled(self.model):
                ref = score(self.model, item.prompt_ids, responses, self.gcfg, meter=self._meter())
        return Group(item.prompt_ids, responses, texts, rewards, adv, old, ref, state, errors, reasons)

    def _update(self, groups: list[Group]) -> dict:
        """``ppo_epochs`` optimiser steps over this replica's ``groups``; the metrics of the first, over the step's
        groups on every replica."""
        a, job = self.cfg.algorithm, self.job
        lens = [r.numel() for g in groups for r in g.responses]
        all_lens = [n for rep in job.replicas(lens) for n in rep]  # every replica's responses, in prompt order
        denom = loss_denominator(all_lens, self.gcfg.loss_agg_mode, self.gcfg.loss_scale_factor)
        # the gradient convention over replicas is their MEAN (init_distributed): D_step / D sums them instead
        scale = denom / job.dp_size
        needs_all = self.gcfg.kl_coef > 0 or self.gcfg.entropy_coef > 0
        # a group whose advantages are all zero contributes exactly zero gradient: skipped, unless another replica
        # has more groups to back-propagate (then it runs, so that every replica makes the same engine calls)
        active = [g for g in groups if needs_all or not bool((g.advantages == 0).all())]
        n_calls = max(job.replicas(len(active))) if job.sharded else len(active)
        is_active = {id(g) for g in active}
        calls = active + [g for g in groups if id(g) not in is_active][: n_calls - len(active)]
        out: dict = {}
        # the optimiser's parameters, not model.parameters(): under FSDP2 a module group that has not resharded
        # since its last forward (the embedding and final norm after decoding) is registered with its gathered
        # parameters, whose .grad is not the sharded gradient the optimiser steps on
        params = [p for g in self.opt.param_groups for p in g["params"]]
        for epoch in range(a.ppo_epochs):
            self.opt.zero_grad(set_to_none=True)
            sums = {"loss": 0.0, "pg_clipfrac": 0.0, "ppo_kl": 0.0, "kl": 0.0, "entropy": 0.0, "active": 0}
            st_bytes, peak, kept = 0, 0, (0, 0)
            for g in calls:
                st = grpo_backward(self.model, g.prompt_ids, g.responses, g.advantages, self.gcfg,
                                   old_logprobs=g.old_logprobs, ref_logprobs=g.ref_logprobs, loss_scale=scale,
                                   prompt_state=g.prompt_state if epoch == 0 else None, meter=self._meter())
                g.prompt_state = None
                st_bytes = max(st_bytes, st.prompt_state_bytes + st.prompt_state_grad_bytes  # device memory
                               - st.prompt_state_grad_host_bytes - st.prompt_state_host_bytes)  # (offloads: less)
                peak = max(peak, max(st.peak_memory.values(), default=0))
                kept = max(kept, (st.kept_graph_bytes, st.kept_steps))  # the graph budget's use (exact mode)
                if id(g) not in is_active:
                    continue  # a zero call: no metrics
                w = st.num_tokens
                sums["active"] += 1
                sums["loss"] += st.loss
                for k in ("pg_clipfrac", "ppo_kl", "kl", "entropy"):
                    sums[k] += st.metrics.get(k, 0.0) * w
            n_active = sum(job.replicas(sums["active"])) if job.distributed else sums["active"]
            if n_active and job.distributed and not job.sharded:  # whole gradients: their mean over replicas
                self._mean_over_replicas(params)
            total_opt = self.cfg.train.steps * a.ppo_epochs
            lr = self.cfg.optim.lr * lr_factor(self.opt_step, self.cfg.optim.warmup_steps, total_opt,
                                               self.cfg.optim.min_lr_ratio)
            set_lr(self.opt, lr)
            gnorm = clip_grad_norm(params, self.cfg.optim.grad_clip) if n_active else 0.0  # the global norm
            if n_active:
                self.opt.step()
            self.opt_step += 1
            if epoch == 0:
                reps = job.gather((sums, st_bytes, peak, kept))
                total = {k: sum(r[0][k] for r in reps[:: job.cp_size]) for k in sums}
                n = max(1, sum(all_lens))
                out = {"loss": total["loss"] / job.dp_size, "pg_clipfrac": total["pg_clipfrac"] / n,
                       "ppo_kl": total["ppo_kl"] / n, "grad_norm": gnorm, "lr": lr,
                       "prompt_state_bytes": max(r[1] for r in reps), "train_peak_bytes": max(r[2] for r in reps),
                       "active_groups": total["active"]}
                if self.gcfg.exact and self.gcfg.graph_budget_bytes:  # what the budget kept, the most of a call
                    out["kept_graph_bytes"] = max(r[3][0] for r in reps)
                    out["kept_steps"] = max(r[3][1] for r in reps)
                if self.gcfg.kl_coef > 0:
                    out["kl"] = total["kl"] / n
                if self.gcfg.entropy_coef > 0:
                    out["entropy"] = total["entropy"] / n
        return out

    def _mean_over_replicas(self, params: list) -> None:
        """Without FSDP each replica holds its own groups' whole gradient: average them. A parameter that some
        replica's groups reached and this one's did not gets a zero gradient first (every rank then all-reduces the
        same parameters); one that no replica reached keeps no gradient, as in one process (AdamW skips it)."""
        import torch.distributed as dist

        from longstraw.distributed import all_reduce_data_parallel

        ctx = self.job.ctx
        if ctx.dp_size == 1:
            return
        reached = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=ctx.device)
        dist.all_reduce(reached, op=dist.ReduceOp.MAX, group=ctx.dp.group)
        for p, r in zip(params, reached.tolist()):
            if r and p.grad is None:
                p.grad = torch.zeros_like(p)
        all_reduce_data_parallel(self.model, ctx)

    def step(self, step: int) -> dict:
        t0 = time.perf_counter()
        calls_before = delta_rule_calls(self.model)
        meter = PhaseMeter(self.device)
        with meter.phase("rollout"), self.expert_load.recording():
            groups = [self._collect(step, k) for k in self.job.local_prompts(self.cfg.algorithm.prompts_per_step)]
        t1 = time.perf_counter()
        with meter.phase("train"), self.expert_load.recording():
            upd = self._update(groups)
        t2 = time.perf_counter()
        expert_tokens = self._expert_tokens()
        peak_bytes = max(meter.peak_bytes.values())
        mine = {"rewards": [r for g in groups for r in g.rewards], "errors": sum(g.reward_errors for g in groups),
                "lens": [r.numel() for g in groups for r in g.responses],
                "prompt_len": max(int(g.prompt_ids.numel()) for g in groups), "sample": groups[0].texts[0][:64],
                # a group has a learning signal when its rewards are not all equal (some advantage is non-zero)
                "signal": sum(not bool((g.advantages == 0).all()) for g in groups), "groups": len(groups),
                "peak": peak_bytes, "above": peak_bytes - self.baseline_bytes}
        ranks = self.job.gather(mine)
        reps = ranks[:: self.job.cp_size]  # one per replica, in prompt order
        rewards = [r for rep in reps for r in rep["rewards"]]
        lens = [n for rep in reps for n in rep["lens"]]
        m = {
            "step": step + 1,
            "reward_mean": sum(rewards) / len(rewards),
            "reward_std": float(torch.tensor(rewards).std()) if len(rewards) > 1 else 0.0,
            "reward_max": max(rewards),
            "solved": sum(r >= 1.0 for r in rewards) / len(rewards),
            "signal_groups": sum(rep["signal"] for rep in reps) / max(1, sum(rep["groups"] for rep in reps)),
            "reward_errors": sum(rep["errors"] for rep in reps),
            "response_len": sum(lens) / len(lens),
            "prompt_len": max(rep["prompt_len"] for rep in reps),
            **upd,
            "rollout_s": t1 - t0,
            "train_s": t2 - t1,
            "step_s": t2 - t0,
            "peak_memory_bytes": max(r["peak"] for r in ranks),  # the largest of any rank
            "peak_above_start_bytes": max(r["above"] for r in ranks),
            "sample": reps[0]["sample"],
        }
        # the delta-rule kernel the Gated DeltaNet layers took (rollout and update): named once in the run's
        # output, then in every step's metrics (GRPOStats.delta_rule_kernel reports it per engine call)
        kernel = kernels_since(self.model, calls_before)
        if kernel:
            m["delta_rule_kernel"] = kernel
            if not self._kernel_said:
                self.echo(f"Gated DeltaNet layers run the delta-rule kernels: {kernel.replace('+', ', ')}")
                self._kernel_said = True
        if expert_tokens is not None:
            m.update(imbalance(expert_tokens))
            self.last_expert_tokens = expert_tokens
        return m

    def _expert_tokens(self) -> torch.Tensor | None:
        """The routed slots per expert of every MoE layer in this step (its rollouts, scoring and update: the work
        each expert did), summed over the job's processes
        (``[moe layers, experts]``); None for a model without routed experts."""
        if not self.expert_load:
            return None
        job = self.job
        return self.expert_load.take(reduce=(lambda c: sum(job.gather(c))) if job.distributed else None)

    # ------------------------------------------------------------------ the loop
    def _save(self, step_done: int) -> Path:
        job = self.job
        rngs = job.gather(rng_state())
        state = {"step": step_done, "opt_step": self.opt_step, "rng": rngs[0],
                 "data_position": step_done * self.cfg.algorithm.prompts_per_step}
        if job.distributed:
            state.update(rng_ranks=rngs, world_size=job.world,
                         parallel={"cp": job.cp_size, "fsdp": job.sharded, "replicate": self.cfg.parallel.replicate})
        extra = {}
        tok_dir = self.run_dir / "tokenizer"
        if tok_dir.is_dir():
            extra = {f.name: f for f in tok_dir.iterdir() if f.is_file()}
        elif self.cfg.model.path:  # the checkpoint's own tokenizer: each saved model directory is servable
            extra = tokenizer_files(self.cfg.model.path)
        if job.sharded:  # every rank writes its shards (their errors agreed on inside: the same on every rank)
            try:
                with self._writing(f"checkpoint {step_done}"):
                    return save_sharded_checkpoint(self.run_dir, step_done, self.model, self.opt, state,
                                                   keep_last=self.cfg.train.keep_last, extra_files=extra,
                                                   export_dtype=parse_dtype(self.cfg.model.dtype))
            except JobError as e:
                raise JobError(str(self._write_error(f"checkpoint {step_done} ", OSError(0, str(e))))) from None
        state["optimizer"] = self.opt.state_dict()  # whole on every rank: rank 0's is the job's
        final = None
        with job.together(main_only=True) as mine:
            if mine:
                with self._writing(f"checkpoint {step_done}"):
                    final = save_checkpoint(self.run_dir, step_done, self.model, state,
                                            keep_last=self.cfg.train.keep_last, extra_files=extra)
        return final or self.run_dir / "checkpoints" / f"step-{step_done:08d}"

    def train(self, *, on_step: Callable[[dict], None] | None = None) -> RunSummary:
        """Run the steps from the start (or the resumed checkpoint) to ``train.steps``; the run directory's lock is
        held throughout and released at the end (see :meth:`close`). Under torchrun: on every rank."""
        if self.job.is_main:
            self._lock.acquire()  # held since __init__; taken again if an earlier train() released it
        clean = False
        try:
            summary = self._train(on_step)
            clean = True
            return summary
        except JobError:
            clean = True  # every rank raises it at the same point
            raise
        except OSError as e:  # metrics.jsonl, plots, TensorBoard: a full disk is one line, not a traceback
            if e.filename is None:  # not a file (a closed pipe on stdout): left to the caller
                raise
            raise self._write_error("", e) from None
        finally:
            self.close(clean)

    @contextmanager
    def _main_writes(self):
        """Rank 0's writes (metrics, TensorBoard, W&B, plots, the progress bar), agreed on by the job: a failed
        write is one ValueError naming it and the last complete checkpoint, on every rank."""
        with self.job.together(main_only=True) as mine:
            try:
                yield mine
            except OSError as e:
                if e.filename is None:
                    raise
                raise self._write_error("", e) from None

    def _train(self, on_step: Callable[[dict], None] | None) -> RunSummary:
        t = self.cfg.train
        writers = []
        with self._main_writes() as mine:
            if mine:
                writers = make_writers(self.cfg, self.run_dir)  # TensorBoard, W&B (train.tensorboard, train.wandb)
        bar = _progress(t.steps, self.start_step, t.progress) if self.job.is_main else None
        last_ckpt = latest_checkpoint(self.run_dir)
        try:
            for step in range(self.start_step, t.steps):
                m = self.step(step)
                with self._main_writes() as mine:
                    if mine:
                        append_metrics(self.run_dir, m)
                        if self.expert_load:
                            append_metrics(self.run_dir, {"step": m["step"], "layers": self.expert_load.layers,
                                                          "tokens": self.last_expert_tokens.tolist()}, EXPERT_LOAD)
                        log_metrics(writers, m)
                        if bar is not None:
                            bar.update(1)
                            bar.set_postfix(reward=f"{m['reward_mean']:.3f}", solved=f"{m['solved']:.2f}",
                                            peak=f"{m['peak_memory_bytes'] / 2**20:.0f}MiB", refresh=False)
                        elif (step + 1) % t.log_every == 0:
                            self.echo(f"step {m['step']}/{t.steps} reward {m['reward_mean']:.3f} loss "
                                      f"{m['loss']:.4f} peak {m['peak_memory_bytes'] / 2**20:.0f} MiB "
                                      f"{m['step_s']:.2f}s")
                if on_step is not None:
                    on_step(m)
                if (t.save_every and (step + 1) % t.save_every == 0) or step + 1 == t.steps:
                    last_ckpt = self._save(step + 1)
        finally:
            if bar is not None:
                bar.close()
            close_writers(writers)
        plots = []
        with self._main_writes() as mine:
            if mine and t.plots:
                from longstraw.rl.plots import plot_run

                plots = plot_run(self.run_dir)
        return self.summary(plots, last_ckpt)

    def summary(self, plots: list[Path], last_ckpt: Path | None) -> RunSummary:
        rows = read_metrics(self.run_dir)
        first = [r["reward_mean"] for r in rows[:10]]
        last = [r["reward_mean"] for r in rows[-10:]]
        return RunSummary(
            run_dir=self.run_dir, steps=len(rows), prompt_len=max((r["prompt_len"] for r in rows), default=0),
            group_size=self.cfg.rollout.group_size, reward_first=sum(first) / max(1, len(first)),
            reward_last=sum(last) / max(1, len(last)),
            solved_first=sum(r["solved"] for r in rows[:10]) / max(1, len(rows[:10])),
            solved_last=sum(r["solved"] for r in rows[-10:]) / max(1, len(rows[-10:])),
            peak_memory_bytes=max((r["peak_memory_bytes"] for r in rows), default=0),
            peak_above_start_bytes=max((r.get("peak_above_start_bytes", 0) for r in rows), default=0), plots=plots,
            last_checkpoint=last_ckpt, signal_steps=sum(r.get("signal_groups", 0) > 0 for r in rows))


def _progress(total: int, initial: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, initial=initial, desc="grpo", unit="step", dynamic_ncols=True)

