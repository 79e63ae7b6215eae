"""Per-slide augmentation: one parameter set per bag, exact geometry, colour round trips, determinism."""

from __future__ import annotations

import colorsys

import numpy as np
import pytest
import torch

from dpgs.wsi.augment import (
    HED_FROM_RGB,
    IMAGENET_MEAN,
    IMAGENET_STD,
    RGB_FROM_HED,
    AugmentConfig,
    BagAugment,
    BagAugmentParams,
    apply_params,
    gaussian_blur,
    hed_to_rgb,
    hsv_to_rgb,
    imagenet_normalize,
    rgb_to_hed,
    rgb_to_hsv,
    sample_params,
    to_float_tiles,
)


@pytest.fixture
def bag():
    return torch.rand(5, 3, 16, 16, generator=torch.Generator().manual_seed(0)) * 0.9 + 0.05


@pytest.mark.parametrize("color", ["hed", "hsv", "none"])
def test_one_parameter_set_for_every_tile(bag, color):
    cfg = AugmentConfig(color=color, blur_probability=1.0)
    params = sample_params(cfg, torch.Generator().manual_seed(3))
    together = apply_params(bag, params)
    one_by_one = torch.stack([apply_params(t, params) for t in bag])
    torch.testing.assert_close(together, one_by_one, rtol=0, atol=1e-6)
    assert params.blur_sigma > 0 and params.color == color


def test_flips_and_rotations_are_exact(bag):
    x = bag.numpy()
    p = BagAugmentParams(hflip=True, vflip=False, rot90=1)
    np.testing.assert_array_equal(apply_params(bag, p).numpy(), np.rot90(x[..., ::-1], k=1, axes=(-2, -1)))
    p = BagAugmentParams(hflip=False, vflip=True, rot90=3)
    np.testing.assert_array_equal(apply_params(bag, p).numpy(), np.rot90(x[..., ::-1, :], k=3, axes=(-2, -1)))
    np.testing.assert_array_equal(apply_params(bag, BagAugmentParams()).numpy(), x)


def test_hed_round_trip_and_ruifrok_matrix(bag):
    torch.testing.assert_close(hed_to_rgb(rgb_to_hed(bag)), bag, rtol=0, atol=1e-5)
    torch.testing.assert_close(RGB_FROM_HED.norm(dim=1), torch.ones(3, dtype=torch.float64))
    torch.testing.assert_close(RGB_FROM_HED @ HED_FROM_RGB, torch.eye(3, dtype=torch.float64))
    # a pure haematoxylin pixel of concentration 0.5 has OD 0.5 * (0.65, 0.70, 0.29) / |.|
    h = torch.tensor([0.5, 0.0, 0.0]).view(1, 3, 1, 1)
    od = torch.tensor([0.65, 0.70, 0.29]) / torch.tensor([0.65, 0.70, 0.29]).norm()
    torch.testing.assert_close(hed_to_rgb(h).view(3), torch.exp(-0.5 * od), rtol=0, atol=1e-6)
    torch.testing.assert_close(rgb_to_hed(hed_to_rgb(h)), h, rtol=0, atol=1e-5)


def test_hed_jitter_scales_stains():
    h = torch.tensor([0.4, 0.2, 0.05]).view(1, 3, 1, 1)
    p = BagAugmentParams(color="hed", jitter=(1.1, 0.9, 1.0, 0.02, -0.01, 0.0))
    out = rgb_to_hed(apply_params(hed_to_rgb(h), p))
    expected = torch.tensor([0.4 * 1.1 + 0.02, 0.2 * 0.9 - 0.01, 0.05]).view(1, 3, 1, 1)
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


