"""Run records: the files a run writes, the checkpoint format, the MLflow names every command uses,
and the way from an MLflow run id to its run directory. Every mode writes and reads through these names.

A run directory is ``train.output_dir`` (``output_dir/fold_k`` for each fold of a k-fold run)::

    config.yaml           the run's config                    classes.json   class names, output order
    metrics.csv           one row per epoch                   run.json       MLflow run id, experiment, URI
    last.pt, best.pt      model state_dicts                   training_curves.png
    checkpoint.pt         single-split runs: what ``--resume`` continues (:class:`Checkpoint`)
    fold_result.json      a finished fold of a k-fold run     kfold.json     in ``output_dir``: the k-fold run
                          (``dpgs.train.kfold_progress``: what ``--resume`` of a k-fold command keeps)

A checkpoint is a dict of tensors and plain values (loaded with ``weights_only=True``)::

    {"format": CHECKPOINT_FORMAT,
     "master":  {"model", "optimizer", "step", "sync"},             MasterCheckpoint
     "driver":  {"epoch", "step_in_epoch", "history", "config",      DriverProgress: where the driver stood,
                 and the engine's own keys beside them},           and the engine's part of it
     "workers": [each worker's step-synchronisation state, or None]}

The engine's part of ``driver`` is the engine's own dataclass (``DpgsProgress`` in
``dpgs.distributed.dpgs_engine``: worker restarts, keep ratio, ...; ``LocalProgress`` in
``dpgs.train.local_engine``: random states, the epoch's loss so far). A single-process run writes the
same shape: the process holds the master's part (``sync`` empty) and ``workers`` is empty. The resume
check refuses another ``train.mode``, so each engine reads only its own kind.

MLflow: params are the flattened config plus :data:`RUN_PARAMS`; tags are the ``TAG_*`` names below.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from pathlib import Path

from dpgs.errors import RunFailure
from dpgs.outputs import save_torch_atomically, write_text_atomically

# ---------------------------------------------------------------- files of a run directory
CONFIG_FILE = "config.yaml"
CLASSES_FILE = "classes.json"
METRICS_FILE = "metrics.csv"
RUN_FILE = "run.json"
LAST_WEIGHTS = "last.pt"
BEST_WEIGHTS = "best.pt"
CHECKPOINT_FILE = "checkpoint.pt"
CURVES_FILE = "training_curves.png"
KFOLD_FILE = "kfold.json"
FOLD_RESULT_FILE = "fold_result.json"
RESUME_TARGETS = (CHECKPOINT_FILE, KFOLD_FILE)  # what `--resume RUN_DIR` continues: a directory has one
RUN_DIR_FILES = (CONFIG_FILE, CLASSES_FILE, BEST_WEIGHTS)  # what makes a directory a trained run
REPLACED_BY_A_NEW_RUN = (BEST_WEIGHTS, LAST_WEIGHTS, METRICS_FILE, FOLD_RESULT_FILE, *RESUME_TARGETS)
ARTIFACTS = (CONFIG_FILE, CLASSES_FILE, METRICS_FILE, BEST_WEIGHTS)  # logged to MLflow (with the curves)

# ---------------------------------------------------------------- MLflow names
TAG_MODE = "dpgs.mode"
TAG_MODEL = "dpgs.model"
TAG_FOLD = "dpgs.fold"  # the nested run of one fold: its split name
TAG_KFOLD_PARENT = "dpgs.kfold_parent"  # "true" on the parent run of several splits
TAG_RESUMED_FROM = "dpgs.resumed_from"  # on a resumed run: the run it continues (k-fold: the parent)
TAG_FOLDS_KEPT = "dpgs.folds_kept"  # on a resumed k-fold parent: the folds finished before, comma-separated
TAG_ERROR = "dpgs.error"  # why a run ended FAILED or KILLED
TAG_KIND = "dpgs.kind"  # "comparison" or "evaluation" for runs that are not trainings
TAG_EVALUATES = "dpgs.evaluates"  # the training run a `dpgs eval` run evaluates
TAG_METRIC = "dpgs.metric"  # the metric of a comparison run
TAG_PARENT = "mlflow.parentRunId"
PARAM_OUTPUT_DIR = "train.output_dir"
PARAM_STEPS_PER_EPOCH = "steps_per_epoch"  # optimizer steps per epoch (accumulation included)
KIND_COMPARISON, KIND_EVALUATION = "comparison", "evaluation"

CHECKPOINT_FORMAT = 3


class CheckpointError(RunFailure):
    """A checkpoint that cannot be found or read; the message names it. Nothing was written."""

    exit_code = 2


@dataclass
class MasterCheckpoint:
    """The master's part of a checkpoint: weights, optimizer, optimizer steps taken, and its
    step-synchronisation state (``StepSync.state_dict``)."""

    model: dict
    optimizer: dict
    step: int
    sync: dict


@dataclass
class DriverProgress:
    """The driver's part of a checkpoint: the run continues before optimizer step ``step_in_epoch`` of
    ``epoch`` (0: at the epoch's start), with ``history`` (every finished epoch's row of ``metrics.csv``)
    and ``config`` (the run's, ``config_to_dict``: what ``--resume`` compares its own config with).
    ``engine``: the part that the engine which wrote the checkpoint reads back (its own dataclass as a
    dict, module docstring), stored beside the others in the file."""

    epoch: int
    step_in_epoch: int
    history: list[dict]
    config: dict
    engine: dict = field(default_factory=dict)

    def to_file(self) -> dict:
        """The ``driver`` dict of the file."""
        shared = set(self.engine) & set(DRIVER_KEYS)
        if shared:
            raise ValueError(f"the engine's part of a checkpoint may not use the keys {sorted(shared)}")
        return {"epoch": self.epoch, "step_in_epoch": self.step_in_epoch, "history": self.history,
                "config": self.config, **self.engine}

    @classmethod
    def from_file(cls, driver: dict) -> DriverProgress:
        """The inverse of :meth:`to_file` (``driver`` holds every key of :data:`DRIVER_KEYS`)."""
        engine = {k: v for k, v in driver.items() if k not in DRIVER_KEYS}
        return cls(int(driver["epoch"]), int(driver["step_in_epoch"]), list(driver["history"]),
                   driver["config"], engine)


DRIVER_KEYS = tuple(f.name for f in fields(DriverProgress) if f.name != "engine")


@dataclass
class Checkpoint:
    """A checkpoint as read back (module docstring)."""

    master: MasterCheckpoint
    driver: DriverProgress
    workers: list


def save_checkpoint(path: str | Path, master: MasterCheckpoint, driver: DriverProgress,
                    workers: list) -> Path:
    """Write a checkpoint atomically (``dpgs.outputs``); a failure leaves the previous one intact."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    return save_torch_atomically(
        {"format": CHECKPOINT_FORMAT, "master": {f.name: getattr(master, f.name) for f in fields(master)},
         "driver": driver.to_file(), "workers": list(workers)},  # not asdict: it would deep-copy every tensor
        path,
    )


