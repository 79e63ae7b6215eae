"""Manifest CSV: one row per slide with ``slide_id,label`` and optional ``case_id`` and ``split``.

Labels may be integers or strings, not both: a column of integer labels with a few text ones (or the
reverse) is a typo, reported naming the rows of the fewer kind, rather than a class of its own. Class
indices follow a stable order: numeric order when every label is an integer, otherwise sorted string
order; ``classes`` (for example from a checkpoint's ``classes.json``) forces an order instead, and labels
outside it are reported as unknown. ``case_id``
(the patient) defaults to the slide id; ``split`` must be ``train``, ``val`` or ``test`` when given.

Problems of individual rows are collected (row numbers are CSV line numbers, header = line 1) rather
than raised one by one, so that :func:`dpgs.data.validate.validate_inputs` can report them together
with the problems of the feature files.
"""

from __future__ import annotations

import csv
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from dpgs.data.errors import DataValidationError
from dpgs.data.layout import FeatureLayout, resolve_layout

log = logging.getLogger("dpgs.data")

REQUIRED_COLUMNS = ("slide_id", "label")
OPTIONAL_COLUMNS = ("case_id", "split")
SPLIT_VALUES = ("train", "val", "test")
_INT = re.compile(r"[+-]?\d+")


@dataclass
class SlideRecord:
    """One slide: ``label`` is the class index into ``Manifest.classes`` (-1 only on a reported row)."""

    slide_id: str
    label: int
    label_name: str
    case_id: str
    split: str | None
    path: Path
    row: int = 0


@dataclass
class Manifest:
    """Slides of a manifest, ``classes[i]`` being the original label of class index ``i``.

    ``problems`` lists what was wrong with the manifest rows; it is empty for a manifest returned by
    ``load_manifest(strict=True)``.
    """

    records: list[SlideRecord]
    classes: list[str]
    source: Path | None = None
    layout: FeatureLayout | None = None
    problems: list[str] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.records)

    @property
    def labels(self) -> list[int]:
        return [r.label for r in self.records]

    def index_of(self) -> dict[str, int]:
        """slide_id -> record index."""
        return {r.slide_id: i for i, r in enumerate(self.records)}


def canonical_label(raw: str) -> str:
    """Integer labels are written without sign or leading zeros ("01" -> "1"); others are stripped."""
    text = raw.strip()
    return str(int(text)) if _INT.fullmatch(text) else text


def class_order(names: list[str]) -> list[str]:
    """Distinct labels in numeric order when all are integers, else in sorted string order."""
    distinct = set(names)
    if distinct and all(_INT.fullmatch(n) for n in distinct):
        return sorted(distinct, key=int)
    return sorted(distinct)


def _mixed_label_problems(path: Path, kept: list[tuple[int, dict[str, str]]], names: list[str]) -> list[str]:
    """One problem per row whose label is of the rarer kind when integer and text labels are mixed."""
    numeric = [bool(_INT.fullmatch(n)) for n in names]
    n_int = sum(numeric)
    n_text = sum(1 for n, is_int in zip(names, numeric, strict=True) if n and not is_int)
    if not n_int or not n_text:
        return []
    odd_is_int = n_int < n_text
    usual = f"the other {n_text} labels are text" if odd_is_int else f"the other {n_int} labels are integers"
    return [
        f"{path}, row {line}: label '{row['label']}' for slide '{row['slide_id']}' is "
        f"{'an integer' if odd_is_int else 'not an integer'} but {usual}"
        for (line, row), name, is_int in zip(kept, names, numeric, strict=True)
        if name and is_int == odd_is_int
    ]


def _read_rows(path: Path, problems: list[str]) -> tuple[list[str], list[tuple[int, dict[str, str]]]]:
    """Header (lower-cased, stripped) and (line number, row) pairs; bad structure goes to ``problems``."""
    try:
        with path.open(newline="", encoding="utf-8-sig") as fh:
            reader = csv.reader(fh)
            header = next(reader, None)
            if header is None:
                problems.append(f"{path}: manifest is empty (expected a header with slide_id,label)")
                return [], []
            columns = [c.strip().lower() for c in header]
            rows = []
            for values in reader:
                line = reader.line_num
                if not any(v.strip() for v in values):
                    continue
                if len(values) != len(columns):
                    problems.append(
                        f"{path}, row {line}: {len(values)} fields, the header has {len(columns)}"
                    )
                    continue
                rows.append((line, {c: v.strip() for c, v in zip(columns, values, strict=True)}))
            return columns, rows
    except FileNotFoundError:
        problems.append(f"{path}: manifest file not found")
    except (OSError, UnicodeDecodeError, csv.Error) as err:
        problems.append(f"{path}: cannot read manifest ({err})")
    return [], []


