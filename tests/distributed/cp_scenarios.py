"""Scenarios run twice: single-process in the test process (the reference) and on every rank of a CP group
(cp_worker.py). Each returns a dict of CPU tensors / numbers / strings that the tests compare.

Data come from fixed seeds, so both sides build the same groups without passing tensors around. ``fsdp``
scenarios shard the loaded model with FSDP2 when a CP group is active (single-process: plain model).
"""

from __future__ import annotations

import torch

import longstraw
from longstraw import distributed

V = 61  # vocabulary of the tiny models (tests/distributed/test_cp.py builds them)


def group(seed: int, p: int, lens: list[int]):
    g = torch.Generator().manual_seed(seed)
    prompt = torch.randint(0, V, (p,), generator=g)
    responses = [torch.randint(0, V, (n,), generator=g) for n in lens]
    adv = torch.tensor([1.3, -0.7, 0.4, -1.6, 0.9, -0.2][: len(lens)])
    return prompt, responses, adv


def _load(path: str, fsdp: bool, dtype=None):
    """The model as the job loads it (FSDP2 over every rank after init_distributed(fsdp=True)); ``fsdp``: shard it
    over every rank also in a job initialised without (single process: the plain model)."""
    model = longstraw.load_model(path, dtype=dtype)
    ctx = distributed.get_context()
    if fsdp and ctx is not None and not ctx.fsdp:
        distributed.parallelize(model, ctx, fsdp=True)
    return model


def _old_ref(model, prompt, responses, cfg, seed):
    """Off-policy old log-probs (both clips active) and reference log-probs for the KL term."""
    true_lp = longstraw.score(model, prompt, responses, cfg)
    g = torch.Generator().manual_seed(seed)
    old = [lp + 0.5 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in true_lp]
    ref = [lp + 0.3 * torch.randn(lp.shape, generator=g, dtype=lp.dtype) for lp in true_lp]
    return old, ref


def _mla_mode(model, mode):
    """Force every MLA layer of ``model`` to one form (None: leave "auto"), expanding 4 stored positions at a time in
    the decompressed form, so that chunks split a rank's share, a step's earlier pieces and the prompt alike."""
    if mode is not None:
        from longstraw.models.mla import set_mla_mode

        set_mla_mode(model, mode, decompress_chunk=4)


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: g.detach().cpu().clone() for n, g in longstraw.hf_grads(model).items()}


def grpo_two_groups(paths, *, family="llama", prompt_grad="exact", fsdp=False, chunk=3, branch_batch=1,
                    checkpoint_layers=False, mla_mode=None, dtype=None, offload=False, state_offload=False,
                    graph_budget=None, train_only=None):
    """Two groups accumulated into .grad with a step-global normaliser (the second adds to the first's .grad).
    ``mla_mode``: force an MLA form (in one process and under CP alike; see :func:`_mla_mode`). Every rank passes
    the same groups: with the mean over data-parallel replicas, the gradients are the single process's.
    ``offload``: the state gradient offloaded (``offload_state_grad``), every sink access checked to go through
    ``ops/sinks.py`` (``tests/sink_guard.py``). ``state_offload``: the K/V moved to host memory (``offload_state``,
    forced on the CPU), every read of it checked to go through ``ops/host_memory.py`` (``tests/host_guard.py``).
    ``train_only``: only the parameters whose name contains it are trained (LoRA's case: a frozen model whose first
    layers' outputs need no gradient on the rank with the first piece, while the next rank's prefix collects one)."""
    model = _load(paths[family], fsdp, dtype)
    _freeze(model, train_only)
    _mla_mode(model, mla_mode)
    groups = [group(5, 23, [4, 1, 6]), group(6, 18, [3, 5])]
    d = longstraw.loss_denominator([r.numel() for _, rs, _ in groups for r in rs], "token-mean")
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=chunk, branch_batch=branch_batch,
                               checkpoint_layers=checkpoint_layers, kl_coef=0.05, entropy_coef=0.01,
                               offload_state_grad=offload, offload_state=state_offload,
                               graph_budget_bytes=graph_budget)
    out = {"loss": [], "logprobs": [], "state_bytes": [], "state_grad_bytes": [], "kept": []}
    for i, (prompt, responses, adv) in enumerate(groups):
        old, ref = _old_ref(model, prompt, responses, cfg, seed=40 + i)
        with _sink_guard(offload) as touched, _host_guard(state_offload) as read:
            st = longstraw.grpo_backward(model, prompt, responses, adv, cfg, old_logprobs=old, ref_logprobs=ref,
                                         loss_scale=d)
        assert touched, "no gradient reached an offloaded sink"
        if state_offload:
            assert read, "no block of the moved state was copied in"
            assert 0 < st.prompt_state_host_bytes <= st.prompt_state_bytes
        out["loss"].append(st.loss)
        out["logprobs"].append([lp.cpu() for lp in st.logprobs])
        out["state_bytes"].append(st.prompt_state_bytes)
        out["state_grad_bytes"].append(st.prompt_state_grad_bytes)
        out["kept"].append((st.kept_steps, st.kept_layers))  # what the graph budget kept: (whole steps, layers)
        out["metrics"] = st.metrics
    out["grads"] = _grads(model)
    out["sharded_params"] = sum(hasattr(p, "full_tensor") for p in model.parameters())
    out["whole_params"] = sum(not hasattr(p, "full_tensor") for p in model.parameters())
    out["ep_params"] = 2 * len(distributed.ep_modules(model))
    if dtype is None:  # the global gradient norm (over every rank's shards and experts), as the trainer clips it
        from longstraw.rl.optim import clip_grad_norm

        out["grad_norm"] = clip_grad_norm(list(model.parameters()), 0.0)
    if dtype is not None:
        out["grads"] = {n: g.double() for n, g in out["grads"].items()}
    return out


def _host_guard(on: bool):
    """``tests/host_guard.py``'s check when ``on`` (yields the ops that read the moved state); else a no-op."""
    import contextlib

    if not on:
        return contextlib.nullcontext(["unguarded"])
    from host_guard import guarded_host

    return guarded_host()


