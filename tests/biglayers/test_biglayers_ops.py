"""Every big op against the plain PyTorch op, float64 on CPU, forward and backward."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dpgs.biglayers import (
    BigBatchNorm2d,
    BigBatchNorm2dFunction,
    BigConfig,
    BigConv2d,
    BigConv2dFunction,
    BigMaxPool2d,
)
from dpgs.biglayers.batchnorm import plan_pointwise
from dpgs.biglayers.conv import plan_conv
from dpgs.biglayers.planner import RowWindow

TOL = dict(rtol=1e-9, atol=1e-9)
F64 = torch.float64

# (kernel, stride, padding, dilation, groups)
CONVS = {
    "7/2/3": (7, 2, 3, 1, 1),
    "3/2/1": (3, 2, 1, 1, 1),
    "1/2/0": (1, 2, 0, 1, 1),
    "3/1/1": (3, 1, 1, 1, 1),
    "dilated": (3, 1, 2, 2, 1),
    "grouped": (3, 2, 1, 1, 2),
}


def _budget(window: RowWindow, height: int, in_row: int, out_row: int, mode: str) -> tuple[int, int]:
    """max_elements giving the requested strip layout, and the expected number of bands per sample."""
    out_h = window.out_rows(height)
    need = lambda rows: max(window.in_rows(rows) * in_row, rows * out_row)  # noqa: E731
    if mode == "single":
        return 10**9, 1
    if mode == "one-row":
        return need(1), out_h
    for bands in (7, 5, 3, 2):  # a prime number of bands per sample
        rows = -(-out_h // bands)
        if -(-out_h // rows) == bands:
            return need(rows), bands
    raise AssertionError("no prime split")


def _close(a, b):
    torch.testing.assert_close(a, b, **TOL)


@pytest.mark.parametrize("name", list(CONVS))
@pytest.mark.parametrize("height", [13, 14])
@pytest.mark.parametrize("mode", ["single", "one-row", "prime"])
def test_conv_matches_dense(name, height, mode):
    k, s, p, d, g = CONVS[name]
    torch.manual_seed(0)
    cin, cout, width = 4, 6, 11
    x = torch.randn(2, cin, height, width, dtype=F64, requires_grad=True)
    ref = nn.Conv2d(cin, cout, k, s, p, d, g, bias=True, dtype=F64)
    out_w = RowWindow(k, s, p, d).out_rows(width)
    budget, bands = _budget(RowWindow(k, s, p, d), height, cin * width, cout * out_w, mode)
    big = BigConv2d(cin, cout, k, s, p, d, g, bias=True, max_elements=budget, dtype=F64)
    big.load_state_dict(ref.state_dict())
    strips, _, _ = plan_conv(x.shape, big.weight.shape, big.geometry, budget)
    assert len(strips) == (1 if mode == "single" else 2 * bands)

    y, r = big(x), ref(x)
    _close(y, r)
    gy = torch.randn_like(r)
    got = torch.autograd.grad(y, [x, big.weight, big.bias], gy)
    want = torch.autograd.grad(r, [x, ref.weight, ref.bias], gy)
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    assert big.big_config.meter.peak_tensor_elements <= budget


def test_conv_batch_strips_and_no_input_grad():
    torch.manual_seed(1)
    x = torch.randn(5, 3, 9, 9, dtype=F64)  # input without grad: only weight gradients are computed
    ref = nn.Conv2d(3, 4, 3, 1, 1, bias=False, dtype=F64)
    big = BigConv2d(3, 4, 3, 1, 1, bias=False, max_elements=2 * 4 * 9 * 9, dtype=F64)  # two whole samples
    big.load_state_dict(ref.state_dict())
    strips, _, _ = plan_conv(x.shape, big.weight.shape, big.geometry, big.big_config.max_elements)
    assert [(s.n0, s.n1) for s in strips] == [(0, 2), (2, 4), (4, 5)]
    y, r = big(x), ref(x)
    _close(y, r)
    y.sum().backward()
    r.sum().backward()
    _close(big.weight.grad, ref.weight.grad)


@pytest.mark.parametrize("height", [13, 14])
@pytest.mark.parametrize("mode", ["single", "one-row", "prime"])
def test_maxpool_matches_dense(height, mode):
    torch.manual_seed(0)
    # small integers: many ties, including at the image borders
    x = torch.randint(-2, 3, (2, 3, height, 11)).to(F64).requires_grad_()
    window = RowWindow(3, 2, 1, 1)
    budget, bands = _budget(window, height, 3 * 11, 3 * 6, mode)
    pool = BigMaxPool2d(3, 2, 1, max_elements=budget)
    y, r = pool(x), F.max_pool2d(x, 3, 2, 1)
    _close(y, r)
    gy = torch.randn_like(r)
    _close(torch.autograd.grad(y, x, gy)[0], torch.autograd.grad(r, x, gy)[0])


@pytest.mark.parametrize("height", [13, 14])
@pytest.mark.parametrize("mode", ["single", "one-row", "prime"])
@pytest.mark.parametrize("momentum", [0.1, None])
def test_batchnorm_matches_dense(height, mode, momentum):
    torch.manual_seed(0)
    c, width = 5, 7
    budget, bands = _budget(RowWindow(), height, c * width, c * width, mode)
    ref = nn.BatchNorm2d(c, momentum=momentum, dtype=F64)
    big = BigBatchNorm2d(c, momentum=momentum, max_elements=budget, dtype=F64)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 2.0)
        ref.bias.uniform_(-1, 1)
    big.load_state_dict(ref.state_dict())
    assert len(plan_pointwise((3, c, height, width), budget, "bn")) == (1 if mode == "single" else 3 * bands)
    for _ in range(2):  # two training steps: running statistics and the cumulative-average momentum
        x = (torch.randn(3, c, height, width, dtype=F64) * 3 + 7).requires_grad_()
        y, r = big(x), ref(x)
        _close(y, r)
        gy = torch.randn_like(r)
        got = torch.autograd.grad(y, [x, big.weight, big.bias], gy)
        want = torch.autograd.grad(r, [x, ref.weight, ref.bias], gy)
        for a, b in zip(got, want, strict=True):
            _close(a, b)
    for key, value in ref.state_dict().items():
        _close(big.state_dict()[key].to(F64), value.to(F64))
    assert int(big.num_batches_tracked) == 2

    big.eval()
    ref.eval()
    x = torch.randn(2, c, height, width, dtype=F64, requires_grad=True)
    y, r = big(x), ref(x)
    _close(y, r)
    gy = torch.randn_like(r)
    got = torch.autograd.grad(y, [x, big.weight, big.bias], gy)
    want = torch.autograd.grad(r, [x, ref.weight, ref.bias], gy)
    for a, b in zip(got, want, strict=True):
        _close(a, b)
    assert int(big.num_batches_tracked) == 2  # eval mode does not touch the statistics


def test_batchnorm_single_value_per_channel_is_an_error():
    with pytest.raises(ValueError, match="more than 1 value per channel"):
        BigBatchNorm2d(2)(torch.randn(1, 2, 1, 1))


def test_gradcheck_small_cases():
    torch.manual_seed(0)
    conv = BigConv2d(2, 3, 3, 2, 1, bias=True, max_elements=2 * 4 * 6, dtype=F64)
    x = torch.randn(1, 2, 7, 6, dtype=F64, requires_grad=True)
    w = conv.weight.detach().clone().requires_grad_()
    b = conv.bias.detach().clone().requires_grad_()
    assert len(plan_conv(x.shape, w.shape, conv.geometry, conv.big_config.max_elements)[0]) > 1
    assert torch.autograd.gradcheck(
        lambda x, w, b: BigConv2dFunction.apply(x, w, b, conv.geometry, conv.big_config), (x, w, b))

    cfg = BigConfig(max_elements=6)
    xb = torch.randn(2, 2, 5, 3, dtype=F64, requires_grad=True)
    gamma = torch.rand(2, dtype=F64).add(0.5).requires_grad_()
    beta = torch.randn(2, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x, g, b: BigBatchNorm2dFunction.apply(x, g, b, None, None, None, True, 0.1, 1e-5, cfg),
        (xb, gamma, beta))

    pool = BigMaxPool2d(3, 2, 1, max_elements=2 * 3 * 7)
    xp = torch.randn(1, 2, 9, 7, dtype=F64, requires_grad=True)
    assert torch.autograd.gradcheck(pool, (xp,))


def test_reduced_precision_storage_and_autocast():
    torch.manual_seed(0)
    x = torch.randn(2, 3, 20, 17)
    ref = nn.Conv2d(3, 8, 3, 2, 1)
    big = BigConv2d(3, 8, 3, 2, 1, config=BigConfig(max_elements=300, storage_dtype=torch.float16))
    big.load_state_dict(ref.state_dict())
    y = big(x)
    assert y.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref(x), rtol=2e-3, atol=2e-3)
    bn = BigBatchNorm2d(8, max_elements=200)
    z = bn(y)  # half-precision host input: statistics in float32/float64, output keeps float16
    assert z.dtype == torch.float16
    torch.testing.assert_close(z.float(), F.batch_norm(y.float(), None, None, training=True),
                               rtol=2e-3, atol=4e-3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        ya = BigConv2d(3, 8, 3, 2, 1, max_elements=300).requires_grad_(False)
        ya.load_state_dict(ref.state_dict())
        out = ya(x)
        dense = ref(x)
    assert out.dtype == torch.float32  # host storage keeps the input dtype; compute was bfloat16
    torch.testing.assert_close(out, dense.float(), rtol=0, atol=0.05)


def test_channels_last_host_storage_gives_the_same_results():
    torch.manual_seed(0)
    x = torch.randn(2, 4, 15, 9, dtype=F64, requires_grad=True)
    plain = BigConv2d(4, 5, 3, 2, 1, max_elements=200, dtype=F64)
    cl = BigConv2d(4, 5, 3, 2, 1, config=BigConfig(max_elements=200, channels_last=True), dtype=F64)
    cl.load_state_dict(plain.state_dict())
    y1, y2 = plain(x), cl(x)
    assert y2.is_contiguous(memory_format=torch.channels_last)
    _close(y1, y2)
    _close(torch.autograd.grad(y1.sum(), x)[0], torch.autograd.grad(y2.sum(), x)[0])


def test_bad_arguments_are_named():
    with pytest.raises(ValueError, match="padding_mode must be 'zeros'"):
        BigConv2d(3, 4, 3, padding_mode="reflect")
    with pytest.raises(ValueError, match="padding must be an int"):
        BigConv2d(3, 4, 3, padding="same")
    with pytest.raises(ValueError, match="expects 3 input channels, got 2"):
        BigConv2d(3, 4, 3)(torch.randn(1, 2, 8, 8))
    with pytest.raises(ValueError, match="max_elements must be >= 1"):
        BigConfig(max_elements=0)
