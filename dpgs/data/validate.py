"""Validation of every input before training: all problems are collected and reported at once.

Checked per slide: the feature file exists and is readable, holds a 2-D floating-point ``features``
array with at least one instance, ``coords`` (when present) is [N, 2], and (with ``check_values``)
no NaN/inf values; values are scanned in row blocks of ``chunk_bytes`` so memory stays bounded.
Across slides: every bag has the same feature dim (the most common dim is taken as the expected one).
The manifest's own problems (columns, duplicates, unknown labels, split values) are included.
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from dpgs.data.errors import DataValidationError
from dpgs.data.manifest import Manifest, SlideRecord
from dpgs.data.readers import BagInfo, BagReadError, bag_info, iter_feature_chunks

FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")


def _where(record: SlideRecord) -> str:
    return f"slide '{record.slide_id}' (row {record.row}, {record.path})"


def _non_finite(record: SlideRecord, chunk_bytes: int) -> int:
    count = 0
    for block in iter_feature_chunks(record.path, chunk_bytes):
        count += int(block.size - np.count_nonzero(np.isfinite(block)))
    return count


def _check_record(
    record: SlideRecord, check_values: bool, chunk_bytes: int
) -> tuple[BagInfo | None, list[str]]:
    where = _where(record)
    if not record.path.exists():
        return None, [f"{where}: feature file not found"]
    try:
        info = bag_info(record.path)
    except BagReadError as err:
        return None, [f"slide '{record.slide_id}' (row {record.row}): unreadable or corrupt file: {err}"]
    problems = []
    if info.dtype not in FLOAT_DTYPES:
        problems.append(f"{where}: features have dtype {info.dtype}, expected float16 or float32")
    if info.length == 0:
        problems.append(f"{where}: empty bag (0 instances)")
    if info.coords_shape is not None and info.coords_shape != (info.length, 2):
        problems.append(f"{where}: coords have shape {info.coords_shape}, expected ({info.length}, 2)")
    if check_values and not problems:
        try:
            bad = _non_finite(record, chunk_bytes)
        except BagReadError as err:
            return info, [f"slide '{record.slide_id}' (row {record.row}): unreadable or corrupt file: {err}"]
        if bad:
            problems.append(f"{where}: {bad} NaN/inf feature values")
    return info, problems


def check_inputs(
    manifest: Manifest, check_values: bool = True, chunk_bytes: int = 64 << 20
) -> tuple[dict[str, BagInfo], list[str]]:
    """(bag metadata by slide_id for every readable bag, every problem found); raises nothing."""
    problems = list(manifest.problems)
    infos: dict[str, BagInfo] = {}
    for record in manifest.records:
        info, found = _check_record(record, check_values, chunk_bytes)
        problems.extend(found)
        if info is not None:
            infos[record.slide_id] = info
    missing = sum(not r.path.exists() for r in manifest.records)
    if len(manifest.records) > 1 and missing == len(manifest.records) and manifest.layout is not None:
        problems.append(f"none of the {missing} feature files exists in the {manifest.layout.describe()}")
    dims = Counter(info.dim for info in infos.values())
    if len(dims) > 1:
        expected, n_expected = dims.most_common(1)[0]
        for record in manifest.records:
            info = infos.get(record.slide_id)
            if info is not None and info.dim != expected:
                problems.append(
                    f"{_where(record)}: feature dim {info.dim} differs from the {expected} "
                    f"of {n_expected} other bags"
                )
    return infos, problems


def validate_inputs(
    manifest: Manifest,
    check_values: bool = True,
    chunk_bytes: int = 64 << 20,
    extra_problems: list[str] | tuple[str, ...] = (),
) -> dict[str, BagInfo]:
    """Bag metadata by slide_id; raises :class:`DataValidationError` listing every problem found.

    ``extra_problems`` (for example from building the splits) are reported in the same error.
    """
    infos, problems = check_inputs(manifest, check_values, chunk_bytes)
    problems = [*problems, *extra_problems]
    if problems:
        raise DataValidationError(problems)
    return infos
