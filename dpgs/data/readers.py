"""Readers of one feature bag: HDF5 (``features`` [N, D], optional ``coords`` [N, 2]) or a ``.pt`` tensor.

* :func:`bag_info` reads only metadata: the HDF5 dataset shapes, or for ``.pt`` files a memory-mapped
  ``torch.load`` that maps the tensor without reading its data (legacy non-zip ``.pt`` files are
  loaded in full).
* :func:`read_bag` returns the features at their stored dtype (float16 stays float16) and coords.
* :func:`iter_feature_chunks` yields blocks of at most ``chunk_bytes`` (rows, or pieces of one row when
  a row is wider than that) so that whole-file checks (NaN/inf) never hold more than one block in
  memory, whatever dimension the file declares.

``.pt`` files are always loaded with ``weights_only=True``; a file that is not a plain tensor fails.
"""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import h5py
import numpy as np
import torch

FEATURES_KEY = "features"
COORDS_KEY = "coords"


class BagReadError(ValueError):
    """A feature file that cannot be read as a bag; the message names the file."""


@dataclass(frozen=True)
class BagInfo:
    """Metadata of one bag: instance count, feature dim, stored dtype and coords shape (or None)."""

    length: int
    dim: int
    dtype: str
    coords_shape: tuple[int, ...] | None = None

    @property
    def nbytes(self) -> int:
        return self.length * self.dim * np.dtype(self.dtype).itemsize


def _is_h5(path: Path) -> bool:
    return path.suffix == ".h5"


def _torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _load_pt(path: Path, mmap: bool) -> torch.Tensor:
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=mmap)
    except RuntimeError as err:
        if mmap and "mmap" in str(err).lower():
            return _load_pt(path, mmap=False)  # legacy (non-zip) serialization cannot be mapped
        raise BagReadError(f"{path}: cannot load .pt file ({str(err).splitlines()[0]})") from err
    except pickle.UnpicklingError as err:
        raise BagReadError(
            f"{path}: not a tensor file loadable with weights_only=True (corrupt, or holds other objects)"
        ) from err
    except Exception as err:  # torch raises several types for corrupt archives
        first_line = str(err).splitlines()[0] if str(err) else ""
        raise BagReadError(f"{path}: cannot load .pt file ({type(err).__name__}: {first_line})") from err
    if not isinstance(obj, torch.Tensor):
        raise BagReadError(f"{path}: .pt file holds a {type(obj).__name__}, expected a [N, D] tensor")
    if obj.ndim != 2:
        raise BagReadError(f"{path}: features have shape {tuple(obj.shape)}, expected [N, D]")
    return obj


def _h5_features(fh: h5py.File, path: Path) -> h5py.Dataset:
    if FEATURES_KEY not in fh:
        raise BagReadError(
            f"{path}: no '{FEATURES_KEY}' dataset (found: {', '.join(fh.keys()) or 'nothing'})"
        )
    ds = fh[FEATURES_KEY]
    if not isinstance(ds, h5py.Dataset) or ds.ndim != 2:
        raise BagReadError(f"{path}: '{FEATURES_KEY}' has shape {getattr(ds, 'shape', '?')}, expected [N, D]")
    return ds


def _open_h5(path: Path) -> h5py.File:
    try:
        return h5py.File(path, "r")
    except OSError as err:
        raise BagReadError(f"{path}: cannot open HDF5 file ({err})") from err


def bag_info(path: str | Path) -> BagInfo:
    """Length, dim and dtype of a bag without reading its features."""
    path = Path(path)
    if _is_h5(path):
        with _open_h5(path) as fh:
            ds = _h5_features(fh, path)
            coords = fh.get(COORDS_KEY)
            coords_shape = tuple(coords.shape) if isinstance(coords, h5py.Dataset) else None
            return BagInfo(int(ds.shape[0]), int(ds.shape[1]), np.dtype(ds.dtype).name, coords_shape)
    t = _load_pt(path, mmap=True)
    return BagInfo(int(t.shape[0]), int(t.shape[1]), _torch_dtype_name(t.dtype))


def read_bag(path: str | Path) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(features [N, D] at the stored dtype, coords [N, 2] or None)."""
    path = Path(path)
    if _is_h5(path):
        with _open_h5(path) as fh:
            ds = _h5_features(fh, path)
            try:
                features = torch.from_numpy(ds[()])
                coords = fh.get(COORDS_KEY)
                coords = torch.from_numpy(coords[()]) if isinstance(coords, h5py.Dataset) else None
            except (OSError, TypeError) as err:
                raise BagReadError(f"{path}: cannot read data ({err})") from err
        return features, coords
    return _load_pt(path, mmap=False), None


def feature_blocks(shape: tuple[int, int], itemsize: int, chunk_bytes: int) -> Iterator[tuple[slice, slice]]:
    """(rows, columns) slices covering an [N, D] array in blocks of at most ``chunk_bytes`` (at least one
    element): whole rows while a row fits, else one row at a time in column pieces."""
    n, d = shape
    per_block = max(1, chunk_bytes // max(1, itemsize))
    if d <= per_block:
        rows = per_block // max(1, d)
        for start in range(0, n, rows):
            yield slice(start, start + rows), slice(None)
        return
    for row in range(n):
        for start in range(0, d, per_block):
            yield slice(row, row + 1), slice(start, start + per_block)


def iter_feature_chunks(path: str | Path, chunk_bytes: int = 64 << 20) -> Iterator[np.ndarray]:
    """The features of a bag in blocks of at most ``chunk_bytes`` (see :func:`feature_blocks`)."""
    path = Path(path)
    if _is_h5(path):
        with _open_h5(path) as fh:
            ds = _h5_features(fh, path)
            for rows, cols in feature_blocks(ds.shape, ds.dtype.itemsize, chunk_bytes):
                try:
                    yield ds[rows, cols]
                except OSError as err:
                    raise BagReadError(f"{path}: cannot read rows {rows.start}..{rows.stop} ({err})") from err
        return
    t = _load_pt(path, mmap=True)  # blocks are views of the mapped file; bfloat16 ones become float32 copies
    itemsize = 4 if t.dtype == torch.bfloat16 else t.element_size()
    for rows, cols in feature_blocks(tuple(t.shape), itemsize, chunk_bytes):
        block = t[rows, cols]
        yield (block.float() if block.dtype == torch.bfloat16 else block).numpy()
