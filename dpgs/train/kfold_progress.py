"""What a k-fold command keeps so that ``--resume`` continues it fold by fold.

A k-fold command (``data.folds > 1``) writes no checkpoint during a fold: a fold is short, and a checkpoint
every epoch would slow every fold of every command for the rare one that is interrupted. It keeps instead:

* ``train.output_dir/kfold.json`` (:class:`KfoldRecord`), written before its first fold: the command's
  config and classes, and its MLflow parent run;
* ``train.output_dir/fold_k/fold_result.json`` (:class:`FinishedFold`), written once fold k is trained,
  tested and its MLflow run ended: that run, the best epoch, the test metrics, and the digest of the
  fold's split (:func:`split_digest`).

``dpgs train --resume OUTPUT_DIR`` checks the config against the record (``dpgs.train.resume_check``),
keeps every finished fold (:func:`finished_folds`) and trains the others from their first epoch. A fold is
seeded by itself (``train.seed``; the data order by seed and epoch), so with a fixed compression or in a
single-process mode a fold trained after a resume is the fold an uninterrupted command trains. With
``compression: auto`` a fold after the first starts from the link and compute that the folds before it
measured in the same command; after a resume the first fold trained measures them again.

A new command (not a resume) removes every fold's ``fold_result.json`` before its first fold
(:func:`forget_finished_folds`), so a later ``--resume`` never keeps a fold of an earlier command.
"""

from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from dpgs.data import Split
from dpgs.data.dataset import BagSource
from dpgs.outputs import write_text_atomically
from dpgs.records import BEST_WEIGHTS, FOLD_RESULT_FILE, KFOLD_FILE, METRICS_FILE, CheckpointError

KFOLD_FORMAT = 1


@dataclass(frozen=True)
class KfoldRecord:
    """``kfold.json``: the command a ``--resume`` continues (``config`` as ``config_to_dict`` writes it)."""

    parent_run_id: str
    config: dict
    classes: list[str]


@dataclass(frozen=True)
class FinishedFold:
    """``fold_result.json``: a fold that was trained and tested to the end, and the bags it was run on."""

    name: str
    run_id: str
    best_epoch: int
    test_metrics: dict[str, float]
    split_sha256: str


def split_digest(split: Split, dataset: BagSource) -> str:
    """SHA-256 of the slide ids and labels of ``split``'s train, val and test bags, in order: the same
    digest means the same bags in the same parts (a changed manifest or split does not)."""
    parts = {part: [[dataset.records[i].slide_id, str(dataset.records[i].label)] for i in indices]
             for part, indices in split.parts().items()}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def write_kfold_record(root: Path, record: KfoldRecord) -> Path:
    body = {"format": KFOLD_FORMAT, **asdict(record)}
    return write_text_atomically(Path(root) / KFOLD_FILE, json.dumps(body))


def read_kfold_record(path: Path) -> KfoldRecord:
    """The record at ``path``; CheckpointError naming it when it is missing, unreadable or not one."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise CheckpointError(f"--resume: cannot read the k-fold record {path} ({err})") from None
    if not isinstance(raw, dict) or raw.get("format") != KFOLD_FORMAT:
        found = raw.get("format") if isinstance(raw, dict) else type(raw).__name__
        raise CheckpointError(f"--resume: {path} is not a k-fold record of format {KFOLD_FORMAT} (found "
                              f"{found}); start a new run")
    try:
        record = KfoldRecord(str(raw["parent_run_id"]), dict(raw["config"]), [str(c) for c in raw["classes"]])
    except (KeyError, TypeError, ValueError) as err:
        raise CheckpointError(f"--resume: the k-fold record {path} lacks or mangles {err}") from None
    return record


def write_finished_fold(fold_dir: Path, fold: FinishedFold) -> Path:
    """Write ``fold_result.json`` (JSON has no NaN: a metric that is not finite is left out)."""
    metrics = {k: float(v) for k, v in fold.test_metrics.items() if math.isfinite(float(v))}
    body = {**asdict(fold), "test_metrics": metrics}
    return write_text_atomically(Path(fold_dir) / FOLD_RESULT_FILE, json.dumps(body))


def _read_finished_fold(path: Path) -> FinishedFold | None:
    try:
        raw = json.loads(path.read_text())
        metrics = {str(k): float(v) for k, v in raw["test_metrics"].items()}
        return FinishedFold(str(raw["name"]), str(raw["run_id"]), int(raw["best_epoch"]), metrics,
                            str(raw["split_sha256"]))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def read_history(path: Path) -> list[dict[str, float]]:
    """The rows of a fold's ``metrics.csv`` (``epoch`` an int, every other value a float; empty cells left
    out, as a row that lacked the column was written)."""
    with Path(path).open(newline="") as fh:
        return [{k: int(v) if k == "epoch" else float(v) for k, v in row.items() if v != ""}
                for row in csv.DictReader(fh)]


@dataclass(frozen=True)
class KeptFold:
    """A finished fold that a resumed command keeps, with its epochs (``metrics.csv``)."""

    result: FinishedFold
    fold_dir: Path
    history: list[dict[str, float]]


def finished_folds(root: Path, splits: list[Split], dataset: BagSource) -> dict[str, KeptFold]:
    """The folds of ``splits`` that finished in ``root``, by name.

    A fold whose ``fold_result.json``, ``best.pt`` or ``metrics.csv`` is missing or unreadable did not
    finish (it is trained again). A finished fold whose split digest differs from the split computed now
    is a CheckpointError naming it: the manifest or the split settings changed, and its results would not
    belong to this command.
    """
    kept = {}
    for split in splits:
        fold_dir = Path(root) / split.name
        fold = _read_finished_fold(fold_dir / FOLD_RESULT_FILE)
        if fold is None or fold.name != split.name or not (fold_dir / BEST_WEIGHTS).is_file():
            continue
        try:
            history = read_history(fold_dir / METRICS_FILE)
        except (OSError, ValueError, csv.Error):
            continue
        if fold.split_sha256 != split_digest(split, dataset):
            raise CheckpointError(
                f"--resume: {split.name} was trained on other bags than the manifest gives it now "
                f"({fold_dir / FOLD_RESULT_FILE}): the manifest or its splits changed; start a new run"
            )
        kept[split.name] = KeptFold(fold, fold_dir, history)
    return kept


def forget_finished_folds(root: Path, splits: list[Split]) -> None:
    """Remove the ``fold_result.json`` of every fold of ``splits`` (a new command starts)."""
    for split in splits:
        (Path(root) / split.name / FOLD_RESULT_FILE).unlink(missing_ok=True)
