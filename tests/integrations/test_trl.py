"""LongStrawGRPOTrainer against stock TRL (trl==1.16.0) on a tiny Llama and a tokenizer trained offline.

* Same batch, same completions: the gradient LongStraw adds equals stock TRL's ``compute_loss`` + ``backward`` to
  float32 tolerance, for every mapped ``loss_type``, with the KL term (``beta > 0``), with old-policy log-probs
  (``num_iterations > 1``), with gradient accumulation and with masked (truncated) completions.
* A real ``trainer.train()`` loop: with a ``rollout_func`` giving both trainers the same completions, the
  gradients TRL's optimiser sees agree; with LongStraw's own sampling, steps run, TRL logs and calls back, and
  ``max_grad_norm`` clips.
* Settings the engine cannot honour are refused with one line naming them.
* LoRA (``peft_config=LoraConfig(...)``) against stock TRL + PEFT in float64: the adapters' gradients and weights
  after a real optimiser step, with ``beta = 0`` and with ``beta > 0`` (reference = adapters off), the checkpoint
  (PEFT's files, keys and values; stock PEFT loads it), resuming, and the refusals.
"""

from __future__ import annotations

import math

import pytest
import torch

trl = pytest.importorskip("trl")
transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")

import longstraw  # noqa: E402
from hf_reference import float32_rope, true_float64  # noqa: E402
from longstraw.integrations.trl import LOSS_TYPES, LongStrawGRPOTrainer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

PROMPTS = ["The grass is green. What colour is the grass?", "What is the pass key? 12345",
           "The sky is blue. The sky is", "Remember 67890. The number was"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A random tiny Llama checkpoint (float32) with a BPE tokenizer trained offline, in one directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(PROMPTS * 4, trainer=trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<pad>", "<eos>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf_tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>",
                                                  unk_token="<unk>")
    cfg = transformers.LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=len(hf_tok), max_position_embeddings=256,
                                   eos_token_id=hf_tok.eos_token_id, pad_token_id=hf_tok.pad_token_id,
                                   bos_token_id=None, tie_word_embeddings=False)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0, 0.2)
    d = tmp_path_factory.mktemp("tiny_llama")
    model.to(torch.float32).save_pretrained(d)
    hf_tok.save_pretrained(d)
    return str(d)


def _reward_len(completions, **kwargs):
    """A reward that differs within a group: the completion's length in characters, scaled."""
    return [len(c) / 10.0 for c in completions]


def _args(tmp_path, **kw):
    base = dict(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4, num_generations=4,
                max_completion_length=6, bf16=False, report_to="none", logging_steps=1, save_strategy="no",
                use_cpu=True, gradient_checkpointing=False, seed=0, dataloader_num_workers=0,
                disable_tqdm=True)
    base.update(kw)
    return trl.GRPOConfig(**base)


def _dataset(n=4):
    return datasets.Dataset.from_dict({"prompt": (PROMPTS * n)[:n]})


def _trainers(tiny_dir, tmp_path, **kw):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    common = dict(reward_funcs=_reward_len, train_dataset=_dataset(), processing_class=tok)
    stock = trl.GRPOTrainer(model=tiny_dir, args=_args(tmp_path / "stock", **kw), **common)
    ours = LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path / "ls", **kw), **common)
    return stock, ours, tok


def _batch(tok, rows_per_prompt=3, seed=0, truncated_row=None, old=False, ref=False, max_len=6, scorer=None):
    """TRL's prepared-batch dict for two prompts of different lengths (left-padded) and completions of several
    lengths (right-padded), as _generate_and_score_completions returns it (rows shuffled)."""
    g = torch.Generator().manual_seed(seed)
    prompts = [tok(p)["input_ids"] for p in PROMPTS[:2]]
    rows = [(p, torch.randint(3, len(tok), (int(torch.randint(1, max_len + 1, (1,), generator=g)),), generator=g))
            for p in prompts for _ in range(rows_per_prompt)]
    order = torch.randperm(len(rows), generator=g).tolist()
    rows = [rows[i] for i in order]
    P = max(len(p) for p, _ in rows)
    C = max_len
    B = len(rows)
    prompt_ids = torch.full((B, P), tok.pad_token_id)
    prompt_mask = torch.zeros(B, P, dtype=torch.long)
    completion_ids = torch.full((B, C), tok.pad_token_id)
    completion_mask = torch.zeros(B, C, dtype=torch.long)
    for i, (p, c) in enumerate(rows):
        prompt_ids[i, P - len(p):] = torch.tensor(p)
        prompt_mask[i, P - len(p):] = 1
        completion_ids[i, :len(c)] = c
        completion_mask[i, :len(c)] = 1
    if truncated_row is not None:
        completion_mask[truncated_row] = 0
    batch = dict(prompt_ids=prompt_ids, prompt_mask=prompt_mask, completion_ids=completion_ids,
                 completion_mask=completion_mask, advantages=torch.randn(B, generator=g),
                 num_items_in_batch=completion_mask.sum())
    if old or ref:  # near the model's own log-probs, as they are in training: some ratios clipped, KL moderate
        ids = torch.cat([prompt_ids, completion_ids], 1)
        mask = torch.cat([prompt_mask, completion_mask], 1)
        lp, _, _ = scorer._get_per_token_logps_and_entropies(scorer.model, ids, mask, C)
        if old:
            batch["old_per_token_logps"] = lp + 0.2 * torch.randn(B, C, generator=g)
        if ref:
            batch["ref_per_token_logps"] = lp + 0.5 * torch.randn(B, C, generator=g)
    return batch


