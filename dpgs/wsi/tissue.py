"""Tissue detection: the Big-Layers grey rule per tile, and Otsu's threshold on a thumbnail.

Grey rule (Big-Layers paper, sec. 4.2): a pixel is foreground when its greyscale intensity
``g = 0.299 R + 0.587 G + 0.114 B`` (ITU-R BT.601 luma, as PIL's ``L`` mode) satisfies
``low <= g <= high`` with ``low = 3``, ``high = 230``; a tile is kept when at least ``min_tissue``
(default 0.6) of its pixels are foreground. White glass (g > 230) and black padding (g < 3) are
background.

Otsu (Otsu 1979, as used by CLAM for CAMELYON): on the HSV saturation of a thumbnail (tissue is
coloured, glass is not), optionally median-filtered, the threshold ``t`` maximises the between-class
variance ``w0(t) w1(t) (mu0(t) - mu1(t))^2`` of the 256-bin histogram with class 0 = ``{s <= t}``;
pixels with ``s > t`` are tissue. A tile's tissue fraction is the mean of that mask over the
thumbnail pixels its level-0 footprint covers.
"""

from __future__ import annotations

import numpy as np

GREY_LOW = 3
GREY_HIGH = 230
_LUMA = np.array([0.299, 0.587, 0.114], dtype=np.float32)


def greyscale(rgb: np.ndarray) -> np.ndarray:
    """float32 [..., h, w] BT.601 luma of uint8 RGB [..., h, w, 3]."""
    return np.asarray(rgb, dtype=np.float32) @ _LUMA


def grey_foreground(rgb: np.ndarray, low: float = GREY_LOW, high: float = GREY_HIGH) -> np.ndarray:
    """bool [..., h, w]: ``low <= grey <= high``."""
    g = greyscale(rgb)
    return (g >= low) & (g <= high)


def grey_tissue_fraction(tiles: np.ndarray, low: float = GREY_LOW, high: float = GREY_HIGH) -> np.ndarray:
    """float [...] fraction of foreground pixels of each tile of uint8 [..., h, w, 3]."""
    return grey_foreground(tiles, low, high).mean(axis=(-2, -1))


def otsu_threshold(values: np.ndarray) -> int:
    """Otsu's threshold of uint8 ``values``: class 0 is ``values <= t``; a constant input returns its value.

    Between-class variance for every ``t`` from the cumulative histogram:
    ``sigma_b^2(t) = (mu_T w0(t) - mu(t))^2 / (w0(t) (1 - w0(t)))`` with ``w0`` the cumulative
    probability and ``mu`` the cumulative first moment; the first maximising ``t`` is returned.
    """
    v = np.asarray(values)
    if v.dtype != np.uint8:
        raise ValueError(f"otsu_threshold expects uint8 values, got {v.dtype}")
    if v.size == 0:
        raise ValueError("otsu_threshold of an empty array")
    hist = np.bincount(v.ravel(), minlength=256).astype(np.float64)
    p = hist / hist.sum()
    w0 = np.cumsum(p)
    mu = np.cumsum(p * np.arange(256))
    mu_t = mu[-1]
    denom = w0 * (1.0 - w0)
    with np.errstate(divide="ignore", invalid="ignore"):
        sigma_b = np.where(denom > 0, (mu_t * w0 - mu) ** 2 / denom, -1.0)
    if sigma_b.max() < 0:
        return int(v.ravel()[0])
    return int(np.argmax(sigma_b))


def saturation(rgb: np.ndarray) -> np.ndarray:
    """uint8 HSV saturation ``round(255 (max - min) / max)`` (0 where max = 0) of uint8 RGB [h, w, 3]."""
    arr = np.asarray(rgb, dtype=np.int32)
    mx, mn = arr.max(axis=-1), arr.min(axis=-1)
    sat = np.where(mx > 0, (255 * (mx - mn) + mx // 2) // np.maximum(mx, 1), 0)
    return sat.astype(np.uint8)


def median_filter(img: np.ndarray, size: int) -> np.ndarray:
    """Median over a ``size`` x ``size`` window (odd ``size``), edges replicated; ``size <= 1`` copies."""
    if size <= 1:
        return img.copy()
    if size % 2 == 0:
        raise ValueError(f"median filter size must be odd, got {size}")
    r = size // 2
    padded = np.pad(img, r, mode="edge")
    windows = np.lib.stride_tricks.sliding_window_view(padded, (size, size))
    out = np.empty_like(img)
    for y0 in range(0, img.shape[0], 256):  # bounded memory: 256 rows of windows at a time
        block = windows[y0 : y0 + 256].reshape(-1, img.shape[1], size * size)
        out[y0 : y0 + 256] = np.median(block, axis=-1).astype(img.dtype)
    return out


def otsu_mask(thumbnail: np.ndarray, median: int = 7) -> np.ndarray:
    """bool [h, w] tissue mask of a uint8 RGB thumbnail: median-filtered saturation > Otsu threshold."""
    sat = median_filter(saturation(thumbnail), median)
    return sat > otsu_threshold(sat)


def box_fractions(mask: np.ndarray, boxes: np.ndarray) -> np.ndarray:
    """Mean of ``mask`` [h, w] over each box ``(y0, y1, x0, x1)`` (half-open, at least one pixel each)."""
    integral = np.zeros((mask.shape[0] + 1, mask.shape[1] + 1), dtype=np.int64)
    integral[1:, 1:] = np.cumsum(np.cumsum(mask.astype(np.int64), axis=0), axis=1)
    y0, y1, x0, x1 = (boxes[:, k] for k in range(4))
    total = integral[y1, x1] - integral[y0, x1] - integral[y1, x0] + integral[y0, x0]
    return total / ((y1 - y0) * (x1 - x0))


def footprint_boxes(coords: np.ndarray, size0: int, scale_x: float, scale_y: float, shape) -> np.ndarray:
    """Thumbnail boxes ``(y0, y1, x0, x1)`` covered by level-0 tiles at ``coords`` of side ``size0``.

    ``[floor(x s), ceil((x + size0) s))`` per axis, clipped to the thumbnail and at least one pixel wide.
    """
    h, w = shape
    boxes = np.empty((len(coords), 4), dtype=np.int64)
    for k, (xy, s, limit) in enumerate(((1, scale_y, h), (0, scale_x, w))):
        lo = np.floor(coords[:, xy] * s + 1e-9).astype(np.int64)
        hi = np.ceil((coords[:, xy] + size0) * s - 1e-9).astype(np.int64)
        lo = np.clip(lo, 0, limit - 1)
        hi = np.clip(np.maximum(hi, lo + 1), 1, limit)
        boxes[:, 2 * k], boxes[:, 2 * k + 1] = lo, hi
    return boxes


def thumbnail_scale(level0: tuple[int, int], thumb_shape) -> tuple[float, float]:
    """(x, y) thumbnail pixels per level-0 pixel."""
    return thumb_shape[1] / level0[0], thumb_shape[0] / level0[1]
