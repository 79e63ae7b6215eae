"""dpgs's optimizers (``dpgs.train.optimizers``) against ``torch.optim`` with ``fused=True`` (the same
kernels): bit for bit over steps with weight decay, a parameter that misses steps and a changing learning
rate; a ``torch.optim`` state dict (what checkpoints written before dpgs had its own optimizers hold)
continues bit for bit; loading copies; a state of another size is refused; and a process that trains
never imports ``torch._dynamo`` (what ``torch.optim`` costs at its first use)."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest
import torch

from dpgs.config import load_config
from dpgs.train.optim import build_optimizer, optimizer_step

CASES = {
    "adam": ("train.optimizer=adam", lambda ps: torch.optim.Adam(ps, lr=0.0, weight_decay=0.01, fused=True)),
    "adamw": ("train.optimizer=adamw",
              lambda ps: torch.optim.AdamW(ps, lr=0.0, weight_decay=0.01, fused=True)),
    "sgd-momentum": ("train.optimizer=sgd",
                     lambda ps: torch.optim.SGD(ps, lr=0.0, momentum=0.9, weight_decay=0.01, fused=True)),
    "sgd": ("train.optimizer=sgd", lambda ps: torch.optim.SGD(ps, lr=0.0, weight_decay=0.01, fused=True)),
}
MOMENTUM = {"sgd-momentum": "train.momentum=0.9", "sgd": "train.momentum=0"}


def model_params(seed: int = 0) -> list[torch.nn.Parameter]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.ReLU(), torch.nn.Linear(7, 3))
    return list(model.parameters())


def ours(name: str, params):
    option, _ = CASES[name]
    config = load_config(None, [option, "train.weight_decay=0.01", MOMENTUM.get(name, "train.momentum=0.9")])
    return build_optimizer(params, config.train)


def take_steps(optimizer, params, steps: range, late: bool = True) -> None:
    """Seeded gradients, the learning rate varying; with ``late``, the last parameter (a bias) has none at
    steps 0 and 1 (it joins at step 2)."""
    for s in steps:
        gen = torch.Generator().manual_seed(100 + s)
        for i, p in enumerate(params):
            joined = not late or i < len(params) - 1 or s >= 2
            p.grad = torch.randn(p.shape, generator=gen) if joined else None
        lr = 0.01 * (1 + s % 3)
        if isinstance(optimizer, torch.optim.Optimizer):
            for group in optimizer.param_groups:
                group["lr"] = lr
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer_step(optimizer, params, lr)


@pytest.mark.parametrize("name", list(CASES))
def test_steps_are_torch_optims_fused_steps_bit_for_bit(name):
    a, b = model_params(), model_params()
    mine, reference = ours(name, a), CASES[name][1](b)
    late = name != "sgd-momentum"  # torch's fused SGD cannot start a buffer after its first step
    take_steps(mine, a, range(6), late)
    take_steps(reference, b, range(6), late)
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    assert not any(p.grad is not None for p in a)
    state, expected = mine.state_dict(), reference.state_dict()
    assert state["state"].keys() == expected["state"].keys()
    for i, tensors in expected["state"].items():
        assert state["state"][i].keys() == tensors.keys(), i
        assert all(torch.equal(state["state"][i][k], v) for k, v in tensors.items())


@pytest.mark.parametrize("name", list(CASES))
def test_a_torch_optim_state_continues_bit_for_bit(name):
    """A checkpoint written with torch.optim (dpgs before 2026-11-29) resumes as if torch.optim went on."""
    a, b = model_params(), model_params()
    reference = CASES[name][1](b)
    late = name != "sgd-momentum"
    take_steps(reference, b, range(3), late)
    with torch.no_grad():
        for x, y in zip(a, b, strict=True):
            x.copy_(y)
    saved = torch.load(_saved(reference.state_dict()), weights_only=True)
    mine = ours(name, a)
    mine.load_state_dict(saved)
    take_steps(mine, a, range(3, 6))
    take_steps(reference, b, range(3, 6))
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_a_momentum_buffer_started_after_the_first_step_starts_as_that_steps_gradient():
    """SGD with momentum where a parameter first has a gradient at step 2: its buffer starts there as its
    gradient (with decay), as torch.optim's unfused SGD does (the fused kernel rounds with FMA: 3e-8)."""
    a, b = model_params(), model_params()
    mine, reference = ours("sgd-momentum", a), torch.optim.SGD(b, lr=0.0, momentum=0.9, weight_decay=0.01,
                                                               foreach=False)
    take_steps(mine, a, range(2))
    assert len(mine.state) == 3  # the bias without a gradient has no buffer yet
    joining = a[-1].detach().clone()
    gen = torch.Generator().manual_seed(102)
    grads = [torch.randn(p.shape, generator=gen) for p in a]
    take_steps(mine, a, range(2, 3))
    torch.testing.assert_close(mine.state[a[-1]]["momentum_buffer"], grads[-1] + 0.01 * joining, rtol=1e-6,
                               atol=1e-7)
    take_steps(mine, a, range(3, 6))
    take_steps(reference, b, range(6))
    for x, y in zip(a, b, strict=True):
        torch.testing.assert_close(x, y, rtol=1e-6, atol=1e-7)


def _saved(state_dict: dict):
    buffer = io.BytesIO()
    torch.save(state_dict, buffer)
    buffer.seek(0)
    return buffer


def test_loading_copies_the_state_and_takes_its_hyperparameters():
    params = model_params()
    first = ours("adam", params)
    take_steps(first, params, range(2))
    saved = first.state_dict()
    second = ours("adam", model_params(1))
    saved["param_groups"][0]["betas"] = (0.5, 0.9)
    second.load_state_dict(saved)
    assert second.param_groups[0]["betas"] == (0.5, 0.9)
    before = saved["state"][0]["exp_avg"].clone()
    take_steps(second, second.params, range(2, 3))
    assert torch.equal(saved["state"][0]["exp_avg"], before)  # the loaded dict is not stepped in place
    assert not torch.equal(second.state_dict()["state"][0]["exp_avg"], before)


def test_a_state_for_other_parameters_is_refused():
    small = ours("adam", model_params()[:2])
    expected = r"holds \[4\] parameters per group; this optimizer has one group of 2"
    with pytest.raises(ValueError, match=expected):
        small.load_state_dict(ours("adam", model_params()).state_dict())


def test_training_never_imports_torch_dynamo():
    """torch.optim's first use imports torch._dynamo (1.4-1.8 s, ~70 MB a process): a process that builds,
    steps, saves and loads dpgs's optimizers (Adam, AdamW, SGD, FrozenAdam) must not."""
    code = """
import sys, torch
from dpgs.config import load_config
from dpgs.distributed.replica import Replica
from dpgs.train.optim import build_optimizer, optimizer_step
for name in ("adam", "adamw", "sgd"):
    model = torch.nn.Linear(4, 2)
    replica = Replica(model, load_config(None, [f"train.optimizer={name}"]).train)
    replica.restart(model.state_dict(), with_optimizer=True)
    replica.step(torch.ones(replica.numel), 0.1, 0.5)
    if name != "sgd":
        replica.freeze_second_moment(1.0)
        replica.step(torch.ones(replica.numel), 0.1, 1.0)
    replica.load_optimizer(replica.optimizer.state_dict())
print("torch._dynamo" in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
