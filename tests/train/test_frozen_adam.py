"""Adam with its second moment frozen (``dpgs.train.frozen_adam``): the switch from a stepped Adam, the
update against its formula in float64, the floor, and a state that survives a replica's reload."""

from __future__ import annotations

import pickle

import pytest
import torch

from dpgs.config import load_config
from dpgs.distributed.replica import Replica
from dpgs.train.frozen_adam import FrozenAdam, floored_root, freeze
from dpgs.train.optim import build_optimizer, optimizer_step
from dpgs.train.optimizers import Adam

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def stepped(optimizer_name: str, steps: int = 3, weight_decay: float = 0.01):
    """A small model and its Adam/AdamW after ``steps`` steps on seeded gradients."""
    config = load_config(None, [f"train.optimizer={optimizer_name}", f"train.weight_decay={weight_decay}"])
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.Linear(8, 2))
    params = list(model.parameters())
    optimizer = build_optimizer(params, config.train)
    gen = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        optimizer_step(optimizer, params, 0.01)
    return config, model, params, optimizer


@pytest.mark.parametrize("optimizer_name", ["adam", "adamw"])
def test_freezing_then_stepping_follows_the_formula(optimizer_name):
    _, _, params, adam = stepped(optimizer_name)
    t = 3
    expected_m, expected_d = [], []
    for p in params:
        state = adam.state[p]
        d = (state["exp_avg_sq"].double() / (1 - BETA2**t)).sqrt() + EPS
        expected_d.append(d)
        expected_m.append(state["exp_avg"].double() / (1 - BETA1**t) / d)
    theta = [p.detach().double().clone() for p in params]
    frozen = freeze(adam, floor=0.0)
    for p, d, m in zip(params, expected_d, expected_m, strict=True):
        torch.testing.assert_close(frozen.state[p]["denom"].double(), d, rtol=1e-6, atol=0)
        torch.testing.assert_close(frozen.state[p]["exp_avg"].double(), m, rtol=1e-5, atol=1e-7)
    lr, wd = 0.05, 0.01
    gen = torch.Generator().manual_seed(7)
    for _ in range(2):
        us = [torch.randn(p.shape, generator=gen) for p in params]
        for p, u in zip(params, us, strict=True):
            p.grad = u.clone()
        optimizer_step(frozen, params, lr)
        for i, u in enumerate(us):
            u = u.double()
            if optimizer_name == "adamw":
                theta[i] = theta[i] * (1 - lr * wd)
            else:
                u = u + wd * theta[i] / expected_d[i]
            expected_m[i] = BETA1 * expected_m[i] + (1 - BETA1) * u
            theta[i] = theta[i] - lr * expected_m[i]
    for p, th in zip(params, theta, strict=True):
        torch.testing.assert_close(p.detach().double(), th, rtol=1e-5, atol=1e-6)


def test_the_floor_lifts_a_tensors_small_roots_to_its_median():
    v_hat = torch.tensor([0.0, 1e-12, 4.0, 9.0, 16.0])  # roots 0, 1e-6, 2, 3, 4: median 2
    assert floored_root(v_hat, 1.0).tolist() == [2.0, 2.0, 2.0, 3.0, 4.0]
    assert floored_root(v_hat, 0.5).tolist() == [1.0, 1.0, 2.0, 3.0, 4.0]
    torch.testing.assert_close(floored_root(v_hat, 0.0), v_hat.sqrt())


def test_freezing_before_any_step_says_why():
    _, _, params, _ = stepped("adam", steps=0)
    config = load_config(None, ["train.optimizer=adam"])
    with pytest.raises(ValueError, match="before its first step.*warmup_epochs"):
        freeze(build_optimizer(params, config.train), floor=1.0)


def test_sgd_cannot_be_frozen():
    _, _, params, _ = stepped("adam", steps=0)
    config = load_config(None, ["train.optimizer=sgd", "train.momentum=0.9"])
    with pytest.raises(ValueError, match="needs Adam or AdamW.*SGD"):
        freeze(build_optimizer(params, config.train), floor=1.0)


def test_a_replica_reloads_a_frozen_state_and_goes_back_to_adam():
    """A resynchronised or resumed replica gets the optimizer its state is of: a FrozenAdam's state makes
    its Adam a FrozenAdam (and the next step is the same), an Adam's state makes it an Adam again."""
    config, model, _, _ = stepped("adam", steps=0)
    a, b = Replica(model, config.train), Replica(torch.nn.Sequential(torch.nn.Linear(12, 8),
                                                                      torch.nn.Linear(8, 2)), config.train)
    a.restart(model.state_dict(), with_optimizer=True)
    b.restart(model.state_dict(), with_optimizer=True)
    shipped = lambda replica: pickle.loads(pickle.dumps(replica.state(replica.flat_params())))  # as Ray does
    for _ in range(2):
        a.step(torch.randn(a.numel, generator=torch.Generator().manual_seed(3)), 0.01, 1.0)
    adam_state = shipped(a)
    a.freeze_second_moment(1.0)
    b.load_state(shipped(a))
    assert b.frozen and torch.equal(b.preconditioner(), a.preconditioner())
    u = torch.randn(a.numel, generator=torch.Generator().manual_seed(4))
    a.step(u, 0.01, 1.0)
    b.step(u, 0.01, 1.0)
    assert torch.equal(a.flat_params(), b.flat_params())
    b.load_state(adam_state)
    assert not b.frozen and isinstance(b.optimizer, Adam)
    assert not FrozenAdam.holds(b.optimizer.state_dict()) and FrozenAdam.holds(a.optimizer.state_dict())
