"""MIL heads: shapes, packed == per-bag loop, mask invariance, loss dictionaries, class weights,
single-instance bags, learning a separable toy problem, registry errors."""

import pytest
import torch

from dpgs.models import HEADS, build_head, head_params
from dpgs.train.batching import pad_batch

NAMES = sorted(HEADS)
EXACT = [n for n in NAMES if HEADS[n].packing_exact]
# small sizes keep the transformer heads fast; every other parameter keeps its published default
SMALL = {
    "abmil": {"hidden": 32, "attn_dim": 16},
    "meanmil": {"hidden": 32},
    "maxmil": {"hidden": 32},
    "clam_sb": {"hidden": 32, "attn_dim": 16},
    "clam_mb": {"hidden": 32, "attn_dim": 16},
    "transmil": {"hidden": 32, "heads": 4, "landmarks": 4},
    "dtfd": {"hidden": 32, "attn_dim": 16},
    "acmil": {"hidden": 32, "attn_dim": 16},
    "rrtmil": {"hidden": 32, "heads": 4, "attn_dim": 16, "region_num": 2, "epeg_k": 3},
    "dsmil": {"q_dim": 16},
}
# heads whose training forward is deterministic (no random pseudo-bags or masking)
DETERMINISTIC_TRAIN = [n for n in NAMES if n not in ("dtfd", "acmil")]


def head(name, dim=8, classes=3, **extra):
    torch.manual_seed(0)
    return build_head(name, dim, classes, **{**SMALL[name], "dropout": 0.0, **extra}).double()


def bags(dim=8, lengths=(1, 5, 20, 3), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, dim, generator=g, dtype=torch.float64) for n in lengths]


def lengths_of(xs):
    return torch.tensor([len(b) for b in xs])


