"""Non-overlapping tiling of slides into CLAM/TRIDENT-style coordinate files.

Geometry. With ``magnification=M`` on a slide whose level 0 is at ``B`` x (objective power, or
``10 / mpp``), one output pixel covers ``d = B / M`` level-0 pixels. Tiles are read from the
deepest level ``L`` with ``downsample[L] <= d`` (0.1% tolerance for scanners' 4.0003-style
downsamples), ``read_size = round(tile_size * d / downsample[L])`` pixels per side, and resized to
``tile_size`` when ``read_size != tile_size``. With ``level=L`` tiles are ``tile_size`` pixels of level
``L`` (``d = downsample[L]``). ``patch_size_level0 = round(tile_size * d)``; the grid has
``floor(W0 / patch_size_level0) x floor(H0 / patch_size_level0)`` tiles at level-0 top-lefts
``(i * patch_size_level0, j * patch_size_level0)``, row-major (y outer).

Tissue. ``grey``: the Big-Layers rule on the pixels read at the patch level (:mod:`dpgs.wsi.tissue`),
read in blocks of a row of tiles; ``otsu``: Otsu's mask of a thumbnail averaged over each tile's
footprint. A tile is kept when its tissue fraction is ``>= min_tissue``.

Output of ``tile_directory(slides_dir, out_dir)``::

    out_dir/patches/{slide_id}.h5      coords [N, 2] int64 (x, y level-0 top-left), tissue_fraction [N]
    out_dir/thumbnails/{slide_id}.png  thumbnail with the kept tiles outlined
    out_dir/tiling_report.csv          slide_id,path,status,tiles,grid_tiles,seconds,error

The ``coords`` dataset carries CLAM/TRIDENT attributes: ``patch_size`` (output side),
``patch_level``, ``downsample`` (``d``), ``patch_size_level0``, ``read_size``, ``level_downsample``,
``level_dim``, ``level0_dim``, ``overlap`` (0), ``name``, ``level0_magnification`` and
``target_magnification`` (when known). The file's root attribute ``dpgs_settings`` (JSON) records the
tiling settings; an existing file with the same settings is skipped, so a stopped run resumes. Files
are written under a temporary name and renamed, so an existing file is complete.
"""

from __future__ import annotations

import csv
import json
import math
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from dataclasses import asdict, dataclass, field
from multiprocessing import get_context
from pathlib import Path

import numpy as np

from dpgs.outputs import write_atomically
from dpgs.wsi import tissue as T
from dpgs.wsi.reader import Slide, open_slide

SLIDE_EXTENSIONS = (".svs", ".tif", ".tiff", ".ndpi", ".scn", ".bif", ".mrxs", ".vms", ".vmu", ".svslide")
TISSUE_METHODS = ("grey", "otsu")
REPORT_NAME = "tiling_report.csv"
REPORT_COLUMNS = ("slide_id", "path", "status", "tiles", "grid_tiles", "seconds", "error")
_TOL = 1e-3
_BLOCK_WIDTH = 8192


@dataclass(frozen=True)
class TilingParams:
    """Settings of a tiling run: ``magnification`` or ``level`` (neither: magnification 20)."""

    tile_size: int = 256
    magnification: float | None = None
    level: int | None = None
    tissue: str = "grey"
    min_tissue: float = 0.6
    thumbnail_size: int = 1024
    otsu_median: int = 7
    backend: str = "auto"

    def __post_init__(self):
        if self.tile_size < 1:
            raise ValueError(f"tile size must be >= 1, got {self.tile_size}")
        if self.magnification is not None and self.level is not None:
            raise ValueError("give magnification or level, not both")
        if self.magnification is None and self.level is None:
            object.__setattr__(self, "magnification", 20.0)
        if self.magnification is not None and not self.magnification > 0:
            raise ValueError(f"magnification must be > 0, got {self.magnification}")
        if self.level is not None and self.level < 0:
            raise ValueError(f"level must be >= 0, got {self.level}")
        if self.tissue not in TISSUE_METHODS:
            raise ValueError(f"tissue method must be one of {', '.join(TISSUE_METHODS)}, got '{self.tissue}'")
        if not 0.0 <= self.min_tissue <= 1.0:
            raise ValueError(f"min_tissue must be in [0, 1], got {self.min_tissue}")
        if self.thumbnail_size < 16:
            raise ValueError(f"thumbnail size must be >= 16, got {self.thumbnail_size}")

    def settings(self) -> dict:
        """What decides the tiles (the resume key); the backend and thumbnail size of grey runs do not."""
        keys = ["tile_size", "magnification", "level", "tissue", "min_tissue"]
        if self.tissue == "otsu":
            keys += ["thumbnail_size", "otsu_median"]
        return {k: getattr(self, k) for k in keys}


