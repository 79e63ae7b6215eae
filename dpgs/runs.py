"""``--run RUN_DIR_OR_RUN_ID``: a trained dpgs run located by its directory or its MLflow run id.

A run directory is a ``train.output_dir`` (per fold ``output_dir/fold_k``) holding ``config.yaml``,
``classes.json`` and ``best.pt`` (``dpgs.records``). An MLflow run id is resolved like ``dpgs train
--resume`` does, with :func:`dpgs.records.run_dir_of`.

The other way round, :func:`find_mlflow_run` finds the MLflow run of a run directory: the most recent
run of the config's experiment whose output directory (as above) is that directory.

:func:`resolve_run_group` also accepts a parent of several splits (``data.folds > 1``, or a CLAM split
directory): its output directory, whose sub-directories ``fold_k`` (split names) are run directories,
or the MLflow id of its parent run (tag ``dpgs.kfold_parent``), whose nested runs are the folds.

Every problem raises :class:`RunError` (a ``ValueError``) naming the path or run id.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from dpgs.config import Config, ConfigError, load_config
from dpgs.config.schema import TrackingConfig
from dpgs.records import (
    BEST_WEIGHTS,
    CLASSES_FILE,
    CONFIG_FILE,
    PARAM_OUTPUT_DIR,
    RUN_DIR_FILES,
    TAG_FOLD,
    TAG_KFOLD_PARENT,
    TAG_PARENT,
    RunLookupError,
    mlflow_run,
    recorded_run_id,
    run_dir_of,
    sqlite_store_missing,
)

DEFAULT_TRACKING_URI = TrackingConfig().uri
_RUN_ID = re.compile(r"^[0-9a-f]{32}$")


class RunError(ValueError):
    """A run that cannot be located or loaded; the message names the path or run id."""


@dataclass(frozen=True)
class RunRef:
    """A located run: its directory, its config, and its MLflow run when known (``run_id`` or None)."""

    run_dir: Path
    config: Config
    run_id: str | None
    tracking_uri: str

    @property
    def checkpoint(self) -> Path:
        return self.run_dir / BEST_WEIGHTS

    def load_model(self, in_dim: int | None, checkpoint: Path | None = None) -> torch.nn.Module:
        """The run's model for ``len(classes())`` classes (``in_dim``: the feature dim of feature-bag runs,
        None for tile runs) with ``checkpoint`` (default ``best.pt``) loaded, in eval mode on the CPU;
        RunError naming the file when it cannot be read or does not fit."""
        from dpgs.modeling import ModelSpec

        checkpoint = self.checkpoint if checkpoint is None else Path(checkpoint)
        model = ModelSpec(self.config.model, in_dim, len(self.classes())).build()
        try:
            state = torch.load(checkpoint, map_location="cpu", weights_only=True)
        except Exception as err:  # missing file, pickle errors, truncated files, non-tensor content
            raise RunError(f"{checkpoint}: not a readable state_dict ({err})") from None
        try:
            model.load_state_dict(state)
        except (RuntimeError, TypeError) as err:
            first = str(err).strip().splitlines()[:3]
            raise RunError(f"{checkpoint}: does not match the run's model ({' '.join(first)})") from None
        return model.eval()

    def classes(self) -> list[str]:
        """The class names of ``classes.json``, in the model's output order."""
        path = self.run_dir / CLASSES_FILE
        try:
            classes = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise RunError(f"{path}: cannot read the run's classes ({err})") from None
        if not isinstance(classes, list) or not classes:
            raise RunError(f"{path}: expected a non-empty JSON list of class names")
        return [str(c) for c in classes]


def check_run_dir(run_dir: Path, what: str) -> None:
    """Raise :class:`RunError` unless ``run_dir`` holds config.yaml, classes.json and best.pt."""
    if not run_dir.is_dir():
        raise RunError(f"{what}: run directory {run_dir} not found")
    missing = [name for name in RUN_DIR_FILES if not (run_dir / name).is_file()]
    if missing:
        raise RunError(
            f"{what}: {run_dir} is not a dpgs run directory (missing {', '.join(missing)}; "
            "expected a train.output_dir, or output_dir/fold_k of a k-fold run)"
        )


def load_run_config(run_dir: Path) -> Config:
    """The run's ``config.yaml``."""
    try:
        return load_config(run_dir / CONFIG_FILE)
    except ConfigError as err:
        raise RunError(str(err)) from None


def _client(uri: str):
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri=uri)


def _get_run(run_id: str, uri: str):
    """The MLflow run ``run_id`` of ``uri``; RunError naming both when there is none."""
    try:
        return mlflow_run(run_id, uri, "--run", "a run directory")
    except RunLookupError as err:
        raise RunError(str(err)) from None


def dir_from_run_id(run_id: str, uri: str) -> Path:
    """The run directory of MLflow run ``run_id`` (see module docstring)."""
    run = _get_run(run_id, uri)
    if run.data.tags.get(TAG_KFOLD_PARENT) == "true":
        out = run.data.params.get(PARAM_OUTPUT_DIR)
        raise RunError(f"--run {run_id}: a k-fold parent run; pass one of its fold runs or {out}/fold_k")
    run_dir = run_dir_of(run.data.params, run.data.tags)
    if run_dir is None:
        raise RunError(f"--run {run_id}: the MLflow run has no param train.output_dir (not a dpgs run)")
    check_run_dir(run_dir, f"--run {run_id}")
    return run_dir