def test_every_head_is_registered_with_published_defaults():
    assert set(NAMES) == {
        "abmil",
        "meanmil",
        "maxmil",
        "clam_sb",
        "clam_mb",
        "transmil",
        "dtfd",
        "acmil",
        "rrtmil",
        "dsmil",
    }
    assert set(EXACT) == {"abmil", "meanmil", "maxmil", "clam_sb", "clam_mb", "dsmil"}
    assert head_params("abmil") == {"hidden": 500, "attn_dim": 128, "gated": True, "dropout": 0.25}
    assert head_params("clam_mb")["k_sample"] == 8 and head_params("clam_sb")["bag_weight"] == 0.7
    assert head_params("clam_sb")["instance_loss"] == "svm"
    assert head_params("dtfd")["num_groups"] == 4
    acmil = head_params("acmil")
    assert (acmil["n_token"], acmil["n_masked_patch"], acmil["mask_drop"]) == (5, 10, 0.6)
    assert head_params("transmil")["pinv_iterations"] == 6
    rrt = head_params("rrtmil")
    assert (rrt["region_num"], rrt["epeg_k"], rrt["crmsa_k"]) == (8, 15, 3)
    assert all("dropout" in head_params(n) for n in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_shapes_with_default_parameters(name):
    model = build_head(name, 8, 3).double().eval()
    xs = bags()
    with torch.no_grad():
        assert model(xs[1]).shape == (3,)
        x, mask = pad_batch(xs)
        assert model(x, mask).shape == (4, 3)
        assert model(torch.stack([b[:3] for b in xs[1:]])).shape == (3, 3)  # sampling mode: no mask
        assert model.forward_packed(torch.cat(xs), lengths_of(xs)).shape == (4, 3)
        scores = model.instance_scores(xs[2])
    assert scores.shape == (20,) and torch.isfinite(scores).all()


@pytest.mark.parametrize("name", NAMES)
def test_loss_dictionary_contract(name):
    model = head(name).train()
    xs, y = bags(), torch.tensor([0, 1, 2, 1])
    out = model.loss_packed(torch.cat(xs), lengths_of(xs), y)
    assert {"loss", "per_bag", "logits", "ce"} <= set(out)
    assert out["per_bag"].shape == (4,) and out["logits"].shape == (4, 3) and out["loss"].dim() == 0
    torch.testing.assert_close(out["loss"], out["per_bag"].mean())
    components = [v for k, v in out.items() if k not in ("loss", "per_bag", "logits")]
    torch.testing.assert_close(torch.stack(components).sum(), out["loss"])
    single = model.eval().loss(xs[1], torch.tensor(2))
    assert single["per_bag"].shape == (1,) and single["logits"].shape == (1, 3)
    assert set(single) == {"loss", "per_bag", "logits", *(["max_ce"] if name == "dsmil" else []), "ce"}


@pytest.mark.parametrize("name", EXACT)
def test_packed_equals_per_bag_loop(name):
    model = head(name, subtyping=True) if name.startswith("clam") else head(name)
    model.train()
    xs, y = bags(), torch.tensor([0, 1, 2, 1])
    packed = model.loss_packed(torch.cat(xs), lengths_of(xs), y)
    loop = [model.loss(b, y[i]) for i, b in enumerate(xs)]
    reference = torch.stack([o["loss"] for o in loop]).mean()
    torch.testing.assert_close(packed["loss"], reference, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(
        packed["per_bag"], torch.cat([o["per_bag"] for o in loop]), rtol=1e-10, atol=1e-12
    )
    torch.testing.assert_close(
        packed["logits"], torch.cat([o["logits"] for o in loop]), rtol=1e-10, atol=1e-12
    )
    for key in packed:
        if key not in ("loss", "per_bag", "logits"):
            torch.testing.assert_close(
                packed[key], torch.stack([o[key] for o in loop]).mean(), rtol=1e-10, atol=1e-12
            )
    params = list(model.parameters())
    g_packed = torch.autograd.grad(packed["loss"], params, allow_unused=True)
    g_loop = torch.autograd.grad(reference, params, allow_unused=True)
    used = 0
    for a, b in zip(g_packed, g_loop, strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-12)
            used += 1
    assert used == len(params)  # every parameter (instance classifiers included) gets a gradient
    with torch.no_grad():
        torch.testing.assert_close(
            model.eval().forward_packed(torch.cat(xs), lengths_of(xs)),
            torch.stack([model(b) for b in xs]),
            rtol=1e-10,
            atol=1e-12,
        )


@pytest.mark.parametrize("name", NAMES)
def test_mask_padding_does_not_change_output(name):
    model = head(name).eval()
    xs = bags()
    x, mask = pad_batch(xs)
    x = x.masked_fill(~mask.unsqueeze(-1), 1e3)  # garbage in the padding must not leak
    with torch.no_grad():
        torch.testing.assert_close(
            model(x, mask), torch.stack([model(b) for b in xs]), rtol=1e-10, atol=1e-10
        )


@pytest.mark.parametrize("name", [n for n in DETERMINISTIC_TRAIN if HEADS[n].supports_mask])
def test_padded_training_loss_equals_per_bag_loop(name):
    model = head(name).train()
    xs, y = bags(), torch.tensor([0, 1, 2, 1])
    x, mask = pad_batch(xs)
    padded = model.loss(x.masked_fill(~mask.unsqueeze(-1), -7.0), y, mask=mask)
    loop = torch.cat([model.loss(b, y[i])["per_bag"] for i, b in enumerate(xs)])
    torch.testing.assert_close(padded["per_bag"], loop, rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("name", NAMES)
def test_class_weights_scale_per_bag_loss(name):
    model = head(name, classes=2).eval()
    xs, y = bags(lengths=(4, 6, 3)), torch.tensor([0, 1, 1])
    plain = model.loss_packed(torch.cat(xs), lengths_of(xs), y)
    weighted = model.loss_packed(torch.cat(xs), lengths_of(xs), y, class_weights=torch.tensor([2.0, 0.5]))
    expected = plain["per_bag"] * torch.tensor([2.0, 0.5, 0.5], dtype=torch.float64)
    torch.testing.assert_close(weighted["per_bag"], expected)
    torch.testing.assert_close(weighted["loss"], expected.mean())
    with pytest.raises(ValueError, match="class_weights must have shape"):
        model.loss(xs[0], 1, class_weights=torch.ones(3))


@pytest.mark.parametrize("name", NAMES)
def test_single_instance_bags_train(name):
    model = head(name).train()
    xs, y = bags(lengths=(1, 1, 2)), torch.tensor([2, 0, 1])
    out = model.loss_packed(torch.cat(xs), lengths_of(xs), y)
    out["loss"].backward()
    assert torch.isfinite(out["per_bag"]).all()
    assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None)
    one = model.loss(xs[0], torch.tensor(2))
    assert torch.isfinite(one["loss"])
    assert model.eval()(xs[0]).shape == (3,)
    assert model.instance_scores(xs[0]).shape == (1,)


def separable_bags(n=40, dim=4, seed=1):
    """A bag is positive iff it holds one key instance (feature 0 shifted by +6)."""
    g = torch.Generator().manual_seed(seed)
    data = []
    for i in range(n):
        label = i % 2
        x = torch.randn(int(torch.randint(2, 11, (1,), generator=g)), dim, generator=g)
        if label:
            x[int(torch.randint(len(x), (1,), generator=g)), 0] += 6.0
        data.append((x, label))
    return data


@pytest.mark.parametrize("name", NAMES)
def test_learns_separable_toy_problem(name):
    torch.manual_seed(0)
    data = separable_bags()
    model = build_head(name, 4, 2, **SMALL[name], dropout=0.0)
    opt = torch.optim.Adam(model.parameters(), lr=5e-3)
    for _ in range(25):
        for start in range(0, len(data), 8):
            chunk = data[start : start + 8]
            out = model.loss_packed(
                torch.cat([x for x, _ in chunk]),
                torch.tensor([len(x) for x, _ in chunk]),
                torch.tensor([y for _, y in chunk]),
            )
            opt.zero_grad()
            out["loss"].backward()
            opt.step()
    model.eval()
    with torch.no_grad():
        acc = sum(int(model(x).argmax()) == y for x, y in data) / len(data)
    assert acc >= 0.95, f"{name}: accuracy {acc}"


def test_build_head_errors_name_the_bad_key():
    with pytest.raises(ValueError, match="unknown head 'abmill'.*abmil.*transmil"):
        build_head("abmill", 4, 2)
    with pytest.raises(ValueError, match="unknown parameter.*dropuot.*head 'abmil'.*valid: hidden, attn_dim"):
        build_head("abmil", 4, 2, dropuot=0.1)
    with pytest.raises(ValueError, match="unknown head 'nope'"):
        head_params("nope")
    with pytest.raises(ValueError, match="instance_loss"):
        build_head("clam_sb", 4, 2, instance_loss="hinge")


def test_bad_inputs_are_reported():
    model = build_head("abmil", 4, 2)
    with pytest.raises(ValueError, match=r"D=4.*\(3, 5\)"):
        model(torch.randn(3, 5))
    with pytest.raises(ValueError, match="sum to x.shape"):
        model.forward_packed(torch.randn(5, 4), torch.tensor([2, 2]))
    with pytest.raises(ValueError, match="labels must be integers in \\[0, 2\\)"):
        model.loss(torch.randn(3, 4), 2)
    x, mask = torch.randn(2, 3, 4), torch.tensor([[True, False, False], [False, False, False]])
    with pytest.raises(ValueError, match=r"bag\(s\) \[1\] without any instance"):
        model(x, mask)