def load_manifest(
    csv_path: str | Path,
    features_dir: str | Path | None,
    classes: list[str] | None = None,
    encoder: str | None = None,
    strict: bool = True,
    locate: Callable[[str], Path] | None = None,
) -> Manifest:
    """Read the manifest and locate each slide's feature file under ``features_dir``.

    ``locate`` (slide_id -> path) replaces the features directory for inputs that are not feature bags
    (tile bags locate the slide file); ``features_dir`` is then ignored and ``Manifest.layout`` is None.

    ``features_dir`` may use any layout of :mod:`dpgs.data.layout`; ``encoder`` picks a TRIDENT
    ``features_<encoder>`` directory. A slide without a file gets the path where its ``.h5`` file was
    expected (validation reports it as missing). With ``strict`` every manifest problem raises a
    :class:`DataValidationError` at once; otherwise they are returned in ``Manifest.problems``.
    A features directory that cannot be resolved always raises, together with the manifest problems.
    """
    path = Path(csv_path)
    problems: list[str] = []
    columns, rows = _read_rows(path, problems)
    if columns:
        for name in REQUIRED_COLUMNS:
            if name not in columns:
                problems.append(f"{path}: missing column '{name}' (columns are: {', '.join(columns)})")
        seen = set()
        for name in columns:
            if name in seen:
                problems.append(f"{path}: column '{name}' appears twice")
            seen.add(name)
    layout = None
    if locate is None:
        try:
            layout = resolve_layout(features_dir, encoder=encoder)
        except DataValidationError as err:
            raise DataValidationError(problems + err.problems) from None
        locate = layout.locate
    if "slide_id" not in columns or "label" not in columns:
        raise DataValidationError(problems)

    kept: list[tuple[int, dict[str, str]]] = []
    first_row: dict[str, int] = {}
    for line, row in rows:
        sid = row["slide_id"]
        if not sid:
            problems.append(f"{path}, row {line}: empty slide_id")
            continue
        if any(sep in sid for sep in ("/", "\\")) or sid in (".", ".."):
            problems.append(f"{path}, row {line}: slide_id '{sid}' is not a file name")
            continue
        if sid in first_row:
            problems.append(f"{path}, row {line}: duplicate slide_id '{sid}' (first on row {first_row[sid]})")
            continue
        first_row[sid] = line
        if not row["label"]:
            problems.append(f"{path}, row {line}: empty label for slide '{sid}'")
        split = row.get("split", "").lower() or None
        if split is not None and split not in SPLIT_VALUES:
            problems.append(
                f"{path}, row {line}: split '{row['split']}' for slide '{sid}' is not one of "
                f"{', '.join(SPLIT_VALUES)}"
            )
        kept.append((line, row))

    names = [canonical_label(row["label"]) for _, row in kept]
    if classes is None:
        problems.extend(_mixed_label_problems(path, kept, names))
        order = class_order([n for n in names if n])
    else:
        order = [canonical_label(str(c)) for c in classes]
        known = set(order)
        for (line, row), name in zip(kept, names, strict=True):
            if name and name not in known:
                problems.append(
                    f"{path}, row {line}: unknown label '{row['label']}' for slide '{row['slide_id']}' "
                    f"(known classes: {', '.join(order)})"
                )
    index = {name: i for i, name in enumerate(order)}
    records = [
        SlideRecord(
            slide_id=row["slide_id"],
            label=index.get(name, -1),
            label_name=name,
            case_id=row.get("case_id") or row["slide_id"],
            split=row.get("split", "").lower() or None,
            path=locate(row["slide_id"]),
            row=line,
        )
        for (line, row), name in zip(kept, names, strict=True)
    ]
    if strict and problems:
        raise DataValidationError(problems)
    log.info("manifest %s: %d slides, classes %s", path, len(records), dict(enumerate(order)))
    return Manifest(records=records, classes=order, source=path, layout=layout, problems=problems)
