"""The training loop shared by every mode: epochs, validation, early stopping, checkpoints, MLflow.

``train_splits(config, session)`` validates all inputs first (nothing is written when they are bad), then
trains one run, or a parent run with one nested run per fold when ``data.folds > 1``, with the engines of
``session`` (:class:`~dpgs.train.engine.Session`; ``dpgs.runner.run_training`` picks it from the mode).
``--resume`` continues a single-split run from its last epoch's checkpoint, and a k-fold command from its
finished folds (:mod:`dpgs.train.kfold_progress`), in every mode.

Per fold, ``train.output_dir`` (or ``output_dir/fold_k``) receives the run records of ``dpgs.records``
(config, classes, metrics per epoch, last and best weights, curves, and ``run.json`` with the fold's MLflow
run, so ``dpgs heatmap --run DIR`` finds the run to log to). The best epoch maximises (or minimises)
``train.early_stopping.monitor``; with no validation bags the last epoch is the best.
"""

from __future__ import annotations

import csv
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from dpgs.config import Config, ConfigError, config_to_dict, flatten, save_config
from dpgs.data import BagDataset, ExperimentData, Split
from dpgs.experiment import load_experiment_data
from dpgs.heap import freeze_startup_heap
from dpgs.interrupts import keep_signal_handlers
from dpgs.metrics import METRIC_NAMES
from dpgs.modeling import ModelSpec, initial_model, resolve_device
from dpgs.outputs import (
    locked_output_dir,
    remove_temporaries,
    save_torch_atomically,
    write_atomically,
    write_text_atomically,
)
from dpgs.plots import plot_training_curves
from dpgs.records import (
    ARTIFACTS,
    BEST_WEIGHTS,
    CLASSES_FILE,
    CONFIG_FILE,
    CURVES_FILE,
    LAST_WEIGHTS,
    METRICS_FILE,
    PARAM_STEPS_PER_EPOCH,
    REPLACED_BY_A_NEW_RUN,
    TAG_FOLD,
    TAG_FOLDS_KEPT,
    TAG_KFOLD_PARENT,
    TAG_MODE,
    TAG_MODEL,
    TAG_RESUMED_FROM,
    Checkpoint,
    recorded_run_id,
    write_run_file,
)
from dpgs.tracking import RunTracker
from dpgs.train.batching import epoch_batches
from dpgs.train.engine import Engine, EpochEnd, FoldSetup, Session, Validation
from dpgs.train.evaluate import EvalPlan, validation_protocol
from dpgs.train.kfold_progress import (
    FinishedFold,
    KeptFold,
    KfoldRecord,
    finished_folds,
    forget_finished_folds,
    split_digest,
    write_finished_fold,
    write_kfold_record,
)
from dpgs.train.optim import class_weights_for
from dpgs.train.resume_check import check_resume, check_resume_classes
from dpgs.train.steps import check_mode_supported


@dataclass
class FoldResult:
    name: str
    run_id: str
    output_dir: Path
    best_epoch: int
    test_metrics: dict[str, float]
    history: list[dict[str, float]] = field(default_factory=list)


@dataclass
class TrainingResult:
    run_id: str
    folds: list[FoldResult]
    summary: dict[str, float]


def seed_everything(seed: int, deterministic: bool) -> None:
    torch.manual_seed(seed)
    np.random.seed(seed % (2**32))
    if deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)


def is_improvement(value: float, best: float | None, mode: str) -> bool:
    if value is None or not math.isfinite(value):
        return False
    if best is None:
        return True
    return value > best if mode == "max" else value < best


def close_after_error(engine: Engine) -> None:
    """Release ``engine`` while an error or interrupt ends the fold, once the files of the last epoch it
    saved are written (an interrupted run resumes from that epoch's checkpoint); a failure to write or to
    release (a dead cluster) is printed, so that the error that ended the run is the one reported."""
    try:
        engine.wait_saved()
    except Exception as err:
        print(f"[dpgs] warning: the last epoch's files could not be written: {type(err).__name__}: {err}",
              file=sys.stderr)
    try:
        engine.close()
    except Exception as err:
        print(f"[dpgs] warning: could not release the engine cleanly: {type(err).__name__}: {err}",
              file=sys.stderr)