@dataclass(frozen=True)
class TileGeometry:
    """Where and how tiles are read; see the module docstring for the formulas."""

    patch_size: int
    patch_level: int
    level_downsample: float
    downsample: float
    read_size: int
    patch_size_level0: int
    level0_dim: tuple[int, int]
    level_dim: tuple[int, int]
    level0_magnification: float | None
    target_magnification: float | None


def choose_geometry(
    slide: Slide, tile_size: int, magnification: float | None = None, level: int | None = None
) -> TileGeometry:
    """Tile geometry for ``magnification`` or ``level``; ``ValueError`` naming the slide when impossible."""
    base = slide.magnification
    if level is not None:
        if not 0 <= level < slide.level_count:
            raise ValueError(
                f"{slide.path}: level {level} does not exist (levels 0..{slide.level_count - 1})"
            )
        lvl, d, read = level, slide.level_downsamples[level], tile_size
        target = base / d if base is not None else None
    else:
        if base is None:
            raise ValueError(
                f"{slide.path}: no objective power or mpp in the metadata, so magnification "
                f"{magnification:g}x cannot be located; tile by level (--level) instead"
            )
        if magnification > base * (1 + _TOL):
            raise ValueError(f"{slide.path}: scanned at {base:g}x, cannot tile at {magnification:g}x")
        d = max(1.0, base / magnification)
        lvl = max(i for i, ds in enumerate(slide.level_downsamples) if ds <= d * (1 + _TOL) or i == 0)
        ratio = d / slide.level_downsamples[lvl]
        read = tile_size if abs(ratio - 1) <= _TOL else max(1, round(tile_size * ratio))
        target = magnification
    return TileGeometry(
        patch_size=tile_size,
        patch_level=lvl,
        level_downsample=slide.level_downsamples[lvl],
        downsample=float(d),
        read_size=read,
        patch_size_level0=max(1, round(tile_size * d)),
        level0_dim=slide.dimensions,
        level_dim=slide.level_dimensions[lvl],
        level0_magnification=base,
        target_magnification=target,
    )


def grid_coords(level0_dim: tuple[int, int], size0: int) -> np.ndarray:
    """int64 [ny * nx, 2] level-0 (x, y) top-lefts of the full tiles of side ``size0``, row-major."""
    nx, ny = level0_dim[0] // size0, level0_dim[1] // size0
    ys, xs = np.meshgrid(np.arange(ny, dtype=np.int64), np.arange(nx, dtype=np.int64), indexing="ij")
    return np.stack([xs.ravel(), ys.ravel()], axis=1) * size0