def read_checkpoint(path: str | Path) -> Checkpoint:
    """The checkpoint at ``path``; CheckpointError naming it when it is missing, corrupt, not a dpgs
    checkpoint or written by another checkpoint format."""
    import torch

    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"--resume: checkpoint {path} not found")
    try:
        raw = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # truncated zip, pickle of other objects, ...: torch raises many types
        first_line = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(
            f"--resume: checkpoint {path} is corrupt or not a dpgs checkpoint ({type(err).__name__}: "
            f"{first_line}); resume from an intact checkpoint or start a new run"
        ) from None
    parts = raw if isinstance(raw, dict) else {}
    master, driver = parts.get("master"), parts.get("driver")
    if not (isinstance(master, dict) and isinstance(driver, dict) and all(k in driver for k in DRIVER_KEYS)):
        raise CheckpointError(
            f"--resume: {path} is not a dpgs checkpoint (expected 'master' and 'driver' with "
            f"{', '.join(DRIVER_KEYS)})"
        )
    if parts.get("format") != CHECKPOINT_FORMAT:
        raise CheckpointError(
            f"--resume: {path} has checkpoint format {parts.get('format')}; this dpgs reads format "
            f"{CHECKPOINT_FORMAT} (resume with the dpgs version that wrote it, or start a new run)"
        )
    try:
        master_part = MasterCheckpoint(**master)
    except TypeError as err:
        raise CheckpointError(f"--resume: {path}: the master's part does not fit ({err})") from None
    return Checkpoint(master_part, DriverProgress.from_file(driver), list(parts.get("workers") or []))


