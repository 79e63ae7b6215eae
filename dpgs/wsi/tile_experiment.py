"""``data.kind=tiles``: the manifest, validated slides and coords files, the splits and two tile datasets.

:func:`load_tile_experiment` reads the manifest (slides located in ``data.slides_dir``), builds the
splits exactly as for feature bags, and checks every slide before anything is written: the slide file
exists and opens, its coords file (``dpgs tile`` output, CLAM or TRIDENT patches) exists, is readable,
holds at least one tile and fits the slide's levels. Every problem is reported in one
:class:`~dpgs.data.errors.DataValidationError` naming the file.

Two datasets share the items:

* ``dataset`` (training): ``data.tiles_per_bag`` tiles sampled per bag per epoch, per-slide augmentation
  (``data.augment``), ImageNet normalisation;
* ``eval_dataset``: every tile of the bag, no augmentation (the sampled K x R protocol of ``eval``
  subsamples these).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpgs.data.errors import DataValidationError
from dpgs.data.feature_experiment import ExperimentData, build_splits
from dpgs.data.manifest import load_manifest
from dpgs.wsi.augment import AugmentConfig, BagAugment
from dpgs.wsi.tiles import TileBagDataset, locate_slide, tile_items


def augment_from_config(section: Any) -> BagAugment | None:
    """The :class:`BagAugment` of ``data.augment`` (None when disabled)."""
    if not section.enabled:
        return None
    return BagAugment(
        AugmentConfig(
            flips=section.flips,
            rotations=section.rotations,
            color=section.color,
            hed_alpha=section.hed_alpha,
            hed_beta=section.hed_beta,
            hue=section.hue,
            saturation=section.saturation,
            brightness=section.brightness,
            blur_probability=section.blur_probability,
            blur_sigma=tuple(section.blur_sigma),
        )
    )


def load_tile_experiment(data_cfg: Any, seed: int = 0, classes: list[str] | None = None,
                         with_splits: bool = True) -> ExperimentData:
    """Manifest, training and evaluation tile datasets and splits of ``data_cfg`` (``data.kind=tiles``)."""
    if data_cfg.manifest is None or data_cfg.slides_dir is None or data_cfg.tiles_dir is None:
        raise DataValidationError(["data.manifest, data.slides_dir and data.tiles_dir are all required "
                                   "with data.kind=tiles"])
    slides_dir, tiles_dir = Path(data_cfg.slides_dir), Path(data_cfg.tiles_dir)
    problems = [f"{d}: {name} not found" for name, d in (("data.slides_dir", slides_dir),
                                                          ("data.tiles_dir", tiles_dir)) if not d.is_dir()]
    if problems:
        raise DataValidationError(problems)
    manifest = load_manifest(
        data_cfg.manifest, None, classes=classes, strict=False,
        locate=lambda sid: locate_slide(slides_dir, sid) or slides_dir / f"{sid}.tif",
    )
    problems = list(manifest.problems)
    splits = []
    if with_splits and not manifest.problems:
        try:
            splits = build_splits(manifest, data_cfg, seed)
        except DataValidationError as err:
            problems += err.problems
    try:
        items = tile_items(manifest.records, slides_dir, tiles_dir)
    except DataValidationError as err:
        problems += err.problems
    if problems:
        raise DataValidationError(problems)
    common = dict(tile_size=data_cfg.tile_size, seed=seed, threads=data_cfg.read_threads)
    train = TileBagDataset(items, tiles_per_bag=data_cfg.tiles_per_bag,
                           augment=augment_from_config(data_cfg.augment), **common)
    full = TileBagDataset(items, tiles_per_bag=None, augment=None, **common)
    return ExperimentData(manifest, train, splits, {}, eval_dataset=full)