def find_mlflow_run(run_dir: Path, experiment: str, uri: str) -> str | None:
    """The MLflow run of ``run_dir``: the id in its ``run.json`` (written by training) when that run
    exists in ``uri``, else the latest run of ``experiment`` that wrote ``run_dir``, or None."""
    if sqlite_store_missing(uri) is not None:
        return None
    from mlflow.exceptions import MlflowException

    recorded = recorded_run_id(run_dir)
    if recorded is not None:
        try:
            _client(uri).get_run(recorded)
            return recorded
        except MlflowException:
            pass  # a run of another store: search the experiment
    client = _client(uri)
    try:
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return None
        target, token = run_dir.resolve(), None
        while True:
            page = client.search_runs([found.experiment_id], order_by=["attributes.start_time DESC"],
                                      max_results=1000, page_token=token)
            for run in page:
                candidate = run_dir_of(run.data.params, run.data.tags)
                if candidate is not None and candidate.resolve() == target:
                    return run.info.run_id
            token = page.token
            if not token:
                return None
    except MlflowException:
        return None


def resolve_run(target: str, tracking_uri: str | None = None, lookup_mlflow: bool = True) -> RunRef:
    """Locate ``target`` (a run directory or an MLflow run id) and load its config.

    The tracking URI is ``tracking_uri``, else the run config's ``tracking.uri`` (run directory) or
    ``sqlite:///mlflow.db`` (run id). With ``lookup_mlflow`` a run directory's MLflow run is looked up
    there (``run_id`` None when not found); without it ``run_id`` is only set for a run id.
    """
    path = Path(target)
    if path.is_dir() or not _RUN_ID.match(target):
        check_run_dir(path, f"--run {target}")
        config = load_run_config(path)
        uri = tracking_uri or config.tracking.uri
        run_id = find_mlflow_run(path, config.experiment, uri) if lookup_mlflow else None
        return RunRef(path, config, run_id, uri)
    uri = tracking_uri or DEFAULT_TRACKING_URI
    run_dir = dir_from_run_id(target, uri)
    return RunRef(run_dir, load_run_config(run_dir), target, uri)


@dataclass(frozen=True)
class RunGroup:
    """One trained run, or every fold of a parent of several splits (``kfold``), in split order;
    ``parent_run_id`` is the parent's MLflow run when known."""

    root: Path
    folds: tuple[RunRef, ...]
    kfold: bool
    parent_run_id: str | None


def _split_order(name: str) -> tuple[int, str]:
    found = re.search(r"(\d+)$", name)
    return (int(found.group(1)) if found else -1, name)


def fold_dirs(root: Path) -> list[Path]:
    """The sub-directories of ``root`` that are run directories, in split order (``fold_0``, ``fold_1``)."""
    found = [d for d in root.iterdir() if d.is_dir() and all((d / n).is_file() for n in RUN_DIR_FILES)]
    return sorted(found, key=lambda d: _split_order(d.name))


def _parent_of(folds: list[RunRef]) -> str | None:
    """The MLflow parent run of the first fold whose run is known."""
    from mlflow.exceptions import MlflowException

    for ref in folds:
        if ref.run_id is not None:
            try:
                return _client(ref.tracking_uri).get_run(ref.run_id).data.tags.get(TAG_PARENT)
            except MlflowException:
                return None
    return None


def _group_of_parent_run(run, uri: str) -> RunGroup:
    """The folds of k-fold parent ``run``: its nested runs, each located by its output directory."""
    client = _client(uri)
    children, token = [], None
    while True:
        page = client.search_runs([run.info.experiment_id], f"tags.{TAG_PARENT} = '{run.info.run_id}'",
                                  max_results=1000, page_token=token)
        children.extend(page)
        token = page.token
        if not token:
            break
    if not children:
        raise RunError(f"--run {run.info.run_id}: a k-fold parent run without nested fold runs in {uri}")
    folds = []
    for child in sorted(children, key=lambda c: _split_order(c.data.tags.get(TAG_FOLD, ""))):
        run_dir = run_dir_of(child.data.params, child.data.tags)
        what = f"--run {run.info.run_id} (fold run {child.info.run_id})"
        if run_dir is None:
            raise RunError(f"{what}: the MLflow run has no param train.output_dir (not a dpgs run)")
        check_run_dir(run_dir, what)
        folds.append(RunRef(run_dir, load_run_config(run_dir), child.info.run_id, uri))
    root = Path(run.data.params.get(PARAM_OUTPUT_DIR, folds[0].run_dir.parent))
    return RunGroup(root, tuple(folds), True, run.info.run_id)


def resolve_run_group(target: str, tracking_uri: str | None = None) -> RunGroup:
    """Locate ``target``: a run directory or MLflow run id (:func:`resolve_run`), or a parent of several
    splits (see the module docstring); RunError naming the path or run id."""
    path = Path(target)
    if path.is_dir() and not (path / CONFIG_FILE).is_file():
        found = fold_dirs(path)
        if not found:
            check_run_dir(path, f"--run {target}")  # raises, naming the missing files
        folds = [resolve_run(str(d), tracking_uri) for d in found]
        return RunGroup(path, tuple(folds), True, _parent_of(folds))
    if path.is_dir() or not _RUN_ID.match(target):
        return RunGroup(path, (resolve_run(target, tracking_uri),), False, None)
    uri = tracking_uri or DEFAULT_TRACKING_URI
    run = _get_run(target, uri)
    if run.data.tags.get(TAG_KFOLD_PARENT) == "true":
        return _group_of_parent_run(run, uri)
    ref = resolve_run(target, uri)
    return RunGroup(ref.run_dir, (ref,), False, None)