def _sink_guard(on: bool):
    """``tests/sink_guard.py``'s check when ``on`` (yields the ops that reached the sinks); else a no-op."""
    import contextlib

    if not on:
        return contextlib.nullcontext(["unguarded"])
    from sink_guard import guarded_sinks

    return guarded_sinks()


def _ring_selection(run):
    """``run()`` with every replicated DSA top-k taking the ring (``cp_latent._GATHER_BYTES`` below any call's
    size), restored after; one process never reads it."""
    from longstraw.distributed import cp_latent

    old, cp_latent._GATHER_BYTES = cp_latent._GATHER_BYTES, -1
    try:
        return run()
    finally:
        cp_latent._GATHER_BYTES = old


def score(paths, *, family="llama", fsdp=False, mla_mode=None):
    model = _load(paths[family], fsdp)
    _mla_mode(model, mla_mode)
    prompt, responses, _ = group(8, 19, [5, 1, 8])
    lp, ent = longstraw.score(model, prompt, responses, longstraw.GRPOConfig(prefill_chunk=2, branch_batch=2),
                              with_entropy=True)
    return {"logprobs": [x.cpu() for x in lp], "entropy": [x.cpu() for x in ent]}


def generate(paths, *, family="llama", fsdp=False, mla_mode=None):
    """Rollouts from the shared state, their log-probs against score, and the kept state reused for a step."""
    model = _load(paths[family], fsdp)
    _mla_mode(model, mla_mode)
    prompt, _, _ = group(9, 21, [1])
    sp = longstraw.SamplingConfig(temperature=0.9, top_k=20, max_new_tokens=7, seed=3, stop_token_ids=(7,))
    ro = longstraw.generate(model, prompt, 4, sp, prefill_chunk=3, keep_state=True, exact_state=True)
    want = longstraw.score(model, prompt, ro.responses, longstraw.GRPOConfig(prefill_chunk=4, temperature=0.9))
    cfg = longstraw.GRPOConfig(prefill_chunk=3, temperature=0.9)
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    longstraw.grpo_backward(model, prompt, ro.responses, adv, cfg, prompt_state=ro.prompt_state)
    return {"responses": [r.cpu() for r in ro.responses], "logprobs": [x.cpu() for x in ro.logprobs],
            "score": [x.cpu() for x in want], "reasons": list(ro.finish_reasons), "grads": _grads(model)}


def state_bytes(paths, *, family="llama"):
    """Per-rank prompt-state bytes of a longer prompt, as PromptState.nbytes() reports them; per layer, its bytes and
    whether it keeps a recurrent state (DeltaNet, KDA: the O(1) state after the prompt, on every rank under CP)."""
    from longstraw.distributed.cp_recurrent import ShardedRecurrentState
    from longstraw.engine.prefill import prefill
    from longstraw.models.deltanet import RecurrentState

    model = longstraw.load_model(paths[family])
    prompt, _, _ = group(10, 98, [1])
    st = prefill(model, prompt[:-1], 8)
    recurrent = [isinstance(ls, (RecurrentState, ShardedRecurrentState)) for ls in st.layers]
    first = next(getattr(ls, "local", ls) for ls, rec in zip(st.layers, recurrent) if not rec)
    buf = first.k if hasattr(first, "k") else first.lat  # K/V or MLA latents [1, H, positions, D]
    return {"nbytes": st.nbytes(), "positions": buf.shape[2],
            "layers": [(ls.nbytes(), rec) for ls, rec in zip(st.layers, recurrent)]}


def window_state_bytes(paths, *, family="gemma3_w5", exact=False):
    """Per layer of a longer prompt: the prompt-state bytes this rank holds and, for a sliding layer, the global
    positions its tails cover (replicated: the same on every rank)."""
    from longstraw.engine.prefill import prefill

    model = longstraw.load_model(paths[family])
    prompt, _, _ = group(10, 98, [1])
    st = prefill(model, prompt[:-1], 8, exact=exact)
    out = []
    for ls in st.layers:
        tails = getattr(getattr(ls, "local", ls), "tails", None)
        out.append({"nbytes": ls.nbytes(), "sliding": tails is not None,
                    "positions": [(t.start, t.end) for t in tails] if tails is not None else None})
    return {"layers": out, "window": model.spec.sliding_window}


def _freeze(model, train_only: str | None) -> None:
    """Train only the parameters whose name contains ``train_only`` (None: all)."""
    if train_only is not None:
        for n, prm in model.named_parameters():
            prm.requires_grad_(train_only in n)


def _split_budget(paths, family="gemma3_w5", chunk=2) -> int:
    """A graph budget under which the first group of :func:`grpo_two_groups` (prefill chunks of ``chunk``) keeps its
    last step whole and the top layers of the one before: found on a throwaway model by trying fractions of a
    measured step (the ranks plan alike: the steps' costs are agreed over them). Enough steps that the one split is
    not step 0 (kept whole or not at all)."""
    model = longstraw.load_model(paths[family])
    prompt, responses, adv = group(5, 23, [4, 1, 6])

    def kept(budget):
        return longstraw.grpo_backward(model, prompt, responses, adv,
                                       longstraw.GRPOConfig(prefill_chunk=chunk, graph_budget_bytes=budget))

    step = kept(1 << 30).step_graph_bytes
    ctx = distributed.cp_active()
    if ctx is not None:  # a rank's step-0 piece may be shorter than another's: one budget for all
        step = int(ctx.cp.all_reduce_max(torch.tensor([step])).item())
    for f in range(11, 30):
        budget = int(f / 10 * step)
        if kept(budget).kept_layers > 0:
            return budget
    raise AssertionError(f"no budget between 1.1 and 2.9 steps of {step} bytes splits a step")


