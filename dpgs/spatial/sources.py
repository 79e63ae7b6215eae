"""Inputs that each rank reads by rectangle, so that no process ever holds the whole image."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from dpgs.spatial.partition import Rect


class NpySource:
    """An [N, 3, H, W] ``.npy`` array read through a memory map, one rectangle at a time.

    Pass it to ``SampleParallelGroup.compute`` instead of a tensor: every rank opens the file (which
    must be visible to every node) and copies only the rows and columns it owns.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"{self.path}: no such .npy file")
        arr = np.load(self.path, mmap_mode="r")
        if arr.ndim != 4 or arr.shape[1] != 3:
            raise ValueError(f"{self.path}: expected an array of shape [N, 3, H, W], got {arr.shape}")
        self.shape = tuple(arr.shape)

    def read(self, rect: Rect) -> torch.Tensor:
        arr = np.load(self.path, mmap_mode="r")
        return torch.from_numpy(np.ascontiguousarray(arr[:, :, rect.r0:rect.r1, rect.c0:rect.c1]))