def _stock_grads(trainer, batch, ga=1):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = ga
    loss = trainer.compute_loss(trainer.model, batch)
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in trainer.model.named_parameters() if p.grad is not None}


def _ours_grads(trainer, batch, ga=1):
    trainer.model.train()
    trainer.model.zero_grad()
    trainer.current_gradient_accumulation_steps = ga
    loss = trainer.longstraw_backward(batch)
    return float(loss), longstraw.hf_grads(trainer.model)


def _assert_close(ref: dict, got: dict):
    assert set(got) == set(ref), set(got) ^ set(ref)
    for n in ref:  # float32: relative to the tensor's largest entry
        atol = 1e-5 * float(ref[n].abs().max()) + 1e-9
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=atol, msg=lambda m: f"{n}: {m}")


CASES = [dict(loss_type=t) for t in LOSS_TYPES] + [
    dict(loss_type="grpo", beta=0.1, ref=True, old=True),
    dict(loss_type="bnpo", beta=0.1, ref=True, use_bias_correction_kl=False),
    dict(loss_type="grpo", importance_sampling_level="sequence", old=True, beta=0.05, ref=True),
    dict(loss_type="dr_grpo", delta=1.5, old=True),
    dict(loss_type="dapo", num_iterations=2, old=True, epsilon=0.1, epsilon_high=0.3),
    dict(loss_type="bnpo", truncated_row=1, old=True, ga=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_gradients_equal_stock_trl_on_the_same_batch(tiny_dir, tmp_path, case):
    case = dict(case)
    extra = {k: case.pop(k) for k in ("ref", "old", "truncated_row", "ga") if k in case}
    stock, ours, tok = _trainers(tiny_dir, tmp_path, **case)
    batch = _batch(tok, old=extra.get("old", False), ref=extra.get("ref", False),
                   truncated_row=extra.get("truncated_row"), scorer=ours)
    ga = extra.get("ga", 1)
    loss_ref, g_ref = _stock_grads(stock, batch, ga)
    loss, g = _ours_grads(ours, batch, ga)
    assert math.isclose(loss, loss_ref, rel_tol=1e-4, abs_tol=1e-6), (loss, loss_ref)
    _assert_close(g_ref, g)
    assert ours.engine_config.prompt_grad.value == "exact"  # the default: gradients through the prompt


def test_detached_prompt_differs_only_by_the_prompt_path(tiny_dir, tmp_path):
    """prompt_grad='detached' is available as a keyword; its gradient lacks the prompt's share, so it differs."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    ours = LongStrawGRPOTrainer(model=tiny_dir, reward_funcs=_reward_len, args=_args(tmp_path),
                                train_dataset=_dataset(), processing_class=tok, prompt_grad="detached")
    batch = _batch(tok)
    _, g = _ours_grads(ours, batch)
    stock = trl.GRPOTrainer(model=tiny_dir, reward_funcs=_reward_len, args=_args(tmp_path / "s"),
                            train_dataset=_dataset(), processing_class=tok)
    _, g_ref = _stock_grads(stock, batch)
    torch.testing.assert_close(g["lm_head.weight"], g_ref["lm_head.weight"], rtol=2e-4, atol=2e-6)
    assert not torch.allclose(g["model.layers.0.self_attn.k_proj.weight"],
                              g_ref["model.layers.0.self_attn.k_proj.weight"], rtol=1e-3, atol=1e-7)


def test_offloaded_state_gradient_gives_the_same_gradients(tiny_dir, tmp_path):
    """offload_state_grad=True (the state's gradient in host memory on a GPU) and offload_state=True (its K/V) are
    keywords; on the CPU the same gradients as without them, every sink access through ops/sinks.py
    (tests/sink_guard.py), every read of the moved K/V through ops/host_memory.py (tests/host_guard.py, which forces
    the move on the CPU)."""
    from host_guard import guarded_host
    from sink_guard import guarded_sinks

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    common = dict(model=tiny_dir, reward_funcs=_reward_len, train_dataset=_dataset(), processing_class=tok)
    plain = LongStrawGRPOTrainer(args=_args(tmp_path / "a"), **common)
    off = LongStrawGRPOTrainer(args=_args(tmp_path / "b"), offload_state_grad=True, **common)
    assert off.engine_config.offload_state_grad and not plain.engine_config.offload_state_grad
    batch = _batch(tok)
    _, g_ref = _ours_grads(plain, batch)
    with guarded_sinks() as touched:
        _, g = _ours_grads(off, batch)
    assert touched and set(g) == set(g_ref)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=0)
    moved = LongStrawGRPOTrainer(args=_args(tmp_path / "d"), offload_state=True, **common)
    assert moved.engine_config.offload_state
    with guarded_host() as read:
        _, g = _ours_grads(moved, batch)
    assert read and set(g) == set(g_ref)
    for n in g_ref:
        torch.testing.assert_close(g[n], g_ref[n], rtol=0, atol=0)
    with pytest.raises(ValueError, match="with prompt_grad='detached' there is none"):
        LongStrawGRPOTrainer(args=_args(tmp_path / "c"), prompt_grad="detached", offload_state_grad=True, **common)


def _fixed_rollout(tok):
    """A rollout_func giving every prompt the same deterministic completions (so two trainers see one batch)."""
    texts = [" green", " blue and", " 12345", " the"]

    def rollout(prompts, trainer):
        prompt_ids = [tok(p)["input_ids"] for p in prompts]
        completion_ids = [tok(texts[i % len(texts)])["input_ids"] + [tok.eos_token_id] for i in range(len(prompts))]
        return {"prompt_ids": prompt_ids, "completion_ids": completion_ids, "logprobs": None}
    return rollout


class _GradRecorder(transformers.TrainerCallback):
    """Gradients as the optimiser receives them (after clipping), under transformers' names."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        g = longstraw.hf_grads(model) if hasattr(model, "spec") else {
            n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        self.grads.append(g)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_a_real_trl_loop_with_the_same_completions_matches_stock(tiny_dir, tmp_path, loss_type):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    kw = dict(loss_type=loss_type, max_steps=2, gradient_accumulation_steps=2, per_device_train_batch_size=2,
              num_generations=4, learning_rate=1e-2, max_grad_norm=1.0, num_iterations=1,
              optim="sgd")  # SGD: Adam would amplify float32 rounding in the first update into the second step
    recs = []
    for cls, name in ((trl.GRPOTrainer, "stock"), (LongStrawGRPOTrainer, "ls")):
        rec = _GradRecorder()
        tr = cls(model=tiny_dir, reward_funcs=_reward_len, args=_args(tmp_path / name, **kw),
                 train_dataset=_dataset(4), processing_class=tok, rollout_func=_fixed_rollout(tok), callbacks=[rec])
        out = tr.train()
        assert out.global_step == 2
        recs.append(rec.grads)
    assert len(recs[0]) == len(recs[1]) == 2
    for g_ref, g in zip(*recs):
        _assert_close(g_ref, g)


def _one_step_weights(tiny_dir, tmp_path, cls, *, optimizer=False, scaler=None, **kw):
    """The weights (transformers' names) after one TRL step on the fixed completions."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    args = _args(tmp_path, max_steps=1, learning_rate=1e-2, max_grad_norm=0.0, **kw)
    model, optimizers = tiny_dir, (None, None)
    if optimizer:  # the user's own optimiser and scheduler over the transformers model they pass in
        model = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
        # SGD with momentum and weight decay (not args.optim's); not Adam, whose first step is about lr * sign(g)
        # and so turns float32 rounding in a near-zero gradient into a difference of lr
        opt = torch.optim.SGD(model.parameters(), lr=3e-2, momentum=0.9, weight_decay=0.1)
        optimizers = (opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5))
    tr = cls(model=model, reward_funcs=_reward_len, args=args, train_dataset=_dataset(4), processing_class=tok,
             rollout_func=_fixed_rollout(tok), optimizers=optimizers)
    if scaler is not None:  # what accelerate makes for fp16 on a GPU (none on the CPU)
        tr.accelerator.scaler = scaler
    tr.train()
    m = tr.model
    return {n: p.detach().clone() for n, p in m.named_parameters()} if not hasattr(m, "spec") else {
        n: p.detach().clone() for n, p in longstraw.checkpoint.hf.hf_parameters(m).items()}


def _assert_weights_close(ref: dict, got: dict):
    assert set(ref) == set(got)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=1e-4, atol=1e-6, msg=lambda m: f"{n}: {m}")


def test_the_users_optimiser_and_scheduler_are_moved_onto_the_longstraw_model(tiny_dir, tmp_path):
    """optimizers=(optimizer, scheduler) over the transformers model's parameters: the same update as stock TRL
    with them (the optimiser's own hyper-parameters, the scheduler's factor); a bad optimiser is refused in one
    line."""
    ref = _one_step_weights(tiny_dir, tmp_path / "stock", trl.GRPOTrainer, optimizer=True)
    got = _one_step_weights(tiny_dir, tmp_path / "ls", LongStrawGRPOTrainer, optimizer=True)
    base = _one_step_weights(tiny_dir, tmp_path / "ls0", LongStrawGRPOTrainer)
    _assert_weights_close(ref, got)
    assert not torch.allclose(base["lm_head.weight"], got["lm_head.weight"])  # the user's optimiser did the step
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    stray = torch.optim.SGD([torch.nn.Parameter(torch.zeros(3))], lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers=.*\(3,\) tensor that is not a parameter") as ei:
        LongStrawGRPOTrainer(model=tiny_dir, reward_funcs=_reward_len, args=_args(tmp_path / "bad"),
                             train_dataset=_dataset(), processing_class=tok, optimizers=(stray, None))
    assert "\n" not in str(ei.value)


def test_an_fp16_grad_scaler_sees_the_gradient_scaled_as_trainers_backward_scales_it(tiny_dir, tmp_path):
    """fp16 on a GPU: accelerate's GradScaler divides the gradient by its scale in the optimiser step, so the engine's
    gradient must be scaled as Trainer's backward scales the loss. A CPU GradScaler stands in for the GPU's."""
    ref = _one_step_weights(tiny_dir, tmp_path / "a", LongStrawGRPOTrainer, optim="sgd")
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 10)
    got = _one_step_weights(tiny_dir, tmp_path / "b", LongStrawGRPOTrainer, optim="sgd", scaler=scaler)
    assert scaler.get_scale() == 2.0 ** 10  # finite gradients: the step ran
    _assert_weights_close(ref, got)


def test_a_model_with_dropout_needs_disable_dropout(tiny_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, attention_dropout=0.1)
    common = dict(reward_funcs=_reward_len, train_dataset=_dataset(), processing_class=tok)
    with pytest.raises(ValueError, match=r"disable_dropout=False.*attention_dropout=0.1"):
        LongStrawGRPOTrainer(model=hf, args=_args(tmp_path / "a", disable_dropout=False), **common)
    LongStrawGRPOTrainer(model=hf, args=_args(tmp_path / "b", disable_dropout=True), **common)


def test_train_loop_with_longstraw_sampling(tiny_dir, tmp_path):
    """LongStraw samples (generate from the prompt state), TRL rewards, logs and calls back; max_grad_norm clips;
    the model trains and is saved as an HF checkpoint transformers loads."""
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    seen, steps = [], []

    class Spy(transformers.TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kw):
            seen.append(dict(logs or {}))

        def on_step_end(self, args, state, control, **kw):
            steps.append(state.global_step)

    args = _args(tmp_path, max_steps=3, learning_rate=5e-2, max_grad_norm=1.0, beta=0.05, temperature=1.2,
                 num_iterations=2, per_device_train_batch_size=8)  # two prompts of 4 completions per batch
    tr = LongStrawGRPOTrainer(model=tiny_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset(4),
                              processing_class=tok, callbacks=[Spy()])
    assert isinstance(tr.model, longstraw.models.transformer.CausalLM)
    before = {n: p.detach().clone() for n, p in tr.model.named_parameters()}
    tr.train()
    assert steps == [1, 2, 3]
    train_logs = [entry for entry in seen if "loss" in entry]
    assert train_logs and all(math.isfinite(entry["loss"]) for entry in train_logs)
    assert "reward" in train_logs[0] and all("kl" in entry for entry in train_logs)  # num_iterations=2: one
    # generation serves two steps, so TRL logs rewards on the steps that generate
    assert all(entry["grad_norm"] >= 0 for entry in train_logs)
    changed = [n for n, p in tr.model.named_parameters() if not torch.equal(p, before[n])]
    assert changed
    out = tmp_path / "saved"
    tr.save_model(str(out))
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    torch.testing.assert_close(reloaded.model.embed_tokens.weight, tr.model.model.embed_tokens.weight)


def test_max_grad_norm_clips_the_longstraw_gradient(tiny_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    rec = _GradRecorder()
    args = _args(tmp_path, max_steps=1, max_grad_norm=1e-3)
    tr = LongStrawGRPOTrainer(model=tiny_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset(4),
                              processing_class=tok, rollout_func=_fixed_rollout(tok), callbacks=[rec])
    tr.train()
    norm = torch.linalg.vector_norm(torch.stack([g.norm() for g in rec.grads[0].values()]))
    assert norm <= 1e-3 * (1 + 1e-4)


def test_hf_grads_on_trainer_model(tiny_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    tr = LongStrawGRPOTrainer(model=tiny_dir, reward_funcs=_reward_len, args=_args(tmp_path),
                              train_dataset=_dataset(), processing_class=tok)
    tr.current_gradient_accumulation_steps = 1
    tr.longstraw_backward(_batch(tok))
    grads = longstraw.hf_grads(tr.model)
    assert "model.layers.1.mlp.down_proj.weight" in grads and "lm_head.weight" in grads
    assert all(torch.isfinite(g).all() for g in grads.values())


def test_accepts_an_hf_model_instance(tiny_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    tr = LongStrawGRPOTrainer(model=hf, reward_funcs=_reward_len, args=_args(tmp_path), train_dataset=_dataset(),
                              processing_class=tok)
    torch.testing.assert_close(tr.model.lm_head.weight, hf.lm_head.weight)


REFUSED = [
    (dict(loss_type="cispo"), "loss_type='cispo'"),
    (dict(loss_type="sapo"), "loss_type='sapo'"),
    (dict(delta=1.1), "delta=1.1"),
    (dict(top_entropy_quantile=0.5), "top_entropy_quantile=0.5"),
    (dict(entropy_coef=0.01), "entropy_coef=0.01"),
    (dict(off_policy_mask_threshold=0.5), "off_policy_mask_threshold=0.5"),
    (dict(use_vllm=True), "use_vllm=True"),
    (dict(repetition_penalty=1.1), "repetition_penalty=1.1"),
    (dict(min_p=0.1), "min_p=0.1"),
    (dict(neftune_noise_alpha=5.0), "neftune_noise_alpha=5.0"),
    (dict(torch_compile=True), "torch_compile=True"),
    (dict(optim="lomo"), "optim='lomo'"),
]


@pytest.mark.parametrize("kw,needle", REFUSED, ids=[n for _, n in REFUSED])
def test_settings_it_cannot_honour_are_refused_in_one_line(tiny_dir, tmp_path, kw, needle):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    try:
        args = _args(tmp_path, **kw)
    except (ValueError, ImportError) as e:  # TRL itself refuses some (e.g. use_vllm without vllm installed)
        pytest.skip(f"trl.GRPOConfig refuses it already: {e}")
    with pytest.raises(ValueError) as ei:
        LongStrawGRPOTrainer(model=tiny_dir, reward_funcs=_reward_len, args=args, train_dataset=_dataset(),
                             processing_class=tok)
    msg = str(ei.value)
    assert needle in msg and "allowed" in msg and "\n" not in msg


def test_constructor_arguments_it_cannot_honour_are_refused(tiny_dir, tmp_path):
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    common = dict(reward_funcs=_reward_len, args=_args(tmp_path), train_dataset=_dataset(), processing_class=tok)

    def tool(x: int) -> int:
        """A tool.

        Args:
            x: a number
        """
        return x

    with pytest.raises(ValueError, match=r"tools=\['tool'\]"):
        LongStrawGRPOTrainer(model=tiny_dir, tools=[tool], **common)


def test_accepts_every_argument_of_trl_grpo_trainer():
    import inspect

    stock = inspect.signature(trl.GRPOTrainer.__init__).parameters
    ours = inspect.signature(LongStrawGRPOTrainer.__init__).parameters
    assert list(stock) == list(ours)[:len(stock)]  # same names, same order (positional calls work too)
    assert all(ours[n].default == p.default for n, p in stock.items())
    extra = list(ours)[len(stock):]
    assert extra == ["prompt_grad", "prefill_chunk", "branch_batch", "logprob_chunk", "offload_state_grad",
                     "graph_budget_bytes", "offload_state"]
    assert all(ours[n].kind is inspect.Parameter.KEYWORD_ONLY for n in extra) and ours["prompt_grad"].default == "exact"


# ------------------------------------------------------------------------------------------------------------ LoRA
LORA = dict(r=4, lora_alpha=8, target_modules="all-linear")


class _LoraGradRecorder(transformers.TrainerCallback):
    """The adapters' gradients as the optimiser receives them, under PEFT's saved keys (``lora_A.weight``)."""

    def __init__(self):
        self.grads = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.grads.append(longstraw.lora_grads(model) if hasattr(model, "spec") else {
            n.replace(".default.", "."): p.grad.clone() for n, p in model.named_parameters() if p.grad is not None})


def _adapter_weights(model) -> dict:
    """The trained tensors under PEFT's saved keys (stock PeftModel or LongStraw model)."""
    if hasattr(model, "spec"):  # routed experts' adapters: PEFT nests them (models.lora.expert_peft_names)
        theirs = longstraw.models.lora.expert_peft_names(longstraw.models.lora.expert_adapters(model))
        return {"base_model.model." + theirs.get(n, n): p.detach().clone() for n, p in model.named_parameters()
                if p.requires_grad}
    return {n.replace(".default.", "."): p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _copy_stock_adapters(stock, ours, tmp_path, seed=1):
    """Random non-zero B in stock's adapters (B = 0 would leave A's gradient zero and the reference equal to the
    policy), then stock's adapters copied into ours by PEFT's keys (its saved adapter file)."""
    from longstraw.checkpoint.adapter import fill_adapter

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in sorted(stock.model.named_parameters()):
            if "lora_B" in n:
                p.copy_(0.1 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    d = tmp_path / "stock_init"
    stock.model.save_pretrained(d)
    fill_adapter(ours.model, d)


def _lora_pair(tiny_dir, tmp_path, peft_kw=LORA, load_kw=None, **kw):
    """Stock TRL + PEFT and LongStrawGRPOTrainer, both float64 with peft_config, set for one SGD step on the fixed
    completions, with the same initial adapters; returns (stock, ours, their gradient recorders)."""
    peft = pytest.importorskip("peft")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    args = dict(max_steps=1, learning_rate=0.5, max_grad_norm=0.0, optim="sgd")
    args.update(kw)
    trainers, recs = [], []
    for cls, name in ((trl.GRPOTrainer, "stock"), (LongStrawGRPOTrainer, "ls")):
        hf = float32_rope(transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64,
                                                                            **(load_kw or {})))
        rec = _LoraGradRecorder()
        trainers.append(cls(model=hf, reward_funcs=_reward_len, args=_args(tmp_path / name, **args),
                            train_dataset=_dataset(4), processing_class=tok, rollout_func=_fixed_rollout(tok),
                            callbacks=[rec], peft_config=peft.LoraConfig(**peft_kw)))
        recs.append(rec)
    _copy_stock_adapters(*trainers, tmp_path)
    return (*trainers, recs)


class _LogProb64:
    """Stand-in for TRL 1.16's chunked log-prob kernel (``trl.kernels.ChunkedLogProbFunction``, which keeps its
    softmax statistics in float32 whatever the model's dtype) computing the same outputs in the model's dtype with
    plain autograd: so stock TRL runs wholly in float64 and can be compared to ~1e-8."""

    @staticmethod
    def apply(hidden, weight, bias, targets, temperature, chunk_size, softcap=None, logit_scale=1.0,
              outputs=("entropy",)):
        z = torch.nn.functional.linear(hidden, weight, bias) * logit_scale
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        lsm = (z / temperature).log_softmax(-1)
        lp = lsm.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        ent = -(lsm.exp() * lsm).sum(-1) if "entropy" in outputs else None
        lss = torch.logsumexp(2 * lsm, -1).detach() if "log_sum_sq_probs" in outputs else None
        mean = (z / temperature).mean(-1).detach() if "mean_logits" in outputs else None
        top1 = (z.argmax(-1) == targets) if "is_top1" in outputs else None
        return lp, ent, lss, mean, top1


def _assert_close64(ref: dict, got: dict, tol=1e-8):
    assert set(got) == set(ref), set(got) ^ set(ref)
    for n in ref:
        torch.testing.assert_close(got[n], ref[n], rtol=tol, atol=tol * float(ref[n].abs().max()) + 1e-15,
                                   msg=lambda m: f"{n}: {m}")


@pytest.mark.parametrize("beta", [0.0, 0.2])
def test_lora_step_equals_stock_trl_peft(tiny_dir, tmp_path, beta, monkeypatch):
    """peft_config=LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"): the same trained tensors as stock
    TRL's PeftModel, the adapters' gradients and their values after one optimiser step equal in float64; with
    beta > 0 TRL's reference is the model with the adapters off (no model copy), so the KL is not zero. The step's
    checkpoint holds PEFT's files with stock's keys and values, stock PEFT loads it with stock's logits, and resuming
    reads it back."""
    peft = pytest.importorskip("peft")
    stock, ours, (rec_stock, rec_ours) = _lora_pair(tiny_dir, tmp_path, beta=beta, save_strategy="steps",
                                                    save_steps=1)
    assert ours.ref_model is None and isinstance(ours.model, longstraw.models.transformer.CausalLM)
    before = _adapter_weights(ours.model)
    _assert_close64(_adapter_weights(stock.model), before, tol=0)  # the same trained tensors, the same values
    base = {n: p.detach().clone() for n, p in ours.model.named_parameters() if not p.requires_grad}
    monkeypatch.setattr("trl.trainer.utils._ChunkedLogProbFunction", _LogProb64)  # stock wholly in float64
    with true_float64():  # transformers' float32 casts in a float64 model (RMSNorm) made no-ops
        stock.train()
    ours.train()
    assert len(rec_stock.grads) == len(rec_ours.grads) == 1
    _assert_close64(rec_stock.grads[0], rec_ours.grads[0])
    assert all(float(g.abs().max()) > 0 for g in rec_ours.grads[0].values())
    after = _adapter_weights(ours.model)
    _assert_close64(_adapter_weights(stock.model), after)
    assert all(not torch.equal(after[n], before[n]) for n in after)  # every adapter trained
    assert all(torch.equal(p, base[n]) for n, p in ours.model.named_parameters() if not p.requires_grad)
    logged = [h for h in ours.state.log_history if "loss" in h][0]
    ref_logged = [h for h in stock.state.log_history if "loss" in h][0]
    assert (beta == 0.0 and "kl" not in logged) or logged["kl"] > 1e-4  # adapters off: the reference differs
    assert math.isclose(logged["loss"], ref_logged["loss"], rel_tol=1e-9)
    if beta:
        assert math.isclose(logged["kl"], ref_logged["kl"], rel_tol=1e-9)

    ckpt, stock_ckpt = tmp_path / "ls" / "out" / "checkpoint-1", tmp_path / "stock" / "out" / "checkpoint-1"
    for f in ("adapter_config.json", "adapter_model.safetensors", "training_args.bin", "tokenizer.json"):
        assert (ckpt / f).is_file(), f
    assert not (ckpt / "model.safetensors").exists()
    from safetensors.torch import load_file
    _assert_close64(load_file(stock_ckpt / "adapter_model.safetensors"), load_file(ckpt / "adapter_model.safetensors"))
    hf = float32_rope(transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64))
    loaded = peft.PeftModel.from_pretrained(hf, str(ckpt)).eval()
    x = torch.tensor([[5, 17, 42, 8, 99, 23]])
    with torch.no_grad(), true_float64():
        want = stock.model.eval()(x).logits
        torch.testing.assert_close(loaded(x).logits, want, rtol=1e-9, atol=1e-9)

    # resuming: the checkpoint's adapter read back into a fresh trainer's adapters
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    again = LongStrawGRPOTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(tiny_dir, dtype=torch.float64),
                                 reward_funcs=_reward_len, args=_args(tmp_path / "again", beta=beta),
                                 train_dataset=_dataset(4), processing_class=tok, peft_config=peft.LoraConfig(**LORA))
    again._load_from_checkpoint(str(ckpt))
    _assert_close64(after, _adapter_weights(again.model), tol=0)


def test_lora_reference_is_the_base_model(tiny_dir, tmp_path):
    """The model's disable_adapter() (what TRL's PEFT branch scores the reference in): the base model's log-probs,
    modules_to_save at their initial values even after they changed; outside it the adapters are back."""
    peft = pytest.importorskip("peft")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    common = dict(reward_funcs=_reward_len, train_dataset=_dataset(), processing_class=tok)
    plain = LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path / "a"), **common)
    tr = LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path / "b", beta=0.1), **common,
                              peft_config=peft.LoraConfig(**LORA, modules_to_save=["lm_head"]))
    assert tr.model.peft_config["default"].r == 4 and tr.ref_model is None
    trained = {n for n, p in tr.model.named_parameters() if p.requires_grad}
    assert "lm_head.weight" in trained and all(".lora_" in n or n == "lm_head.weight" for n in trained)
    with torch.no_grad():
        for n, p in tr.model.named_parameters():
            if p.requires_grad:
                p.add_(0.1 * torch.randn_like(p))
    batch = _batch(tok)
    ids = torch.cat([batch["prompt_ids"], batch["completion_ids"]], 1)
    mask = torch.cat([batch["prompt_mask"], batch["completion_mask"]], 1)

    k = batch["completion_ids"].size(1)

    def lp(trainer):
        return trainer._get_per_token_logps_and_entropies(trainer.model, ids, mask, k)[0]

    policy = lp(tr)
    with tr.model.disable_adapter():
        ref = lp(tr)
    torch.testing.assert_close(ref, lp(plain), rtol=0, atol=1e-6)
    assert not torch.allclose(policy, ref, atol=1e-3)
    torch.testing.assert_close(lp(tr), policy, rtol=0, atol=0)