def kept_refused(paths):
    """A graph budget on a model with a layer whose context-parallel kind does not say it can keep step graphs
    (``keeps_step_graphs``; here the DeltaNet scan registered through a plain function): refused under CP (one
    line, before anything runs), fine in one process."""
    from longstraw.distributed.cp_recurrent import ShardedRecurrentState
    from longstraw.models.deltanet import RecurrentState

    model = longstraw.load_model(paths["hybrid"])
    prompt, responses, adv = group(5, 23, [4, 1, 6])
    distributed.register_cp_kind(RecurrentState, lambda st, layout, comm: ShardedRecurrentState(st, layout, comm))
    try:
        longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(graph_budget_bytes=1 << 30))
        return {"error": None}
    except ValueError as e:
        assert all(p.grad is None for p in model.parameters())
        return {"error": str(e)}
    finally:
        distributed.register_cp_kind(RecurrentState, ShardedRecurrentState)


def bad_inputs(paths):
    """Errors every CP rank must raise alike (single-process: the calls that are fine there return 'ok')."""
    model = longstraw.load_model(paths["llama"])
    ctx = distributed.cp_active()
    r = ctx.cp.size if ctx is not None else 1
    out = {}
    cfg = longstraw.GRPOConfig(prefill_chunk=4)
    short, responses, adv = group(11, r, [3, 2])  # r tokens: r - 1 prefilled positions, one too few for cp=r
    for name, call in {
        "too_short_grpo": lambda: longstraw.grpo_backward(model, short, responses, adv, cfg),
        "too_short_generate": lambda: longstraw.generate(model, short, 2, longstraw.SamplingConfig(max_new_tokens=2)),
        "init_twice": lambda: longstraw.init_distributed(cp=r),
    }.items():
        try:
            call()
            out[name] = "ok"
        except ValueError as e:
            out[name] = str(e)
    if ctx is not None:  # ranks that disagree on the group: every rank raises instead of hanging
        prompt, responses, adv = group(12 + ctx.cp.rank, 12, [3, 2])
        try:
            longstraw.score(model, prompt, responses)
            out["mismatch"] = "ok"
        except ValueError as e:
            out["mismatch"] = str(e)
    assert ctx is None or all(p.grad is None for p in model.parameters())
    return out


def low_precision(paths):
    """bf16 weights, and float32 weights under bf16 autocast: the CP collectives carry bf16 partial outputs."""
    prompt, responses, adv = group(5, 40, [6, 3, 5])
    out = {}
    for dtype, compute in (("bfloat16", None), ("float32", "bfloat16")):
        model = longstraw.load_model(paths["llama"], dtype=dtype)
        cfg = longstraw.GRPOConfig(prefill_chunk=4, compute_dtype=compute)
        longstraw.grpo_backward(model, prompt, responses, adv, cfg)
        out[dtype] = {n: g.double().cpu() for n, g in longstraw.hf_grads(model).items()}
    return out


def dp_sum(paths, *, family="llama", prompt_grad="exact", fsdp=False, train_only=None):
    """Data parallel x context parallel: replica d back-propagates its own groups (prompts of different lengths, so
    different numbers of prefill and reverse-pass steps; different G, so different numbers of replay batches; they
    also generate rollouts that stop at different steps), with the step-global normaliser over the replicas
    (``loss_scale = D / replicas``: the gradients are averaged over replicas); the result is one process's gradient
    of all the groups. Under FSDP over every rank the replicas' phases run in lockstep (idle steps).
    ``train_only``: as :func:`grpo_two_groups`'s."""
    model = _load(paths[family], fsdp)
    _freeze(model, train_only)
    ctx = distributed.get_context()
    groups = [group(20, 15, [3, 4]), group(21, 29, [5, 2, 6]), group(22, 9, [2, 2]), group(23, 23, [4])]
    d = longstraw.loss_denominator([r.numel() for _, rs, _ in groups for r in rs], "token-mean")
    cfg = longstraw.GRPOConfig(prompt_grad=prompt_grad, prefill_chunk=3, clip_ratio_c=None)
    replicas = 1 if ctx is None else ctx.dp_size
    mine = [g for i, g in enumerate(groups) if ctx is None or i % replicas == ctx.dp_rank]
    for prompt, responses, adv in mine:
        sp = longstraw.SamplingConfig(max_new_tokens=3 + len(responses), seed=len(responses), stop_token_ids=(7,))
        longstraw.generate(model, prompt, 2, sp, prefill_chunk=3)  # decoding steps differ between replicas too
        longstraw.grpo_backward(model, prompt, responses, adv, cfg, loss_scale=d / replicas)
    if ctx is not None:
        distributed.all_reduce_data_parallel(model, ctx)
    return {"grads": _grads(model), "sharded_params": sum(hasattr(p, "full_tensor") for p in model.parameters())}


def op_blocks(paths):
    """The CP attention op alone, replicated queries, the local share attended in blocks of 3 keys: output, dq,
    the causal segment's dK/dV and this rank's sinks (single process: the reference attention, autograd)."""
    from longstraw.ops.attention import KVSegment, segment_attention, segment_attention_reference

    g = torch.Generator().manual_seed(7)
    b, hq, hkv, t, s, d = 2, 4, 2, 5, 23, 8
    q = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64).requires_grad_()
    k, v = (torch.randn(1, hkv, s, d, generator=g, dtype=torch.float64) for _ in range(2))
    kc, vc = (torch.randn(b, hkv, t, d, generator=g, dtype=torch.float64).requires_grad_() for _ in range(2))
    w = torch.randn(b, hq, t, d, generator=g, dtype=torch.float64)
    ctx = distributed.cp_active()
    if ctx is None:
        k, v = k.requires_grad_(), v.requires_grad_()
        out = segment_attention_reference(q, [KVSegment(k, v), KVSegment(kc, vc, causal=True)], d**-0.5)
        (out * w).sum().backward()
        return {"out": out.detach(), "dq": q.grad, "dkc": kc.grad, "dvc": vc.grad, "dk": k.grad, "dv": v.grad,
                "positions": list(range(s))}
    lay = distributed.shard_layout(s, ctx.cp.size, 2)
    pos = [p for a, e in lay.pieces(ctx.cp.rank) for p in range(a, e)]
    kl, vl = k[:, :, pos], v[:, :, pos]
    sk, sv = torch.zeros_like(kl), torch.zeros_like(vl)
    seg = distributed.ShardedSegment(kl, vl, k_grad=sk, v_grad=sv, comm=ctx.cp, global_length=s)
    out = segment_attention(q, [seg, KVSegment(kc, vc, causal=True)], d**-0.5, max_segment=3)
    (out * w).sum().backward()
    return {"out": out.detach(), "dq": q.grad, "dkc": kc.grad, "dvc": vc.grad, "dk": sk, "dv": sv, "positions": pos}


