"""Lazily loaded feature bags with a bounded in-memory cache.

``BagDataset(records)[i]`` returns a :class:`Bag` whose ``features`` are float32 [N, D]. Bags are read
on first access and kept in a byte-bounded LRU cache at their stored dtype (float16 files take half
the memory; conversion to float32 happens on access). The returned tensors may share memory with the
cache: treat them as read-only. Bag lengths and the feature dim come from file metadata
(:func:`dpgs.data.readers.bag_info`, or the infos returned by validation) without loading features.

The dataset pickles without its cache and lock, so it can be shipped to worker processes.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from dpgs.data.cache import ByteLRUCache
from dpgs.data.manifest import SlideRecord
from dpgs.data.readers import BagInfo, bag_info, read_bag

DEFAULT_CACHE_BYTES = 2 << 30


@dataclass
class Bag:
    slide_id: str
    features: torch.Tensor  # float32 [N, D]
    label: int
    coords: torch.Tensor | None = None  # [N, 2]


class BagSource(Protocol):
    """What training and evaluation read bags from (``BagDataset``, ``dpgs.wsi.tiles.TileBagDataset``)."""

    records: Sequence[Any]  # per bag: ``slide_id``, ``label``

    def get(self, index: int, epoch: int) -> Any:
        """Bag ``index`` (``slide_id``, ``features``, ``label``) as epoch ``epoch`` reads it."""

    def lengths(self) -> list[int]:
        """Instances ``get`` returns per bag (DPGS balances workers on it), from metadata only."""


class BagDataset:
    """Random access to the bags of ``records`` (a list of :class:`SlideRecord`)."""

    def __init__(
        self,
        records: Sequence[SlideRecord],
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        infos: dict[str, BagInfo] | None = None,
    ):
        self.records = list(records)
        self.cache_bytes = int(cache_bytes)
        self._infos: dict[str, BagInfo] = dict(infos or {})
        self._init_runtime()

    def _init_runtime(self) -> None:
        self.cache = ByteLRUCache(self.cache_bytes)
        self._info_lock = threading.Lock()

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        del state["cache"], state["_info_lock"]
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._init_runtime()

    def __len__(self) -> int:
        return len(self.records)

    def info(self, index: int) -> BagInfo:
        """Metadata of bag ``index`` (read once from the file, then remembered)."""
        record = self.records[index]
        with self._info_lock:
            known = self._infos.get(record.slide_id)
        if known is None:
            known = bag_info(record.path)
            with self._info_lock:
                self._infos[record.slide_id] = known
        return known

    def lengths(self) -> list[int]:
        """Instance count of every bag, from metadata."""
        return [self.info(i).length for i in range(len(self))]

    @property
    def feature_dim(self) -> int:
        if not self.records:
            raise ValueError("an empty dataset has no feature dim")
        return self.info(0).dim

    def _load(self, record: SlideRecord) -> tuple[torch.Tensor, torch.Tensor | None]:
        cached = self.cache.get(record.slide_id)
        if cached is not None:
            return cached
        features, coords = read_bag(record.path)
        nbytes = features.nbytes + (coords.nbytes if coords is not None else 0)
        self.cache.put(record.slide_id, (features, coords), nbytes)
        return features, coords

    def get(self, index: int, epoch: int) -> Bag:
        """Bag ``index``; feature bags are the same in every epoch (the tile-bag dataset's interface)."""
        return self[index]

    def __getitem__(self, index: int) -> Bag:
        record = self.records[index]
        features, coords = self._load(record)
        return Bag(record.slide_id, features.float(), record.label, coords)