def grey_fractions(slide: Slide, geom: TileGeometry, low=T.GREY_LOW, high=T.GREY_HIGH) -> np.ndarray:
    """Grey-rule foreground fraction of every grid tile, read at the patch level in blocks of a tile row."""
    s0, r = geom.patch_size_level0, geom.read_size
    nx, ny = geom.level0_dim[0] // s0, geom.level0_dim[1] // s0
    out = np.zeros((ny, nx), dtype=np.float32)
    per_block = max(1, _BLOCK_WIDTH // r)
    for j in range(ny):
        for i0 in range(0, nx, per_block):
            n = min(per_block, nx - i0)
            block = slide.read_region((i0 * s0, j * s0), geom.patch_level, (n * r, r))
            tiles = block.reshape(r, n, r, 3).transpose(1, 0, 2, 3)
            out[j, i0 : i0 + n] = T.grey_tissue_fraction(tiles, low, high)
    return out.ravel()


def otsu_fractions(thumbnail: np.ndarray, coords: np.ndarray, geom: TileGeometry, median: int) -> np.ndarray:
    """Otsu-mask fraction of every tile's footprint on the thumbnail."""
    mask = T.otsu_mask(thumbnail, median)
    sx, sy = T.thumbnail_scale(geom.level0_dim, mask.shape)
    boxes = T.footprint_boxes(coords, geom.patch_size_level0, sx, sy, mask.shape)
    return T.box_fractions(mask, boxes).astype(np.float32)


@dataclass
class TilingResult:
    """Kept tiles of one slide (``coords`` [N, 2], ``fractions`` [N]) and how many the grid had."""

    coords: np.ndarray
    fractions: np.ndarray
    grid_tiles: int
    geometry: TileGeometry
    thumbnail: np.ndarray


def tile_slide(slide: Slide | str | Path, params: TilingParams) -> TilingResult:
    """Grid, tissue fractions and the kept tiles of one slide (a path is opened and closed here)."""
    if not isinstance(slide, Slide):
        with open_slide(slide, params.backend) as opened:
            return tile_slide(opened, params)
    geom = choose_geometry(slide, params.tile_size, params.magnification, params.level)
    coords = grid_coords(geom.level0_dim, geom.patch_size_level0)
    thumb = slide.thumbnail(params.thumbnail_size)
    if len(coords) == 0:
        fractions = np.zeros(0, dtype=np.float32)
    elif params.tissue == "grey":
        fractions = grey_fractions(slide, geom)
    else:
        fractions = otsu_fractions(thumb, coords, geom, params.otsu_median)
    keep = fractions >= params.min_tissue
    return TilingResult(coords[keep], fractions[keep], len(coords), geom, thumb)


def write_coords_h5(path: str | Path, result: TilingResult, params: TilingParams, slide_path: str) -> Path:
    """Write ``coords`` (+ attrs) and ``tissue_fraction`` atomically (temporary file, then rename)."""
    import h5py

    path = Path(path)
    g = result.geometry
    attrs = {
        "patch_size": g.patch_size,
        "patch_level": g.patch_level,
        "downsample": g.downsample,
        "patch_size_level0": g.patch_size_level0,
        "read_size": g.read_size,
        "level_downsample": g.level_downsample,
        "level_dim": np.asarray(g.level_dim, dtype=np.int64),
        "level0_dim": np.asarray(g.level0_dim, dtype=np.int64),
        "overlap": 0,
        "name": path.stem,
        "slide_path": str(slide_path),
    }
    if g.level0_magnification is not None:
        attrs["level0_magnification"] = g.level0_magnification
    if g.target_magnification is not None:
        attrs["target_magnification"] = g.target_magnification

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as fh:
            ds = fh.create_dataset("coords", data=result.coords.astype(np.int64).reshape(-1, 2))
            ds.attrs.update(attrs)
            fh.create_dataset("tissue_fraction", data=result.fractions.astype(np.float32))
            fh.attrs["dpgs_settings"] = json.dumps(params.settings(), sort_keys=True)
            fh.attrs["grid_tiles"] = result.grid_tiles

    return write_atomically(path, write)


def read_coords_h5(path: str | Path) -> tuple[np.ndarray, dict]:
    """``coords`` int64 [N, 2] and the attributes of the ``coords`` dataset of a CLAM/TRIDENT/dpgs file.

    ``patch_size`` is required, and ``patch_level`` (CLAM, dpgs) or ``patch_size_level0`` (TRIDENT).
    """
    import h5py

    try:
        with h5py.File(path, "r") as fh:
            if "coords" not in fh:
                raise ValueError(f"{path}: no 'coords' dataset (datasets: {', '.join(fh.keys())})")
            ds = fh["coords"]
            coords = np.asarray(ds[()], dtype=np.int64)
            attrs = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in ds.attrs.items()}
    except OSError as err:
        raise ValueError(f"{path}: cannot read coords file ({err})") from err
    if coords.ndim != 2 or coords.shape[1] != 2:
        if coords.size == 0:
            coords = coords.reshape(0, 2)
        else:
            raise ValueError(f"{path}: coords has shape {coords.shape}, expected [N, 2]")
    if "patch_size" not in attrs:
        raise ValueError(f"{path}: coords attribute 'patch_size' is missing")
    if "patch_level" not in attrs and "patch_size_level0" not in attrs:
        raise ValueError(f"{path}: coords attributes 'patch_level' and 'patch_size_level0' are both missing")
    return coords, attrs


