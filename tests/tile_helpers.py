"""Builders for the tile-bag tests: small synthetic slides tiled at 32 px, and configs over them."""

from __future__ import annotations

from pathlib import Path

from dpgs.config import load_config
from dpgs.wsi.synthetic import write_synthetic_slides
from dpgs.wsi.tiling import TilingParams, tile_directory


def write_tiled_slides(root: Path, n_slides: int = 6, size: tuple[int, int] = (384, 256),
                       level: int = 0, levels: int = 2) -> tuple[Path, Path, Path]:
    """(manifest, slides_dir, tiles_dir): ``n_slides`` synthetic slides (``levels`` pyramid levels), tiles
    of 32 px at ``level``."""
    manifest = write_synthetic_slides(root / "demo", n_slides=n_slides, seed=0, size=size, levels=levels)
    tiles = root / "tiles"
    report = tile_directory(manifest.parent / "slides", tiles, TilingParams(tile_size=32, level=level),
                            progress=False)
    assert report.counts["failed"] == 0
    return manifest, manifest.parent / "slides", tiles


def tile_config(manifest: Path, slides: Path, tiles: Path, out: Path, *overrides: str):
    """A small ResNet-18 (big_stages=1) + ABMIL config over the tiled slides (no dropout, no augment)."""
    base = [
        "data.kind=tiles",
        f"data.manifest={manifest}",
        f"data.slides_dir={slides}",
        f"data.tiles_dir={tiles}",
        "data.tiles_per_bag=6",
        "data.read_threads=2",
        "data.prefetch=0",
        "data.augment.enabled=false",
        "model.encoder=resnet18",
        "model.big_stages=1",
        "model.max_elements=20000",
        "model.params={dropout: 0.0}",
        f"train.output_dir={out}",
        f"tracking.uri=sqlite:///{out.parent / 'mlflow.db'}",
        "train.scheduler=none",
        "train.epochs=1",
        "train.batch_size=3",
    ]
    return load_config(None, [*base, *overrides])
