"""The planner's speed machinery changes no tracked byte: each shortcut is held to the dry run without it, op by op
where it can be (the live bytes after every op), else plan for plan."""

import pytest
import torch

from longstraw import GRPOConfig
from longstraw.planner import plan

DENSE = {"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 4, "vocab_size": 512, "max_position_embeddings": 20000}
GLM_DSA = {"model_type": "glm_moe_dsa", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 40,
           "moe_intermediate_size": 8, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
           "n_routed_experts": 4, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1,
           "topk_group": 1, "n_shared_experts": 1, "kv_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6,
           "v_head_dim": 5, "q_lora_rank": 10, "index_head_dim": 8, "index_n_heads": 4, "index_topk": 16,
           "indexer_types": ["full", "shared", "full"], "max_position_embeddings": 4096}


def _hybrid():
    from longstraw.models.qwen_hybrid import tiny_config

    return {**tiny_config(), "num_hidden_layers": 8, "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 2}


def _trace(monkeypatch) -> list:
    """Record every dry-run op's (name, live bytes, peak) from now on, in the list returned."""
    import longstraw.planner as planner

    trace = []
    real = planner.LiveBytes.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        out = real(self, func, types, args, kwargs)
        trace.append((str(func), self.live, self.peak))
        return out

    monkeypatch.setattr(planner.LiveBytes, "__torch_dispatch__", dispatch)
    return trace


@pytest.mark.parametrize("name", ["dense", "hybrid", "glm_dsa"])
def test_memoised_meta_kernels_change_no_tracked_byte(monkeypatch, name):
    """``LiveBytes`` memoises the meta kernels' output layouts (``planner.MEMO_OPS``): plans of a dense model, a
    DeltaNet/attention hybrid and a GLM-5-style MLA + DSA + MoE model, detached and exact (checkpointed layers, a
    LoRA plan, a memory limit that makes the planner search ``max_prompt_len``), allocate the very same storages op
    for op with the memo on and off (every op's live bytes and peak), and most ops were answered from the memo."""
    import longstraw.planner as planner

    cfg = {"dense": DENSE, "hybrid": _hybrid(), "glm_dsa": GLM_DSA}[name]
    cfg = {**cfg, "max_position_embeddings": 1024}  # the max_prompt_len search: dry runs below 1024 positions
    base = dict(prompt_len=700, response_len=8, group=2, dtype="float32")
    kws = [dict(base, cfg=GRPOConfig(prompt_grad="detached", prefill_chunk=256)),
           dict(base, cfg=GRPOConfig(prompt_grad="exact", prefill_chunk=256, checkpoint_layers=True),
                lora={"rank": 4, "alpha": 8, "target_modules": "all-linear"}, gpu_mem=64 << 20),
           dict(base, cfg=GRPOConfig(prompt_grad="exact", prefill_chunk=512), dtype="bfloat16")]
    monkeypatch.setattr(planner, "_MEMO", {})
    hits = []
    replay = planner.LiveBytes._replay

    def counted(self, func, args, kwargs):
        key, out = replay(self, func, args, kwargs)
        hits.append(out is not None)
        return key, out

    monkeypatch.setattr(planner.LiveBytes, "_replay", counted)
    trace = _trace(monkeypatch)

    def plans():
        trace.clear()
        return [(p.peak_bytes, p.breakdown, p.max_prompt_len) for p in (plan(cfg, **kw) for kw in kws)], list(trace)

    fast, fast_trace = plans()
    assert sum(hits) > len(hits) / 4  # the memo answered
    monkeypatch.setattr(planner, "MEMO_OPS", False)
    full, full_trace = plans()
    assert len(fast_trace) == len(full_trace) and fast_trace == full_trace
    assert fast == full


def test_memo_keys_tell_apart_what_meta_kernels_read():
    """Two calls share a memo entry only when a meta kernel cannot tell them apart: a scalar's type (``1``, ``1.0``,
    ``True`` promote differently), a tensor's strides and storage offset, its dtype, conjugate bit."""
    from longstraw.planner import _op_key

    x = torch.empty(4, 6, device="meta")
    keys = [_op_key((x, 1)), _op_key((x, 1.0)), _op_key((x, True)), _op_key((x.t(),)), _op_key((x[1:],)),
            _op_key((x.double(),)), _op_key((x,)), _op_key((torch.empty(4, 6, device="meta", dtype=torch.cfloat),)),
            _op_key((torch.empty(4, 6, device="meta", dtype=torch.cfloat).conj(),)), _op_key(([x, x],)),
            _op_key(((x, x),))]
    assert len(set(keys)) == len(keys)
    assert _op_key((x, 1)) == _op_key((torch.empty(4, 6, device="meta"), 1))
    assert _op_key((torch._neg_view(x),)) != _op_key((x,))  # the negative bit, on a real tensor too


@pytest.mark.parametrize("shape", ["linear", "quadratic", "kinked", "steps"])
@pytest.mark.parametrize("limit", [150.0, 1e3, 3.3e4])
def test_max_len_search_brackets_the_longest_fitting_prompt_to_one_percent(shape, limit):
    """_solve_max_len below the line: the answer fits, and the true longest fitting length lies less than 1% (or
    one token) above it, for peaks of several shapes (straight, curved, kinked, stepped), with no more dry runs
    than a bisection."""
    from longstraw.planner import _solve_max_len

    t = 16384
    peaks = {"linear": lambda x: 100 + 3 * x, "quadratic": lambda x: 100 + x * x / 50,
             "kinked": lambda x: 100 + (x if x < 3000 else 3000 + 40 * (x - 3000)),
             "steps": lambda x: 100 + 4096 * (x // 4096) + x / 8}
    f = peaks[shape]
    calls = []

    def peak_at(x):
        calls.append(x)
        return f(x)

    got = _solve_max_len(peak_at, limit, t, 1 << 22, known=(1 << 21, f(1 << 21)))
    if f(2) > limit:
        assert got == 0
        return
    truth = max(x for x in range(2, 2 * t + 1) if f(x) <= limit)
    assert f(got) <= limit and got <= truth < got + max(1, got // 100), (got, truth)
    # besides the line's t and 2t, lo and hi: no more dry runs than a bisection to 1% (~13-15 here)
    assert len(calls) - 4 <= 14, calls


def _plans_equal_without_shortcuts(monkeypatch, cfg: dict, min_skips: int) -> None:
    """Detached and exact plans of ``cfg`` are byte-equal with ``ops/meta.py``'s block shortcuts on and off, and
    ``skip_repeated_block`` skipped more than ``min_skips`` blocks (so the comparison covered the shortcut)."""
    from longstraw.ops import meta

    def plans():
        return [plan(cfg, prompt_len=1100, response_len=8, group=2, dtype="float32",
                     cfg=GRPOConfig(prompt_grad=m, prefill_chunk=512)).breakdown for m in ("detached", "exact")]

    calls = []
    real = meta.skip_repeated_block
    monkeypatch.setattr(meta, "skip_repeated_block", lambda *a: calls.append(real(*a)) or calls[-1])
    fast = plans()
    assert sum(calls) > min_skips  # the shortcut did skip blocks
    monkeypatch.setattr(meta, "SHORTCUTS", False)
    assert plans() == fast


def test_dsa_meta_shortcut_changes_no_tracked_byte(monkeypatch):
    """The DSA indexer's and the sparse attention's repeated blocks on meta (ops/meta.py ``skip_repeated_block``):
    plans of a GLM-5-style model (full and shared indexer layers) with many query blocks and key chunks (small
    score and gather budgets) are byte-equal with the shortcut on and off, detached and exact."""
    from longstraw.models import dsa
    from longstraw.ops import sparse_attention

    monkeypatch.setattr(dsa, "SCORE_ELEMS", 1 << 14)  # ~30 query blocks of ~4 key chunks per layer call
    monkeypatch.setattr(sparse_attention, "GATHER_ELEMS", 1 << 12)  # ~8 query blocks per sparse attention call
    _plans_equal_without_shortcuts(monkeypatch, GLM_DSA, 50)


def test_mla_decompressed_chunk_shortcut_changes_no_byte(monkeypatch):
    """The decompressed MLA form's chunk loop (``models/mla.py``: forward and backward expand ``chunk`` stored
    positions at a time; on meta only the first and the last chunk run): plans of a DeepSeek-V3-style model whose
    prefill chunks decompress (the FLOP rule picks that form) over many chunks are byte-equal with the shortcut on
    and off, detached and exact."""
    from longstraw.models import mla

    cfg = {k: v for k, v in GLM_DSA.items() if not k.startswith(("index", "indexer"))}
    cfg["model_type"] = "deepseek_v3"
    monkeypatch.setattr(mla, "_DECOMPRESS_ELEMS", 1)  # 64 stored positions per chunk: ~17 chunks per call
    _plans_equal_without_shortcuts(monkeypatch, cfg, 20)


@pytest.mark.parametrize("name", ["dense", "hybrid", "mla", "glm_dsa"])
def test_prefill_step_shortcut_changes_no_planned_byte(monkeypatch, name):
    """The dry run's prefill runs only the steps that can set its peak (``ops/meta.py``: the first two and the last
    two; the others store replicas of the last run step's pieces): detached and exact plans (checkpointed layers,
    LoRA, a short last chunk, a ``max_prompt_len`` search), direct and on the long-prompt line (its first point
    dry-runs the prefill alone), are byte-equal with the shortcuts on and off, and steps were skipped."""
    import longstraw.planner as planner
    from longstraw.ops import meta

    mla = {k: v for k, v in GLM_DSA.items() if not k.startswith(("index", "indexer"))} | {"model_type": "deepseek_v3"}
    cfg = {"dense": DENSE, "hybrid": _hybrid(), "mla": mla, "glm_dsa": GLM_DSA}[name]
    cfg = {**cfg, "max_position_embeddings": 4000}
    monkeypatch.setattr(planner, "_ATTN_BLOCK", 1024)  # the line from 2 x 1,280 positions: 10 prefill steps
    base = dict(response_len=8, group=2, dtype="float32")
    kws = [dict(base, prompt_len=2000, cfg=GRPOConfig(prompt_grad="detached", prefill_chunk=256)),
           dict(base, prompt_len=3000, cfg=GRPOConfig(prompt_grad="exact", prefill_chunk=256)),
           dict(base, prompt_len=3000, cfg=GRPOConfig(prompt_grad="exact", prefill_chunk=256, checkpoint_layers=True),
                lora={"rank": 4, "alpha": 8, "target_modules": "all-linear"}, gpu_mem=48 << 20)]
    calls = []
    real = meta.replicate
    monkeypatch.setattr(meta, "replicate", lambda spec: calls.append(1) or real(spec))

    def plans():
        return [(p.peak_bytes, p.breakdown, p.max_prompt_len) for p in (plan(cfg, **kw) for kw in kws)]

    fast = plans()
    assert len(calls) > 10  # the shortcut did skip steps
    monkeypatch.setattr(meta, "SHORTCUTS", False)
    assert plans() == fast