def finished_settings(path: Path) -> dict | None:
    """The ``dpgs_settings`` of a finished coords file, or None when absent or unreadable."""
    import h5py

    try:
        with h5py.File(path, "r") as fh:
            if "coords" not in fh:
                return None
            return json.loads(fh.attrs["dpgs_settings"])
    except (OSError, KeyError, ValueError):
        return None


def outline_thumbnail(thumbnail: np.ndarray, coords: np.ndarray, geom: TileGeometry, path: Path) -> Path:
    """Save ``thumbnail`` as PNG with a green outline around every kept tile (atomic write)."""
    from PIL import Image, ImageDraw

    img = Image.fromarray(thumbnail)
    draw = ImageDraw.Draw(img)
    sx, sy = T.thumbnail_scale(geom.level0_dim, thumbnail.shape)
    s0 = geom.patch_size_level0
    for x, y in coords:
        x0, y0 = math.floor(x * sx), math.floor(y * sy)
        x1, y1 = max(x0, math.ceil((x + s0) * sx) - 1), max(y0, math.ceil((y + s0) * sy) - 1)
        draw.rectangle((x0, y0, x1, y1), outline=(0, 160, 0), width=1)
    return write_atomically(path, lambda tmp: img.save(tmp, format="PNG"))


@dataclass
class SlideOutcome:
    """One slide of a run: ``status`` is ``tiled``, ``skipped`` (finished before) or ``failed``."""

    slide_id: str
    path: str
    status: str
    tiles: int = 0
    grid_tiles: int = 0
    seconds: float = 0.0
    error: str = ""


def slide_id_of(path: Path) -> str:
    """File name without its slide extension (``a.b.svs`` -> ``a.b``)."""
    name = path.name
    for ext in SLIDE_EXTENSIONS:
        if name.lower().endswith(ext):
            return name[: -len(ext)]
    return path.stem


def tile_one(slide_path: str | Path, out_dir: str | Path, params: TilingParams) -> SlideOutcome:
    """Tile one slide into ``out_dir``; never raises for a bad slide (the outcome says ``failed``)."""
    slide_path, out_dir = Path(slide_path), Path(out_dir)
    sid = slide_id_of(slide_path)
    h5_path = out_dir / "patches" / f"{sid}.h5"
    start = time.perf_counter()
    done = finished_settings(h5_path) if h5_path.exists() else None
    if done == params.settings():
        coords, _ = read_coords_h5(h5_path)
        return SlideOutcome(sid, str(slide_path), "skipped", tiles=len(coords))
    try:
        result = tile_slide(slide_path, params)
        (out_dir / "thumbnails").mkdir(parents=True, exist_ok=True)
        h5_path.parent.mkdir(parents=True, exist_ok=True)
        outline_thumbnail(
            result.thumbnail, result.coords, result.geometry, out_dir / "thumbnails" / f"{sid}.png"
        )
        write_coords_h5(h5_path, result, params, str(slide_path))
    except Exception as err:  # any per-slide problem is reported and the run goes on
        message = str(err) if str(slide_path) in str(err) else f"{slide_path}: {err}"
        return SlideOutcome(
            sid, str(slide_path), "failed", seconds=time.perf_counter() - start, error=message
        )
    return SlideOutcome(
        sid, str(slide_path), "tiled", len(result.coords), result.grid_tiles, time.perf_counter() - start
    )


