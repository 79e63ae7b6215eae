"""Synthetic pyramidal TIFF slides, so the slide pipeline (tile, train on tiles, heatmaps) runs offline.

:func:`write_pyramid_tiff` writes an RGB image as a tiled pyramid that tiffslide and OpenSlide read:

* with ``objective_power`` (and optionally ``mpp``): an Aperio-SVS-like layout (baseline page whose
  ImageDescription starts ``Aperio`` and carries ``|AppMag = 20|MPP = 0.5``, a stripped thumbnail page,
  then the reduced levels), so readers report the objective power and the pixel size;
* with ``mpp`` only: a generic pyramidal TIFF (levels in SubIFDs) whose resolution tags give the mpp;
* with neither: a generic pyramidal TIFF without physical metadata.

Level ``k`` is the 2^k x 2^k box mean of level 0 (the image is cropped to a multiple of 2^(levels-1)).

:func:`write_synthetic_slides` renders H&E-like slides: a near-white background (grey > 230), pink
stroma blobs with purple nuclei, and on positive slides (label 1) one or two "tumour" regions inside the
tissue whose nuclei are about twice as large and twice as dense, in the same colours as normal tissue, so
the label is learnable from the texture of a few tiles and not from the colour of the slide.
``tumour_contrast`` (0 < c <= 1, default 1) sets how far that texture is from normal tissue: the
tumour's nuclei are drawn like normal ones (noise pitch ``NUCLEUS_SCALE``, threshold
``NUCLEUS_THRESHOLD``) moved a fraction c of the way to the full tumour texture (pitch
``TUMOUR_NUCLEUS_SCALE``, threshold ``TUMOUR_NUCLEUS_THRESHOLD``); c = 1 is the texture above, a smaller
c a harder task (an encoder needs more steps to separate the classes).
"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import numpy as np

from dpgs.staging import staged_directory

MARKER = "demo_slides.json"
NUCLEUS_RGB = np.array([96, 64, 158], np.float32)
# Normal tissue: nuclei where smooth noise of pitch 3 px exceeds 0.82 (~10% of the area).
NUCLEUS_SCALE = 3.0
NUCLEUS_THRESHOLD = 0.82
# Tumour: the same stroma and nucleus colour as normal tissue, but nuclei about twice as large and twice
# as dense (~20% of the area against ~10%): a texture a trained encoder learns and a colour histogram
# (or a random frozen encoder) barely separates.
TUMOUR_NUCLEUS_SCALE = 6.0
TUMOUR_NUCLEUS_THRESHOLD = 0.72
SPLITS = ("train", "val", "test")


def pyramid_levels(image: np.ndarray, levels: int) -> list[np.ndarray]:
    """Level 0 cropped to a multiple of 2^(levels-1), then successive 2x2 box means (rounded)."""
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise ValueError(f"image must be uint8 [H, W, 3], got {image.dtype} {image.shape}")
    if levels < 1:
        raise ValueError(f"levels must be >= 1, got {levels}")
    m = 1 << (levels - 1)
    h, w = image.shape[0] // m * m, image.shape[1] // m * m
    if h == 0 or w == 0:
        raise ValueError(f"image {image.shape[1]}x{image.shape[0]} is too small for {levels} levels")
    out = [np.ascontiguousarray(image[:h, :w])]
    for _ in range(1, levels):
        prev = out[-1].astype(np.uint16)
        down = (prev[0::2, 0::2] + prev[1::2, 0::2] + prev[0::2, 1::2] + prev[1::2, 1::2] + 2) // 4
        out.append(down.astype(np.uint8))
    return out


def write_pyramid_tiff(
    path: str | Path,
    image: np.ndarray,
    levels: int = 3,
    tile: int = 256,
    objective_power: float | None = 20,
    mpp: float | None = 0.5,
    compression: str = "zlib",
) -> Path:
    """Write ``image`` (uint8 [H, W, 3]) as a tiled pyramid with ``levels`` levels; see module docstring."""
    import tifffile

    path = Path(path)
    pyramid = pyramid_levels(image, levels)
    h, w = pyramid[0].shape[:2]
    common = dict(photometric="rgb", metadata=None)
    tiled = dict(tile=(tile, tile), compression=compression, **common)
    with tifffile.TiffWriter(path) as tw:
        if objective_power is not None:
            fields = [f"AppMag = {objective_power:g}"] + ([f"MPP = {mpp:g}"] if mpp is not None else [])
            desc = (
                f"Aperio Image Library dpgs-synthetic\r\n{w}x{h} [0,0 {w}x{h}] ({tile}x{tile}) "
                f"{compression}|" + "|".join(fields)
            )
            tw.write(pyramid[0], description=desc, **tiled)
            step = max(1, max(h, w) // 256)
            tw.write(
                np.ascontiguousarray(pyramid[0][::step, ::step]), description="Aperio thumbnail", **common
            )
            for level in pyramid[1:]:
                tw.write(level, description="Aperio level", **tiled)
        else:
            res = {}
            if mpp is not None:
                res = dict(resolution=(1e4 / mpp, 1e4 / mpp), resolutionunit="CENTIMETER")
            tw.write(pyramid[0], subifds=levels - 1, **res, **tiled)
            for level in pyramid[1:]:
                tw.write(level, subfiletype=1, **tiled)
    return path


def smooth_noise(rng: np.random.Generator, height: int, width: int, scale: float) -> np.ndarray:
    """float32 [height, width] in [0, 1]: uniform noise on a grid of pitch ``scale`` px, bicubic upsampled."""
    from PIL import Image

    gh, gw = max(2, int(height / scale) + 2), max(2, int(width / scale) + 2)
    coarse = Image.fromarray(rng.random((gh, gw), dtype=np.float32), mode="F")
    return np.asarray(coarse.resize((width, height), Image.Resampling.BICUBIC), dtype=np.float32)


def _ellipses(rng, yy, xx, n, centres, radius_range, wobble) -> np.ndarray:
    mask = np.zeros(yy.shape, dtype=bool)
    size = min(yy.shape)
    for k in range(n):
        cy, cx = centres[k]
        a, b = rng.uniform(*radius_range, size=2) * size
        t = rng.uniform(0, np.pi)
        dy, dx = yy - cy, xx - cx
        u = (dx * np.cos(t) + dy * np.sin(t)) / a
        v = (-dx * np.sin(t) + dy * np.cos(t)) / b
        mask |= u * u + v * v <= 1.0 + wobble
    return mask


def tumour_nuclei_texture(contrast: float) -> tuple[float, float]:
    """(noise pitch px, threshold) of tumour nuclei at ``contrast`` c in (0, 1]: the normal texture
    moved the fraction c of the way to the full tumour texture (linear in both)."""
    if not 0.0 < contrast <= 1.0:
        raise ValueError(f"tumour_contrast must be in (0, 1], got {contrast}")
    scale = NUCLEUS_SCALE + contrast * (TUMOUR_NUCLEUS_SCALE - NUCLEUS_SCALE)
    threshold = NUCLEUS_THRESHOLD + contrast * (TUMOUR_NUCLEUS_THRESHOLD - NUCLEUS_THRESHOLD)
    return scale, threshold


def render_slide(
    height: int, width: int, positive: bool, rng: np.random.Generator, tumour_contrast: float = 1.0
) -> tuple[np.ndarray, dict]:
    """uint8 RGB [height, width, 3] H&E-like image and its tissue / tumour masks."""
    t_scale, t_threshold = tumour_nuclei_texture(tumour_contrast)
    yy, xx = np.mgrid[0:height, 0:width].astype(np.float32)
    wobble = 0.6 * (smooth_noise(rng, height, width, 48) - 0.5)
    n_blobs = int(rng.integers(2, 5))
    centres = np.stack(
        [rng.uniform(0.25, 0.75, n_blobs) * height, rng.uniform(0.25, 0.75, n_blobs) * width], axis=1
    )
    tissue = _ellipses(rng, yy, xx, n_blobs, centres, (0.12, 0.28), wobble)

    img = np.empty((height, width, 3), dtype=np.float32)
    img[:] = np.array([243, 242, 245], np.float32)
    shade = smooth_noise(rng, height, width, 24)[..., None]
    stroma = np.array([236, 168, 206], np.float32) + (shade - 0.5) * np.array([20, 40, 25], np.float32)
    nuclei = smooth_noise(rng, height, width, NUCLEUS_SCALE) > NUCLEUS_THRESHOLD
    img[tissue] = stroma[tissue]
    img[tissue & nuclei] = NUCLEUS_RGB

    tumour = np.zeros_like(tissue)
    if positive:
        inside = np.argwhere(tissue)
        n_regions = int(rng.integers(1, 3))
        picks = inside[rng.integers(0, len(inside), n_regions)].astype(np.float32)
        tumour = _ellipses(rng, yy, xx, n_regions, picks, (0.07, 0.13), 0.3 * wobble) & tissue
        t_nuclei = smooth_noise(rng, height, width, t_scale) > t_threshold
        img[tumour] = stroma[tumour]
        img[tumour & t_nuclei] = NUCLEUS_RGB
    img += rng.normal(0.0, 4.0, size=img.shape).astype(np.float32)
    return np.clip(np.rint(img), 0, 255).astype(np.uint8), {"tissue": tissue, "tumour": tumour}


def _split_of(rank: int, count: int) -> str:
    """Within one class: the first ~20% test, the next ~20% val, the rest train."""
    n_hold = max(1, round(0.2 * count)) if count >= 3 else 0
    return "test" if rank < n_hold else "val" if rank < 2 * n_hold else "train"


def _check_target(out_dir: Path) -> None:
    if out_dir.exists() and (
        not out_dir.is_dir() or (any(out_dir.iterdir()) and not (out_dir / MARKER).exists())
    ):
        raise FileExistsError(
            f"{out_dir} exists and is not a dpgs synthetic-slides directory (no {MARKER}); "
            "choose an empty or new directory"
        )


def write_synthetic_slides(
    out_dir: str | Path,
    n_slides: int = 8,
    seed: int = 0,
    size: tuple[int, int] = (1536, 1024),
    levels: int = 3,
    objective_power: float = 20,
    mpp: float = 0.5,
    tumour_contrast: float = 1.0,
) -> Path:
    """Write ``n_slides`` synthetic slides and their manifest into ``out_dir``; returns the manifest path.

    Layout: ``out_dir/slides/{slide_id}.tif`` (``size`` = level-0 ``(width, height)``, ``levels`` levels,
    SVS-like metadata ``AppMag = objective_power``, ``MPP = mpp``), ``out_dir/manifest.csv`` with
    ``slide_id,label,case_id,split`` (labels 0/1 alternate, one case per slide, ~60/20/20 train/val/test
    within each label) and ``out_dir/demo_slides.json`` (parameters and per-slide tissue and tumour
    fractions); ``tumour_contrast``: see the module docstring. ``out_dir`` must be new, empty or a
    previous synthetic-slides directory (replaced).
    """
    if n_slides < 2:
        raise ValueError(f"n_slides must be >= 2 (one per class), got {n_slides}")
    tumour_nuclei_texture(tumour_contrast)  # refuses a contrast outside (0, 1] before anything is written
    width, height = (int(v) for v in size)
    if min(width, height) < 64 << (levels - 1):
        raise ValueError(
            f"size {width}x{height} is too small for {levels} levels (min side {64 << (levels - 1)})"
        )
    out_dir = Path(out_dir)
    _check_target(out_dir)
    with staged_directory(out_dir) as tmp:
        (tmp / "slides").mkdir()
        labels = [i % 2 for i in range(n_slides)]
        counts = {c: labels.count(c) for c in (0, 1)}
        ranks = {0: 0, 1: 0}
        rows, info = [], []
        for i, label in enumerate(labels):
            slide_id = f"slide_{i:03d}"
            rng = np.random.default_rng([seed, i])
            image, masks = render_slide(height, width, bool(label), rng, tumour_contrast)
            write_pyramid_tiff(tmp / "slides" / f"{slide_id}.tif", image, levels, 256, objective_power, mpp)
            split = _split_of(ranks[label], counts[label])
            ranks[label] += 1
            rows.append((slide_id, label, f"case_{i:03d}", split))
            info.append(
                {
                    "slide_id": slide_id,
                    "label": label,
                    "tissue_fraction": round(float(masks["tissue"].mean()), 4),
                    "tumour_fraction": round(float(masks["tumour"].mean()), 4),
                }
            )
        with (tmp / "manifest.csv").open("w", newline="") as fh:
            writer = csv.writer(fh)
            writer.writerow(["slide_id", "label", "case_id", "split"])
            writer.writerows(rows)
        summary = {
            "n_slides": n_slides,
            "seed": seed,
            "size": [width, height],
            "levels": levels,
            "objective_power": objective_power,
            "mpp": mpp,
            "tumour_contrast": tumour_contrast,
            "split_counts": {s: sum(r[3] == s for r in rows) for s in SPLITS},
            "slides": info,
        }
        (tmp / MARKER).write_text(json.dumps(summary, indent=2))
    return out_dir / "manifest.csv"


def read_summary(out_dir: str | Path) -> dict:
    """The parameters and per-slide fractions recorded in ``demo_slides.json``."""
    return json.loads((Path(out_dir) / MARKER).read_text())
