"""Train/val/test splits as lists of record indices into a :class:`~dpgs.data.manifest.Manifest`.

Sources:

* the manifest's ``split`` column (:func:`manifest_split`);
* CLAM split files ``splits_k.csv`` with columns ``train,val,test`` of slide ids, ragged with blank
  cells, optionally preceded by CLAM's unnamed index column (:func:`clam_splits`; a directory gives one
  split per ``splits_*.csv`` in numeric order of k);
* K-fold cross-validation (:func:`kfold_splits`): scikit-learn's ``StratifiedGroupKFold`` stratified
  by label and grouped by ``case_id``, so no case is in two test folds and the slides of one case are
  never divided between train, val and test. The validation part is carved out of each fold's
  training part the same way: the first fold of a ``StratifiedGroupKFold`` with
  ``round(1 / val_fraction)`` folds (so it holds about ``1 / round(1 / val_fraction)`` of the training
  cases). ``val_fraction = 0`` leaves val empty. A fixed seed gives identical splits. Every class needs
  at least K cases (one per test fold), and at least ``round(1 / val_fraction)`` training cases in every
  fold for the validation part.

:func:`split_problems` checks a split of any source before training: a case (patient) in two parts, or a
class without a training slide, is reported.
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from dpgs.data.errors import DataValidationError
from dpgs.data.manifest import SPLIT_VALUES, Manifest


@dataclass
class Split:
    """Record indices of the train, val and test parts; ``name`` labels runs and output folders."""

    name: str
    train: list[int] = field(default_factory=list)
    val: list[int] = field(default_factory=list)
    test: list[int] = field(default_factory=list)

    def parts(self) -> dict[str, list[int]]:
        return {"train": self.train, "val": self.val, "test": self.test}


def manifest_split(manifest: Manifest, name: str = "split") -> Split:
    """The split given by the manifest's ``split`` column; every row must have a value."""
    split = Split(name)
    problems = []
    for i, record in enumerate(manifest.records):
        if record.split is None:
            problems.append(
                f"{manifest.source}, row {record.row}: slide '{record.slide_id}' has no split value"
            )
        elif record.split in SPLIT_VALUES:
            getattr(split, record.split).append(i)
    if problems:
        raise DataValidationError(problems)
    if not split.train:
        raise DataValidationError([f"{manifest.source}: no slide has split 'train'"])
    return split


def _read_clam_file(path: Path, index: dict[str, int], problems: list[str]) -> Split:
    split = Split(path.stem)
    known_before = len(problems)
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = [c.strip().lower() for c in next(reader, [])]
            missing = [c for c in SPLIT_VALUES if c not in header]
            if missing:
                problems.append(
                    f"{path}: missing column(s) {', '.join(missing)} (columns: {', '.join(header)})"
                )
                return split
            cols = {part: header.index(part) for part in SPLIT_VALUES}
            where: dict[str, str] = {}
            for values in reader:
                line = reader.line_num
                for part, col in cols.items():
                    sid = values[col].strip() if col < len(values) else ""
                    if not sid:
                        continue
                    if sid not in index:
                        problems.append(
                            f"{path}, row {line}, column {part}: slide '{sid}' is not in the manifest"
                        )
                    elif sid in where:
                        problems.append(
                            f"{path}, row {line}, column {part}: slide '{sid}' already listed ({where[sid]})"
                        )
                    else:
                        where[sid] = f"row {line}, column {part}"
                        getattr(split, part).append(index[sid])
    except FileNotFoundError:
        problems.append(f"{path}: split file not found")
        return split
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        problems.append(f"{path}: cannot read split file ({err})")
        return split
    if not split.train and len(problems) == known_before:
        problems.append(f"{path}: no slide in column 'train'")
    return split


def _split_files(path: Path) -> list[Path]:
    if not path.is_dir():
        return [path]

    def k_of(p: Path) -> tuple[int, str]:
        m = re.search(r"(\d+)$", p.stem)
        return (int(m.group(1)) if m else -1, p.name)

    files = sorted(path.glob("splits_*.csv"), key=k_of)
    if not files:
        raise DataValidationError([f"{path}: no splits_*.csv files in this directory"])
    return files


def clam_splits(manifest: Manifest, path: str | Path) -> list[Split]:
    """Splits from a CLAM ``splits_k.csv`` file, or from every ``splits_*.csv`` of a directory."""
    index = manifest.index_of()
    problems: list[str] = []
    splits = [_read_clam_file(f, index, problems) for f in _split_files(Path(path))]
    if problems:
        raise DataValidationError(problems)
    return splits


