"""Background loading of batches so that reading bags overlaps with compute.

``Prefetcher(dataset, batches, depth, epoch)`` iterates over ``batches`` (lists of dataset indices) and
yields ``[dataset.get(i, epoch) for i in batch]`` (any :class:`~dpgs.data.dataset.BagSource`). A daemon
thread loads up to ``depth`` batches ahead into a bounded queue; ``depth = 0`` loads synchronously in the
caller's thread. An exception raised while loading is re-raised in the consumer at the position of the
failing batch. Leaving the loop early (``break``, an
exception, garbage collection of the iterator) or calling :meth:`close` stops and joins the thread.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

_DONE = object()
_POLL_SECONDS = 0.05


class _Failure:
    def __init__(self, error: BaseException):
        self.error = error


class Prefetcher:
    """Iterable over loaded batches; single use."""

    def __init__(self, dataset: Any, batches: Iterable[Sequence[int]], depth: int = 2, epoch: int = 0):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.dataset = dataset
        self.batches = batches
        self.depth = depth
        self.epoch = epoch
        self._queue: queue.Queue = queue.Queue(maxsize=max(depth, 1))
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._used = False

    def _load(self, batch: Sequence[int]) -> list:
        return [self.dataset.get(i, self.epoch) for i in batch]

    def _offer(self, item: Any) -> bool:
        """Put ``item`` unless asked to stop; returns False when stopped."""
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=_POLL_SECONDS)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            for batch in self.batches:
                if self._stop.is_set() or not self._offer(self._load(batch)):
                    return
            self._offer(_DONE)
        except BaseException as err:  # handed to the consumer, which re-raises it
            self._offer(_Failure(err))

    def __iter__(self) -> Iterator[list]:
        if self._used:
            raise RuntimeError("a Prefetcher can be iterated only once")
        self._used = True
        if self.depth == 0:
            for batch in self.batches:
                yield self._load(batch)
            return
        self._thread = threading.Thread(target=self._produce, name="dpgs-prefetch", daemon=True)
        self._thread.start()
        try:
            while True:
                item = self._queue.get()
                if item is _DONE:
                    return
                if isinstance(item, _Failure):
                    raise item.error
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Stop the loader thread and drop batches loaded ahead."""
        self._stop.set()
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                break
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join()
            self._thread = None

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
