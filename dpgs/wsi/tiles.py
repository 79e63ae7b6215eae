"""Tile bags read on the fly from slides by their coords.

:class:`TileLayout` says how to read a coords file's tiles: from ``patch_level``, ``read_size`` pixels
per side, resized to ``patch_size``. dpgs files carry ``read_size``; CLAM files (no resize) read
``patch_size`` pixels at ``patch_level``; TRIDENT files (``patch_size_level0``, no level) read from the
deepest level whose downsample is ``<= patch_size_level0 / patch_size``.

:class:`TileReader` reads tiles of one slide with a thread pool into uint8 [n, s, s, 3] (resizing with
PIL's antialiased bilinear filter when the read size differs from ``s``).

:class:`TileBagDataset` returns a :class:`TileBag` per slide: ``tiles_per_bag`` tiles sampled without
replacement (all tiles when the slide has fewer, or when ``tiles_per_bag`` is None), in coords order,
from ``numpy.random.default_rng([seed, epoch, index])``; then, when an augmentation is given, one
parameter set drawn from a ``torch.Generator`` seeded with the same triple and applied to all tiles;
then ImageNet normalisation. ``iterate_bags`` reads the next bag in a background thread while the
caller computes on the current one.

For evaluation, ``TileBagDataset.open_stream(i)`` returns a :class:`TileStream`: every tile of slide ``i``
addressable by its coords index and read on demand (``stream.read(indices)``), ImageNet-normalised and
never augmented, so that a bag is embedded chunk by chunk straight from the slide and only the tiles a
protocol uses are read (``dpgs.train.evaluate``).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from dpgs.wsi.augment import BagAugment, imagenet_normalize, to_float_tiles
from dpgs.wsi.reader import Slide, open_slide
from dpgs.wsi.tiling import SLIDE_EXTENSIONS, read_coords_h5

_TOL = 1e-3
DENSE_FACTOR = 4
MAX_REGION_PIXELS = 1 << 24


@dataclass(frozen=True)
class TileLayout:
    """Coords [N, 2] (level-0 top-left) and how to read them; ``patch_level`` None = choose per slide."""

    coords: np.ndarray
    patch_size: int
    patch_level: int | None
    read_size: int | None
    patch_size_level0: int | None

    @classmethod
    def from_h5(cls, path: str | Path) -> TileLayout:
        coords, attrs = read_coords_h5(path)
        level = attrs.get("patch_level")
        size0 = attrs.get("patch_size_level0")
        read = attrs.get("read_size")
        if read is None and level is not None and size0 is None:
            read = attrs["patch_size"]  # CLAM: patch_size pixels of patch_level
        return cls(
            coords=coords,
            patch_size=int(attrs["patch_size"]),
            patch_level=None if level is None else int(level),
            read_size=None if read is None else int(read),
            patch_size_level0=None if size0 is None else int(size0),
        )

    def resolve(self, slide: Slide) -> tuple[int, int]:
        """(level, read size) on ``slide``."""
        if self.patch_level is not None and self.read_size is not None:
            if self.patch_level >= slide.level_count:
                raise ValueError(
                    f"{slide.path}: tiles are at level {self.patch_level}, slide has {slide.level_count}"
                )
            return self.patch_level, self.read_size
        d = self.patch_size_level0 / self.patch_size
        if self.patch_level is not None:
            level = self.patch_level
        else:
            level = max(i for i, ds in enumerate(slide.level_downsamples) if ds <= d * (1 + _TOL) or i == 0)
        return level, max(1, round(self.patch_size_level0 / slide.level_downsamples[level]))

    def __len__(self) -> int:
        return len(self.coords)


class TileReader:
    """Reads tiles of one slide in parallel; use as a context manager (closes slide and threads)."""

    def __init__(
        self,
        slide_path: str | Path,
        layout: TileLayout,
        out_size: int | None = None,
        threads: int = 4,
        backend: str = "auto",
    ):
        self.slide = open_slide(slide_path, backend)
        self.layout = layout
        self.out_size = int(out_size or layout.patch_size)
        self.level, self.read_size = layout.resolve(self.slide)
        self._pool = ThreadPoolExecutor(max_workers=max(1, threads), thread_name_prefix="dpgs-tiles")

    def _resize(self, tile: np.ndarray) -> np.ndarray:
        from PIL import Image

        if self.read_size == self.out_size:
            return tile
        img = Image.fromarray(tile).resize((self.out_size, self.out_size), Image.Resampling.BILINEAR)
        return np.asarray(img)

    def read_one(self, index: int) -> np.ndarray:
        """uint8 [s, s, 3] of tile ``index``."""
        x, y = self.layout.coords[index]
        return self._resize(
            self.slide.read_region((int(x), int(y)), self.level, (self.read_size, self.read_size))
        )

    def read(self, indices: Sequence[int] | None = None) -> np.ndarray:
        """uint8 [n, s, s, 3] of the tiles ``indices`` (all when None), in that order.

        When the tiles cover at least ``1 / DENSE_FACTOR`` of their bounding box at the patch level
        and the box holds at most ``MAX_REGION_PIXELS``, the box is read once and sliced (tile ``(x, y)``
        sits at level pixel ``floor(x / downsample)``, the backends' rule); else the tiles are read
        one by one on the thread pool.
        """
        idx = np.arange(len(self.layout)) if indices is None else np.asarray(indices, dtype=np.int64)
        out = np.empty((len(idx), self.out_size, self.out_size, 3), dtype=np.uint8)
        if len(idx) == 0:
            return out
        r = self.read_size
        ds = self.slide.level_downsamples[self.level]
        level_xy = np.floor(self.layout.coords[idx] / ds + 1e-9).astype(np.int64)
        (bx0, by0), (bx1, by1) = level_xy.min(axis=0), level_xy.max(axis=0) + r
        box = int((bx1 - bx0) * (by1 - by0))
        if box <= MAX_REGION_PIXELS and len(idx) * r * r * DENSE_FACTOR >= box:
            region = self.slide.read_region(
                (math.ceil(bx0 * ds), math.ceil(by0 * ds)), self.level, (int(bx1 - bx0), int(by1 - by0))
            )
            for k, (lx, ly) in enumerate(level_xy - (bx0, by0)):
                out[k] = self._resize(region[ly : ly + r, lx : lx + r])
            return out

        def fill(k_i):
            k, i = k_i
            out[k] = self.read_one(i)

        list(self._pool.map(fill, enumerate(idx.tolist())))
        return out

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self.slide.close()

    def __enter__(self) -> TileReader:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class TileStream:
    """The tiles of one slide for evaluation: ``read(indices)`` returns the ImageNet-normalised float32
    tiles [n, 3, s, s] of those coords indices (all, in coords order, for None), with no augmentation.
    A context manager: leaving it closes the reader."""

    def __init__(self, reader: TileReader):
        self.reader = reader

    def __len__(self) -> int:
        return len(self.reader.layout)

    def read(self, indices: np.ndarray | None = None) -> torch.Tensor:
        return imagenet_normalize(to_float_tiles(self.reader.read(indices)))

    def close(self) -> None:
        self.reader.close()

    def __enter__(self) -> TileStream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def sample_indices(n: int, k: int | None, seed: int, epoch: int, index: int) -> np.ndarray:
    """Sorted ``min(k, n)`` distinct indices of ``range(n)`` from ``default_rng([seed, epoch, index])``."""
    if k is None or n <= k:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch, index])
    return np.sort(rng.choice(n, size=k, replace=False)).astype(np.int64)


@dataclass(frozen=True)
class TileBagItem:
    """One slide of a tile-bag dataset."""

    slide_id: str
    slide_path: Path
    coords_path: Path
    label: int


@dataclass
class TileBag:
    """``tiles``: float32 [N, 3, s, s] (normalised unless asked otherwise) or uint8 [N, s, s, 3]."""

    slide_id: str
    tiles: torch.Tensor | np.ndarray
    label: int
    coords: np.ndarray
    indices: np.ndarray

    @property
    def features(self) -> torch.Tensor | np.ndarray:
        """The bag's instances (the tiles), the name the trainers and evaluation read."""
        return self.tiles


def locate_slide(slides_dir: str | Path, slide_id: str) -> Path | None:
    """``slides_dir/{slide_id}{ext}`` for the first existing slide extension (any case), or None."""
    root = Path(slides_dir)
    for ext in SLIDE_EXTENSIONS:
        for candidate in (root / f"{slide_id}{ext}", root / f"{slide_id}{ext.upper()}"):
            if candidate.is_file():
                return candidate
    return None


def locate_coords(tiles_dir: str | Path, slide_id: str) -> Path | None:
    """The coords file of ``slide_id`` under ``tiles_dir``, or None.

    Looked for in this order: ``patches/{id}.h5`` (dpgs, CLAM), ``patches/{id}_patches.h5`` (TRIDENT),
    ``{id}.h5``.
    """
    root = Path(tiles_dir)
    for candidate in (
        root / "patches" / f"{slide_id}.h5",
        root / "patches" / f"{slide_id}_patches.h5",
        root / f"{slide_id}.h5",
    ):
        if candidate.is_file():
            return candidate
    return None


def check_tile_item(slide_id: str, slide_path: Path | None, coords_path: Path | None,
                    slides_dir: Path, tiles_dir: Path) -> list[str]:
    """Problems of one slide (empty when none): both files present, the coords readable and non-empty,
    the slide readable and holding the coords' level."""
    problems = []
    if slide_path is None:
        exts = "|".join(e.lstrip(".") for e in SLIDE_EXTENSIONS)
        problems.append(f"slide '{slide_id}': no slide file {slide_id}.<{exts}> in {slides_dir}")
    if coords_path is None:
        problems.append(f"slide '{slide_id}': no coords file {slide_id}.h5 in {tiles_dir}/patches or "
                        f"{tiles_dir} (run `dpgs tile {slides_dir} {tiles_dir}`)")
    if problems:
        return problems
    try:
        layout = TileLayout.from_h5(coords_path)
    except (OSError, KeyError, ValueError) as err:
        return [f"{coords_path}: cannot read tile coords ({err})"]
    if len(layout) == 0:
        return [f"{coords_path}: no tiles (tissue detection kept none; lower --min-tissue)"]
    try:
        with open_slide(slide_path) as slide:
            layout.resolve(slide)
    except (OSError, ValueError) as err:
        return [f"{slide_path}: {err}"]
    return []


def tile_items(records, slides_dir: str | Path, tiles_dir: str | Path) -> list[TileBagItem]:
    """A :class:`TileBagItem` per record (``slide_id``, ``label``); raises one DataValidationError
    listing the problems of every slide."""
    from dpgs.data.errors import DataValidationError

    slides_dir, tiles_dir = Path(slides_dir), Path(tiles_dir)
    items, problems = [], []
    for r in records:
        slide, coords = locate_slide(slides_dir, r.slide_id), locate_coords(tiles_dir, r.slide_id)
        found = check_tile_item(r.slide_id, slide, coords, slides_dir, tiles_dir)
        problems += found
        if not found:
            items.append(TileBagItem(r.slide_id, slide, coords, int(r.label)))
    if problems:
        raise DataValidationError(problems)
    return items


class TileBagDataset:
    """Bags of tiles read from slides; ``get(i, epoch)`` samples and augments as that epoch does."""

    def __init__(
        self,
        items: Sequence[TileBagItem],
        tiles_per_bag: int | None = 256,
        tile_size: int | None = None,
        seed: int = 0,
        augment: BagAugment | None = None,
        normalize: bool = True,
        threads: int = 4,
        backend: str = "auto",
    ):
        if tiles_per_bag is not None and tiles_per_bag < 1:
            raise ValueError(f"tiles_per_bag must be >= 1, got {tiles_per_bag}")
        self.items = list(items)
        self.tiles_per_bag = tiles_per_bag
        self.tile_size = tile_size
        self.seed = seed
        self.augment = augment
        self.normalize = normalize
        self.threads = threads
        self.backend = backend
        self._layouts: dict[int, TileLayout] = {}
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["_lock"]  # the dataset is shipped to DPGS worker processes
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._lock = threading.Lock()

    @property
    def records(self) -> list[TileBagItem]:
        """The items (slide_id, label, paths), by index: the attribute trainers read labels from."""
        return self.items

    @classmethod
    def from_records(cls, records, slides_dir: str | Path, tiles_dir: str | Path, **kwargs) -> TileBagDataset:
        """Items for records with ``slide_id`` and ``label``, each checked by :func:`check_tile_item`;
        every problem is listed in one :class:`~dpgs.data.errors.DataValidationError`."""
        return cls(tile_items(records, slides_dir, tiles_dir), **kwargs)

    def __len__(self) -> int:
        return len(self.items)

    def layout(self, i: int) -> TileLayout:
        with self._lock:
            if i not in self._layouts:
                self._layouts[i] = TileLayout.from_h5(self.items[i].coords_path)
            return self._layouts[i]

    def tile_counts(self) -> list[int]:
        """Number of tiles of every slide (all tiles, before sampling)."""
        return [len(self.layout(i)) for i in range(len(self))]

    def lengths(self) -> list[int]:
        """Number of tiles ``get(i, epoch)`` returns: ``min(tiles, tiles_per_bag)`` (DPGS balances on it)."""
        k = self.tiles_per_bag
        return [n if k is None else min(n, k) for n in self.tile_counts()]

    def read(self, i: int, indices: np.ndarray | None = None, generator_key: int | None = None) -> TileBag:
        """Bag ``i`` with the tiles ``indices`` (all when None); augmentation seeded by (seed, key, i)."""
        item, layout = self.items[i], self.layout(i)
        idx = np.arange(len(layout), dtype=np.int64) if indices is None else np.asarray(indices, np.int64)
        with TileReader(item.slide_path, layout, self.tile_size, self.threads, self.backend) as reader:
            raw = reader.read(idx)
        coords = layout.coords[idx]
        if not self.normalize and self.augment is None:
            return TileBag(item.slide_id, raw, item.label, coords, idx)
        x = to_float_tiles(raw)
        if self.augment is not None and len(idx) > 0:
            key = 0 if generator_key is None else generator_key
            gen = torch.Generator().manual_seed(
                int(np.random.default_rng([self.seed, key, i]).integers(2**62))
            )
            x, _ = self.augment(x, gen)
        if self.normalize:
            x = imagenet_normalize(x)
        return TileBag(item.slide_id, x, item.label, coords, idx)

    def open_stream(self, i: int) -> TileStream:
        """Every tile of bag ``i`` for evaluation, read on demand (no sampling, no augmentation)."""
        path = self.items[i].slide_path
        return TileStream(TileReader(path, self.layout(i), self.tile_size, self.threads, self.backend))

    def get(self, i: int, epoch: int) -> TileBag:
        """Bag ``i`` as epoch ``epoch`` samples and augments it."""
        idx = sample_indices(len(self.layout(i)), self.tiles_per_bag, self.seed, epoch, i)
        return self.read(i, idx, generator_key=epoch)

    def __getitem__(self, i: int) -> TileBag:
        """Bag ``i`` as epoch 0 samples it."""
        return self.get(i, 0)


def iterate_bags(dataset: TileBagDataset, order: Sequence[int], prefetch: int = 1) -> Iterator[TileBag]:
    """``dataset.get(i, 0)`` for ``i`` in ``order``, reading up to ``prefetch`` bags ahead in a thread."""
    from dpgs.data.prefetch import Prefetcher

    for batch in Prefetcher(dataset, [[i] for i in order], depth=prefetch):
        yield batch[0]