def split_problems(manifest: Manifest, split: Split) -> list[str]:
    """What makes ``split`` unfit for training: a case whose slides are in two parts (the case would be
    both trained and tested on), a class with no training slide."""
    problems = []
    parts_of_case: dict[str, dict[str, list[int]]] = {}
    for part, indices in split.parts().items():
        for i in indices:
            record = manifest.records[i]
            parts_of_case.setdefault(record.case_id, {}).setdefault(part, []).append(record.row)
    for case, parts in parts_of_case.items():
        if len(parts) > 1:
            where = " and ".join(
                f"{part} (row{'s' if len(rows) > 1 else ''} {', '.join(map(str, rows))})"
                for part, rows in parts.items()
            )
            problems.append(
                f"{manifest.source}, split '{split.name}': case '{case}' has slides in {where}; the "
                "slides of one case must all be in one part"
            )
    trained = {manifest.records[i].label_name for i in split.train}
    present = {r.label_name for r in manifest.records}
    for name in (c for c in manifest.classes if c in present):
        if name not in trained:
            problems.append(f"{manifest.source}, split '{split.name}': class '{name}' has no slide in train")
    return problems


def _cases_per_class(manifest: Manifest, positions) -> dict[str, int]:
    cases: dict[str, set[str]] = {}
    for i in positions:
        record = manifest.records[i]
        cases.setdefault(record.label_name, set()).add(record.case_id)
    return {name: len(found) for name, found in cases.items()}


def _group_kfold(labels: np.ndarray, groups: np.ndarray, k: int, seed: int):
    """(train, test) position arrays of a shuffled StratifiedGroupKFold."""
    # imported here: every DPGS worker imports this package when it unpickles its dataset, and
    # scikit-learn (with SciPy and pandas) costs each of them ~1 s of CPU at start-up
    from sklearn.model_selection import StratifiedGroupKFold

    cv = StratifiedGroupKFold(n_splits=k, shuffle=True, random_state=seed)
    return list(cv.split(np.zeros(len(labels)), labels, groups))


def kfold_splits(manifest: Manifest, k: int, val_fraction: float = 0.2, seed: int = 0) -> list[Split]:
    """K folds named ``fold_0`` .. ``fold_{k-1}``: stratified by label, grouped by case_id."""
    if k < 2:
        raise ValueError(f"data.folds must be >= 2 for cross-validation, got {k}")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"data.val_fraction must be in [0, 1), got {val_fraction}")
    labels = np.array([r.label for r in manifest.records])
    groups = np.array([r.case_id for r in manifest.records])
    n_cases = len(set(groups.tolist()))
    if n_cases < k:
        raise DataValidationError([f"{manifest.source}: {k} folds need at least {k} cases, found {n_cases}"])
    few = {name: n for name, n in _cases_per_class(manifest, range(len(manifest.records))).items() if n < k}
    if few:
        raise DataValidationError([
            f"{manifest.source}: class '{name}' has {n} case(s), fewer than the {k} folds of data.folds={k} "
            "(every test fold needs one); lower data.folds or add slides of that class"
            for name, n in few.items()
        ])
    n_val = max(2, round(1.0 / val_fraction)) if val_fraction > 0 else 0
    splits = []
    for fold, (train_pos, test_pos) in enumerate(_group_kfold(labels, groups, k, seed)):
        val_pos = np.array([], dtype=int)
        if n_val:
            train_cases = len(set(groups[train_pos].tolist()))
            if train_cases < n_val:
                raise DataValidationError(
                    [
                        f"{manifest.source}: fold {fold} has {train_cases} training cases, too few for "
                        f"val_fraction={val_fraction}"
                    ]
                )
            few = {name: n for name, n in _cases_per_class(manifest, train_pos).items() if n < n_val}
            if few:
                raise DataValidationError([
                    f"{manifest.source}: fold {fold}: class '{name}' has {n} training case(s), fewer than "
                    f"the {n_val} parts that data.val_fraction={val_fraction} divides them into (the "
                    "validation part needs one); raise data.val_fraction, lower data.folds or add slides"
                    for name, n in few.items()
                ])
            inner_train, inner_val = _group_kfold(labels[train_pos], groups[train_pos], n_val, seed + fold)[0]
            val_pos, train_pos = train_pos[inner_val], train_pos[inner_train]
        splits.append(
            Split(
                f"fold_{fold}",
                train=sorted(train_pos.tolist()),
                val=sorted(val_pos.tolist()),
                test=sorted(test_pos.tolist()),
            )
        )
    return splits
