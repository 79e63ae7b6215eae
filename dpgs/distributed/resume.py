"""Locating the checkpoint that ``dpgs train --resume PATH_OR_RUN_ID`` continues from."""

from __future__ import annotations

from pathlib import Path

from dpgs.config import Config, ConfigError

CHECKPOINT_NAME = "checkpoint.pt"  # the one name of a DPGS checkpoint in train.output_dir


def find_checkpoint(target: str, tracking_uri: str) -> Path:
    """A checkpoint file, a run directory holding ``checkpoint.pt``, or an MLflow run id."""
    path = Path(target)
    if path.is_file():
        return path
    if path.is_dir():
        candidate = path / CHECKPOINT_NAME
        if candidate.is_file():
            return candidate
        raise ConfigError(f"--resume {target}: no {CHECKPOINT_NAME} in that directory")
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    try:
        run = MlflowClient(tracking_uri=tracking_uri).get_run(target)
    except MlflowException as err:
        raise ConfigError(
            f"--resume {target}: neither a file, a directory nor an MLflow run id ({err})"
        ) from None
    out_dir = run.data.params.get("train.output_dir")
    candidate = Path(out_dir or "") / CHECKPOINT_NAME
    if not out_dir or not candidate.is_file():
        raise ConfigError(
            f"--resume {target}: the run's output directory has no {CHECKPOINT_NAME} ({candidate})"
        )
    return candidate


def attach_resume(config: Config, target: str) -> Config:
    """``config`` with ``dpgs.resume`` pointing at the checkpoint of ``target``."""
    checkpoint = find_checkpoint(target, config.tracking.uri)
    dpgs = config.dpgs.model_copy(update={"resume": checkpoint})
    return config.model_copy(update={"dpgs": dpgs})
