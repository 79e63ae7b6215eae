"""Per-slide augmentation of tile bags (Big-Layers paper, sec. 4.2.6) and ImageNet normalisation.

One parameter set is drawn per bag (:func:`sample_params`, from a ``torch.Generator``, so a seed fixes
it) and applied identically to every tile of the bag (:func:`apply_params`), in this order:

1. horizontal flip, vertical flip, rotation by ``k * 90`` degrees (counter-clockwise, ``torch.rot90``);
2. colour jitter, either
   * ``hed`` (Tellez et al. 2018): optical density ``OD = -ln(max(rgb, eps))`` is unmixed into
     haematoxylin, eosin and DAB with the Ruifrok & Johnston (2001) stain matrix ``M`` (rows: stain
     OD vectors in RGB, unit norm), ``stains = OD M^-1``; each stain is scaled and shifted,
     ``s' = alpha s + beta`` with ``alpha ~ U[1 - a, 1 + a]``, ``beta ~ U[-b, b]``; back to RGB with
     ``rgb = exp(-s' M)``. Without jitter the round trip is exact for ``rgb >= eps``;
   * ``hsv``: hue shifted by ``U[-h, h]`` (mod 1), saturation and value scaled by ``U[1 - s, 1 + s]`` and
     ``U[1 - v, 1 + v]``;
3. Gaussian blur with probability ``blur_probability``, ``sigma ~ U[blur_sigma]``: separable kernel
   ``exp(-i^2 / (2 sigma^2))``, ``|i| <= ceil(3 sigma)``, normalised, reflect padding;
4. clamp to [0, 1].

Tiles are float [N, 3, h, w] (or [3, h, w]) in [0, 1]; :func:`to_float_tiles` converts uint8
[N, h, w, 3] and :func:`imagenet_normalize` applies ``(x - mean) / std`` with ImageNet statistics.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
COLOR_MODES = ("hed", "hsv", "none")
OD_EPS = 1e-6

_RUIFROK = torch.tensor([[0.65, 0.70, 0.29], [0.07, 0.99, 0.11], [0.27, 0.57, 0.78]], dtype=torch.float64)
RGB_FROM_HED = _RUIFROK / _RUIFROK.norm(dim=1, keepdim=True)
HED_FROM_RGB = torch.linalg.inv(RGB_FROM_HED)


def to_float_tiles(tiles) -> torch.Tensor:
    """uint8 [N, h, w, 3] (numpy or torch) -> float32 [N, 3, h, w] in [0, 1]."""
    if isinstance(tiles, np.ndarray) and not tiles.flags.writeable:
        tiles = tiles.copy()  # torch does not wrap read-only arrays
    t = torch.as_tensor(tiles)
    if t.dtype != torch.uint8 or t.ndim != 4 or t.shape[-1] != 3:
        raise ValueError(f"expected uint8 tiles [N, h, w, 3], got {t.dtype} {tuple(t.shape)}")
    return t.permute(0, 3, 1, 2).to(torch.float32).div_(255.0).contiguous()


def imagenet_normalize(x: torch.Tensor) -> torch.Tensor:
    """``(x - mean) / std`` per channel of [..., 3, h, w] in [0, 1]."""
    mean = torch.tensor(IMAGENET_MEAN, dtype=x.dtype, device=x.device).view(3, 1, 1)
    std = torch.tensor(IMAGENET_STD, dtype=x.dtype, device=x.device).view(3, 1, 1)
    return (x - mean) / std


def _mix(x: torch.Tensor, matrix: torch.Tensor) -> torch.Tensor:
    """Per pixel row vector times ``matrix``: ``out[c'] = sum_c x[c] matrix[c, c']`` over dim -3."""
    return torch.einsum("...chw,cd->...dhw", x, matrix.to(dtype=x.dtype, device=x.device))


def rgb_to_hed(rgb: torch.Tensor) -> torch.Tensor:
    """Stain concentrations [..., 3 (H, E, D), h, w] of RGB [..., 3, h, w] in [0, 1]."""
    od = -torch.log(rgb.clamp(min=OD_EPS))
    return _mix(od, HED_FROM_RGB)


def hed_to_rgb(hed: torch.Tensor) -> torch.Tensor:
    """RGB [..., 3, h, w] in [0, 1] of stain concentrations (inverse of :func:`rgb_to_hed`)."""
    return torch.exp(-_mix(hed, RGB_FROM_HED)).clamp(0.0, 1.0)


def rgb_to_hsv(rgb: torch.Tensor) -> torch.Tensor:
    """HSV [..., 3, h, w] with every channel in [0, 1] (hue in turns) of RGB [..., 3, h, w] in [0, 1]."""
    r, g, b = rgb.unbind(-3)
    mx, argmax = rgb.max(dim=-3)
    mn = rgb.min(dim=-3).values
    delta = mx - mn
    safe = torch.where(delta > 0, delta, torch.ones_like(delta))
    hue = torch.where(
        argmax == 0,
        ((g - b) / safe) % 6.0,
        torch.where(argmax == 1, (b - r) / safe + 2.0, (r - g) / safe + 4.0),
    )
    hue = torch.where(delta > 0, hue / 6.0, torch.zeros_like(hue)) % 1.0
    sat = torch.where(mx > 0, delta / torch.where(mx > 0, mx, torch.ones_like(mx)), torch.zeros_like(mx))
    return torch.stack([hue, sat, mx], dim=-3)


def hsv_to_rgb(hsv: torch.Tensor) -> torch.Tensor:
    """RGB [..., 3, h, w] of HSV [..., 3, h, w] (inverse of :func:`rgb_to_hsv`)."""
    h, s, v = hsv.unbind(-3)
    # standard closed form: channel n uses k = (n + 6h) mod 6, value v - v s max(0, min(k, 4 - k, 1))
    out = []
    for n in (5.0, 3.0, 1.0):
        k = (n + h * 6.0) % 6.0
        out.append(v - v * s * torch.clamp(torch.minimum(k, 4.0 - k), 0.0, 1.0))
    return torch.stack(out, dim=-3)


def gaussian_kernel(sigma: float, dtype=torch.float32) -> torch.Tensor:
    """Normalised 1-D Gaussian of radius ``ceil(3 sigma)``."""
    radius = max(1, math.ceil(3.0 * sigma))
    i = torch.arange(-radius, radius + 1, dtype=torch.float64)
    k = torch.exp(-(i * i) / (2.0 * sigma * sigma))
    return (k / k.sum()).to(dtype)


def gaussian_blur(x: torch.Tensor, sigma: float) -> torch.Tensor:
    """Separable Gaussian blur of [N, C, h, w] (reflect padding); ``sigma <= 0`` returns ``x``."""
    if sigma <= 0:
        return x
    k = gaussian_kernel(sigma, x.dtype).to(x.device)
    r = (len(k) - 1) // 2
    if r >= min(x.shape[-2:]):
        raise ValueError(f"blur sigma {sigma} needs tiles larger than {2 * r} px, got {tuple(x.shape[-2:])}")
    c = x.shape[1]
    x = F.conv2d(F.pad(x, (r, r, 0, 0), mode="reflect"), k.view(1, 1, 1, -1).expand(c, 1, 1, -1), groups=c)
    return F.conv2d(F.pad(x, (0, 0, r, r), mode="reflect"), k.view(1, 1, -1, 1).expand(c, 1, -1, 1), groups=c)


@dataclass(frozen=True)
class AugmentConfig:
    """Ranges of the per-bag augmentation; ``color`` is ``hed``, ``hsv`` or ``none``."""

    flips: bool = True
    rotations: bool = True
    color: str = "hed"
    hed_alpha: float = 0.05
    hed_beta: float = 0.05
    hue: float = 0.04
    saturation: float = 0.2
    brightness: float = 0.2
    blur_probability: float = 0.5
    blur_sigma: tuple[float, float] = (0.1, 1.0)

    def __post_init__(self):
        if self.color not in COLOR_MODES:
            raise ValueError(f"augment color must be one of {', '.join(COLOR_MODES)}, got '{self.color}'")
        for name in ("hed_alpha", "hed_beta", "hue", "saturation", "brightness"):
            if not 0 <= getattr(self, name) < 1:
                raise ValueError(f"augment {name} must be in [0, 1), got {getattr(self, name)}")
        if not 0 <= self.blur_probability <= 1:
            raise ValueError(f"augment blur_probability must be in [0, 1], got {self.blur_probability}")
        lo, hi = self.blur_sigma
        if not 0 < lo <= hi:
            raise ValueError(f"augment blur_sigma must be 0 < low <= high, got {self.blur_sigma}")


@dataclass(frozen=True)
class BagAugmentParams:
    """One bag's augmentation: ``blur_sigma = 0`` means no blur; ``jitter`` is colour-mode specific.

    ``hed``: ``jitter = (alpha_H, alpha_E, alpha_D, beta_H, beta_E, beta_D)``;
    ``hsv``: ``jitter = (hue shift, saturation factor, value factor)``; ``none``: ``()``.
    """

    hflip: bool = False
    vflip: bool = False
    rot90: int = 0
    color: str = "none"
    jitter: tuple[float, ...] = ()
    blur_sigma: float = 0.0


def sample_params(cfg: AugmentConfig, generator: torch.Generator | None = None) -> BagAugmentParams:
    """Draw one parameter set; always consumes 11 uniforms of ``generator`` (fixed stream layout)."""
    u = torch.rand(11, generator=generator, dtype=torch.float64).tolist()
    hflip = cfg.flips and u[0] < 0.5
    vflip = cfg.flips and u[1] < 0.5
    rot = min(3, int(u[2] * 4)) if cfg.rotations else 0
    if cfg.color == "hed":
        alphas = [1.0 + cfg.hed_alpha * (2 * v - 1) for v in u[3:6]]
        betas = [cfg.hed_beta * (2 * v - 1) for v in u[6:9]]
        jitter = tuple(alphas + betas)
    elif cfg.color == "hsv":
        jitter = (
            cfg.hue * (2 * u[3] - 1),
            1.0 + cfg.saturation * (2 * u[4] - 1),
            1.0 + cfg.brightness * (2 * u[5] - 1),
        )
    else:
        jitter = ()
    lo, hi = cfg.blur_sigma
    sigma = lo + (hi - lo) * u[10] if u[9] < cfg.blur_probability else 0.0
    return BagAugmentParams(hflip, vflip, rot, cfg.color, jitter, sigma)


def apply_params(x: torch.Tensor, p: BagAugmentParams) -> torch.Tensor:
    """Apply ``p`` to every tile of ``x`` ([N, 3, h, w] or [3, h, w], values in [0, 1])."""
    single = x.ndim == 3
    if single:
        x = x.unsqueeze(0)
    if x.ndim != 4 or x.shape[1] != 3:
        raise ValueError(f"expected tiles [N, 3, h, w], got {tuple(x.shape)}")
    if p.hflip:
        x = torch.flip(x, dims=(-1,))
    if p.vflip:
        x = torch.flip(x, dims=(-2,))
    if p.rot90:
        x = torch.rot90(x, k=p.rot90, dims=(-2, -1))
    if p.color == "hed":
        a = torch.tensor(p.jitter[:3], dtype=x.dtype, device=x.device).view(3, 1, 1)
        b = torch.tensor(p.jitter[3:], dtype=x.dtype, device=x.device).view(3, 1, 1)
        x = hed_to_rgb(rgb_to_hed(x) * a + b)
    elif p.color == "hsv":
        hsv = rgb_to_hsv(x)
        dh, fs, fv = p.jitter
        h = (hsv[:, 0] + dh) % 1.0
        s = (hsv[:, 1] * fs).clamp(0.0, 1.0)
        v = (hsv[:, 2] * fv).clamp(0.0, 1.0)
        x = hsv_to_rgb(torch.stack([h, s, v], dim=1))
    x = gaussian_blur(x, p.blur_sigma).clamp(0.0, 1.0)
    return x[0] if single else x


class BagAugment:
    """``augment(x, generator) -> (augmented x, params)``: one draw per call, applied to every tile."""

    def __init__(self, cfg: AugmentConfig | None = None):
        self.cfg = cfg or AugmentConfig()

    def __call__(self, x: torch.Tensor, generator: torch.Generator | None = None):
        params = sample_params(self.cfg, generator)
        return apply_params(x, params), params
