"""Bag-level evaluation: on all instances, and the sampled protocol of the Big-Layers paper.

Evaluation always runs with the model in eval mode under ``torch.no_grad`` (two bugs of reference
repositories are validating in train mode, which updates BatchNorm statistics and uses dropout, and
building autograd graphs during validation).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

import numpy as np
import torch

from dpgs.metrics import METRIC_NAMES, classification_metrics
from dpgs.modeling import input_to
from dpgs.train.batching import sample_indices


@dataclass
class Predictions:
    slide_ids: list[str]
    labels: np.ndarray  # [n]
    probs: np.ndarray  # [n, C]
    losses: np.ndarray  # [n] per-bag loss

    @property
    def loss(self) -> float:
        return float(self.losses.mean()) if self.losses.size else math.nan

    def metrics(self, prefix: str) -> dict[str, float]:
        """``{prefix}loss`` and ``{prefix}{acc,bacc,auc,f1,qwk}``."""
        scores = classification_metrics(self.labels, self.probs)
        out = {f"{prefix}loss": self.loss}
        out.update({f"{prefix}{name}": scores[name] for name in METRIC_NAMES})
        return out


@torch.no_grad()
def predict(
    model: torch.nn.Module,
    bags: Iterable,
    device: torch.device,
    num_classes: int,
    sample_k: int | None = None,
    generator: torch.Generator | None = None,
) -> Predictions:
    """Predict every bag of ``bags`` (an iterable of objects with slide_id, features, label).

    With ``sample_k`` each bag is reduced to K instances drawn with ``generator`` (with replacement
    only for bags shorter than K).
    """
    was_training = model.training
    model.eval()
    ids, labels, probs, losses = [], [], [], []
    try:
        for bag in bags:
            x = bag.features
            if sample_k is not None:
                x = x[sample_indices(x.shape[0], sample_k, generator)]
            x = input_to(model, x, device)
            y = torch.tensor(bag.label, device=device)
            out = model.loss(x, y)
            ids.append(bag.slide_id)
            labels.append(int(bag.label))
            probs.append(torch.softmax(out["logits"].reshape(-1, num_classes).float(), -1)[0].cpu().numpy())
            losses.append(float(out["loss"]))
    finally:
        model.train(was_training)
    return Predictions(
        ids,
        np.asarray(labels, dtype=np.int64),
        np.asarray(probs, dtype=np.float64).reshape(-1, num_classes),
        np.asarray(losses, dtype=np.float64),
    )


def sampled_protocol(
    model: torch.nn.Module,
    load_bags: Callable[[], Iterable],
    device: torch.device,
    num_classes: int,
    sample_k: int,
    repeats: int,
    seed: int,
    prefix: str,
) -> dict[str, float]:
    """Evaluate R times with K instances per bag; return ``{prefix}k{K}_{metric}_mean`` and ``_std``."""
    runs = []
    for r in range(repeats):
        gen = torch.Generator().manual_seed(seed * 7919 + r)
        runs.append(predict(model, load_bags(), device, num_classes, sample_k, gen).metrics(""))
    out = {}
    for name in runs[0]:
        values = np.array([run[name] for run in runs], dtype=np.float64)
        out[f"{prefix}k{sample_k}_{name}_mean"] = float(np.mean(values))
        out[f"{prefix}k{sample_k}_{name}_std"] = float(np.std(values))
    return out
