"""Classification metrics for bag-level predictions.

All functions take integer labels ``y`` [n] and class probabilities ``probs`` [n, C] (rows sum to 1).
AUC is the binary ROC AUC of the positive class for C = 2 and the macro one-vs-rest AUC for C > 2;
it is NaN when the labels of the evaluated set hold a single class (AUC is undefined there).
Quadratic-weighted kappa treats class indices as ordinal grades.
"""

from __future__ import annotations

import math

import numpy as np
from sklearn.metrics import (
    accuracy_score,
    balanced_accuracy_score,
    cohen_kappa_score,
    confusion_matrix,
    f1_score,
    roc_auc_score,
)

METRIC_NAMES = ("acc", "bacc", "auc", "f1", "qwk")


def auc_score(y: np.ndarray, probs: np.ndarray) -> float:
    """Binary ROC AUC (C = 2) or macro one-vs-rest AUC over the classes present (C > 2)."""
    present = np.unique(y)
    if present.size < 2:
        return math.nan
    if probs.shape[1] == 2:
        return float(roc_auc_score(y, probs[:, 1]))
    per_class = [roc_auc_score(y == c, probs[:, c]) for c in present]
    return float(np.mean(per_class))


def classification_metrics(y, probs) -> dict[str, float]:
    """Accuracy, balanced accuracy, AUC, macro F1 and QWK of argmax predictions."""
    y = np.asarray(y, dtype=np.int64)
    probs = np.asarray(probs, dtype=np.float64)
    if y.ndim != 1 or probs.ndim != 2 or probs.shape[0] != y.shape[0]:
        raise ValueError(f"expected y [n] and probs [n, C], got {y.shape} and {probs.shape}")
    if y.size == 0:
        return {name: math.nan for name in METRIC_NAMES}
    pred = probs.argmax(axis=1)
    labels = np.arange(probs.shape[1])
    if np.array_equal(np.unique(np.concatenate([y, pred])), np.unique(y)) and np.unique(y).size == 1:
        qwk = 1.0
    else:
        qwk = float(cohen_kappa_score(y, pred, labels=labels, weights="quadratic"))
    return {
        "acc": float(accuracy_score(y, pred)),
        "bacc": float(balanced_accuracy_score(y, pred)),
        "auc": auc_score(y, probs),
        "f1": float(f1_score(y, pred, labels=labels, average="macro", zero_division=0)),
        "qwk": qwk,
    }


def confusion(y, probs) -> np.ndarray:
    """Confusion matrix [C, C]: rows are true classes, columns predicted classes."""
    probs = np.asarray(probs)
    return confusion_matrix(np.asarray(y), probs.argmax(axis=1), labels=np.arange(probs.shape[1]))
