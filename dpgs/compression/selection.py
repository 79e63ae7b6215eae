"""Top-k selection by magnitude: exact ``torch.topk`` for small vectors, sampled threshold above.

Sampled path (Deep Gradient Compression, Lin et al. 2017, with a refinement step): draw ``m`` random
elements of ``|g|``; the number of them at or above the true k-th largest magnitude is Binomial(m, k/n) with
mean ``mu = m k / n``. Taking the ``r``-th largest sample with ``r = mu + 3 sqrt(mu) + 2`` gives a threshold
below the true k-th magnitude with high probability, so the candidate set ``{i : |g_i| >= thr}`` (about
``k (1 + 3 / sqrt(mu))`` elements) contains the whole top-k. An exact ``topk`` over the candidates then
returns exactly the global top-k (``count == k``). When too few candidates come out (an unlucky sample)
and fewer than ``0.8 k`` of them, the margin is widened and the pass repeated; after ``MAX_ROUNDS`` the
exact ``torch.topk`` over the full vector is used. With fewer than ``0.8 k`` non-zero magnitudes the
non-zero ones are all sent (sending zeros carries no information).

Elements excluded from selection (dense-exempt tensors) must hold a negative magnitude (e.g. -1).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

MIN_COUNT_FRACTION = 0.8
MAX_COUNT_FRACTION = 1.3
MAX_ROUNDS = 3
MIN_SAMPLE = 4096


@dataclass(frozen=True)
class Selection:
    """Sorted int64 ``indices`` chosen; ``method`` is "exact", "sampled" or "sampled-fallback";
    ``candidates`` is the size of the thresholded candidate set (0 for exact)."""

    indices: torch.Tensor
    method: str
    candidates: int


def _nonzero(mask: torch.Tensor) -> torch.Tensor:
    """Sorted positions of the True entries (numpy's flatnonzero is several times faster on CPU)."""
    if mask.device.type == "cpu":
        return torch.from_numpy(np.flatnonzero(mask.numpy()))
    return mask.nonzero().squeeze(1)


def _keep_largest(positions: torch.Tensor, values: torch.Tensor, k: int) -> torch.Tensor:
    """The ``k`` entries of sorted ``positions`` with the largest ``values``, still sorted. Drops the
    smallest ``len - k`` when that is the shorter list (a small ``topk`` instead of a large one)."""
    found = positions.numel()
    if found == k:
        return positions
    if found - k < k:
        keep = torch.ones(found, dtype=torch.bool, device=positions.device)
        keep[torch.topk(values, found - k, largest=False, sorted=False).indices] = False
    else:
        keep = torch.zeros(found, dtype=torch.bool, device=positions.device)
        keep[torch.topk(values, k, sorted=False).indices] = True
    return positions[keep]


def exact_topk(magnitude: torch.Tensor, k: int) -> torch.Tensor:
    """Sorted indices of ``torch.topk(magnitude, k)``."""
    if k == 0:
        return torch.zeros(0, dtype=torch.long, device=magnitude.device)
    mask = torch.zeros(magnitude.numel(), dtype=torch.bool, device=magnitude.device)
    mask[torch.topk(magnitude, k, sorted=False).indices] = True
    return _nonzero(mask)


def select_topk(magnitude: torch.Tensor, k: int, *, exact_max_numel: int = 1 << 20,
                sample_ratio: float = 0.01, generator: torch.Generator | None = None) -> Selection:
    """Indices of (about) the ``k`` largest entries of the non-negative 1-D ``magnitude`` (module docstring).

    Exact when ``magnitude.numel() <= exact_max_numel``; otherwise the count is ``k`` (almost always) and
    always within [0.8 k, 1.3 k] unless fewer than 0.8 k entries are non-zero.
    """
    n = magnitude.numel()
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside [0, {n}]")
    if k == 0 or k == n or n <= exact_max_numel:
        return Selection(exact_topk(magnitude, k), "exact", 0)
    m = min(n, max(MIN_SAMPLE, math.ceil(sample_ratio * n)))
    sample = magnitude[torch.randint(0, n, (m,), generator=generator, device="cpu").to(magnitude.device)]
    mu = m * k / n
    margin = 3.0
    for _ in range(MAX_ROUNDS):
        r = min(m, math.ceil(mu + margin * math.sqrt(mu) + 2))
        threshold = float(torch.topk(sample, r, sorted=False).values.min())
        mask = magnitude > 0 if threshold <= 0 else magnitude >= threshold
        candidates = _nonzero(mask)
        found = candidates.numel()
        if found >= k:
            return Selection(_keep_largest(candidates, magnitude[candidates], k), "sampled", found)
        if found >= MIN_COUNT_FRACTION * k or threshold <= 0:
            return Selection(candidates, "sampled", found)
        margin *= 3.0
    return Selection(exact_topk(magnitude, k), "sampled-fallback", n)
