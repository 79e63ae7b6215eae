"""Reading a worker's bags: ``dataset.get(index, epoch)``, the next step's bags read ahead in a thread."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor


class BagReader:
    """``dataset.get(index, epoch)``, with the next step's bags read in a background thread."""

    def __init__(self, dataset) -> None:
        self.dataset = dataset
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="dpgs-read-ahead")
        self._ahead: dict[tuple[int, int], Future] = {}

    def take(self, index: int, epoch: int):
        ahead = self._ahead.pop((epoch, index), None)
        return ahead.result() if ahead is not None else self.dataset.get(index, epoch)

    def read_ahead(self, indices: list[int], epoch: int) -> None:
        """Start reading ``indices`` of ``epoch``; bags read ahead for other steps are dropped."""
        wanted = {(epoch, i) for i in indices}
        for key in [k for k in self._ahead if k not in wanted]:
            self._ahead.pop(key).cancel()
        for key in wanted - self._ahead.keys():
            self._ahead[key] = self._pool.submit(self.dataset.get, key[1], key[0])