def registered_shards(paths):
    """After every public engine call (generate with and without a kept state, score, grpo_backward, on a dense
    model and the hybrid) each of ``model.parameters()`` is the sharded DTensor the optimiser holds: no FSDP unit is
    left registered with its gathered parameters. Per family and call: the names of the parameters that are not."""
    out = {}
    for family in ("llama", "hybrid"):
        model = _load(paths[family], True)
        prompt, responses, adv = group(5, 23, [4, 1, 6])
        sp = longstraw.SamplingConfig(temperature=0.9, top_k=20, max_new_tokens=5, seed=3)
        cfg = longstraw.GRPOConfig(prefill_chunk=4, temperature=0.9)
        calls = [("generate", lambda: longstraw.generate(model, prompt, 2, sp, prefill_chunk=4)),
                 ("generate_keep", lambda: longstraw.generate(model, prompt, 2, sp, prefill_chunk=4, keep_state=True,
                                                             exact_state=True)),
                 ("score", lambda: longstraw.score(model, prompt, responses, cfg)),
                 ("grpo_backward", lambda: longstraw.grpo_backward(model, prompt, responses, adv, cfg))]
        for name, call in calls:
            call()
            out[f"{family}:{name}"] = [n for n, p in model.named_parameters() if not hasattr(p, "full_tensor")]
    return out


def offload_dcp(paths):
    """HostAdamW (AdamW's moments on the host) over FSDP shards through a sharded (DCP) checkpoint: two steps, save,
    a fresh model and optimiser loaded from it hold the same shards and moments, and one more step on each gives the
    same weights. Returns the checkpoint and the full (gathered) moments and weights for the one-process load."""
    from pathlib import Path

    from longstraw.checkpoint.training import load_sharded_state, save_sharded_checkpoint
    from longstraw.offload import HostAdamW

    ctx = distributed.get_context()
    cfg = longstraw.GRPOConfig(prefill_chunk=4)

    def made():
        model = _load(paths["llama"], True)
        return model, HostAdamW(list(model.parameters()), lr=1e-2, weight_decay=0.1)

    def step(model, opt, seed):
        prompt, responses, adv = group(seed, 19, [3, 5])
        opt.zero_grad(set_to_none=True)
        longstraw.grpo_backward(model, prompt, responses, adv, cfg)
        opt.step()

    model, opt = made()
    for seed in (5, 6):
        step(model, opt, seed)
    run = Path(paths["llama"]).with_name(Path(paths["llama"]).name + f"-offload-w{ctx.world_size}")
    ckpt = save_sharded_checkpoint(run, 2, model, opt, {"step": 2, "opt_step": 2})
    names = {p: n for n, p in model.named_parameters()}
    moments = {f"{names[p]}.{k}": _full_of(p, v) for p, st in opt.state.items() for k, v in st.items() if k != "step"}
    model2, opt2 = made()
    load_sharded_state(ckpt, model2, opt2)
    same_state = all(torch.equal(opt.state[p][k], opt2.state[q][k]) and opt2.state[q][k].device.type == "cpu"
                     for p, q in zip(model.parameters(), model2.parameters()) for k in opt.state[p])
    step(model, opt, 7)
    step(model2, opt2, 7)
    same_step = all(torch.equal(a.to_local(), b.to_local()) for a, b in zip(model.parameters(), model2.parameters()))
    return {"checkpoint": str(ckpt), "model": str(paths["llama"]), "moments": moments, "same_state": same_state, "same_step": same_step,
            "weights": {n: p.detach().full_tensor() for n, p in model.named_parameters()}}


def _full_of(param, local):
    """The full tensor of a host-held optimiser state shard of an FSDP parameter (a collective)."""
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(local.to(param.device), param.device_mesh, param.placements, run_check=False,
                              shape=param.shape, stride=param.stride()).full_tensor()


