"""Where each parameter lives in a model's flat parameter vector, and which ones are sent dense.

The order is the order of ``model.named_parameters()`` restricted to trainable parameters, the same order
``dpgs.distributed.flat.flat_params`` concatenates them in.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch


@dataclass(frozen=True)
class ParamSpec:
    """One parameter: ``flat[offset : offset + numel].view(shape)``; ``dense`` = always sent uncompressed."""

    name: str
    shape: tuple[int, ...]
    offset: int
    numel: int
    dense: bool = False


class ParamLayout:
    """Names, shapes and offsets of the parameters in a flat vector, plus a dense-exempt flag per tensor."""

    def __init__(self, specs: Sequence[ParamSpec]):
        offset = 0
        names = set()
        for spec in specs:
            if spec.offset != offset:
                raise ValueError(f"parameter {spec.name!r} starts at {spec.offset}, expected {offset}")
            if spec.numel != int(np.prod(spec.shape, dtype=np.int64)):
                raise ValueError(f"parameter {spec.name!r}: numel {spec.numel} does not match "
                                 f"shape {spec.shape}")
            if spec.name in names:
                raise ValueError(f"duplicate parameter name {spec.name!r}")
            names.add(spec.name)
            offset += spec.numel
        self.specs: tuple[ParamSpec, ...] = tuple(specs)
        self.numel = offset

    @classmethod
    def from_shapes(cls, named_shapes: Iterable[tuple[str, Sequence[int]]], *, dense_min_numel: int = 0,
                    dense_names: Sequence[str] = ()) -> ParamLayout:
        """Layout of tensors with these (name, shape) in this order. A tensor is dense when it has fewer than
        ``dense_min_numel`` elements or its name matches one of the glob patterns ``dense_names``."""
        specs, offset = [], 0
        for name, shape in named_shapes:
            shape = tuple(int(s) for s in shape)
            numel = int(np.prod(shape, dtype=np.int64))
            dense = numel < dense_min_numel or any(fnmatch.fnmatchcase(name, p) for p in dense_names)
            specs.append(ParamSpec(name, shape, offset, numel, dense))
            offset += numel
        return cls(specs)

    @classmethod
    def from_module(cls, model: torch.nn.Module, *, dense_min_numel: int = 0,
                    dense_names: Sequence[str] = ()) -> ParamLayout:
        """Layout of ``model``'s trainable parameters (see ``from_shapes`` for the dense rule)."""
        return cls.from_shapes(((n, p.shape) for n, p in model.named_parameters() if p.requires_grad),
                               dense_min_numel=dense_min_numel, dense_names=dense_names)

    def with_dense_min_numel(self, dense_min_numel: int) -> ParamLayout:
        """Copy where tensors with fewer than ``dense_min_numel`` elements are also dense."""
        return ParamLayout([replace(s, dense=s.dense or s.numel < dense_min_numel) for s in self.specs])

    @property
    def names(self) -> list[str]:
        return [s.name for s in self.specs]

    def dense_ranges(self) -> np.ndarray:
        """int64 array [n, 2] of (offset, length) covering the dense tensors, adjacent ones merged."""
        merged: list[list[int]] = []
        for s in self.specs:
            if not s.dense or s.numel == 0:
                continue
            if merged and merged[-1][0] + merged[-1][1] == s.offset:
                merged[-1][1] += s.numel
            else:
                merged.append([s.offset, s.numel])
        return np.array(merged, dtype=np.int64).reshape(-1, 2)

    def sparse_ranges(self) -> np.ndarray:
        """int64 array [n, 2] of (offset, length), one row per compressible (not dense, non-empty) tensor."""
        rows = [[s.offset, s.numel] for s in self.specs if not s.dense and s.numel]
        return np.array(rows, dtype=np.int64).reshape(-1, 2)

    def dense_numel(self) -> int:
        return sum(s.numel for s in self.specs if s.dense)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Views of ``flat`` per parameter name, in their shapes."""
        if flat.numel() != self.numel:
            raise ValueError(f"flat vector has {flat.numel()} elements, the layout has {self.numel}")
        flat = flat.reshape(-1)
        return {s.name: flat[s.offset : s.offset + s.numel].view(s.shape) for s in self.specs}

    def __len__(self) -> int:
        return len(self.specs)

    def __iter__(self):
        return iter(self.specs)

    def __repr__(self) -> str:
        return f"ParamLayout({len(self.specs)} tensors, numel={self.numel}, dense={self.dense_numel()})"
