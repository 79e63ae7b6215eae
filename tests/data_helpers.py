"""Small builders of feature files and manifests for the tests of ``dpgs.data``."""

from __future__ import annotations

import csv
from pathlib import Path

import h5py
import numpy as np
import torch


def write_h5(
    path: Path, n: int = 5, d: int = 4, dtype=np.float32, coords: bool = True, seed: int = 0
) -> np.ndarray:
    path.parent.mkdir(parents=True, exist_ok=True)
    feats = np.random.default_rng(seed).standard_normal((n, d)).astype(dtype)
    with h5py.File(path, "w") as fh:
        fh.create_dataset("features", data=feats)
        if coords:
            fh.create_dataset("coords", data=np.arange(2 * n).reshape(n, 2))
    return feats


def write_pt(path: Path, n: int = 5, d: int = 4, dtype=torch.float32, seed: int = 0) -> torch.Tensor:
    path.parent.mkdir(parents=True, exist_ok=True)
    t = torch.randn(n, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    torch.save(t, path)
    return t


def write_csv(path: Path, header: list[str], rows: list[list]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(header)
        w.writerows(rows)
    return path
