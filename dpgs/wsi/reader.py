"""Whole-slide image readers: one small :class:`Slide` interface over tiffslide and OpenSlide.

``open_slide(path, backend="auto")`` opens a slide with tiffslide (pure Python, the default) and falls
back to OpenSlide when tiffslide cannot read the file and ``openslide`` is importable (for example MRXS).
``backend="openslide"`` forces OpenSlide. Every failure raises :class:`SlideReadError` naming the file.

Coordinates follow OpenSlide: ``(x, y)`` are level-0 pixel positions of the top-left corner, sizes are
``(width, height)`` in pixels of the level read. Pixels come back as uint8 RGB arrays [h, w, 3]; grey
slides are repeated to three channels, transparent pixels inside the slide (OpenSlide's regions without
data) are white, and pixels outside the slide are black with either backend.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np

BACKENDS = ("auto", "tiffslide", "openslide")
# Regions are read in blocks of at most this many pixels when a whole level is reduced (thumbnails).
_BLOCK_PIXELS = 1 << 24


class SlideReadError(OSError):
    """A slide could not be opened or read; the message names the file and the reason."""

    def __init__(self, path: str | Path, reason: str):
        self.path = str(path)
        self.reason = reason
        super().__init__(f"cannot read slide {self.path}: {reason}")


def openslide_available() -> bool:
    """True when ``import openslide`` works (the optional ``dpgs[openslide]`` extra)."""
    try:
        import openslide  # noqa: F401
    except (ImportError, OSError):
        return False
    return True


def _to_float(value) -> float | None:
    try:
        out = float(value)
    except (TypeError, ValueError):
        return None
    return out if math.isfinite(out) and out > 0 else None


def _as_rgb(arr: np.ndarray, path: str) -> np.ndarray:
    """uint8 [h, w, 3] from grey [h, w] / [h, w, 1], RGB or RGBA (alpha 0 -> white)."""
    arr = np.asarray(arr)
    if arr.dtype != np.uint8:
        raise SlideReadError(path, f"pixel type {arr.dtype} is not supported (expected 8-bit RGB)")
    if arr.ndim == 2:
        arr = arr[..., None]
    channels = arr.shape[2]
    if channels == 1:
        return np.repeat(arr, 3, axis=2)
    if channels == 3:
        return np.ascontiguousarray(arr)
    if channels == 4:
        rgb = arr[..., :3].copy()
        rgb[arr[..., 3] == 0] = 255
        return rgb
    raise SlideReadError(path, f"{channels} channels are not supported (expected grey, RGB or RGBA)")


class Slide:
    """An open slide. Subclasses provide ``_read(x, y, level, w, h)``; use :func:`open_slide`.

    Attributes: ``path``, ``backend``, ``level_count``, ``level_dimensions`` (tuple of ``(w, h)``),
    ``level_downsamples`` (level-0 pixels per level pixel), ``objective_power`` and ``mpp`` (microns per
    level-0 pixel, mean of x and y) from the file's metadata or ``None``.
    """

    backend = ""

    def __init__(self, path: str, level_dimensions, level_downsamples, objective_power, mpp):
        self.path = path
        self.level_dimensions = tuple((int(w), int(h)) for w, h in level_dimensions)
        self.level_downsamples = tuple(float(d) for d in level_downsamples)
        self.level_count = len(self.level_dimensions)
        self.objective_power = _to_float(objective_power)
        self.mpp = _to_float(mpp)
        if self.level_count == 0:
            raise SlideReadError(path, "the file holds no image levels")

    @property
    def dimensions(self) -> tuple[int, int]:
        """Level-0 ``(width, height)``."""
        return self.level_dimensions[0]

    @property
    def magnification(self) -> float | None:
        """Level-0 magnification: the objective power, else ``10 / mpp`` (0.25 um/px -> 40x), else None."""
        if self.objective_power is not None:
            return self.objective_power
        if self.mpp is not None:
            return 10.0 / self.mpp
        return None

    def _check_level(self, level: int) -> None:
        if not 0 <= level < self.level_count:
            raise SlideReadError(
                self.path, f"level {level} does not exist (levels 0..{self.level_count - 1})"
            )

    def read_region(self, xy: tuple[int, int], level: int, size: tuple[int, int]) -> np.ndarray:
        """uint8 RGB [h, w, 3] of the region whose top-left is level-0 ``xy``, ``size=(w, h)`` at ``level``.

        Parts outside the level's bounds read as black (value 0) with every backend (tiffslide pads with
        black, OpenSlide returns them transparent, which would be white); level pixel ``floor(x / d)``
        is the first column read, as both backends place it.
        """
        self._check_level(level)
        w, h = int(size[0]), int(size[1])
        if w <= 0 or h <= 0:
            raise ValueError(f"region size must be positive, got {size}")
        try:
            arr = self._read(int(xy[0]), int(xy[1]), level, w, h)
        except SlideReadError:
            raise
        except Exception as err:  # decoder errors of the backends have no common base class
            raise SlideReadError(self.path, f"reading {w}x{h} at {tuple(xy)} level {level}: {err}") from err
        arr = _as_rgb(arr, self.path)
        if arr.shape[:2] != (h, w):
            raise SlideReadError(self.path, f"backend returned {arr.shape[:2]} for a {h}x{w} region")
        return self._black_outside(arr, int(xy[0]), int(xy[1]), level)

    def _black_outside(self, arr: np.ndarray, x: int, y: int, level: int) -> np.ndarray:
        """``arr`` with the pixels outside the level's bounds set to 0."""
        ds = self.level_downsamples[level]
        lw, lh = self.level_dimensions[level]
        lx, ly = math.floor(x / ds + 1e-9), math.floor(y / ds + 1e-9)
        h, w = arr.shape[:2]
        x0, x1 = min(w, max(0, -lx)), max(0, min(w, lw - lx))
        y0, y1 = min(h, max(0, -ly)), max(0, min(h, lh - ly))
        if (x0, x1, y0, y1) == (0, w, 0, h):
            return arr
        out = np.zeros_like(arr)
        out[y0:y1, x0:x1] = arr[y0:y1, x0:x1]
        return out

    def thumbnail(self, max_size: int = 1024) -> np.ndarray:
        """uint8 RGB [th, tw, 3] of the whole slide, the longer side ``min(max_size, level-0 side)``.

        ``tw = round(W0 * s)``, ``th = round(H0 * s)`` with ``s = max_size / max(W0, H0)`` (at least 1 px).
        The smallest level at least as large as the thumbnail is read in blocks, each reduced by an
        integer box mean, and the result resized (Lanczos) to the exact thumbnail size.
        """
        from PIL import Image

        w0, h0 = self.dimensions
        scale = min(1.0, max_size / max(w0, h0))
        tw, th = max(1, round(w0 * scale)), max(1, round(h0 * scale))
        level = 0
        for lvl in range(self.level_count):
            lw, lh = self.level_dimensions[lvl]
            if lw >= tw and lh >= th:
                level = lvl
        lw, lh = self.level_dimensions[level]
        factor = max(1, min(lw // tw, lh // th))
        rows = max(factor, (_BLOCK_PIXELS // max(lw, 1)) // factor * factor)
        usable_w, usable_h = lw // factor * factor, lh // factor * factor
        ds = self.level_downsamples[level]
        parts = []
        for y in range(0, usable_h, rows):
            hh = min(rows, usable_h - y)
            # ceil keeps int(y0 / ds) == y for non-integer downsamples
            block = self.read_region((0, math.ceil(y * ds)), level, (usable_w, hh))
            if factor > 1:
                b = block.reshape(hh // factor, factor, usable_w // factor, factor, 3).astype(np.float32)
                block = np.rint(b.mean(axis=(1, 3))).astype(np.uint8)
            parts.append(block)
        reduced = np.concatenate(parts, axis=0)
        if reduced.shape[:2] != (th, tw):
            reduced = np.asarray(Image.fromarray(reduced).resize((tw, th), Image.Resampling.LANCZOS))
        return reduced

    def _read(self, x: int, y: int, level: int, w: int, h: int) -> np.ndarray:
        raise NotImplementedError

    def close(self) -> None:
        """Release the file handle."""

    def __enter__(self) -> Slide:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}({self.path!r}, levels={self.level_dimensions}, "
            f"objective_power={self.objective_power}, mpp={self.mpp})"
        )


class TiffSlideSlide(Slide):
    backend = "tiffslide"

    def __init__(self, path: str):
        import tiffslide

        try:
            self._slide = tiffslide.TiffSlide(path)
            props = self._slide.properties
            dims = self._slide.level_dimensions
            downs = self._slide.level_downsamples
        except Exception as err:
            raise SlideReadError(path, f"tiffslide: {type(err).__name__}: {err}") from err
        mpps = [_to_float(props.get(k)) for k in ("tiffslide.mpp-x", "tiffslide.mpp-y")]
        mpp = float(np.mean(mpps)) if all(m is not None for m in mpps) else None
        try:
            super().__init__(path, dims, downs, props.get("tiffslide.objective-power"), mpp)
        except SlideReadError:
            self._slide.close()
            raise

    def _read(self, x, y, level, w, h):
        return self._slide.read_region((x, y), level, (w, h), as_array=True)

    def close(self) -> None:
        self._slide.close()


class OpenSlideSlide(Slide):
    backend = "openslide"

    def __init__(self, path: str):
        import openslide

        try:
            self._slide = openslide.OpenSlide(path)
            props = self._slide.properties
            dims = self._slide.level_dimensions
            downs = self._slide.level_downsamples
        except Exception as err:
            raise SlideReadError(path, f"openslide: {type(err).__name__}: {err}") from err
        mpps = [
            _to_float(props.get(k)) for k in (openslide.PROPERTY_NAME_MPP_X, openslide.PROPERTY_NAME_MPP_Y)
        ]
        mpp = float(np.mean(mpps)) if all(m is not None for m in mpps) else None
        power = props.get(openslide.PROPERTY_NAME_OBJECTIVE_POWER)
        super().__init__(path, dims, downs, power, mpp)

    def _read(self, x, y, level, w, h):
        return np.asarray(self._slide.read_region((x, y), level, (w, h)))

    def close(self) -> None:
        self._slide.close()


def open_slide(path: str | Path, backend: str = "auto") -> Slide:
    """Open ``path`` with ``backend`` (``auto``: tiffslide, then OpenSlide when importable)."""
    path = str(path)
    if backend not in BACKENDS:
        raise ValueError(f"slide backend must be one of {', '.join(BACKENDS)}, got '{backend}'")
    if not Path(path).is_file():
        raise SlideReadError(path, "no such file")
    if backend == "openslide":
        if not openslide_available():
            raise SlideReadError(path, "OpenSlide is not installed (pip install 'dpgs[openslide]')")
        return OpenSlideSlide(path)
    try:
        return TiffSlideSlide(path)
    except SlideReadError as first:
        if backend == "tiffslide" or not openslide_available():
            raise
        try:
            return OpenSlideSlide(path)
        except SlideReadError as second:
            raise SlideReadError(path, f"{first.reason}; {second.reason}") from second
