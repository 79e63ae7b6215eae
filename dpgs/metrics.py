"""Classification metrics for bag-level predictions, and their bootstrap confidence intervals.

All functions take integer labels ``y`` [n] and class probabilities ``probs`` [n, C] (rows sum to 1).
AUC is the binary ROC AUC of the positive class for C = 2 and the macro one-vs-rest AUC over the
classes present for C > 2; it is NaN when the labels of the evaluated set hold a single class (AUC is
undefined there). Quadratic-weighted kappa treats class indices as ordinal grades.

Accuracy, balanced accuracy and AUC are computed by row-wise functions (``*_rows``: labels [R, n],
probabilities [R, n, C] -> [R]) so that a bootstrap evaluates all its resamples at once; the
single-set metrics are the same functions on one row. AUC is the Mann-Whitney statistic
``(sum of the positives' ranks - n1 (n1 + 1) / 2) / (n1 n0)`` with average ranks for ties, which is
the area under the ROC curve with ties counted one half.

Confidence intervals (:func:`bootstrap_ci`): stratified percentile bootstrap. Each of ``resamples``
resamples draws, within every class ``c`` separately, ``n_c`` bags with replacement from the ``n_c``
bags of that class (so every resample keeps the class counts, and AUC stays defined); the metric is
computed on each resample, and the interval is the ``(1 - level) / 2`` and ``(1 + level) / 2``
percentiles (``numpy.percentile``, linear interpolation) of the resampled values. Draws come from
``numpy.random.default_rng(seed)``, so an interval is reproducible.

Everything here is NumPy. The average ranks are :func:`average_ranks` (equal to
``scipy.stats.rankdata(method="average")``, tests/test_metrics.py): importing ``scipy.stats`` cost the
run's first validation 1.0-1.3 s (2-core VM, 2026-11-29), and every DPGS actor imports this module
(through ``dpgs.train.evaluate``, for scoring). F1, QWK and the confusion matrix are computed from the
confusion counts here, equal to scikit-learn's (tests/test_metrics.py) without its argument checks, which
cost ~3 ms a call: most of an epoch's validation metrics on a small set.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

METRIC_NAMES = ("acc", "bacc", "auc", "f1", "qwk")
CI_METRICS = ("auc", "acc", "bacc")


def accuracy_rows(y: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """[R]: fraction of bags of each row whose argmax class is the label."""
    return (probs.argmax(axis=-1) == y).mean(axis=-1)


def balanced_accuracy_rows(y: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """[R]: mean over the classes present in each row of the recall of argmax predictions."""
    pred = probs.argmax(axis=-1)
    classes = range(probs.shape[-1])
    members = np.stack([(y == c).sum(axis=-1) for c in classes])  # [C, R]
    hits = np.stack([((y == c) & (pred == c)).sum(axis=-1) for c in classes])
    return (hits / np.maximum(members, 1)).sum(axis=0) / (members > 0).sum(axis=0)


def average_ranks(values: np.ndarray) -> np.ndarray:
    """Ranks 1..n of ``values`` along the last axis, tied values sharing the mean of the ranks they span
    (``rankdata(method="average")``): a tie group spanning sorted positions ``first..last`` (0-based) gets
    ``(first + last) / 2 + 1``."""
    values = np.asarray(values)
    n = values.shape[-1]
    order = np.argsort(values, axis=-1, kind="stable")
    ordered = np.take_along_axis(values, order, axis=-1)
    starts = np.ones(ordered.shape, dtype=bool)  # a tie group starts here (sorted order)
    starts[..., 1:] = ordered[..., 1:] != ordered[..., :-1]
    ends = np.ones(ordered.shape, dtype=bool)  # ... and ends here
    ends[..., :-1] = starts[..., 1:]
    position = np.arange(n)
    first = np.maximum.accumulate(np.where(starts, position, 0), axis=-1)
    last = np.flip(np.minimum.accumulate(np.flip(np.where(ends, position, n - 1), -1), axis=-1), -1)
    ranks = np.empty(ordered.shape, dtype=np.float64)
    np.put_along_axis(ranks, order, (first + last) / 2.0 + 1.0, axis=-1)
    return ranks


def _binary_auc_rows(positive: np.ndarray, scores: np.ndarray) -> np.ndarray:
    """[R]: Mann-Whitney AUC of ``scores`` for the boolean ``positive`` labels (NaN without both)."""
    n1 = positive.sum(axis=-1)
    n0 = positive.shape[-1] - n1
    ranks = average_ranks(scores)
    u = (ranks * positive).sum(axis=-1) - n1 * (n1 + 1) / 2.0
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where((n1 > 0) & (n0 > 0), u / (n1 * n0), np.nan)


def auc_rows(y: np.ndarray, probs: np.ndarray) -> np.ndarray:
    """[R]: binary AUC (C = 2) or macro one-vs-rest AUC over the classes present (C > 2); NaN for rows
    holding a single class."""
    if probs.shape[-1] == 2:
        return _binary_auc_rows(y == 1, probs[..., 1])
    classes = range(probs.shape[-1])
    present = np.stack([(y == c).any(axis=-1) for c in classes])  # [C, R]
    per_class = np.stack([_binary_auc_rows(y == c, probs[..., c]) for c in classes])
    n_present = present.sum(axis=0)
    total = np.where(present, per_class, 0.0).sum(axis=0)
    return np.where(n_present > 1, total / np.maximum(n_present, 1), np.nan)


ROW_SCORES: dict[str, Callable[[np.ndarray, np.ndarray], np.ndarray]] = {
    "auc": auc_rows,
    "acc": accuracy_rows,
    "bacc": balanced_accuracy_rows,
}


def _check(y, probs) -> tuple[np.ndarray, np.ndarray]:
    y = np.asarray(y, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64)
    if y.ndim != 1 or probs.ndim != 2 or probs.shape[0] != y.shape[0]:
        raise ValueError(f"expected y [n] and probs [n, C], got {y.shape} and {probs.shape}")
    if y.size and (y.min() < 0 or y.max() >= probs.shape[1]):
        found = sorted(set(y.tolist()))
        raise ValueError(f"labels must be class indices in [0, {probs.shape[1]}), got {found}")
    return y, probs


def auc_score(y, probs) -> float:
    """Binary ROC AUC (C = 2) or macro one-vs-rest AUC over the classes present (C > 2)."""
    y, probs = _check(y, probs)
    return float(auc_rows(y[None], probs[None])[0]) if y.size else math.nan


def confusion_counts(y: np.ndarray, pred: np.ndarray, classes: int) -> np.ndarray:
    """[C, C] int64: bags of true class i (row) predicted as class j (column)."""
    return np.bincount(y * classes + pred, minlength=classes * classes).reshape(classes, classes)


def macro_f1(counts: np.ndarray) -> float:
    """Mean over every class of ``2 TP / (2 TP + FP + FN)`` from confusion ``counts``; 0 for a class with
    no true and no predicted bag (scikit-learn's ``f1_score(average="macro", zero_division=0)`` over all
    the classes)."""
    tp = np.diag(counts).astype(np.float64)
    denominator = 2 * tp + (counts.sum(axis=0) - tp) + (counts.sum(axis=1) - tp)
    return float(np.mean(np.where(denominator > 0, 2 * tp / np.maximum(denominator, 1), 0.0)))


def quadratic_kappa(counts: np.ndarray) -> float:
    """Cohen's kappa with quadratic weights from confusion ``counts``: ``1 - sum(W O) / sum(W E)``, with
    ``W_ij = (i - j)^2``, ``O`` the counts and ``E`` the counts expected from the margins
    (``outer(rows, columns) / n``); 1 where every label and prediction is one class (``sum(W E) = 0``
    only there)."""
    grades = np.arange(counts.shape[0])
    weights = (grades[:, None] - grades[None, :]) ** 2
    expected = np.outer(counts.sum(axis=1), counts.sum(axis=0)) / counts.sum()
    disagreement = float((weights * expected).sum())
    return 1.0 if disagreement == 0 else 1.0 - float((weights * counts).sum()) / disagreement


def classification_metrics(y, probs) -> dict[str, float]:
    """Accuracy, balanced accuracy, AUC, macro F1 and QWK of argmax predictions."""
    y, probs = _check(y, probs)
    if y.size == 0:
        return {name: math.nan for name in METRIC_NAMES}
    counts = confusion_counts(y, probs.argmax(axis=1), probs.shape[1])
    return {
        "acc": float(accuracy_rows(y[None], probs[None])[0]),
        "bacc": float(balanced_accuracy_rows(y[None], probs[None])[0]),
        "auc": auc_score(y, probs),
        "f1": macro_f1(counts),
        "qwk": quadratic_kappa(counts),
    }


def confusion(y, probs) -> np.ndarray:
    """Confusion matrix [C, C] of argmax predictions: rows are true classes, columns predicted classes."""
    y, probs = _check(y, probs)
    return confusion_counts(y, probs.argmax(axis=1), probs.shape[1])


@dataclass(frozen=True)
class Interval:
    """A bootstrap confidence interval ``[low, high]`` at ``level`` (NaN bounds when undefined)."""

    low: float
    high: float
    level: float

    def overlaps(self, other: Interval) -> bool:
        """Whether the two intervals share a point (NaN bounds never overlap)."""
        return self.low <= other.high and other.low <= self.high


def stratified_resamples(y: np.ndarray, resamples: int, seed: int) -> np.ndarray:
    """int64 [resamples, n] row indices: each row draws, within each class, that class's count of its
    bags with replacement (see the module docstring)."""
    y = np.asarray(y, dtype=np.int64)
    rng = np.random.default_rng(seed)
    out = np.empty((resamples, y.size), dtype=np.int64)
    start = 0
    for c in np.unique(y):
        members = np.flatnonzero(y == c)
        draws = rng.integers(0, members.size, (resamples, members.size))
        out[:, start : start + members.size] = members[draws]
        start += members.size
    return out


def bootstrap_ci(
    y, probs, metrics: tuple[str, ...] = CI_METRICS, resamples: int = 1000, level: float = 0.95, seed: int = 0
) -> dict[str, Interval]:
    """Stratified percentile bootstrap interval of each metric in ``metrics`` (names of ``ROW_SCORES``).

    An empty set gives NaN bounds, and so does AUC of a one-class set (undefined in every resample).
    """
    y, probs = _check(y, probs)
    unknown = [m for m in metrics if m not in ROW_SCORES]
    if unknown:
        raise ValueError(f"no bootstrap interval for {unknown} (available: {', '.join(ROW_SCORES)})")
    if resamples < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"expected resamples >= 1 and 0 < level < 1, got {resamples} and {level}")
    if y.size == 0:
        return {m: Interval(math.nan, math.nan, level) for m in metrics}
    rows = stratified_resamples(y, resamples, seed)
    percentiles = (100 * (1 - level) / 2, 100 * (1 + level) / 2)
    out = {}
    for name in metrics:
        values = ROW_SCORES[name](y[rows], probs[rows])
        if np.isnan(values).any():
            out[name] = Interval(math.nan, math.nan, level)
        else:
            low, high = np.percentile(values, percentiles)
            out[name] = Interval(float(low), float(high), level)
    return out
