"""Everything a training run on feature bags needs from ``config.data``: manifest, validated dataset and
splits (``dpgs.experiment.load_experiment_data`` picks this or ``dpgs.wsi.tile_experiment``).

:func:`load_feature_experiment` reads the manifest, builds the splits and validates every feature file,
then raises one :class:`DataValidationError` listing all problems (manifest rows, split files, feature
files) before anything is written. Split precedence: ``data.folds > 1`` (K-fold), else
``data.split_file`` (CLAM), else the manifest's ``split`` column. Training needs at least two classes,
every class in every training part, and every case (patient) in one part only (``split_problems``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpgs.data.dataset import BagDataset
from dpgs.data.errors import DataValidationError
from dpgs.data.manifest import Manifest, load_manifest
from dpgs.data.readers import BagInfo
from dpgs.data.splits import Split, clam_splits, kfold_splits, manifest_split, split_problems
from dpgs.data.validate import validate_inputs


@dataclass
class ExperimentData:
    """``dataset`` is what training reads; ``eval_dataset`` what validation and testing read (the same
    object for feature bags; for tile bags every tile without augmentation)."""

    manifest: Manifest
    dataset: Any
    splits: list[Split]
    infos: dict[str, BagInfo]
    eval_dataset: Any = None

    def __post_init__(self) -> None:
        if self.eval_dataset is None:
            self.eval_dataset = self.dataset


def build_splits(manifest: Manifest, data_cfg: Any, seed: int) -> list[Split]:
    """The splits selected by ``data.folds``, ``data.split_file`` or the manifest's split column, checked
    for training (:func:`~dpgs.data.splits.split_problems`); DataValidationError lists every problem."""
    present = sorted({r.label_name for r in manifest.records})
    if len(present) == 1:
        raise DataValidationError([
            f"{manifest.source}: every slide has label '{present[0]}'; training a classifier needs at least "
            "two classes"
        ])
    splits = _select_splits(manifest, data_cfg, seed)
    problems = [problem for split in splits for problem in split_problems(manifest, split)]
    if problems:
        raise DataValidationError(problems)
    return splits


def _select_splits(manifest: Manifest, data_cfg: Any, seed: int) -> list[Split]:
    if data_cfg.folds > 1:
        if data_cfg.split_file is not None:
            raise DataValidationError(
                [f"data.folds={data_cfg.folds} and data.split_file={data_cfg.split_file}: choose one"]
            )
        return kfold_splits(manifest, data_cfg.folds, data_cfg.val_fraction, seed)
    if data_cfg.split_file is not None:
        return clam_splits(manifest, data_cfg.split_file)
    if manifest.records and all(r.split is None for r in manifest.records):
        raise DataValidationError(
            [f"{manifest.source}: no 'split' column; add one, or set data.split_file or data.folds > 1"]
        )
    return [manifest_split(manifest)]


def load_feature_experiment(
    data_cfg: Any,
    seed: int = 0,
    classes: list[str] | None = None,
    with_splits: bool = True,
    check_values: bool = True,
) -> ExperimentData:
    """Manifest, dataset and splits of ``data_cfg`` with ``data.kind=features`` (tile bags:
    :func:`dpgs.wsi.tile_experiment.load_tile_experiment`; either:
    :func:`dpgs.experiment.load_experiment_data`).

    ``classes`` forces the class order (evaluation of a saved model); ``with_splits=False`` skips split
    construction (``splits`` is then empty). Raises :class:`DataValidationError` with every problem.
    """
    if data_cfg.kind != "features":
        raise ValueError(f"data.kind={data_cfg.kind!r}: expected features or tiles")
    if data_cfg.manifest is None or data_cfg.features_dir is None:
        raise DataValidationError(["data.manifest and data.features_dir are both required"])
    manifest = load_manifest(
        data_cfg.manifest, data_cfg.features_dir, classes=classes, encoder=data_cfg.encoder, strict=False
    )
    splits: list[Split] = []
    split_problems: list[str] = []
    if with_splits and not manifest.problems:
        try:
            splits = build_splits(manifest, data_cfg, seed)
        except DataValidationError as err:
            split_problems = err.problems
    infos = validate_inputs(manifest, check_values=check_values, extra_problems=split_problems)
    dataset = BagDataset(manifest.records, cache_bytes=int(data_cfg.cache_gb * (1 << 30)), infos=infos)
    return ExperimentData(manifest, dataset, splits, infos)
