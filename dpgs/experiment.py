"""Everything a run needs from ``config.data``, whatever its bags: feature bags (``dpgs.data``) or tiles
read from slides (``dpgs.wsi``). Sitting above both packages, this keeps them independent of each other.
"""

from __future__ import annotations

from typing import Any

from dpgs.data.feature_experiment import ExperimentData, load_feature_experiment
from dpgs.wsi.tile_experiment import load_tile_experiment


def load_experiment_data(data_cfg: Any, seed: int = 0, classes: list[str] | None = None,
                         with_splits: bool = True, check_values: bool = True) -> ExperimentData:
    """Manifest, dataset(s) and splits of ``data_cfg`` (a :class:`dpgs.config.schema.DataConfig`); every
    input problem is raised at once as a :class:`~dpgs.data.errors.DataValidationError` before anything is
    written. ``classes`` forces the class order (evaluation of a saved model); ``with_splits=False`` skips
    the splits; ``check_values`` (feature bags) scans the values for NaN/inf."""
    if data_cfg.kind == "tiles":
        return load_tile_experiment(data_cfg, seed=seed, classes=classes, with_splits=with_splits)
    return load_feature_experiment(data_cfg, seed=seed, classes=classes, with_splits=with_splits,
                                   check_values=check_values)