def master_weights(paths):
    """A bf16 model under FSDP2: fp32 master shards (fp32 gradients and optimiser state), bf16 compute. An SGD update
    far below bf16's resolution survives in the fp32 masters and is lost with bf16 shards (master_dtype=bf16)."""
    from longstraw.checkpoint.hf import read_config
    from longstraw.models.registry import build_model

    ctx = distributed.get_context()
    prompt, responses, adv = group(5, 23, [4, 1, 6])
    cfg = longstraw.GRPOConfig(prefill_chunk=4)

    def stepped(family: str, dtype: torch.dtype, master: torch.dtype | None, lora: bool = False, hook=None):
        """A random ``family`` model in ``dtype`` under FSDP2 with ``master`` shards (``lora``: adapters on every
        linear layer, the base frozen), after one grpo_backward; ``hook(model)`` runs before the step."""
        torch.manual_seed(0)
        model = build_model(read_config(paths[family])).to(dtype)
        if lora:
            from longstraw.models.lora import LoraSettings, add_adapters

            add_adapters(model, LoraSettings(r=2, lora_alpha=4, target_modules="all-linear"),
                         torch.Generator().manual_seed(1))
            for m in model.modules():  # B = 0 would leave the base's gradient path alone: draw it too
                if hasattr(m, "lora_B"):
                    torch.nn.init.normal_(m.lora_B.weight, std=0.1, generator=torch.Generator().manual_seed(2))
        distributed.parallelize(model, ctx, fsdp=True, master_dtype=master)
        if hook is not None:
            hook(model)
        longstraw.grpo_backward(model, prompt, responses, adv, cfg)
        return model

    out = {}
    for name, master in (("fp32", None), ("bf16", torch.bfloat16)):
        model = stepped("llama", torch.bfloat16, master)
        params = [p for p in model.parameters() if p.grad is not None]
        before = [p.detach().full_tensor().clone() for p in params]
        moved = [p.grad.full_tensor() != 0 for p in params]  # entries the update touches
        torch.optim.SGD(params, lr=1e-4).step()  # |update| ~1e-7: above fp32's resolution, far below bf16's
        after = [p.detach().full_tensor() for p in params]
        changed = sum(int(((a != b) & m).sum()) for a, b, m in zip(after, before, moved))
        out[name] = {"param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                     "grad_dtypes": sorted({str(p.grad.dtype) for p in params}),
                     "changed": changed / sum(int(m.sum()) for m in moved)}
    # a float16 DSA model keeps the indexer's weights_proj in float32 (as transformers does): with float16 masters
    # it is an FSDP2 unit of its own (a unit takes one dtype; this step once raised FSDP's AssertionError), and the
    # step's gradients are what float32 masters give, to float16 accuracy (the indexer itself gets none: its top-k
    # is not differentiable; its head weights rank the keys every layer's attention reads)
    from torch.distributed.fsdp import FSDPModule

    from longstraw.models.dsa import HeadWeights

    grads = {}
    for name, master in (("fp16_kept_fp32", None), ("fp16_kept_fp16", torch.float16)):
        model = stepped("glm_moe_dsa", torch.float16, master)
        heads = [m for m in model.modules() if isinstance(m, HeadWeights)]
        grads[name] = torch.cat([p.grad.full_tensor().float().flatten() for p in model.parameters()
                                 if p.grad is not None])
        out[name] = {"param_dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                     "head_dtypes": sorted({str(m.weight.dtype) for m in heads}),
                     "head_units": [isinstance(m, FSDPModule) for m in heads],
                     "finite": bool(grads[name].isfinite().all())}
    a, b = grads["fp16_kept_fp32"], grads["fp16_kept_fp16"]
    out["fp16_kept_grad_rel"] = float((a - b).norm() / a.norm())
    # a bf16 Ling 3.0 model keeps its short convs and forget-gate rates in float32 (transformers' strict list):
    # each owner an FSDP2 unit gathered in float32 whatever the masters (its f_proj child a bf16 unit of its own),
    # with a frozen base and LoRA too; the gathered dtypes are read by pre-forward hooks that run after FSDP's
    from longstraw.models.kda import ForgetGate
    from longstraw.models.deltanet import ShortConv

    def watch(seen):
        def hook(model):
            for m in model.modules():
                if isinstance(m, (ForgetGate, ShortConv)):
                    m.register_forward_pre_hook(lambda mod, args: seen.update(
                        (f"{type(mod).__name__.removeprefix('FSDP')}.{n}", str(p.dtype))
                        for n, p in mod.named_parameters(recurse=False)))
                    if isinstance(m, ForgetGate):
                        proj = m.f_proj
                        proj.register_forward_pre_hook(lambda mod, args: seen.update(
                            {"f_proj": str(next(p for p in mod.parameters() if p.dim() == 2).dtype)}))
        return hook

    for name, master, lora in (("ling_fp32", None, False), ("ling_bf16", torch.bfloat16, False),
                               ("ling_lora", None, True)):
        seen = {}
        model = stepped("bailing_hybrid", torch.bfloat16, master, lora, watch(seen))
        owners = [m for m in model.modules() if isinstance(m, (ForgetGate, ShortConv))]
        grads[name] = torch.cat([p.grad.full_tensor().float().flatten() for _, p in sorted(model.named_parameters())
                                 if p.grad is not None])
        out[name] = {"kept_dtypes": sorted({str(p.dtype) for m in owners for p in m.parameters(recurse=False)}),
                     "owner_units": sorted({isinstance(m, FSDPModule) for m in owners}),
                     "gathered": seen, "finite": bool(grads[name].isfinite().all())}
    a, b = grads["ling_fp32"], grads["ling_bf16"]
    out["ling_grad_rel"] = float((a - b).norm() / a.norm())
    # an fp16 GPT-OSS model keeps its RMSNorm weights in float32 (transformers' fp16-only list), the final norm
    # (outside every layer) included: each a unit of its own, gathered in float32, with float16 masters
    from longstraw.models.norms import RMSNorm

    norms_seen = {}

    def watch_norms(model):
        for name, m in model.named_modules():
            if isinstance(m, RMSNorm):
                m.register_forward_pre_hook(
                    lambda mod, args, name=name: norms_seen.update({name: str(mod.weight.dtype)}))

    model = stepped("gpt_oss", torch.float16, torch.float16, hook=watch_norms)
    norms = [m for n, m in model.named_modules() if n in norms_seen]
    out["gpt_oss_fp16"] = {"gathered": sorted(set(norms_seen.values())), "count": len(norms_seen),
                           "units": sorted({isinstance(m, FSDPModule) for m in norms}),
                           "weights": sorted({str(p.dtype) for m in norms for p in m.parameters()}),
                           "finite": all(p.grad.full_tensor().isfinite().all().item() for p in model.parameters()
                                         if p.grad is not None)}
    return out


