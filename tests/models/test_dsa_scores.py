"""The DSA indexer's head-score GEMM on CUDA bf16/fp16 (model dtype, float32 accumulation and result) against the
float32 path that CPU runs: same scores up to accumulation order. ``torch.bmm(..., out_dtype=float32)`` has CUDA
and meta kernels only, so on CPU it is emulated here by an exact float32 bmm of the (exactly representable)
bf16 operands, and the real call is held to its schema on meta."""

import torch

from longstraw.models import dsa


def _indexer(heads=4, dim=16):
    torch.manual_seed(0)
    return dsa.Indexer(hidden=32, q_lora_rank=24, num_heads=heads, head_dim=dim, rope_dim=8, topk=5, interleaved=False)


def test_low_precision_head_scores_on_meta_are_float32():
    qb = torch.empty(2, 3, 4, 16, device="meta", dtype=torch.bfloat16)
    k = torch.empty(1, 7, 16, device="meta", dtype=torch.bfloat16)
    hs = dsa._head_scores_low_precision(qb, k)
    assert hs.shape == (2, 3, 4, 7) and hs.dtype == torch.float32


def test_only_cuda_bf16_fp16_keys_take_the_low_precision_gemm():
    assert not dsa.low_precision_scores(torch.zeros(1, 2, 3, dtype=torch.bfloat16))  # CPU: float32 as upstream
    assert not dsa.low_precision_scores(torch.empty(1, 2, 3, device="meta", dtype=torch.bfloat16))  # planner


def test_bf16_scores_match_the_float32_path(monkeypatch):
    ix = _indexer()
    g = torch.Generator().manual_seed(1)
    q = torch.randn(2, 5, 4, 16, generator=g).to(torch.bfloat16)  # what the bf16 projections give
    w = torch.randn(2, 5, 4, generator=g)  # float32 head weights (score dtype)
    keys = [torch.randn(1, 9, 16, generator=g).to(torch.bfloat16),
            torch.randn(2, 5, 16, generator=g).to(torch.bfloat16)]
    want = ix.scores(q.float(), w, keys)  # the CPU path: float32 matmuls
    real_bmm = torch.bmm

    def bmm(a, b, out_dtype=None):  # CPU stand-in for the CUDA kernel: float32 accumulation of bf16 operands
        assert out_dtype == torch.float32 and a.dtype == b.dtype == torch.bfloat16
        return real_bmm(a.float(), b.float())

    monkeypatch.setattr(dsa, "low_precision_scores", lambda k: k.dtype == torch.bfloat16)
    monkeypatch.setattr(torch, "bmm", bmm)
    got = ix.scores(q, w, keys)
    assert got.dtype == torch.float32 and got.shape == (2, 5, 14)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    got32 = ix.scores(q.float(), w, keys)  # a caller that already cast the queries (cp_latent) gets the same
    torch.testing.assert_close(got32, got, rtol=0, atol=0)


def test_a_selection_is_kept_through_the_call_only_for_a_layer_that_shares_it():
    """GLM-5's shared layers read their full layer's top-k selection from the call's scratch (``ctx.shared``): the
    builder marks those full layers, and only they leave it there. With every layer full (GLM-5's and DeepSeek-V3.2's
    published configs) a call holds no layer's selection beyond that layer: the no-grad prefill's peak no longer grows
    by ``T x index_topk x 9`` bytes per layer."""
    import longstraw
    from longstraw.engine.config import GRPOConfig
    from longstraw.engine.grpo import build_prompt_state
    from longstraw.planner import LiveBytes

    cfg = {"model_type": "glm_moe_dsa", "vocab_size": 97, "hidden_size": 32, "intermediate_size": 40,
           "moe_intermediate_size": 8, "num_attention_heads": 4, "num_key_value_heads": 4, "n_routed_experts": 4,
           "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
           "n_shared_experts": 1, "kv_lora_rank": 12, "qk_rope_head_dim": 4, "qk_nope_head_dim": 6, "v_head_dim": 5,
           "q_lora_rank": 10, "index_head_dim": 8, "index_n_heads": 4, "index_topk": 16,
           "max_position_embeddings": 8192}
    shared = longstraw.build_model({**cfg, "num_hidden_layers": 4, "indexer_types": ["full", "shared", "full",
                                                                                      "full"]})
    assert [layer.mixer.keeps_selection for layer in shared.layers] == [True, False, False, False]

    def prefill_peak(n: int) -> int:
        with torch.device("meta"):
            model = longstraw.build_model({**cfg, "num_hidden_layers": n, "indexer_types": ["full"] * n})
        lb = LiveBytes()
        with lb:
            state = build_prompt_state(model, torch.zeros(1025, dtype=torch.long, device="meta"),
                                       GRPOConfig(prompt_grad="detached", prefill_chunk=512), False)
            held = state.nbytes()
        return lb.peak - held  # the transient above the prompt state

    small, large = prefill_peak(2), prefill_peak(8)
    # the 6 more layers add their share of the state's last-step slack (512 positions x 96 bytes each), and kept
    # selections (512 x 16 x 9 bytes each) would add more than that again: 737,280 bytes kept, 294,912 now
    assert large - small < (8 - 2) * 512 * 16 * 9
