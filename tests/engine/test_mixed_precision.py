"""Mixed precision in one process: float32 master weights, gradients and AdamW moments, bf16 compute
(``CausalLM.use_master_weights``). Under FSDP2 the same split is FSDP's MixedPrecisionPolicy
(tests/distributed: master_weights)."""

import pytest
import torch
from hf_reference import save_tiny, tiny_hf
from transformers import LlamaConfig

import longstraw

V = 97
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def path():
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=V, max_position_embeddings=256)
    return save_tiny(tiny_hf(cfg, seed=3, dtype=torch.float32, init_std=0.05), dtype=torch.float32)


def _groups():
    g = torch.Generator().manual_seed(0)
    return [(torch.randint(0, V, (60,), generator=g), [torch.randint(0, V, (n,), generator=g) for n in (5, 7, 3)],
             torch.tensor([1.0, -0.5, -0.5])) for _ in range(2)]


def _train(model, steps=6, lr=3e-4):
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    cfg = longstraw.GRPOConfig(prefill_chunk=16, clip_ratio_c=None)
    losses = []
    for step in range(steps):
        prompt, responses, adv = _groups()[step % 2]
        opt.zero_grad(set_to_none=True)
        losses.append(longstraw.grpo_backward(model, prompt, responses, adv, cfg).loss)
        opt.step()
    return losses


def _flat(model):
    return torch.cat([p.detach().double().flatten() for p in model.parameters()])


def test_master_weights_keep_float32_state_and_track_the_float32_run(path):
    ref = longstraw.load_model(path, dtype="float32")
    mixed = longstraw.load_model(path, dtype="bfloat16")
    mixed.use_master_weights(torch.bfloat16)
    plain = longstraw.load_model(path, dtype="bfloat16")  # bf16 weights, gradients and moments
    assert {p.dtype for p in mixed.parameters()} == {torch.float32} and mixed.compute_dtype == torch.bfloat16
    want, got, _ = _train(ref), _train(mixed), _train(plain)  # plain: trained for its drift below
    assert {p.grad.dtype for p in mixed.parameters()} == {torch.float32}
    for a, b in zip(got, want):
        assert abs(a - b) <= 0.05 * abs(b) + 1e-3, (got, want)
    w0 = _flat(longstraw.load_model(path, dtype="float32"))
    drift_mixed = (_flat(mixed) - _flat(ref)).norm() / (_flat(ref) - w0).norm()
    drift_bf16 = (_flat(plain) - _flat(ref)).norm() / (_flat(ref) - w0).norm()
    assert drift_mixed < 0.2 and drift_mixed < drift_bf16 / 2, (float(drift_mixed), float(drift_bf16))


def test_an_update_below_bf16_resolution_survives_in_the_masters(path):
    """lr 1e-5: each update is ~1e-8..1e-6, above float32's spacing and far below bf16's (~1e-4 at these weights):
    the float32 masters move, bf16 weights do not."""
    prompt, responses, adv = _groups()[0]
    moved = {}
    for name in ("master", "bf16"):
        model = longstraw.load_model(path, dtype="bfloat16")
        if name == "master":
            model.use_master_weights(torch.bfloat16)
        longstraw.grpo_backward(model, prompt, responses, adv, longstraw.GRPOConfig(prefill_chunk=16))
        before = _flat(model)
        touched = torch.cat([(p.grad != 0).flatten() for p in model.parameters()])
        torch.optim.SGD(model.parameters(), lr=1e-5).step()
        moved[name] = float(((_flat(model) != before) & touched).sum() / touched.sum())
    assert moved["master"] > 0.9 and moved["bf16"] < 0.01, moved


def test_load_model_master_dtype_reads_the_checkpoint_into_float32_masters(path):
    """load_model(dtype=bf16, master_dtype=float32): float32 parameters holding the checkpoint's values exactly (no
    trip through bf16), every pass in bf16; the model's own dtype means no master weights; the rest is refused."""
    want = dict(longstraw.load_model(path, dtype="float32").named_parameters())
    model = longstraw.load_model(path, dtype="bfloat16", master_dtype="float32")
    assert model.compute_dtype == torch.bfloat16
    for n, p in model.named_parameters():
        assert p.dtype == torch.float32 and torch.equal(p, want[n]), n
    plain = longstraw.load_model(path, dtype="bfloat16", master_dtype=torch.bfloat16)
    assert plain.compute_dtype is None and {p.dtype for p in plain.parameters()} == {torch.bfloat16}
    for dtype, master in (("float32", "bfloat16"), ("float32", "float64"), ("bfloat16", "float64"),
                          ("float64", "float32")):
        with pytest.raises(ValueError, match=rf"master_dtype={master} is not allowed with dtype={dtype}: master "
                                             "weights are float32 for a bfloat16 or float16 model"):
            longstraw.load_model(path, dtype=dtype, master_dtype=master)
    with pytest.raises(ValueError, match="master_dtype"):
        longstraw.load_model(path, dtype="bfloat16", master_dtype="float33")