SCENARIOS = {
    "exact": lambda p: grpo_two_groups(p),
    "detached": lambda p: grpo_two_groups(p, prompt_grad="detached"),
    "exact_fsdp": lambda p: grpo_two_groups(p, fsdp=True),
    "detached_fsdp": lambda p: grpo_two_groups(p, prompt_grad="detached", fsdp=True),
    "qwen3_exact_ckpt": lambda p: grpo_two_groups(p, family="qwen3", chunk=4, branch_batch=2,
                                                  checkpoint_layers=True),
    "qwen3_exact_fsdp": lambda p: grpo_two_groups(p, family="qwen3", chunk=5, fsdp=True),
    "hybrid_exact": lambda p: grpo_two_groups(p, family="hybrid", chunk=3),
    "hybrid_exact_offload": lambda p: grpo_two_groups(p, family="hybrid", chunk=3, offload=True),
    "exact_state_offload": lambda p: grpo_two_groups(p, chunk=3, state_offload=True),
    "hybrid_exact_state_offload": lambda p: grpo_two_groups(p, family="hybrid", chunk=3, offload=True,
                                                            state_offload=True),
    "hybrid_detached_state_offload": lambda p: grpo_two_groups(p, family="hybrid", prompt_grad="detached",
                                                               chunk=4, state_offload=True),
    "hybrid_detached": lambda p: grpo_two_groups(p, family="hybrid", prompt_grad="detached", chunk=4),
    # only the attention's queries trained: the DeltaNet layer below them has nothing to differentiate on CP rank 0
    "hybrid_exact_q_only": lambda p: grpo_two_groups(p, family="hybrid", train_only="q_proj"),
    "hybrid_exact_fsdp_ckpt": lambda p: grpo_two_groups(p, family="hybrid", chunk=5, fsdp=True, branch_batch=2,
                                                        checkpoint_layers=True),
    "hybrid_generate": lambda p: generate(p, family="hybrid"),
    "score": lambda p: score(p),
    "generate": lambda p: generate(p),
    "generate_fsdp": lambda p: generate(p, fsdp=True),
    "state_bytes": lambda p: state_bytes(p),
    "bad_inputs": lambda p: bad_inputs(p),
    "dp_sum": lambda p: dp_sum(p),
    "dp_sum_fsdp": lambda p: dp_sum(p, fsdp=True),
    "hybrid_dp_sum_fsdp": lambda p: dp_sum(p, family="hybrid", fsdp=True),
    "v3_dp_sum_fsdp": lambda p: dp_sum(p, family="deepseek_v3", prompt_grad="detached", fsdp=True),
    "next_dp_sum_q_only": lambda p: dp_sum(p, family="qwen3_next", fsdp=True, train_only="q_proj"),
    "hybrid_dp_sum_q_only": lambda p: dp_sum(p, family="hybrid", fsdp=True, train_only="q_proj"),
    "fp32_exact": lambda p: grpo_two_groups(p, dtype="float32"),
    "bf16_exact": lambda p: grpo_two_groups(p, dtype="bfloat16", chunk=4),
    "hybrid_fp32_exact": lambda p: grpo_two_groups(p, family="hybrid", dtype="float32"),
    "master_weights": lambda p: master_weights(p),
    "registered_shards": registered_shards,
    "offload_dcp": offload_dcp,
    "op_blocks": lambda p: op_blocks(p),
    "low_precision": lambda p: low_precision(p),
    "hybrid_dp_sum_detached": lambda p: dp_sum(p, family="hybrid", prompt_grad="detached"),
    # MoE families: MLA latents (deepseek_v3), MLA + sparse indexer (glm_moe_dsa with a shared indexer layer,
    # deepseek_v32), GQA + MoE (glm4_moe, qwen3_moe, mixtral), hybrid DeltaNet + MoE (qwen3_next, qwen3_5_moe_text)
    "v3_exact": lambda p: grpo_two_groups(p, family="deepseek_v3"),
    "v3_detached": lambda p: grpo_two_groups(p, family="deepseek_v3", prompt_grad="detached", branch_batch=2),
    "v3_exact_decompressed": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=5, mla_mode="decompressed"),
    "v3_exact_fsdp": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=4, fsdp=True),
    "v3_generate": lambda p: generate(p, family="deepseek_v3"),
    "v3_state_bytes": lambda p: state_bytes(p, family="deepseek_v3"),
    "dsa_exact": lambda p: grpo_two_groups(p, family="glm_moe_dsa"),
    "dsa_exact_offload": lambda p: grpo_two_groups(p, family="glm_moe_dsa", offload=True),
    "dsa_detached": lambda p: grpo_two_groups(p, family="glm_moe_dsa", prompt_grad="detached", chunk=4),
    "dsa_exact_fsdp_ckpt": lambda p: grpo_two_groups(p, family="glm_moe_dsa", chunk=2, fsdp=True, branch_batch=2,
                                                     checkpoint_layers=True),
    "dsa_generate": lambda p: generate(p, family="glm_moe_dsa"),
    "dsa_score": lambda p: score(p, family="glm_moe_dsa"),
    "dsa_state_bytes": lambda p: state_bytes(p, family="glm_moe_dsa"),
    # every replicated DSA selection (replay, score, decoding) on the ring path that large calls take
    "dsa_ring_exact": lambda p: _ring_selection(lambda: grpo_two_groups(p, family="glm_moe_dsa", branch_batch=2)),
    "dsa_ring_score": lambda p: _ring_selection(lambda: score(p, family="glm_moe_dsa")),
    "dsa_ring_generate": lambda p: _ring_selection(lambda: generate(p, family="glm_moe_dsa")),
    "v32_exact": lambda p: grpo_two_groups(p, family="deepseek_v32", chunk=4),
    # MLA forms forced under CP (the decompressed CP twin, the absorbed CP path), against one process forced alike
    "v3_exact_absorbed": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=5, mla_mode="absorbed"),
    "v3_detached_decompressed": lambda p: grpo_two_groups(p, family="deepseek_v3", prompt_grad="detached",
                                                          branch_batch=2, mla_mode="decompressed"),
    "v3_exact_fsdp_decompressed": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=4, fsdp=True,
                                                            mla_mode="decompressed"),
    "v3_exact_ckpt_decompressed": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=2, branch_batch=2,
                                                            checkpoint_layers=True, mla_mode="decompressed"),
    "v3_decompressed_score": lambda p: score(p, family="deepseek_v3", mla_mode="decompressed"),
    "v3_absorbed_score": lambda p: score(p, family="deepseek_v3", mla_mode="absorbed"),
    "v3_decompressed_generate": lambda p: generate(p, family="deepseek_v3", mla_mode="decompressed"),
    "dsa_exact_decompressed": lambda p: grpo_two_groups(p, family="glm_moe_dsa", mla_mode="decompressed"),
    "dsa_exact_decompressed_offload": lambda p: grpo_two_groups(p, family="glm_moe_dsa", mla_mode="decompressed",
                                                                offload=True),
    "dsa_exact_absorbed": lambda p: grpo_two_groups(p, family="glm_moe_dsa", mla_mode="absorbed"),
    "dsa_decompressed_score": lambda p: score(p, family="glm_moe_dsa", mla_mode="decompressed"),
    "v32_exact_decompressed": lambda p: grpo_two_groups(p, family="deepseek_v32", chunk=4, mla_mode="decompressed"),
    "glm4_moe_exact": lambda p: grpo_two_groups(p, family="glm4_moe"),
    "glm4_moe_detached": lambda p: grpo_two_groups(p, family="glm4_moe", prompt_grad="detached"),
    "next_exact": lambda p: grpo_two_groups(p, family="qwen3_next"),
    "next_detached": lambda p: grpo_two_groups(p, family="qwen3_next", prompt_grad="detached", chunk=4),
    "q35moe_exact": lambda p: grpo_two_groups(p, family="qwen3_5_moe_text", chunk=4),
    "q35moe_detached": lambda p: grpo_two_groups(p, family="qwen3_5_moe_text", prompt_grad="detached"),
    # frozen but the top layer's queries: under EP no MoE layer has a gradient to compute on CP rank 0's piece, the
    # other rank's experts still need it to run their backward (and its all-to-alls)
    "next_exact_q_only": lambda p: grpo_two_groups(p, family="qwen3_next", train_only="q_proj"),
    "q35moe_exact_q_only": lambda p: grpo_two_groups(p, family="qwen3_5_moe_text", train_only="q_proj"),
    "v3_exact_kept_top_only": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=4, graph_budget=1 << 30,
                                                        train_only="layers.2.self_attn"),
    # GQA + softmax-routed MoE: Qwen3-MoE (a dense layer between sparse ones), Mixtral (float32 routing weights)
    "q3moe_exact": lambda p: grpo_two_groups(p, family="qwen3_moe"),
    "q3moe_detached": lambda p: grpo_two_groups(p, family="qwen3_moe", prompt_grad="detached", branch_batch=2),
    "mixtral_exact": lambda p: grpo_two_groups(p, family="mixtral", chunk=4),
    "mixtral_detached": lambda p: grpo_two_groups(p, family="mixtral", prompt_grad="detached"),
    "minimax_exact": lambda p: grpo_two_groups(p, family="minimax_m2", branch_batch=2),
    "olmoe_detached": lambda p: grpo_two_groups(p, family="olmoe", prompt_grad="detached"),
    "gemma3_exact": lambda p: grpo_two_groups(p, family="gemma3", chunk=4),
    # kept prompt-step graphs under CP (a graph budget: every step's, or a step and the top layer of the next)
    "kept_exact": lambda p: grpo_two_groups(p, graph_budget=1 << 30),
    "kept_split": lambda p: grpo_two_groups(p, family="gemma3_w5", chunk=2, graph_budget=_split_budget(p)),
    "w5_exact_kept": lambda p: grpo_two_groups(p, family="gemma3_w5", chunk=2, graph_budget=1 << 30),
    "gpt_oss_exact_kept": lambda p: grpo_two_groups(p, family="gpt_oss", graph_budget=1 << 30),
    "v3_exact_kept": lambda p: grpo_two_groups(p, family="deepseek_v3", chunk=4, graph_budget=1 << 30),
    "dsa_exact_kept": lambda p: grpo_two_groups(p, family="glm_moe_dsa", graph_budget=1 << 30),
    "hybrid_kept_refused": lambda p: kept_refused(p),
    # the DeltaNet state scan with kept graphs (every step, the first included: a kept step's initial state is a
    # gradient leaf), whole steps and split ones, the frozen-bottom case, and the hybrid MoE (EP jobs)
    "hybrid_exact_kept": lambda p: grpo_two_groups(p, family="hybrid", graph_budget=1 << 30),
    "hybrid_kept_split": lambda p: grpo_two_groups(p, family="hybrid", chunk=2,
                                                   graph_budget=_split_budget(p, "hybrid")),
    "hybrid_exact_kept_q_only": lambda p: grpo_two_groups(p, family="hybrid", graph_budget=1 << 30,
                                                          train_only="q_proj"),
    "next_exact_kept": lambda p: grpo_two_groups(p, family="qwen3_next", graph_budget=1 << 30),
    # past the window (distributed/cp_window.py): Gemma 3 with a window of 5, GPT-OSS (sinks, windows of 4)
    "w5_exact": lambda p: grpo_two_groups(p, family="gemma3_w5"),
    "w5_exact_c1": lambda p: grpo_two_groups(p, family="gemma3_w5", chunk=1),  # 1-token pieces
    "w5_detached": lambda p: grpo_two_groups(p, family="gemma3_w5", prompt_grad="detached", chunk=2),
    "w5_exact_ckpt": lambda p: grpo_two_groups(p, family="gemma3_w5", chunk=4, branch_batch=2,
                                               checkpoint_layers=True),
    "w5_exact_offload": lambda p: grpo_two_groups(p, family="gemma3_w5", offload=True),
    "w5_exact_state_offload": lambda p: grpo_two_groups(p, family="gemma3_w5", state_offload=True),
    "w5_score": lambda p: score(p, family="gemma3_w5"),
    "w5_generate": lambda p: generate(p, family="gemma3_w5"),
    "w5_state_bytes": lambda p: window_state_bytes(p),
    "w5_exact_state_bytes": lambda p: window_state_bytes(p, exact=True),
    "gpt_oss_exact": lambda p: grpo_two_groups(p, family="gpt_oss"),
    "gpt_oss_detached": lambda p: grpo_two_groups(p, family="gpt_oss", prompt_grad="detached", branch_batch=2),
    "gpt_oss_exact_fsdp": lambda p: grpo_two_groups(p, family="gpt_oss", chunk=2, fsdp=True),
    "gpt_oss_score": lambda p: score(p, family="gpt_oss"),
    "gpt_oss_generate": lambda p: generate(p, family="gpt_oss"),
    # GLM-4.7-Flash (glm4_moe_lite): DeepSeek-V3's MLA with GLM's MoE, both MLA forms
    "lite_exact": lambda p: grpo_two_groups(p, family="glm4_moe_lite", mla_mode="absorbed"),
    "lite_detached": lambda p: grpo_two_groups(p, family="glm4_moe_lite", prompt_grad="detached",
                                               mla_mode="decompressed"),
    # Kimi-Linear (kimi_linear): KDA layers (the delta rule with a decay per key channel, on the DeltaNet state
    # scan), NoPE MLA (latents sharded), sigmoid-routed MoE; both MLA forms
    "kimi_exact": lambda p: grpo_two_groups(p, family="kimi_linear", mla_mode="absorbed"),
    "kimi_detached": lambda p: grpo_two_groups(p, family="kimi_linear", prompt_grad="detached", chunk=4,
                                               branch_batch=2, mla_mode="decompressed"),
    "kimi_generate": lambda p: generate(p, family="kimi_linear"),
    "kimi_state_bytes": lambda p: state_bytes(p, family="kimi_linear"),
    "kimi_exact_kept": lambda p: grpo_two_groups(p, family="kimi_linear", graph_budget=1 << 30),
    # frozen but the top attention's queries, as next_exact_q_only: the MLA layer's (layer 2 of KDA, KDA, MLA, KDA;
    # "q_proj" alone would train every KDA layer's queries too): the KDA layers below have nothing to differentiate,
    # the frozen KDA layer above scans its state's gradient back to the prompt's MLA outputs
    "kimi_exact_q_only": lambda p: grpo_two_groups(p, family="kimi_linear",
                                                   train_only="layers.2.self_attn.q_proj"),
    # Ling 3.0 (bailing_hybrid): KDA with full-rank, bounded gates (the DeltaNet state scan), MLA with RoPE and a
    # head gate (latents sharded), sigmoid-routed MoE; both MLA forms
    "ling_exact": lambda p: grpo_two_groups(p, family="bailing_hybrid", mla_mode="absorbed"),
    "ling_detached": lambda p: grpo_two_groups(p, family="bailing_hybrid", prompt_grad="detached", chunk=4,
                                               branch_batch=2, mla_mode="decompressed"),
    "ling_generate": lambda p: generate(p, family="bailing_hybrid"),
}