def find_slides(slides_dir: str | Path, extensions=SLIDE_EXTENSIONS) -> list[Path]:
    """Slide files directly in ``slides_dir`` with one of ``extensions`` (case-insensitive), sorted."""
    root = Path(slides_dir)
    if not root.is_dir():
        raise FileNotFoundError(f"slides directory {root} does not exist or is not a directory")
    exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in extensions)
    return sorted(p for p in root.iterdir() if p.is_file() and p.name.lower().endswith(exts))


@dataclass
class TilingReport:
    """All outcomes of a run and where the CSV report was written."""

    outcomes: list[SlideOutcome]
    report_path: Path
    counts: dict = field(default_factory=dict)

    @property
    def failed(self) -> list[SlideOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def write_report(path: Path, outcomes: list[SlideOutcome]) -> Path:
    def write(tmp: Path) -> None:
        with tmp.open("w", newline="") as fh:
            writer = csv.DictWriter(fh, fieldnames=REPORT_COLUMNS)
            writer.writeheader()
            for o in outcomes:
                row = asdict(o)
                row["seconds"] = f"{o.seconds:.3f}"
                writer.writerow(row)

    return write_atomically(path, write)


def tile_directory(
    slides_dir: str | Path,
    out_dir: str | Path,
    params: TilingParams | None = None,
    workers: int = 1,
    extensions=SLIDE_EXTENSIONS,
    progress: bool = True,
) -> TilingReport:
    """Tile every slide of ``slides_dir`` into ``out_dir`` (see module docstring).

    ``workers > 1`` tiles slides in parallel processes (spawned, so the parent's threads and CUDA state
    are not inherited). Slides whose file cannot be read, or that cannot be tiled with ``params``, are
    reported (``failed`` rows of the report) and the others are tiled. Slides with the same id (``a.svs``
    and ``a.tif``) are tiled once; the others are reported as failed.
    """
    from tqdm.auto import tqdm

    params = params or TilingParams()
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    out_dir = Path(out_dir)
    slides = find_slides(slides_dir, extensions)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "patches").mkdir(exist_ok=True)
    outcomes: list[SlideOutcome] = []
    todo: list[Path] = []
    first: dict[str, Path] = {}
    for path in slides:
        sid = slide_id_of(path)
        if sid in first:
            outcomes.append(
                SlideOutcome(
                    sid, str(path), "failed", error=f"{path}: slide id '{sid}' already used by {first[sid]}"
                )
            )
        else:
            first[sid] = path
            todo.append(path)
    bar = tqdm(total=len(todo), desc="tiling", unit="slide", disable=not progress)
    try:
        if workers == 1 or len(todo) <= 1:
            for path in todo:
                outcomes.append(tile_one(path, out_dir, params))
                bar.update(1)
        else:
            with ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn")) as pool:
                futures = {pool.submit(tile_one, path, out_dir, params): path for path in todo}
                for fut in as_completed(futures):
                    try:
                        outcomes.append(fut.result())
                    except BrokenProcessPool as err:  # a worker died (killed, out of memory, bad __main__)
                        path = futures[fut]
                        outcomes.append(
                            SlideOutcome(
                                slide_id_of(path), str(path), "failed", error=f"{path}: worker died: {err}"
                            )
                        )
                    bar.update(1)
    finally:
        bar.close()
    outcomes.sort(key=lambda o: (o.slide_id, o.path))
    report = write_report(out_dir / REPORT_NAME, outcomes)
    counts = {s: sum(o.status == s for o in outcomes) for s in ("tiled", "skipped", "failed")}
    return TilingReport(outcomes, report, counts)
