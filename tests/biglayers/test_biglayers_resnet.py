"""Whole big ResNets against a plain torch.nn ResNet with the same weights (training-mode BatchNorm)."""

import pytest
import torch

from dpgs.biglayers import resnet18, resnet50
from tests._biglayers_reference import dense_resnet

F64 = torch.float64
BUILD = {"resnet18": resnet18, "resnet50": resnet50}
# (batch, height, width): an odd-sized image pair, and a bag of small tiles
SIZES = {"image": (2, 37, 45), "bag": (6, 20, 20), "large": (1, 70, 61)}
BUDGET = 8192  # small enough that every big layer of these inputs is cut into several strips


def _pair(arch, big_stages, num_classes=3, max_elements=BUDGET, dtype=F64, seed=0, **options):
    ref = dense_resnet(arch, num_classes=num_classes, dtype=dtype, seed=seed)
    big = BUILD[arch](big_stages=big_stages, max_elements=max_elements, num_classes=num_classes,
                      device="cpu", dtype=dtype, **options)
    big.load_state_dict(ref.state_dict())
    return big, ref


def _compare(arch, big_stages, size, dtype=F64, rtol=1e-9, **options):
    big, ref = _pair(arch, big_stages, dtype=dtype, **options)
    torch.manual_seed(1)
    x = torch.randn(size[0], 3, size[1], size[2], dtype=dtype)
    y, r = big(x), ref(x)
    scale = lambda t: rtol * max(1.0, t.abs().max().item())  # noqa: E731
    torch.testing.assert_close(y, r, rtol=rtol, atol=scale(r))
    w = torch.randn_like(r)
    (y * w).sum().backward()
    (r * w).sum().backward()
    got = dict(big.named_parameters())
    for name, p in ref.named_parameters():
        torch.testing.assert_close(got[name].grad, p.grad, rtol=rtol, atol=scale(p.grad), msg=name)
    state = big.state_dict()
    for name, v in ref.state_dict().items():
        torch.testing.assert_close(state[name], v, rtol=rtol, atol=scale(v), msg=name)
    if big_stages >= 0:
        assert 0 < big.memory_stats()["peak_tensor_elements"] <= BUDGET


@pytest.mark.parametrize("size", ["image", "bag"])
@pytest.mark.parametrize("big_stages", [-1, 0, 1, 2, 3, 4])
def test_resnet18_matches_dense(big_stages, size):
    _compare("resnet18", big_stages, SIZES[size])


@pytest.mark.parametrize("big_stages,size", [(0, "bag"), (2, "image"), (4, "image")])
def test_resnet50_matches_dense(big_stages, size):
    _compare("resnet50", big_stages, SIZES[size])


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["resnet18", "resnet50"])
@pytest.mark.parametrize("size", ["image", "bag", "large"])
@pytest.mark.parametrize("big_stages", [-1, 0, 1, 2, 3, 4])
def test_resnet_sweep_matches_dense(arch, big_stages, size):
    _compare(arch, big_stages, SIZES[size])


def test_resnet18_nchw_host_storage():
    _compare("resnet18", 4, SIZES["image"], channels_last=False)


def test_resnet18_float32():
    _compare("resnet18", 3, SIZES["image"], dtype=torch.float32, rtol=1e-4)


def test_results_do_not_depend_on_max_elements():
    torch.manual_seed(2)
    x = torch.randn(3, 3, 41, 35, dtype=F64)
    outs, grads = [], []
    for budget in (10**9, 60000, 8192, 5000):
        big, _ = _pair("resnet18", 4, max_elements=budget)
        y = big(x)
        y.square().sum().backward()
        outs.append(y.detach())
        grads.append(torch.cat([p.grad.flatten() for p in big.parameters()]))
    for y, g in zip(outs[1:], grads[1:], strict=True):
        torch.testing.assert_close(y, outs[0], rtol=1e-12, atol=1e-12)
        torch.testing.assert_close(g, grads[0], rtol=1e-10, atol=1e-10)


def test_adam_steps_track_dense_model():
    big, ref = _pair("resnet18", 2, num_classes=4)
    opt_big = torch.optim.Adam(big.parameters(), lr=1e-3)
    opt_ref = torch.optim.Adam(ref.parameters(), lr=1e-3)
    torch.manual_seed(3)
    for _ in range(3):
        x = torch.randn(4, 3, 33, 33, dtype=F64)
        target = torch.randint(0, 4, (4,))
        losses = []
        for model, opt in ((big, opt_big), (ref, opt_ref)):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(x), target)
            loss.backward()
            opt.step()
            losses.append(loss.item())
        assert losses[0] == pytest.approx(losses[1], rel=1e-9)
    for name, p in ref.named_parameters():
        torch.testing.assert_close(dict(big.named_parameters())[name], p, rtol=1e-7, atol=1e-9)


def test_eval_mode_uses_running_statistics():
    big, ref = _pair("resnet18", 4)
    big.eval()
    ref.eval()
    x = torch.randn(2, 3, 29, 31, dtype=F64)
    torch.testing.assert_close(big(x), ref(x), rtol=1e-9, atol=1e-9)
    assert all(int(v) == 0 for k, v in big.state_dict().items() if k.endswith("num_batches_tracked"))


def test_torchvision_state_dict_and_pooled_features():
    for arch, dim in (("resnet18", 512), ("resnet50", 2048)):
        ref = dense_resnet(arch, num_classes=1000)  # a torchvision-format checkpoint, fc included
        big = BUILD[arch](big_stages=1, max_elements=BUDGET, num_classes=0, device="cpu", dtype=F64)
        assert set(big.state_dict()) == {k for k in ref.state_dict() if not k.startswith("fc.")}
        assert "layer2.0.downsample.1.running_var" in big.state_dict()
        big.load_state_dict(ref.state_dict())  # fc.* dropped for a feature extractor
        bag = torch.randn(5, 3, 24, 24, dtype=F64, requires_grad=True)
        feats = big(bag)
        assert feats.shape == (5, dim)
        feats.sum().backward()
        assert bag.grad is not None and bag.grad.shape == bag.shape
    with_head = resnet18(big_stages=0, num_classes=1000, device="cpu", dtype=F64)
    assert set(with_head.state_dict()) == set(dense_resnet("resnet18", 1000).state_dict())


def test_bad_big_stages_is_rejected():
    with pytest.raises(ValueError, match="big_stages must be an int from -1"):
        resnet18(big_stages=5)
    with pytest.raises(ValueError, match="num_classes must be an int >= 0"):
        resnet50(num_classes=-1)