class FoldTrainer:
    """Trains and evaluates one split."""

    def __init__(self, config: Config, dataset: BagDataset, classes: list[str], split: Split, out_dir: Path,
                 eval_dataset=None):
        self.config = config
        self.dataset = dataset
        self.eval_dataset = dataset if eval_dataset is None else eval_dataset
        self.classes = classes
        self.split = split
        self.out_dir = out_dir
        self.device = resolve_device(config.train.device)
        self.num_classes = len(classes)

    def _write_history(self, history: list[dict]) -> Path:
        keys = list(dict.fromkeys(k for row in history for k in row))

        def write(tmp: Path) -> None:
            with tmp.open("w", newline="") as fh:
                writer = csv.DictWriter(fh, fieldnames=keys)
                writer.writeheader()
                writer.writerows(history)

        return write_atomically(self.out_dir / METRICS_FILE, write)

    def run(self, tracker: RunTracker, session: Session, checkpoint: Checkpoint | None = None) -> FoldResult:
        """Train and test the split; ``checkpoint`` (checked by dpgs.train.resume_check) is continued."""
        cfg = self.config
        freeze_startup_heap()
        seed_everything(cfg.seed, cfg.train.deterministic)
        train_idx, val_idx, test_idx = self.split.train, self.split.val, self.split.test
        labels = [self.dataset.records[i].label for i in train_idx]
        class_weights = class_weights_for(labels, self.num_classes) if cfg.train.class_weighted_loss else None
        in_dim = None if cfg.model.encoder else self.dataset.feature_dim
        spec = ModelSpec(cfg.model, in_dim, self.num_classes)
        model = initial_model(spec)
        batch_size = 1 if cfg.train.mode == "classic" else cfg.train.batch_size
        batches_per_epoch = math.ceil(len(train_idx) / batch_size)
        tracker.log_params(
            {
                PARAM_STEPS_PER_EPOCH: math.ceil(batches_per_epoch / cfg.train.accumulation_steps),
                "n_train": len(train_idx),
                "n_val": len(val_idx),
                "n_test": len(test_idx),
                "classes": json.dumps(self.classes),
                "n_parameters": sum(p.numel() for p in model.parameters()),
                "n_trainable_parameters": sum(p.numel() for p in model.parameters() if p.requires_grad),
            }
        )
        write_run_file(self.out_dir, tracker.run_id, cfg.experiment, cfg.tracking.uri)
        val_protocol = validation_protocol(cfg.eval, cfg.seed)
        setup = FoldSetup(cfg, spec, model, class_weights, self.dataset, train_idx, self.device, self.out_dir,
                          self.eval_dataset, Validation(tuple(val_idx), val_protocol) if val_idx else None)
        with keep_signal_handlers():  # an engine that starts Ray gets Ray's SIGTERM handler: keep ours
            engine: Engine = session.engine(setup)
        monitor, mode = cfg.train.early_stopping.monitor, cfg.train.early_stopping.mode
        history: list[dict] = []
        best_value, best_epoch, best_elapsed, stale = None, 0, 0.0, 0
        first_epoch, elapsed_before = 1, 0.0
        if checkpoint is not None:
            driver = engine.restore(checkpoint)
            history, first_epoch = list(driver.history), driver.epoch
            elapsed_before = history[-1]["elapsed_seconds"] if history else 0.0
            for row in history:
                if is_improvement(row.get(monitor), best_value, mode) or not val_idx:
                    best_value, best_epoch, best_elapsed, stale = (
                        row.get(monitor),
                        row["epoch"],
                        row["elapsed_seconds"],
                        0,
                    )
                else:
                    stale += 1
            within = f", step {driver.step_in_epoch}" if driver.step_in_epoch else ""
            print(f"[{self.split.name}] resumed from {cfg.dpgs.resume} at epoch {first_epoch}{within}")
        start = time.perf_counter() - elapsed_before
        try:
            for epoch in range(first_epoch, cfg.train.epochs + 1):
                epoch_start = time.perf_counter()
                batches = epoch_batches(train_idx, batch_size, cfg.seed, epoch)
                stats = engine.run_epoch(batches, epoch, history)
                row = {"epoch": epoch, **stats}
                if val_idx:
                    row.update(engine.evaluate(val_idx, val_protocol).metrics("val_"))
                row["epoch_seconds"] = time.perf_counter() - epoch_start
                row["elapsed_seconds"] = time.perf_counter() - start
                history.append(row)
                value = row.get(monitor)
                improved = is_improvement(value, best_value, mode) if val_idx else True
                if improved:
                    best_value = value if val_idx else None
                    best_epoch, best_elapsed, stale = epoch, row["elapsed_seconds"], 0
                else:
                    stale += 1
                weights = (self.out_dir / LAST_WEIGHTS, *((self.out_dir / BEST_WEIGHTS,) if improved else ()))
                engine.save_epoch(EpochEnd(epoch, history, weights))
                tracker.log_metrics({k: v for k, v in row.items() if k != "epoch"}, step=epoch)
                self._write_history(history)
                summary = ", ".join(
                    f"{k}={v:.4f}" for k, v in row.items() if k.startswith(("train_loss", "val_"))
                )
                print(f"[{self.split.name}] epoch {epoch}/{cfg.train.epochs} {summary}", flush=True)
                if cfg.train.early_stopping.patience and stale >= cfg.train.early_stopping.patience:
                    print(f"[{self.split.name}] early stopping: no {monitor} improvement for {stale} epochs")
                    break
            engine.wait_saved()
            if not (self.out_dir / BEST_WEIGHTS).exists():
                save_torch_atomically(engine.state_dict(), self.out_dir / BEST_WEIGHTS)
                best_epoch, best_elapsed = history[-1]["epoch"], history[-1]["elapsed_seconds"]
            best = torch.load(self.out_dir / BEST_WEIGHTS, weights_only=True)
            plan = EvalPlan.from_config(cfg.eval, cfg.seed)
            test = {}
            if test_idx:
                test = plan.metrics([engine.evaluate(test_idx, p, best) for p in plan.protocols])
            test.update({"best_epoch": best_epoch, "time_to_best_seconds": best_elapsed})
            test.update(engine.final_metrics())
            tracker.log_metrics(test)
        except BaseException:
            close_after_error(engine)
            raise
        engine.close()
        curves = plot_training_curves(history, self.out_dir / CURVES_FILE, title=self.split.name)
        for name in ARTIFACTS:
            tracker.log_artifact(self.out_dir / name)
        tracker.log_artifact(curves)
        return FoldResult(self.split.name, tracker.run_id, self.out_dir, best_epoch, test, history)


