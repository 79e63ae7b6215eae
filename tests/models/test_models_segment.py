"""Segment operations against dense per-bag references (values and gradients)."""

import numpy as np
import pytest
import torch

from dpgs.models.segment import (
    segment_argmax,
    segment_ids,
    segment_max,
    segment_mean,
    segment_softmax,
    segment_sum,
    segment_topk,
)

LENGTHS = torch.tensor([1, 4, 7, 2])


def packed(cols=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(int(LENGTHS.sum()), cols, generator=g, dtype=torch.float64, requires_grad=True)


def per_bag(x):
    return torch.split(x, LENGTHS.tolist())


@pytest.mark.parametrize(
    "op, dense",
    [
        (segment_sum, lambda b: b.sum(0)),
        (segment_mean, lambda b: b.mean(0)),
        (segment_max, lambda b: b.amax(0)),
    ],
)
def test_reductions_match_dense(op, dense):
    x = packed()
    out = op(x, LENGTHS)
    ref = torch.stack([dense(b) for b in per_bag(x)])
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-15)
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((out * w).sum(), x)
    (g_ref,) = torch.autograd.grad((ref * w).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=0, atol=1e-15)


def test_softmax_matches_dense_and_survives_large_scores():
    x = packed()
    out = segment_softmax(x * 1e3, LENGTHS)  # large scores: the max shift keeps exp finite
    ref = torch.cat([torch.softmax(b * 1e3, 0) for b in per_bag(x)])
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-15)
    w = torch.randn_like(out)
    (g,) = torch.autograd.grad((segment_softmax(x, LENGTHS) * w).sum(), x)
    (g_ref,) = torch.autograd.grad((torch.cat([torch.softmax(b, 0) for b in per_bag(x)]) * w).sum(), x)
    torch.testing.assert_close(g, g_ref, rtol=1e-12, atol=1e-15)


def test_softmax_gives_zero_to_minus_inf_rows():
    s = torch.tensor([[0.0], [float("-inf")], [1.0]], dtype=torch.float64)
    out = segment_softmax(s, torch.tensor([2, 1]))
    assert out[:, 0].tolist() == [1.0, 0.0, 1.0]


def test_argmax_is_first_maximum_per_bag_and_column():
    x = torch.tensor([[1.0, 5.0], [3.0, 5.0], [3.0, 0.0], [2.0, 2.0], [2.0, 1.0]])
    out = segment_argmax(x, torch.tensor([3, 2]))
    assert out.tolist() == [[1, 0], [3, 3]]


def test_topk_matches_per_bag_sort_with_ties_and_short_bags():
    v = torch.tensor([0.5, 2.0, 2.0, 1.0, 7.0, 3.0, 3.0, 3.0])
    lengths = torch.tensor([4, 1, 3])
    idx, valid = segment_topk(v, lengths, 2)
    assert valid.tolist() == [[True, True], [True, False], [True, True]]
    assert idx[valid].tolist() == [1, 2, 4, 5, 6]  # ties: lower row first
    assert idx[~valid].tolist() == [4]  # invalid slots point at the bag's first row
    idx, valid = segment_topk(v, lengths, torch.tensor([1, 1, 0]))
    assert idx[valid].tolist() == [1, 4]
    with pytest.raises(ValueError, match="1-D"):
        segment_topk(v[:, None], lengths, 1)


def test_topk_random_against_torch_topk():
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(1, 30, (20,), generator=g)
    v = torch.randn(int(lengths.sum()), generator=g)
    idx, valid = segment_topk(v, lengths, 5)
    offsets = np.cumsum([0] + lengths.tolist()[:-1])
    for b, bag in enumerate(torch.split(v, lengths.tolist())):
        k = min(5, len(bag))
        ref = torch.topk(bag, k).indices + int(offsets[b])
        assert idx[b][valid[b]].tolist() == ref.tolist()


def test_segment_ids():
    assert segment_ids(torch.tensor([2, 1, 3])).tolist() == [0, 0, 1, 2, 2, 2]
