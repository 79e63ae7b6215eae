"""Checking that ``--resume`` continues the same run, before anything is written or started.

``--resume`` continues one of two things (``dpgs.records.find_resume_target``), each carrying the config
of the run that wrote it:

* a single-split run of any mode from its last checkpoint (``train.output_dir/checkpoint.pt``, format in
  ``dpgs.records``; ``read_checkpoint`` loads it);
* a k-fold command (``data.folds > 1``, any mode) from its finished folds (``train.output_dir/kfold.json``,
  ``dpgs.train.kfold_progress``).

A missing, truncated, foreign or other-format file is a ``CheckpointError`` naming it;
:func:`check_resume` then compares the two configs key by key:

* keys of :data:`RESUMABLE_KEYS` may differ (how long to train, where to log, timeouts, resources,
  read-ahead: nothing that changes the optimizer steps already taken or still to come);
* ``train.epochs`` may differ too, except with ``train.scheduler=cosine``, whose schedule spans the
  original number of epochs;
* every other key (model, data, splits, batch, optimizer, learning rate and schedule, seed, workers and
  compression, whose per-worker state the checkpoint restores) must be equal. All differences are
  refused together, each with its old and new value;
* a k-fold command's folds that finished were trained and tested with the command's epochs, early
  stopping, determinism and evaluation settings, and logged to its MLflow store and experiment
  (:data:`FIXED_ACROSS_FOLDS`): the folds still to train must use the same, so those keys must be equal
  too.

The run continues in its own directory (``train.output_dir`` must be the directory of the file).
:func:`check_resume_classes` compares the classes of the manifest with the run's. Every error is a
:class:`ResumeError` (a ``CheckpointError``, exit code 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpgs.config import Config, config_to_dict, flatten
from dpgs.records import CLASSES_FILE, KFOLD_FILE, Checkpoint, CheckpointError, read_checkpoint
from dpgs.train.kfold_progress import KfoldRecord, read_kfold_record

RESUMABLE_KEYS = (
    "experiment",
    "tracking.",
    "train.early_stopping.patience",
    "train.output_dir",  # checked apart: the checkpoint's directory, wherever it is now
    "train.checkpoint_every",
    "train.device",
    "train.deterministic",
    "eval.sample_k",
    "eval.repeats",
    "eval.bootstrap",
    "eval.ci_level",
    "data.prefetch",
    "data.cache_gb",
    "data.read_threads",
    "dpgs.resume",
    "dpgs.address",
    "dpgs.transport",
    "dpgs.dashboard",
    "dpgs.object_store_gb",
    "dpgs.call_timeout_s",
    "dpgs.max_worker_restarts",
    "dpgs.checkpoint_every",  # train.checkpoint_every's place in the config of checkpoints written before
    "dpgs.cpus_per_worker",
    "dpgs.gpus_per_worker",
    "dpgs.emulate_bandwidth_mbps",
)
FIXED_ACROSS_FOLDS = (
    "train.epochs",
    "train.early_stopping.patience",
    "train.deterministic",
    "eval.",
    "experiment",
    "tracking.uri",
)
"""Keys that a k-fold resume must keep though a single-split resume may change them: how the folds that
finished were trained and tested, and where their MLflow runs are (the resumed command's parent run takes
them as its nested runs, in the same store and experiment)."""


class ResumeError(CheckpointError):
    """``--resume`` cannot continue this checkpoint with this config; nothing was written."""


def _matches(key: str, patterns: tuple[str, ...]) -> bool:
    """Whether dotted ``key`` is one of ``patterns`` (a pattern ending in "." covers every key under it)."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in patterns)


def is_resumable_key(key: str, across_folds: bool = False, cosine: bool = False) -> bool:
    """Whether dotted config ``key`` may differ between a run and the resume that continues it
    (``across_folds``: a k-fold command resumed from its finished folds; ``cosine``: the resume's
    ``train.scheduler`` is cosine, whose schedule spans the original ``train.epochs``)."""
    if across_folds and _matches(key, FIXED_ACROSS_FOLDS):
        return False
    if key == "train.epochs":
        return not cosine
    return _matches(key, RESUMABLE_KEYS)


_ABSENT = object()


def _show(value: Any) -> str:
    return "(not set)" if value is _ABSENT else json.dumps(value)


def config_differences(saved: dict, config: Config, across_folds: bool = False) -> list[tuple[str, Any, Any]]:
    """(key, saved value, new value) for every key that differs and may not, sorted by key
    (``across_folds``: for a k-fold resume, see :func:`is_resumable_key`).

    A key that the saved run's dpgs did not have counts as its current default.
    """
    old = flatten(saved)
    new = flatten(config_to_dict(config))
    defaults = flatten(config_to_dict(Config()))
    found = []
    for key in sorted(set(old) | set(new)):
        before = old.get(key, defaults.get(key, _ABSENT))
        after = new.get(key, _ABSENT)
        if before == after:
            continue
        if is_resumable_key(key, across_folds, cosine=new.get("train.scheduler") == "cosine"):
            continue
        found.append((key, before, after))
    return found


def check_resume(config: Config) -> Checkpoint | KfoldRecord | None:
    """What ``config.dpgs.resume`` names (a checkpoint, or a k-fold command's record), once checked against
    ``config``; None when not resuming. Raises ResumeError before anything is written."""
    if config.dpgs.resume is None:
        return None
    path = Path(config.dpgs.resume)
    kfold = path.name == KFOLD_FILE
    saved = read_kfold_record(path) if kfold else read_checkpoint(path)
    out_dir = Path(config.train.output_dir)
    if out_dir.resolve() != path.parent.resolve():
        raise ResumeError(
            f"--resume continues a run in its own directory: {path.name} is in {path.parent}, but "
            f"train.output_dir={out_dir}; set train.output_dir={path.parent}"
        )
    saved_config = saved.config if kfold else saved.driver.config
    differences = config_differences(saved_config, config, across_folds=kfold)
    if differences:
        lines = [f"  {key}: {_show(before)} -> {_show(after)}" for key, before, after in differences]
        if kfold:
            allowed = ("A k-fold resume may change only tracking.run_name, timeouts, resources and "
                       "read-ahead: its finished folds were trained, tested and logged with the rest")
        else:
            epochs_note = ("; train.epochs only without train.scheduler=cosine"
                           if any(key == "train.epochs" for key, _, _ in differences) else "")
            allowed = ("A resume may change only train.epochs, tracking, timeouts, resources and read-ahead "
                       f"(docs/reliability.md){epochs_note}")
        raise ResumeError(
            f"--resume {path}: the new config changes the run in {len(differences)} key(s):\n"
            + "\n".join(lines)
            + f"\n{allowed}; start a new run to change the others"
        )
    return saved


def check_resume_classes(resume: Checkpoint | KfoldRecord, out_dir: Path, classes: list[str]) -> None:
    """ResumeError when the manifest's ``classes`` are not those of the run that ``resume`` continues in
    ``out_dir`` (a k-fold command's record holds them; a single-split run's ``classes.json`` does)."""
    if isinstance(resume, KfoldRecord):
        saved, source = resume.classes, Path(out_dir) / KFOLD_FILE
    else:
        source = Path(out_dir) / CLASSES_FILE
        if not source.is_file():
            return
        try:
            saved = json.loads(source.read_text())
        except (OSError, ValueError) as err:
            raise ResumeError(f"--resume: cannot read {source} ({err})") from None
    if saved != list(classes):
        raise ResumeError(
            f"--resume: the manifest's classes {classes} differ from the run's {saved} ({source}); the "
            "model's outputs would not match"
        )