def cv_summary(folds: list[FoldResult]) -> dict[str, float]:
    """``cv_mean_test_<m>`` and ``cv_std_test_<m>`` over folds (NaN-free values only)."""
    out = {}
    for name in METRIC_NAMES:
        values = [f.test_metrics.get(f"test_{name}") for f in folds]
        values = [v for v in values if v is not None and math.isfinite(v)]
        if values:
            out[f"cv_mean_test_{name}"] = float(np.mean(values))
            out[f"cv_std_test_{name}"] = float(np.std(values))
    return out


def remove_earlier_run(out_dir: Path) -> None:
    """Remove the outputs of an earlier run in ``out_dir`` that a new run replaces
    (``REPLACED_BY_A_NEW_RUN``: its weights, metrics and what ``--resume`` would continue)."""
    for stale in REPLACED_BY_A_NEW_RUN:
        (out_dir / stale).unlink(missing_ok=True)


def prepare_output_dir(config: Config, out_dir: Path, classes: list[str], resuming: bool) -> None:
    """Make ``out_dir`` ready for one split (the caller holds the lock of ``train.output_dir``).

    Temporary files of a killed writer are removed. A new run removes an earlier run's outputs and writes
    its ``config.yaml`` and ``classes.json``; a resumed run keeps those of the run it continues (its config
    was checked against them), writing them only when they are missing.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    removed = remove_temporaries(out_dir)
    if removed:
        print(f"[dpgs] removed {len(removed)} temporary file(s) left by an interrupted write in {out_dir}")
    if not resuming:
        remove_earlier_run(out_dir)
    if not resuming or not (out_dir / CONFIG_FILE).is_file():
        save_config(config, out_dir / CONFIG_FILE)
    if not resuming or not (out_dir / CLASSES_FILE).is_file():
        write_text_atomically(out_dir / CLASSES_FILE, json.dumps(classes))


def check_model(config: Config, data: ExperimentData) -> None:
    """Build the model once, so that a bad ``model.name``, ``model.params``, encoder weights file or a mode
    the head cannot run is refused (ConfigError) before the output directory or the MLflow run exist."""
    in_dim = None if config.model.encoder else data.dataset.feature_dim
    try:
        model = initial_model(ModelSpec(config.model, in_dim, len(data.manifest.classes)))
        check_mode_supported(model, config.train.mode)
    except (ValueError, TypeError) as err:
        raise ConfigError(str(err)) from None  # the messages name the key (model.name, model.params, ...)


def train_splits(config: Config, session: Session) -> TrainingResult:
    """Check everything, then train every split with ``session``'s engines; returns the (parent) run id and
    the results. The caller owns ``session`` (and closes it).

    Before anything is written or started: a resume is checked against the run it continues
    (:mod:`dpgs.train.resume_check`), every input is validated and the model is built once. Then
    ``train.output_dir`` is locked for the whole run (:mod:`dpgs.outputs`). A run that does not finish is
    ended in MLflow as KILLED (interrupted) or FAILED (:meth:`RunTracker.fail`); its checkpoints stay.
    """
    resume = check_resume(config)
    data = load_experiment_data(config.data, seed=config.seed)
    check_model(config, data)
    if resume is not None:
        check_resume_classes(resume, Path(config.train.output_dir), data.manifest.classes)
    with locked_output_dir(config.train.output_dir) as root:
        if len(data.splits) == 1:
            return _train_single_split(config, session, data, root, resume)
        return _train_folds(config, session, data, root, resume)


def _run_tags(config: Config) -> dict[str, str]:
    return {TAG_MODE: config.train.mode, TAG_MODEL: config.model.name}


def _run_params(config: Config, data: ExperimentData) -> dict:
    params = flatten(config_to_dict(config))
    params["classes"] = json.dumps(data.manifest.classes)
    return params


def _train_single_split(config: Config, session: Session, data: ExperimentData, root: Path,
                        checkpoint: Checkpoint | None) -> TrainingResult:
    start = time.perf_counter()
    tags = _run_tags(config)
    continued = recorded_run_id(root) if checkpoint is not None else None
    if continued is not None:
        tags[TAG_RESUMED_FROM] = continued
    tracker = RunTracker.start(config.tracking.uri, config.experiment, config.tracking.run_name, tags)
    try:
        tracker.log_params(_run_params(config, data))
        prepare_output_dir(config, root, data.manifest.classes, resuming=checkpoint is not None)
        fold = FoldTrainer(
            config, data.dataset, data.manifest.classes, data.splits[0], root, data.eval_dataset
        ).run(tracker, session, checkpoint)
    except BaseException as err:
        tracker.fail(err)
        raise
    tracker.log_metrics({"total_seconds": time.perf_counter() - start})
    tracker.end()
    return TrainingResult(tracker.run_id, [fold], fold.test_metrics)


def _train_folds(config: Config, session: Session, data: ExperimentData, root: Path,
                 record: KfoldRecord | None) -> TrainingResult:
    """Every split of a k-fold command under one parent run, each in ``root/<split>`` as a nested run.

    A resume (``record``) keeps the folds that finished (:mod:`dpgs.train.kfold_progress`): their results
    count in the summary and their MLflow runs move under the new parent run. A new command forgets the
    finished folds of an earlier one in ``root`` (and its single-split run's files) before it starts.
    """
    start = time.perf_counter()
    uri, experiment, classes = config.tracking.uri, config.experiment, data.manifest.classes
    if record is None:
        kept = {}
        remove_earlier_run(root)
        forget_finished_folds(root, data.splits)
    else:
        kept = finished_folds(root, data.splits, data.dataset)
    tags = {**_run_tags(config), TAG_KFOLD_PARENT: "true"}
    if record is not None:
        tags.update({TAG_RESUMED_FROM: record.parent_run_id, TAG_FOLDS_KEPT: ",".join(kept)})
    parent = RunTracker.start(uri, experiment, config.tracking.run_name, tags)
    params = _run_params(config, data)
    folds = []
    try:
        parent.log_params(params)
        write_kfold_record(root, KfoldRecord(parent.run_id, config_to_dict(config), classes))
        for split in data.splits:
            out_dir = root / split.name
            if split.name in kept:
                folds.append(_kept_fold(kept[split.name], parent))
                continue
            child = RunTracker.start(uri, experiment, split.name, {**_run_tags(config), TAG_FOLD: split.name},
                                     parent=parent)
            try:
                child.log_params(params)
                prepare_output_dir(config, out_dir, classes, resuming=False)
                fold = FoldTrainer(config, data.dataset, classes, split, out_dir, data.eval_dataset).run(
                    child, session
                )
            except BaseException as err:
                child.fail(err)
                raise
            child.end()
            write_finished_fold(out_dir, FinishedFold(split.name, child.run_id, fold.best_epoch,
                                                      fold.test_metrics, split_digest(split, data.dataset)))
            folds.append(fold)
    except BaseException as err:
        parent.fail(err)
        raise
    summary = cv_summary(folds)
    summary["total_seconds"] = time.perf_counter() - start
    parent.log_metrics(summary)
    parent.end()
    return TrainingResult(parent.run_id, folds, summary)


def _kept_fold(kept: KeptFold, parent: RunTracker) -> FoldResult:
    """A fold that finished before the resume: its MLflow run nested under ``parent``, its result."""
    result = kept.result
    parent.adopt(result.run_id)
    metrics = ", ".join(f"{k}={v:.4f}" for k, v in result.test_metrics.items() if k.startswith("test_"))
    print(f"[{result.name}] finished before the resume (MLflow run {result.run_id}): kept; {metrics}")
    return FoldResult(result.name, result.run_id, kept.fold_dir, result.best_epoch, result.test_metrics,
                      kept.history)
