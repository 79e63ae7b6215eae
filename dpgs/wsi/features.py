"""Tile features of every tiled slide with a ResNet encoder (``dpgs extract``).

For each slide of ``slides_dir`` whose coords file is under ``tiles_dir`` (located as
:func:`~dpgs.wsi.tiles.locate_coords` does), all tiles are read in coords order (resized to
``tile_size`` when given, else the coords file's ``patch_size``), converted to [0, 1], normalised with
the ImageNet statistics and embedded by the encoder in eval mode under ``no_grad``, ``batch_size``
tiles per pass (the next batch is read while the current one is embedded). The result is written to
``out_dir/{slide_id}.h5``, the CLAM/TRIDENT feature-file layout that ``data.features_dir`` reads:

* ``features`` float32 [N, D] (D = 512 for ResNet-18, 2048 for ResNet-50);
* ``coords`` int64 [N, 2], the coords file's rows in its order, with every attribute of its ``coords``
  dataset (``patch_size``, ``patch_level``, ``downsample``, ``patch_size_level0``, ...);
* file attributes ``encoder`` (name), ``encoder_sha256`` (digest of the encoder's state_dict),
  ``weights`` (where the weights came from), ``tile_size`` (input side of the encoder), ``slide_id``,
  ``slide_path``.

Files are written under a temporary name and renamed, so a file that exists is complete. A slide whose
file exists with the same ``encoder``, ``encoder_sha256``, ``tile_size`` and coords is skipped, so a
stopped run resumes. A slide that cannot be read (slide or coords file) is reported ``failed`` and the
others go on. An encoder without weights is initialised from ``torch.manual_seed(0)``, so the random
baseline is reproducible.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpgs.biglayers import BigResNet
from dpgs.outputs import write_atomically
from dpgs.wsi.augment import imagenet_normalize, to_float_tiles
from dpgs.wsi.tiles import TileLayout, TileReader, locate_coords
from dpgs.wsi.tiling import find_slides, slide_id_of

RANDOM_INIT_SEED = 0
STATUSES = ("extracted", "skipped", "failed", "untiled")


def build_extraction_encoder(name: str, big_stages: int = 1, max_elements: int = 1 << 24,
                             weights: str | Path | None = None) -> BigResNet:
    """The encoder in eval mode on the CPU: ``weights`` loaded, else seeded random initialisation.

    ``weights`` is a torchvision-format state_dict or a dpgs ``best.pt`` (its ``encoder.*`` entries), as
    :func:`~dpgs.models.tilemil.load_encoder_weights` reads them; a mismatch raises ValueError naming it.
    """
    from dpgs.models.tilemil import build_encoder, load_encoder_weights

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_INIT_SEED)
        encoder = build_encoder(name, big_stages, max_elements)
    if weights is not None:
        load_encoder_weights(encoder, weights)
    return encoder.eval()


def encoder_digest(encoder: torch.nn.Module) -> str:
    """SHA-256 of the encoder's state_dict (names and values): the identity of its weights."""
    h = hashlib.sha256()
    for key, value in sorted(encoder.state_dict().items()):
        h.update(key.encode())
        h.update(value.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


@dataclass(frozen=True)
class ExtractSettings:
    """The encoder and how tiles are fed to it; ``tile_size`` None keeps each file's ``patch_size``."""

    encoder_name: str
    encoder_sha256: str
    weights: str
    tile_size: int | None = None
    batch_size: int = 256
    threads: int = 4
    backend: str = "auto"

    def __post_init__(self):
        if self.batch_size < 1:
            raise ValueError(f"batch size must be >= 1, got {self.batch_size}")
        if self.tile_size is not None and self.tile_size < 1:
            raise ValueError(f"tile size must be >= 1, got {self.tile_size}")

    def key(self, layout: TileLayout) -> dict:
        """What decides a slide's features (the resume key)."""
        return {
            "encoder": self.encoder_name,
            "encoder_sha256": self.encoder_sha256,
            "tile_size": int(self.tile_size or layout.patch_size),
        }


@dataclass
class ExtractOutcome:
    """One slide: ``status`` is extracted, skipped, failed (``error`` names the file) or untiled."""

    slide_id: str
    slide_path: str
    status: str
    tiles: int = 0
    seconds: float = 0.0
    error: str = ""


@dataclass
class ExtractReport:
    """Every slide's outcome and the counts per status."""

    outcomes: list[ExtractOutcome]

    @property
    def counts(self) -> dict[str, int]:
        return {s: sum(o.status == s for o in self.outcomes) for s in STATUSES}

    @property
    def failed(self) -> list[ExtractOutcome]:
        return [o for o in self.outcomes if o.status == "failed"]


def read_batches(reader: TileReader, batch_size: int) -> Iterator[np.ndarray]:
    """uint8 [b, s, s, 3] batches of all the reader's tiles in order, reading one batch ahead."""
    n = len(reader.layout)
    starts = list(range(0, n, batch_size))
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpgs-extract") as pool:
        ahead = None
        for start in starts:
            nxt = pool.submit(reader.read, np.arange(start, min(start + batch_size, n)))
            if ahead is not None:
                yield ahead.result()
            ahead = nxt
        if ahead is not None:
            yield ahead.result()


@torch.no_grad()
def embed_tiles(encoder: torch.nn.Module, tiles: np.ndarray) -> np.ndarray:
    """float32 [n, D] features of uint8 tiles [n, s, s, 3] (ImageNet-normalised, eval mode)."""
    encoder.eval()
    feats = encoder(imagenet_normalize(to_float_tiles(tiles)))
    return feats.float().cpu().numpy()


def finished_key(path: Path) -> dict | None:
    """The resume key and coords of a finished feature file, or None when absent or unreadable."""
    import h5py

    try:
        with h5py.File(path, "r") as fh:
            if "features" not in fh or "coords" not in fh:
                return None
            key = {k: fh.attrs[k] for k in ("encoder", "encoder_sha256", "tile_size")}
            key = {k: (v.item() if isinstance(v, np.generic) else v) for k, v in key.items()}
            return {**key, "coords": np.asarray(fh["coords"][()], dtype=np.int64)}
    except (OSError, KeyError, ValueError):
        return None


def is_finished(path: Path, settings: ExtractSettings, layout: TileLayout) -> bool:
    """True when ``path`` holds this slide's features with the same encoder, tile size and coords."""
    found = finished_key(path)
    if found is None:
        return False
    coords = found.pop("coords")
    return found == settings.key(layout) and np.array_equal(coords, layout.coords)


def write_features(path: Path, encoder: torch.nn.Module, reader: TileReader, coords_attrs: dict,
                   settings: ExtractSettings, slide_id: str) -> int:
    """Embed every tile of ``reader`` into ``path`` (atomic: temporary file, then rename); returns N."""
    import h5py

    layout = reader.layout
    n, dim = len(layout), int(encoder.feature_dim)

    def write(tmp: Path) -> None:
        with h5py.File(tmp, "w") as fh:
            feats = fh.create_dataset("features", shape=(n, dim), dtype=np.float32)
            coords = fh.create_dataset("coords", data=layout.coords.astype(np.int64).reshape(-1, 2))
            coords.attrs.update(coords_attrs)
            start = 0
            for tiles in read_batches(reader, settings.batch_size):
                feats[start : start + len(tiles)] = embed_tiles(encoder, tiles)
                start += len(tiles)
            fh.attrs.update(settings.key(layout))
            fh.attrs.update({"weights": settings.weights, "slide_id": slide_id,
                             "slide_path": str(reader.slide.path)})

    write_atomically(path, write)
    return n


def coords_attributes(coords_path: Path) -> dict:
    """Every attribute of the coords file's ``coords`` dataset."""
    from dpgs.wsi.tiling import read_coords_h5

    return read_coords_h5(coords_path)[1]


def describe_error(err: Exception, *paths: Path) -> str:
    """The error's message, prefixed with the first path when it names none of ``paths``."""
    text = str(err)
    if any(str(p) in text for p in paths):
        return text
    return f"{paths[0]}: {type(err).__name__}: {text}"


def extract_slide(slide_path: Path, coords_path: Path, out_dir: Path, encoder: torch.nn.Module,
                  settings: ExtractSettings) -> ExtractOutcome:
    """Features of one slide into ``out_dir/{slide_id}.h5``; never raises for a bad slide or coords file."""
    sid, start = slide_id_of(slide_path), time.perf_counter()
    try:
        layout = TileLayout.from_h5(coords_path)
        out = out_dir / f"{sid}.h5"
        if is_finished(out, settings, layout):
            return ExtractOutcome(sid, str(slide_path), "skipped", len(layout))
        if len(layout) == 0:
            raise ValueError(f"{coords_path}: no tiles (tissue detection kept none)")
        with TileReader(slide_path, layout, settings.tile_size, settings.threads, settings.backend) as reader:
            n = write_features(out, encoder, reader, coords_attributes(coords_path), settings, sid)
    except (OSError, ValueError, KeyError, RuntimeError) as err:
        return ExtractOutcome(sid, str(slide_path), "failed", seconds=time.perf_counter() - start,
                              error=describe_error(err, slide_path, coords_path))
    return ExtractOutcome(sid, str(slide_path), "extracted", n, time.perf_counter() - start)


def plan_slides(slides_dir: str | Path, tiles_dir: str | Path) -> tuple[list[tuple[Path, Path]],
                                                                         list[ExtractOutcome]]:
    """(slide, coords file) pairs to extract, and the outcomes decided without reading: slides with no
    coords file (``untiled``) and slides whose id is already taken by another file (``failed``)."""
    todo, decided, first = [], [], {}
    for path in find_slides(slides_dir):
        sid = slide_id_of(path)
        if sid in first:
            decided.append(ExtractOutcome(sid, str(path), "failed",
                                          error=f"{path}: slide id '{sid}' already used by {first[sid]}"))
            continue
        first[sid] = path
        coords = locate_coords(tiles_dir, sid)
        if coords is None:
            decided.append(ExtractOutcome(sid, str(path), "untiled"))
        else:
            todo.append((path, coords))
    return todo, decided


def extract_directory(slides_dir: str | Path, tiles_dir: str | Path, out_dir: str | Path,
                      encoder: torch.nn.Module, settings: ExtractSettings,
                      progress: bool = True) -> ExtractReport:
    """Extract every tiled slide of ``slides_dir`` into ``out_dir`` (see the module docstring).

    Raises FileNotFoundError when ``slides_dir`` or ``tiles_dir`` is not a directory.
    """
    from tqdm.auto import tqdm

    if not Path(tiles_dir).is_dir():
        raise FileNotFoundError(f"tiles directory {tiles_dir} does not exist or is not a directory")
    todo, outcomes = plan_slides(slides_dir, tiles_dir)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for slide_path, coords_path in tqdm(todo, desc="extracting", unit="slide", disable=not progress):
        outcomes.append(extract_slide(slide_path, coords_path, out_dir, encoder, settings))
    outcomes.sort(key=lambda o: (o.slide_id, o.slide_path))
    return ExtractReport(outcomes)