# expert parallelism (init_distributed(ep=E)): the gradient scenarios above run unchanged on EP jobs; these check
# what is EP's own
def ep_init_errors(cp: int, ep: int) -> dict:
    """init_distributed's one-line errors for EP combinations it rejects (before any process group exists)."""
    out = {}
    for key, kw in {"ep_no_fsdp": dict(fsdp=False, ep=ep), "ep_zero": dict(fsdp=True, ep=0),
                    "ep_not_dividing": dict(fsdp=True, ep=3)}.items():
        try:
            longstraw.init_distributed(cp=cp, **kw)
            out[key] = "no error"
            longstraw.shutdown_distributed()
        except ValueError as e:
            out[key] = str(e)
    return out


def _expert_modules(model):
    """The routed-experts modules (``Experts``, GPT-OSS's: whatever expert parallelism splits)."""
    return [(n, m) for n, m in model.named_modules() if hasattr(m, "ep_tensor_names")]


def ep_experts(paths, *, family="deepseek_v3"):
    """Routed-expert bytes this rank holds and the values of its experts as loaded (each rank reads its rows):
    ``weights`` ``{name: (first row of the full tensor, this rank's rows)}`` (with FSDP over edp its shard of its
    EP block)."""
    from longstraw.distributed.fsdp import local_rows

    model = longstraw.load_model(paths[family])
    mods = _expert_modules(model)

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    def first(m, t):
        return getattr(m, "first", 0) + ((local_rows(t) or (0, 0))[0])

    nbytes = sum(local(getattr(m, k)).numel() * getattr(m, k).element_size() for _, m in mods
                 for k in m.ep_tensor_names)
    other = sum(local(t).numel() * t.element_size() for t in model.parameters()) - nbytes
    return {"expert_bytes": nbytes, "first": [getattr(m, "first", 0) for _, m in mods],
            "weights": {f"{n}.{k}": (first(m, getattr(m, k)), local(getattr(m, k)).detach().clone()) for n, m in mods
                        for k in m.ep_tensor_names}, "other_bytes": other,
            "sharded_edp": [bool(getattr(m, "shard_edp", False)) for _, m in mods]}