def test_lora_settings_it_cannot_honour_are_refused_in_one_line(tiny_dir, tmp_path):
    peft = pytest.importorskip("peft")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    common = dict(reward_funcs=_reward_len, train_dataset=_dataset(), processing_class=tok)
    cases = [
        (dict(use_dora=True), "use_dora=True"),
        (dict(bias="all"), "bias='all'"),
        (dict(init_lora_weights="gaussian"), "init_lora_weights='gaussian'"),
        (dict(init_lora_weights="pissa"), "init_lora_weights='pissa'"),
        (dict(target_modules=["q_proj"], layers_to_transform=[0]), "layers_to_transform=[0]"),
        (dict(target_modules=["q_proj", "foo_proj"]), "'foo_proj' matches no module"),
        (dict(target_modules=["lm_head"]), "modules_to_save=['lm_head']"),
        (dict(modules_to_save=["nothing_here"]), "'nothing_here' matches no module"),
    ]
    for kw, needle in cases:
        with pytest.raises(ValueError) as ei:
            LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path), peft_config=peft.LoraConfig(**{**LORA, **kw}),
                                 **common)
        msg = str(ei.value)
        assert needle in msg and msg.startswith("LongStrawGRPOTrainer cannot honour peft_config") and "\n" not in msg
    with pytest.raises(ValueError, match=r"peft_config='PrefixTuningConfig': allowed: None or a peft.LoraConfig"):
        LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path), **common,
                             peft_config=peft.PrefixTuningConfig(num_virtual_tokens=4, task_type="CAUSAL_LM"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tiny_dir)
    opt = torch.optim.SGD(hf.parameters(), lr=0.1)
    with pytest.raises(ValueError, match=r"optimizers=.*with peft_config.*allowed: \(None, None\)"):
        LongStrawGRPOTrainer(model=hf, args=_args(tmp_path), **common, optimizers=(opt, None),
                             peft_config=peft.LoraConfig(**LORA))
    drop = peft.LoraConfig(**LORA, lora_dropout=0.1)
    with pytest.raises(ValueError, match=r"lora_dropout=0.1 with disable_dropout=False and prompt_grad='exact'"):
        LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path, disable_dropout=False), **common, peft_config=drop)
    # disable_dropout=True switches LoRA dropout off (as TRL does on its PeftModel); detached takes dropout
    on = LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path, disable_dropout=True), **common, peft_config=drop)
    assert not longstraw.models.lora.active_dropout(on.model)
    on.current_gradient_accumulation_steps = 1
    on.longstraw_backward(_batch(tok))  # exact mode runs: no dropout left
    assert longstraw.lora_grads(on.model)
    det = LongStrawGRPOTrainer(model=tiny_dir, args=_args(tmp_path, disable_dropout=False), **common,
                               peft_config=drop, prompt_grad="detached")
    assert longstraw.models.lora.active_dropout(det.model)
    with pytest.raises(ValueError, match=r"model='PeftModel'"):
        LongStrawGRPOTrainer(model=peft.get_peft_model(hf, peft.LoraConfig(**LORA)), args=_args(tmp_path), **common)