def test_hsv_matches_colorsys(bag):
    hsv = rgb_to_hsv(bag)
    for y, x in [(0, 0), (3, 7), (15, 15)]:
        ref = colorsys.rgb_to_hsv(*bag[2, :, y, x].tolist())
        torch.testing.assert_close(hsv[2, :, y, x], torch.tensor(ref, dtype=torch.float32), rtol=0, atol=1e-6)
    torch.testing.assert_close(hsv_to_rgb(hsv), bag, rtol=0, atol=1e-6)
    grey = torch.full((1, 3, 2, 2), 0.5)
    torch.testing.assert_close(rgb_to_hsv(grey)[0, :, 0, 0], torch.tensor([0.0, 0.0, 0.5]))
    p = BagAugmentParams(color="hsv", jitter=(0.25, 0.5, 1.0))
    out = apply_params(torch.tensor([1.0, 0.0, 0.0]).view(1, 3, 1, 1), p)  # red, hue 0 -> 0.25
    ref = colorsys.hsv_to_rgb(0.25, 0.5, 1.0)
    torch.testing.assert_close(out.view(3), torch.tensor(ref, dtype=torch.float32), rtol=0, atol=1e-6)


def test_gaussian_blur_against_dense_reference():
    x = torch.rand(2, 3, 12, 10, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    sigma = 0.8
    out = gaussian_blur(x, sigma)
    r = 3  # ceil(3 * 0.8)
    i = torch.arange(-r, r + 1, dtype=torch.float64)
    k = torch.exp(-(i**2) / (2 * sigma**2))
    k = k / k.sum()
    padded = np.pad(x.numpy(), ((0, 0), (0, 0), (r, r), (r, r)), mode="reflect")
    ref = np.zeros_like(x.numpy())
    for dy in range(2 * r + 1):
        for dx in range(2 * r + 1):
            ref += k[dy].item() * k[dx].item() * padded[..., dy : dy + 12, dx : dx + 10]
    np.testing.assert_allclose(out.numpy(), ref, atol=1e-12)
    torch.testing.assert_close(
        gaussian_blur(torch.full((1, 3, 8, 8), 0.3), 1.0), torch.full((1, 3, 8, 8), 0.3)
    )


def test_deterministic_given_a_generator(bag):
    aug = BagAugment(AugmentConfig(blur_probability=0.5))
    a, pa = aug(bag, torch.Generator().manual_seed(7))
    b, pb = aug(bag, torch.Generator().manual_seed(7))
    assert pa == pb
    torch.testing.assert_close(a, b, rtol=0, atol=0)
    drawn = {sample_params(aug.cfg, torch.Generator().manual_seed(s)) for s in range(20)}
    assert len(drawn) == 20
    assert {p.rot90 for p in drawn} == {0, 1, 2, 3} and {p.hflip for p in drawn} == {False, True}
    for p in drawn:
        assert all(0.95 <= a <= 1.05 for a in p.jitter[:3]) and all(-0.05 <= b <= 0.05 for b in p.jitter[3:])
        assert p.blur_sigma == 0 or 0.1 <= p.blur_sigma <= 1.0
    assert float(a.min()) >= 0 and float(a.max()) <= 1


def test_disabled_geometry_and_validation(bag):
    cfg = AugmentConfig(flips=False, rotations=False, color="none", blur_probability=0)
    for s in range(5):
        p = sample_params(cfg, torch.Generator().manual_seed(s))
        assert p == BagAugmentParams()
    with pytest.raises(ValueError, match="augment color"):
        AugmentConfig(color="lab")
    with pytest.raises(ValueError, match="blur_sigma"):
        AugmentConfig(blur_sigma=(0.0, 1.0))
    with pytest.raises(ValueError, match=r"tiles \[N, 3, h, w\]"):
        apply_params(torch.zeros(2, 4, 8, 8), BagAugmentParams())


def test_float_tiles_and_imagenet_normalisation():
    raw = np.random.default_rng(0).integers(0, 256, size=(2, 4, 5, 3), dtype=np.uint8)
    x = to_float_tiles(raw)
    assert x.shape == (2, 3, 4, 5) and x.dtype == torch.float32
    torch.testing.assert_close(x[1, 2, 3, 4], torch.tensor(raw[1, 3, 4, 2] / 255.0, dtype=torch.float32))
    n = imagenet_normalize(x)
    torch.testing.assert_close(n[0, 1], (x[0, 1] - IMAGENET_MEAN[1]) / IMAGENET_STD[1])
    with pytest.raises(ValueError, match="uint8 tiles"):
        to_float_tiles(raw.astype(np.float32))
