"""Validation of every input before training: all problems are collected and reported at once.

Checked per slide: the feature file exists and is readable, holds a 2-D floating-point ``features``
array with at least one instance, ``coords`` (when present) is [N, 2], and (with ``check_values``)
no NaN/inf values and, for float64 files, no value beyond the float32 range (training reads features as
float32, where such values become inf). Across slides: every bag has the same feature dim (the most
common dim is taken as the expected one). Values are scanned only in bags whose metadata is sound and
whose dim is the expected one, in blocks of at most ``chunk_bytes`` (a row wider than that is read in
column blocks), so memory stays bounded whatever dimension a file declares.
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


FLOAT32_MAX = float(np.finfo(np.float32).max)


def _bad_values(record: SlideRecord, chunk_bytes: int) -> tuple[int, int]:
    """(NaN/inf values, finite values beyond the float32 range) of a bag's features."""
    non_finite = too_large = 0
    for block in iter_feature_chunks(record.path, chunk_bytes):
        finite = np.isfinite(block)
        non_finite += int(block.size - np.count_nonzero(finite))
        if block.dtype == np.float64:
            too_large += int(np.count_nonzero(np.abs(block[finite]) > FLOAT32_MAX))
    return non_finite, too_large


def _check_values(record: SlideRecord, chunk_bytes: int) -> list[str]:
    try:
        non_finite, too_large = _bad_values(record, chunk_bytes)
    except BagReadError as err:
        return [f"slide '{record.slide_id}' (row {record.row}): unreadable or corrupt file: {err}"]
    problems = []
    if non_finite:
        problems.append(f"{_where(record)}: {non_finite} NaN/inf feature values")
    if too_large:
        problems.append(
            f"{_where(record)}: {too_large} float64 feature values beyond the float32 range "
            f"(|x| > {FLOAT32_MAX:.4g}); they would become inf in training"
        )
    return problems


def _check_metadata(record: SlideRecord) -> tuple[BagInfo | None, list[str]]:
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
    return info, problems


def check_inputs(
    manifest: Manifest, check_values: bool = True, chunk_bytes: int = 64 << 20
) -> tuple[dict[str, BagInfo], list[str]]:
    """(bag metadata by slide_id for every readable bag, every problem found); raises nothing."""
    infos: dict[str, BagInfo] = {}
    found: dict[str, list[str]] = {}
    for record in manifest.records:
        info, found[record.slide_id] = _check_metadata(record)
        if info is not None:
            infos[record.slide_id] = info
    dims = Counter(info.dim for info in infos.values())
    expected, n_expected = dims.most_common(1)[0] if dims else (None, 0)
    if check_values:
        for record in manifest.records:
            info = infos.get(record.slide_id)
            if info is not None and not found[record.slide_id] and info.dim == expected:
                found[record.slide_id] += _check_values(record, chunk_bytes)
    problems = list(manifest.problems)
    for record in manifest.records:
        problems.extend(found[record.slide_id])
    missing = sum(not r.path.exists() for r in manifest.records)
    if len(manifest.records) > 1 and missing == len(manifest.records) and manifest.layout is not None:
        problems.append(f"none of the {missing} feature files exists in the {manifest.layout.describe()}")
    if len(dims) > 1:
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
