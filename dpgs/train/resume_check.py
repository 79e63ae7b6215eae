"""Checking that ``--resume`` continues the same run, before anything is written or started.

A DPGS checkpoint (``train.output_dir/checkpoint.pt``, format in ``dpgs.records``) carries in its driver
part the config of the run that wrote it. ``dpgs.records.read_checkpoint`` loads it (a missing, truncated,
foreign or other-format file is a ``CheckpointError`` naming it); :func:`check_resume` then compares the
two configs key by key:

* keys of :data:`RESUMABLE_KEYS` may differ (how long to train, where to log, timeouts, resources,
  read-ahead: nothing that changes the optimizer steps already taken or still to come);
* ``train.epochs`` may differ too, except with ``train.scheduler=cosine``, whose schedule spans the
  original number of epochs;
* every other key (model, data, splits, batch, optimizer, learning rate and schedule, seed, workers and
  compression, whose per-worker state the checkpoint restores) must be equal. All differences are
  refused together, each with its old and new value.

The run continues in the checkpoint's own directory (``train.output_dir`` must be that directory), and
only single-split runs are resumable (``Config.resumable``: ``data.folds=1``; a k-fold command writes no
checkpoint, so it neither pays for one every epoch nor leaves one that ``--resume`` would refuse).
:func:`check_resume_classes` compares the classes of the manifest with the run's ``classes.json``. Every
error is a :class:`ResumeError` (a ``CheckpointError``, exit code 2).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpgs.config import Config, config_to_dict, flatten
from dpgs.records import CLASSES_FILE, Checkpoint, CheckpointError, read_checkpoint

RESUMABLE_KEYS = (
    "experiment",
    "tracking.",
    "train.early_stopping.patience",
    "train.output_dir",  # checked apart: the checkpoint's directory, wherever it is now
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
    "dpgs.checkpoint_every",
    "dpgs.cpus_per_worker",
    "dpgs.gpus_per_worker",
    "dpgs.emulate_bandwidth_mbps",
)
class ResumeError(CheckpointError):
    """``--resume`` cannot continue this checkpoint with this config; nothing was written."""


def is_resumable_key(key: str) -> bool:
    """Whether dotted config ``key`` may differ between a checkpoint and the run that resumes it."""
    return any(key == k or (k.endswith(".") and key.startswith(k)) for k in RESUMABLE_KEYS)


_ABSENT = object()


def _show(value: Any) -> str:
    return "(not set)" if value is _ABSENT else json.dumps(value)


def config_differences(saved: dict, config: Config) -> list[tuple[str, Any, Any]]:
    """(key, checkpoint's value, new value) for every key that differs and may not, sorted by key.

    A key that the checkpoint's dpgs did not have counts as its current default.
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
        cosine = new.get("train.scheduler") == "cosine"
        if is_resumable_key(key) or (key == "train.epochs" and not cosine):
            continue
        found.append((key, before, after))
    return found


def check_resume(config: Config) -> Checkpoint | None:
    """The checkpoint that ``config.dpgs.resume`` names, once checked against ``config`` (None when not
    resuming). Raises ResumeError before anything is written."""
    if config.dpgs.resume is None:
        return None
    path = Path(config.dpgs.resume)
    if config.train.mode != "dpgs":
        raise ResumeError("--resume needs train.mode=dpgs (single-process runs restart from best.pt)")
    if not config.resumable:
        raise ResumeError(f"--resume continues single-split runs; data.folds={config.data.folds} runs cannot "
                          "be resumed")
    checkpoint = read_checkpoint(path)
    out_dir = Path(config.train.output_dir)
    if out_dir.resolve() != path.parent.resolve():
        raise ResumeError(
            f"--resume continues a run in its own directory: the checkpoint is in {path.parent}, but "
            f"train.output_dir={out_dir}; set train.output_dir={path.parent}"
        )
    differences = config_differences(checkpoint.driver["config"], config)
    if differences:
        lines = [f"  {key}: {_show(before)} -> {_show(after)}" for key, before, after in differences]
        epochs_note = ("; train.epochs only without train.scheduler=cosine"
                       if any(key == "train.epochs" for key, _, _ in differences) else "")
        raise ResumeError(
            f"--resume {path}: the new config changes the run in {len(differences)} key(s):\n"
            + "\n".join(lines)
            + "\nA resume may change only train.epochs, tracking, timeouts, resources and read-ahead "
            f"(docs/reliability.md){epochs_note}; start a new run to change the others"
        )
    return checkpoint


def check_resume_classes(out_dir: Path, classes: list[str]) -> None:
    """ResumeError when the manifest's classes are not those of the run in ``out_dir`` (``classes.json``)."""
    path = Path(out_dir) / CLASSES_FILE
    if not path.is_file():
        return
    try:
        saved = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ResumeError(f"--resume: cannot read {path} ({err})") from None
    if saved != list(classes):
        raise ResumeError(
            f"--resume: the manifest's classes {classes} differ from the run's {saved} ({path}); the "
            "model's outputs would not match"
        )
