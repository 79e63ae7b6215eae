"""``dpgs.models.layers.Dropout``: ``nn.Dropout``'s contract (keep with probability 1 - p, scale the kept
values by 1 / (1 - p)) with the CPU mask drawn from ``rand``, and every head built with it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dpgs.models.layers import Dropout


def test_kept_values_are_scaled_and_the_rest_are_zero():
    torch.manual_seed(0)
    x = torch.rand(400, 512) + 1.0  # no zeros of its own
    out = Dropout(0.25).train()(x)
    kept = out != 0
    assert torch.allclose(out[kept], x[kept] / 0.75)
    # 204,800 Bernoulli(0.75) draws: the kept share is 0.75 within 5 standard deviations (0.005)
    assert abs(kept.float().mean().item() - 0.75) < 0.005


def test_the_gradient_goes_through_the_kept_values_only():
    torch.manual_seed(1)
    x = torch.randn(64, 32, requires_grad=True)
    out = Dropout(0.5).train()(x)
    out.sum().backward()
    kept = out.detach() != 0
    assert torch.equal(x.grad, kept.float() * 2.0)


def test_the_same_seed_draws_the_same_mask():
    """A DPGS worker seeds each micro-batch; a replayed step must drop the same values."""
    x = torch.randn(128, 64)
    drop = Dropout(0.3).train()
    torch.manual_seed(7)
    first = drop(x)
    torch.manual_seed(7)
    assert torch.equal(first, drop(x))
    assert not torch.equal(first, drop(x))  # the generator moved on


@pytest.mark.parametrize("p", [0.0, 1.0])
def test_the_limits_and_evaluation_are_those_of_nn_dropout(p):
    x = torch.randn(16, 8)
    assert torch.equal(Dropout(p).train()(x), nn.Dropout(p).train()(x))
    assert torch.equal(Dropout(0.5).eval()(x), x)


def test_the_expected_output_is_the_input():
    torch.manual_seed(2)
    x = torch.full((1000, 1000), 3.0)
    assert Dropout(0.4).train()(x).mean().item() == pytest.approx(3.0, abs=0.01)


def test_heads_use_it_and_keep_nn_dropout_state_dicts():
    """Every dropout layer of the heads is this one, and it is an ``nn.Dropout`` without state, so
    checkpoints written before it load unchanged."""
    from dpgs.models import HEADS

    for name, head in HEADS.items():
        model = head(in_dim=16, num_classes=2)
        drops = [m for m in model.modules() if isinstance(m, nn.Dropout)]
        assert all(type(m) is Dropout for m in drops), name
    assert Dropout(0.25).state_dict() == {}
