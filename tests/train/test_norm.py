"""The gradient norm every engine clips with (dpgs.train.optim.l2_norm), and the one gradient vector a DPGS
rank reuses every step (Replica.gradient_buffer)."""

from __future__ import annotations

import math

import pytest
import torch

from dpgs.config import load_config
from dpgs.distributed.replica import Replica
from dpgs.train.optim import NORM_CHUNK, grad_norm, l2_norm


@pytest.mark.parametrize("n", [1, NORM_CHUNK - 1, NORM_CHUNK, 3 * NORM_CHUNK + 17])
def test_l2_norm_agrees_with_a_float64_norm_of_the_whole_vector(n):
    x = torch.randn(n, generator=torch.Generator().manual_seed(n)) * 1e3
    reference = float(torch.linalg.vector_norm(x.double()))
    assert l2_norm(x) == pytest.approx(reference, rel=1e-13)


def test_l2_norm_of_several_tensors_is_the_norm_of_their_concatenation():
    g = torch.Generator().manual_seed(1)
    parts = [torch.randn(NORM_CHUNK + 5, generator=g), torch.randn(3, 4, generator=g), torch.empty(0),
             torch.randn(2 * NORM_CHUNK, generator=g)]
    reference = float(torch.linalg.vector_norm(torch.cat([p.reshape(-1) for p in parts]).double()))
    assert l2_norm(*parts) == pytest.approx(reference, rel=1e-13)
    assert l2_norm() == 0.0


def test_l2_norm_keeps_float64_precision_where_a_float32_sum_would_not():
    """A million ones and one 1e4: float32 accumulation would drop the small terms' last digits."""
    x = torch.ones(1_000_000)
    x[0] = 1e4
    assert l2_norm(x) == math.sqrt(999_999 + 1e8)


def test_l2_norm_of_nothing_is_zero_and_of_non_finite_values_is_not_finite():
    assert l2_norm(torch.empty(0)) == 0.0
    assert math.isnan(l2_norm(torch.tensor([1.0, float("nan")])))
    assert l2_norm(torch.tensor([1.0, float("-inf")])) == math.inf


def test_grad_norm_is_the_norm_of_the_concatenated_gradients():
    a, b, c = torch.zeros(3, requires_grad=True), torch.zeros(2, 2, requires_grad=True), torch.zeros(1)
    a.grad, b.grad = torch.tensor([3.0, 0.0, 0.0]), torch.tensor([[0.0, 4.0], [0.0, 12.0]])
    assert grad_norm([a, b, c]) == 13.0  # c has no gradient
    assert grad_norm([c]) == 0.0


def test_a_replica_forms_every_step_in_the_same_gradient_vector_and_releases_it_after_the_step():
    model = torch.nn.Linear(5, 3)
    replica = Replica(model, load_config(None, ["train.optimizer=sgd", "train.weight_decay=0"]).train)
    replica.restart(model.state_dict(), with_optimizer=True)
    buffer = replica.gradient_buffer()
    assert buffer.shape == (replica.numel,) and buffer.dtype == torch.float32
    before = replica.flat_params()
    buffer.fill_(1.0)
    replica.step(buffer, lr=0.5, clip=1.0)
    assert torch.equal(replica.flat_params(), before - 0.5)
    assert all(p.grad is None for p in model.parameters())  # nothing still points into the buffer
    assert replica.gradient_buffer() is buffer