def ep_save(paths, *, family="deepseek_v3"):
    """save_model of an EP model (every rank joins), read back with safetensors: the checkpoint's tensors; the
    experts are written by ranks that hold them (no all-gather over the EP group: counted)."""
    import os
    from pathlib import Path

    import torch.distributed as dist
    from safetensors.torch import load_file

    model = longstraw.load_model(paths[family])
    ctx = distributed.get_context()
    out = Path(paths[family]).parent / f"ep_saved_{ctx.world_size if ctx else 1}_{family}"
    from longstraw.distributed.context import Comm

    gathers, real = [], Comm.all_gather
    Comm.all_gather = lambda self, *a, **k: (gathers.append(self.size), real(self, *a, **k))[1]
    try:
        longstraw.save_model(model, out, max_shard_size="20KB")
    finally:
        Comm.all_gather = real
    if ctx is not None:
        dist.barrier()
    saved, orig = {}, {}
    for f in sorted(os.listdir(out)):
        if f.endswith(".safetensors"):
            saved.update(load_file(out / f))
    for f in sorted(os.listdir(paths[family])):
        if f.endswith(".safetensors"):
            orig.update(load_file(Path(paths[family]) / f))
    same = set(saved) == set(orig) and all(torch.equal(saved[k], orig[k].to(saved[k].dtype)) for k in orig)
    return {"same": same, "missing": sorted(set(orig) - set(saved))[:5], "extra": sorted(set(saved) - set(orig))[:5],
            "comm_gathers": len(gathers)}


SCENARIOS.update({
    "ep_experts": ep_experts,
    "ep_save": ep_save,
    "gpt_oss_ep_experts": lambda p: ep_experts(p, family="gpt_oss"),
    "gpt_oss_ep_save": lambda p: ep_save(p, family="gpt_oss"),
    # 6 experts: blocks of 3 over 2 edp ranks are FSDP chunks of 2 and 1 rows
    "minimax_ep_experts": lambda p: ep_experts(p, family="minimax_m2"),
    "minimax_ep_save": lambda p: ep_save(p, family="minimax_m2"),
    "dsa_exact_ckpt": lambda p: grpo_two_groups(p, family="glm_moe_dsa", chunk=2, branch_batch=2,
                                                checkpoint_layers=True),
})
