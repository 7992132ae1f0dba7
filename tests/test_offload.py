"""HostAdamW: torch's AdamW with the state in host memory, bit for bit on a CPU run."""

import pytest
import torch

from longstraw.offload import HostAdamW


def _params(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(5, 7, generator=g, dtype=dtype)),
            torch.nn.Parameter(torch.randn(3, generator=g, dtype=dtype))]


def _grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g, dtype=p.dtype)


def test_equals_torch_adamw_bit_for_bit():
    ours, ref = _params(0), _params(0)
    opt = HostAdamW(ours, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1)
    want = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
    for step in range(5):
        _grads(ours, step)
        _grads(ref, step)
        opt.step()
        want.step()
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)
    st = opt.state[ours[0]]
    assert st["exp_avg"].device.type == "cpu" and float(st["step"]) == 5
    assert torch.equal(st["exp_avg_sq"], want.state[ref[0]]["exp_avg_sq"])


def test_master_on_host_keeps_updates_below_the_device_dtype_resolution():
    """bf16 parameters with float32 masters on the host: many tiny updates add up in the masters and reach the bf16
    weights; applied to the bf16 weights directly they are lost."""
    p = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    direct = torch.nn.Parameter(torch.ones(64, dtype=torch.bfloat16))
    opt = HostAdamW([p], lr=1e-4, weight_decay=0.0, master_on_host=True)
    plain = HostAdamW([direct], lr=1e-4, weight_decay=0.0)
    for _ in range(100):
        p.grad = torch.ones_like(p)
        direct.grad = torch.ones_like(direct)
        opt.step()
        plain.step()
    master = opt.state[p]["master"]
    assert master.dtype == torch.float32 and abs(float(master[0]) - (1 - 100 * 1e-4)) < 1e-5
    assert float(p.detach()[0]) < 1.0 and float(direct.detach()[0]) == 1.0  # 1e-4 < half of bf16's spacing at 1.0


def test_bad_settings():
    with pytest.raises(ValueError, match=r"betas=\(1.0, 0.9\) must be two numbers in \[0, 1\)"):
        HostAdamW(_params(0), betas=(1.0, 0.9))


@pytest.mark.parametrize("master_on_host", [False, True])
def test_state_dict_round_trip_continues_bit_for_bit(master_on_host):
    """Save after 3 steps, load into a fresh optimiser over copies of the parameters, 3 more steps: the same as 6
    uninterrupted; the loaded state stays on the host in the dtypes step() keeps (not moved to the parameters')."""
    dtype = torch.bfloat16 if master_on_host else torch.float32
    a = _params(0, dtype)
    opt = HostAdamW(a, lr=1e-2, weight_decay=0.1, master_on_host=master_on_host)
    for step in range(3):
        _grads(a, step)
        opt.step()
    saved = opt.state_dict()
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    resumed = HostAdamW(b, lr=1e-2, weight_decay=0.1, master_on_host=master_on_host)
    resumed.load_state_dict(saved)
    for step in range(3, 6):
        _grads(a, step)
        opt.step()
        _grads(b, step)
        resumed.step()
    for x, y in zip(a, b):
        assert torch.equal(x, y)
    st = resumed.state[b[0]]
    assert st["exp_avg"].dtype == torch.float32 and st["exp_avg"].device.type == "cpu"
    assert ("master" in st) == master_on_host and float(st["step"]) == 6


def test_load_state_dict_refuses_another_layout():
    opt = HostAdamW(_params(0), lr=1e-2)
    _grads(opt.param_groups[0]["params"], 0)
    opt.step()
    other = HostAdamW(_params(0)[:1], lr=1e-2)
    with pytest.raises(ValueError, match=r"does not match this optimiser's parameter groups: \[2\] parameters saved, "
                                         r"\[1\] here"):
        other.load_state_dict(opt.state_dict())
