"""MIL heads: shapes, packed == per-bag loop, mask invariance, class weights, learning, errors."""

import pytest
import torch

from dpgs.models import HEADS, build_head, head_params
from dpgs.train.batching import pad_batch

NAMES = sorted(HEADS)


def bags(dim=8, lengths=(1, 5, 20, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g, dtype=torch.float64) for n in lengths]


@pytest.mark.parametrize("name", NAMES)
def test_shapes(name):
    head = build_head(name, 8, 3).double().eval()
    xs = bags()
    assert head(xs[1]).shape == (3,)
    x, mask = pad_batch(xs)
    assert head(x, mask).shape == (4, 3)
    packed = torch.cat(xs)
    assert head.forward_packed(packed, torch.tensor([len(b) for b in xs])).shape == (4, 3)
    out = head.loss(xs[0], torch.tensor(1))
    assert out["logits"].shape == (1, 3) and out["per_bag"].shape == (1,)
    assert head.instance_scores(xs[2]).shape == (20,)


@pytest.mark.parametrize("name", NAMES)
def test_packed_equals_per_bag_loop(name):
    torch.manual_seed(0)
    head = build_head(name, 8, 3, dropout=0.0).double().train()
    assert head.packing_exact
    xs, y = bags(), torch.tensor([0, 1, 2, 1])
    packed = head.loss_packed(torch.cat(xs), torch.tensor([len(b) for b in xs]), y)
    loop = [head.loss(b, y[i]) for i, b in enumerate(xs)]
    reference = torch.stack([o["loss"] for o in loop]).mean()
    torch.testing.assert_close(packed["loss"], reference, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(
        packed["per_bag"], torch.cat([o["per_bag"] for o in loop]), rtol=1e-12, atol=1e-12
    )
    assert float(packed["loss"]) == pytest.approx(float(packed["per_bag"].mean()))
    g_packed = torch.autograd.grad(packed["loss"], list(head.parameters()), allow_unused=True)
    g_loop = torch.autograd.grad(reference, list(head.parameters()), allow_unused=True)
    for a, b in zip(g_packed, g_loop, strict=True):
        if a is not None or b is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_mask_padding_does_not_change_output(name):
    head = build_head(name, 8, 3).double().eval()
    xs = bags()
    x, mask = pad_batch(xs)
    x = x.masked_fill(~mask.unsqueeze(-1), 1e3)  # garbage in the padding must not leak
    torch.testing.assert_close(head(x, mask), torch.stack([head(b) for b in xs]), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("name", NAMES)
def test_class_weights_scale_per_bag_loss(name):
    torch.manual_seed(0)
    head = build_head(name, 8, 2, dropout=0.0).double().eval()
    xs, y = bags(lengths=(4, 6)), torch.tensor([0, 1])
    plain = head.loss_packed(torch.cat(xs), torch.tensor([4, 6]), y)
    weighted = head.loss_packed(
        torch.cat(xs), torch.tensor([4, 6]), y, class_weights=torch.tensor([2.0, 0.5])
    )
    torch.testing.assert_close(
        weighted["per_bag"], plain["per_bag"] * torch.tensor([2.0, 0.5], dtype=torch.float64)
    )


@pytest.mark.parametrize("name", NAMES)
def test_learns_separable_toy_problem(name):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    data = []
    for i in range(40):
        label = i % 2
        x = torch.randn(int(torch.randint(2, 12, (1,), generator=g)), 4, generator=g)
        if label:
            x[0, 0] += 4.0  # one key instance makes a bag positive
        data.append((x, label))
    head = build_head(name, 4, 2, dropout=0.0)
    opt = torch.optim.Adam(head.parameters(), lr=5e-3)
    for _ in range(60):
        for start in range(0, 40, 8):
            chunk = data[start : start + 8]
            out = head.loss_packed(
                torch.cat([x for x, _ in chunk]),
                torch.tensor([len(x) for x, _ in chunk]),
                torch.tensor([y for _, y in chunk]),
            )
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
    head.eval()
    with torch.no_grad():
        acc = sum(int(head(x).argmax()) == y for x, y in data) / len(data)
    assert acc >= 0.95


def test_unknown_head_and_param_are_named():
    with pytest.raises(ValueError, match="unknown head 'abmill'.*abmil"):
        build_head("abmill", 4, 2)
    with pytest.raises(ValueError, match="unknown parameter.*dropuot.*head 'abmil'"):
        build_head("abmil", 4, 2, dropuot=0.1)
    assert head_params("clam_sb")["k_sample"] == 8
    assert head_params("clam_sb")["bag_weight"] == 0.7


def test_clam_instance_loss_only_in_training():
    head = build_head("clam_sb", 8, 2).double()
    x = bags()[2]
    assert "instance" in head.train().loss(x, torch.tensor(1))
    assert "instance" not in head.eval().loss(x, torch.tensor(1))