@pytest.fixture(scope="module")
def tiny_moe_dir(tiny_dir, tmp_path_factory):
    """A random tiny GLM-4 MoE checkpoint (float64, routed experts as fused 3-D weights) with tiny_dir's tokenizer."""
    from hf_reference import save_tiny, tiny_moe_hf

    tok = transformers.AutoTokenizer.from_pretrained(tiny_dir)
    cfg = transformers.Glm4MoeConfig(
        vocab_size=len(tok), hidden_size=32, intermediate_size=40, moe_intermediate_size=8, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.7, max_position_embeddings=256,
        eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id, bos_token_id=None, tie_word_embeddings=False)
    d = save_tiny(tiny_moe_hf(cfg, seed=7))
    tok.save_pretrained(d)
    return str(d)


def test_lora_on_routed_experts_equals_stock_trl_peft(tiny_moe_dir, tmp_path, monkeypatch):
    """target_parameters (routed experts' fused weights, PEFT's ParamWrapper layout) beside target_modules, with
    beta > 0: the same adapter gradients and weights after one step as stock TRL + PEFT, in float64."""
    experts = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                   target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"])
    stock, ours, (rec_stock, rec_ours) = _lora_pair(tiny_moe_dir, tmp_path, peft_kw=experts, beta=0.1,
                                                    load_kw=dict(experts_implementation="eager"))
    assert longstraw.models.lora.expert_adapters(ours.model)
    _assert_close64(_adapter_weights(stock.model), _adapter_weights(ours.model), tol=0)
    monkeypatch.setattr("trl.trainer.utils._ChunkedLogProbFunction", _LogProb64)
    with true_float64():
        stock.train()
    ours.train()
    _assert_close64(rec_stock.grads[0], rec_ours.grads[0])
    assert any("experts" in n for n in rec_ours.grads[0])
    _assert_close64(_adapter_weights(stock.model), _adapter_weights(ours.model))