def write_run_file(run_dir: Path, run_id: str, experiment: str, tracking_uri: str) -> Path:
    """``run.json``: the MLflow run of a run directory."""
    return write_text_atomically(
        Path(run_dir) / RUN_FILE,
        json.dumps({"run_id": run_id, "experiment": experiment, "tracking_uri": tracking_uri}),
    )


def recorded_run_id(run_dir: Path) -> str | None:
    """The MLflow run id in ``run_dir/run.json`` (None when there is none or it cannot be read)."""
    try:
        return str(json.loads((Path(run_dir) / RUN_FILE).read_text())["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_dir_of(params: dict[str, str], tags: dict[str, str]) -> Path | None:
    """The directory an MLflow run of ``dpgs train`` wrote to (None: not a dpgs training run): its param
    ``train.output_dir``, plus the fold name (tag ``dpgs.fold``) for the nested run of a fold; a relative
    directory is relative to the current directory, as training wrote it."""
    out = params.get(PARAM_OUTPUT_DIR)
    if not out:
        return None
    fold = tags.get(TAG_FOLD)
    return Path(out) / fold if fold else Path(out)


class RunLookupError(ValueError):
    """A value that names neither a local path nor an MLflow run of the tracking store."""


def mlflow_run(run_id: str, tracking_uri: str, what: str, local: str):
    """The MLflow run ``run_id`` of ``tracking_uri``. RunLookupError when the store does not exist or has no
    such run, naming ``what`` (the option that gave the value) and ``local`` (what else it could have
    named, for example "a run directory")."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    missing = sqlite_store_missing(tracking_uri)
    if missing is not None:
        raise RunLookupError(f"{what} {run_id}: no {local} of that name, and the tracking store {missing} "
                             "does not exist (give --tracking-uri)")
    try:
        return MlflowClient(tracking_uri=tracking_uri).get_run(run_id)
    except MlflowException as err:
        raise RunLookupError(f"{what} {run_id}: neither {local} nor an MLflow run id in {tracking_uri} "
                             f"({err.message})") from None


def sqlite_store_missing(uri: str) -> Path | None:
    """The database file of a ``sqlite:///FILE`` URI when it does not exist (opening it would create it)."""
    prefix = "sqlite:///"
    if not uri.startswith(prefix):
        return None
    path = Path(uri[len(prefix) :].split("?", 1)[0])
    return None if path.is_file() else path


def find_resume_target(target: str, tracking_uri: str) -> Path:
    """What ``dpgs train --resume TARGET`` continues: a file (a single-split run's ``checkpoint.pt``, a
    k-fold command's ``kfold.json``), a run directory holding one of them, or the MLflow run id of such a
    run (a k-fold command's parent run); CheckpointError naming TARGET when there is none."""
    path = Path(target)
    if path.is_file():
        return path
    if path.is_dir():
        return _resume_target_in(path, f"--resume {target}")
    try:
        run = mlflow_run(target, tracking_uri, "--resume", "a checkpoint file or run directory")
    except RunLookupError as err:
        raise CheckpointError(str(err)) from None
    run_dir = run_dir_of(run.data.params, run.data.tags)
    if run_dir is None or not run_dir.is_dir():
        raise CheckpointError(f"--resume {target}: the run's output directory {run_dir} does not exist here")
    return _resume_target_in(run_dir, f"--resume {target} (an MLflow run)")


def _resume_target_in(run_dir: Path, what: str) -> Path:
    for name in RESUME_TARGETS:
        if (run_dir / name).is_file():
            return run_dir / name
    raise CheckpointError(f"{what}: no {' or '.join(RESUME_TARGETS)} in {run_dir}")
